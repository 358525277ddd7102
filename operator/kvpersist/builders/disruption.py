"""The PodDisruptionBudget of the lmcache servers: node drains take them one at a time (with more than one)."""

from __future__ import annotations

from typing import Any

from kvpersist.builders.target import SERVER, Target, manifest


def server_budget_limits(target: Target) -> bool:
    """Whether the budget limits anything: one disruption at a time over a single server allows every
    eviction, so with lmcacheServer.replicas 1 no budget is made (one write less a new resource), and one
    made for more servers is deleted when they go back to one (controller.decision.SWITCHED_OFF)."""
    return target.spec.lmcache_server.replicas > 1


def build_server_pdb(target: Target) -> dict[str, Any]:
    """An evicted server loses its node's L1 (its L2 is read again once it is back): a drain of many
    nodes at once would otherwise take every vLLM pod's cache server together. With one server,
    maxUnavailable 0 would block `kubectl drain` forever; 1 lets it go (vLLM runs without the cache
    meanwhile: CacheBypassed), follows replicas without a rewrite and blocks nothing with the cache off.
    AlwaysAllow: a server that is not Ready serves nothing, so a drain need not wait for it. Servers the
    scheduler has found no node for for UNPLACED_AFTER_S are not counted: they would use up the one disruption for good."""
    return manifest("policy/v1", "PodDisruptionBudget", target.metadata(target.server_name, SERVER), {
        "maxUnavailable": 1 + target.unplaced_servers,
        "selector": {"matchLabels": target.selector(SERVER)},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    })
