"""Watch caches of what the status refresh used to read by request every round (100+ reads a second
at 500 resources), of objects kopf's indexes never see (no operator labels): one list, then one watch,
per watched namespace, each in a thread of its own; until a cache has listed, callers read by request.
Each object is cut down as its page arrives, and all but claims and pods are listed in small pages:
whoever may create one decides its size (400 ConfigMaps of 1,500 labels and a 250 KiB annotation took
the operator from 110 to 330 MiB; issue 58).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvpersist.api.attachpolicy import LABEL as ATTACH_LABEL
from kvpersist.builders.retained import INSTANCE_LABEL, PROTECTED_ANNOTATIONS, TRACKING_LABEL
from kvpersist.controller import kube
from kvpersist.controller.stale_routes import ROUTE_KINDS, ROUTE_LABELS
from kvpersist.status.workloads import COMPONENT_LABEL, attached_view, slim

WATCH_TIMEOUT_S = 300  # the API server ends each watch after this; the next starts from the last resourceVersion
BACKOFFS_S = (1, 2, 5, 10)  # after a failed list or watch (the API server down, a 410), then every 10 s
SMALL_PAGE = 10  # objects per page of a metadata-only list: a page is held whole until it is cut down
Keep = Callable[[Mapping[str, Any]], dict[str, Any]]
Lister = Callable[[str | None, Keep], tuple[list[dict[str, Any]], str]]  # each item already kept
Watcher = Callable[[str | None, str, threading.Event], Iterator[tuple[str, dict[str, Any]]]]
# The labels the operator reads on a Secret: its own key's (controller.ownership.is_own_key_secret).
OWN_LABELS = ("app.kubernetes.io/managed-by", COMPONENT_LABEL, INSTANCE_LABEL, TRACKING_LABEL)
_IDENTITY = ("name", "namespace", "uid", "resourceVersion", "deletionTimestamp")
_CONTROLLER_REF = ("apiVersion", "kind", "uid", "controller")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None where the C library is another (musl, macOS): nothing to trim there."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - raises AttributeError where it is not glibc's
    except (OSError, AttributeError):
        return None
    return libc


def trim() -> bool:
    """malloc_trim(0): freed heap back to the system. glibc keeps what Python frees, and every watch event
    and API answer is parsed JSON freed a moment later: untrimmed, the process stays at its busiest
    second's size (at 500 resources a trim every tick took peak RSS from 245 to 223 MiB; issue 58).
    Milliseconds; ctypes lets the GIL go meanwhile. False: no glibc, nothing trimmed."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def names_view(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Whether it exists, its version and its controller: all that is read of a ConfigMap
    (ReferencesFound, and whose a name an apply takes is: ownership.controller_uid)."""
    meta = obj.get("metadata") or {}
    out = {k: meta[k] for k in _IDENTITY if k in meta}
    controllers = [{k: ref.get(k) for k in _CONTROLLER_REF} for ref in meta.get("ownerReferences") or [] if ref.get("controller")]
    if controllers:
        out["ownerReferences"] = controllers[:1]  # the API server admits one
    return {"metadata": out}


def labelled_view(label_keys: tuple[str, ...], annotation_keys: tuple[str, ...] = ()) -> Keep:
    """names_view, and of the labels and annotations only those read."""

    def keep(obj: Mapping[str, Any]) -> dict[str, Any]:
        out = names_view(obj)
        meta = obj.get("metadata") or {}
        labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        out["metadata"]["labels"] = {k: labels[k] for k in label_keys if k in labels}
        if annotation_keys:
            out["metadata"]["annotations"] = {k: annotations[k] for k in annotation_keys if k in annotations}
        return out
    return keep


class WatchCache:
    """Objects of one kind in the given namespaces (None: cluster-wide), kept fresh by a watch."""

    def __init__(self, kind: str, namespaces: tuple[str, ...] | None, lister: Lister, watcher: Watcher, keep: Keep) -> None:
        self.kind, self.lister, self.watcher, self.keep = kind, lister, watcher, keep
        self.scopes: tuple[str | None, ...] = namespaces if namespaces else (None,)
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}
        self._synced: dict[str | None, bool] = dict.fromkeys(self.scopes, False)
        self._listed: set[str | None] = set()  # scopes that have listed at least once
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def start(self) -> None:
        for scope in self.scopes:
            threading.Thread(target=self._run, args=(scope,), name=f"kvpersist-cache-{self.kind}-{scope or 'all'}",
                             daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def listed_once(self) -> bool:
        """Whether every scope has listed once: the operator's readiness (never unset, so an outage does not flap it)."""
        with self._lock:
            return self._listed >= set(self.scopes)

    def _synced_for(self, namespace: str) -> bool:
        """Whether the scope holding namespace has a listing; call with the lock held."""
        return self._synced.get(namespace if namespace in self._synced else None, False)

    def lookup(self, namespace: str, name: str) -> tuple[bool, dict[str, Any] | None]:
        """(synced, the object or None when there is none). Not synced: the cache cannot say."""
        with self._lock:
            if not self._synced_for(namespace):
                return False, None
            found = self._objects.get((namespace, name))
            return True, (dict(found) if found is not None else None)

    def in_namespace(self, namespace: str) -> tuple[bool, list[dict[str, Any]]]:
        """(synced, copies of every object of one namespace)."""
        with self._lock:
            if not self._synced_for(namespace):
                return False, []
            return True, [dict(o) for (ns, _), o in self._objects.items() if ns == namespace]

    def everything(self) -> list[dict[str, Any]]:
        """Copies of every object held (of the scopes that have listed)."""
        with self._lock:
            return [dict(o) for o in self._objects.values()]

    def _run(self, scope: str | None) -> None:
        log = logging.getLogger("kvpersist")
        failures = 0
        while not self._stop.is_set():
            try:
                version = self._relist(scope)
                failures = 0
                while not self._stop.is_set():
                    version = self._watch(scope, version)
            except Exception as exc:  # the API server down or refusing: unsynced until a new listing
                with self._lock:
                    self._synced[scope] = False
                if failures == 0:
                    log.warning("watch cache of %s in %s: %s; reading by request until it lists again", self.kind,
                                scope or "all namespaces", exc.__class__.__name__)
                self._stop.wait(BACKOFFS_S[min(failures, len(BACKOFFS_S) - 1)])
                failures += 1

    def _relist(self, scope: str | None) -> str:
        items, version = self.lister(scope, self.keep)  # each page cut down as it arrives
        with self._lock:
            for key in [k for k in self._objects if scope is None or k[0] == scope]:
                del self._objects[key]
            for item in items:
                meta = item.get("metadata") or {}
                self._objects[(meta.get("namespace", ""), meta.get("name", ""))] = item
            self._synced[scope] = True
            self._listed.add(scope)
        # After a listing of large objects, cut down to a few fields, the process would stay at its peak.
        trim()
        return version

    def _watch(self, scope: str | None, version: str) -> str:
        """One watch, until the API server ends it; the resourceVersion to go on from. Raises on a 410 or an error."""
        for kind, obj in self.watcher(scope, version, self._stop):
            meta = obj.get("metadata") or {}
            version = meta.get("resourceVersion") or version
            if kind == "BOOKMARK":
                continue
            key = (meta.get("namespace", ""), meta.get("name", ""))
            with self._lock:
                if kind == "DELETED":
                    self._objects.pop(key, None)
                else:
                    self._objects[key] = self.keep(obj)
        return version


def list_and_watch(api_version: str, kind: str, metadata_only: bool, page: int = kube.LIST_PAGE,
                   label_selector: str | None = None, field_selector: str | None = None) -> tuple[Lister, Watcher]:
    """The list and the watch of one kind (tests/rbac_needs.py follows the kind from each caller)."""

    def lister(scope: str | None, keep: Keep) -> tuple[list[dict[str, Any]], str]:
        return kube.list_page(api_version, kind, scope, metadata_only, field_selector=field_selector,
                              label_selector=label_selector, keep=keep, page=page)

    def watcher(scope: str | None, version: str, stop: threading.Event) -> Iterator[tuple[str, dict[str, Any]]]:
        return kube.watch_page(api_version, kind, scope, version, WATCH_TIMEOUT_S, metadata_only, stop,
                               field_selector=field_selector, label_selector=label_selector)

    return lister, watcher


def attached_pods(namespaces: tuple[str, ...] | None) -> WatchCache:
    """Users' own vLLM pods attached to a resource (spec.vllm.mode Attached), by the label the attach
    policies judge, as kvpersist.status.workloads.attached_view keeps them (a pod's spec is kilobytes)."""
    return WatchCache("Pod", namespaces, *list_and_watch("v1", "Pod", False, label_selector=ATTACH_LABEL), keep=attached_view)


def secrets(namespaces: tuple[str, ...] | None, label_keys: tuple[str, ...] = ()) -> WatchCache:
    """A Secret's identity, the labels read of it (the operator's own, and label_keys: the chart's secretLabel
    key) and the annotations it protects, never the rest of its metadata."""
    keep = labelled_view(OWN_LABELS + label_keys, PROTECTED_ANNOTATIONS)
    return WatchCache("Secret", namespaces, *list_and_watch("v1", "Secret", True, SMALL_PAGE), keep=keep)


def claims(namespaces: tuple[str, ...] | None) -> WatchCache:
    return WatchCache("PersistentVolumeClaim", namespaces, *list_and_watch("v1", "PersistentVolumeClaim", False), keep=slim)


def configmaps(namespaces: tuple[str, ...] | None) -> WatchCache:
    """Metadata only: whether a ConfigMap a spec names exists (ReferencesFound), never its data."""
    return WatchCache("ConfigMap", namespaces, *list_and_watch("v1", "ConfigMap", True, SMALL_PAGE), keep=names_view)


# The kinds besides Secret and ConfigMap whose derived names an apply takes (snapshot's names check).
NAMED_KINDS = (("apps/v1", "StatefulSet"), ("apps/v1", "Deployment"), ("policy/v1", "PodDisruptionBudget"), *ROUTE_KINDS)


def names(api_version: str, kind: str, namespaces: tuple[str, ...] | None) -> WatchCache:
    """Metadata only, whose each object is (names_view), and for a route kind the labels that say
    which id and resource it routes for (stale_routes.route_conflicts)."""
    keep = labelled_view(ROUTE_LABELS) if (api_version, kind) in ROUTE_KINDS else names_view
    return WatchCache(kind, namespaces, *list_and_watch(api_version, kind, True, SMALL_PAGE), keep=keep)
