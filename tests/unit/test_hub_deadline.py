"""Each Hub request has one deadline for the whole exchange and a cap on its answer
(kvpersist.inventory.bucket's client): a Hub that trickles its answer, headers or body, a byte
at a time (each read well inside httpx's per-read timeout) is hung up on at the deadline, and an
endless answer is hung up on at the cap, instead of holding a worker thread.

Against real HTTP servers on 127.0.0.1, through huggingface_hub's real client. Each Hub call runs
on a thread joined with a timeout, so a regression fails the test instead of hanging it; every
server and thread started here is stopped and joined, every wait is bounded."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvpersist import httptransport
from kvpersist.inventory import bucket
from kvpersist.inventory.bucket import BucketInventoryError, preflight_bucket, scan_bucket
from tests.integration.hub_stub import GOOD_TOKEN, HubStub
from tests.serving import in_thread

BID = "acme-ml/kv-cache"
HANDLE = f"hf://buckets/{BID}/prod"
TOKEN = "hf_deadline_test_token_0123456789"
DEADLINE_S = 1.5  # HUB_CALL_DEADLINE_S in these tests
SLACK_S = 2.0  # what a call may take past its deadline
TRICKLE_S = 0.2  # one byte every TRICKLE_S: each read well inside PREFLIGHT_TIMEOUT_S (10 s)
HUGE = 100 * 1024 * 1024
NS = "kvp-" + "c" * 32


class Stub:
    """A Hub stand-in answering every request with `answer(handler)`; records the requests, the
    bytes it sent and whether the client hung up on it. `stop` ends a trickle early."""

    def __init__(self, answer: Callable[[Stub, BaseHTTPRequestHandler], None]) -> None:
        self.answer = answer
        self.stop = threading.Event()
        self.hung_up = threading.Event()
        self.paths: list[str] = []
        self.sent = 0
        self.url = ""

    def trickle(self, handler: BaseHTTPRequestHandler, data: bytes) -> None:
        for i in range(len(data)):
            if self.stop.wait(TRICKLE_S):
                return
            handler.wfile.write(data[i:i + 1])
            self.sent += 1


@contextmanager
def serving(answer: Callable[[Stub, BaseHTTPRequestHandler], None]) -> Iterator[Stub]:
    stub = Stub(answer)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_: object) -> None:
            return

        def do_GET(self) -> None:
            stub.paths.append(self.path)
            try:
                stub.answer(stub, self)
            except (BrokenPipeError, ConnectionResetError):
                stub.hung_up.set()
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # handler threads joined by server_close
    with in_thread(server) as port:
        stub.url = f"http://127.0.0.1:{port}"
        try:
            yield stub
        finally:
            stub.stop.set()  # a trickle still running ends within TRICKLE_S


def body_trickled(stub: Stub, handler: BaseHTTPRequestHandler) -> None:
    """Headers at once, then a valid (empty) JSON listing a byte at a time: 20 s in all."""
    body = b"[" + b" " * 98 + b"]"
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    stub.trickle(handler, body)


def head_trickled(stub: Stub, handler: BaseHTTPRequestHandler) -> None:
    """The status line and headers themselves a byte at a time: about 30 s in all."""
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Pad: " + b"p" * 60
            + b"\r\nContent-Length: 2\r\n\r\n[]")
    stub.trickle(handler, head)


def huge(stub: Stub, handler: BaseHTTPRequestHandler) -> None:
    """A 100 MB page, sent as fast as the client reads it."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(HUGE))
    handler.end_headers()
    chunk = b" " * (1024 * 1024)
    while stub.sent < HUGE and not stub.stop.is_set():
        handler.wfile.write(chunk)
        stub.sent += len(chunk)


@pytest.fixture()
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[dict[str, Any], float]]]:
    """Runs a Hub call on a thread, joined within `limit` seconds: ({"result": ...} or {"error": ...},
    seconds taken). A small per-request deadline; the client rebuilt before and after."""
    monkeypatch.setattr(bucket, "HUB_CALL_DEADLINE_S", DEADLINE_S)
    bucket._client_bounded = False  # the next Hub call builds a fresh client
    threads: list[threading.Thread] = []

    def call(fn: Callable[[], Any], limit: float = DEADLINE_S + SLACK_S) -> tuple[dict[str, Any], float]:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = fn()
            except Exception as exc:
                box["error"] = exc

        thread = threading.Thread(target=run, name="test-hub-call", daemon=True)
        threads.append(thread)
        start = time.monotonic()
        thread.start()
        thread.join(limit)
        took = time.monotonic() - start
        assert not thread.is_alive(), f"the Hub call was still running after {limit:g}s"
        assert watchdogs() == [], "a deadline timer outlived its call"
        return box, took

    yield call
    for thread in threads:  # a call that overran ends once its stub stops (the test's `with` has ended)
        thread.join(15)
    bucket._client_bounded = False  # the next Hub call builds a fresh client


def watchdogs() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.is_alive() and (t.name.startswith(httptransport.RESOLVER_THREAD) or isinstance(t, threading.Timer))]


@pytest.mark.parametrize("answer", [body_trickled, head_trickled], ids=["body", "headers"])
def test_a_trickled_listing_ends_at_the_deadline(calls: Callable[..., tuple[dict[str, Any], float]],
                                                 answer: Callable[[Stub, BaseHTTPRequestHandler], None]) -> None:
    with serving(answer) as stub:
        box, took = calls(lambda: scan_bucket(HANDLE, TOKEN, endpoint=stub.url))
        assert stub.hung_up.wait(5), "the client never hung up"
    err = box.get("error")
    assert isinstance(err, BucketInventoryError), box
    assert err.reason == "HubTimeout" and f"within {DEADLINE_S:g}s" in str(err) and BID in str(err)
    assert TOKEN not in str(err)
    assert DEADLINE_S - 0.1 <= took < DEADLINE_S + SLACK_S
    if answer is body_trickled:
        assert 0 < stub.sent < 100  # some of the body came, not all of it


def test_a_huge_page_is_refused_and_the_connection_dropped(calls: Callable[..., tuple[dict[str, Any], float]],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bucket, "HUB_CALL_DEADLINE_S", 20.0)  # the cap, not the deadline, ends it
    with serving(huge) as stub:
        box, _ = calls(lambda: scan_bucket(HANDLE, TOKEN, endpoint=stub.url), limit=20.0)
        assert stub.hung_up.wait(5), "the client read on to the end"
    err = box.get("error")
    assert isinstance(err, BucketInventoryError), box
    assert err.reason == "HubUnreachable" and f"larger than {bucket.HUB_MAX_BODY_BYTES} bytes" in str(err)
    assert stub.sent < HUGE


def test_preflight_against_a_trickling_hub_names_the_deadline(calls: Callable[..., tuple[dict[str, Any], float]]) -> None:
    with serving(body_trickled) as stub:
        box, took = calls(lambda: preflight_bucket(f"hf://buckets/{BID}", TOKEN, False, "ns/secret", endpoint=stub.url))
    result = box.get("result")
    assert result is not None, box
    assert (result.ok, result.reason) == (False, "HubUnreachable")
    assert f"did not answer within {DEADLINE_S:g}s" in result.message and BID in result.message
    assert TOKEN not in result.message
    assert took < DEADLINE_S + SLACK_S
    assert stub.paths == [f"/api/buckets/{BID}"]


def test_the_listings_own_deadline_reaches_each_page(calls: Callable[..., tuple[dict[str, Any], float]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """BUCKET_DEADLINE_S, earlier than the per-request deadline, cuts a page short (the extension
    reaches the transport), not only the start of the next page."""
    monkeypatch.setattr(bucket, "HUB_CALL_DEADLINE_S", 30.0)
    monkeypatch.setattr(bucket, "BUCKET_DEADLINE_S", DEADLINE_S)
    with serving(body_trickled) as stub:
        box, took = calls(lambda: scan_bucket(HANDLE, TOKEN, endpoint=stub.url))
    err = box.get("error")
    assert isinstance(err, BucketInventoryError) and err.reason == "HubTimeout", box
    assert took < DEADLINE_S + SLACK_S


def test_hub_deadline_bounds_calls_without_the_extension(calls: Callable[..., tuple[dict[str, Any], float]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """hub_deadline() (used around HfApi's batch delete) bounds a request made inside it; one made
    after it passed is not sent at all."""
    from huggingface_hub.utils import get_session

    monkeypatch.setattr(bucket, "HUB_CALL_DEADLINE_S", 30.0)
    bucket.bound_hub_client()

    def inside(seconds: float) -> Any:
        with bucket.hub_deadline(time.monotonic() + seconds):
            return get_session().get(stub.url + "/api/buckets/x/y")

    with serving(body_trickled) as stub:
        box, took = calls(lambda: inside(DEADLINE_S))
        assert isinstance(box.get("error"), bucket.HubDeadlineExceeded), box
        assert took < DEADLINE_S + SLACK_S
        box, _ = calls(lambda: inside(-1.0))
        assert isinstance(box.get("error"), bucket.HubDeadlineExceeded), box
        assert len(stub.paths) == 1


def test_a_normal_listing_pages_through(calls: Callable[..., tuple[dict[str, Any], float]]) -> None:
    """The happy path through the wrapped stream: 5 objects, 2 a page, chained by Link next."""
    with HubStub(existing={BID}, page_size=2) as hub:
        for i in range(4):
            hub.put(BID, f"prod/{NS}/obj{i}", b"x" * (100 + i), 1_785_000_000.0 + i)
        hub.put(BID, "prod/README.md", b"r" * 7, 1_785_000_000.0)
        box, _ = calls(lambda: scan_bucket(HANDLE, GOOD_TOKEN, endpoint=hub.url))
    inv = box.get("result")
    assert inv is not None, box
    usage = next((n for n in inv.namespaces if n.namespace_id == NS), None)
    assert usage is not None and (usage.objects, usage.bytes) == (4, 100 + 101 + 102 + 103)
    assert inv.other_bytes == 7
    assert sum(1 for m, p in hub.requests if m == "GET" and "/tree/" in p) == 3


def test_a_trace_callback_of_the_caller_still_runs(calls: Callable[..., tuple[dict[str, Any], float]]) -> None:
    from huggingface_hub.utils import get_session

    seen: list[str] = []
    bucket.bound_hub_client()
    with HubStub(existing={BID}) as hub:
        box, _ = calls(lambda: get_session().get(f"{hub.url}/api/buckets/{BID}", headers={"Authorization": f"Bearer {GOOD_TOKEN}"},
                                                 extensions={"trace": lambda name, _info: seen.append(name)}))
    assert box.get("result") is not None and box["result"].status_code == 200, box
    assert "connection.connect_tcp.complete" in seen and "http11.receive_response_body.complete" in seen


def bucket_info(stub: Stub, handler: BaseHTTPRequestHandler) -> None:
    body = (b'{"id": "acme-ml/kv-cache", "private": true, "createdAt": "2026-11-30T00:00:00.000Z", "size": 0, '
            b'"totalFiles": 0}')  # the shape tests/integration/hub_stub.py answers
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def test_the_hub_is_asked_through_the_environments_proxy(calls: Callable[..., tuple[dict[str, Any], float]],
                                                         monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """HTTP(S)_PROXY as httpx would honour it without an explicit transport (this client has one):
    the request goes to the proxy in absolute form, still under its deadline; NO_PROXY naming the
    Hub's host turns it off. The stub plays the proxy; hub.invalid is never resolved. And the Hub is
    asked the bucket only: no cached agent-harness registry (huggingface_hub fetches one a day for
    its telemetry User-Agent, which the operator turns off)."""
    from huggingface_hub import constants as hub_constants
    from huggingface_hub.utils import _detect_agent

    monkeypatch.setattr(hub_constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agent_harnesses.json"))
    monkeypatch.setattr(_detect_agent, "_registry", None)
    monkeypatch.setattr(hub_constants, "HF_HUB_DISABLE_TELEMETRY", False)  # as a fresh process has it
    monkeypatch.setattr(hub_constants, "ENDPOINT", "http://hub.invalid")  # as HF_ENDPOINT set before the import makes it
    with serving(bucket_info) as proxy:
        for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("http_proxy", proxy.url)
        assert bucket.hub_proxy("http://hub.invalid") == proxy.url
        bucket._client_bounded = False  # the next Hub call builds a fresh client
        monkeypatch.setenv("HF_ENDPOINT", "http://hub.invalid")
        box, _ = calls(lambda: preflight_bucket(HANDLE, TOKEN, False, "ns/hf", endpoint="http://hub.invalid"))
        assert "result" in box and box["result"].ok, box
        assert proxy.paths == [f"http://hub.invalid/api/buckets/{BID}"], proxy.paths
        monkeypatch.setenv("NO_PROXY", "hub.invalid")
        monkeypatch.setenv("no_proxy", "hub.invalid")
        assert bucket.hub_proxy("http://hub.invalid") is None
