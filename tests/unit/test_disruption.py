"""The lmcache servers' PodDisruptionBudget (kvpersist.builders.lmcache)."""

from __future__ import annotations

import dataclasses

import pytest

from kvpersist.builders.all import build_all
from kvpersist.builders.lmcache import build_lmcache_statefulset, build_server_pdb
from tests.unit.test_builders import target


def _servers(replicas: int):
    def mutate(obj: dict) -> None:
        obj["spec"].setdefault("lmcacheServer", {})["replicas"] = replicas
        nvme = obj["spec"]["l2"].get("nvme") or {}
        nvme.pop("existingClaimName", None)  # an existing claim serves one server only
        nvme.setdefault("size", "100Gi")
    return target(mutate=mutate)


@pytest.mark.parametrize("replicas", [2, 5])
def test_one_server_at_a_time_and_never_a_drain_blocked_forever(replicas: int) -> None:
    t = _servers(replicas)
    pdb = build_server_pdb(t)
    spec = pdb["spec"]
    # maxUnavailable 1 whatever the count: with one server a budget of 0 would block every drain.
    assert spec["maxUnavailable"] == 1 and "minAvailable" not in spec
    assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    # It selects exactly the StatefulSet's pods (every namespace id's, old ones mid-rollout included).
    sts = build_lmcache_statefulset(t)
    assert spec["selector"] == sts["spec"]["selector"]
    assert all(sts["spec"]["template"]["metadata"]["labels"][k] == v for k, v in spec["selector"]["matchLabels"].items())
    assert pdb["metadata"]["namespace"] == "ml" and pdb["metadata"]["labels"]["app.kubernetes.io/name"] == "kvpersist"


def test_the_budget_is_applied_with_the_servers_and_with_the_cache_off() -> None:
    t = _servers(2)
    kinds = [m["kind"] for m in build_all(t, operator_ns="kvpersist-system")]
    assert kinds.index("StatefulSet") < kinds.index("PodDisruptionBudget") < kinds.index("Deployment")
    off = dataclasses.replace(t, namespace_id=None)  # cache off: no server pods, the budget blocks nothing
    assert "PodDisruptionBudget" in [m["kind"] for m in build_all(off, operator_ns="kvpersist-system")]


def test_one_server_gets_no_budget_and_its_earlier_one_is_deleted() -> None:
    """One disruption at a time over one server allows every eviction: nothing to write, and a budget
    made while there were more servers goes (the resource's own only: controller.decision.dropped)."""
    from kvpersist.controller.decision import dropped

    one = _servers(1)
    manifests = build_all(one, operator_ns="kvpersist-system")
    assert "PodDisruptionBudget" not in [m["kind"] for m in manifests]
    pdb = ("PodDisruptionBudget", "ml", one.server_name)
    assert pdb in dropped(one, manifests, frozenset({pdb}), pool_served=False)
    assert pdb not in dropped(one, manifests, frozenset(), pool_served=False)  # not known as its own: never touched
    two = _servers(2)
    assert pdb not in dropped(two, build_all(two, operator_ns="kvpersist-system"), frozenset({pdb}), pool_served=False)
