"""vLLM without the cache while its lmcache servers are unavailable, and back when they return.

vLLM with `--kv-transfer-config` stays Pending (its pod affinity) while no server of its id runs
on its node, and its connector gives up after mq_timeout (300 s). A cache is an optimisation,
serving is not: LMCacheReady false for FALLBACK_AFTER_S rolls vLLM without the connector and that
affinity (condition CacheBypassed); true again for RECOVER_AFTER_S (a flapping server must not roll
vLLM back and forth) rolls it back. The cache's data and servers are untouched either way.
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
    """Whether the stored status says vLLM runs without the cache (a restarted operator keeps it so,
    rather than rolling vLLM back to a cache still away)."""
    conds = ((body.get("status") or {}).get("conditions")) or []
    # Not the other bypasses: buildcheck and canary keep theirs; route names are decided at every apply.
    return any(c.get("type") == CONDITION and c.get("status") == "True"
               and c.get("reason") not in ("BuildMismatch", "RouteNameTaken", "HitMismatch") for c in conds)


class Fallback:
    """Per resource: since when its servers are (un)available, and whether vLLM runs without the cache.
    Used from worker threads, hence the lock."""

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
        """One status round's view of the servers: True when vLLM goes without the cache now, False
        when back with it, None when nothing changes."""
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
