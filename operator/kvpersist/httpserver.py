"""A bounded HTTP server for the inventory agent and the operator's metrics (standard library only).

http.server's ThreadingHTTPServer starts a thread per connection with no cap and reads with no
timeout: a peer that opens thousands of connections and trickles (or never sends) its headers holds
as many threads for as long as it likes. Here one selector thread waits for every request head at
once (an idle connection costs a socket, no thread); each head must arrive whole within
HEAD_TIMEOUT_S of the accept and fit MAX_HEAD_BYTES, and beyond `max_pending` waiting connections
the oldest is closed, so a flood of idle ones never shuts out a client that sends at once (the
operator, the kubelet's probe). A complete head goes to a fixed pool of workers (a bounded queue
before them: 503 when full) running the ordinary handler, each socket read bounded by IO_TIMEOUT_S
and all of a request's reads by REQUEST_TIMEOUT_S. One request per connection (HTTP/1.0).

Probes: a GET of a path in `probes` is answered on the selector thread from the probe's callable
(in-memory state, never blocking), so slow requests and a full queue cannot fail the kubelet's
liveness probe and get a process restarted by whoever fills them.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import logging
import queue
import re
import selectors
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

HEAD_TIMEOUT_S = 10.0  # from accept to the blank line ending the headers
IO_TIMEOUT_S = 10.0  # each socket read or write of a handler
REQUEST_TIMEOUT_S = 15.0  # all of a handler's reads together (its body), from the end of the head
MAX_HEAD_BYTES = 16 * 1024  # request line and headers
MAX_PENDING = 512  # connections waiting for their head at once; the oldest goes first beyond it
WORKERS = 8
QUEUE = 32  # complete heads waiting for a worker; 503 beyond
_DIGITS = re.compile(r"[0-9]{1,19}")
_HEAD_END = (b"\r\n\r\n", b"\n\n")
# A probe's answer: (HTTP code, content type, body). Sent with one non-blocking write on the
# selector thread, so the body must be small (a few KiB: it fits a fresh socket's send buffer).
ProbeAnswer = tuple[int, str, bytes]
Probe = Callable[[], ProbeAnswer]
MAX_PROBE_BODY = 8 * 1024


class BodyError(Exception):
    """A request body refused before reading it: the HTTP code and why."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def read_body(handler: BaseHTTPRequestHandler, cap: int) -> bytes:
    """The request's body, at most `cap` bytes, never a read to EOF. BodyError before reading anything: 411 for
    Transfer-Encoding, 400 for a Content-Length not one plain non-negative integer, 413 over the cap; 408 for a
    body not in by the request's deadline."""
    if handler.headers.get("Transfer-Encoding") is not None:
        raise BodyError(411, "send the body with a Content-Length, not Transfer-Encoding")
    values = handler.headers.get_all("Content-Length") or []
    if not values:
        return b""
    if len(set(v.strip() for v in values)) != 1 or not _DIGITS.fullmatch(values[0].strip()):
        raise BodyError(400, f"Content-Length must be one non-negative integer, not {', '.join(values)[:60]!r}")
    length = int(values[0])
    if length > cap:
        raise BodyError(413, f"a body of {length} bytes is over this endpoint's {cap}")
    try:
        body = handler.rfile.read(length)
    except TimeoutError:
        raise BodyError(408, f"the body's {length} bytes did not come in time") from None
    if len(body) != length:
        raise BodyError(400, f"the body ended after {len(body)} of its {length} bytes")
    return body


class QuietHandler(BaseHTTPRequestHandler):
    """A handler that logs no request (the operator's log is for what went wrong) and answers in one call."""

    def answer(self, code: int, kind: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        return


class _Reader(io.RawIOBase):
    """The socket as the handler reads it: first the head the selector already read, then the
    socket, every read bounded by the time the request has left."""

    def __init__(self, sock: socket.socket, head: bytes, deadline: float) -> None:
        self._sock, self._head, self._deadline = sock, memoryview(head), deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's read deadline passed")
        self._sock.settimeout(min(left, IO_TIMEOUT_S))
        return self._sock.recv_into(buffer)


class _Connection:
    """A connection waiting for its head until deadline; once it is whole, as the handler class
    receives it, queued for a worker since queued_at (stalled(): how long it has waited)."""

    __slots__ = ("address", "deadline", "head", "queued_at", "sock")

    def __init__(self, sock: socket.socket, address: Any, deadline: float) -> None:
        self.sock, self.address, self.head, self.deadline, self.queued_at = sock, address, bytearray(), deadline, 0.0


class BoundedHTTPServer(HTTPServer):
    """An HTTPServer (serve_forever, shutdown, server_close; any BaseHTTPRequestHandler) bounded as the module says."""

    request_queue_size = 128  # the listen backlog: a burst of connects must not wait on SYN retries

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *, workers: int = WORKERS,
                 max_pending: int = MAX_PENDING, queue_size: int = QUEUE, head_timeout: float = HEAD_TIMEOUT_S,
                 request_timeout: float = REQUEST_TIMEOUT_S, name: str = "http", probes: Mapping[str, Probe] | None = None) -> None:
        self.workers, self.max_pending, self.head_timeout = workers, max_pending, head_timeout
        self.probes = dict(probes or {})  # path -> answered on the selector thread (the module's docstring)
        self.request_timeout, self.name = request_timeout, name
        self._work: queue.Queue[_Connection | None] = queue.Queue(queue_size)
        self._pending: collections.OrderedDict[int, _Connection] = collections.OrderedDict()  # by fd, oldest first
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._wake_r, self._wake_w = socket.socketpair()
        self._threads: list[threading.Thread] = []
        self.refused = 0  # 503s: every worker busy and the queue full
        self._warned = -1e9
        super().__init__(address, _bounded(handler))

    # ------------------------------------------------------------------ the loop (serve_forever's thread)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stop.clear()
        self._stopped.clear()
        self._threads = [threading.Thread(target=self._worker, name=f"{self.name}-worker-{i}", daemon=True)
                         for i in range(self.workers)]
        for thread in self._threads:
            thread.start()
        self.socket.setblocking(False)
        sel = selectors.DefaultSelector()
        sel.register(self.socket, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                oldest = next(iter(self._pending.values()), None)
                wait = poll_interval if oldest is None else max(0.0, min(poll_interval, oldest.deadline - time.monotonic()))
                for key, _ in sel.select(wait):
                    if key.fileobj is self.socket:
                        self._accept(sel)
                    elif key.fileobj is self._wake_r:
                        self._wake_r.recv(64)
                    else:
                        try:
                            self._read_head(sel, key.data)
                        except Exception as exc:  # one peer's head must never end the loop every other one needs
                            log.warning("%s: dropped a connection whose head could not be read: %s: %s", self.name,
                                        type(exc).__name__, exc)
                            self._drop(sel, key.data)
                self._expire(sel)
        finally:
            for pending in list(self._pending.values()):
                self._drop(sel, pending)
            sel.close()
            while True:  # heads no worker took yet: closed, then one stop for each worker
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    _close(item.sock)
            for _ in self._threads:
                self._work.put(None)
            for thread in self._threads:
                thread.join(5.0)
            self._stopped.set()

    def shutdown(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        self._wake_r.close()
        self._wake_w.close()

    def start(self) -> BoundedHTTPServer:
        """serve_forever on a daemon thread of the server's name; the server, to stop with shutdown."""
        threading.Thread(target=self.serve_forever, name=self.name, daemon=True).start()
        return self

    def stalled(self, after_s: float) -> str | None:
        """Why the pool makes no progress (a worker ended, or a request waited over after_s for one), else None;
        only busy (503s) is not stalled. Non-blocking: a probe may call it."""
        ended = sum(not t.is_alive() for t in self._threads)
        if ended and not self._stop.is_set():
            return f"{ended} of the {self.workers} worker threads ended"
        with self._work.mutex:
            oldest = self._work.queue[0] if self._work.queue else None
        if isinstance(oldest, _Connection) and (waited := time.monotonic() - oldest.queued_at) > after_s:
            return (f"a request has waited {waited:.0f} s for one of the {self.workers} workers (the limit is "
                    f"{after_s:.0f} s): every worker is stuck in one request")
        return None

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(64):  # a burst per wake-up, without starving the reads
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: the oldest waiting connection makes room (else the
                    # listening socket stays readable and the loop spins).
                    if self._pending:
                        self._drop(sel, next(iter(self._pending.values())))
                    else:
                        time.sleep(0.05)
                return
            if len(self._pending) >= self.max_pending:
                self._drop(sel, next(iter(self._pending.values())))
            sock.setblocking(False)
            pending = _Connection(sock, address, time.monotonic() + self.head_timeout)
            self._pending[sock.fileno()] = pending
            sel.register(sock, selectors.EVENT_READ, pending)

    def _read_head(self, sel: selectors.BaseSelector, pending: _Connection) -> None:
        if pending.sock.fileno() < 0:  # dropped earlier in this same round of events
            return
        try:
            data = pending.sock.recv(min(4096, MAX_HEAD_BYTES + 1 - len(pending.head)))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sel, pending)
            return
        pending.head += data
        if any(end in pending.head for end in _HEAD_END):
            self._forget(sel, pending)
            if (probe := self._probe_of(pending.head)) is not None:
                self._answer_probe(pending, probe)
                return
            try:
                pending.queued_at = time.monotonic()
                self._work.put_nowait(pending)
            except queue.Full:
                self.refused += 1
                if time.monotonic() - self._warned > 60:  # a flood must not flood the log too
                    self._warned = time.monotonic()
                    log.warning("%s: all %d workers busy and %d requests queued: 503 to %s (%d refused so far)",
                                self.name, self.workers, self._work.maxsize, pending.address[0], self.refused)
                _reply(pending.sock, 503, "Service Unavailable")
        elif len(pending.head) > MAX_HEAD_BYTES:
            self._forget(sel, pending)
            _reply(pending.sock, 431, "Request Header Fields Too Large")

    def _probe_of(self, head: bytes | bytearray) -> Probe | None:
        """The probe a complete head asks for (`GET <a probe's path> HTTP/1.x`), or None."""
        parts = bytes(head[:head.find(b"\n")]).split()
        if not self.probes or len(parts) != 3 or parts[0] != b"GET" or not parts[2].startswith(b"HTTP/1."):
            return None
        try:
            return self.probes.get(urlsplit(parts[1].decode("latin-1")).path)
        except ValueError:  # e.g. `//[x`, an unclosed IPv6 literal: no probe, and never the end of this loop
            return None

    def _answer_probe(self, pending: _Connection, probe: Probe) -> None:
        """The probe's answer, on this thread: a probe that raises is a failed probe (500, why)."""
        try:
            code, kind, body = probe()
        except Exception as exc:
            code, kind, body = 500, "text/plain", f"the probe raised {type(exc).__name__}: {exc}".encode()
        reason = next((status.phrase for status in HTTPStatus if status == code), "Unknown")
        _reply(pending.sock, code, reason, kind, body[:MAX_PROBE_BODY])

    def _expire(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        while self._pending and (oldest := next(iter(self._pending.values()))).deadline <= now:
            self._forget(sel, oldest)
            _reply(oldest.sock, 408, "Request Timeout")

    def _forget(self, sel: selectors.BaseSelector, pending: _Connection) -> None:
        self._pending.pop(pending.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(pending.sock)

    def _drop(self, sel: selectors.BaseSelector, pending: _Connection) -> None:
        self._forget(sel, pending)
        _close(pending.sock)

    # ------------------------------------------------------------------ the workers

    def _worker(self) -> None:
        while (item := self._work.get()) is not None:
            try:
                item.sock.setblocking(True)
                item.sock.settimeout(IO_TIMEOUT_S)
                self.RequestHandlerClass(item, item.address, self)  # type: ignore[arg-type]
            except Exception as exc:  # one broken request must not end a worker
                log.debug("%s: a request failed: %s: %s", self.name, type(exc).__name__, exc)
            finally:
                with contextlib.suppress(OSError):
                    item.sock.shutdown(socket.SHUT_WR)
                _close(item.sock)


def _bounded(handler: type[BaseHTTPRequestHandler]) -> type[BaseHTTPRequestHandler]:
    """The handler class reading the head the loop already read, then the socket with deadlines."""

    class Bounded(handler):  # type: ignore[valid-type, misc]
        def setup(self) -> None:
            accepted: _Connection = self.request
            server: BoundedHTTPServer = self.server  # type: ignore[assignment]
            self.request = self.connection = accepted.sock
            deadline = time.monotonic() + server.request_timeout
            self.rfile = io.BufferedReader(_Reader(accepted.sock, accepted.head, deadline))
            # Whole writes (sendall), each bounded by the socket's timeout: what StreamRequestHandler.setup writes with.
            self.wfile = socketserver._SocketWriter(accepted.sock)

    Bounded.__name__ = Bounded.__qualname__ = handler.__name__
    return Bounded


def _reply(sock: socket.socket, code: int, reason: str, kind: str = "", body: bytes = b"") -> None:
    """A short answer, best effort (non-blocking: one write, never a wait), then closed. What the peer sent is
    read first (at most 64 KiB), or the close resets the connection and the peer may never see the answer."""
    content_type = f"Content-Type: {kind}\r\n" if kind else ""
    head = f"HTTP/1.0 {code} {reason}\r\n{content_type}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    with contextlib.suppress(OSError):
        sock.send(head.encode() + body)
        for _ in range(16):
            if not sock.recv(4096):
                break
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
    _close(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
