"""An idle resource costs the API server no reads (issue 29, item 8; every read verb since issue
40): the Secrets a resource names and the claim it names are read from watch caches
(kvpersist.controller.watchcache; Secrets as metadata only), not by request every status round,
and no round gets, lists or opens a watch of anything (the resource itself included: there is no
resync read since issue 46; kopf's watch lists again whenever it cannot go on). The API
server's own audit log counts the operator's requests (it runs as a ServiceAccount of its own,
which the local cluster audits), and the caches still follow changes: a rotated key Secret is a
new namespace id, a deleted claim says so.
Real API server; the server pods are the local cluster's kwok pods (no lmcache needed for this)."""

from __future__ import annotations

import base64
import copy
import secrets
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.cases.invalid_manifests import sample
from tests.e2e.audit import events
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import more_rounds, refreshes, resource_series, start_operator, stop

pytestmark = pytest.mark.e2e
NAME = "idle"
ROUNDS = 4  # status rounds (10 s each) watched for reads
LABEL = "kvpersist.dev/usable-by=kvpersist"


@pytest.fixture()
def setup(kubectl: Kubectl, crd: None, namespace: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The operator as ServiceAccount `operator` of the test's namespace (cluster-admin: what is
    under test is how often it reads, not RBAC), with secretLabel set, and its audit identity."""
    ns = namespace
    binding = f"{ns}-operator"
    kubectl.run("create", "serviceaccount", "operator", "-n", ns)
    kubectl.run("create", "clusterrolebinding", binding, "--clusterrole=cluster-admin", f"--serviceaccount={ns}:operator")
    own = kubectl.as_service_account(ns, "operator", tmp_path / "operator.kubeconfig").kubeconfig
    log = tmp_path / "operator.log"
    proc = start_operator(own, ns, log, {"KVPERSIST_SECRET_LABEL": LABEL})
    try:
        yield {"ns": ns, "proc": proc, "user": f"system:serviceaccount:{ns}:operator", "log": log,
               "as_operator": Kubectl(own, kubectl.binary)}
    finally:
        stop(proc)
        kubectl.run("delete", "clusterrolebinding", binding, "--ignore-not-found", check=False)


def put_key(kubectl: Kubectl, ns: str, key: bytes) -> None:
    kubectl.apply({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                   "metadata": {"name": "user-key", "namespace": ns, "labels": dict([LABEL.split("=")])},
                   "data": {"master-key": base64.b64encode(key).decode()}})


def resource(ns: str) -> dict[str, Any]:
    obj = copy.deepcopy(sample("nvme-minimal"))
    obj["metadata"] = {"name": NAME, "namespace": ns}
    obj["spec"]["l1"]["size"] = "256Mi"
    obj["spec"]["l2"] = {"nvme": {"existingClaimName": "user-data", "maxCapacity": "1Gi"},
                         "encryption": {"keySecretRef": {"name": "user-key"}}}
    obj["spec"]["vllm"]["replicas"] = 0
    return obj


READ_VERBS = ("get", "list", "watch")


def reads(audit_log: Path, user: str, since: datetime, until: datetime) -> list[str]:
    """Every read the operator's account asked for between since and until, of any resource, by
    when the API server received it: gets and lists once complete, watches once started (the
    local cluster's audit policy logs a watch's start; it completes only when the server ends it).
    Peering (kopf's heartbeat) is a write and not here. "verb resource namespace/name"."""
    out = []
    for e in events(audit_log, user, stages=("ResponseStarted", "ResponseComplete")):
        verb, ref = e.get("verb"), e.get("objectRef") or {}
        counted = "ResponseStarted" if verb == "watch" else "ResponseComplete"
        if verb not in READ_VERBS or e.get("stage") != counted or not since <= received(e) <= until:
            continue
        out.append(f"{verb} {ref.get('resource')} {ref.get('namespace', '')}/{ref.get('name', '')}")
    return out


def received(event: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))


def per_round(seen: list[str]) -> list[str]:
    """The reads a status round repeats: a get of anything, or the same list or watch more than
    once in the window. A watch ends every few minutes (kopf's server timeout) and is opened again,
    and one whose version has grown too old is listed again: once each per resource in a window
    of a few rounds is the watch itself, not a read per round."""
    counts = Counter(seen)
    return sorted(r for r, n in counts.items() if r.startswith("get ") or n > 1)


def status(kubectl: Kubectl, ns: str) -> dict[str, Any]:
    return kubectl.get("kvns", NAME, ns).get("status") or {}


def test_an_idle_resource_reads_no_secret_or_claim_and_still_sees_changes(kubectl: Kubectl, setup: dict[str, Any],
                                                                          audit_log: Path) -> None:
    ns, proc, user = setup["ns"], setup["proc"], setup["user"]
    kubectl.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "user-data", "namespace": ns},
                   "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                            "storageClassName": f"{ns}-none"}})
    put_key(kubectl, ns, secrets.token_bytes(32))
    kubectl.apply(resource(ns))
    first = wait_for("a namespace id from the named key", lambda: status(kubectl, ns).get("namespaceId"), timeout=90)
    more_rounds(proc, ns, NAME)  # whatever the first rounds read (the caches listing) is behind us

    since = datetime.now(UTC)
    before = refreshes(proc, ns, NAME)
    more_rounds(proc, ns, NAME, rounds=ROUNDS)
    until = datetime.now(UTC)
    rounds = refreshes(proc, ns, NAME) - before
    assert rounds >= ROUNDS
    # The audit log is written as requests complete: one request of ours as the operator's
    # ServiceAccount marks the window's end; once it is in the log, so is everything before it.
    marker = f"marker-{uuid.uuid4().hex[:8]}"
    setup["as_operator"].run("get", "configmap", marker, "-n", ns, "--ignore-not-found")
    wait_for("the marker request in the audit log", lambda: any((e.get("objectRef") or {}).get("name") == marker
                                                                 for e in events(audit_log, user)), timeout=30)
    seen = [r for r in reads(audit_log, user, since, until) if marker not in r]
    assert per_round(seen) == [], f"{rounds} idle status rounds read from the API server: {seen}"
    assert (status(kubectl, ns).get("namespaceId")) == first

    # The caches follow changes: new key bytes are a new namespace id (its data read again, once) ...
    put_key(kubectl, ns, secrets.token_bytes(32))
    wait_for("a new namespace id after the key rotated", lambda: status(kubectl, ns).get("namespaceId") not in (None, first),
             timeout=60)
    # ... and the named claim deleted is a claim not found.
    kubectl.run("delete", "pvc", "user-data", "-n", ns, "--wait=false")
    kubectl.run("patch", "pvc", "user-data", "-n", ns, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)

    def claim_missing() -> bool:
        l2 = next((c for c in status(kubectl, ns).get("conditions") or [] if c["type"] == "L2Ready"), {})
        return "user-data not found" in l2.get("message", "")
    wait_for("L2Ready to say the claim is gone", claim_missing, timeout=60)

    # The operator's /metrics shows the same conditions, one series each, with the reason that
    # changed (docs/runbooks.md); a deleted resource's series go.
    def shown() -> set[tuple[str, str, str]]:
        return {(labels["type"], labels["status"], labels["reason"]) for metric, labels, _ in resource_series(proc, ns, NAME)
                if metric == "kvpersist_resource_condition"}

    def stored() -> set[tuple[str, str, str]]:
        return {(c["type"], c["status"], c["reason"]) for c in status(kubectl, ns).get("conditions") or []}

    wait_for("the condition series to be the stored conditions", lambda: shown() == stored() != set(), timeout=60)
    assert ("L2Ready", "False", "ClaimNotFound") in shown()
    kubectl.run("delete", "kvns", NAME, "-n", ns, "--wait=false")
    wait_for("the deleted resource's series to go", lambda: not shown() and not resource_series(proc, ns, NAME), timeout=60)
