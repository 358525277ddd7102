"""A pin change before it happens (issue 32, item 2), on the real API server: kubectl's Warning from
config/pin-change-warning's ValidatingAdmissionPolicy (the API server type-checks it against the
CRD and runs its CEL) on a change that moves the namespace id, none on a replica change or an
image's tag alone, and `kubectl kvpersist plan -f` printing old id -> new id and the inventory's
numbers.

No operator runs and no lmcache server: the status is planted through the status subresource, as
the operator writes it (checked against the status models by checked_patch), with the namespace id
the operator's code resolves the spec to under a recorded key fingerprint, an inventory of two
claims (the old id's folders, and a folder of the id the pin change goes to: a rollback) and a hit
rate. What is under test reads status only, so the planted status shows what it needs; that the
operator writes these fields is tests/e2e/test_admin.py's and test_l2_key.py's.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.api.status import checked_patch
from kvpersist.identity import key_fingerprint, resolve
from kvpersist.status.usage import human_bytes
from tests.cases.invalid_manifests import sample
from tests.e2e.kube import Kubectl, wait_for

NAME = "plan"
FP = "0123456789abcdef"  # the fingerprint status.l2Key records for the generated key Secret
REVISION = "1" * 40
TEAM_KEY = bytes(range(32, 64))
POLICY = "kvpersist-pin-change-warning"


def _id(obj: dict[str, Any], fingerprint: str = FP) -> str:
    found = resolve(KVCacheNamespaceSpec.model_validate(obj["spec"]).pins(fingerprint)).namespace_id
    assert found is not None
    return found


def _plant(kubectl: Kubectl, ns: str, served: str, volumes: list[tuple[str, list[tuple[str, int, int]]]] | None,
           generation: int) -> None:
    """status as the operator writes it: the served id, the key's record, the inventory (None: not
    measured yet) and the hit rate."""
    status: dict[str, Any] = {
        "observedGeneration": generation, "phase": "Ready", "namespaceId": served,
        "l2Key": {"secret": f"{NAME}-l2-key", "generated": True, "fingerprint": FP, "namespaceId": served},
        "hits": {"lookupTokens": 1000, "hitTokens": 640, "hitRate": 0.64, "summary": "64.0% (5m)"},
    }
    if volumes is not None:
        current = [(b, o) for _, shares in volumes for nsid, b, o in shares if nsid == served]
        status["usage"] = {"l2UsedBytes": sum(b for b, _ in current), "l2Objects": sum(o for _, o in current),
                           "measuredAt": "2026-01-01T00:00:00Z"}
        status["inventory"] = {
            "measuredAt": "2026-01-01T00:00:00Z",
            "volumes": [{"location": loc, "namespaces": [{"namespaceId": nsid, "bytes": b, "objects": o, "orphan": nsid != served}
                                                         for nsid, b, o in shares]} for loc, shares in volumes]}
    else:
        status["inventory"] = status["usage"] = None
    patch = checked_patch(status, None, "test")
    assert patch is not None
    kubectl.run("patch", "kvns", NAME, "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps({"status": patch}))


def _apply(kubectl: Kubectl, obj: dict[str, Any], *flags: str) -> str:
    """kubectl apply; its stderr, where kubectl prints the API server's warnings."""
    return kubectl.apply(obj, *flags).stderr


def _warning(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("Warning:")]
    return "\n".join(lines)


def _plan(kubectl: Kubectl, obj: dict[str, Any], tmp: Path, *args: str, plugin: bool = False) -> subprocess.CompletedProcess:
    path = tmp / "new.yaml"
    path.write_text(json.dumps(obj))
    if plugin:  # kubectl finds kubectl-kvpersist on PATH; the kubeconfig comes from $KUBECONFIG
        return subprocess.run([str(kubectl.binary), "kvpersist", "plan", "-f", str(path), *args], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "KUBECONFIG": str(kubectl.kubeconfig),
                                                           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"})
    return subprocess.run([sys.executable, "-m", "kvpersist.cli", "plan", "-f", str(path), "--kubeconfig", str(kubectl.kubeconfig),
                           *args], capture_output=True, text=True, timeout=120)


def test_a_pin_change_warns_and_plan_tells_the_ids_and_the_inventorys_numbers(
        kubectl: Kubectl, pin_change_policy: None, namespace: str, tmp_path: Path) -> None:
    ns = namespace
    obj = sample("nvme-minimal")
    obj["metadata"].update({"name": NAME, "namespace": ns})
    assert _warning(_apply(kubectl, obj)) == ""  # a create: nothing is served yet
    served = _id(obj)
    pinned = copy.deepcopy(obj)
    pinned["spec"]["identity"]["modelRevision"] = REVISION
    rollback = _id(pinned)  # the id the pin change goes to, already on a claim: an earlier rollout's
    volumes = [("pvc/l2-plan-lmcache-0", [(served, 13_207_024_435 - 2**20, 400), (rollback, 3 * 2**20, 12)]),
               ("pvc/l2-plan-lmcache-1", [(served, 2**20, 56)])]
    generation = kubectl.get("kvns", NAME, ns)["metadata"]["generation"]
    _plant(kubectl, ns, served, volumes, generation)

    # The policy is active once the API server's informer has it: a dry run warns.
    wait_for("the pin-change policy to warn", lambda: _warning(_apply(kubectl, pinned, "--dry-run=server")), timeout=30)

    # The plan first, as a user would run it (through kubectl's plugin lookup).
    table = _plan(kubectl, pinned, tmp_path, plugin=True)
    assert table.returncode == 2, table.stdout + table.stderr
    assert f"{served} -> {rollback}" in table.stdout and "spec.identity.modelRevision" in table.stdout
    assert f"{served}: 12.3Gi (13207024435 bytes) in 456 objects, hit rate 64.0% (5m)" in table.stdout, table.stdout
    assert f"{rollback}: 3Mi (3145728 bytes) in 12 objects already on this resource's L2: served at once" in table.stdout
    [plan] = json.loads(_plan(kubectl, pinned, tmp_path, "-o", "json").stdout)
    assert (plan["oldId"], plan["newId"], plan["changedFields"]) == (served, rollback, ["spec.identity.modelRevision"])
    usage = kubectl.get("kvns", NAME, ns)["status"]["usage"]
    assert plan["oldHeld"] == {"bytes": usage["l2UsedBytes"], "objects": usage["l2Objects"]}
    assert plan["newHeld"] == {"bytes": 3 * 2**20, "objects": 12}
    same = _plan(kubectl, obj, tmp_path)
    assert same.returncode == 0 and f"{served} (unchanged)" in same.stdout, same.stdout + same.stderr

    # No warning where the id stays: replicas, an image's tag (same digest), an annotation.
    scaled = copy.deepcopy(obj)
    scaled["spec"]["vllm"]["replicas"] = 2
    assert _warning(_apply(kubectl, scaled)) == ""
    retagged = copy.deepcopy(scaled)
    retagged["spec"]["image"] = "mirror.example.com/other:v9@" + obj["spec"]["image"].split("@")[1]
    assert _warning(_apply(kubectl, retagged, "--dry-run=server")) == ""

    # The pin change itself: kubectl prints the warning, and the change is applied (Warn only).
    pinned["spec"]["vllm"]["replicas"] = 2
    warning = _warning(_apply(kubectl, pinned))
    assert f"ValidatingAdmissionPolicy '{POLICY}'" in warning, warning
    assert (f"identity changes (spec.identity.modelRevision): {served} (12.3Gi in 456 objects, hit rate 64.0% (5m)) will no "
            f"longer be served; it stays in L2 as an orphan until `kvpersist gc {served}`") in warning, warning
    assert kubectl.get("kvns", NAME, ns)["spec"]["identity"]["modelRevision"] == REVISION


def test_the_warning_writes_sizes_as_status_does_and_names_key_changes(
        kubectl: Kubectl, pin_change_policy: None, namespace: str, tmp_path: Path) -> None:
    """The policy's size arithmetic on the API server against status.usage.human_bytes (ties
    rounded to even, a trailing .0 dropped), an inventory not measured yet, and a change of the
    key's Secret, whose plan reads that Secret (or cannot, when it does not exist)."""
    ns = namespace
    obj = sample("nvme-minimal")
    obj["metadata"].update({"name": NAME, "namespace": ns})
    kubectl.apply(obj)
    served = _id(obj)
    generation = kubectl.get("kvns", NAME, ns)["metadata"]["generation"]
    moved = copy.deepcopy(obj)
    moved["spec"]["identity"]["maxModelLen"] = 8192
    _plant(kubectl, ns, served, None, generation)
    first = wait_for("the pin-change policy to warn", lambda: _warning(_apply(kubectl, moved, "--dry-run=server")), timeout=30)
    assert f"{served} (its size not measured yet, hit rate 64.0% (5m))" in first, first
    for size in (5, 1280, 1331, 2**20 - 1, 10 * 2**40 + 2**39):
        _plant(kubectl, ns, served, [("pvc/x", [(served, size, 3)])], generation)
        warning = _warning(_apply(kubectl, moved, "--dry-run=server"))
        assert f"{served} ({human_bytes(size)} in 3 objects, hit rate 64.0% (5m))" in warning, (size, warning)

    keyed = copy.deepcopy(obj)
    keyed["spec"]["l2"]["encryption"] = {"enabled": True, "keySecretRef": {"name": "team-key", "key": "k"}}
    warning = _warning(_apply(kubectl, keyed, "--dry-run=server"))
    assert ("identity changes (spec.l2.encryption.keySecretRef.name, spec.l2.encryption.keySecretRef.key): "
            f"{served} (") in warning and "will no longer be served unless the new Secret holds the same key" in warning, warning
    missing = _plan(kubectl, keyed, tmp_path)
    assert missing.returncode == 3 and "Secret team-key key k" in missing.stdout, missing.stdout + missing.stderr
    kubectl.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "team-key", "namespace": ns},
                   "data": {"k": base64.b64encode(TEAM_KEY).decode()}})
    [plan] = json.loads(_plan(kubectl, keyed, tmp_path, "-o", "json").stdout)
    assert plan["newId"] == _id(keyed, key_fingerprint(TEAM_KEY)) and plan["exitCode"] == 2
    assert base64.b64encode(TEAM_KEY).decode() not in json.dumps(plan)


def test_plan_says_the_operator_would_refuse_a_claim_another_resource_holds(
        kubectl: Kubectl, crd: None, namespace: str, tmp_path: Path) -> None:
    """`kvpersist plan` runs the operator's own decision (kvpersist.controller.decision.decide) on
    what it reads with the user's credentials: a resource naming the claim an older one holds is
    said to be kept off its store (StorageInUse), with the conditions the operator would write,
    before it is applied; the same resource on a claim of its own applies."""
    ns = namespace
    holder = sample("nvme-minimal")
    holder["metadata"] = {"name": "holder", "namespace": ns}
    holder["spec"]["l2"]["nvme"] = {"existingClaimName": "kv-shared", "maxCapacity": "100Gi"}
    kubectl.apply(holder)
    second = copy.deepcopy(holder)
    second["metadata"]["name"] = "second"

    table = _plan(kubectl, second, tmp_path)
    assert table.returncode == 4, table.stdout + table.stderr
    assert "applied with the cache off (StorageInUse)" in table.stdout, table.stdout
    assert f"claim kv-shared is already used by KVCacheNamespace {ns}/holder" in table.stdout, table.stdout
    assert "L2Ready=False StorageInUse" in table.stdout and "Ready=False StorageInUse" in table.stdout, table.stdout
    [plan] = json.loads(_plan(kubectl, second, tmp_path, "-o", "json").stdout)
    assert (plan["verdict"], plan["refused"], plan["exitCode"], plan["phase"]) == ("StorageInUse", True, 4, "CacheDisabled")
    assert {(c["type"], c["status"], c["reason"]) for c in plan["conditions"]} >= {
        ("L2Ready", "False", "StorageInUse"), ("Ready", "False", "StorageInUse")}, plan["conditions"]

    own = copy.deepcopy(second)
    own["spec"]["l2"]["nvme"]["existingClaimName"] = "kv-second"
    [free] = json.loads(_plan(kubectl, own, tmp_path, "-o", "json").stdout)
    assert free["verdict"] is None and free["refused"] is False and free["exitCode"] != 4, free
