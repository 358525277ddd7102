"""The claim-space status (issue 30, item 7) through the real API server: status.l2 and the
L2SpaceAvailable condition the operator writes are stored as written (the CRD prunes nothing of
them), and spec.l2.orphanRetention is accepted on NVMe (the refusals: tests/e2e/test_api.py's
cases). No operator runs: the status is the one kvpersist.inventory.space and
kvpersist.status.conditions compute, patched as the operator patches it."""

from __future__ import annotations

import json

from kvpersist.api.status import checked_patch
from kvpersist.inventory.space import DAY_S, claim_space_summary
from kvpersist.inventory.volume import Inventory, NamespaceUsage
from kvpersist.status.conditions import merge_conditions, space_condition
from tests.cases.invalid_manifests import sample
from tests.e2e.kube import Kubectl

SERVED, OLD = "kvp-" + "a" * 32, "kvp-" + "b" * 32
NOW = 1_800_000_000.0


def test_status_l2_and_the_condition_are_stored_as_written(kubectl: Kubectl, crd: None, namespace: str) -> None:
    obj = sample("nvme-minimal")
    obj["metadata"]["namespace"] = namespace
    obj["spec"]["l2"]["orphanRetention"] = {"maxAgeDays": 30}
    kubectl.apply(obj)
    inv = Inventory("pvc/l2-x-0", [NamespaceUsage(SERVED, 400, 4, NOW), NamespaceUsage(OLD, 520, 9, NOW - 45 * DAY_S)],
                    capacity_bytes=1000, free_bytes=80, effective_capacity_bytes=430)
    l2 = claim_space_summary([("pvc/l2-x-0", "x-0", inv)], SERVED, frozenset({SERVED}), NOW, None,
                             [{"namespaceId": "kvp-" + "c" * 32, "bytes": 77}])
    cond = space_condition(l2, 1)
    assert l2 is not None and cond is not None and cond["reason"] == "ClaimNearlyFull"
    patch = checked_patch({"l2": l2, "conditions": merge_conditions([], [cond])}, None, "test")
    assert patch is not None
    name = obj["metadata"]["name"]
    kubectl.run("patch", "kvns", name, "-n", namespace, "--subresource=status", "--type=merge", "-p",
                json.dumps({"status": patch}))
    stored = kubectl.get("kvns", name, namespace)
    assert stored["spec"]["l2"]["orphanRetention"] == {"maxAgeDays": 30}
    assert stored["status"]["l2"] == l2  # every field kept: largestOtherNamespaces, orphansRemoved, ...
    got = next(c for c in stored["status"]["conditions"] if c["type"] == "L2SpaceAvailable")
    assert (got["status"], got["reason"], got["message"]) == ("False", "ClaimNearlyFull", cond["message"])
