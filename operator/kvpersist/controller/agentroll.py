"""The agent image roll in the controller: which image one apply renders (kvpersist.status.agentroll
decides), the claims bridging an apply and the watch event that shows it, and the events. Claims live in
memory: after a restart the watch cache alone says what rolls, so never more at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from kvpersist.builders.lmcache import agent_image
from kvpersist.controller import kube
from kvpersist.identity import IMAGE_DIGEST_RE
from kvpersist.status import agentroll as plan

ROLL_MAX_ENV = "KVPERSIST_AGENT_ROLL_MAX"  # the chart's agentRoll.maxUnavailable
# A claim whose StatefulSet is still seen on the old image this long after (apply failed, or now refused)
# frees its slot: an unappliable resource must not hold every other update. Once seen new, only Ready frees it.
CLAIM_TTL_S = 120.0
PENDING = "AgentUpdatePending"
UPDATING = "AgentUpdating"
log = logging.getLogger(__name__)


def limit() -> int:
    """How many lmcache StatefulSets may roll to a new agent image at once, cluster-wide (>= 1)."""
    try:
        return max(1, int(os.environ.get(ROLL_MAX_ENV) or 1))
    except ValueError:
        return 1


def warn_if_unpinned() -> None:
    """A tag names no build: the roll compares names, so a moved tag rolls nothing and each server restarted
    for another reason pulls whatever it names now (the chart's image.requireDigest refuses it)."""
    image = agent_image()
    if not IMAGE_DIGEST_RE.search(image):
        log.warning("the inventory agent's image %s is named by tag alone: set the chart's image.digest (and "
                    "image.requireDigest) so each upgrade rolls the agents deliberately (docs/upgrading.md)", image)


class Roller:
    """Thread-safe: applies of different resources run side by side in worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claimed: dict[plan.Key, tuple[str, float]] = {}  # resource -> the image it was handed, when
        self._told: dict[plan.Key, plan.Decision] = {}

    def _decide(self, key: plan.Key, wanted: str, fleet: Mapping[plan.Key, plan.AgentSet],
                now: float) -> plan.Decision:
        claimed = [k for k, (image, at) in self._claimed.items() if image == wanted and (
            now - at < CLAIM_TTL_S or (k in fleet and fleet[k].image == wanted))]
        busy = plan.in_flight(wanted, fleet, claimed)
        for k in list(self._claimed):  # settled on it, gone, expired, or handed an image no longer wanted
            if k not in busy:
                del self._claimed[k]
        return plan.decide(key, wanted, fleet, self._claimed, limit())

    def image_for(self, key: plan.Key, fleet: Mapping[plan.Key, plan.AgentSet], body: Mapping[str, Any],
                  now: float | None = None) -> str:
        """The agent image this apply renders for one resource; claims a slot when it is its turn."""
        wanted = agent_image()
        now = time.monotonic() if now is None else now
        with self._lock:
            decision = self._decide(key, wanted, fleet, now)
            if decision == "roll":
                self._claimed[key] = (wanted, now)
            prior = self._told.get(key)
            self._told[key] = decision
            rolling = sorted(plan.in_flight(wanted, fleet, self._claimed))
        current = fleet[key].image if key in fleet else None
        reason = None
        if decision == "hold" and prior != "hold":
            busy = ", ".join(f"{ns}/{name}" for ns, name in rolling) or "none"
            reason, message = PENDING, (
                f"the inventory agent's image {wanted} waits for its turn (it runs {current}): {limit()} lmcache "
                f"StatefulSet(s) take a new agent image at a time, cluster-wide, each once the last one's servers "
                f"are Ready again, so no two servers lose L1 together; rolling now: {busy}")
        elif decision == "roll":
            reason, message = UPDATING, (f"the lmcache servers restart, one at a time, for the inventory agent's image "
                                         f"{wanted} (was {current}): L1 of each restarted server is lost, L2 stays")
        if reason is not None:
            kube.post_event(body, "Normal", reason, message)
            log.info("%s/%s %s: %s", key[0], key[1], reason, message)
        return current if decision == "hold" and current else wanted

    def may_go(self, key: plan.Key, fleet: Mapping[plan.Key, plan.AgentSet], now: float | None = None) -> bool:
        """Whether an apply now would give this StatefulSet the wanted agent image it lacks (the refresh then applies it)."""
        wanted = agent_image()
        mine = fleet.get(key)
        if mine is None or mine.image is None or mine.image == wanted:
            return False
        with self._lock:
            return self._decide(key, wanted, fleet, time.monotonic() if now is None else now) in ("roll", "idle", "rolling")

    def forget(self, key: plan.Key) -> None:
        with self._lock:
            self._claimed.pop(key, None)
            self._told.pop(key, None)


ROLLER = Roller()
