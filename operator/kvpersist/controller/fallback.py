"""vLLM without the cache while its lmcache servers are unavailable, and back when they return.

vLLM cannot start with `--kv-transfer-config` while no server of its namespace id runs on its
node: the required pod affinity keeps it Pending, and a connector that cannot reach its server
gives up after mq_timeout (300 s). A cache is an optimisation, serving is not: when LMCacheReady
has stayed false for FALLBACK_AFTER_S, vLLM is rolled without the connector (and without the
affinity to a server that only the cache needs), and the resource says so (condition
CacheBypassed). Once LMCacheReady has been true again for RECOVER_AFTER_S (so a flapping server
does not roll vLLM back and forth), vLLM is rolled back with the cache. Nothing of the cache's
data is touched either way: the servers stay as declared.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable, Mapping
from typing import Any

from kvpersist.status.workloads import UNPLACED_AFTER_S

FALLBACK_AFTER_ENV = "KVPERSIST_CACHE_FALLBACK_S"
RECOVER_AFTER_ENV = "KVPERSIST_CACHE_RECOVER_S"
FALLBACK_AFTER_S = 300.0  # a first start (image pull, torch, L1) or a restart fits within it
RECOVER_AFTER_S = 30.0
CONDITION = "CacheBypassed"


def _seconds(env: str, default: float) -> float:
    value = float(os.environ.get(env) or default)
    if value < 0:
        raise ValueError(f"{env}={value}: must be 0 or more seconds")
    return value


UNPLACED_AFTER_ENV = "KVPERSIST_UNPLACED_AFTER_S"  # tests shorten it; status.workloads.UNPLACED_AFTER_S


def unplaced_after_s() -> float:
    """How long a server the scheduler finds no node for counts against its PodDisruptionBudget."""
    return _seconds(UNPLACED_AFTER_ENV, UNPLACED_AFTER_S)


def bypassed_in(body: Mapping[str, Any]) -> bool:
    """Whether the resource's stored status says vLLM runs without the cache (so an operator that
    restarts keeps it so, rather than rolling vLLM back to a cache that is still away)."""
    conds = ((body.get("status") or {}).get("conditions")) or []
    # Not a bypass over a vLLM that refused its versions (kvpersist.controller.buildcheck keeps that
    # one), over route names another id holds (decided again at every apply: stale_routes), nor over
    # a hit that changed an answer (kvpersist.controller.canary keeps that one, from status.canary).
    return any(c.get("type") == CONDITION and c.get("status") == "True"
               and c.get("reason") not in ("BuildMismatch", "RouteNameTaken", "HitMismatch") for c in conds)


class Fallback:
    """Per resource: since when its servers are unavailable (or available again), and whether vLLM
    runs without the cache. Used from worker threads, hence the lock."""

    def __init__(self, after_s: float | None = None, recover_s: float | None = None) -> None:
        self.after_s = _seconds(FALLBACK_AFTER_ENV, FALLBACK_AFTER_S) if after_s is None else after_s
        self.recover_s = _seconds(RECOVER_AFTER_ENV, RECOVER_AFTER_S) if recover_s is None else recover_s
        self._lock = threading.Lock()
        self._since: dict[Hashable, tuple[bool, float]] = {}  # (servers ready, since when)
        self._bypassed: set[Hashable] = set()
        self._seeded: set[Hashable] = set()

    def seed(self, key: Hashable, bypassed: bool) -> None:
        """The state the stored status shows, taken once per resource (an operator restart)."""
        with self._lock:
            if key not in self._seeded:
                self._seeded.add(key)
                if bypassed:
                    self._bypassed.add(key)

    def bypassed(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._bypassed

    def observe(self, key: Hashable, servers_ready: bool, now: float) -> bool | None:
        """One status round's view of the servers. Returns the new state when it changes (True:
        vLLM goes without the cache now; False: back with it), else None."""
        with self._lock:
            self._seeded.add(key)
            ready, since = self._since.get(key, (servers_ready, now))
            if ready != servers_ready:
                since = now
            self._since[key] = (servers_ready, since)
            if not servers_ready and key not in self._bypassed and now - since >= self.after_s:
                self._bypassed.add(key)
                return True
            if servers_ready and key in self._bypassed and now - since >= self.recover_s:
                self._bypassed.discard(key)
                return False
            return None

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._since.pop(key, None)
            self._bypassed.discard(key)
            self._seeded.discard(key)
