"""Attach mode without a cluster (spec.vllm.mode Attached, docs/attach.md): what the operator writes for
the admission policies (status.attach) is what its own vLLM pods are launched with; no Deployment of
its own; the policy's ZMQ rule admits attached pods of the id only; status counts them; the committed
policies are the generated ones, and the chart ships the same. What the API server does with them
(the mutation, each refusal): tests/e2e/test_attach.py; with the real vLLM: tests/e2e/test_attach_vllm.py."""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from kvpersist.api import attachpolicy
from kvpersist.api.attachpolicy import LABEL as ATTACH_LABEL
from kvpersist.api.identity import id_fields
from kvpersist.api.spec import EXTRA_ARGS
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.all import build_all
from kvpersist.builders.lmcache import build_network_policy
from kvpersist.builders.target import NAMESPACE_ID_LABEL, SERVER, Target
from kvpersist.builders.vllm import (
    attach_status,
    attached_peer,
    build_vllm_deployment,
    kv_transfer_config_json,
    operator_env,
    vllm_args,
)
from kvpersist.identity import key_fingerprint, resolve
from kvpersist.status.conditions import Observation, compute_status
from kvpersist.status.workloads import attached_counts, attached_view
from tests.cases.invalid_manifests import sample

ROOT = Path(__file__).resolve().parents[2]
KEY_FINGERPRINT = key_fingerprint(b"k" * 32)


def _target(mode: str = "Attached", image: str | None = None, **vllm: Any) -> Target:
    obj = sample("nvme-minimal")
    obj["spec"]["vllm"].pop("hfTokenSecretRef", None)
    obj["spec"]["vllm"].update(mode=mode, **vllm)
    if image is not None:
        obj["spec"]["image"] = image
    spec = KVCacheNamespace.model_validate(obj).spec
    return Target(obj["metadata"]["name"], "ml", spec, resolve(spec.pins(KEY_FINGERPRINT)).namespace_id,
                  key_fingerprint=KEY_FINGERPRINT)


def _pairs(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in itertools.pairwise(args) if a.startswith("--")}


def test_status_attach_is_what_the_managed_pods_are_launched_with() -> None:
    """The pins, the connector and the fixed variables an attached pod must carry are those of the
    operator's own vLLM Deployment for the same spec: one source for both."""
    attached, managed = _target(), _target(mode="Managed")
    assert attached.namespace_id == managed.namespace_id  # the mode is no pin: the same cache
    st = attach_status(attached)
    assert st is not None and st["namespaceId"] == attached.namespace_id
    args = vllm_args(managed)
    assert args[:2] == ["serve", st["model"]]
    launched = _pairs(args)
    assert {p["flag"]: p["value"] for p in st["pins"]} == {f: v for f, v in launched.items() if f in
                                                          {p["flag"] for p in st["pins"]}}
    assert {p["flag"] for p in st["pins"]} >= {"--revision", "--tokenizer", "--tokenizer-revision", "--kv-cache-dtype",
                                               "--block-size", "--max-model-len"}
    assert st["args"] == ["--kv-transfer-config", kv_transfer_config_json(attached)] == \
        ["--kv-transfer-config", launched["--kv-transfer-config"]]
    assert [(e["name"], e["value"]) for e in st["env"]] == [(e["name"], e["value"]) for e in operator_env(managed)[:2]]
    assert st["serverSelector"] == attached.id_selector(SERVER)
    assert st["imageDigest"] == attached.spec.image.rsplit("@", 1)[1]
    assert {p["field"] for p in st["pins"]} <= {f.path for f in id_fields()}


def test_while_the_cache_is_off_for_vllm_status_attach_says_why() -> None:
    t = _target()
    assert "bypassed" not in (attach_status(t) or {})
    assert (attach_status(t, "the lmcache servers are unavailable") or {})["bypassed"] == "the lmcache servers are unavailable"


def test_nothing_to_attach_to_without_a_namespace_or_in_managed_mode() -> None:
    assert attach_status(_target(mode="Managed")) is None
    assert attach_status(_target(image="registry.example.com/vllm:latest")) is None  # no digest: no namespace id
    t = _target()
    assert attach_status(Target(t.name, t.namespace, t.spec, None)) is None
    assert attach_status(Target(t.name, t.namespace, t.spec, t.namespace_id, routes=False)) is None


def test_attached_mode_makes_no_vllm_deployment_and_admits_attached_pods_of_its_id_only() -> None:
    t = _target()
    kinds = [m["kind"] for m in build_all(t, "kvpersist-system")]
    assert "Deployment" not in kinds and "StatefulSet" in kinds
    assert build_vllm_deployment(_target(mode="Managed")) in build_all(_target(mode="Managed"), "kvpersist-system")
    peers = build_network_policy(t, None)["spec"]["ingress"][0]["from"]  # ZMQ, the only rule without the operator
    assert peers == [attached_peer(t)]  # no selector of managed vLLM pods: none exist, a look-alike would be a peer
    assert attached_peer(t)["podSelector"]["matchLabels"] == {ATTACH_LABEL: t.name, NAMESPACE_ID_LABEL: t.namespace_id}
    assert all(attached_peer(t) != p for p in build_network_policy(_target(mode="Managed"), None)["spec"]["ingress"][0]["from"])


def _pod(name: str, ready: bool, labels: dict[str, str], deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ml", "uid": name, "labels": labels,
                            "ownerReferences": [{"kind": "ReplicaSet", "uid": "u", "controller": True}]}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": "n", "containers": [{"name": "vllm"}]},
            "status": {"podIP": "127.16.0.9", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_an_attached_pod_is_viewed_as_the_resources_vllm_pod_whatever_its_own_labels() -> None:
    nid = _target().namespace_id
    own = {"app.kubernetes.io/instance": "their-app", "app.kubernetes.io/component": "server", ATTACH_LABEL: "llama31-8b",
           NAMESPACE_ID_LABEL: nid}
    view = attached_view(_pod("a", True, own))
    assert view["metadata"]["labels"] == {ATTACH_LABEL: "llama31-8b", "app.kubernetes.io/instance": "llama31-8b",
                                          "app.kubernetes.io/component": "vllm", NAMESPACE_ID_LABEL: nid}
    assert "ownerReferences" not in view["metadata"] and view["status"]["podIP"] == "127.16.0.9"
    pods = [attached_view(_pod("a", True, own)), attached_view(_pod("b", False, own)),
            attached_view(_pod("c", True, own, deleting=True)),
            attached_view(_pod("d", True, {**own, NAMESPACE_ID_LABEL: "kvp-" + "0" * 32}))]
    assert attached_counts(pods, nid) == (2, 1)


def test_status_of_an_attached_resource_counts_its_pods_and_none_holds_nothing_back() -> None:
    base = dict(generation=1, namespace_id="kvp-" + "1" * 32, identity_reason="", l2_kind="nvme", server_desired=0,
                vllm_desired=1)
    status, conds = compute_status(Observation(**base, attached=(0, 0, "x")))
    vllm = next(c for c in conds if c["type"] == "VLLMReady")
    assert (vllm["status"], vllm["reason"]) == ("Unknown", "NoAttachedPods") and "kvpersist.dev/attach=x" in vllm["message"]
    assert next(c for c in conds if c["type"] == "Ready")["status"] == "True" and status["replicas"] == "0/0"
    status, conds = compute_status(Observation(**base, attached=(3, 2, "x")))
    vllm = next(c for c in conds if c["type"] == "VLLMReady")
    assert (vllm["status"], vllm["reason"], status["replicas"]) == ("True", "AttachedPodsReady", "2/3")
    status, conds = compute_status(Observation(**base, attached=(1, 1, "x"), unadmitted=["their-vllm-0"]))
    vllm = next(c for c in conds if c["type"] == "VLLMReady")
    assert (vllm["status"], vllm["reason"]) == ("False", "AttachPoliciesMissing")
    assert "their-vllm-0" in vllm["message"] and "attach.enabled" in vllm["message"] and status["phase"] != "Ready"
    status, conds = compute_status(Observation(**base, attached=(1, 0, "x")))
    assert next(c for c in conds if c["type"] == "VLLMReady")["status"] == "False"
    assert status["phase"] != "Ready"


# ---- the committed policies


def test_committed_files_are_generated() -> None:
    assert (ROOT / attachpolicy.CONFIG_PATH).read_text() == attachpolicy.render_config(), \
        "stale: run `kvpersist-operator attach-policy --write`"
    assert (ROOT / attachpolicy.TEMPLATE_PATH).read_text() == attachpolicy.render_template(), \
        "stale: run `kvpersist-operator attach-policy --write`"


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_chart_ships_the_same_objects_where_the_api_server_serves_them() -> None:
    template = (ROOT / attachpolicy.TEMPLATE_PATH).read_text()
    assert "{{- if and .Values.attach.enabled (.Capabilities.APIVersions.Has " in template
    assert yaml.safe_load((ROOT / "charts/kvpersist/values.yaml").read_text())["attach"] == {"enabled": True}
    rendered = template.replace(attachpolicy.NAMESPACE_SCOPE, "")  # empty without watchNamespaces
    rendered = re.sub(r"\{\{-? (if|end)[^\n]*\}\}\n?", "", rendered)
    rendered = re.sub(r"\n *labels: \{\{-[^}]*\}\}", "", rendered)
    rendered = rendered.replace('{{ include "kvpersist.fullname" . }}', "kvpersist")
    assert "{{" not in rendered
    assert _docs(rendered) == _docs((ROOT / attachpolicy.CONFIG_PATH).read_text())


def test_the_policies_judge_labelled_pods_by_their_resource_and_add_only_what_is_absent() -> None:
    mutating, validating, mbinding, vbinding = _docs(attachpolicy.render_config())
    assert [d["kind"] for d in (mutating, validating, mbinding, vbinding)] == [
        "MutatingAdmissionPolicy", "ValidatingAdmissionPolicy", "MutatingAdmissionPolicyBinding",
        "ValidatingAdmissionPolicyBinding"]
    for policy in (mutating, validating):
        assert policy["spec"]["paramKind"] == {"apiVersion": "kvpersist.dev/v1alpha1", "kind": "KVCacheNamespace"}
        assert policy["spec"]["failurePolicy"] == "Fail"  # an error refuses: never a pod attached unchecked
    for binding in (mbinding, vbinding):
        # Params from the pod's own namespace only: a resource never reaches another namespace's pods.
        assert binding["spec"]["paramRef"] == {"selector": {}, "parameterNotFoundAction": "Deny"}
        assert "namespace" not in binding["spec"]["paramRef"]
        assert binding["spec"]["matchResources"]["objectSelector"] == {
            "matchExpressions": [{"key": ATTACH_LABEL, "operator": "Exists"}]}
    assert vbinding["spec"]["validationActions"] == ["Deny"]
    assert mutating["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE"]
    patch = mutating["spec"]["mutations"][0]["jsonPatch"]["expression"]
    assert "op: 'replace'" not in patch and "op: 'remove'" not in patch  # adds only
    variables = {v["name"]: v["expression"] for v in validating["spec"]["variables"]}
    # The extraArgs allow-list, the same table, every flag of it.
    assert all(flag in variables["refusedFlags"] for flag in EXTRA_ARGS)


MAP_SERVED = "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"


def _template(helm: Path, *flags: str) -> list[dict[str, Any]]:
    out = subprocess.run([str(helm), "template", "kvpersist", str(ROOT / "charts/kvpersist"), "--namespace",
                          "kvpersist-system", *flags], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    order = ["MutatingAdmissionPolicy", "ValidatingAdmissionPolicy", "MutatingAdmissionPolicyBinding",
             "ValidatingAdmissionPolicyBinding"]  # helm sorts by kind
    return sorted((d for d in yaml.safe_load_all(out.stdout) if d and d["metadata"]["name"] == "kvpersist-attach"),
                  key=lambda d: order.index(d["kind"]))


def test_helm_renders_them_only_where_served_and_scoped_to_the_watched_namespaces(helm: Path) -> None:
    served = _template(helm, "--api-versions", MAP_SERVED)
    assert [d["kind"] for d in served] == ["MutatingAdmissionPolicy", "ValidatingAdmissionPolicy",
                                           "MutatingAdmissionPolicyBinding", "ValidatingAdmissionPolicyBinding"]
    assert [d["spec"] for d in served] == [d["spec"] for d in _docs(attachpolicy.render_config())]
    assert _template(helm) == []  # a cluster before 1.36: nothing the API server would refuse
    assert _template(helm, "--api-versions", MAP_SERVED, "--set", "attach.enabled=false") == []
    scoped = _template(helm, "--api-versions", MAP_SERVED, "--set", "watchNamespaces={ml,team}")
    for binding in scoped[2:]:
        assert binding["spec"]["matchResources"]["namespaceSelector"] == {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["ml", "team"]}]}
        assert binding["spec"]["matchResources"]["objectSelector"]["matchExpressions"][0]["key"] == ATTACH_LABEL
