"""Apply failures: invalid objects wait for a new spec; everything else is tried again with a
per-resource exponential backoff (kvpersist.controller.retry)."""

from __future__ import annotations

import pytest

from kvpersist.controller import retry


@pytest.mark.parametrize("status", [400, 422])
def test_invalid_objects_are_permanent(status: int) -> None:
    assert status in retry.INVALID


@pytest.mark.parametrize("status", [None, 401, 403, 404, 409, 429, 500, 502, 503, 504])
def test_the_rest_is_retried(status: int | None) -> None:
    assert status not in retry.INVALID


def test_backoff_doubles_up_to_its_cap_and_restarts_with_a_new_generation() -> None:
    assert [retry.delay(n) for n in (1, 2, 3, 4)] == [5.0, 10.0, 20.0, 40.0]
    assert retry.delay(30) == retry.MAX_DELAY_S == 300.0
    b = retry.Backoff()
    key = ("ns", "a")
    assert b.due(key, 0.0) and b.pending(key) is None
    first = b.failed(key, 1, "HTTP 403: exceeded quota", now=100.0)
    assert (first.attempts, first.due_at) == (1, 105.0)
    assert not b.due(key, 104.9) and b.due(key, 105.0)
    second = b.failed(key, 1, "HTTP 403: exceeded quota", now=105.0)
    assert (second.attempts, second.due_at) == (2, 115.0)
    assert b.failed(key, 2, "HTTP 409", now=120.0).attempts == 1  # a new spec starts over
    assert b.due(("ns", "other"), 120.0)  # per resource
    b.succeeded(key)
    assert b.pending(key) is None and b.due(key, 120.0)
