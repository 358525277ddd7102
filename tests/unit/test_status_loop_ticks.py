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
