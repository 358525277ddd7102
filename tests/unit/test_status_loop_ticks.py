"""The status loop keeps ticking while every refresh thread is busy (slow servers): its own
blocking step runs on a thread of its own, so liveness and the next round do not wait on them."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest

from kvpersist.controller import runtime, state, status_loop


def test_ticks_go_on_while_every_refresh_thread_is_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    calls: list[float] = []

    def counted(keys: list[Any], now: float) -> list[Any]:
        calls.append(now)
        return []

    monkeypatch.setattr(status_loop, "TICK_S", 0.01)
    monkeypatch.setattr(status_loop, "_active_keys", counted)
    busy = [runtime.CONTROLLER.refresh_pool.submit(release.wait, 10) for _ in range(state.REFRESH_CONCURRENCY)]

    async def run_for(seconds: float) -> None:
        task = asyncio.create_task(status_loop._status_loop(logging.getLogger("test")))
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(run_for(0.5))
    finally:
        release.set()
        for f in busy:
            f.result(10)
    assert len(calls) >= 5, calls  # with the refresh pool full, none would have come back


def test_the_loop_outlives_ticks_that_fail_while_the_api_server_is_unreachable(monkeypatch: pytest.MonkeyPatch,
                                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A refused connection raises urllib3's MaxRetryError, no ApiException: the ticks of an outage
    fail, the loop goes on (its liveness probe stays fine) and ticks through once the server is back."""
    from urllib3.exceptions import MaxRetryError

    calls: list[str] = []

    def outage_then_back(keys: list[Any], now: float) -> list[Any]:
        if len(calls) < 5:
            calls.append("refused")
            raise MaxRetryError(None, "/apis/kopf.dev/v1/clusterkopfpeerings/x", "Connection refused")  # type: ignore[arg-type]
        calls.append("ok")
        return []

    monkeypatch.setattr(status_loop, "TICK_S", 0.01)
    monkeypatch.setattr(status_loop, "_active_keys", outage_then_back)

    async def run_until_back() -> tuple[bool, float]:
        task = asyncio.create_task(status_loop._status_loop(logging.getLogger("kvpersist.test")))
        runtime.CONTROLLER.loop_task = task
        for _ in range(500):
            await asyncio.sleep(0.01)
            if calls.count("ok") >= 3:
                break
        alive = not task.done()
        age = status_loop.status_loop_alive()  # raises when the loop has stopped
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return alive, age

    with caplog.at_level(logging.INFO, logger="kvpersist.test"):
        alive, age = asyncio.run(run_until_back())
    assert alive and age < status_loop.LOOP_STALL_S
    assert calls[:5] == ["refused"] * 5 and calls.count("ok") >= 3, calls
    said = [r.getMessage() for r in caplog.records]
    assert sum("a tick failed (MaxRetryError" in m for m in said) == 1, said  # once per outage, not every tick
    assert any("ticks succeed again" in m for m in said), said


def test_an_unanswered_peering_read_keeps_the_last_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime.active with peering, the API server gone: the last verdict stands (none: standing by),
    and the record is read again on the next call rather than cached as unknown."""
    from urllib3.exceptions import MaxRetryError

    from kvpersist.controller import kube

    reads: list[str] = []
    answers: list[Any] = [{"status": {}}]

    def get_peering(api_version: str, kind: str, name: str, namespace: str | None) -> Any:
        reads.append(name)
        answer = answers.pop(0) if answers else MaxRetryError(None, "/", "Connection refused")  # type: ignore[arg-type]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(kube, "get", get_peering)
    monkeypatch.setattr(runtime, "is_active", lambda record, identity, priority: record is not None)
    runtime.set_peering("kvpersist", "me", 0)
    try:
        assert runtime.active(100.0, None) is True  # read: a record, active
        assert runtime.active(100.0 + runtime.PEERING_CHECK_S + 1, None) is True  # refused: the last verdict
        assert runtime.active(100.0 + runtime.PEERING_CHECK_S + 1.1, None) is True  # read again, not cached
        assert len(reads) == 3
        runtime.CONTROLLER.active_seen.clear()
        assert runtime.active(200.0, None) is False  # never answered: standing by
    finally:
        runtime.set_peering(None, "", 0)


def test_every_tick_hands_freed_heap_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 58: the heap freed by a second's refreshes and watch events is trimmed on the tick after
    it, in the tick's own thread, so the operator's RSS follows what it holds, not its busiest second."""
    from kvpersist.controller import watchcache

    trims: list[str] = []
    monkeypatch.setattr(status_loop, "TICK_S", 0.01)
    monkeypatch.setattr(status_loop, "_active_keys", lambda keys, now: [])
    monkeypatch.setattr(watchcache, "trim", lambda: trims.append(threading.current_thread().name) or True)

    async def run_for(seconds: float) -> None:
        task = asyncio.create_task(status_loop._status_loop(logging.getLogger("test")))
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run_for(0.3))
    assert len(trims) >= 5, trims
    assert all(name.startswith("kvp-tick") for name in trims), trims  # never on the event loop
