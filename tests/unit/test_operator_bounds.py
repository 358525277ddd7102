"""The operator-bounds policy without a cluster: the chart ships the same objects as
config/operator-bounds, matches the operator's own ServiceAccount in every install mode and every
kind it writes that becomes pods, admits the agent image the chart gives the operator, and what the
builders render for every sample meets each rule the policy states (mirrored here in Python, each
mirror shown to refuse the object kvpersist never renders). The CEL itself runs on the real API
server in tests/e2e/test_operator_bounds.py, over the same refused objects."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.all import build_all
from kvpersist.builders.lmcache import AGENT_CONTAINER, DEFAULT_AGENT_IMAGE
from kvpersist.builders.target import MANAGED_BY, SERVER, VLLM, Target
from kvpersist.controller.policy import image_allowed
from kvpersist.identity import key_fingerprint, resolve
from tests import rbac_needs as rb
from tests.cases.invalid_manifests import sample

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config/operator-bounds/operator-bounds.yaml"
TEMPLATE = "templates/operator-bounds.yaml"
SAMPLES = ("nvme-minimal", "hf-bucket", "tp2-fp8")
# What the samples run (one image in both fields): the prefix an admin would allow for them.
SAMPLE_PREFIXES = ("registry.example.com/kvpersist/vllm-lmcache",)
COMPONENT = {"StatefulSet": SERVER, "Deployment": VLLM}
OWNER_UID = "5f0c3f0e-0000-4000-8000-000000000001"


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def render(helm: Path, *sets: str, release: str = "kvpersist", namespace: str = "kvpersist-system",
           show_only: str | None = TEMPLATE) -> list[dict[str, Any]]:
    args = [str(helm), "template", release, str(rb.CHART), "--namespace", namespace]
    args += [a for s in sets for a in ("--set", s)]
    if show_only:
        args += ["--show-only", show_only]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"helm template: {out.stderr}")
    return _docs(out.stdout)


def variable(policy: dict[str, Any], name: str) -> str:
    return next(v["expression"] for v in policy["spec"]["variables"] if v["name"] == name)


def policy_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [policy] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"].endswith("-operator-bounds")]
    return policy


def bounds(policy: dict[str, Any]) -> tuple[str, tuple[str, ...], str]:
    """(the ServiceAccount matched, the allowed prefixes, the agent's repository) as the policy's
    CEL literals say them."""
    [cond] = policy["spec"]["matchConditions"]
    head = "request.userInfo.username == '"
    assert cond["expression"].startswith(head) and cond["expression"].endswith("'"), cond
    repo = variable(policy, "agentRepository")
    assert repo.startswith("'") and repo.endswith("'"), repo
    return cond["expression"][len(head):-1], tuple(json.loads(variable(policy, "allowedImages"))), repo[1:-1]


def test_chart_ships_the_same_operator_bounds_as_config(helm: Path) -> None:
    """Rendered for release kvpersist in kvpersist-system with the default values, the chart's
    objects equal config/'s apart from the chart's labels; on by default, gone when off."""
    rendered = render(helm)
    for doc in rendered:
        assert doc["metadata"].pop("labels")["app.kubernetes.io/instance"] == "kvpersist"
    plain = _docs(CONFIG.read_text())
    assert rendered == plain
    assert [d["kind"] for d in plain] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    assert plain[1]["spec"] == {"policyName": "kvpersist-operator-bounds", "validationActions": ["Deny"]}
    assert plain[0]["spec"]["failurePolicy"] == "Fail"
    # config/ says which line names the account: exactly one, the chart's default install's.
    assert CONFIG.read_text().count("system:serviceaccount:") == 2  # the comment that explains it, and the line
    assert bounds(plain[0]) == ("system:serviceaccount:kvpersist-system:kvpersist", (), "ghcr.io/kvpersist/kvpersist-operator")
    off = render(helm, "operatorBounds.enabled=false", show_only=None)
    assert not [d for d in off if d["kind"].startswith("ValidatingAdmissionPolicy") and "operator-bounds" in d["metadata"]["name"]]


@pytest.mark.parametrize("sets,account", [
    ((), "system:serviceaccount:kvpersist-system:kvpersist"),
    (("watchNamespaces={ml,team-b}",), "system:serviceaccount:kvpersist-system:kvpersist"),
    (("serviceAccount.create=false", "serviceAccount.name=platform-operator"),
     "system:serviceaccount:kvpersist-system:platform-operator"),
], ids=["clusterwide", "namespaced", "own-service-account"])
def test_the_chart_matches_the_account_its_operator_runs_as(helm: Path, sets: tuple[str, ...], account: str) -> None:
    """Whichever mode, the policy's account is the one the chart's operator Deployment runs as
    and its RBAC binds: a policy naming another account would bound nobody."""
    docs = render(helm, *sets, show_only=None)
    policy = policy_of(docs)
    [deployment] = [d for d in docs if d["kind"] == "Deployment"]
    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert bounds(policy)[0] == account == f"system:serviceaccount:kvpersist-system:{sa}"
    subjects = [s for d in docs if d["kind"] in ("ClusterRoleBinding", "RoleBinding") and d["metadata"]["name"].startswith("kvpersist")
                and "gc" not in d["metadata"]["name"] for s in d.get("subjects", [])]
    assert subjects and all((s["kind"], s["namespace"], s["name"]) == ("ServiceAccount", "kvpersist-system", sa) for s in subjects)


def test_every_kind_the_operator_writes_that_becomes_pods_is_matched(helm: Path) -> None:
    """Every manifest with a pod template that build_all renders, in each shape, is of a kind the
    policy matches; and the chart lets the operator create no pod directly (pods: list and watch
    only), in either mode, so there is no third way to a pod."""
    [policy, _] = _docs(CONFIG.read_text())
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule == {"apiGroups": ["apps"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
                    "resources": ["statefulsets", "deployments"]}
    kinds = {m["kind"] for t in variants() for m in build_all(t, "kvpersist-system") if "template" in (m.get("spec") or {})}
    assert kinds == {"StatefulSet", "Deployment"}
    for mode in rb.MODES:
        for doc in rb.render(helm, mode):
            for r in doc.get("rules", []) if doc["kind"] in ("ClusterRole", "Role") else []:
                writes = set(r["verbs"]) & {"create", "patch", "update"}
                if writes and "" in r["apiGroups"]:
                    assert not {"pods", "pods/ephemeralcontainers", "replicationcontrollers"} & set(r["resources"]), (mode, r)
                if writes and "apps" in r["apiGroups"]:
                    assert set(r["resources"]) <= {"statefulsets", "deployments"}, (mode, r)
                if writes and "batch" in r["apiGroups"]:
                    raise AssertionError(f"{mode}: the operator may write Jobs, which the policy does not match: {r}")


def test_the_agent_image_the_chart_gives_the_operator_is_admitted(helm: Path) -> None:
    """The inventory agent runs from the operator's own image (KVPERSIST_AGENT_IMAGE), by tag or by
    digest, whatever allowedImages says; the operator's built-in default is under the same repository."""
    digest = "sha256:" + "ab" * 32
    for sets in ((), (f"image.digest={digest}",), ("image.repository=registry.example.com/mirror/kvpersist",)):
        docs = render(helm, "allowedImages={registry.example.com/lmcache/}", *sets, show_only=None)
        policy = policy_of(docs)
        [deployment] = [d for d in docs if d["kind"] == "Deployment"]
        env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        _, prefixes, repo = bounds(policy)
        assert prefixes == ("registry.example.com/lmcache/",)
        assert env["KVPERSIST_ALLOWED_IMAGES"] == ",".join(prefixes)
        assert agent_image_admitted(env["KVPERSIST_AGENT_IMAGE"], repo), (sets, env["KVPERSIST_AGENT_IMAGE"], repo)
    assert agent_image_admitted(DEFAULT_AGENT_IMAGE, bounds(_docs(CONFIG.read_text())[0])[2])


# ---- the policy's rules, in Python: what the builders render must meet each of them.
def agent_image_admitted(image: str, repo: str) -> bool:
    return image.startswith((repo + ":", repo + "@"))


def violations(obj: dict[str, Any], prefixes: tuple[str, ...], repo: str, old: dict[str, Any] | None = None) -> list[str]:
    """The rules of config/operator-bounds, one name for each the object breaks (its validations'
    order). The API server's own evaluation of the CEL is tests/e2e/test_operator_bounds.py."""
    out = []
    meta, tmpl = obj["metadata"], obj["spec"]["template"]
    labels, pod_labels = meta.get("labels") or {}, (tmpl.get("metadata") or {}).get("labels") or {}
    wanted = {"app.kubernetes.io/managed-by": MANAGED_BY, "app.kubernetes.io/name": "kvpersist",
              "app.kubernetes.io/component": COMPONENT[obj["kind"]]}
    instance = "app.kubernetes.io/instance"
    if any(labels.get(k) != v or pod_labels.get(k) != v for k, v in wanted.items()) or not labels.get(instance) \
            or labels.get(instance) != pod_labels.get(instance):
        out.append("labels")

    def owners(m: dict[str, Any]) -> list[dict[str, Any]]:
        return [r for r in m.get("ownerReferences") or [] if r.get("controller") and r["kind"] == "KVCacheNamespace"
                and r["apiVersion"].startswith("kvpersist.dev/")]

    mine = owners(meta)
    if len(mine) != 1 or mine[0]["name"] != labels.get(instance) or (
            old is not None and [r["uid"] for r in owners(old["metadata"])] != [mine[0]["uid"]]):
        out.append("owner")
    pod = tmpl["spec"]
    containers = pod["containers"] + pod.get("initContainers", [])
    volumes = pod.get("volumes", [])
    if any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")):
        out.append("hostNamespaces")
    if any("hostPath" in v for v in volumes):
        out.append("hostPath")
    if any((c.get("securityContext") or {}).get("privileged") for c in containers):
        out.append("privileged")
    if any(((c.get("securityContext") or {}).get("capabilities") or {}).get("add") for c in containers):
        out.append("capabilities")
    if any(p.get("hostPort") for c in containers for p in c.get("ports", [])):
        out.append("hostPort")
    if pod.get("automountServiceAccountToken") is not False or any(
            "serviceAccountToken" in s for v in volumes for s in (v.get("projected") or {}).get("sources", [])):
        out.append("token")
    if any(not (image_allowed(c["image"], prefixes) or (
            c["name"] == AGENT_CONTAINER and obj["kind"] == "StatefulSet" and agent_image_admitted(c["image"], repo)))
            for c in containers):
        out.append("image")
    return out


def variants() -> list[Target]:
    """Every sample, and each other shape of pod: the cache off, a user's claim, a shared claim,
    unencrypted, a model cache, vLLM's Service, kv events."""
    def t(name: str = "nvme-minimal", mutate: Callable[[dict], None] | None = None) -> Target:
        obj = sample(name)
        if mutate:
            mutate(obj)
        spec = KVCacheNamespace.model_validate(obj).spec
        fp = key_fingerprint(b"k" * 32)
        return Target(obj["metadata"]["name"], "ml", spec, resolve(spec.pins(fp)).namespace_id,
                      key_fingerprint=fp if spec.l2.encryption.enabled else None)

    return [*(t(s) for s in SAMPLES),
            t(mutate=lambda o: o["spec"]["identity"].pop("chatTemplateDigest")),
            t(mutate=lambda o: o["spec"]["l2"].update(nvme={"existingClaimName": "mine", "maxCapacity": "100Gi"})),
            t(mutate=lambda o: o["spec"]["l2"]["nvme"].update(shared=True, adapter="nixl_store_dynamic")),
            t(mutate=lambda o: o["spec"]["l2"].update(encryption={"enabled": False})),
            t(mutate=lambda o: o["spec"]["vllm"].update(modelCache={"size": "50Gi"}, service={"enabled": True},
                                                        kvEvents={"enabled": True}, envFrom=[{"secretRef": {"name": "x"}}])),
            t("hf-bucket", lambda o: o["spec"].update(imagePullSecrets=[{"name": "regcred"}]))]


def workloads(t: Target, agent_image: str | None = None) -> list[dict[str, Any]]:
    """What the operator applies for t that becomes pods, with the owner reference it adds
    (kvpersist.controller.apply: kopf.append_owner_reference)."""
    if agent_image:
        t = dataclasses.replace(t, agent_image=agent_image)
    body = {"apiVersion": "kvpersist.dev/v1alpha1", "kind": "KVCacheNamespace",
            "metadata": {"name": t.name, "namespace": t.namespace, "uid": OWNER_UID}}
    out = [m for m in build_all(t, "kvpersist-system") if m["kind"] in ("StatefulSet", "Deployment")]
    for m in out:
        kopf.append_owner_reference(m, owner=body)
    return out


@pytest.mark.parametrize("t", variants(), ids=lambda t: f"{t.name}-{t.spec.l2.kind}-{bool(t.namespace_id)}")
def test_what_the_operator_renders_meets_every_rule(t: Target) -> None:
    """Created, and applied again over itself (an update keeps its controller), with the samples'
    image allowed and the agent from the operator's repository, by tag (the default) or by digest."""
    repo = "ghcr.io/kvpersist/kvpersist-operator"
    for agent in (None, f"{repo}@sha256:" + "cd" * 32):
        objs = workloads(t, agent)
        assert sorted(m["kind"] for m in objs) == ["Deployment", "StatefulSet"]
        for m in objs:
            assert violations(m, SAMPLE_PREFIXES, repo) == [], m["kind"]
            assert violations(m, SAMPLE_PREFIXES, repo, old=copy.deepcopy(m)) == [], m["kind"]
            assert violations(m, (), repo) == [], m["kind"]  # allowedImages empty: any image


def lmcache_sts(t: Target | None = None) -> dict[str, Any]:
    return next(m for m in workloads(t or variants()[0]) if m["kind"] == "StatefulSet")


def _pod(m: dict[str, Any]) -> dict[str, Any]:
    return m["spec"]["template"]["spec"]


def _server(m: dict[str, Any]) -> dict[str, Any]:
    return _pod(m)["containers"][0]


def _privileged(m: dict[str, Any]) -> None:
    sc = _server(m)["securityContext"]
    sc.pop("allowPrivilegeEscalation")  # the API server refuses privileged with it false, before any policy
    sc["privileged"] = True


# Each thing kvpersist never renders: (the rule the policy refuses it by, what the API server's
# refusal names, the change). tests/e2e/test_operator_bounds.py sends each as the operator's account.
REFUSED: dict[str, tuple[str, str, Callable[[dict[str, Any]], None]]] = {
    "privileged": ("privileged", "container lmcache-server sets securityContext.privileged", _privileged),
    "hostPath": ("hostPath", "hostPath volume node-root (/)",
                 lambda m: _pod(m)["volumes"].append({"name": "node-root", "hostPath": {"path": "/"}})),
    "hostNetwork": ("hostNamespaces", "spec.template.spec.hostNetwork is true", lambda m: _pod(m).update(hostNetwork=True)),
    "hostPID": ("hostNamespaces", "spec.template.spec.hostPID is true", lambda m: _pod(m).update(hostPID=True)),
    "hostIPC": ("hostNamespaces", "spec.template.spec.hostIPC is true", lambda m: _pod(m).update(hostIPC=True)),
    "capability": ("capabilities", "container lmcache-server adds SYS_ADMIN",
                   lambda m: _server(m)["securityContext"]["capabilities"].update(add=["SYS_ADMIN"])),
    "hostPort": ("hostPort", "container lmcache-server sets ports[].hostPort",
                 lambda m: _server(m)["ports"][0].update(hostPort=5555)),
    "token": ("token", "set spec.template.spec.automountServiceAccountToken false",
              lambda m: _pod(m).update(automountServiceAccountToken=True)),
    "projected-token": ("token", "drop the serviceAccountToken of volume api-token", lambda m: _pod(m)["volumes"].append(
        {"name": "api-token", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}})),
    "unlisted-image": ("image", "container lmcache-server (registry.example.com/kvpersist/vllm-lmcache-evil:v1) runs an image",
                       lambda m: _server(m).update(image="registry.example.com/kvpersist/vllm-lmcache-evil:v1")),
    "agent-elsewhere": ("image", "container inventory-agent (registry.example.com/other/agent:v1) runs an image",
                        lambda m: _pod(m)["containers"][1].update(image="registry.example.com/other/agent:v1")),
    "unlabelled": ("labels", "only with the labels app.kubernetes.io/managed-by=kvpersist",
                   lambda m: m["metadata"]["labels"].pop("app.kubernetes.io/managed-by")),
    "pod-unlabelled": ("labels", "only with the labels app.kubernetes.io/managed-by=kvpersist",
                       lambda m: m["spec"]["template"]["metadata"]["labels"].pop("app.kubernetes.io/managed-by")),
    "unowned": ("owner", "only when one KVCacheNamespace (kvpersist.dev), the one its label app.kubernetes.io/instance names",
                lambda m: m["metadata"].pop("ownerReferences")),
}


def refused(case: str) -> dict[str, Any]:
    obj = lmcache_sts()
    REFUSED[case][2](obj)
    return obj


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_each_rule_refuses_what_kvpersist_never_renders(case: str) -> None:
    """The mirror above can fail: each change breaks exactly its rule, and no other."""
    assert violations(refused(case), SAMPLE_PREFIXES, "ghcr.io/kvpersist/kvpersist-operator") == [REFUSED[case][0]]


def test_an_update_of_a_workload_it_did_not_make_is_refused() -> None:
    """The operator's applies over an object someone else made under a derived name (which the
    controller already refuses: NameTaken) are refused at the API server too."""
    obj = lmcache_sts()
    theirs = copy.deepcopy(obj)
    theirs["metadata"].pop("ownerReferences")
    assert violations(obj, SAMPLE_PREFIXES, "ghcr.io/kvpersist/kvpersist-operator", old=theirs) == ["owner"]
