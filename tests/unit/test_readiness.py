"""The operator's readiness (the chart's readinessProbe, GET /readyz on the liveness port): ready once
kopf's liveness answers 200 and every watch cache has listed once; a cache unsynced later by a
failed watch keeps it ready (an API server outage must not take every replica out of its Service)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvpersist.controller import health
from kvpersist.controller.watchcache import WatchCache
from kvpersist.httpserver import ProbeAnswer


class StandInLiveness(health.KopfLiveness):
    """kopf's liveness as the test sets it."""

    def __init__(self, answer: ProbeAnswer) -> None:
        super().__init__(upstream_port=1, path="/healthz", poll_s=3600)
        self.now = answer

    def answer(self) -> ProbeAnswer:
        return self.now


ALIVE: ProbeAnswer = (200, "application/json", b'{"statusLoopSecondsSinceTick": 1.5}')


def _get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_ready_needs_kopf_alive_and_every_cache_listed() -> None:
    liveness = StandInLiveness((503, "application/json", b'{"error": "kopf\'s liveness endpoint not read yet"}'))
    waiting = ["secrets", "persistentvolumeclaims"]
    ready = health.readiness(liveness, lambda: list(waiting))
    code, _, body = ready()
    assert code == 503 and "kopf's liveness answered 503" in json.loads(body)["why"]
    liveness.now = ALIVE
    code, _, body = ready()
    assert code == 503 and json.loads(body)["why"] == "watch caches not listed yet: secrets, persistentvolumeclaims"
    waiting.clear()
    assert ready() == (200, "application/json", b'{"ready": true}')
    liveness.now = (500, "application/json", b'{"statusLoopSecondsSinceTick": "stalled"}')
    assert ready()[0] == 503  # not alive: not ready either


def test_the_liveness_front_answers_readyz_beside_healthz() -> None:
    liveness = StandInLiveness(ALIVE)
    front = health.serve("127.0.0.1", 0, "/healthz", upstream_port=1, liveness=liveness)
    port = front.server_address[1]
    try:
        assert _get(port, "/healthz")[0] == 200
        # No watch cache made in this process (runtime.CONTROLLER's are None): kopf alone decides.
        assert _get(port, health.READY_PATH) == (200, {"ready": True})
        liveness.now = (503, "application/json", b'{"error": "down"}')
        code, body = _get(port, health.READY_PATH)
        assert code == 503 and body["ready"] is False
        assert _get(port, "/nothing")[0] == 404
    finally:
        front.shutdown()
        front.server_close()


def test_a_cache_is_listed_once_per_scope_and_stays_so() -> None:
    failing = {"b"}

    def lister(scope: str | None, keep: Any) -> tuple[list[dict[str, Any]], str]:
        if scope in failing:
            raise ConnectionError("the API server is down")
        return [], "1"

    def watcher(scope: str | None, version: str, stopped: threading.Event) -> Iterator[tuple[str, dict[str, Any]]]:
        if scope in failing:
            raise ConnectionError("the watch broke")
        stopped.wait(0.05)
        return iter(())

    cache = WatchCache("secrets", ("a", "b"), lister, watcher, keep=dict)
    cache.start()
    try:
        deadline = time.monotonic() + 5
        while cache.lookup("a", "x")[0] is False and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cache.lookup("a", "x") == (True, None)
        assert cache.listed_once is False  # scope b has never listed
        failing.clear()
        while not cache.listed_once and time.monotonic() < deadline + 10:
            time.sleep(0.05)
        assert cache.listed_once
        failing.add("a")  # a's watch now fails: a is unsynced, but it has listed once
        while cache.lookup("a", "x")[0] and time.monotonic() < deadline + 15:
            time.sleep(0.02)
        assert cache.lookup("a", "x")[0] is False and cache.listed_once
    finally:
        cache.stop()
