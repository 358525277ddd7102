"""The inventory agent: a sidecar beside each lmcache server that can see its L2 volume.

The operator cannot mount a claim, and lmcache reports only the namespace it serves (and only
what its lazy index has seen since a restart). The agent reads the volume itself: GET /inventory
gives bytes, objects and last write per namespace folder; POST /gc deletes one named folder when
the operator asks. It refuses the namespace its own server serves, whatever the caller says; the
operator refuses every other namespace still in use before asking. Reached only by the operator
(the lmcache NetworkPolicy admits nothing else to this port).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from kvpersist.inventory import NAMESPACE_ID_RE, Inventory, namespace_usage, remove_namespace, scan_volume

log = logging.getLogger("kvpersist.agent")
DEFAULT_PORT = 8090
SCAN_TTL_S = 30.0  # a walk of a big volume is not free: answer from a recent scan


class Agent:
    """Scans (cached for SCAN_TTL_S) and deletes; one deletion at a time."""

    def __init__(self, root: Path, serving: str | None, scan_ttl_s: float = SCAN_TTL_S) -> None:
        self.root = root
        self.serving = serving
        self.scan_ttl_s = scan_ttl_s
        self._lock = threading.Lock()
        self._scan: tuple[float, Inventory] | None = None

    def inventory(self, fresh: bool = False) -> Inventory:
        with self._lock:
            now = time.monotonic()
            if fresh or self._scan is None or now - self._scan[0] > self.scan_ttl_s:
                self._scan = (now, scan_volume(self.root))
            return self._scan[1]

    def gc(self, namespace_id: str, dry_run: bool) -> tuple[int, dict[str, Any]]:
        """(HTTP code, body). Never touches anything but <root>/<namespace_id>."""
        if not NAMESPACE_ID_RE.fullmatch(namespace_id or ""):
            return 400, {"error": f"{namespace_id!r} is not a namespace id (kvp-<32 hex>)"}
        if namespace_id == self.serving:
            return 409, {"error": f"{namespace_id} is the namespace this lmcache server serves: refused"}
        held = namespace_usage(self.root, namespace_id)  # that folder only, not the whole volume
        if held is None:
            return 404, {"error": f"{namespace_id} has no data on this volume"}
        if dry_run:
            return 200, {**held.to_json(), "dryRun": True, "deleted": False}
        with self._lock:
            removed = remove_namespace(self.root, namespace_id)
            self._scan = None
        log.warning("deleted namespace %s: %d bytes in %d objects", namespace_id, removed.bytes, removed.objects)
        return 200, {**removed.to_json(), "dryRun": False, "deleted": True}


def make_server(agent: Agent, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug(fmt, *args)

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/healthz":
                self._send(200, {"status": "ok"})
            elif url.path == "/inventory":
                fresh = parse_qs(url.query).get("fresh", ["0"])[0] in ("1", "true")
                self._send(200, {**agent.inventory(fresh).to_json(), "serving": agent.serving})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            if urlparse(self.path).path != "/gc":
                self._send(404, {"error": "not found"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(min(length, 4096)) or b"{}")
                code, out = agent.gc(str(body.get("namespaceId", "")), bool(body.get("dryRun", True)))
            except (ValueError, OSError) as exc:
                code, out = 500, {"error": str(exc)}
            self._send(code, out)

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpersist agent", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="the L2 mount (namespace folders under it)")
    parser.add_argument("--serving", help="the namespace id this pod's lmcache server serves (never deleted)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    server = make_server(Agent(args.root, args.serving), args.host, args.port)
    log.info("serving the inventory of %s on %s:%d", args.root, args.host, args.port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
