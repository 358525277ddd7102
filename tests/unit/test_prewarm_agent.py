"""The inventory agent's POST /server/prefetch (spec.prewarm) against a STAND-IN for lmcache's
admin API on the pod's loopback: a loopback server answering as lmcache 0.5.6's /status (the
workers registered with it) and /cache/prefetches routes do (cache_api.py, prefetch_service.py),
or badly. The agent must require the resource's token, prefetch under each registration /status
lists (and nothing without one), poll to completion within its bound, and answer every hostile
reply (a hang, garbage, a huge body, found over total, a job that vanishes or never ends) with a
bounded 502/504 naming what was wrong. The real lmcache server behind the same route:
tests/integration/test_prewarm.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvpersist import httpclient
from kvpersist.inventory import prefetch
from kvpersist.inventory.agent import Agent, make_server
from kvpersist.inventory.agentclient import request_prefetch
from tests.serving import in_thread
from tests.unit.test_hostile_peers import SLACK, Behave, Conn, answer, hang, huge_streamed, not_http, serving, timed

TOKEN = "t0ken"
IDS = list(range(1000, 1600))


SNAPSHOT = "/root/.cache/huggingface/hub/models--org--model/snapshots/" + "0" * 40  # vLLM's model name under HF_HUB_OFFLINE
ONE_WORKER = {"is_healthy": True, "registered_non_cuda_instance_ids": [7],
              "non_cuda_context_meta": {"7": {"model_name": SNAPSHOT, "world_size": 1, "block_size": 16, "use_mla": False}}}


class StandInLmcache:
    """STAND-IN for lmcache's admin API: /status lists the registered workers; a prefetch is pending
    for `pending` polls, then completed with found of total keys (once: then 404, as lmcache drops a
    job on its first completed poll)."""

    def __init__(self, found: int = 4, total: int = 4, pending: int = 2, submit: tuple[int, dict[str, Any]] | None = None,
                 status: dict[str, Any] | None = None):
        self.found, self.total, self.pending = found, total, pending
        self.submit = submit  # None: a new job per submission
        self.status = ONE_WORKER if status is None else status
        self.jobs: dict[str, int] = {}
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        lm = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                with lm.lock:
                    lm.paths.append(f"POST {self.path}")
                    lm.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                    if lm.submit is not None:
                        return self._send(*lm.submit)
                    job = f"job{len(lm.jobs) + 1}"
                    lm.jobs[job] = lm.pending
                self._send(202, {"request_id": job, "chunks": 2, "status": "submitted"})

            def do_GET(self) -> None:
                with lm.lock:
                    lm.paths.append(f"GET {self.path}")
                    if self.path == "/status":
                        return self._send(200, lm.status)
                    job = self.path.removeprefix("/cache/prefetches/")
                    if job not in lm.jobs:
                        return self._send(404, {"detail": "unknown prefetch request_id"})
                    lm.jobs[job] -= 1
                    if lm.jobs[job] >= 0:
                        return self._send(200, {"request_id": job, "status": "pending"})
                    del lm.jobs[job]  # told once
                self._send(200, {"request_id": job, "status": "completed", "found_keys": lm.found, "total_keys": lm.total})

        return Handler


@contextmanager
def agent_in_front_of(port: int, token: str | None = TOKEN, wait_s: float = prefetch.WAIT_S) -> Iterator[int]:
    agent = Agent(None, None, token=token, server=("127.0.0.1", port))
    assert agent.prefetcher is not None
    agent.prefetcher.wait_s = wait_s
    with in_thread(make_server(agent, "127.0.0.1", 0)) as agent_port:
        yield agent_port


@contextmanager
def lmcache(stand_in: StandInLmcache) -> Iterator[int]:
    with in_thread(ThreadingHTTPServer(("127.0.0.1", 0), stand_in.handler())) as port:
        yield port


def ask(port: int, token: str | None = TOKEN, ids: list[int] | None = None, timeout: float = 10.0) -> tuple[int, prefetch.Answer]:
    return request_prefetch("127.0.0.1", port, IDS if ids is None else ids, token, timeout=timeout)


def test_the_agent_prefetches_under_the_registered_layout_and_polls_to_completion() -> None:
    """The model name and world size come from lmcache's /status (what vLLM registered: its
    snapshot path under HF_HUB_OFFLINE), not from the operator."""
    stand_in = StandInLmcache(found=4, total=4, pending=2)
    with lmcache(stand_in) as port, agent_in_front_of(port) as agent:
        code, got = ask(agent)
    assert code == 200 and got.status == "completed" and (got.chunks, got.found_keys, got.total_keys) == (2, 4, 4)
    assert got.whole and got.error is None and [(x.model_name, x.world_size) for x in got.layouts] == [(SNAPSHOT, 1)]
    assert stand_in.bodies == [{"model_name": SNAPSHOT, "world_size": 1, "token_ids": IDS}]
    assert stand_in.paths == ["GET /status", "POST /cache/prefetches"] + ["GET /cache/prefetches/job1"] * 3


def test_each_registration_is_prefetched_once_and_the_keys_summed() -> None:
    """Two workers of one model and world size are one layout; another world size (a TP-2
    registration) or the lmcache-driven module's are others."""
    status = {"non_cuda_context_meta": {"1": {"model_name": "org/model", "world_size": 1},
                                        "2": {"model_name": "org/model", "world_size": 1}},
              "cache_context_meta": {"3": {"model_name": "org/model", "world_size": 2, "kv_cache_layout": {}}}}
    stand_in = StandInLmcache(found=1, total=4, pending=0, status=status)
    with lmcache(stand_in) as port, agent_in_front_of(port) as agent:
        code, got = ask(agent)
    assert [(b["model_name"], b["world_size"]) for b in stand_in.bodies] == [("org/model", 1), ("org/model", 2)]
    assert code == 200 and (got.chunks, got.found_keys, got.total_keys) == (2, 2, 8) and not got.whole
    assert [(x.model_name, x.world_size) for x in got.layouts] == [("org/model", 1), ("org/model", 2)]


def test_no_registered_worker_is_a_503_and_nothing_is_submitted() -> None:
    stand_in = StandInLmcache(status={"is_healthy": True, "non_cuda_context_meta": {}, "cache_context_meta": {}})
    with lmcache(stand_in) as port, agent_in_front_of(port) as agent:
        code, got = ask(agent)
    assert code == 503 and "no vLLM has registered its KV layout" in (got.error or "") and got.status is None
    assert stand_in.paths == ["GET /status"]


def test_some_keys_missing_is_an_answer_not_an_error() -> None:
    with lmcache(StandInLmcache(found=1, total=4)) as port, agent_in_front_of(port) as agent:
        code, got = ask(agent)
    assert code == 200 and not got.whole and (got.found_keys, got.total_keys) == (1, 4)


def test_under_one_chunk_is_a_noop() -> None:
    with lmcache(StandInLmcache(submit=(202, {"chunks": 0, "status": "noop"}))) as port, agent_in_front_of(port) as agent:
        code, got = ask(agent)
    assert code == 200 and got.status == "noop" and got.whole


def test_unregistered_since_status_passes_lmcaches_503_and_reason_on() -> None:
    detail = {"detail": "no layout registered for model_name='org/model' world_size=1; the model has not allocated KV"}
    with lmcache(StandInLmcache(submit=(503, detail))) as port, agent_in_front_of(port) as agent:
        code, got = ask(agent)
    assert code == 503 and "no layout registered" in (got.error or "") and got.status is None


@pytest.mark.parametrize("token", [None, "wrong"])
def test_the_token_is_required_and_lmcache_is_not_asked_without_it(token: str | None) -> None:
    stand_in = StandInLmcache()
    with lmcache(stand_in) as port, agent_in_front_of(port) as agent:
        code, got = ask(agent, token=token)
        assert code == 401 and "bearer token" in (got.error or "")
    with lmcache(stand_in) as port, agent_in_front_of(port, token=None) as agent:  # an agent without a token file: off
        code, got = ask(agent, token="anything")
        assert code == 403 and "without --token-file" in (got.error or "")
    assert stand_in.paths == []


@pytest.mark.parametrize(("body", "code"), [
    (b"[]", 400), (b'{"tokenIds": []}', 400), (b'{"tokenIds": [-1]}', 400), (b'{"tokenIds": ["1"]}', 400),
    (b'{"tokenIds": [1], "modelName": "m"}', 400), (b'{"tokenIds": [2147483648]}', 400), (b"not json", 400)])
def test_a_malformed_request_is_refused_before_lmcache_is_asked(body: bytes, code: int) -> None:
    stand_in = StandInLmcache()
    with lmcache(stand_in) as port, agent_in_front_of(port) as agent:
        reply = httpclient.request("POST", "127.0.0.1", agent, prefetch.PATH, timeout=5, max_bytes=4096, body=body,
                                   content_type="application/json", headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status == code and b"not a prefetch request" in reply.body
    assert stand_in.paths == []


def test_a_body_over_the_cap_is_refused_unread() -> None:
    with lmcache(StandInLmcache()) as port, agent_in_front_of(port) as agent:
        code, got = ask(agent, ids=[7] * (prefetch.MAX_TOKENS + 1))
    assert code in (400, 413), (code, got)


REGISTERED = answer(json.dumps(ONE_WORKER).encode())


def _then(submit: Behave, poll: Behave | None = None, status: Behave = REGISTERED) -> Behave:
    def behave(conn: Conn, path: str) -> None:
        (status if path == "/status" else submit if path == "/cache/prefetches" else poll or submit)(conn, path)
    return behave


SUBMITTED = answer(b'{"request_id": "ab12", "chunks": 2, "status": "submitted"}', 202)
PENDING = answer(b'{"request_id": "ab12", "status": "pending"}')


@pytest.mark.parametrize(("behave", "code", "words"), [
    (hang, 504, "lmcache /status"),
    (not_http, 502, "lmcache /status"),
    (huge_streamed, 502, "lmcache /status"),
    (answer(b'{"non_cuda_context_meta": {"1": {"model_name": "", "world_size": 0}}}'), 502, "lmcache /status"),
    (answer(b'{"non_cuda_context_meta": [1, 2]}'), 502, "lmcache /status"),
    (_then(hang), 504, "lmcache /cache/prefetches"),
    (_then(not_http), 502, "lmcache /cache/prefetches"),
    (_then(huge_streamed), 502, "limit"),
    (_then(answer(b'{"chunks": "many", "status": "submitted"}', 202)), 502, "chunks"),
    (_then(answer(b'{"status": "submitted", "chunks": 2}', 202)), 502, "without a request_id"),
    (_then(answer(b'{"request_id": "../../env", "chunks": 2, "status": "submitted"}', 202)), 502, "request_id"),
    (_then(answer(b"<html>oops</html>", 500)), 502, "HTTP 500"),
    (_then(SUBMITTED, hang), 504, "lmcache /cache/prefetches/ab12"),
    (_then(SUBMITTED, answer(b'{"status": "completed", "found_keys": 9, "total_keys": 4}')), 502, "found_keys 9 of total_keys 4"),
    (_then(SUBMITTED, answer(b'{"status": "completed"}')), 502, "found_keys None"),
    (_then(SUBMITTED, answer(b'{"detail": "unknown"}', 404)), 502, "gone before it was seen complete"),
    (_then(SUBMITTED, answer(b'{"status": "exploded"}')), 502, "status"),
    (_then(SUBMITTED, PENDING), 504, "still pending after 2 s"),
], ids=["status-hang", "status-not-http", "status-huge", "status-bad-worker", "status-garbage", "hang", "not-http", "huge",
        "garbage", "no-id", "hostile-id", "500", "poll-hang", "found-over-total", "no-counts", "vanished", "bad-state",
        "never-ends"])
def test_a_hostile_lmcache_is_a_bounded_error_naming_what_was_wrong(behave: Behave, code: int, words: str) -> None:
    wait = 2.0
    with serving(behave) as peer, agent_in_front_of(peer.port, wait_s=wait) as agent, \
            timed(wait + 3 * prefetch.CALL_TIMEOUT_S + SLACK + 1):
        got_code, got = ask(agent, timeout=wait + 3 * prefetch.CALL_TIMEOUT_S + 2)
    assert got_code == code and words in (got.error or ""), (got_code, got)
    assert got.status is None and not got.whole


@pytest.mark.parametrize(("raw", "status"), [(b'{"status": "completed", "foundKeys": -1}', 200), (b"[1,2]", 200),
                                              (b'{"error": "' + b"x" * 5000 + b'"}', 500)])
def test_the_operator_reads_a_malformed_agent_answer_as_an_error(raw: bytes, status: int) -> None:
    with serving(answer(raw, status)) as peer:
        code, got = ask(peer.port, timeout=2)
    assert code == status and got.error is not None and "malformed" in got.error and not got.whole


def test_an_unreachable_agent_is_code_zero() -> None:
    with serving(hang) as peer:
        port = peer.port
    code, got = ask(port, timeout=1)
    assert code == 0 and "unreachable" in (got.error or "")
