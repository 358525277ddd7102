"""What every role of the controller shares: the one Controller, kopf's settings (configure), the
policy and peering that `kvpersist run` sets, and whether this replica may write (active).

Other modules read runtime.CONTROLLER (never `from ... import CONTROLLER`), so a Controller put in
its place (a test's fresh one) is the one every role uses.
"""

from __future__ import annotations

import logging
import os
import random
import socket
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from kvpersist.controller import kube
from kvpersist.controller.state import Controller
from kvpersist.status.workloads import WATCH_SELECTOR, WATCHED

PREFIX = "kvpersist.dev"
STATUS_INTERVAL_S = 10.0

# Everything the operator remembers, per resource and across them (kvpersist.controller.state).
CONTROLLER = Controller()

# listing_scopes' answer when the operator serves the whole cluster: one LIST of all namespaces.
ALL_NAMESPACES: tuple[str | None, ...] = (None,)
PATTERN_CHARACTERS = "*?[!,"  # kopf's namespace patterns: globs, negations, comma-separated lists
# What listing_scopes' callers list: every KVCacheNamespace (a bucket prefix's users, gc's last
# look) and the pods carrying a namespace id (gc's last look).
CROSS_NAMESPACE_LISTS = (("kvpersist.dev", "kvcachenamespaces"), ("", "pods"))


def named_namespaces() -> tuple[str, ...] | None:
    """The namespaces `kvpersist run --namespace` named (each once), or None when it watches all of them or a pattern."""
    named = CONTROLLER.peering["namespaces"]
    if not named or any(c in ns for ns in named for c in PATTERN_CHARACTERS):
        return None
    return tuple(dict.fromkeys(named))


def listing_scopes() -> tuple[str | None, ...]:
    """Where a LIST meant to see every namespace's objects goes (a bucket prefix's users, gc's last
    look): the whole cluster (None) when the operator watches all namespaces or a pattern, or may
    list those kinds cluster-wide anyway; else each watched namespace, where the chart's Roles grant
    it (all it serves). Asks the API server once per kind. Raises ApiException. Blocking."""
    named = named_namespaces()
    if named is None:
        return ALL_NAMESPACES
    if CONTROLLER.lists_cluster_wide is None:
        CONTROLLER.lists_cluster_wide = all(kube.may("list", group, plural) for group, plural in CROSS_NAMESPACE_LISTS)
    return ALL_NAMESPACES if CONTROLLER.lists_cluster_wide else named


API_ERROR_BACKOFFS = (1, 1, 2, 3, 5, 8, *(10,) * 40)  # about 7 minutes


# kopf's per-event handlers (tracking.track, the drift watches): kopf logs "Handler 'x' succeeded." for
# each call, at 500 resources thousands of lines a minute and a twentieth of the CPU, saying nothing.
EVENT_HANDLERS = frozenset({"track", "drift"})


def _not_event_handler_success(record: logging.LogRecord) -> bool:
    msg = record.msg
    return not (record.levelno <= logging.INFO and isinstance(msg, str) and msg.startswith("Handler '")
                and msg.endswith("' succeeded.") and msg[9:-12] in EVENT_HANDLERS)


def quiet_event_handler_logs() -> None:
    """Drops kopf's success lines of EVENT_HANDLERS (all else stays); `kvpersist run --verbose` keeps them."""
    logging.getLogger("kopf.objects").addFilter(_not_event_handler_success)


WORKER_IDLE_S = 0.5


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """kopf's bookkeeping (none while only its event handlers run: kvpersist.controller.tracking) in
    our own annotations and out of status, which our schema owns."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    # kopf's own requests, its peering keep-alive among them, retry an unreachable API server this
    # long: with kopf's default (8 tries, 54 s) a minute's outage ends the keep-alive, and with it
    # the operator. Every 10 s at most, so it is back within 10 s of the API server.
    settings.networking.error_backoffs = API_ERROR_BACKOFFS
    # kopf's worker of an object keeps its last watch event (the whole object, a pod's spec and
    # status) until it has idled this long: with kopf's 5 s, converging resources held every object
    # that changed in the last 5 s (peak RSS at 500 resources 223 MiB, 204 with 0.5 s; issue 58).
    settings.queueing.idle_timeout = WORKER_IDLE_S
    for group, version, plural in WATCHED:
        settings.watching.label_selectors[group, version, plural] = WATCH_SELECTOR
    # Peering (several replicas): a priority of our own and a short lifetime (is_active).
    settings.peering.priority = CONTROLLER.peering["priority"]
    settings.peering.lifetime = PEERING_LIFETIME_S
    # Namespaces named (the chart's watchNamespaces): kopf would list the cluster's namespaces, which
    # the chart does not grant, and hold every watch back through every refused try. Exact names
    # need no scan; CRDs are then read once at start (the chart installs them first).
    if named_namespaces() is not None:
        settings.scanning.disabled = True
    kube.load_config()


# Which replica is active, when several run with kopf peering. kopf pauses every replica that sees a live
# peer of higher or equal priority, so replicas of one Deployment (the same args) would all pause: each
# takes a random priority instead, and when the active one dies its record expires after
# PEERING_LIFETIME_S and the next highest resumes. kopf pauses only its own handlers: the status loop
# asks `active`, by the same record and rule, so a paused replica writes no status from paused caches.

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


PEERING_CHECK_S = 2.0


def set_peering(name: str | None, identity: str, priority: int, namespaces: tuple[str, ...] = ()) -> None:
    CONTROLLER.peering.update(name=name, identity=identity, priority=priority, namespaces=tuple(namespaces))
    CONTROLLER.active_seen.clear()
    CONTROLLER.lists_cluster_wide = None


def active(now: float, namespace: str | None) -> bool:
    """Whether this replica may write status for a resource in namespace: always when standalone; with
    peering, when kopf's peering object there says so (read at most every PEERING_CHECK_S). Blocking."""
    peering, seen_by_scope = CONTROLLER.peering, CONTROLLER.active_seen
    if not peering["name"]:
        return True
    scope = namespace if peering["namespaces"] else None
    seen = seen_by_scope.get(scope)
    if seen is not None and now - seen[0] < PEERING_CHECK_S:
        return seen[1]
    try:
        record = kube.get("kopf.dev/v1", "ClusterKopfPeering" if scope is None else "KopfPeering", peering["name"], scope)
    except ApiException:
        record = None
    except Exception:
        # No answer at all (the API server down: MaxRetryError, a timeout, a reset): the last verdict
        # stands, not cached anew, so the record is read again next call; never seen, standing by.
        return seen[1] if seen is not None else False
    verdict = is_active(record, peering["identity"], peering["priority"])
    if seen is None or verdict != seen[1]:
        logging.getLogger("kvpersist").info("this replica is %s%s", "active" if verdict else "standing by (a peer is active)",
                                            f" in {scope}" if scope else "")
    seen_by_scope[scope] = (now, verdict)
    return verdict
