"""The inventory agent's image, rolled a few lmcache StatefulSets at a time.

The agent runs from the operator's image, beside each lmcache server in the same pod. A new
operator image is therefore a new pod template for every server: applied everywhere at once,
every server restarts together and every L1 is lost together (L2 persists). So an apply renders
the wanted agent image only where it may: a StatefulSet that does not exist yet, one already on
it, one scaled to zero (nothing to lose), or while fewer than `limit` StatefulSets on the wanted
image are still rolling (a rollout of their template in progress, and not all of their servers
updated and Ready again). Every other one keeps the agent image it runs, and waits for its turn.
The agent is not in the data path and not in the namespace id, so holding it back changes no KV
byte. Pure functions of what the watch cache saw.

"Rolling" is read as the StatefulSet controller writes it: it starts a new StatefulSet with
status.currentRevision equal to its updateRevision, and sets currentRevision to updateRevision
again only once every replica is updated and Ready (completeUpdate). A set whose controller has
seen its generation and whose two revisions are equal has no rollout in progress: one made
directly on the wanted image whose pods never become Ready is broken, not rolling, and takes no
slot (it held every other roll before).
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
    """The StatefulSets rolling to the wanted image now: on it and rolling (AgentSet.rolling), and
    those just handed it (claimed) whose watch event has not yet shown them on it and done rolling.
    A claim whose StatefulSet is gone is dropped. Scaled to zero: nothing rolling. One on the wanted
    image with no rollout in progress (made on it, or done) takes no slot, Ready or not."""
    out = {k for k, s in fleet.items() if s.image == wanted and s.rolling()}
    for key in claimed:
        s = fleet.get(key)
        if s is not None and s.replicas > 0 and not (s.image == wanted and not s.rolling()):
            out.add(key)
    return out


def decide(key: Key, wanted: str, fleet: Mapping[Key, AgentSet], claimed: Iterable[Key], limit: int) -> Decision:
    """What one resource's apply renders: the wanted image ("new", "current", "idle", "rolling",
    "roll": "roll" takes a slot and must be claimed) or the image it runs ("hold"). Any waiting
    StatefulSet may take a free slot (first come): one whose resource cannot be applied never
    blocks the others."""
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
