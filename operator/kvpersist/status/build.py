"""The runtime build check, read back: the refusals the pods' container statuses carry
(kvpersist.builders.buildcheck's script exits EXIT_CODE with MISMATCH_PREFIX... as its termination
message), and the verdict kvpersist.status.conditions turns into BuildVerified. Acted on (BuildBypass):
a vLLM pod that refused sends vLLM without the cache for that namespace id, so serving goes on; a
server that refuses is only not ready.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpersist.builders.buildcheck import EXIT_CODE, MISMATCH_PREFIX
from kvpersist.builders.target import NAMESPACE_ID_LABEL, SERVER, VLLM

CONDITION = "BuildVerified"
MISMATCH = "BuildMismatch"


@dataclass(frozen=True)
class Refusal:
    """A container that refused to start over its versions, as its pod's status tells it."""

    pod: str
    container: str
    component: str  # SERVER or VLLM
    message: str  # its termination message (MISMATCH_PREFIX ...)

    @property
    def detail(self) -> str:
        return f"pod {self.pod} ({self.container}): {self.message[len(MISMATCH_PREFIX):].strip()}"


def refusal_of(status: Mapping[str, Any], exit_code: int = EXIT_CODE, prefix: str = MISMATCH_PREFIX) -> Mapping[str, Any] | None:
    """The container's terminated state with a refusal (exit_code, its message starting with prefix: the build
    check's unless told), now (Error) or else last (while in CrashLoopBackOff)."""
    for key in ("state", "lastState"):
        term = (status.get(key) or {}).get("terminated")
        if term and term.get("exitCode") == exit_code and str(term.get("message") or "").startswith(prefix):
            return term
    return None


def refusals(pods: Iterable[Mapping[str, Any]], namespace_id: str | None) -> list[Refusal]:
    """Refusals among pods of the current namespace id (an old pod mid-rollout ran another
    build, or was told another), sorted by pod, so the condition's message is stable."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if namespace_id is None or labels.get(NAMESPACE_ID_LABEL) != namespace_id or meta.get("deletionTimestamp"):
            continue
        out += [Refusal(meta.get("name", ""), status.get("name", ""), labels.get("app.kubernetes.io/component", ""),
                        str(term["message"]))
                for status in (pod.get("status") or {}).get("containerStatuses") or [] if (term := refusal_of(status)) is not None]
    return sorted(out, key=lambda r: (r.component != SERVER, r.pod, r.container))


BYPASS_PREFIX = "vLLM refused to start with the cache, "
BYPASS_SUFFIX = (": it runs without the cache (no --kv-transfer-config) until spec.image or "
                 "spec.identity.connectorBuild changes")


def bypass_message(detail: str) -> str:
    """The CacheBypassed message while vLLM runs without the cache over its versions."""
    return f"{BYPASS_PREFIX}{detail}{BYPASS_SUFFIX}"


def detail_of(message: str) -> str | None:
    if message.startswith(BYPASS_PREFIX) and message.endswith(BYPASS_SUFFIX):
        return message[len(BYPASS_PREFIX):-len(BYPASS_SUFFIX)]
    return None


@dataclass(frozen=True)
class BuildVerdict:
    """What the build check found for one resource, for kvpersist.status.conditions."""

    connector_build: str | None
    refusals: tuple[Refusal, ...] = ()
    vllm_bypass: str | None = None  # the refusal detail while vLLM runs without the cache over it


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
