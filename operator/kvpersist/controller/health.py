"""The operator's liveness endpoint: kopf's own (its probe handlers, and an event loop that still
answers) on the pod's loopback, behind a bounded server on the address `--liveness` names.

kopf serves /healthz with aiohttp, which holds an idle connection, or one whose request head never
ends, for aiohttp's keep-alive timeout (3630 s in aiohttp 3.14), some 6 KB of the operator's memory
each (measured: +58 MiB for 10000), and the port is open to every namespace by default. In front
of it kvpersist.httpserver bounds connections, time and threads as for the agent and the metrics;
each probe is one bounded GET to kopf's endpoint on 127.0.0.1, whose answer (code and body)
passes through, so the probe means what kopf's means.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from kvpersist import httpclient
from kvpersist.httpserver import BoundedHTTPServer

# Under the chart's probe timeoutSeconds (5): a kopf that does not answer in time is a failed probe.
UPSTREAM_TIMEOUT_S = 4.0
MAX_BODY = 2**20


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


def serve(host: str, port: int, path: str, upstream_port: int) -> BoundedHTTPServer:
    """The front on a daemon thread: GET `path` is kopf's answer, anything else 404."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if urlsplit(self.path).path != path:
                self._send(404, {"error": "not found"})
                return
            try:
                reply = httpclient.get("127.0.0.1", upstream_port, path, timeout=UPSTREAM_TIMEOUT_S, max_bytes=MAX_BODY)
            except httpclient.PeerError as exc:
                self._send(503, {"error": f"kopf's liveness endpoint: {exc}"})
                return
            self._send(reply.status, reply.body, "application/json" if reply.ok else "text/plain")

        def _send(self, code: int, body: dict | bytes, kind: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_: object) -> None:
            return

    server = BoundedHTTPServer((host, port), Handler, workers=2, queue_size=8, name="liveness")
    threading.Thread(target=server.serve_forever, name="liveness", daemon=True).start()
    return server
