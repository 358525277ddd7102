"""Which failures of an apply to retry, and when.

An object refused as invalid (400, 422) is refused until the spec changes: ApplyFailed, for that
generation. Anything else may pass later (403: RBAC propagating, a full quota, a webhook down; 404:
a namespace or CRD not there yet; 409, 429, 5xx, no answer): retried with per-resource exponential
backoff (5 s, 10 s, ... up to 5 minutes), Ready False ApplyRetrying meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass

INVALID = frozenset({400, 422})
BASE_DELAY_S = 5.0
MAX_DELAY_S = 300.0


def delay(attempt: int) -> float:
    """Seconds before try attempt + 1, after `attempt` failures (1, 2, ...)."""
    return min(BASE_DELAY_S * 2 ** max(attempt - 1, 0), MAX_DELAY_S)


@dataclass(frozen=True)
class Pending:
    """A resource whose last apply failed transiently."""

    attempts: int
    due_at: float  # monotonic
    message: str
    generation: int | None
    due_wall: float = 0.0  # the same moment as a Unix time, for status (a message that stays the same)


class Backoff:
    """Per-resource retry state, shared by the event loop and worker threads (hence the lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[Hashable, Pending] = {}

    def failed(self, key: Hashable, generation: int | None, message: str, now: float) -> Pending:
        with self._lock:
            before = self._pending.get(key)
            attempts = before.attempts + 1 if before and before.generation == generation else 1
            wait = delay(attempts)
            self._pending[key] = Pending(attempts, now + wait, message, generation, round(time.time() + wait))
            return self._pending[key]

    def succeeded(self, key: Hashable) -> None:
        with self._lock:
            self._pending.pop(key, None)

    forget = succeeded

    def pending(self, key: Hashable) -> Pending | None:
        with self._lock:
            return self._pending.get(key)

    def due(self, key: Hashable, now: float) -> bool:
        """Whether an apply of this resource may run now (no failure pending, or its wait is over)."""
        with self._lock:
            pending = self._pending.get(key)
            return pending is None or now >= pending.due_at
