"""The operator's one HTTP client stack: an httpx2 transport giving each request one deadline for the
whole exchange and a cap on its answer. Every peer is hostile: the in-cluster ones (lmcache servers,
inventory agents, vLLM pods; through kvpersist.httpclient) and the Hugging Face Hub (kvpersist.inventory.bucket).

httpx's timeouts bound each socket operation, not the call: a peer sending a byte a second holds a call
forever. Here a network backend bounds every operation of a request's connection (name lookup, connect,
TLS handshake, each read and write) by the time left to its deadline, so a trickle is cut, in headers or
body alike. The body is refused by its Content-Length before any is read, else once one byte over the cap
has arrived. Keep-alive is off: a connection serves one request and is closed with it, so no request
inherits a half-read connection or another's deadline.

httpx2 (2.0 to 2.16 checked) gives no way to pass a network backend: BoundedTransport sets the pool's
`_network_backend` itself, and refuses to build if that attribute is gone.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from typing import Any, NoReturn

import httpcore2
import httpx2

RESOLVER_THREAD = "kvp-resolve-"  # the name prefix of the one kind of thread this module starts (a name lookup)
DEADLINE = "kvpersist_deadline"  # request extension: a time.monotonic() the request must end by
MAX_BYTES = "kvpersist_max_bytes"  # request extension: the most bytes of body this request accepts
_NO_BODY_STATUS = (204, 304)  # a Content-Length on these (or on a HEAD's answer) describes no body here

_caller_deadline: ContextVar[float | None] = ContextVar("kvpersist_caller_deadline", default=None)
_connecting: ContextVar[_Call | None] = ContextVar("kvpersist_connecting", default=None)


class Refused(Exception):
    """An answer this transport gave up on. Its text is ours (never the URL, a header or the peer's bytes): a status
    message may quote it."""


class DeadlineExceeded(httpx2.ReadTimeout, Refused):
    """A request that did not end by its deadline; a ReadTimeout, so callers' (and huggingface_hub's) handling of
    transport errors treats it as one."""


class AnswerTooLarge(httpx2.ReadError, Refused):
    """An answer over the request's cap; the connection was dropped unread."""

    def __init__(self, message: str, *, limit: int, declared: int | None = None,
                 request: httpx2.Request | None = None) -> None:
        super().__init__(message, request=request)
        self.limit, self.declared = limit, declared


class NotHTTP(httpx2.RemoteProtocolError, Refused):
    """Bytes came back, but no HTTP response head."""


class AnswerTruncated(httpx2.RemoteProtocolError, Refused):
    """The connection ended before the body its head announced."""

    def __init__(self, message: str, *, received: int, request: httpx2.Request | None = None) -> None:
        super().__init__(message, request=request)
        self.received = received


@contextmanager
def ending_by(deadline: float) -> Iterator[None]:
    """Requests this thread makes through a BoundedTransport in the block end by `deadline` (a time.monotonic()), as
    if each carried DEADLINE: for callers that pass no extensions (huggingface_hub's HfApi)."""
    token = _caller_deadline.set(deadline)
    try:
        yield
    finally:
        _caller_deadline.reset(token)


class _Call:
    """One request's deadline, shared by every stream of its connection, and its errors, in words naming the peer
    (`who`) and nothing it sent."""

    def __init__(self, deadline: float, who: str, seconds: float, request: httpx2.Request) -> None:
        self.deadline, self.who, self.seconds, self.request = deadline, who, seconds, request
        self.received = 0  # bytes read back, head and body
        self.cut = False  # the last wait was bounded by the deadline, not by the caller's timeout

    def clamp(self, timeout: float | None, error: type[Exception]) -> float:
        """timeout, shortened to the time left; `error` once none is left."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.cut = True
            raise error("the request's deadline passed")
        self.cut = timeout is None or left <= timeout
        return left if self.cut else timeout  # type: ignore[return-value]

    def too_large(self, limit: int, declared: int | None = None) -> AnswerTooLarge:
        said = f" ({declared} declared)" if declared is not None else ""
        return AnswerTooLarge(f"{self.who}'s answer was larger than {limit} bytes{said}", limit=limit, declared=declared,
                              request=self.request)

    def reraise(self, exc: httpx2.TransportError, body_seen: int | None = None) -> NoReturn:
        """Ours for a failure the deadline caused or a peer that broke HTTP; else exc as it is."""
        if time.monotonic() >= self.deadline or (isinstance(exc, httpx2.TimeoutException) and self.cut):
            raise DeadlineExceeded(f"{self.who} did not answer within {self.seconds:.3g}s", request=self.request) from exc
        if isinstance(exc, httpx2.RemoteProtocolError) and body_seen is not None:
            raise AnswerTruncated(f"{self.who}'s answer ended after {body_seen} bytes of its body", received=body_seen,
                                  request=self.request) from exc
        if isinstance(exc, httpx2.RemoteProtocolError) and self.received:
            raise NotHTTP(f"{self.who} answered something that is not an HTTP response", request=self.request) from exc
        raise exc


class _Stream(httpcore2.NetworkStream):
    """httpcore's stream with every wait bounded by the request's deadline."""

    def __init__(self, inner: httpcore2.NetworkStream, call: _Call) -> None:
        self._inner, self._call = inner, call

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = self._inner.read(max_bytes, self._call.clamp(timeout, httpcore2.ReadTimeout))
        self._call.received += len(data)
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, self._call.clamp(timeout, httpcore2.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore2.NetworkStream:
        inner = self._inner.start_tls(ssl_context, server_hostname, self._call.clamp(timeout, httpcore2.ConnectTimeout))
        return _Stream(inner, self._call)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


def _addresses(host: str, port: int, call: _Call) -> list[str]:
    """The addresses of host, looked up before the deadline. getaddrinfo has no timeout, so a name (not an IP) is
    looked up on a daemon thread that is abandoned at the deadline."""
    with suppress(ValueError):
        ipaddress.ip_address(host)
        return [host]
    found: list[Any] = []

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            found.append(exc)

    worker = threading.Thread(target=lookup, name=f"{RESOLVER_THREAD}{host}"[:60], daemon=True)
    worker.start()
    worker.join(call.clamp(None, httpcore2.ConnectTimeout))
    if not found:
        call.cut = True
        raise httpcore2.ConnectTimeout(f"looking up {host} timed out")
    if isinstance(found[0], OSError):
        why = found[0].strerror if isinstance(found[0], socket.gaierror) and found[0].strerror else found[0]
        raise httpcore2.ConnectError(f"name lookup failed: {why}") from found[0]
    return list(dict.fromkeys(str(info[4][0]) for info in found[0]))


class _Backend(httpcore2.NetworkBackend):
    """httpcore's backend whose connections carry the deadline of the request that opens them."""

    def __init__(self, inner: httpcore2.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore2.NetworkStream:
        call = _connecting.get()
        if call is None:  # only BoundedTransport's pool has this backend, and it sets the call
            raise httpcore2.ConnectError("a connection outside a bounded request")
        last: Exception = httpcore2.ConnectError(f"no address for {host}")
        for address in _addresses(host, port, call):
            try:
                inner = self._inner.connect_tcp(address, port, call.clamp(timeout, httpcore2.ConnectTimeout),
                                                local_address, socket_options)
                return _Stream(inner, call)
            except httpcore2.ConnectError as exc:  # refused, unreachable: the next address (a timeout ends here)
                last = exc
        raise last

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _CappedStream(httpx2.SyncByteStream):
    """A response body read under its request's deadline and cap. A body cut short is an error, never a short body."""

    def __init__(self, inner: httpx2.SyncByteStream, call: _Call, limit: int) -> None:
        self._inner, self._call, self._limit = inner, call, limit

    def __iter__(self) -> Iterator[bytes]:
        seen = 0
        try:
            for chunk in self._inner:
                seen += len(chunk)
                if seen > self._limit:
                    raise self._call.too_large(self._limit)
                yield chunk
        except AnswerTooLarge:
            self._inner.close()  # hang up now: the peer sees it, nothing more is read
            raise
        except httpx2.TransportError as exc:
            self._call.reraise(exc, body_seen=seen)

    def close(self) -> None:
        self._inner.close()


class BoundedTransport(httpx2.HTTPTransport):
    """httpx's transport with one deadline per request (deadline_s() from its start, or earlier when the request
    carries DEADLINE or runs inside ending_by()) and a cap on each answer (max_bytes(), or the request's MAX_BYTES),
    both read on each request. `who` names the peer in error messages ("the Hub"). A proxy is used only when passed in."""

    def __init__(self, who: str, deadline_s: Callable[[], float], max_bytes: Callable[[], int], **options: Any) -> None:
        super().__init__(limits=httpx2.Limits(max_connections=None, max_keepalive_connections=0), **options)
        backend = getattr(self._pool, "_network_backend", None)
        if not isinstance(backend, httpcore2.NetworkBackend):
            raise RuntimeError(f"httpx2 {httpx2.__version__}: its pool has no _network_backend to bound; "
                               "kvpersist.httptransport was checked with 2.0 to 2.16")
        self._pool._network_backend = _Backend(backend)  # type: ignore[union-attr]
        self._who, self._deadline_s, self._max_bytes = who, deadline_s, max_bytes

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        now = time.monotonic()
        caps = (request.extensions.get(DEADLINE), _caller_deadline.get())
        deadline = min([now + self._deadline_s(), *(float(cap) for cap in caps if cap is not None)])
        if deadline <= now:
            raise DeadlineExceeded(f"the deadline of this call to {self._who} passed before the request was sent",
                                   request=request)
        limit = request.extensions.get(MAX_BYTES)
        limit = self._max_bytes() if limit is None else int(limit)
        call = _Call(deadline, self._who, deadline - now, request)
        token = _connecting.set(call)
        try:
            response = super().handle_request(request)
        except httpx2.TransportError as exc:
            call.reraise(exc)
        finally:
            _connecting.reset(token)
        declared = response.headers.get("Content-Length", "")
        if (declared.isdigit() and int(declared) > limit and request.method != "HEAD"
                and response.status_code not in _NO_BODY_STATUS):
            response.close()
            raise call.too_large(limit, int(declared))
        response.stream = _CappedStream(response.stream, call, limit)  # type: ignore[arg-type]
        return response
