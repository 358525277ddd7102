"""The watch caches (kopf indexes) of the operator's workloads and of claims, and one resource's view
of them (Seen); a workload that changes marks its owner for a status refresh.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from kvpersist.controller import runtime
from kvpersist.controller.runtime import _MANAGED
from kvpersist.status.agentroll import AgentSet
from kvpersist.status.workloads import Seen, fleet, index_entry, live_ids, owner_key

# kopf runs no handler until every index has its initial listing, so the first refresh after a
# restart never sees a half-filled cache.


@kopf.index("apps", "v1", "statefulsets", labels=_MANAGED)
async def kvp_statefulsets(body: kopf.Body, **_: Any) -> Any:
    _mark_dirty(body)
    return index_entry(body)


@kopf.index("apps", "v1", "deployments", labels=_MANAGED)
async def kvp_deployments(body: kopf.Body, **_: Any) -> Any:
    _mark_dirty(body)
    return index_entry(body)


@kopf.index("", "v1", "pods", labels=_MANAGED)
async def kvp_pods(body: kopf.Body, **_: Any) -> Any:
    return index_entry(body)


@kopf.index("", "v1", "persistentvolumeclaims")
async def kvp_claims(body: kopf.Body, **_: Any) -> Any:
    return index_entry(body)


def _mark_dirty(body: Mapping[str, Any]) -> None:
    """A workload changed: refresh its owner on the next tick, so phase follows pod readiness."""
    owner = owner_key(body)
    state = runtime.CONTROLLER.get(owner) if owner is not None else None
    if state is not None and state.known:
        state.dirty = True


def _seen(key: tuple[str, str], live: frozenset[str] | None = None,
          agents: Mapping[tuple[str, str], AgentSet] | None = None) -> Seen:
    """Copies of one resource's objects from the indexes; call in the event loop only."""
    def values(name: str) -> list[dict[str, Any]]:
        store = runtime.CONTROLLER.indices.get(name, {}).get(key)
        return list(store) if store is not None else []
    return Seen(statefulsets=values("kvp_statefulsets"), deployments=values("kvp_deployments"),
                pods=values("kvp_pods"), claims=values("kvp_claims"), live_ids=_live() if live is None else live,
                fleet=_fleet() if agents is None else agents)


def _live() -> frozenset[str]:
    """Every namespace id in use, from the caches; call in the event loop only."""
    pods = [p for store in runtime.CONTROLLER.indices.get("kvp_pods", {}).values() for p in store]
    known = runtime.CONTROLLER.known().values()
    return live_ids([st.body for st in known if st.body is not None], [st.namespace_id for st in known], pods)


def _fleet() -> dict[tuple[str, str], AgentSet]:
    """Every resource's lmcache StatefulSet as the agent roll sees it; call in the event loop only."""
    return fleet(runtime.CONTROLLER.indices.get("kvp_statefulsets", {}))
