"""The operator's outbound calls against peers that misbehave: loopback servers standing in for
an lmcache server, inventory agent or vLLM pod (the canary's counter reads) that trickles its
answer a byte at a time, hangs before its headers, answers garbage, or sends a body far larger than
any real one. Each call must come back
within its deadline (plus a little slack) with an unhealthy report or a reason, never raise, and
never read a huge body whole."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from kvpersist import httpclient
from kvpersist.controller.canary import read_counters_of
from kvpersist.inventory.agentclient import fetch_inventory, request_gc
from kvpersist.inventory.cleanup import gc_volumes
from kvpersist.status.usage import collect_usage, fetch_status
from tests.serving import in_thread

STATUS = (Path(__file__).parent / "data" / "lmcache-0.5.6-status-nixl-8-objects.json").read_bytes()
METRICS = b"""# TYPE lmcache_mp_l2_store_submitted_objects_chunks_total counter
lmcache_mp_l2_store_submitted_objects_chunks_total 32.0
lmcache_mp_l2_store_completed_objects_chunks_total 8.0
lmcache_mp_lookup_requested_tokens_total{model_name="m",cache_salt=""} 1024.0
lmcache_mp_lookup_hit_tokens_total{model_name="m",cache_salt=""} 512.0
"""
NSID = "kvp-" + "a" * 32
DEADLINE = 1.0  # the timeout every call here gets
SLACK = 0.6  # what a loaded test machine may add to it
HUGE = 100 * 2**20
BLOCK = b"x" * 65536


class Conn:
    """The server's side of one connection, counting what it managed to send."""

    def __init__(self, sock: socket.socket, peer: Peer) -> None:
        self.sock, self.peer = sock, peer

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)
        with self.peer.lock:
            self.peer.sent += len(data)

    def pause(self, seconds: float) -> bool:
        """Waits; False once the test is stopping the server."""
        return not self.peer.stop.wait(seconds)


Behave = Callable[[Conn, str], None]


class Peer:
    """A loopback TCP server that reads each request's head (and body), then lets behave(conn,
    path) answer however badly. close() stops every thread it started, each wait bounded."""

    def __init__(self, behave: Behave, host: str = "127.0.0.1", port: int = 0) -> None:
        self.behave = behave
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = 0
        self.paths: list[str] = []
        self.listener = socket.create_server((host, port))
        self.listener.settimeout(0.05)
        self.port = self.listener.getsockname()[1]
        self.threads = [threading.Thread(target=self._accept, name="peer-accept", daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(sock,), name="peer-conn", daemon=True)
            with self.lock:
                self.threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            sock.settimeout(5)
            try:
                path = self._read_request(sock)
                with self.lock:
                    self.paths.append(path)
                self.behave(Conn(sock, self), path)
            except OSError:
                pass  # the client hung up on us: what a cut-off peer sees

    @staticmethod
    def _read_request(sock: socket.socket) -> str:
        data = b""
        while b"\r\n\r\n" not in data and len(data) < 65536:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:]) if k.lower() == "content-length"), 0)
        while len(rest) < length:
            chunk = sock.recv(4096)
            if not chunk:
                break
            rest += chunk
        words = lines[0].split(" ")
        return words[1] if len(words) > 1 else ""

    def close(self) -> None:
        self.stop.set()
        self.threads[0].join(timeout=5)
        self.listener.close()
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=5)
        assert not any(t.is_alive() for t in threads), "a test server thread did not stop"


@contextmanager
def serving(behave: Behave) -> Iterator[Peer]:
    peer = Peer(behave)
    try:
        yield peer
    finally:
        peer.close()


def head(status: int = 200, length: int | None = None, extra: str = "") -> bytes:
    lines = [f"HTTP/1.1 {status} X", "Content-Type: application/json", "Connection: close"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def answer(body: bytes, status: int = 200) -> Behave:
    def behave(conn: Conn, path: str) -> None:
        conn.send(head(status, len(body)) + body)
    return behave


def routes(table: dict[str, Behave]) -> Behave:
    def behave(conn: Conn, path: str) -> None:
        table.get(path.removeprefix("/server"), answer(b"{}", 404))(conn, path)  # as forwarded by the agent
    return behave


def healthy(conn: Conn, path: str) -> None:
    """A well-behaved lmcache 0.5.6 server."""
    answer(METRICS if path.endswith("/metrics") else STATUS)(conn, path)


def trickle_body(conn: Conn, path: str) -> None:
    """Headers promptly, then a body of one byte per 0.5 s, forever."""
    conn.send(head(200, 10**6))
    while conn.pause(0.5):
        conn.send(b" ")


def trickle_headers(conn: Conn, path: str) -> None:
    """A status line, then a header that never ends, one byte per 0.5 s."""
    conn.send(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    while conn.pause(0.5):
        conn.send(b"a")


def hang(conn: Conn, path: str) -> None:
    """Accepts, reads the request, and never answers."""
    conn.pause(60)


def huge_declared(conn: Conn, path: str) -> None:
    """Says 100 MB up front and keeps sending."""
    conn.send(head(200, HUGE))
    for _ in range(HUGE // len(BLOCK)):
        conn.send(BLOCK)


def huge_streamed(conn: Conn, path: str) -> None:
    """No Content-Length: 100 MB until the connection closes."""
    conn.send(head(200))
    for _ in range(HUGE // len(BLOCK)):
        conn.send(BLOCK)


def huge_chunked(conn: Conn, path: str) -> None:
    """Chunked: 100 MB in 64 KiB chunks."""
    conn.send(head(200, extra="Transfer-Encoding: chunked\r\n"))
    for _ in range(HUGE // len(BLOCK)):
        conn.send(b"%x\r\n" % len(BLOCK) + BLOCK + b"\r\n")


def truncated(conn: Conn, path: str) -> None:
    conn.send(head(200, 1000) + b'{"is_healthy":')


def truncated_chunked(conn: Conn, path: str) -> None:
    conn.send(head(200, extra="Transfer-Encoding: chunked\r\n") + b"100\r\n{}")


def not_http(conn: Conn, path: str) -> None:
    conn.send(b"SSH-2.0-OpenSSH_9.6\r\n")


def hang_up(conn: Conn, path: str) -> None:
    """Reads the request and closes without a word."""


@contextmanager
def timed(limit: float) -> Iterator[None]:
    start = time.monotonic()
    yield
    elapsed = time.monotonic() - start
    assert elapsed < limit, f"took {elapsed:.2f}s, over {limit:.2f}s"


# ---------------------------------------------------------------- /status


@pytest.mark.parametrize("behave", [trickle_body, trickle_headers, hang], ids=lambda b: b.__name__)
def test_a_stalling_server_costs_one_deadline(behave: Behave) -> None:
    with serving(behave) as peer, timed(DEADLINE + SLACK):
        rep = fetch_status("s-0", "127.0.0.1", peer.port, timeout=DEADLINE)
    assert not rep.healthy and "timed out" in rep.message and f"within {DEADLINE:g}s" in rep.message


def test_a_stalling_metrics_leaves_only_its_figures_unknown() -> None:
    with serving(routes({"/status": healthy, "/metrics": trickle_body})) as peer, timed(DEADLINE + SLACK):
        rep = fetch_status("s-0", "127.0.0.1", peer.port, timeout=DEADLINE)
    assert rep.healthy and rep.l2_objects == 8 and rep.lookups is None and rep.l2_writes_failed is None


GARBAGE = {
    "array": (b"[]", "body: expected a JSON object, got an array"),
    "null": (b"null", "got null"),
    "string": (b'"ok"', "got a string"),
    "storage_manager list": (b'{"storage_manager":[1]}', "storage_manager: expected a JSON object"),
    "adapter not an object": (b'{"storage_manager":{"l2_adapters":[1]}}', "storage_manager.l2_adapters.0"),
    "count as string": (b'{"is_healthy":true,"storage_manager":{"l1_manager":{"memory_used_bytes":"4194304"}}}',
                        "l1_manager.memory_used_bytes"),
    "count as fraction": (b'{"is_healthy":true,"storage_manager":{"l2_adapters":[{"stored_object_count":2.5}]}}',
                          "stored_object_count"),
    "negative count": (b'{"is_healthy":true,"storage_manager":{"l1_manager":{"memory_total_bytes":-1}}}', "memory_total_bytes"),
    "absurd count": (b'{"is_healthy":true,"storage_manager":{"l2_eviction_controller":{"adapters":[{"total_bytes_used":'
                     + b"9" * 40 + b"}]}}}", "total_bytes_used"),
    "pending as words": (b'{"is_healthy":true,"storage_manager":{"store_controller":{"pending_keys_count":"lots"}}}',
                         "pending_keys_count"),
    "health as string": (b'{"is_healthy":"yes"}', "is_healthy"),
    "health as NaN": (b'{"is_healthy":NaN}', "is_healthy"),
    "invalid JSON": (b'{"is_healthy": tru', "not JSON"),
    "html": (b"<html>oops</html>", "not JSON"),
    "binary": (b"\xff\xfe\x00garbage", "not JSON"),
    "nested too deep": (b"[" * 200_000, "not JSON"),
    "huge number": (b"1" * 10_000, "not JSON"),
}


@pytest.mark.parametrize("case", GARBAGE, ids=list(GARBAGE))
def test_garbage_status_is_an_unhealthy_report_with_the_reason(case: str) -> None:
    body, reason = GARBAGE[case]
    with serving(answer(body)) as peer:
        rep = fetch_status("s-0", "127.0.0.1", peer.port, timeout=DEADLINE)
    assert not rep.healthy and rep.message.startswith("malformed /status: ") and reason in rep.message, rep.message
    assert len(rep.message) < 400


@pytest.mark.parametrize(("behave", "reason"), [
    (answer(STATUS, 503), "answered HTTP 503"),
    (truncated, "truncated"),
    (truncated_chunked, "truncated"),
    (not_http, "not an HTTP response"),
    (hang_up, "closed the connection without answering"),
], ids=["503", "truncated", "truncated chunked", "not HTTP", "hang up"])
def test_broken_answers_are_unhealthy_with_the_reason(behave: Behave, reason: str) -> None:
    with serving(behave) as peer, timed(DEADLINE + SLACK):
        rep = fetch_status("s-0", "127.0.0.1", peer.port, timeout=DEADLINE)
    assert not rep.healthy and reason in rep.message, rep.message


def test_unresolvable_name_is_bounded() -> None:
    with timed(DEADLINE + SLACK):
        rep = fetch_status("s-0", "no-such-server.invalid", 8080, timeout=DEADLINE)
    assert not rep.healthy and "unreachable" in rep.message


def test_hostile_metrics_counters_leave_the_write_figures_unknown() -> None:
    metrics = b"lmcache_mp_l2_store_submitted_objects_chunks_total +Inf\nlmcache_mp_l2_store_completed_objects_chunks_total 8\n"
    with serving(routes({"/status": healthy, "/metrics": answer(metrics)})) as peer:
        rep = fetch_status("s-0", "127.0.0.1", peer.port, timeout=DEADLINE)
    assert rep.healthy and rep.l2_writes_failed is None and rep.l2_writes_submitted is None


@pytest.mark.parametrize("behave", [huge_declared, huge_streamed, huge_chunked], ids=lambda b: b.__name__)
def test_a_huge_body_is_refused_without_reading_it(behave: Behave) -> None:
    tracemalloc.start()
    try:
        with serving(behave) as peer, timed(DEADLINE):
            rep = fetch_status("s-0", "127.0.0.1", peer.port, timeout=5.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not rep.healthy and "limit" in rep.message, rep.message
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    assert peer.sent < 32 * 2**20, f"the server got to send {peer.sent / 2**20:.1f} MiB"


def test_a_huge_metrics_body_is_refused_and_the_status_stands() -> None:
    with serving(routes({"/status": healthy, "/metrics": huge_streamed})) as peer, timed(DEADLINE + SLACK):
        rep = fetch_status("s-0", "127.0.0.1", peer.port, timeout=5.0)
    assert rep.healthy and rep.l2_objects == 8 and rep.lookups is None
    assert peer.sent < 32 * 2**20


# ---------------------------------------------------------------- the canary's counters around a check

VLLM_METRICS = b"""vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 107.0
vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 0.0
vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 3840.0
"""


@pytest.mark.parametrize("behave", [trickle_body, hang, huge_streamed, not_http, answer(b'{"is_healthy": true}'),
                                    answer(VLLM_METRICS.replace(b"3840.0", b"NaN"))],
                         ids=["trickle", "hang", "huge", "not_http", "json", "nan"])
def test_the_canarys_counter_reads_cost_one_deadline_and_are_unknown_when_hostile(behave: Behave) -> None:
    """The vLLM pod and one of the servers on its node misbehave alike, the other server is well:
    one deadline for all the reads together, the hostile ones unknown (the check's tier then is)."""
    with ExitStack() as stack:
        ips, agent_port = _peers_on_one_port([healthy, behave], stack)
        vllm = stack.enter_context(serving(behave))
        with timed(DEADLINE + SLACK):
            got = read_counters_of("127.0.0.1", vllm.port, None, (("s-0", ips[0]), ("s-1", ips[1])), agent_port, None,
                                   timeout=DEADLINE)
    assert got.vllm is None and got.servers["s-1"] is None
    assert got.servers["s-0"] is not None and got.servers["s-0"].requested == 1024


def test_the_canarys_counter_reads_from_well_peers() -> None:
    with serving(answer(VLLM_METRICS)) as vllm, serving(healthy) as agent:
        got = read_counters_of("127.0.0.1", vllm.port, "sk-1", (("s-0", "127.0.0.1"),), agent.port, "t",
                               timeout=DEADLINE)
    assert got.vllm is not None and (got.vllm.computed, got.vllm.local_cache_hit, got.vllm.external) == (107, 0, 3840)
    assert got.servers["s-0"] is not None and got.servers["s-0"].hit == 512
    assert agent.paths == ["/server/metrics"] and vllm.paths == ["/metrics"]


# ---------------------------------------------------------------- many servers at once


def _peers_on_one_port(behaviours: list[Behave], stack: ExitStack) -> tuple[list[str], int]:
    """One server per loopback address 127.0.0.2.., all on the same port (collect_usage asks
    every pod on one port); retried when that port is taken on some address."""
    for _ in range(10):
        first = Peer(behaviours[0], "127.0.0.2")
        peers = [first]
        try:
            peers += [Peer(b, f"127.0.0.{i + 2}", first.port) for i, b in enumerate(behaviours) if i > 0]
        except OSError:
            for p in peers:
                p.close()
            continue
        for p in peers:
            stack.callback(p.close)
        return [f"127.0.0.{i + 2}" for i in range(len(behaviours))], first.port
    raise AssertionError("no port free on all the loopback addresses")


def test_collect_usage_over_many_servers_costs_one_deadline() -> None:
    behaviours: list[Behave] = [healthy] * 20 + [trickle_body, answer(b'{"storage_manager":[1]}')]
    with ExitStack() as stack:
        ips, port = _peers_on_one_port(behaviours, stack)
        pods = [(f"s-{i}", ip) for i, ip in enumerate(ips)]
        with timed(DEADLINE + SLACK):
            reports = collect_usage(pods, port, timeout=DEADLINE)
    assert [r.pod for r in reports] == [p for p, _ in pods]
    good, slow, garbled = reports[:20], reports[20], reports[21]
    for rep in good:
        assert rep.healthy and (rep.l1_used, rep.l1_capacity, rep.l2_objects) == (4194304, 536870912, 8)
        assert (rep.l2_writes_submitted, rep.l2_writes_failed) == (32, 24)
        assert rep.lookups is not None and (rep.lookups.requested, rep.lookups.hit) == (1024, 512)
    assert not slow.healthy and "timed out" in slow.message
    assert not garbled.healthy and "malformed /status: storage_manager" in garbled.message


# ---------------------------------------------------------------- the inventory agent


INVENTORY = json.dumps({"location": "/l2", "namespaces": [{"namespaceId": NSID, "bytes": 10, "objects": 1,
                                                           "lastWrite": "2026-01-01T00:00:00Z"}],
                        "otherBytes": 3, "capacityBytes": 100, "freeBytes": 50, "serving": NSID}).encode()
BAD_INVENTORIES = {
    "array": b"[]",
    "null": b"null",
    "namespaces not a list": b'{"namespaces":{"a":1}}',
    "namespace without id": b'{"namespaces":[{"bytes":1}]}',
    "id not a namespace id": b'{"namespaces":[{"namespaceId":"../etc"}]}',
    "bytes as string": json.dumps({"namespaces": [{"namespaceId": NSID, "bytes": "ten"}]}).encode(),
    "bad time": json.dumps({"namespaces": [{"namespaceId": NSID, "lastWrite": "yesterday"}]}).encode(),
    "time as number": json.dumps({"namespaces": [{"namespaceId": NSID, "lastWrite": 5}]}).encode(),
    "free bytes negative": b'{"freeBytes":-5}',
    "invalid JSON": b"{",
}


def test_a_valid_inventory_reads_as_before() -> None:
    with serving(answer(INVENTORY)) as peer:
        inv = fetch_inventory("127.0.0.1", peer.port, timeout=DEADLINE)
    assert inv is not None and inv.to_json() == {
        "location": "/l2", "otherBytes": 3, "capacityBytes": 100, "freeBytes": 50,
        "namespaces": [{"namespaceId": NSID, "bytes": 10, "objects": 1, "lastWrite": "2026-01-01T00:00:00Z"}]}


@pytest.mark.parametrize("case", BAD_INVENTORIES, ids=list(BAD_INVENTORIES))
def test_a_garbage_inventory_is_none_with_a_logged_reason(case: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvpersist.inventory.agentclient"), serving(answer(BAD_INVENTORIES[case])) as peer:
        assert fetch_inventory("127.0.0.1", peer.port, timeout=DEADLINE) is None
    assert f"127.0.0.1:{peer.port}" in caplog.text


@pytest.mark.parametrize(("behave", "reason"), [
    (trickle_body, "timed out"), (trickle_headers, "timed out"), (hang, "timed out"), (huge_declared, "limit"),
    (huge_streamed, "limit"), (answer(INVENTORY, 500), "HTTP 500"), (not_http, "not an HTTP response"),
], ids=["trickle body", "trickle headers", "hang", "huge declared", "huge streamed", "500", "not HTTP"])
def test_a_stalling_or_huge_inventory_is_none_within_the_deadline(behave: Behave, reason: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvpersist.inventory.agentclient"), serving(behave) as peer, timed(DEADLINE + SLACK):
        assert fetch_inventory("127.0.0.1", peer.port, timeout=DEADLINE) is None
    assert reason in caplog.text
    assert peer.sent < 32 * 2**20


@pytest.mark.parametrize(("behave", "reason"), [
    (trickle_body, "timed out"), (trickle_headers, "timed out"), (hang, "timed out"), (huge_streamed, "limit"),
    (not_http, "not an HTTP response"),
], ids=["trickle body", "trickle headers", "hang", "huge", "not HTTP"])
def test_gc_against_a_stalling_agent_is_bounded(behave: Behave, reason: str) -> None:
    with serving(behave) as peer, timed(DEADLINE + SLACK):
        code, body = request_gc("127.0.0.1", peer.port, NSID, dry_run=True, timeout=DEADLINE)
    assert code == 0 and "unreachable" in body["error"] and reason in body["error"], body


@pytest.mark.parametrize(("status", "raw", "reason"), [
    (200, b"[]", "expected a JSON object"),
    (200, b"null", "got null"),
    (200, b'{"deleted":true,"bytes":"lots"}', "bytes"),
    (200, b'{"deleted":"yes"}', "deleted"),
    (200, b"deleted", "not JSON"),
    (500, b"<html>Internal Server Error</html>", "not JSON"),
], ids=["array", "null", "bytes as string", "deleted as string", "not JSON", "500 html"])
def test_a_garbage_gc_answer_is_an_error_not_an_exception(status: int, raw: bytes, reason: str) -> None:
    with serving(answer(raw, status)) as peer:
        code, body = request_gc("127.0.0.1", peer.port, NSID, dry_run=False, timeout=DEADLINE)
        outcome = gc_volumes({"requestId": "r", "namespaceId": NSID}, [("p-0", "127.0.0.1")], peer.port)
    assert code == status and set(body) == {"error"} and reason in body["error"] and f"HTTP {status}" in body["error"], body
    assert outcome["outcome"] == "Failed" and "malformed" in outcome["message"]


def test_a_valid_gc_answer_passes_through_whole() -> None:
    reply = {"namespaceId": NSID, "bytes": 30, "objects": 3, "lastWrite": None, "dryRun": False, "deleted": True}
    with serving(answer(json.dumps(reply).encode())) as peer:
        assert request_gc("127.0.0.1", peer.port, NSID, dry_run=False, timeout=DEADLINE) == (200, reply)
        assert peer.paths == ["/gc"]


# ---------------------------------------------------------------- the helper itself


def test_the_helper_reads_a_chunked_body_and_stops_at_the_cap() -> None:
    def chunked(conn: Conn, path: str) -> None:
        conn.send(head(200, extra="Transfer-Encoding: chunked\r\n") + b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")

    with serving(chunked) as peer:
        assert httpclient.get("127.0.0.1", peer.port, "/", timeout=DEADLINE).body == b"abcde"
        with pytest.raises(httpclient.PeerError, match="limit"):
            httpclient.get("127.0.0.1", peer.port, "/", timeout=DEADLINE, max_bytes=4)
        assert httpclient.get("127.0.0.1", peer.port, "/", timeout=DEADLINE, max_bytes=5).body == b"abcde"


# ---------------------------------------------------------------- the agent's door to lmcache's admin API


@contextmanager
def agent_before(upstream: Peer, token: str = "t0ken") -> Iterator[int]:
    """A real kvpersist agent (no volume) forwarding to `upstream`, which stands in for the
    lmcache admin API on the pod's loopback; yields the agent's port."""
    from kvpersist.inventory.agent import Agent, make_server

    with in_thread(make_server(Agent(None, None, token=token, server=("127.0.0.1", upstream.port)), "127.0.0.1", 0)) as port:
        yield port


def _raw(port: int, method: str, path: str, headers: dict[str, str]) -> int:
    """The status the agent answers to exactly this request line (no client-side path cleaning)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
    try:
        conn.request(method, path, headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


def test_the_agent_forwards_status_with_the_token_and_metrics_and_nothing_else() -> None:
    with serving(routes({"/status": healthy, "/metrics": healthy})) as lmcache, agent_before(lmcache) as port:
        rep = fetch_status("s-0", "127.0.0.1", port, timeout=DEADLINE, token="t0ken")
        assert rep.healthy and rep.l2_writes_submitted == 32 and rep.lookups is not None
        for token in (None, "wrong"):
            refused = fetch_status("s-0", "127.0.0.1", port, timeout=DEADLINE, token=token)
            assert not refused.healthy and "HTTP 401" in refused.message and "bearer token" in refused.message
        assert httpclient.get("127.0.0.1", port, "/server/metrics", timeout=DEADLINE).body == METRICS  # open: counters
        for path in ("/env", "/server/env", "/cache/clear", "/server/cache/clear", "/server/../env", "/server/status/../env",
                     "/server/quota", "/server/reconfigure/l1"):
            # Sent as written (http.client): the operator's client normalises "..", a hostile caller need not.
            assert _raw(port, "GET", path, {"Authorization": "Bearer t0ken"}) == 404, path
            assert _raw(port, "DELETE", path, {}) in (404, 501), path
        # lmcache saw the two reads and nothing else.
        assert set(lmcache.paths) == {"/status", "/metrics"}


@pytest.mark.parametrize("behave", [trickle_body, hang, huge_streamed, garbage_status := answer(b"[]")],
                         ids=["trickle", "hang", "huge", "garbage"])
def test_a_misbehaving_server_behind_the_agent_costs_one_bounded_read(behave: Behave) -> None:
    from kvpersist.inventory.agent import PROXY_TIMEOUT_S

    with serving(behave) as lmcache, agent_before(lmcache) as port, timed(PROXY_TIMEOUT_S + SLACK + 0.5):
        rep = fetch_status("s-0", "127.0.0.1", port, timeout=PROXY_TIMEOUT_S + 0.5, token="t0ken")
    assert not rep.healthy, rep
    if behave is garbage_status:
        assert rep.message.startswith("malformed /status: "), rep.message
    else:
        assert "HTTP 50" in rep.message and "lmcache /status" in rep.message, rep.message
