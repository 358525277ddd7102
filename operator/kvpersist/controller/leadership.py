"""Which replica is active, when several run with kopf peering.

kopf pauses every replica that sees a live peer of higher or equal priority, so replicas of one
Deployment (the same args) would all pause: each process takes a random priority instead, and when
the active one dies its record expires after PEERING_LIFETIME_S and the next highest resumes.
kopf pauses only its own handlers: the status loop asks here, by the same record and rule, so a
paused replica writes no status from caches kopf stopped updating.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

# How long a replica's record counts as alive without a keep-alive; kopf touches it every
# lifetime minus 5-10 s. Fail-over takes up to about this long after the active one dies.
PEERING_LIFETIME_S = 15
POD_ID_ENV = "POD_ID"  # kopf's own name for the peer id (detect_own_id)


def own_identity() -> str:
    """The id kopf will use for this process: POD_ID (the chart sets the pod name), else one made here and
    exported so that kopf and this module agree."""
    if not os.environ.get(POD_ID_ENV):
        os.environ[POD_ID_ENV] = f"{socket.gethostname()}-{os.getpid()}-{random.getrandbits(32):08x}"
    return os.environ[POD_ID_ENV]


def random_priority() -> int:
    """Distinct replicas, distinct priorities (ties would pause them all)."""
    return random.randint(1, 2**31 - 1)


def _alive(info: Mapping[str, Any], now: datetime) -> bool:
    try:
        seen = datetime.fromisoformat(str(info["lastseen"]))
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=UTC)
        return now <= seen + timedelta(seconds=int(info.get("lifetime", PEERING_LIFETIME_S)))
    except (KeyError, TypeError, ValueError):
        return False


def is_active(peering: Mapping[str, Any] | None, identity: str, priority: int, now: datetime | None = None) -> bool:
    """kopf's rule for one ClusterKopfPeering object: active unless another live peer has a priority at
    least as high. Not before kopf wrote our own record, nor unreadable: better a late status than two writers."""
    peers = (peering or {}).get("status") or {}
    if not isinstance(peers, Mapping) or identity not in peers:
        return False
    now = now or datetime.now(UTC)
    return not any(int(info.get("priority", 0)) >= priority for peer_id, info in peers.items()
                   if peer_id != identity and isinstance(info, Mapping) and _alive(info, now))
