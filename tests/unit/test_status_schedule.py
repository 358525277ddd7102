"""Which resources the status loop refreshes on a tick: the dirty ones at once, the rest every
STATUS_INTERVAL_S, or more slowly past MAX_ROUNDS_PER_S periodic rounds a second in all."""

from __future__ import annotations

import asyncio
import logging

import kopf
import pytest

from kvpersist.controller import drift, indexes, status_loop
from kvpersist.controller.state import Controller


def _flagged(controller: Controller, flag: str) -> set[tuple[str, str]]:
    """The keys whose ResourceState has this flag (dirty, drifted) set."""
    return {key for key, st in controller.resources.items() if getattr(st, flag)}


def _known(controller: Controller, *keys: tuple[str, str], **fields: object) -> None:
    """Resources a watch event has shown (an empty snapshot each), with these fields set."""
    for key in keys:
        state = controller.state(key)
        state.body = {"metadata": {"namespace": key[0], "name": key[1]}}
        for name, value in fields.items():
            setattr(state, name, value)


def test_due_dirty_now_others_by_interval(controller: Controller) -> None:
    _known(controller, ("ns", "a"), ("ns", "b"), ("ns", "c"))
    controller.state(("ns", "b")).dirty = True
    controller.state(("ns", "a")).last_refresh = controller.state(("ns", "b")).last_refresh = 100.0
    now = 100.0 + status_loop.STATUS_INTERVAL_S / 2
    assert status_loop.due(now) == [("ns", "b"), ("ns", "c")]  # b: a workload changed; c: never refreshed
    assert status_loop.due(100.0 + status_loop.STATUS_INTERVAL_S) == [("ns", "a"), ("ns", "b"), ("ns", "c")]


def test_past_the_rounds_a_second_the_periodic_rounds_slow_down_and_changes_do_not(controller: Controller,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status_loop, "MAX_ROUNDS_PER_S", 30.0)
    assert status_loop.interval(1) == status_loop.interval(300) == status_loop.STATUS_INTERVAL_S
    assert status_loop.interval(500) == 500 / 30 and status_loop.interval(1000) == 1000 / 30
    keys = [("ns", f"r{i:03d}") for i in range(600)]  # 600 resources at 30 a second: every 20 s
    _known(controller, *keys, last_refresh=100.0)
    controller.state(keys[7]).dirty = True
    assert status_loop.due(100.0 + status_loop.STATUS_INTERVAL_S) == [keys[7]]  # only the change, at once
    assert len(status_loop.due(100.0 + 20.0)) == 600
    monkeypatch.setattr(status_loop, "MAX_ROUNDS_PER_S", 0.0)  # 0: no cap, as before
    assert len(status_loop.due(100.0 + status_loop.STATUS_INTERVAL_S)) == 600


def test_workload_event_marks_its_owner_dirty(controller: Controller) -> None:
    _known(controller, ("ns", "a"))
    sts = {"metadata": {"name": "a-lmcache", "namespace": "ns", "labels": {"app.kubernetes.io/instance": "a"}}}
    entry = asyncio.run(indexes.kvp_statefulsets(body=sts))
    asyncio.run(indexes.kvp_deployments(body={"metadata": {"namespace": "ns", "labels": {"app.kubernetes.io/instance": "zz"}}}))
    assert _flagged(controller, "dirty") == {("ns", "a")}
    assert list(entry) == [("ns", "a")]  # indexed under its owner


def test_seen_reads_the_indexes(controller: Controller) -> None:
    sts = {"metadata": {"name": "a-lmcache", "uid": "s1", "labels": {},
                        "ownerReferences": [{"apiVersion": "kvpersist.dev/v1alpha1", "kind": "KVCacheNamespace",
                                             "uid": "r1", "controller": True}]}}
    pod = {"metadata": {"name": "a-lmcache-0", "labels": {"app.kubernetes.io/component": "lmcache-server"},
                        "ownerReferences": [{"kind": "StatefulSet", "uid": "s1", "controller": True}]}}
    controller.indices["kvp_pods"] = {("ns", "a"): [pod]}
    controller.indices["kvp_statefulsets"] = {("ns", "a"): [sts]}
    seen = indexes.seen_of(("ns", "a"), owner_uid="r1")  # only pods of its own workloads (indexes.trusted_pods)
    assert seen.pods == [pod] and seen.statefulsets == [sts] and indexes.seen_of(("ns", "b")).pods == []


def _child(kind_name: str, generation: int | None = None) -> dict:
    meta = {"name": kind_name, "namespace": "ns", "labels": {"app.kubernetes.io/instance": "a"}}
    if generation is not None:
        meta["generation"] = generation
    return {"metadata": meta}


def test_a_deleted_or_edited_child_marks_its_owner_for_apply(controller: Controller) -> None:
    _known(controller, ("ns", "a"))
    # The initial listing is not drift (resume applies everything then).
    asyncio.run(drift.drift(event={"type": None}, body={**_child("a-lmcache", 1), "kind": "NetworkPolicy"}))
    asyncio.run(drift.drift(event={"type": None}, body={**_child("a-lmcache", 3), "kind": "StatefulSet"}))
    assert _flagged(controller, "drifted") == set()
    asyncio.run(drift.drift(event={"type": "DELETED"}, body={**_child("a-lmcache", 1), "kind": "NetworkPolicy"}))
    assert _flagged(controller, "drifted") == {("ns", "a")}
    controller.state(("ns", "a")).drifted = False
    asyncio.run(drift.drift(event={"type": "MODIFIED"}, body={**_child("a-lmcache-1a2b3c4d"), "kind": "Service"}))
    assert _flagged(controller, "drifted") == {("ns", "a")}
    controller.state(("ns", "a")).drifted = False
    # A StatefulSet's status changes all the time: only a new generation (a spec edit) is drift.
    asyncio.run(drift.drift(event={"type": "MODIFIED"}, body={**_child("a-lmcache", 3), "kind": "StatefulSet"}))
    assert _flagged(controller, "drifted") == set()
    asyncio.run(drift.drift(event={"type": "MODIFIED"}, body={**_child("a-lmcache", 4), "kind": "StatefulSet"}))
    assert _flagged(controller, "drifted") == {("ns", "a")}
    controller.state(("ns", "a")).drifted = False
    # Children of unknown owners (another operator's, or a resource being deleted) are left alone.
    other = {"metadata": {"name": "x", "namespace": "ns", "labels": {"app.kubernetes.io/instance": "zz"}}}
    asyncio.run(drift.drift(event={"type": "DELETED"}, body={**other, "kind": "Service"}))
    assert _flagged(controller, "drifted") == set()


def test_one_slow_refresh_never_holds_up_the_others(monkeypatch, controller: Controller) -> None:
    """The loop starts each due resource's round on its own; a resource whose round still runs is
    skipped, not waited for."""
    import threading
    import time

    keys = [("ns", f"r{i}") for i in range(5)]
    _known(controller, *keys, dirty=True)
    monkeypatch.setattr(status_loop, "TICK_S", 0.05)
    release, done, calls = threading.Event(), [], []

    def refresh(body, seen, logger) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        controller.state(key).dirty = False
        controller.state(key).last_refresh = time.monotonic()
        calls.append(key)
        if key == ("ns", "r0"):
            release.wait(10)  # a server that never answers in time
        done.append(key)

    monkeypatch.setattr(status_loop, "refresh_status", refresh)

    async def run() -> None:
        loop_task = asyncio.create_task(status_loop._status_loop(logging.getLogger("test")))
        deadline = time.monotonic() + 5
        while len(done) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        controller.state(("ns", "r0")).dirty = True  # due again while its first round still hangs
        await asyncio.sleep(0.3)
        release.set()
        loop_task.cancel()
        await asyncio.gather(*controller.refresh_tasks, return_exceptions=True)

    asyncio.run(run())
    assert sorted(done[:4]) == keys[1:]  # the four others finished while r0 hung
    assert calls.count(("ns", "r0")) == 1  # and r0 was not started twice


def test_liveness_fails_when_the_status_loop_stalls(controller: Controller) -> None:
    import time

    import pytest

    controller.loop_task = None
    controller.last_tick = time.monotonic() - 2
    assert 1 <= status_loop.status_loop_alive() < status_loop.LOOP_STALL_S
    controller.last_tick = time.monotonic() - status_loop.LOOP_STALL_S - 1
    with pytest.raises(kopf.PermanentError, match="last ticked"):
        status_loop.status_loop_alive()


def test_the_operators_own_apply_is_not_drift(controller: Controller) -> None:
    """A child whose stored form differs from what is applied (e.g. `ingress: []` stored as absent)
    gets a new generation on every apply; that event must not count as someone's edit, or the
    operator would apply it again every tick."""
    _known(controller, ("ns", "a"))
    applied = _child("a-lmcache", 7)
    applied["kind"] = "NetworkPolicy"
    drift.note_own_write(applied)
    asyncio.run(drift.drift(event={"type": "MODIFIED"}, body={**_child("a-lmcache", 7), "kind": "NetworkPolicy"}))
    assert _flagged(controller, "drifted") == set()
    asyncio.run(drift.drift(event={"type": "MODIFIED"}, body={**_child("a-lmcache", 8), "kind": "NetworkPolicy"}))  # someone else
    assert _flagged(controller, "drifted") == {("ns", "a")}


def test_a_watch_event_that_beats_the_operators_own_apply_is_not_drift(controller: Controller) -> None:
    """The child's event can arrive while the apply is still in flight, before note_own_write has
    its generation (tests/e2e/test_faults.py met it: an ApplyFailed resource applied again on the
    next tick). Inside own_apply it is no drift; the same event once the apply is over is."""
    _known(controller, ("ns", "a"))
    manifest = _child("a-lmcache", 1)
    manifest["kind"] = "NetworkPolicy"
    with drift.own_apply(manifest):
        asyncio.run(drift.drift(event={"type": "ADDED"}, body={**_child("a-lmcache", 1), "kind": "NetworkPolicy"}))
    assert _flagged(controller, "drifted") == set() and controller.child_applying == {}
    asyncio.run(drift.drift(event={"type": "MODIFIED"}, body={**_child("a-lmcache", 2), "kind": "NetworkPolicy"}))  # someone else
    assert _flagged(controller, "drifted") == {("ns", "a")}


def test_a_child_without_a_generation_the_operator_created_is_not_drift(controller: Controller) -> None:
    """A Service has no generation: its ADDED event, arriving after the create
    returned, was taken for someone's edit, so every new resource was applied a second time
    (benchmarks/reconcile_bench.py scale: one extra apply per resource). The resourceVersion the
    operator's own write left tells them apart; another client's edit is a new version."""
    _known(controller, ("ns", "a"))
    created = _child("a-lmcache-1a2b3c4d")
    created["kind"], created["metadata"]["resourceVersion"] = "Service", "354"
    drift.note_own_write(created)
    asyncio.run(drift.drift(event={"type": "ADDED"}, body={**created, "kind": "Service"}))
    assert _flagged(controller, "drifted") == set()
    edited = _child("a-lmcache-1a2b3c4d")
    edited["metadata"]["resourceVersion"] = "360"  # someone else's change
    asyncio.run(drift.drift(event={"type": "MODIFIED"}, body={**edited, "kind": "Service"}))
    assert _flagged(controller, "drifted") == {("ns", "a")}
