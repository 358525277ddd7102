"""Bounded HTTP calls to peers the operator does not trust (lmcache servers, inventory agents).

urllib's timeout bounds each socket read, not the call: a peer that sends one byte a second
holds it forever, and its body is read whole. Here every call has one deadline for everything
(name lookup, connect, request, status line and headers, body), checked before each socket read,
and a body cap checked against Content-Length first and then while reading. http.client still
parses the response (status line, header and chunk limits); it reads through a file whose every
read is bounded by the time left.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, Field, ValidationError

MAX_JSON_BYTES = 4 * 2**20  # /status, /inventory, /gc answers are a few KB
_READ_SIZE = 65536
_MAX_REASON = 300  # a reason lands in a status message or a log line: keep a hostile one short

# A count or byte figure a peer reports: a JSON integer, never negative, and exact as a float
# (a larger one would be garbage, and sums of them must still fit the API server's int64).
Count = Annotated[int, Field(strict=True, ge=0, le=2**53)]

M = TypeVar("M", bound=BaseModel)


class PeerError(Exception):
    """Why a peer gave no usable answer, in words for a status message or a log line."""


@dataclass(frozen=True)
class Reply:
    """A whole response: its status code and its body (at most the cap)."""

    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def _remaining(deadline: float) -> float:
    """Seconds left before deadline (monotonic); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


class _DeadlineReader(io.RawIOBase):
    """A socket as a raw stream whose every read waits at most until the deadline, so a peer
    trickling bytes (into the headers or the body) is cut there rather than served forever."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        self._sock.settimeout(_remaining(self._deadline))
        return self._sock.recv_into(b, min(len(b), _READ_SIZE))


class _Wire:
    """What http.client.HTTPResponse needs of a socket: makefile("rb")."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


def _resolve(host: str, port: int, deadline: float) -> list[Any]:
    """Addresses of host. getaddrinfo has no timeout, so a name (not an IP) is looked up on a
    daemon thread that is abandoned at the deadline."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass
    found: list[Any] = []

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            found.append(exc)

    worker = threading.Thread(target=lookup, name=f"resolve-{host}"[:60], daemon=True)
    worker.start()
    worker.join(_remaining(deadline))
    if not found:
        raise TimeoutError(f"resolving {host} timed out")
    if isinstance(found[0], OSError):
        raise found[0]
    return found[0]


def _connect(host: str, port: int, deadline: float) -> socket.socket:
    """A connected socket to the first address of host that accepts before the deadline."""
    last: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, addr in _resolve(host, port, deadline):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(_remaining(deadline))
            sock.connect(addr)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise last


def _head(method: str, host: str, port: int, path: str, body: bytes | None, content_type: str | None,
          headers: Mapping[str, str] | None = None) -> bytes:
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [f"{method} {path} HTTP/1.1", f"Host: {authority}", "User-Agent: kvpersist", "Connection: close"]
    for name, value in (headers or {}).items():
        if any(c in name + value for c in "\r\n"):
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    if body is not None:
        lines += [f"Content-Type: {content_type or 'application/octet-stream'}", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


def _read_body(resp: http.client.HTTPResponse, max_bytes: int) -> bytes:
    """The body, refused as soon as it is known to exceed max_bytes: by its Content-Length
    before any of it is read, else once one byte more than the cap has arrived."""
    declared = resp.length  # None: chunked, or delimited by the peer closing
    if declared is not None and declared > max_bytes:
        raise PeerError(f"body of {declared} bytes is over the {max_bytes}-byte limit")
    chunks, size = [], 0
    while chunk := resp.read(min(_READ_SIZE, max_bytes + 1 - size)):
        size += len(chunk)
        if size > max_bytes:
            raise PeerError(f"body is over the {max_bytes}-byte limit")
        chunks.append(chunk)
    if declared is not None and size < declared:
        raise PeerError(f"body truncated: {size} of {declared} bytes")
    return b"".join(chunks)


def _reason(exc: BaseException, timeout: float) -> str:
    """Words for a failed call."""
    if isinstance(exc, TimeoutError):
        return f"timed out: no complete answer within {timeout:g}s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return f"name lookup failed: {exc.strerror or exc}"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "closed the connection without answering"
    if isinstance(exc, http.client.IncompleteRead):
        return f"body truncated: {len(exc.partial)} bytes, then the connection ended"
    if isinstance(exc, http.client.HTTPException):
        return f"not an HTTP response ({type(exc).__name__}: {exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def request(method: str, host: str, port: int, path: str, *, timeout: float, max_bytes: int,
            body: bytes | None = None, content_type: str | None = None, headers: Mapping[str, str] | None = None) -> Reply:
    """One HTTP/1.1 call, over within timeout seconds in all, with a body of at most max_bytes.
    Any status code is a Reply; everything else (refused, unresolvable, too slow, too large,
    truncated, not HTTP) is a PeerError with the reason."""
    deadline = time.monotonic() + timeout
    sock = resp = None
    try:
        sock = _connect(host, port, deadline)
        sock.settimeout(_remaining(deadline))
        sock.sendall(_head(method, host, port, path, body, content_type, headers) + (body or b""))
        resp = http.client.HTTPResponse(_Wire(sock, deadline), method=method)  # type: ignore[arg-type]
        resp.begin()
        return Reply(resp.status, _read_body(resp, max_bytes))
    except PeerError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise PeerError(_reason(exc, timeout)[:_MAX_REASON]) from exc
    finally:
        if resp is not None:
            resp.close()
        if sock is not None:
            sock.close()


def get(host: str, port: int, path: str, *, timeout: float, max_bytes: int = MAX_JSON_BYTES,
        headers: Mapping[str, str] | None = None) -> Reply:
    return request("GET", host, port, path, timeout=timeout, max_bytes=max_bytes, headers=headers)


def post_json(host: str, port: int, path: str, payload: Any, *, timeout: float, max_bytes: int = MAX_JSON_BYTES,
              headers: Mapping[str, str] | None = None) -> Reply:
    return request("POST", host, port, path, timeout=timeout, max_bytes=max_bytes, body=json.dumps(payload).encode(),
                   content_type="application/json", headers=headers)


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def problems(exc: ValidationError, limit: int = 3) -> str:
    """A validation error in a line: where (dotted path into the body) and what, first few."""
    parts = []
    for err in exc.errors(include_url=False)[:limit]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        what = f"expected a JSON object, got {_json_type(err['input'])}" if err["type"] == "model_type" else err["msg"]
        parts.append(f"{where}: {what}")
    more = exc.error_count() - limit
    return ("; ".join(parts) + (f" (and {more} more)" if more > 0 else ""))[:_MAX_REASON]


def load_json(body: bytes) -> Any:
    """A peer's JSON body; PeerError for anything that is not JSON (including nesting too deep
    for the parser)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise PeerError(f"not JSON: {str(exc)[:200]}") from None


def parse(body: bytes, model: type[M]) -> M:
    """A peer's JSON body as model; PeerError naming what is malformed."""
    data = load_json(body)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise PeerError(problems(exc)) from None


R = TypeVar("R")
MAX_PARALLEL = 32  # peers asked at once: that many stuck ones still cost one deadline together


def in_parallel(call: Callable[[Any], R], items: Sequence[Any], limit: int = MAX_PARALLEL) -> list[R]:
    """call(item) for every item at once, results in order: each call is bounded by its own
    deadline, so a round over many peers costs one deadline, not one each."""
    if not items:
        return []
    if len(items) == 1:  # one peer: its own deadline in this thread (a pool per call cost a thread start)
        return [call(items[0])]
    with ThreadPoolExecutor(max_workers=min(limit, len(items))) as pool:
        return list(pool.map(call, items))
