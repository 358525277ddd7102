"""The operator's liveness endpoint: kopf's own on the pod's loopback, behind a bounded server on the
address `--liveness` names. kopf's aiohttp (3.14) holds an idle or never-ending connection 3630 s, some
6 KB each (+58 MiB for 10000): kvpersist.httpserver bounds connections, time and threads instead.
The probe is answered from a reading thread's last answer, so whoever fills the front's workers cannot
fail it. A standby replica is ready too: it takes over within the peering lifetime.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from kvpersist import httpclient
from kvpersist.httpserver import MAX_PROBE_BODY, BoundedHTTPServer, Probe, ProbeAnswer, QuietHandler

# Under the chart's probe timeoutSeconds (5): a kopf that does not answer in time is a failed probe.
UPSTREAM_TIMEOUT_S = 4.0
MAX_BODY = 2**20
# kopf reruns its probe handlers at most every 10 s; well under the chart's probe period (20 s).
POLL_S = 5.0
READY_PATH = "/readyz"  # the chart's readinessProbe


def split_endpoint(endpoint: str) -> tuple[str, int, str]:
    """`--liveness` as (host, port, path); a ValueError that names the flag otherwise."""
    parts = urlsplit(endpoint)
    if parts.scheme != "http" or not parts.port or parts.query or parts.fragment:
        raise ValueError(f"--liveness {endpoint}: must be http://HOST:PORT/PATH")
    return parts.hostname or "0.0.0.0", parts.port, parts.path or "/"


def kopf_endpoint(path: str) -> tuple[str, int]:
    """A URL for kopf's own endpoint on a free port of the loopback, and that port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}{path}", port


def _json(code: int, body: dict) -> ProbeAnswer:
    return code, "application/json", json.dumps(body).encode()


class KopfLiveness:
    """kopf's liveness as last read, by a thread of its own: the probe's answer without a wait."""

    def __init__(self, upstream_port: int, path: str, poll_s: float | None = None, stale_s: float | None = None) -> None:
        self.upstream_port, self.path = upstream_port, path
        self.poll_s = POLL_S if poll_s is None else poll_s
        # A reading thread that stopped (or a read stuck past its own deadline) is a failed probe.
        self.stale_s = 3 * self.poll_s + UPSTREAM_TIMEOUT_S if stale_s is None else stale_s
        self._last: tuple[float, ProbeAnswer] | None = None  # (monotonic time, answer); replaced whole

    def read_once(self) -> ProbeAnswer:
        """One bounded GET of kopf's endpoint, kept as the answer: its code and body, or 503 and why."""
        try:
            reply = httpclient.get("127.0.0.1", self.upstream_port, self.path, timeout=UPSTREAM_TIMEOUT_S,
                                   max_bytes=MAX_BODY)
            kind = "application/json" if reply.ok else "text/plain"
            body = reply.body if len(reply.body) <= MAX_PROBE_BODY else json.dumps(
                {"note": f"kopf answered {len(reply.body)} bytes, not shown"}).encode()
            answer: ProbeAnswer = (reply.status, kind, body)
        except httpclient.PeerError as exc:
            answer = _json(503, {"error": f"kopf's liveness endpoint: {exc}"})
        self._last = (time.monotonic(), answer)
        return answer

    def answer(self) -> ProbeAnswer:
        """The last reading, or 503 naming why there is none that is fresh. Never blocks."""
        last = self._last
        if last is None:
            return _json(503, {"error": "kopf's liveness endpoint not read yet"})
        age = time.monotonic() - last[0]
        if age > self.stale_s:
            return _json(503, {"error": f"kopf's liveness endpoint last read {age:.0f} s ago (over {self.stale_s:.0f} s): "
                               "the thread reading it is stuck or gone"})
        return last[1]

    def run(self) -> None:
        while True:
            try:
                self.read_once()
            except Exception as exc:  # the reader must outlive any one read; its answer says what failed
                self._last = (time.monotonic(), _json(503, {"error": f"reading kopf's liveness endpoint: {exc}"}))
            time.sleep(self.poll_s)


def unlisted_caches() -> list[str]:
    """The kinds of the operator's watch caches that have not listed yet (none made: none)."""
    from kvpersist.controller import runtime

    c = runtime.CONTROLLER
    return [cache.kind for cache in (c.secret_cache, c.claim_cache, c.configmap_cache, *c.name_caches.values())
            if cache is not None and not cache.listed_once]


def readiness(liveness: KopfLiveness, unlisted: Callable[[], list[str]] = unlisted_caches) -> Probe:
    """Readiness: 200 once kopf's liveness answers 200 and no cache is unlisted, else 503 and why. Never blocks."""
    def answer() -> ProbeAnswer:
        code, _, body = liveness.answer()
        if code != 200:
            return _json(503, {"ready": False, "why": f"kopf's liveness answered {code}",
                               "liveness": body.decode("utf-8", "replace")[:MAX_PROBE_BODY // 2]})
        waiting = unlisted()
        if waiting:
            return _json(503, {"ready": False, "why": "watch caches not listed yet: " + ", ".join(waiting)})
        return _json(200, {"ready": True})
    return answer


def serve(host: str, port: int, path: str, upstream_port: int, liveness: KopfLiveness | None = None) -> BoundedHTTPServer:
    """The front on a daemon thread: `path` and READY_PATH answered on the selector thread (never queued),
    anything else 404 from a one-worker pool. `liveness`: a test's reader, else one started here."""
    if liveness is None:
        liveness = KopfLiveness(upstream_port, path)
        threading.Thread(target=liveness.run, name="liveness-reader", daemon=True).start()

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            self.answer(*_json(404, {"error": f"not found: the liveness endpoint is {path}, readiness {READY_PATH}"}))

    return BoundedHTTPServer((host, port), Handler, workers=1, queue_size=4, name="liveness",
                             probes={READY_PATH: readiness(liveness), path: liveness.answer}).start()
