"""Which resources the status loop refreshes on a tick: the dirty ones at once, the rest every
STATUS_INTERVAL_S."""

from __future__ import annotations

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
    handlers.workload_changed(body={"metadata": {"namespace": "ns", "labels": {"app.kubernetes.io/instance": "a"}}})
    handlers.workload_changed(body={"metadata": {"namespace": "ns", "labels": {"app.kubernetes.io/instance": "zz"}}})
    assert handlers._dirty == {("ns", "a")}
