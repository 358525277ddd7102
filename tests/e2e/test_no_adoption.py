"""No adoption (issue 29, item 4), on the real API server: an object the operator did not make under
one of a KVCacheNamespace's derived names is never taken over, nor trusted.

Server-side apply with forced conflicts would rewrite a user's `<name>-vllm` Service and
give it an owner reference (garbage-collected with the resource), and a planted
`<name>-agent-token` would be handed to the agents as the operator's credential: instead nothing at
all is applied, Ready says NameTaken naming the object and the fix, with a Warning event, and the
object stays byte for byte as its owner wrote it. Once it is deleted the operator applies its own
and goes on (looked at again within ownership.RETRY_S), and a restarted operator still knows its
own objects. A planted `<name>-l2-key` without the operator's labels is never used: the cache
stays off (KeySecretNotOwned), its bytes name no namespace and show nowhere, nothing is patched
onto it; deleted, the operator generates a key of its own.
"""

from __future__ import annotations

import base64
import json
import secrets
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpersist.identity import key_fingerprint
from tests.cases.invalid_manifests import sample
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import more_rounds, start_operator, stop

pytestmark = pytest.mark.e2e
NAME = "adopt"
RETRY_S = 30  # kvpersist.controller.ownership.RETRY_S (not imported: this file also runs against main, to fail there)


@pytest.fixture()
def start(kubectl: Kubectl, crd: None, namespace: str, tmp_path: Path) -> Iterator[Callable[[], tuple[subprocess.Popen, Path]]]:
    """Starts `kvpersist run` on the test's namespace (again after a stop: the same log); every
    process started is stopped."""
    procs: list[subprocess.Popen] = []
    log = tmp_path / "operator.log"

    def run() -> tuple[subprocess.Popen, Path]:
        procs.append(start_operator(kubectl.kubeconfig, namespace, log))
        return procs[-1], log

    yield run
    for proc in procs:
        stop(proc)


def _resource(ns: str) -> dict[str, Any]:
    """With spec.vllm.service: <name>-vllm is one more name derived from it (the planted Service's)."""
    obj = sample()
    obj["metadata"].update(name=NAME, namespace=ns)
    obj["spec"]["vllm"]["service"] = {"enabled": True}
    return obj


def _status(kubectl: Kubectl, ns: str) -> dict[str, Any]:
    return kubectl.get("kvns", NAME, ns).get("status") or {}


def _condition(kubectl: Kubectl, ns: str, type_: str) -> dict[str, Any]:
    return next((c for c in _status(kubectl, ns).get("conditions") or [] if c["type"] == type_), {})


def _get(kubectl: Kubectl, kind: str, name: str, ns: str) -> dict[str, Any] | None:
    out = kubectl.run("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def _events(kubectl: Kubectl, ns: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in kubectl.get("events", namespace=ns)["items"] if e["reason"] == reason]


def _kept(obj: dict[str, Any]) -> dict[str, Any]:
    """What its owner wrote and the operator must leave alone: its data, labels, owners, version."""
    meta = obj["metadata"]
    return {"data": obj.get("data"), "labels": meta.get("labels"), "annotations": meta.get("annotations"),
            "ownerReferences": meta.get("ownerReferences"), "resourceVersion": meta["resourceVersion"],
            "managers": sorted(m["manager"] for m in meta.get("managedFields") or [])}


USER_TOKEN = "user-" + secrets.token_hex(16)  # what a planted agent-token Secret holds
PLANTED = {
    "vllm-service": {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{NAME}-vllm",
                                                                         "annotations": {"owner": "a user's own Service"}},
                        "spec": {"selector": {"app": "mine"}, "ports": [{"port": 8080, "protocol": "TCP"}]}},
    "agent-token": {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": f"{NAME}-agent-token"},
                    "data": {"token": base64.b64encode(USER_TOKEN.encode()).decode()}},
}


@pytest.mark.parametrize("which", sorted(PLANTED))
def test_a_users_object_under_a_derived_name_is_never_taken_over(kubectl: Kubectl, namespace: str, start,
                                                                 which: str) -> None:
    ns = namespace
    planted = {**PLANTED[which], "metadata": {**PLANTED[which]["metadata"], "namespace": ns}}
    kind, name = planted["kind"], planted["metadata"]["name"]
    kubectl.run("create", "-f", "-", stdin=json.dumps(planted))
    before = _kept(_get(kubectl, kind, name, ns))  # type: ignore[arg-type]
    operator, log = start()
    kubectl.apply(_resource(ns))
    uid = kubectl.get("kvns", NAME, ns)["metadata"]["uid"]

    # The first status the operator writes: on main the object was taken over by then.
    ready = wait_for("a Ready condition", lambda: _condition(kubectl, ns, "Ready") or None, timeout=120)
    now = _get(kubectl, kind, name, ns)
    assert now is not None and _kept(now) == before, f"the operator rewrote the user's {kind} {name}: {now['metadata']}"
    assert ready["status"] == "False" and ready["reason"] == "NameTaken", ready
    assert f"{kind} {name}" in ready["message"] and f"kubectl delete {kind.lower()} {name} -n {ns}" in ready["message"]
    assert _status(kubectl, ns)["phase"] == "Failed"
    event = wait_for("a NameTaken event", lambda: _events(kubectl, ns, "NameTaken"), timeout=60)[0]
    assert event["type"] == "Warning" and event["involvedObject"]["uid"] == uid and f"{kind} {name}" in event["message"]
    more_rounds(operator, ns, NAME)
    # Nothing at all applied (the agents would use that token, the Service select the servers), the object untouched.
    assert _kept(_get(kubectl, kind, name, ns)) == before  # type: ignore[arg-type]
    for other_kind, other in (("statefulset", f"{NAME}-lmcache"), ("deployment", f"{NAME}-vllm"),
                              ("service", f"{NAME}-vllm"),
                              ("secret", f"{NAME}-agent-token")):
        if other != name:
            assert _get(kubectl, other_kind, other, ns) is None, f"{other_kind} {other} applied beside a taken name"
    assert kubectl.get("networkpolicies", namespace=ns)["items"] == []  # not even the policy
    assert len(_events(kubectl, ns, "NameTaken")) == 1  # once, not every round
    assert USER_TOKEN not in log.read_text()

    # The user's object deleted: the operator applies its own (within its retry period) and goes on.
    kubectl.run("delete", kind.lower(), name, "-n", ns)
    mine = wait_for(f"the operator's own {kind} {name}", lambda: (lambda o: o if o and any(
        r.get("uid") == uid and r.get("controller") for r in o["metadata"].get("ownerReferences") or []) else None)(
        _get(kubectl, kind, name, ns)), timeout=RETRY_S + 90, interval=1)
    assert mine["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvpersist"
    if kind == "Secret":
        assert base64.b64decode(mine["data"]["token"]).decode() != USER_TOKEN
    wait_for("the StatefulSet and Deployment", lambda: _get(kubectl, "statefulset", f"{NAME}-lmcache", ns) and _get(
        kubectl, "deployment", f"{NAME}-vllm", ns), timeout=60)
    wait_for("Ready no longer NameTaken", lambda: _condition(kubectl, ns, "Ready").get("reason") != "NameTaken", timeout=60)

    # A restarted operator knows its own objects from the API server (no memory of its applies).
    stop(operator)
    operator, _ = start()
    more_rounds(operator, ns, NAME)
    assert _condition(kubectl, ns, "Ready").get("reason") != "NameTaken"
    owners = [r["uid"] for r in _get(kubectl, kind, name, ns)["metadata"]["ownerReferences"]]  # type: ignore[index]
    assert owners == [uid]


def test_a_planted_l2_key_is_never_used(kubectl: Kubectl, namespace: str, start) -> None:
    """<name>-l2-key made by someone else (no operator labels): its bytes name no namespace, the
    cache is off (KeySecretNotOwned), nothing is patched onto it; deleted, a key of the operator's own."""
    ns = namespace
    planted_key = secrets.token_bytes(32)
    planted_fp = key_fingerprint(planted_key)
    name = f"{NAME}-l2-key"
    kubectl.run("create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                                                    "metadata": {"name": name, "namespace": ns},
                                                    "data": {"master-key": base64.b64encode(planted_key).decode()}}))
    before = _kept(_get(kubectl, "secret", name, ns))  # type: ignore[arg-type]
    operator, log = start()
    kubectl.apply(_resource(ns))

    ident = wait_for("IdentityResolved", lambda: _condition(kubectl, ns, "IdentityResolved") or None, timeout=120)
    st = _status(kubectl, ns)
    assert ident["status"] == "False" and ident["reason"] == "KeySecretNotOwned", (ident, st.get("l2Key"))
    assert name in ident["message"] and "keySecretRef" in ident["message"]
    assert _condition(kubectl, ns, "L2Ready")["reason"] == "KeySecretNotOwned"
    assert not st.get("namespaceId") and (st.get("l2Key") or {}).get("fingerprint") is None
    event = wait_for("a KeySecretNotOwned event", lambda: _events(kubectl, ns, "KeySecretNotOwned"), timeout=60)[0]
    assert event["type"] == "Warning" and name in event["message"]
    more_rounds(operator, ns, NAME)
    assert _kept(_get(kubectl, "secret", name, ns)) == before  # type: ignore[arg-type]  (no label or annotation patched on)
    sts = wait_for("the StatefulSet", lambda: _get(kubectl, "statefulset", f"{NAME}-lmcache", ns), timeout=60)
    assert sts["spec"]["replicas"] == 0  # the cache off: no server mounts that key
    everything = kubectl.run("get", "kvns,statefulsets,deployments,configmaps,events", "-n", ns, "-o", "json").stdout
    assert planted_fp not in everything and planted_fp not in log.read_text()
    assert planted_key.hex() not in log.read_text()

    # Deleted: the operator generates its own, and the cache comes on with it.
    kubectl.run("delete", "secret", name, "-n", ns)
    mine = wait_for("the operator's own key Secret", lambda: (lambda s: s if s and (s["metadata"].get("labels") or {}).get(
        "app.kubernetes.io/managed-by") == "kvpersist" else None)(_get(kubectl, "secret", name, ns)), timeout=120, interval=1)
    own_fp = key_fingerprint(base64.b64decode(mine["data"]["master-key"]))
    assert own_fp != planted_fp
    st = wait_for("status on the generated key", lambda: (lambda s: s if (s.get("l2Key") or {}).get("fingerprint") == own_fp
                                                            else None)(_status(kubectl, ns)), timeout=120, interval=1)
    assert st.get("namespaceId") and _condition(kubectl, ns, "IdentityResolved")["status"] == "True"


# Issue 42, item 2: the L2 claims the servers would mount under derived names.
PLANTED_CLAIMS = {"per-server": f"l2-{NAME}-lmcache-0", "shared": f"l2-{NAME}-lmcache-shared"}


@pytest.mark.parametrize("which", sorted(PLANTED_CLAIMS))
def test_a_planted_l2_claim_is_never_mounted(kubectl: Kubectl, namespace: str, start, which: str) -> None:
    """A claim under an L2 claim's derived name that lacks the operator's labels (made beforehand by
    someone who may create claims) would receive this resource's KV: the StatefulSet controller
    adopts `l2-<name>-lmcache-<i>`, the operator mounts an existing `l2-<name>-lmcache-shared`. So
    nothing is applied, Ready says ClaimNotOwned naming it and what to do, with one Warning event,
    and the claim is left as it was; labelled as the message says (it is the operator's after all),
    the resource is applied within the retry period."""
    ns = namespace
    claim = PLANTED_CLAIMS[which]
    kubectl.run("create", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": ns},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "none", "resources": {"requests": {"storage": "1Gi"}}}}))
    before = _kept(_get(kubectl, "pvc", claim, ns))  # type: ignore[arg-type]
    obj = _resource(ns)
    if which == "shared":
        obj["spec"]["l2"]["nvme"].update(shared=True, adapter="nixl_store_dynamic")
    operator, _log = start()
    kubectl.apply(obj)
    uid = kubectl.get("kvns", NAME, ns)["metadata"]["uid"]

    ready = wait_for("a Ready condition", lambda: _condition(kubectl, ns, "Ready") or None, timeout=120)
    assert ready["status"] == "False" and ready["reason"] == "ClaimNotOwned", ready
    assert f"PersistentVolumeClaim {claim} " in ready["message"] and f"kubectl delete pvc {claim} -n {ns}" in ready["message"]
    event = wait_for("a ClaimNotOwned event", lambda: _events(kubectl, ns, "ClaimNotOwned"), timeout=60)[0]
    assert event["type"] == "Warning" and event["involvedObject"]["uid"] == uid and claim in event["message"]
    more_rounds(operator, ns, NAME)
    assert _get(kubectl, "statefulset", f"{NAME}-lmcache", ns) is None, "the servers' StatefulSet applied beside the claim"
    assert _kept(_get(kubectl, "pvc", claim, ns)) == before  # type: ignore[arg-type]
    assert len(_events(kubectl, ns, "ClaimNotOwned")) == 1  # once, not every round

    # Labelled as the message says: the operator's own claim after all, applied within its retry period.
    label = ready["message"].split("label it: ")[1].split(". The operator")[0]
    assert label.startswith(f"kubectl label pvc {claim} -n {ns} "), label
    kubectl.run(*label.split()[1:])
    wait_for("the StatefulSet", lambda: _get(kubectl, "statefulset", f"{NAME}-lmcache", ns), timeout=RETRY_S + 90, interval=1)
    wait_for("Ready no longer ClaimNotOwned", lambda: _condition(kubectl, ns, "Ready").get("reason") != "ClaimNotOwned",
             timeout=60)
