"""spec.l2.nvme.shared on the real API server with the operator running (kwok pods: the pod
specs and the claims are what is checked; the data path of several servers on one folder is
tests/integration/test_shared_folder.py's). With size: one ReadWriteMany claim, owned for
reclaimPolicy Delete, mounted by every server, no volumeClaimTemplate. With a user's claim that
is not ReadWriteMany: L2Ready ClaimNotShared naming the fix, and one server, not one per node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cases.invalid_manifests import sample
from tests.e2e.kube import Kubectl, wait_for

pytestmark = pytest.mark.e2e


def _shared(ns: str, name: str, nvme: dict, replicas: int = 2) -> dict:
    obj = sample()
    obj["metadata"].update(name=name, namespace=ns)
    obj["spec"]["l2"]["nvme"] = {"maxCapacity": "1Gi", "shared": True, "adapter": "nixl_store_dynamic", **nvme}
    obj["spec"].setdefault("lmcacheServer", {})["replicas"] = replicas
    return obj


def test_one_shared_claim_for_every_server_and_a_claim_that_cannot_be_shared(kubectl: Kubectl, namespace: str,
                                                                             operator: Path) -> None:
    ns = namespace
    log = lambda: "--- operator log:\n" + operator.read_text()[-3000:]  # noqa: E731
    kubectl.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "rwo-kv", "namespace": ns},
                   "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "none",
                            "resources": {"requests": {"storage": "1Gi"}}}})
    kubectl.apply(_shared(ns, "made", {"size": "2Gi", "storageClassName": "none", "reclaimPolicy": "Delete"}))
    kubectl.apply(_shared(ns, "users", {"existingClaimName": "rwo-kv"}))

    def get(kind: str, name: str) -> dict | None:
        out = kubectl.run("get", kind, name, "-n", ns, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    claim = wait_for("made's shared claim", lambda: get("pvc", "l2-made-lmcache-shared"), timeout=120, explain=log)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and claim["spec"]["storageClassName"] == "none"
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    [ref] = claim["metadata"]["ownerReferences"]  # reclaimPolicy Delete: it goes with the resource
    assert (ref["kind"], ref["name"], ref["uid"]) == ("KVCacheNamespace", "made", kubectl.get("kvns", "made", ns)["metadata"]["uid"])
    sts = wait_for("made's StatefulSet", lambda: get("statefulset", "made-lmcache"), timeout=60, explain=log)
    assert "volumeClaimTemplates" not in sts["spec"] and sts["spec"]["replicas"] == 2
    assert {"name": "l2", "persistentVolumeClaim": {"claimName": "l2-made-lmcache-shared"}} in \
        sts["spec"]["template"]["spec"]["volumes"]
    claims = [c["metadata"]["name"] for c in kubectl.get("pvc", namespace=ns)["items"]]
    assert sorted(claims) == ["l2-made-lmcache-shared", "rwo-kv"], claims  # one claim, none per server

    def l2_ready(name: str) -> dict | None:
        conds = (kubectl.get("kvns", name, ns).get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == "L2Ready" and c["reason"] == "ClaimNotShared"), None)

    refused = wait_for("users' ClaimNotShared", lambda: l2_ready("users"), timeout=120, explain=log)
    assert refused["status"] == "False" and "rwo-kv" in refused["message"]
    assert "ReadWriteOnce" in refused["message"] and "spec.l2.nvme.existingClaimName" in refused["message"]
    users = wait_for("users' StatefulSet at one server",
                     lambda: (s := get("statefulset", "users-lmcache")) and s["spec"]["replicas"] == 1 and s,
                     timeout=60, explain=log)
    assert "volumeClaimTemplates" not in users["spec"]
    assert "ownerReferences" not in kubectl.get("pvc", "rwo-kv", ns)["metadata"]  # the user's: never owned
