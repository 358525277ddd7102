"""The PodDisruptionBudget of the lmcache servers: node drains take them one at a time."""

from __future__ import annotations

from typing import Any

from kvpersist.builders.target import SERVER, Target


def build_server_pdb(target: Target) -> dict[str, Any]:
    """maxUnavailable 1, whatever the number of servers, with unhealthy pods always evictable.

    Each server holds its node's L1 (host RAM), lost when it is evicted; its L2 stays on its claim
    or bucket and is read again once it is back. With several servers, a drain of many nodes at
    once (a cluster upgrade) would otherwise evict them together and every vLLM pod would lose its
    cache server at the same moment: one at a time, the others keep serving. With one server,
    maxUnavailable 0 (or minAvailable 1) would block `kubectl drain` and every node upgrade
    forever, an outage of the cluster's maintenance that production operators avoid: the budget
    still lets that one go, and vLLM falls back to running without the cache (CacheBypassed) until
    it is back. maxUnavailable rather than minAvailable: it follows spec.lmcacheServer.replicas
    without a rewrite, and with the cache off (no server pods) it blocks nothing. A server that is
    not Ready (crash-looping, refusing its build) serves nothing: AlwaysAllow lets a drain evict it
    instead of waiting for a readiness that may never come (unhealthyPodEvictionPolicy, GA in 1.31).
    A server that cannot be placed at all (more replicas than eligible nodes: required
    anti-affinity) would use up the one disruption for good and block every drain of the others'
    nodes; once the scheduler has found no node for it for UNPLACED_AFTER_S it is not counted
    (target.unplaced_servers: maxUnavailable 1 + that many). A replacement waiting for a drained
    node to come back is not such a server until then.
    """
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": target.metadata(target.server_name, SERVER),
        "spec": {
            "maxUnavailable": 1 + target.unplaced_servers,
            "selector": {"matchLabels": target.selector(SERVER)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
