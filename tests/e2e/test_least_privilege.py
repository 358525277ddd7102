"""Creating a KVCacheNamespace is less power than the operator's own, on the real API server: an
image outside the allowed prefixes (chart value allowedImages) and a named Secret without the
required label (secretLabel) get nothing applied and say why; with watchNamespaces the chart grants
the operator nothing outside those namespaces (Secrets included) and nothing cluster-wide, and that
is enough for it to reconcile there."""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import rbac_needs
from tests.cases.invalid_manifests import sample, upstream_images
from tests.e2e.audit import events as audit_events
from tests.e2e.kube import REPO, Kubectl, bin_dir, wait_for
from tests.e2e.operator_env import free_port, more_rounds, operator_metrics, start_operator, stop
from tests.e2e.test_exclusive_stores import cond, kvns, replicas, resource
from tests.e2e.test_helm import CHART, helm, rbac_decisions
from tests.integration.hub_stub import HubStub

pytestmark = pytest.mark.e2e
LABEL = "kvpersist.dev/usable-by=kvpersist"
EVIL_DIGEST = "@sha256:" + "e" * 64


@pytest.fixture()
def start(kubectl: Kubectl, crd: None, namespace: str, tmp_path: Path) -> Iterator[Callable[[dict[str, str]],
                                                                                    tuple[subprocess.Popen, Path]]]:
    """Starts `kvpersist run` on the test's namespace with the given environment (the chart's
    values); the process and its log."""
    procs: list[subprocess.Popen] = []

    def run(env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / "operator.log"
        procs.append(start_operator(kubectl.kubeconfig, namespace, log, env))
        return procs[-1], log

    yield run
    for proc in procs:
        stop(proc)


def _named(obj: dict[str, Any], name: str, namespace: str) -> dict[str, Any]:
    obj["metadata"]["name"] = name
    obj["metadata"]["namespace"] = namespace
    return obj


def _ready(kubectl: Kubectl, name: str, ns: str) -> dict[str, Any]:
    status = kubectl.get("kvns", name, ns).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})


def _exists(kubectl: Kubectl, kind: str, name: str, ns: str) -> bool:
    return kubectl.run("get", kind, name, "-n", ns, "-o", "name", check=False).returncode == 0


def _events(kubectl: Kubectl, ns: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in kubectl.get("events", namespace=ns)["items"] if e["reason"] == reason]


def _refused(kubectl: Kubectl, name: str, ns: str, reason: str, generation: int = 1) -> dict[str, Any]:
    return wait_for(f"{name}: Ready False {reason}", lambda: (lambda c: c if c.get("reason") == reason and c.get(
        "observedGeneration") == generation else None)(_ready(kubectl, name, ns)), timeout=60)


def _workloads(kubectl: Kubectl, name: str, ns: str) -> list[str]:
    return [f"{kind}/{n}" for kind, n in (("statefulset", f"{name}-lmcache"), ("deployment", f"{name}-vllm"),
                                          ("secret", f"{name}-agent-token"), ("secret", f"{name}-l2-key"))
            if _exists(kubectl, kind, n, ns)]


def test_image_outside_the_allowed_prefixes_is_refused(kubectl: Kubectl, namespace: str, start) -> None:
    """allowedImages docker.io/vllm/ and lmcache/vllm-openai: vLLM's upstream image reconciles;
    lmcache/vllm-openai-evil (the same characters, another repository) is refused with the field,
    the image, the prefixes and the fix named, a Warning event and no workload; an allowed resource
    edited to a refused image keeps its workloads exactly as they were."""
    operator, _log = start({"KVPERSIST_ALLOWED_IMAGES": "docker.io/vllm/, lmcache/vllm-openai"})
    ns = namespace
    kubectl.apply(_named(upstream_images(), "allowed", ns))
    evil = _named(upstream_images(), "refused", ns)
    evil["spec"]["image"] = "lmcache/vllm-openai-evil:v0.5.6" + EVIL_DIGEST
    kubectl.apply(evil)

    wait_for("the allowed resource's StatefulSet and Deployment", lambda: _exists(
        kubectl, "statefulset", "allowed-lmcache", ns) and _exists(kubectl, "deployment", "allowed-vllm", ns), timeout=60)
    cond = _refused(kubectl, "refused", ns, "ImageNotAllowed")
    assert cond["status"] == "False"
    for words in ("spec.image", evil["spec"]["image"], "docker.io/vllm/",
                  "lmcache/vllm-openai", "allowedImages"):
        assert words in cond["message"], (words, cond["message"])
    assert kubectl.get("kvns", "refused", ns)["status"]["phase"] == "Failed"
    event = wait_for("an ImageNotAllowed event", lambda: _events(kubectl, ns, "ImageNotAllowed"))[0]
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "refused"
    assert "spec.image" in event["message"]
    more_rounds(operator, ns, "refused", rounds=1)  # a status round after the reconcile that refused it (its applies first)
    assert _workloads(kubectl, "refused", ns) == []
    assert _ready(kubectl, "allowed", ns).get("reason") not in ("ImageNotAllowed", "SecretNotAllowed")

    # An allowed resource edited to a refused image: status says so, its workloads stay untouched.
    before = {kind: kubectl.get(kind, f"allowed-{suffix}", ns) for kind, suffix in (("statefulset", "lmcache"),
                                                                                     ("deployment", "vllm"))}
    edited = _named(upstream_images(), "allowed", ns)
    edited["spec"]["image"] = "registry.evil.example/vllm/vllm-openai" + EVIL_DIGEST
    kubectl.apply(edited)
    cond = _refused(kubectl, "allowed", ns, "ImageNotAllowed", generation=2)
    assert "spec.image" in cond["message"] and "registry.evil.example/vllm/vllm-openai" in cond["message"]
    more_rounds(operator, ns, "allowed", rounds=1)
    for kind, old in before.items():
        now = kubectl.get(kind, old["metadata"]["name"], ns)
        assert now["metadata"]["generation"] == old["metadata"]["generation"], kind
        assert now["spec"]["template"] == old["spec"]["template"], kind
    kubectl.apply(_named(upstream_images(), "allowed", ns))  # back to an allowed image: no longer refused
    wait_for("allowed again", lambda: (lambda c: c.get("observedGeneration") == 3 and c.get("reason") != "ImageNotAllowed")(
        _ready(kubectl, "allowed", ns)), timeout=60)


def test_a_named_secret_without_the_label_is_refused_until_labelled(kubectl: Kubectl, namespace: str, start,
                                                                     request: pytest.FixtureRequest) -> None:
    """secretLabel set: an L2 key Secret and a bucket token Secret without the label are refused
    (field, Secret and label named; a Warning event; nothing applied, the bucket never contacted),
    the operator's own Secrets carry the label, and labelling the key Secret brings the workloads."""
    ns = namespace
    key = base64.b64encode(secrets.token_bytes(32)).decode()
    token = "hf_" + secrets.token_hex(16)
    for name, item, value in (("shared-key", "master-key", key), ("hf-kv-writer", "token",
                                                                   base64.b64encode(token.encode()).decode())):
        kubectl.apply({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                       "metadata": {"name": name, "namespace": ns}, "data": {item: value}})
    hub = HubStub(existing={"acme-ml/kv-cache"}, token=token).__enter__()  # what a bucket preflight would reach
    request.addfinalizer(lambda: hub.__exit__(None, None, None))
    # The pin check (kvpersist.controller.pincheck) would read the models' files from the same
    # endpoint, anonymously; off here, so that every request the stub counts is the bucket's.
    operator, log = start({"KVPERSIST_SECRET_LABEL": LABEL, "HF_ENDPOINT": hub.url, "KVPERSIST_PIN_CHECK": "off"})
    keyed = _named(sample(), "keyed", ns)
    keyed["spec"]["l2"]["encryption"] = {"keySecretRef": {"name": "shared-key"}}
    kubectl.apply(keyed)
    kubectl.apply(_named(sample("hf-bucket"), "bucket", ns))
    kubectl.apply(_named(sample(), "plain", ns))

    for name, field, secret in (("keyed", "spec.l2.encryption.keySecretRef", "shared-key"),
                                ("bucket", "spec.l2.hfBucket.tokenSecretRef", "hf-kv-writer")):
        cond = _refused(kubectl, name, ns, "SecretNotAllowed")
        for words in (field, f"Secret {secret}", LABEL, "kubectl label secret"):
            assert words in cond["message"], (words, cond["message"])
        status = kubectl.get("kvns", name, ns)["status"]
        l2 = next(c for c in status["conditions"] if c["type"] == "L2Ready")
        assert status["phase"] == "Failed" and l2["reason"] == "SecretNotAllowed"
    events = wait_for("two SecretNotAllowed events", lambda: (lambda e: e if len(e) >= 2 else None)(
        _events(kubectl, ns, "SecretNotAllowed")))
    assert {e["involvedObject"]["name"] for e in events} == {"keyed", "bucket"}
    assert all(e["type"] == "Warning" for e in events)

    # The resource that names no Secret reconciles; the Secrets the operator made carry the label.
    wait_for("plain's workloads", lambda: _exists(kubectl, "statefulset", "plain-lmcache", ns), timeout=60)
    k, v = LABEL.split("=")
    for made in ("plain-l2-key", "plain-agent-token"):
        assert kubectl.get("secret", made, ns)["metadata"]["labels"].get(k) == v, made
    more_rounds(operator, ns, "keyed", "bucket", rounds=1)
    assert _workloads(kubectl, "keyed", ns) == [] and _workloads(kubectl, "bucket", ns) == []
    assert hub.requests == [] and token not in log.read_text()  # the refused token was never read nor sent

    # Whoever may read the Secret labels it: the resource is applied on the operator's next round.
    kubectl.run("label", "secret", "shared-key", "-n", ns, LABEL)
    sts = wait_for("keyed's StatefulSet after the label", lambda: _exists(kubectl, "statefulset", "keyed-lmcache", ns)
                   and kubectl.get("statefulset", "keyed-lmcache", ns), timeout=60)
    volumes = sts["spec"]["template"]["spec"]["volumes"]
    assert any((v.get("secret") or {}).get("secretName") == "shared-key" for v in volumes)
    wait_for("keyed no longer refused", lambda: _ready(kubectl, "keyed", ns).get("reason") != "SecretNotAllowed", timeout=60)
    assert _ready(kubectl, "bucket", ns).get("reason") == "SecretNotAllowed" and hub.requests == []
    # And the stub is what the operator reaches once the token's Secret is labelled: the check above can fail.
    kubectl.run("label", "secret", "hf-kv-writer", "-n", ns, LABEL)
    wait_for("the bucket preflight with the labelled token", lambda: token in hub.seen_tokens, timeout=60)


def test_watch_namespaces_grant_secrets_only_there(kubectl: Kubectl, crd: None, tmp_path: Path) -> None:
    """The chart with watchNamespaces: its ServiceAccount may get and create Secrets in those
    namespaces (a Role each) and nowhere else; no cluster-wide Secret verb. crd: can-i of a kind
    the API server does not serve says no."""
    suffix = uuid.uuid4().hex[:6]
    release, release_ns, watched, other = f"lp-{suffix}", f"lp-sys-{suffix}", f"lp-w-{suffix}", f"lp-o-{suffix}"
    rendered = subprocess.run([str(bin_dir() / "helm"), "template", release, str(REPO / "charts" / "kvpersist"),
                               "--namespace", release_ns, "--set", f"watchNamespaces={{{watched}}}"],
                              check=True, capture_output=True, text=True, timeout=120).stdout
    fullname = f"{release}-kvpersist"
    docs = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] in (
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding") and d["metadata"]["name"].startswith(
        fullname)]
    # No ClusterRole at all (test_watch_namespaces_grant_nothing_elsewhere: nothing else either).
    assert not [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == fullname]
    assert {(d["kind"], d["metadata"].get("namespace")) for d in docs if d["kind"] in ("Role", "RoleBinding")} == {
        ("Role", watched), ("RoleBinding", watched)}
    for ns in (release_ns, watched, other):
        kubectl.run("create", "namespace", ns)
    cluster_scoped = [(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"].startswith("Cluster")]
    try:
        kubectl.run("apply", "--server-side", "-f", "-", stdin="---\n".join(yaml.safe_dump(d) for d in docs))
        sa = f"system:serviceaccount:{release_ns}:{fullname}"

        def can(verb: str, *where: str) -> bool:
            out = kubectl.run("auth", "can-i", verb, "secrets", f"--as={sa}", *where, check=False)
            return out.stdout.strip() == "yes"

        wait_for("the Role to take effect", lambda: can("get", "-n", watched), timeout=30)
        assert can("create", "-n", watched)
        assert not can("get", "-n", other) and not can("create", "-n", other) and not can("get", "-n", release_ns)
        # list + watch there: the Secrets' metadata cache (kvpersist.controller.watchcache); never elsewhere.
        assert can("list", "-n", watched) and can("watch", "-n", watched)
        assert not can("get", "--all-namespaces") and not can("list", "--all-namespaces") and not can("list", "-n", other)
        # The rest of the Role is there too (the check is not vacuous), and there only.
        assert kubectl.can_i(sa, "watch", "kvcachenamespaces.kvpersist.dev", "-n", watched)
        assert not kubectl.can_i(sa, "watch", "kvcachenamespaces.kvpersist.dev", "-n", other)
    finally:
        for kind, name in cluster_scoped:
            kubectl.run("delete", kind.lower(), name, "--ignore-not-found", check=False)
        for ns in (release_ns, watched, other):
            kubectl.run("delete", "namespace", ns, "--wait=false", check=False)


# What the operator's ServiceAccount may hold cluster-wide with watchNamespaces, beyond what every
# ServiceAccount holds (measured below on a fresh one): nothing. kopf, given exact names, scans
# neither namespaces nor CRDs (controller/runtime.py configure) and peers on a KopfPeering in each
# watched namespace; the operator's own cross-resource LISTs go to each watched namespace by name
# (runtime.listing_scopes, once a SelfSubjectAccessReview, which every user may ask, says it may not
# list them cluster-wide). tests/rbac_needs.py derives the same from the code (checked below).
# The one cluster-wide right with watchNamespaces: list and watch of the creator-rights policy and
# its binding, by name (kvpersist.controller.admissioncheck says whether they exist).
CLUSTER_WIDE_WITH_WATCH_NAMESPACES: set[tuple[str, str]] = rbac_needs.can_i_pairs(
    {("admissionregistration.k8s.io", r, v) for r in ("validatingadmissionpolicies", "validatingadmissionpolicybindings")
     for v in ("list", "watch")})


def test_watch_namespaces_grant_nothing_elsewhere(kubectl: Kubectl, crd: None, tmp_path: Path, audit_log: Path) -> None:
    """`helm install --set watchNamespaces={a,b}`: the operator's ServiceAccount may do, outside a
    and b, nothing a fresh ServiceAccount may not (`kubectl auth can-i --list`): no Deployment in
    kube-system (which, with any ServiceAccount there, is cluster admin), no pod list anywhere. In a
    and b it holds exactly what its code needs, and that is enough: the operator, run as the chart
    runs it with only that account's token, reconciles both and sees across them (a bucket prefix
    held in a refuses its second user in b), with no request of it refused (the audit log)."""
    suffix = uuid.uuid4().hex[:6]
    release, release_ns = f"wn-{suffix}", f"wn-sys-{suffix}"
    a, b, outside = f"wn-a-{suffix}", f"wn-b-{suffix}", f"wn-o-{suffix}"
    fullname = f"{release}-kvpersist"
    sa = f"system:serviceaccount:{release_ns}:{fullname}"
    fresh = f"system:serviceaccount:{release_ns}:fresh"
    proc: subprocess.Popen | None = None
    log = tmp_path / "operator.log"
    for ns in (a, b, outside):
        kubectl.run("create", "namespace", ns)
    try:
        helm("install", release, str(CHART), "--namespace", release_ns, "--create-namespace", "--kubeconfig",
             str(kubectl.kubeconfig), "--set", f"watchNamespaces={{{a},{b}}}", "--set", "peering.name=kvpersist",
             "--set", "crds.enabled=false")  # the session's CRD
        kubectl.run("create", "serviceaccount", "fresh", "-n", release_ns)  # no binding: the defaults only
        wait_for("the Roles to take effect", lambda: kubectl.can_i(sa, "watch", "kvcachenamespaces.kvpersist.dev", "-n", a)
                 and kubectl.can_i(sa, "watch", "kvcachenamespaces.kvpersist.dev", "-n", b), timeout=30)
        need = rbac_needs.needs("namespaced")
        assert rbac_needs.can_i_pairs(rbac_needs.cluster_scoped(need)) == CLUSTER_WIDE_WITH_WATCH_NAMESPACES
        # What the operator asks of the defaults (a SelfSubjectAccessReview: may it list across namespaces?).
        assert rbac_needs.can_i_pairs(set(need.required) & rbac_needs.DEFAULT_GRANTS) <= kubectl.can_i_list(fresh, outside)
        for where in (outside, "kube-system", "default", release_ns):
            extra = kubectl.can_i_list(sa, where) - kubectl.can_i_list(fresh, where)
            assert extra <= CLUSTER_WIDE_WITH_WATCH_NAMESPACES, f"granted in {where}: {sorted(extra)}"
        for verb, what in (("create", "deployments.apps"), ("patch", "statefulsets.apps"), ("delete", "services"),
                           ("delete", "networkpolicies.networking.k8s.io"), ("list", "pods"), ("get", "secrets"),
                           ("patch", "persistentvolumeclaims"), ("patch", "kvcachenamespaces.kvpersist.dev")):
            assert not kubectl.can_i(sa, verb, what, "-n", "kube-system"), f"{verb} {what} in kube-system"
            assert not kubectl.can_i(sa, verb, what, "--all-namespaces"), f"{verb} {what} cluster-wide"
        needed = rbac_needs.can_i_pairs(set(need.required) - rbac_needs.DEFAULT_GRANTS)  # the fresh account has those
        optional = rbac_needs.can_i_pairs(set(need.optional))
        for ns in (a, b):
            got = kubectl.can_i_list(sa, ns) - kubectl.can_i_list(fresh, ns)
            assert needed <= got and not got - needed - optional, f"in {ns}: missing {needed - got}, extra {got - needed - optional}"
        assert kubectl.can_i(sa, "create", "deployments.apps", "-n", a)  # the check above can say yes

        # Enough: the operator as the chart's Deployment runs it (its args and env, the fieldRefs
        # resolved for its pod), with that account's token only (no container runtime here: a process).
        deployment = kubectl.get("deployment", fullname, release_ns)
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert {f"--namespace={a}", f"--namespace={b}"} <= set(container["args"])
        pod = wait_for("the chart's operator pod", lambda: next((p for p in kubectl.get("pods", namespace=release_ns)["items"]
                                                                  if p["metadata"]["name"].startswith(fullname)), None),
                       timeout=60)
        metrics_port = free_port()
        args = [f"--liveness=http://127.0.0.1:{free_port()}/healthz" if x.startswith("--liveness=")
                else f"--metrics-port={metrics_port}" if x.startswith("--metrics-port=") else x for x in container["args"]]
        env = {e["name"]: e["value"] if "value" in e else pod["metadata"][e["valueFrom"]["fieldRef"]["fieldPath"].split(".")[1]]
               for e in container.get("env", [])}
        own = kubectl.as_service_account(release_ns, fullname, tmp_path / "sa.kubeconfig", pod=pod).kubeconfig
        with log.open("ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "kvpersist.cli", *args, "--metrics-host=127.0.0.1"],
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **env, "KUBECONFIG": str(own), "PYTHONUNBUFFERED": "1"})
        proc.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"  # type: ignore[attr-defined]
        bucket = {"hfBucket": {"bucketHandle": f"hf://buckets/acme-ml/kv-cache/{suffix}", "tokenSecretRef": {"name": "hf"},
                               "maxCapacity": "1Gi"}}
        kubectl.apply(resource(a, "first", bucket))
        first = wait_for("first (in a) to serve", lambda: replicas(kubectl, a, "first") == 1
                         and (kvns(kubectl, a, "first").get("status") or {}).get("namespaceId"), timeout=120,
                         explain=lambda: log.read_text()[-3000:])
        time.sleep(1.1)  # creationTimestamp has whole seconds: the second is younger, not a tie
        kubectl.apply(resource(b, "second", bucket))  # the same pins, the same id, the same prefix, another namespace
        second = wait_for("second (in b) refused: a's resource holds the prefix", lambda: (o := kvns(kubectl, b, "second"))
                          and cond(o, "Ready").get("reason") == "StorageInUse" and o, timeout=120,
                          explain=lambda: log.read_text()[-3000:])
        assert f"{a}/first" in cond(second, "Ready")["message"] and first in cond(second, "Ready")["message"]
        # Not reconciled, shown by what the operator did after it: a resource in a watched namespace
        # applied after the one outside gets its status, and two more status rounds of the first
        # run, while the one outside has none and the API server saw no request of the operator's
        # in its namespace (a sleep would only show that nothing happened yet).
        kubectl.apply(resource(outside, "third", bucket))
        kubectl.apply(resource(a, "fourth", bucket))
        wait_for("fourth (in a, applied after third) to get a status", lambda: (kvns(kubectl, a, "fourth").get("status")
                                                                              or {}).get("conditions"), timeout=120,
                 explain=lambda: log.read_text()[-3000:])
        more_rounds(proc, a, "first")
        assert not (kvns(kubectl, outside, "third").get("status") or {}), "a namespace outside watchNamespaces was reconciled"
        touched = [e["verb"] for e in audit_events(audit_log, sa) if (e.get("objectRef") or {}).get("namespace") == outside]
        assert touched == [], f"the operator made requests in {outside}, which it does not watch: {touched}"
        assert proc.poll() is None, log.read_text()[-3000:]
        refused, allowed = rbac_decisions(audit_log, sa)
        assert allowed > 0, f"no request of {sa} in the audit log: the check would be vacuous"
        assert refused == [], refused[:10]
        text = log.read_text()
        assert "Not enough permissions" not in text and "Traceback" not in text, text[-3000:]
    finally:
        if proc is not None:
            stop(proc)
        helm("uninstall", release, "--namespace", release_ns, "--kubeconfig", str(kubectl.kubeconfig), check=False)
        for ns in (a, b, outside, release_ns):
            kubectl.run("delete", "namespace", ns, "--wait=false", check=False)


def test_a_missing_creator_rights_policy_is_said_everywhere(kubectl: Kubectl, namespace: str, start) -> None:
    """Issue 42 item 9: without the creator-rights policy (chart value off, a kubectl install that
    skipped it) or its Deny binding, any creator of a KVCacheNamespace gets its pods, and before
    nothing said so. Now: CreatorRightsEnforced False on each resource (Ready untouched), the gauge
    kvpersist_creator_rights_enforced 0, and a Warning Event on the operator's pod; the policy
    applied, all three follow; its binding deleted, they say so again. A policy name of this test's
    own (KVPERSIST_CREATOR_RIGHTS_POLICY), so no other module's policy answers for it."""
    name = f"kvp-cr-{uuid.uuid4().hex[:6]}"
    pod = "kvpersist-operator-test"
    proc, log = start({"KVPERSIST_CREATOR_RIGHTS_POLICY": name, "POD_ID": pod, "KVPERSIST_OPERATOR_NAMESPACE": namespace})
    obj = _named(sample(), "guarded", namespace)
    kubectl.apply(obj)

    def condition() -> dict[str, Any]:
        status = kubectl.get("kvns", "guarded", namespace).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == "CreatorRightsEnforced"), {})

    def gauge() -> float | None:
        return operator_metrics(proc).get("kvpersist_creator_rights_enforced")

    missing = wait_for("CreatorRightsEnforced False", lambda: condition().get("reason") == "PolicyMissing" and condition(),
                       timeout=90, explain=lambda: log.read_text()[-3000:])
    assert missing["status"] == "False" and f"ValidatingAdmissionPolicy {name} does not exist" in missing["message"]
    assert "config/creator-rights/creator-rights.yaml" in missing["message"]
    assert gauge() == 0
    [event] = wait_for("the Warning Event on the operator's pod", lambda: _events(kubectl, namespace, "PolicyMissing"), timeout=30)
    assert (event["type"], event["involvedObject"]["kind"], event["involvedObject"]["name"]) == ("Warning", "Pod", pod)
    docs = list(yaml.safe_load_all((REPO / "config" / "creator-rights" / "creator-rights.yaml").read_text()))
    for doc in docs:
        doc["metadata"]["name"] = name
    docs[1]["spec"]["policyName"] = name
    try:
        for doc in docs:
            kubectl.apply(doc)
        wait_for("CreatorRightsEnforced True", lambda: condition().get("reason") == "PolicyBound", timeout=60,
                 explain=lambda: str(condition()))
        assert condition()["status"] == "True" and gauge() == 1
        wait_for("the Normal Event", lambda: _events(kubectl, namespace, "PolicyBound"), timeout=30)
        kubectl.run("delete", "validatingadmissionpolicybinding", name)
        unbound = wait_for("CreatorRightsEnforced False, unbound", lambda: condition().get("reason") == "PolicyNotBound"
                           and condition(), timeout=60)
        assert f"ValidatingAdmissionPolicyBinding {name} does not exist" in unbound["message"] and gauge() == 0
        assert _ready(kubectl, "guarded", namespace).get("reason") != "PolicyNotBound"  # informational: Ready is not it
    finally:
        kubectl.run("delete", "validatingadmissionpolicybinding", name, "--ignore-not-found", check=False)
        kubectl.run("delete", "validatingadmissionpolicy", name, "--ignore-not-found", check=False)
