"""Which replica is active under kopf peering: kopf's rule, read from the peering record."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from kvpersist.controller import runtime

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def record(**peers: tuple[int, float]) -> dict:
    """peer id -> (priority, seconds since its last keep-alive)."""
    return {"status": {pid: {"priority": prio, "lifetime": 15, "lastseen": (NOW - timedelta(seconds=ago)).isoformat()}
                       for pid, (prio, ago) in peers.items()}}


def test_the_highest_live_priority_is_active_and_only_it() -> None:
    peering = record(a=(10, 1), b=(20, 1))
    assert runtime.is_active(peering, "b", 20, NOW) and not runtime.is_active(peering, "a", 10, NOW)


def test_a_dead_peer_does_not_hold_the_others() -> None:
    peering = record(a=(10, 1), b=(20, 16))  # b's record expired (lifetime 15 s)
    assert runtime.is_active(peering, "a", 10, NOW)


def test_equal_priorities_pause_both_as_kopf_does() -> None:
    peering = record(a=(10, 1), b=(10, 1))
    assert not runtime.is_active(peering, "a", 10, NOW) and not runtime.is_active(peering, "b", 10, NOW)


def test_not_active_before_kopf_wrote_our_record_or_without_the_object() -> None:
    assert not runtime.is_active(record(b=(5, 1)), "a", 10, NOW)
    assert not runtime.is_active(None, "a", 10, NOW)
    assert not runtime.is_active({"status": "garbage"}, "a", 10, NOW)
    malformed = record(a=(10, 1))
    malformed["status"]["b"] = {"priority": 99, "lastseen": "yesterday"}  # unreadable: not alive
    assert runtime.is_active(malformed, "a", 10, NOW)


def test_replicas_get_distinct_priorities_and_one_identity_each(monkeypatch) -> None:
    assert len({runtime.random_priority() for _ in range(50)}) > 45
    monkeypatch.delenv(runtime.POD_ID_ENV, raising=False)
    first = runtime.own_identity()
    assert first and runtime.own_identity() == first  # exported, so kopf uses the same
    monkeypatch.setenv(runtime.POD_ID_ENV, "kvpersist-operator-7d9f-abcde")
    assert runtime.own_identity() == "kvpersist-operator-7d9f-abcde"
