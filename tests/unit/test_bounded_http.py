"""The agent's and the metrics' HTTP servers are bounded (kvpersist.httpserver): a body's
Content-Length is checked before anything is read (never a read to EOF), a connection that sends
no complete head in time is closed, idle connections cost no thread, and a fresh request is still
answered among them; the liveness probes (the agent's /healthz, the operator's liveness front) are
answered without the workers, from the process's own state. Every wait here has a bound: a server
that blocks fails the test, never hangs it."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from kvpersist.inventory.agent import Agent, make_server
from tests.serving import in_thread

TOKEN = "t0ken" * 12
A = "kvp-" + "a" * 32
ANSWER_S = 5.0  # what "promptly" means here; every client read is bounded by it


@contextmanager
def agent(tmp_path: Path, **bounds: Any) -> Iterator[int]:
    with in_thread(make_server(Agent(tmp_path, serving=A, token=TOKEN), "127.0.0.1", 0, **bounds)) as port:
        yield port


def status_of(port: int, raw: bytes, timeout: float = ANSWER_S) -> tuple[int, bytes]:
    """Sends raw, leaves the connection open, and reads the answer: (status code, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def gc_request(length: str, body: bytes = b"") -> bytes:
    return (f"POST /gc HTTP/1.1\r\nHost: agent\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode() + body


def closed_within(sock: socket.socket, bound: float) -> float:
    """Seconds until the peer closed (EOF or a reset; an answer such as a 408 before it is fine)."""
    start = time.monotonic()
    sock.settimeout(bound)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


@pytest.mark.parametrize(("length", "code"), [("-1", 400), ("-4096", 400), ("abc", 400), ("1e3", 400), ("+5", 400),
                                              ("1_0", 400), ("99999999999999999999999", 400), ("4097", 413),
                                              ("10000000000", 413)])
def test_a_bad_content_length_is_refused_before_reading(tmp_path: Path, length: str, code: int) -> None:
    """The connection stays open and sends no body: an agent that reads to EOF (a negative length)
    or waits for the bytes announced never answers, and the client's read times out."""
    with agent(tmp_path) as port:
        start = time.monotonic()
        got, body = status_of(port, gc_request(length))
        assert (got, time.monotonic() - start < ANSWER_S) == (code, True)
        assert "Content-Length" in json.loads(body)["error"] or "over" in json.loads(body)["error"]


def test_a_good_gc_body_still_works_and_a_short_one_is_refused(tmp_path: Path) -> None:
    (tmp_path / A).mkdir()
    other = "kvp-" + "b" * 32
    (tmp_path / other).mkdir()
    (tmp_path / other / "x.bin").write_bytes(b"12345")
    payload = json.dumps({"namespaceId": other, "dryRun": True}).encode()
    with agent(tmp_path) as port:
        code, body = status_of(port, gc_request(str(len(payload)), payload))
        assert (code, json.loads(body)["bytes"], json.loads(body)["deleted"]) == (200, 5, False)
    # Announces more than it sends, then stops sending: refused once the request's deadline
    # passes (here 1 s), not held open.
    with agent(tmp_path, request_timeout=1.0) as port:
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S) as s:
            s.sendall(gc_request(str(len(payload) + 10), payload))
            assert s.recv(100).split()[1] == b"408"
            assert closed_within(s, ANSWER_S) < ANSWER_S
        assert time.monotonic() - start < ANSWER_S


def test_chunked_and_conflicting_lengths_are_refused(tmp_path: Path) -> None:
    with agent(tmp_path) as port:
        chunked = (f"POST /gc HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
        assert status_of(port, chunked)[0] == 411
        two = (f"POST /gc HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 2\r\nContent-Length: 3000\r\n\r\n{{}}").encode()
        assert status_of(port, two)[0] == 400
        assert status_of(port, gc_request("2", b"[]"))[0] == 400  # JSON, but not an object


def test_an_idle_or_trickling_connection_is_closed_after_the_head_timeout(tmp_path: Path) -> None:
    """Neither a connection that sends nothing nor one that trickles its headers a byte at a time
    (slow loris) is held past the head timeout; a fresh request meanwhile is answered."""
    with agent(tmp_path, head_timeout=1.0) as port, ExitStack() as stack:
        idle = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S))
        loris = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S))
        stop = threading.Event()

        def trickle() -> None:
            for byte in b"GET /healthz HTTP/1.1\r\nHost: agent\r\nX-Slow: " + b"a" * 1000:
                if stop.wait(0.05):
                    return
                try:
                    loris.send(bytes([byte]))
                except OSError:
                    return

        trickler = threading.Thread(target=trickle, daemon=True)
        trickler.start()
        assert status_of(port, b"GET /healthz HTTP/1.0\r\n\r\n")[0] == 200
        try:
            assert closed_within(idle, ANSWER_S) < ANSWER_S
            assert closed_within(loris, ANSWER_S) < ANSWER_S
        finally:
            stop.set()
            trickler.join(5)


def test_idle_connections_cost_no_thread_and_a_fresh_request_is_answered(tmp_path: Path) -> None:
    """300 idle connections beyond a cap of 32 waiting ones: the server's threads stay its fixed
    pool, the oldest idle ones are closed, and an authorized /inventory is answered promptly."""
    with agent(tmp_path, max_pending=32, workers=4) as port, ExitStack() as stack:
        time.sleep(0.2)
        before = threading.active_count()
        idle = [stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S)) for _ in range(300)]
        time.sleep(0.5)
        assert threading.active_count() <= before + 1  # nothing per connection
        start = time.monotonic()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/inventory", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=ANSWER_S) as r:
            assert r.status == 200 and "namespaces" in json.loads(r.read())
        assert time.monotonic() - start < ANSWER_S
        assert closed_within(idle[0], ANSWER_S) < ANSWER_S  # the oldest made room for the newer ones


def test_an_oversized_head_is_refused(tmp_path: Path) -> None:
    with agent(tmp_path) as port:
        assert status_of(port, b"GET /healthz HTTP/1.0\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")[0] == 431


def test_a_full_queue_answers_503_and_the_workers_stay_fixed() -> None:
    """One worker held by a slow handler and one request queued behind it: the next is refused
    at once with 503, not given a thread."""
    from kvpersist.httpserver import BoundedHTTPServer

    release = threading.Event()
    entered = threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            entered.set()
            release.wait(10)
            self.send_response(204)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            return

    server = BoundedHTTPServer(("127.0.0.1", 0), Slow, workers=1, queue_size=1)
    with in_thread(server) as port, ExitStack() as stack:
        first = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S))
        first.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert entered.wait(ANSWER_S)
        second = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S))
        second.sendall(b"GET / HTTP/1.0\r\n\r\n")
        time.sleep(0.3)
        assert status_of(port, b"GET / HTTP/1.0\r\n\r\n")[0] == 503
        release.set()
        assert first.recv(100).split()[1] == b"204" and second.recv(100).split()[1] == b"204"


def test_the_metrics_server_holds_no_thread_per_idle_connection() -> None:
    from kvpersist.controller import metrics

    server = metrics.serve("127.0.0.1", 0)
    port = server.server_address[1]
    try:
        with ExitStack() as stack:
            time.sleep(0.2)
            before = threading.active_count()
            for _ in range(300):
                stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S))
            time.sleep(0.5)
            assert threading.active_count() <= before + 1
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=ANSWER_S) as r:
                assert b"kvpersist_status_writes_total" in r.read()
    finally:
        server.shutdown()
        server.server_close()


def wait_until(what: str, check: Any, bound: float = 10.0) -> Any:
    """check()'s first truthy value, polled; fails naming `what` after bound seconds."""
    deadline = time.monotonic() + bound
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what}: not within {bound} s"
        time.sleep(0.02)
    return value


class StandInKopf(BaseHTTPRequestHandler):
    """A STAND-IN for kopf's endpoint, answering what kopf answers (200 and the probes' JSON, or 500
    when a probe raised); while `stall` is set each request waits for it to clear (a slow kopf)."""

    code = 200
    stall = threading.Event()

    def do_GET(self) -> None:
        deadline = time.monotonic() + 10
        while self.stall.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        body = b'{"statusLoopSecondsSinceTick": 1.5}' if self.code == 200 else b"500 Internal Server Error"
        self.send_response(self.code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        return


@pytest.fixture
def kopf() -> Iterator[tuple[type[StandInKopf], int]]:
    from kvpersist.httpserver import BoundedHTTPServer

    class Kopf(StandInKopf):
        stall = threading.Event()

    with in_thread(BoundedHTTPServer(("127.0.0.1", 0), Kopf, workers=16, queue_size=64)) as port:
        try:
            yield Kopf, port
        finally:
            Kopf.stall.clear()


def test_the_liveness_front_passes_kopfs_answer_through_and_refuses_the_rest(kopf: tuple[type[StandInKopf], int]) -> None:
    """The front answers from its reader's last reading of kopf's endpoint: kopf's code and body,
    503 before the first reading, when kopf does not answer, or when the reading is stale."""
    from kvpersist.controller import health

    stand_in, upstream = kopf
    assert health.split_endpoint("http://0.0.0.0:8080/healthz") == ("0.0.0.0", 8080, "/healthz")
    for bad in ("https://0.0.0.0:8080/healthz", "http://0.0.0.0/healthz", "0.0.0.0:8080"):
        with pytest.raises(ValueError, match="--liveness"):
            health.split_endpoint(bad)
    reader = health.KopfLiveness(upstream, "/healthz", poll_s=3600)  # read by this test only
    front = health.serve("127.0.0.1", 0, "/healthz", upstream, liveness=reader)
    port = front.server_address[1]
    try:
        code, body = status_of(port, b"GET /healthz HTTP/1.0\r\n\r\n")
        assert code == 503 and "not read yet" in json.loads(body)["error"]
        reader.read_once()
        assert status_of(port, b"GET /healthz HTTP/1.0\r\n\r\n") == (200, b'{"statusLoopSecondsSinceTick": 1.5}')
        stand_in.code = 500
        reader.read_once()
        assert status_of(port, b"GET /healthz HTTP/1.0\r\n\r\n")[0] == 500
        assert status_of(port, b"GET /env HTTP/1.0\r\n\r\n")[0] == 404
    finally:
        front.shutdown()
        front.server_close()
    _, down = health.kopf_endpoint("/healthz")  # nothing listens there
    for reader, says in ((health.KopfLiveness(down, "/healthz", poll_s=3600), "kopf's liveness endpoint"),
                         (health.KopfLiveness(upstream, "/healthz", poll_s=3600, stale_s=-1.0), "last read")):
        reader.read_once()
        code, _, body = reader.answer()
        assert code == 503 and says in json.loads(body)["error"]


def test_a_probe_is_answered_with_every_worker_busy_and_the_queue_full() -> None:
    """A probe path never waits on the workers: with the only worker held and the queue full
    (503 to any other request) the probe still gets its callable's answer, good or bad."""
    from kvpersist.httpserver import BoundedHTTPServer

    release, entered = threading.Event(), threading.Event()
    state: dict[str, Any] = {"answer": (200, "application/json", b'{"status": "ok"}')}

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            entered.set()
            release.wait(10)
            self.send_response(204)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            return

    server = BoundedHTTPServer(("127.0.0.1", 0), Slow, workers=1, queue_size=1, probes={"/healthz": lambda: state["answer"]})
    with in_thread(server) as port, ExitStack() as stack:
        try:
            held = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S))
            held.sendall(b"GET /slow HTTP/1.0\r\n\r\n")
            assert entered.wait(ANSWER_S)
            queued = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S))
            queued.sendall(b"GET /slow HTTP/1.0\r\n\r\n")
            wait_until("the queue full", lambda: status_of(port, b"GET /other HTTP/1.0\r\n\r\n")[0] == 503)
            assert status_of(port, b"GET /healthz?verbose=1 HTTP/1.1\r\nHost: x\r\n\r\n") == (200, b'{"status": "ok"}')
            state["answer"] = (503, "application/json", b'{"error": "stuck"}')
            assert status_of(port, b"GET /healthz HTTP/1.0\r\n\r\n") == (503, b'{"error": "stuck"}')
            state["answer"] = None  # a probe that raises is a failed probe, not a dead server
            assert status_of(port, b"GET /healthz HTTP/1.0\r\n\r\n")[0] == 500
            assert server.refused >= 1
        finally:
            release.set()


def test_the_liveness_front_answers_while_its_workers_wait_on_a_slow_kopf(kopf: tuple[type[StandInKopf], int],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Probes from anyone that reaches the port, while kopf is slow: once they held the front's
    two workers (each waiting on kopf) and filled its queue, and the kubelet's probe read 503 (the
    operator restarted for every namespace). Now the probe is answered from the last reading; and
    a kopf that turns bad still fails it."""
    from kvpersist.controller import health

    stand_in, upstream = kopf
    monkeypatch.setattr(health, "POLL_S", 0.2, raising=False)
    front = health.serve("127.0.0.1", 0, "/healthz", upstream)
    port = front.server_address[1]
    try:
        wait_until("the first reading", lambda: status_of(port, b"GET /healthz HTTP/1.0\r\n\r\n")[0] == 200)
        with ExitStack() as stack:
            stand_in.stall.set()  # a reading begun now waits for kopf; the last one (200) stands meanwhile
            for n in (2, 12):  # the front's two workers, then its queue of eight and more, had they been used
                for _ in range(n):
                    s = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S))
                    s.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
                time.sleep(0.3)
            assert status_of(port, b"GET /healthz HTTP/1.0\r\n\r\n") == (200, b'{"statusLoopSecondsSinceTick": 1.5}')
            stand_in.code = 500
            stand_in.stall.clear()
            wait_until("kopf's 500 through the front", lambda: status_of(port, b"GET /healthz HTTP/1.0\r\n\r\n")[0] == 500)
    finally:
        front.shutdown()
        front.server_close()


def test_the_agents_probe_is_answered_while_requests_hold_its_workers(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """/gc requests whose bodies never come hold the agent's worker and fill its queue (503 to
    everything else); /healthz still answers 200 from the agent's own state, and 503 naming why
    once a request has waited too long for a worker (every worker stuck) or the trim thread ended."""
    from kvpersist.inventory import agent as agent_module

    with agent(tmp_path, workers=1, queue_size=1, request_timeout=10.0) as port, ExitStack() as stack:
        for _ in range(2):  # one in the worker, one queued
            s = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S))
            s.sendall(gc_request("100"))
            time.sleep(0.3)  # taken (or queued) before the next
        assert status_of(port, b"GET /inventory HTTP/1.0\r\n\r\n")[0] == 503
        code, body = status_of(port, b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")
        assert code == 200 and json.loads(body) == {"status": "ok"}, (code, body)
        monkeypatch.setattr(agent_module, "STUCK_S", 0.2)
        code, body = wait_until("a stuck pool", lambda: (lambda a: a if a[0] == 503 else None)(
            status_of(port, b"GET /healthz HTTP/1.0\r\n\r\n")))
        assert "waited" in json.loads(body)["error"]

    trimmer = Agent(tmp_path, serving=A, token=TOKEN, capacity_bytes=2**20, trim_period_s=3600)
    with in_thread(make_server(trimmer, "127.0.0.1", 0)) as port:
        trimmer.start_trimming()
        assert status_of(port, b"GET /healthz HTTP/1.0\r\n\r\n")[0] == 200
        trimmer._stop.set()  # the thread ends as if it had died: not stopped by stop()
        assert trimmer._thread is not None
        trimmer._thread.join(ANSWER_S)
        trimmer._stop.clear()
        code, body = status_of(port, b"GET /healthz HTTP/1.0\r\n\r\n")
        assert code == 503 and "trim thread" in json.loads(body)["error"]


def test_a_request_line_no_url_parser_reads_neither_stops_the_server_nor_its_probe(tmp_path: Path) -> None:
    """`GET //[x`: urlsplit raises on it (an unclosed IPv6 literal). Read for the probe check on the
    server's own loop, it ended the loop, and with it every later request and /healthz (a hostile
    peer stopped the agent). Now it is no probe, its worker refuses it, and the server goes on."""
    with agent(tmp_path) as port:
        for raw in (b"GET //[x HTTP/1.1\r\nHost: a\r\n\r\n", b"GET http://[::1 HTTP/1.0\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S) as s:
                s.sendall(raw)
                closed_within(s, ANSWER_S)  # whatever it answers, the connection ends
            assert status_of(port, b"GET /healthz HTTP/1.0\r\n\r\n")[0] == 200
            code, _ = status_of(port, f"GET /inventory HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
            assert code == 200
