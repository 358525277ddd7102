"""The PodDisruptionBudget of the lmcache servers: node drains take them one at a time (with more than one)."""

from __future__ import annotations

from typing import Any

from kvpersist.builders.target import SERVER, Target, manifest


def build_server_pdb(target: Target) -> dict[str, Any] | None:
    """An evicted server loses its node's L1 (its L2 is read again once it is back): a drain of many
    nodes at once would otherwise take every vLLM pod's cache server together. maxUnavailable 1, not
    minAvailable: it follows replicas without a rewrite and blocks nothing with the cache off.
    AlwaysAllow: a server that is not Ready serves nothing, so a drain need not wait for it. Servers the
    scheduler has found no node for for UNPLACED_AFTER_S are not counted: they would use up the one disruption for good.
    None with lmcacheServer.replicas 1: one disruption at a time over one server allows every eviction (one
    write less a new resource); one made for more servers is deleted (controller.decision.SWITCHED_OFF)."""
    if target.spec.lmcache_server.replicas <= 1:
        return None
    return manifest("policy/v1", "PodDisruptionBudget", target.metadata(target.server_name, SERVER), {
        "maxUnavailable": 1 + target.unplaced_servers,
        "selector": {"matchLabels": target.selector(SERVER)},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    })
