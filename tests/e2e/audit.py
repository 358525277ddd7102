"""What the API server recorded of an identity's requests: its audit log (hack/localcluster.py
writes one for ServiceAccounts outside kube-system), so a test counts writes as the cluster saw
them, not as a process says it made them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
# Each replica keeps its own record in the peering object alive, active or not: kopf's heartbeat.
PEERING = frozenset({"kopfpeerings", "clusterkopfpeerings"})
POD_NAME = "authentication.kubernetes.io/pod-name"  # in user.extra for a token bound to a pod


def events(audit_log: Path, user: str, stages: tuple[str, ...] = ("ResponseComplete",)) -> Iterator[dict[str, Any]]:
    """The completed requests of `user` (or those at the given stages: a watch's ResponseStarted),
    oldest first (the rotated file, if any, before the live one)."""
    rotated = sorted(p for p in audit_log.parent.glob(audit_log.stem + "-*" + audit_log.suffix))
    for path in [*rotated, audit_log]:
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if f'"{user}"' not in line:
                continue
            event = json.loads(line)
            if event.get("user", {}).get("username") == user and event.get("stage") in stages:
                yield event


def at(event: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(event["stageTimestamp"].replace("Z", "+00:00"))


def writes(audit_log: Path, user: str, pod: str | None = None, since: datetime | None = None,
           until: datetime | None = None) -> list[str]:
    """The writes of one identity (a ServiceAccount, and the pod its token is bound to when given)
    between since and until, peering heartbeats left out: "verb resource[/sub] namespace/name"."""
    out = []
    for event in events(audit_log, user):
        ref = event.get("objectRef") or {}
        if event["verb"] not in WRITE_VERBS or ref.get("resource") in PEERING:
            continue
        if pod is not None and (event["user"].get("extra") or {}).get(POD_NAME) != [pod]:
            continue
        if (since is not None and at(event) < since) or (until is not None and at(event) >= until):
            continue
        sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
        out.append(f"{event['verb']} {ref.get('resource')}{sub} {ref.get('namespace', '')}/{ref.get('name', '')}")
    return out
