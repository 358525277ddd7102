"""A resource deleted while the operator's watch was down (its DELETED event lost) is forgotten
once its status write finds nothing and the API server confirms it is gone; one that still exists
is kept whatever a refresh failed with."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kvpersist.controller import runtime, status_loop, tracking
from kvpersist.status.workloads import Seen

KEY = ("ns", "ghost")


@pytest.mark.parametrize(("error", "exists", "forgotten"), [
    (ApiException(status=404), False, True),
    (ApiException(status=404), True, False),  # a 404 of something else: the resource is still there
    (ApiException(status=500), False, False),  # not asked: only a 404 raises the question
    (RuntimeError("boom"), False, False),
])
def test_only_a_confirmed_deletion_forgets(monkeypatch: pytest.MonkeyPatch, error: Exception, exists: bool,
                                          forgotten: bool) -> None:
    asked: list[tuple[str, str]] = []

    def refresh(*_a: Any) -> None:
        raise error

    def read_now(key: tuple[str, str]) -> dict[str, Any] | None:
        asked.append(key)
        return {"metadata": {"namespace": key[0], "name": key[1]}} if exists else None

    monkeypatch.setattr(status_loop, "refresh_status", refresh)
    monkeypatch.setattr(status_loop, "_read", read_now)
    state = runtime.CONTROLLER.state(KEY)
    state.body = {"metadata": {"namespace": KEY[0], "name": KEY[1]}}
    state.dirty = True
    try:
        asyncio.run(status_loop._refresh_one(KEY, state.body, Seen(), False, logging.getLogger("test")))
        assert (KEY not in runtime.CONTROLLER.known()) is forgotten
        assert (KEY not in {k for k, st in runtime.CONTROLLER.resources.items() if st.dirty}) is forgotten
        assert asked == ([KEY] if isinstance(error, ApiException) and error.status == 404 else [])
    finally:
        tracking.forget(KEY)
