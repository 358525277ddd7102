"""Bounded HTTP calls to peers the operator does not trust (lmcache servers, inventory agents, vLLM pods): a status
code and a whole body, or a PeerError with a short reason. Through kvpersist.httptransport, plain http: no proxy from
the environment, no cookies, no redirects, the body never decoded (so the cap bounds what is held)."""

from __future__ import annotations

import functools
import json
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import httpx2
from pydantic import BaseModel, Field, ValidationError

from kvpersist import httptransport

MAX_JSON_BYTES = 4 * 2**20  # /status, /inventory, /gc answers are a few KB
_MAX_REASON = 300  # a reason lands in a status message or a log line: keep a hostile one short
_DEFAULT_DEADLINE_S = 30.0  # the transport's default; every call here passes its own timeout as the deadline

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


@functools.cache
def _transport() -> httptransport.BoundedTransport:
    """One transport for every peer, built on first use (it keeps no connection, so any thread may share it). No httpx
    Client: nothing is read from the environment (proxies, .netrc) and no cookie a peer sets is kept."""
    return httptransport.BoundedTransport("the peer", lambda: _DEFAULT_DEADLINE_S, lambda: MAX_JSON_BYTES)


def _headers(body: bytes | None, content_type: str | None, headers: Mapping[str, str] | None) -> dict[str, str]:
    out = {"User-Agent": "kvpersist", "Connection": "close", "Accept-Encoding": "identity"}
    for name, value in (headers or {}).items():
        if any(c in name + value for c in "\r\n"):
            raise ValueError(f"header {name!r} holds a line break")
        out[name] = value
    if body is not None:
        out["Content-Type"] = content_type or "application/octet-stream"
    return out


def _root(exc: BaseException) -> BaseException:
    """The first OSError under exc (httpx wraps httpcore's error, which wraps the socket's)."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen or exc


def _reason(exc: BaseException, timeout: float) -> str:
    """Words for a failed call."""
    if isinstance(exc, httptransport.AnswerTooLarge):
        body = f"body of {exc.declared} bytes" if exc.declared is not None else "body"
        return f"{body} is over the {exc.limit}-byte limit"
    if isinstance(exc, httpx2.TimeoutException | TimeoutError):
        return f"timed out: no complete answer within {timeout:g}s"
    if isinstance(exc, httptransport.AnswerTruncated):
        return f"body truncated: {exc.received} bytes, then the connection ended"
    if isinstance(exc, httptransport.NotHTTP):
        return f"not an HTTP response ({exc.__cause__ or exc})"
    if isinstance(exc, httpx2.RemoteProtocolError):
        return "closed the connection without answering"
    root = _root(exc)
    if isinstance(root, ConnectionRefusedError):
        return "connection refused"
    if isinstance(root, socket.gaierror):
        return f"name lookup failed: {root.strerror or root}"
    if isinstance(root, OSError) and root.strerror:
        return root.strerror
    return str(exc) or type(exc).__name__


def request(method: str, host: str, port: int, path: str, *, timeout: float, max_bytes: int,
            body: bytes | None = None, content_type: str | None = None, headers: Mapping[str, str] | None = None) -> Reply:
    """One HTTP/1.1 call, over within timeout seconds in all, with a body of at most max_bytes.
    Any status code is a Reply; everything else (refused, unresolvable, too slow, too large,
    truncated, not HTTP) is a PeerError with the reason."""
    deadline = time.monotonic() + timeout
    response = None
    try:
        url = httpx2.URL(scheme="http", host=host, port=port, raw_path=path.encode("ascii"))
        call = httpx2.Request(method, url, headers=_headers(body, content_type, headers), content=body,
                              extensions={httptransport.DEADLINE: deadline, httptransport.MAX_BYTES: max_bytes})
        response = _transport().handle_request(call)
        return Reply(response.status_code, b"".join(response.stream))  # type: ignore[arg-type]
    except (httpx2.HTTPError, httpx2.InvalidURL, OSError, ValueError) as exc:
        raise PeerError("".join(c if c.isprintable() else "?" for c in _reason(exc, timeout))[:_MAX_REASON]) from exc
    finally:
        if response is not None:
            response.close()


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
    """A peer's JSON body; PeerError for anything that is not JSON (including nesting too deep for the parser)."""
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
    """call(item) for every item at once, results in order: each call is bounded by its own deadline, so a round over
    many peers costs one deadline, not one each."""
    if len(items) <= 1:  # one peer: its own deadline in this thread (a pool per call cost a thread start)
        return [call(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(limit, len(items))) as pool:
        return list(pool.map(call, items))
