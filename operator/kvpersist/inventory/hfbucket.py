"""Operator-side preflight of a Hugging Face bucket L2: does the bucket exist (or may we create
it), and does the token work? Checked with huggingface_hub before the lmcache servers find out
the hard way, and reported as L2Ready with a reason that names the fix.

Every Hub call the operator makes (this preflight, the bucket listing and deletion in
kvpersist.inventory.bucket) goes through one shared client built here. httpx's timeout bounds
each socket read, not a call: a Hub trickling a byte every few seconds would hold a worker
thread for as long as it likes. So each request here has one total deadline, connect to last
body byte, enforced by shutting its socket down from a timer, and a cap on the answer's size.

The token is read from the Secret by the caller and passed in; it is never logged, and no
message built here contains it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpx2

PREFLIGHT_TIMEOUT_S = 10.0  # each connect, socket read or write
HUB_CALL_DEADLINE_S = 30.0  # one whole request: connect, send, headers, body
HUB_MAX_BODY_BYTES = 32 * 1024 * 1024  # one answer; a listing page of 1000 entries is about 200 KB
DEADLINE_EXTENSION = "kvpersist_deadline"  # request extension: a time.monotonic() the request must end by
_TIMER_NAME = "kvp-hub-deadline"
_caller_deadline: ContextVar[float | None] = ContextVar("kvpersist_hub_deadline", default=None)
_client_lock = threading.Lock()
_client_bounded = False


class HubDeadlineExceeded(httpx2.ReadTimeout):
    """A Hub request that did not end within its deadline; a ReadTimeout, so the callers'
    transport-error handling (and huggingface_hub's retries) treat it as one."""


class HubAnswerTooLarge(httpx2.ReadError):
    """A Hub answer longer than HUB_MAX_BODY_BYTES; the connection was dropped unread."""


@dataclass(frozen=True)
class Preflight:
    ok: bool
    reason: str
    message: str


def bucket_id(handle: str) -> str:
    """hf://buckets/<ns>/<bucket>[/<prefix>] -> <ns>/<bucket>."""
    rest = handle.removeprefix("hf://buckets/")
    parts = [p for p in rest.split("/") if p]
    if not handle.startswith("hf://buckets/") or len(parts) < 2:
        raise ValueError(f"not a bucket handle: {handle!r}")
    return f"{parts[0]}/{parts[1]}"


@contextmanager
def hub_deadline(deadline: float) -> Iterator[None]:
    """Hub requests this thread makes inside the block end by `deadline` (a time.monotonic()), as
    if each carried the DEADLINE_EXTENSION: for calls made through HfApi, which passes no extensions."""
    token = _caller_deadline.set(deadline)
    try:
        yield
    finally:
        _caller_deadline.reset(token)


class _Watchdog:
    """One request's deadline. httpcore reports each socket it connects through the `trace`
    extension; a daemon timer shuts those sockets down at the deadline, which wakes a recv or send
    blocked in the request's thread (close alone would not). It holds a dup of each socket: the
    same kernel socket across the TLS wrap (which detaches the original object), and never a
    descriptor number that a closed socket may have handed on to another."""

    def __init__(self, deadline: float, seconds: float) -> None:
        self.deadline = deadline
        self.seconds = seconds
        self.fired = False
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._done = False
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
        self._timer.name = _TIMER_NAME
        self._timer.daemon = True
        self._timer.start()

    def watch(self, stream: Any) -> None:
        """A network stream httpcore connected (the trace's return_value): shut down with the rest."""
        sock = stream.get_extra_info("socket") if stream is not None else None
        if not isinstance(sock, socket.socket):
            return
        try:
            dup = sock.dup()
        except OSError:
            return
        with self._lock:
            if self._done:
                dup.close()
                return
            self._socks.append(dup)
            if self.fired:  # connected after the deadline: hang up at once
                _shutdown(dup)

    def expired(self) -> bool:
        return self.fired or time.monotonic() >= self.deadline

    def abort(self) -> None:
        """Hang up now (an answer refused midway): the server sees it, the reader wakes."""
        with self._lock:
            for sock in self._socks:
                _shutdown(sock)

    def finish(self) -> None:
        """Stops the timer and lets the sockets go; idempotent, and the timer thread is gone on return."""
        self._timer.cancel()
        with self._lock:
            self._done = True
            socks, self._socks = self._socks, []
        for sock in socks:
            sock.close()
        if self._timer is not threading.current_thread():
            self._timer.join(1.0)

    def error(self, request: httpx2.Request) -> HubDeadlineExceeded:
        return HubDeadlineExceeded(f"the Hub did not answer within {self.seconds:.3g}s", request=request)

    def _fire(self) -> None:
        with self._lock:  # shut down under the lock: finish() never closes a socket mid-shutdown
            if self._done:
                return
            self.fired = True
            for sock in self._socks:
                _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    with suppress(OSError):  # already closed or reset: nothing left to wake
        sock.shutdown(socket.SHUT_RDWR)


class _GuardedStream(httpx2.SyncByteStream):
    """A response body read under its request's deadline and HUB_MAX_BODY_BYTES. An answer cut
    short by the deadline is an error, never a short body (a body sent until EOF would look whole)."""

    def __init__(self, inner: httpx2.SyncByteStream, watchdog: _Watchdog, request: httpx2.Request) -> None:
        self._inner = inner
        self._watchdog = watchdog
        self._request = request

    def __iter__(self) -> Iterator[bytes]:
        cap, seen = HUB_MAX_BODY_BYTES, 0
        try:
            for chunk in self._inner:
                seen += len(chunk)
                if seen > cap:
                    self._watchdog.abort()
                    raise HubAnswerTooLarge(f"the Hub's answer was larger than {cap} bytes", request=self._request)
                yield chunk
            if self._watchdog.fired:
                raise self._watchdog.error(self._request)
        except (HubAnswerTooLarge, HubDeadlineExceeded):
            self._watchdog.finish()
            raise
        except Exception as exc:
            expired = self._watchdog.expired()
            self._watchdog.finish()
            if expired:
                raise self._watchdog.error(self._request) from exc
            raise
        self._watchdog.finish()

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._watchdog.finish()


class _DeadlineTransport(httpx2.HTTPTransport):
    """httpx's transport, giving each request one deadline for the whole exchange:
    HUB_CALL_DEADLINE_S, or earlier when the request carries DEADLINE_EXTENSION or runs inside
    hub_deadline(). Connect, read and write timeouts are clamped to it too (no socket to shut
    down while connecting), and a request whose deadline has passed is not sent."""

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        now = time.monotonic()
        deadline = now + HUB_CALL_DEADLINE_S
        for cap in (request.extensions.get(DEADLINE_EXTENSION), _caller_deadline.get()):
            if cap is not None:
                deadline = min(deadline, float(cap))
        seconds = deadline - now
        if seconds <= 0:
            raise HubDeadlineExceeded("the Hub call's deadline passed before this request was sent", request=request)
        watchdog = _Watchdog(deadline, seconds)
        original = request.extensions
        timeouts = original.get("timeout") or {}
        request.extensions = {  # a copy: a redirect reuses request.extensions, and gets its own watchdog
            **original,
            "timeout": {k: seconds if timeouts.get(k) is None else min(timeouts[k], seconds)
                        for k in ("connect", "read", "write", "pool")},
            "trace": _traced(watchdog, original.get("trace")),
        }
        try:
            response = super().handle_request(request)
        except Exception as exc:
            expired = watchdog.expired()
            watchdog.finish()
            if expired:
                raise watchdog.error(request) from exc
            raise
        except BaseException:
            watchdog.finish()
            raise
        finally:
            request.extensions = original
        response.stream = _GuardedStream(response.stream, watchdog, request)
        return response


def _traced(watchdog: _Watchdog, prior: Callable[[str, dict[str, Any]], Any] | None) -> Callable[[str, dict[str, Any]], Any]:
    """httpcore's trace callback: hands each newly connected stream to the watchdog, then calls any
    callback the request already had."""

    def trace(name: str, info: dict[str, Any]) -> Any:
        if name.endswith(".connect_tcp.complete"):  # "connection.connect_tcp.complete" (httpcore2/_sync/connection.py)
            watchdog.watch(info.get("return_value"))
        return prior(name, info) if prior is not None else None

    return trace


def hub_proxy(endpoint: str | None = None) -> str | None:
    """The proxy for the Hub endpoint (HF_ENDPOINT, else huggingface.co) from HTTPS_PROXY /
    HTTP_PROXY, unless NO_PROXY names its host: httpx reads these only for a client without an
    explicit transport, and this client has one, so they are applied here."""
    url = urllib.parse.urlsplit(endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    if not url.hostname or urllib.request.proxy_bypass(url.hostname):
        return None
    return urllib.request.getproxies().get(url.scheme)


def _hub_client() -> httpx2.Client:
    """The operator's Hub client. Keep-alive off: each request opens its own connection, which its
    watchdog may shut down without touching another request's. Accept-Encoding identity: the body
    cap then bounds what is decoded, not just what crosses the wire."""
    return httpx2.Client(follow_redirects=True, timeout=httpx2.Timeout(PREFLIGHT_TIMEOUT_S),
                         limits=httpx2.Limits(max_keepalive_connections=0), headers={"Accept-Encoding": "identity"},
                         transport=_DeadlineTransport(proxy=hub_proxy()))


def _bound_hub_client() -> None:
    """huggingface_hub's shared HTTP client has no timeout by default; the operator's is _hub_client."""
    global _client_bounded
    with _client_lock:
        if _client_bounded:
            return
        from huggingface_hub import close_session, constants, set_client_factory

        # No telemetry: with it, building a request's User-Agent makes huggingface_hub fetch
        # {endpoint}/api/agent-harnesses once a day (a call the operator never asked for, outside
        # any deadline of its own) and cache the answer under HF_HOME.
        constants.HF_HUB_DISABLE_TELEMETRY = True
        set_client_factory(_hub_client)
        close_session()
        _client_bounded = True


def reset_hub_client() -> None:
    """The next Hub call builds a fresh client (tests that change PREFLIGHT_TIMEOUT_S call this;
    the deadline and the body cap are read on each request)."""
    global _client_bounded
    with _client_lock:
        _client_bounded = False


def preflight_bucket(handle: str, token: str, create_if_missing: bool, secret_ref: str,
                     endpoint: str | None = None) -> Preflight:
    """One round of checks: bucket_info, then create_bucket when missing and allowed."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    _bound_hub_client()
    bid = bucket_id(handle)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.bucket_info(bid)
        return Preflight(True, "BucketReachable", f"bucket {bid} exists and the token from {secret_ref} can read it")
    except HfHubHTTPError as exc:
        code = exc.response.status_code if exc.response is not None else None
        if code == 404 and create_if_missing:
            try:
                api.create_bucket(bid, private=True, exist_ok=True)
                return Preflight(True, "BucketCreated", f"bucket {bid} did not exist and was created (createBucketIfMissing)")
            except HfHubHTTPError as create_exc:
                ccode = create_exc.response.status_code if create_exc.response is not None else None
                return _refused(bid, ccode, secret_ref, creating=True)
            except (httpx2.TransportError, OSError) as create_exc:  # not caught by the outer try's clauses below
                return _unreachable(bid, create_exc)
        if code == 404:
            return Preflight(False, "BucketNotFound", f"bucket {bid} does not exist (or the token from {secret_ref} cannot "
                             "see it): create it, or set spec.l2.hfBucket.createBucketIfMissing: true")
        return _refused(bid, code, secret_ref, creating=False)
    except (httpx2.TransportError, OSError) as exc:  # refused, DNS, TLS, timeout, deadline, answer too large
        return _unreachable(bid, exc)


def transport_error_text(exc: BaseException) -> str:
    """What a message may say about a failed Hub request: the exception type only, except for this
    module's own errors, whose text is ours (the deadline or the size cap) and never holds a URL
    or the token."""
    return str(exc) if isinstance(exc, HubDeadlineExceeded | HubAnswerTooLarge) else type(exc).__name__


def _unreachable(bid: str, exc: BaseException) -> Preflight:
    return Preflight(False, "HubUnreachable",
                     f"cannot reach the Hugging Face Hub to check bucket {bid}: {transport_error_text(exc)}")


def _refused(bid: str, code: int | None, secret_ref: str, creating: bool) -> Preflight:
    action = "create" if creating else "read"
    if code == 401:
        return Preflight(False, "TokenRejected", f"the Hub rejected the token from {secret_ref} (401): put a valid token "
                         "with write access to the bucket in that Secret")
    if code == 403:
        return Preflight(False, "TokenForbidden", f"the token from {secret_ref} may not {action} bucket {bid} (403): grant "
                         "it write access to the bucket's namespace")
    return Preflight(False, "HubError", f"the Hub answered {code} when asked to {action} bucket {bid}; retrying")
