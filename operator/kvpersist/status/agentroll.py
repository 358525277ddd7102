"""The inventory agent's image, rolled a few lmcache StatefulSets at a time.

The agent runs from the operator's image beside each lmcache server, so a new operator image is a
new pod template for every server: applied at once, every L1 is lost together. The agent is in
neither the data path nor the namespace id, so holding it back (decide) changes no KV byte.

"Rolling" is as the StatefulSet controller writes it: currentRevision becomes updateRevision only
once every replica is updated and Ready. A set on the wanted image whose pods never become Ready is
broken, not rolling, and takes no slot (it held every other roll before).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvpersist.builders.lmcache import AGENT_CONTAINER

Key = tuple[str, str]  # (namespace, KVCacheNamespace name)
Decision = Literal["new", "current", "idle", "rolling", "roll", "hold"]


@dataclass(frozen=True)
class AgentSet:
    """One lmcache StatefulSet as the plan sees it."""

    image: str | None  # the agent container's image in its pod template
    replicas: int  # spec.replicas
    settled: bool  # the controller saw this generation, and every replica is updated and Ready
    # A rollout of its template may be in progress: the controller has not seen this generation,
    # or status.currentRevision is not status.updateRevision (either unknown: True, as before).
    rollout: bool = True

    def rolling(self) -> bool:
        """Servers restarting for a new template now: not settled, and a rollout in progress."""
        return self.replicas > 0 and self.rollout and not self.settled


def agent_image_of(statefulset: Mapping[str, Any]) -> str | None:
    """The agent container's image in a StatefulSet's pod template (a full or a slim object)."""
    containers = (((statefulset.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    return next((c.get("image") for c in containers if c.get("name") == AGENT_CONTAINER), None)


def view(statefulset: Mapping[str, Any]) -> AgentSet:
    """What the plan needs of a StatefulSet: its agent image, its size, whether its rollout is done."""
    meta = statefulset.get("metadata") or {}
    status = statefulset.get("status") or {}
    replicas = int((statefulset.get("spec") or {}).get("replicas", 1) or 0)
    seen = (status.get("observedGeneration") or 0) >= (meta.get("generation") or 0)
    settled = seen and (status.get("updatedReplicas") or 0) >= replicas and (status.get("readyReplicas") or 0) >= replicas
    current, update = status.get("currentRevision"), status.get("updateRevision")
    return AgentSet(agent_image_of(statefulset), replicas, settled, rollout=not (seen and current and current == update))


def in_flight(wanted: str, fleet: Mapping[Key, AgentSet], claimed: Iterable[Key]) -> set[Key]:
    """The StatefulSets rolling to the wanted image now: on it and rolling, and those just handed it
    (claimed) that the watch has not yet shown done on it; a claim gone or scaled to zero is dropped."""
    out = {k for k, s in fleet.items() if s.image == wanted and s.rolling()}
    return out | {k for k in claimed if (s := fleet.get(k)) is not None and s.replicas > 0
                  and not (s.image == wanted and not s.rolling())}


def decide(key: Key, wanted: str, fleet: Mapping[Key, AgentSet], claimed: Iterable[Key], limit: int) -> Decision:
    """What one resource's apply renders: the wanted image ("roll" takes a slot and must be claimed)
    or the image it runs ("hold"). First come takes a free slot: an unappliable one blocks no other."""
    mine = fleet.get(key)
    if mine is None or mine.image is None:
        return "new"
    if mine.image == wanted:
        return "current"
    if mine.replicas <= 0:
        return "idle"
    busy = in_flight(wanted, fleet, claimed)
    if key in busy:
        return "rolling"
    return "roll" if len(busy) < limit else "hold"
