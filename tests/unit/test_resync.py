"""A watch that missed a change (CI once showed an annotation the operator never saw for two
minutes) heals: a resource no event has shown for RESYNC_S is read from the API server before its
round, and a newer body replaces the watch's. `_read` stands in for the API server's GET here;
the watch itself is the e2e tier's."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from kvpersist.controller import runtime, status_loop, tracking
from kvpersist.controller.l2key import REPLACE_ANNOTATION

KEY = ("ns", "quiet")


def _body(version: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "kvpersist.dev/v1alpha1", "kind": "KVCacheNamespace",
            "metadata": {"namespace": KEY[0], "name": KEY[1], "resourceVersion": version, "annotations": annotations or {}},
            "spec": {}, "status": {}}


@pytest.fixture
def state():
    st = runtime.CONTROLLER.state(KEY)
    st.body = _body("1")
    try:
        yield st
    finally:
        tracking._forget(KEY)


def _run(body: Any) -> Any:
    return asyncio.run(status_loop._resynced(KEY, body, logging.getLogger("test")))


def _reads(monkeypatch: pytest.MonkeyPatch, answer: Any) -> list[tuple[str, str]]:
    asked: list[tuple[str, str]] = []

    def read(key: tuple[str, str]) -> Any:
        asked.append(key)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(status_loop, "_read", read)
    return asked


def test_a_resource_with_recent_events_is_not_read(monkeypatch: pytest.MonkeyPatch, state: Any) -> None:
    asked = _reads(monkeypatch, _body("2"))
    body = state.body
    assert _run(body) is body and asked == []


def test_a_missed_change_is_read_and_kept(monkeypatch: pytest.MonkeyPatch, state: Any) -> None:
    newer = _body("7", {REPLACE_ANNOTATION: "0123456789abcdef"})
    asked = _reads(monkeypatch, newer)
    state.body_at -= status_loop.RESYNC_S
    got = _run(state.body)
    assert asked == [KEY]
    assert got is state.body and got["metadata"]["annotations"] == {REPLACE_ANNOTATION: "0123456789abcdef"}
    assert got["metadata"]["resourceVersion"] == "7"
    assert _run(state.body) is got and asked == [KEY]  # read again only after another RESYNC_S


def test_the_same_version_keeps_the_body_and_waits_again(monkeypatch: pytest.MonkeyPatch, state: Any) -> None:
    asked = _reads(monkeypatch, _body("1"))
    state.body_at -= status_loop.RESYNC_S
    body = state.body
    assert _run(body) is body and asked == [KEY]
    assert _run(body) is body and asked == [KEY]


def test_a_failed_read_keeps_the_round_going(monkeypatch: pytest.MonkeyPatch, state: Any) -> None:
    asked = _reads(monkeypatch, ConnectionError("api server away"))
    state.body_at -= status_loop.RESYNC_S
    body = state.body
    assert _run(body) is body
    assert _run(body) is body and asked == [KEY, KEY]  # asked again next round: nothing was learnt


def test_a_resource_gone_is_forgotten(monkeypatch: pytest.MonkeyPatch, state: Any) -> None:
    _reads(monkeypatch, None)
    state.body_at -= status_loop.RESYNC_S
    assert _run(state.body) is None
    assert KEY not in runtime.CONTROLLER.known()


def test_an_event_during_the_read_wins(monkeypatch: pytest.MonkeyPatch, state: Any) -> None:
    def read(_key: tuple[str, str]) -> Any:
        state.body = _body("9")  # what track() does when an event lands while the GET is out
        return _body("8")

    monkeypatch.setattr(status_loop, "_read", read)
    state.body_at -= status_loop.RESYNC_S
    got = _run(state.body)
    assert got["metadata"]["resourceVersion"] == "9"
