"""Which resources the status loop refreshes on a tick: the dirty ones at once, the rest every
STATUS_INTERVAL_S."""

from __future__ import annotations

import asyncio

from kvpersist import handlers


def test_due_dirty_now_others_by_interval(monkeypatch) -> None:
    monkeypatch.setattr(handlers, "_known", {("ns", "a"): {}, ("ns", "b"): {}, ("ns", "c"): {}})
    monkeypatch.setattr(handlers, "_dirty", {("ns", "b")})
    monkeypatch.setattr(handlers, "_last_refresh", {("ns", "a"): 100.0, ("ns", "b"): 100.0})
    now = 100.0 + handlers.STATUS_INTERVAL_S / 2
    assert handlers.due(now) == [("ns", "b"), ("ns", "c")]  # b: a workload changed; c: never refreshed
    assert handlers.due(100.0 + handlers.STATUS_INTERVAL_S) == [("ns", "a"), ("ns", "b"), ("ns", "c")]


def test_workload_event_marks_its_owner_dirty(monkeypatch) -> None:
    monkeypatch.setattr(handlers, "_known", {("ns", "a"): {}})
    monkeypatch.setattr(handlers, "_dirty", set())
    sts = {"metadata": {"name": "a-lmcache", "namespace": "ns", "labels": {"app.kubernetes.io/instance": "a"}}}
    entry = asyncio.run(handlers.kvp_statefulsets(body=sts))
    asyncio.run(handlers.kvp_deployments(body={"metadata": {"namespace": "ns", "labels": {"app.kubernetes.io/instance": "zz"}}}))
    assert handlers._dirty == {("ns", "a")}
    assert list(entry) == [("ns", "a")]  # indexed under its owner


def test_seen_reads_the_indexes(monkeypatch) -> None:
    pod = {"metadata": {"name": "a-lmcache-0", "labels": {"app.kubernetes.io/component": "lmcache-server"}}}
    monkeypatch.setattr(handlers, "_indices", {"kvp_pods": {("ns", "a"): [pod]}})
    seen = handlers._seen(("ns", "a"))
    assert seen.pods == [pod] and seen.statefulsets == [] and handlers._seen(("ns", "b")).pods == []
