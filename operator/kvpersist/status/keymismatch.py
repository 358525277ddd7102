"""A server that refused to start with another key than its namespace's, read back from its pod.

kvpersist.inserver.serve refuses so (reading and removing nothing) when the key Secret's bytes were
rotated and a container restarted before its pod rolled: only the pod's container status says so.
MESSAGE parses serve's KEY_MISMATCH_FORMAT (tests/unit/test_key_mismatch.py checks they agree).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpersist.builders.target import NAMESPACE_ID_LABEL
from kvpersist.inserver.serve import KEY_MISMATCH_EXIT_CODE, KEY_MISMATCH_PREFIX
from kvpersist.status.build import refusal_of

PREFIX = KEY_MISMATCH_PREFIX  # how the server's termination message starts
EXIT_CODE = KEY_MISMATCH_EXIT_CODE  # EX_CONFIG: restarting with the same key file will not help
KEY_MISMATCH = "L2KeyMismatch"  # L2Ready's reason, and the Warning event's
MESSAGE = re.compile(re.escape(PREFIX) + r"key file fingerprint (?P<found>[0-9a-f]{16}), namespace "
                     r"(?P<namespace>kvp-[0-9a-f]{32}) expects (?P<expected>[0-9a-f]{16}): refusing to start")
MESSAGE_MAX = 1024


@dataclass(frozen=True)
class KeyRefusal:
    """A server container that refused its mounted key, as its pod's status tells it."""

    pod: str
    found: str | None  # the mounted key file's fingerprint (None: the message did not parse)
    namespace: str | None  # the namespace id the pod serves
    expected: str | None  # the fingerprint that namespace id was computed with
    message: str


def refused_now(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The container's refusal while it lasts: terminated with it, or waiting after it (CrashLoopBackOff);
    one running again (the old bytes put back) is not refusing, though its lastState says it did."""
    return None if "running" in (status.get("state") or {}) else refusal_of(status, EXIT_CODE, PREFIX)


def refusals(pods: Iterable[Mapping[str, Any]]) -> list[KeyRefusal]:
    """Refusals among the resource's server pods, whatever namespace id they serve (an old pod
    restarted on rotated bytes is of the old one), sorted by pod, so the message is stable."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        term = next((t for status in statuses if (t := refused_now(status)) is not None), None)
        if meta.get("deletionTimestamp") or term is None:
            continue
        message = str(term.get("message") or "").strip()
        parsed = MESSAGE.match(message)
        namespace = parsed["namespace"] if parsed else (meta.get("labels") or {}).get(NAMESPACE_ID_LABEL)
        out.append(KeyRefusal(meta.get("name", ""), parsed["found"] if parsed else None, namespace,
                              parsed["expected"] if parsed else None, message[:MESSAGE_MAX]))
    return sorted(out, key=lambda r: r.pod)


def condition_message(found: list[KeyRefusal], secret: tuple[str, str] | None, generated: bool) -> str:
    """L2Ready's message: the Secret, both fingerprints, the namespace, and what to do."""
    first = found[0]
    where = (f"{'the generated Secret' if generated else 'Secret'} {secret[0]} key {secret[1]}"
             f"{'' if generated else ' (spec.l2.encryption.keySecretRef)'}" if secret else "the key Secret the pod mounts")
    pods = ", ".join(r.pod for r in found)
    if first.found is None or first.expected is None:
        what = f"it says: {first.message.removeprefix(PREFIX)}"
        head = f"{where} holds another key than the one the servers' namespace was computed with ({what})"
    else:
        head = (f"{where} now holds the key of fingerprint {first.found}, not the one namespace {first.namespace} was "
                f"computed with (fingerprint {first.expected})")
    return (f"{head}: lmcache server pod(s) {pods} refuse to start on it (exit {EXIT_CODE}); nothing was read or deleted. "
            "The operator rolls the servers to the namespace of the key the Secret holds now (a new namespace: the data "
            f"of {first.namespace or 'the old one'} stays, an orphan, served again if its key comes back). To keep serving "
            f"namespace {first.namespace or 'the old one'} meanwhile, put the old bytes (fingerprint "
            f"{first.expected or 'as before'}) back in the Secret. vLLM runs without the cache once the servers have "
            "been unavailable for the fallback bound (CacheBypassed)")


def event_key(message: str | None) -> str | None:
    """What makes a mismatch another one for the event (posted once each): the message before the
    pods, which come and go as they restart and roll."""
    return None if message is None else message.split(": lmcache server pod(s) ", 1)[0]
