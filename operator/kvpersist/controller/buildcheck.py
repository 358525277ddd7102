"""The runtime build check, acted on: a vLLM pod that refused its versions (kvpersist.status.build) sends
vLLM without the cache for that namespace id, so serving goes on; a server that refuses is only not ready.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from kvpersist.builders.target import VLLM
from kvpersist.status.build import MISMATCH, Refusal, detail_of


class BuildBypass:
    """Per resource: the namespace id for which a vLLM pod refused its versions, and what it said. Final for
    that id (a fix gives another); kept in status (CacheBypassed) across restarts. Worker threads: the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: dict[Hashable, tuple[str, str]] = {}  # key -> (namespace id, refusal detail)
        self._seeded: set[Hashable] = set()

    def seed(self, key: Hashable, body: Mapping[str, Any]) -> None:
        """The bypass the stored status shows, taken once per resource (an operator restart)."""
        with self._lock:
            if key in self._seeded:
                return
            self._seeded.add(key)
            status = body.get("status") or {}
            for c in status.get("conditions") or []:
                if c.get("type") == "CacheBypassed" and c.get("status") == "True" and c.get("reason") == MISMATCH:
                    detail = detail_of(str(c.get("message") or ""))
                    if detail is not None and status.get("namespaceId"):
                        self._by[key] = (status["namespaceId"], detail)

    def observe(self, key: Hashable, namespace_id: str | None, found: Iterable[Refusal]) -> bool:
        """One round's refusals; True when vLLM is to go without the cache from now on."""
        with self._lock:
            self._seeded.add(key)
            if namespace_id is None or (key in self._by and self._by[key][0] == namespace_id):
                return False
            first = next((r for r in found if r.component == VLLM), None)
            if first is None:
                return False
            self._by[key] = (namespace_id, first.detail)
            return True

    def detail(self, key: Hashable, namespace_id: str | None) -> str | None:
        """What the refusing vLLM pod said, while vLLM runs without the cache for this id."""
        with self._lock:
            held = self._by.get(key)
            return held[1] if held and namespace_id is not None and held[0] == namespace_id else None

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._by.pop(key, None)
            self._seeded.discard(key)
