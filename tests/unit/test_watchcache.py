"""The watch cache's own logic (kvpersist.controller.watchcache), with a scripted list and watch in
place of the API server (the real one: tests/e2e/test_idle_reads.py): it never answers before it
has listed, nor after a failed watch until it has listed anew; deletes and changes land; and the
Secret cache keeps metadata only, never data."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpersist.controller import ownership, watchcache


def secret(name: str, version: str, data: str = "c2VjcmV0") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": version, "labels": {"a": "b"}},
            "data": {"master-key": data}}


class Script:
    """A list answer per call, and watch events fed from the test."""

    def __init__(self, listings: list[list[dict[str, Any]] | Exception]) -> None:
        self.listings = listings
        self.events: queue.Queue[tuple[str, dict[str, Any]] | Exception | None] = queue.Queue()
        self.lists = 0

    def lister(self, scope: str | None, keep: watchcache.Keep) -> tuple[list[dict[str, Any]], str]:
        answer = self.listings[min(self.lists, len(self.listings) - 1)]
        self.lists += 1
        if isinstance(answer, Exception):
            raise answer
        return [keep(o) for o in answer], "1"

    def watcher(self, scope: str | None, version: str, stop: threading.Event) -> Iterator[tuple[str, dict[str, Any]]]:
        while not stop.is_set():
            try:
                item = self.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item


def until(probe: Any, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := probe()):
            return got
        time.sleep(0.01)
    raise AssertionError("timed out")


@pytest.fixture()
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watchcache, "BACKOFFS_S", (0.05,))


def make(script: Script) -> watchcache.WatchCache:
    return watchcache.WatchCache("Secret", ("ns",), script.lister, script.watcher, keep=watchcache.secrets(("ns",), ("a",)).keep)


def test_nothing_is_answered_before_the_first_listing(fast: None) -> None:
    script = Script([RuntimeError("API server down"), [secret("k", "5")]])
    cache = make(script)
    assert cache.lookup("ns", "k") == (False, None)  # not started: cannot say
    cache.start()
    try:
        _, found = until(lambda: (r := cache.lookup("ns", "k"))[0] and r)
        assert found == {"metadata": {"name": "k", "namespace": "ns", "resourceVersion": "5", "labels": {"a": "b"},
                                      "annotations": {}}}
        assert "data" not in found and script.lists == 2
    finally:
        cache.stop()


def test_changes_and_deletes_land_and_a_failed_watch_unsyncs_until_the_next_listing(fast: None) -> None:
    gate = threading.Event()
    script = Script([[secret("k", "5")]])
    relisted: list[list[dict[str, Any]] | Exception] = [[secret("k", "9"), secret("other", "10")]]

    def lister(scope: str | None, keep: watchcache.Keep) -> tuple[list[dict[str, Any]], str]:
        if script.lists >= 1:
            gate.wait(5)  # hold the second listing until the test has looked
            script.listings = relisted
        return Script.lister(script, scope, keep)

    cache = watchcache.WatchCache("Secret", ("ns",), lister, script.watcher, keep=watchcache.secrets(("ns",)).keep)
    cache.start()
    try:
        until(lambda: cache.lookup("ns", "k")[0])
        script.events.put(("MODIFIED", secret("k", "6")))
        until(lambda: (cache.lookup("ns", "k")[1] or {}).get("metadata", {}).get("resourceVersion") == "6")
        script.events.put(("DELETED", secret("k", "7")))
        until(lambda: cache.lookup("ns", "k") == (True, None))
        script.events.put(RuntimeError("watch broke"))  # e.g. a 410: the version expired
        until(lambda: not cache.lookup("ns", "k")[0])  # unsynced: callers read by request
        assert cache.lookup("ns", "other") == (False, None)
        gate.set()
        until(lambda: cache.lookup("ns", "other")[0])
        assert cache.lookup("ns", "k")[1]["metadata"]["resourceVersion"] == "9"  # the new listing replaced the old
    finally:
        gate.set()
        cache.stop()


def test_a_namespace_outside_the_scopes_is_never_answered() -> None:
    cache = watchcache.WatchCache("Secret", ("ns",), Script([[]]).lister, Script([[]]).watcher, keep=watchcache.secrets(("ns",)).keep)
    assert cache.lookup("elsewhere", "k") == (False, None)


def test_the_scope_follows_the_watched_namespaces() -> None:
    from kvpersist.controller import runtime

    try:
        for named, scope in (((), None), (("a", "b"), ("a", "b")), (("a", "team-*"), None)):
            runtime.set_peering(None, "", 0, named)
            assert runtime.named_namespaces() == scope
    finally:
        runtime.set_peering(None, "", 0)


def test_only_what_is_read_of_a_secret_or_configmap_is_kept() -> None:
    """Issue 58 item 1: anyone who may create a Secret or ConfigMap in a watched namespace decides
    its size; the caches keep its identity, the labels the operator reads (its own, and the
    chart's secretLabel key) and the annotations it protects, never the rest."""
    from kvpersist.builders.retained import ARGOCD_SYNC_OPTIONS

    # Its controller, which says whose a derived name is (ownership.controller_uid), without its name.
    owner = {"apiVersion": "kvpersist.dev/v1alpha1", "kind": "KVCacheNamespace", "name": "n" * 253, "uid": "c",
             "controller": True, "blockOwnerDeletion": True}
    controller = [{"apiVersion": "kvpersist.dev/v1alpha1", "kind": "KVCacheNamespace", "uid": "c", "controller": True}]
    hostile = {"metadata": {"name": "x", "namespace": "ns", "uid": "u", "resourceVersion": "3",
                            "labels": {**{f"l{i}": "v" * 60 for i in range(1500)}, "usable": "yes",
                                       "app.kubernetes.io/managed-by": "kvpersist"},
                            "annotations": {"big": "a" * 256 * 1024, ARGOCD_SYNC_OPTIONS: "Prune=false"},
                            "ownerReferences": [{"kind": "X", "name": "y", "uid": "z"}] * 100 + [owner],
                            "managedFields": [{"manager": "m"}] * 100}}
    assert watchcache.secrets(("ns",), ("usable",)).keep(hostile) == {"metadata": {
        "name": "x", "namespace": "ns", "uid": "u", "resourceVersion": "3", "ownerReferences": controller,
        "labels": {"usable": "yes", "app.kubernetes.io/managed-by": "kvpersist"},
        "annotations": {ARGOCD_SYNC_OPTIONS: "Prune=false"}}}
    assert watchcache.names_view(hostile) == {"metadata": {"name": "x", "namespace": "ns", "uid": "u", "resourceVersion": "3",
                                                           "ownerReferences": controller}}
    assert ownership.controller_uid(watchcache.names_view(hostile)["metadata"]) == "c"
    assert watchcache.configmaps(("ns",)).keep is watchcache.names_view
    assert watchcache.secrets(("ns",), ("usable",)).keep(hostile)["metadata"]["labels"]["usable"] == "yes"


def test_each_page_of_a_list_is_cut_down_as_it_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    """A relist holds one raw page at a time: kube.list_page keeps each page's objects as it reads
    them, in small pages for Secrets and ConfigMaps (SMALL_PAGE), before asking for the next."""
    from kvpersist.controller import kube

    held: list[int] = []
    pages = [[{"metadata": {"name": f"o{p}-{i}", "namespace": "ns", "labels": {"l": "v" * 1000}}} for i in range(3)]
             for p in range(3)]
    kept: list[dict[str, Any]] = []

    class Response:
        def __init__(self, data: bytes) -> None:
            self.data = data

    class Client:
        def request(self, method: str, path: str, **kwargs: Any) -> Response:
            n = int(kwargs["_continue"] or 0)
            held.append(len(kept))  # objects kept before this page was asked for
            assert kwargs["limit"] == watchcache.SMALL_PAGE
            meta = {"resourceVersion": "7", **({"continue": str(n + 1)} if n + 1 < len(pages) else {})}
            return Response(json.dumps({"items": pages[n], "metadata": meta}).encode())

    def keep(obj: Any) -> dict[str, Any]:
        kept.append(watchcache.names_view(obj))
        return kept[-1]

    class Resource:
        def path(self, namespace: str | None = None) -> str:
            return f"/api/v1/namespaces/{namespace}/configmaps"

    monkeypatch.setattr(kube, "client", Client)
    monkeypatch.setattr(kube, "_resource", lambda *_a: Resource())
    items, version = watchcache.configmaps(("ns",)).lister("ns", keep)
    assert version == "7" and held == [0, 3, 6] and items == kept and len(items) == 9
    assert all("labels" not in i["metadata"] for i in items)


def test_every_cache_the_operator_makes_lists_through_its_keep() -> None:
    """Each lister takes the cache's keep and cuts each page with it (the relist calls
    lister(scope, keep)): one that took the scope alone failed every listing, and its cache never
    synced (the creator-rights policy's caches, found by the e2e suite)."""
    import inspect

    from kvpersist.controller import admissioncheck

    caches = [watchcache.secrets(("ns",)), watchcache.claims(("ns",)), watchcache.configmaps(("ns",)),
              watchcache.attached_pods(("ns",)), admissioncheck._by_name("ValidatingAdmissionPolicy", "p")]
    for cache in caches:
        assert list(inspect.signature(cache.lister).parameters)[1:] == ["keep"], cache.kind
