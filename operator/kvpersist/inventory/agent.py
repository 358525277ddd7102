"""The inventory agent: a sidecar beside each lmcache server, the one door into its pod.

lmcache's HTTP admin API (/env with the whole environment, /cache/clear, DELETE /cache/objects,
/quota, /reconfigure) listens on the pod's loopback only, so nothing outside the pod reaches it
whatever the CNI does. The agent forwards the operator the two reads it needs: GET /server/status
(with the resource's agent token) and GET /server/metrics (counters only, open so Prometheus can
scrape it), each bounded in time and size; nothing else of lmcache's API is reachable through it.

The operator cannot mount a claim, and lmcache reports only the namespace it serves (and only
what its lazy index has seen since a restart). The agent reads the volume itself: GET /inventory
gives bytes, objects and last write per namespace folder; POST /gc deletes one named folder when
the operator asks. It refuses the namespace its own server serves, whatever the caller says; the
operator refuses every other namespace still in use before asking. Reached only by the operator
(the lmcache NetworkPolicy admits nothing else to this port), and both /inventory and /gc need
the resource's agent token (a bearer token from an owned Secret, mounted as a file): where the
policy is not enforced, nobody else can delete or list. Whoever reaches the port still costs
the agent no thread per connection and no unbounded read (kvpersist.httpserver: idle connections
wait on one selector and are closed after 10 s, a /gc body's Content-Length is checked first).

With --capacity-bytes it also keeps the served namespace's folder within that capacity: lmcache
0.5.6's nixl_store_dynamic index starts empty after a restart and counts from zero, so files from
before the restart are neither counted nor evicted by it and the folder grows past its capacity
(measured: 14 MiB in an 8 MiB namespace after one restart). Every --trim-period seconds the agent
deletes that folder's oldest chunk files until they hold at most the capacity, counting only what it
may delete (nixl's committed `*.bin` files), and first the temp files of writes that died
(`*.bin.tmp.<hex>` untouched for an hour: kvpersist.inventory.volume.ABANDONED_TEMP_S).
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from kvpersist import httpclient
from kvpersist.httpclient import PeerError
from kvpersist.httpserver import BodyError, BoundedHTTPServer, read_body
from kvpersist.inventory.volume import (
    ABANDONED_TEMP_S,
    NAMESPACE_ID_RE,
    Inventory,
    NamespaceUsage,
    iso,
    namespace_usage,
    remove_namespace,
    scan_volume,
    sweep_abandoned,
    trim_namespace,
)

log = logging.getLogger("kvpersist.agent")
DEFAULT_PORT = 8090
SCAN_TTL_S = 30.0  # a walk of a big volume is not free: answer from a recent scan
# Between two trims the folder can exceed its capacity by what lmcache writes in one period; a
# trim walks only the served folder, so a short period is cheap.
TRIM_PERIOD_S = 30.0
MAX_TRIM_PERIOD_S = 3600.0
# lmcache's admin API, forwarded: what may pass, each read bounded (the server runs a tenant's
# image; a stalled or flooding one must not hold the agent's threads or memory). Under the
# operator's own 2-second deadline for both reads together.
PROXIED = {"/server/status": ("/status", 4 * 2**20, True), "/server/metrics": ("/metrics", 4 * 2**20, False)}
PROXY_TIMEOUT_S = 1.5
NO_VOLUME = {"error": "this agent has no L2 volume (the cache's L2 is a bucket)"}
MAX_GC_BODY = 4096  # {"namespaceId": ..., "dryRun": ...}


class TokenFile:
    """The token from a mounted Secret, read again when the file changes: the kubelet updates a
    Secret volume in place, and a re-created Secret must not lock the operator out until a restart."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._value = ""

    @property
    def value(self) -> str:
        try:
            st = self.path.stat()
            if (st.st_mtime_ns, st.st_ino) != self._stamp:
                self._value, self._stamp = self.path.read_text().strip(), (st.st_mtime_ns, st.st_ino)
        except OSError:
            pass  # keep the last one read
        return self._value


class Agent:
    """Scans (cached for SCAN_TTL_S), deletes and trims; one deletion or trim at a time.

    The trim target is the capacity itself, not capacity x (1 - evictionRatio): a deleted file may
    be one lmcache has re-indexed since its restart, and deleting it from under the server turns
    that key's lookups into misses until lmcache drops the key (measured: no wrong bytes, but the
    key is not written again meanwhile), so the agent deletes as little as it can. It walks the
    folder every period anyway, so headroom below the capacity would not save walks. lmcache's own
    accounting keeps what it has indexed within the capacity, so without a restart the agent finds
    nothing to trim (tests/integration/test_capacity.py)."""

    def __init__(self, root: Path | None, serving: str | None, scan_ttl_s: float = SCAN_TTL_S,
                 capacity_bytes: int | None = None, trim_period_s: float = TRIM_PERIOD_S,
                 token: str | TokenFile | None = None, server: tuple[str, int] | None = None) -> None:
        self.root = root  # None: no volume here (a bucket's L2), only the forwarded reads
        self.server = server  # (host, port) of lmcache's admin API inside the pod
        self.token = token
        self.serving = serving
        self.scan_ttl_s = scan_ttl_s
        self.capacity_bytes = capacity_bytes
        self.trim_period_s = trim_period_s
        self.trim_passes = 0  # completed passes, whether they deleted anything or not (tests wait on it)
        self.last_trim: dict[str, Any] | None = None  # the last pass that deleted something
        self.swept_temp_files = 0  # abandoned temp files deleted so far
        self._lock = threading.Lock()
        self._scan: tuple[float, Inventory] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def inventory(self, fresh: bool = False) -> Inventory:
        assert self.root is not None
        with self._lock:
            now = time.monotonic()
            if fresh or self._scan is None or now - self._scan[0] > self.scan_ttl_s:
                self._scan = (now, scan_volume(self.root))
            return self._scan[1]

    def gc(self, namespace_id: str, dry_run: bool) -> tuple[int, dict[str, Any]]:
        """(HTTP code, body). Never touches anything but <root>/<namespace_id>."""
        if not NAMESPACE_ID_RE.fullmatch(namespace_id or ""):
            return 400, {"error": f"{namespace_id!r} is not a namespace id (kvp-<32 hex>)"}
        if self.root is None:
            return 404, NO_VOLUME
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

    def forward(self, path: str) -> tuple[int, str, bytes]:
        """(HTTP code, content type, body) of one allowed read of lmcache's admin API. A server
        that is down, slow or oversized answers 502/504 with why, never a hung request."""
        upstream, cap, _ = PROXIED[path]
        if self.server is None:
            return 404, "application/json", json.dumps({"error": "this agent was started without --server-url"}).encode()
        host, port = self.server
        try:
            reply = httpclient.get(host, port, upstream, timeout=PROXY_TIMEOUT_S, max_bytes=cap)
        except PeerError as exc:
            code = 504 if "deadline" in str(exc) or "timed out" in str(exc) else 502
            return code, "application/json", json.dumps({"error": f"lmcache {upstream}: {exc}"}).encode()
        kind = "application/json" if upstream == "/status" else "text/plain; version=0.0.4"
        return reply.status, kind, reply.body

    def authorized(self, header: str | None, deleting: bool) -> tuple[bool, str]:
        """Whether a request may go on, and why not. With a token (the operator renders one from
        the resource's own Secret) every /inventory, /server/status and /gc must carry it; without
        one, /gc and /server/status are off."""
        expected = self.token.value if isinstance(self.token, TokenFile) else self.token
        if not expected:
            return (not deleting, "this agent was started without --token-file: /gc and /server/status are off")
        given = (header or "").removeprefix("Bearer ").strip()
        ok = hmac.compare_digest(given.encode(), expected.encode())
        return ok, "" if ok else "missing or wrong bearer token"

    @property
    def trimming(self) -> bool:
        return bool(self.root and self.serving and self.capacity_bytes)

    def trim_once(self) -> NamespaceUsage | None:
        """One pass over the served folder; None when trimming is off."""
        if not self.trimming:
            return None
        assert self.root and self.serving and self.capacity_bytes
        with self._lock:
            # Temp files of writes that died (a killed server) are never renamed: gone first. The
            # trim counts only the chunk files it may delete (kvpersist.inventory.volume).
            swept = sweep_abandoned(self.root, self.serving)
            trimmed = trim_namespace(self.root, self.serving, self.capacity_bytes)
            if swept.objects:
                self._scan = None
                self.swept_temp_files += swept.objects
            if trimmed.objects:
                self._scan = None
                self.last_trim = {"bytes": trimmed.bytes, "objects": trimmed.objects, "at": iso(time.time()),
                                  "newestTrimmed": iso(trimmed.last_write), "capacityBytes": self.capacity_bytes}
            self.trim_passes += 1
        if swept.objects:
            log.warning("deleted %d abandoned temp files (%d bytes) of %s: no write touched them for %.0f s",
                        swept.objects, swept.bytes, self.serving, ABANDONED_TEMP_S)
        if trimmed.objects:
            log.warning("trimmed %s to its capacity of %d bytes: deleted %d bytes in %d oldest chunk files (newest written %s)",
                        self.serving, self.capacity_bytes, trimmed.bytes, trimmed.objects, iso(trimmed.last_write))
        return trimmed

    def _trim_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.trim_once()
            except Exception:  # the thread must outlive any one pass: a dead trimmer is no bound
                log.exception("trim of %s failed; trying again in %.0f s", self.serving, self.trim_period_s)
            self._stop.wait(self.trim_period_s)

    def start_trimming(self) -> None:
        """A daemon thread that trims now and then every trim_period_s; nothing when trimming is off."""
        if self.trimming and self._thread is None:
            self._thread = threading.Thread(target=self._trim_loop, name="kvpersist-trim", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


def make_server(agent: Agent, host: str, port: int, **bounds: Any) -> BoundedHTTPServer:
    """The agent's HTTP server: bounded in connections, threads, time and body size
    (kvpersist.httpserver; `bounds` override its limits, for tests)."""

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
            elif url.path in PROXIED:
                ok, why = agent.authorized(self.headers.get("Authorization"), deleting=True) if PROXIED[url.path][2] else (True, "")
                if not ok:
                    self._send(403 if "without --token-file" in why else 401, {"error": why})
                    return
                code, kind, data = agent.forward(url.path)
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif url.path == "/inventory" and agent.root is None:
                self._send(404, NO_VOLUME)
            elif url.path == "/inventory":
                ok, why = agent.authorized(self.headers.get("Authorization"), deleting=False)
                if not ok:
                    self._send(401, {"error": why})
                    return
                fresh = parse_qs(url.query).get("fresh", ["0"])[0] in ("1", "true")
                self._send(200, {**agent.inventory(fresh).to_json(), "serving": agent.serving, "trimmed": agent.last_trim,
                                 "trimPasses": agent.trim_passes})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            if urlparse(self.path).path != "/gc":
                self._send(404, {"error": "not found"})
                return
            ok, why = agent.authorized(self.headers.get("Authorization"), deleting=True)
            if not ok:
                log.warning("refused /gc from %s: %s", self.client_address[0], why)
                self._send(403 if "without --token-file" in why else 401, {"error": why})
                return
            try:
                body = json.loads(read_body(self, MAX_GC_BODY) or b"{}")
                if not isinstance(body, dict):
                    raise BodyError(400, "the body must be a JSON object")
                code, out = agent.gc(str(body.get("namespaceId", "")), bool(body.get("dryRun", True)))
            except BodyError as exc:
                code, out = exc.code, {"error": str(exc)}
            except (ValueError, OSError) as exc:
                code, out = 500, {"error": str(exc)}
            self._send(code, out)

    return BoundedHTTPServer((host, port), Handler, name="agent", **bounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpersist agent", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, help="the L2 mount (namespace folders under it); none with a bucket's L2")
    parser.add_argument("--server-url", help="lmcache's admin API inside the pod, e.g. http://127.0.0.1:8080 "
                        "(forwarded: GET /server/status and /server/metrics)")
    parser.add_argument("--serving", help="the namespace id this pod's lmcache server serves (never deleted)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--token-file", type=Path,
                        help="a file holding the bearer token /inventory and /gc require (the resource's agent-token "
                        "Secret); without it /gc is off")
    parser.add_argument("--capacity-bytes", type=_positive_int,
                        help="keep the --serving namespace's folder at most this big (oldest chunk files deleted first)")
    parser.add_argument("--trim-period", type=_period, default=TRIM_PERIOD_S, metavar="SECONDS",
                        help=f"seconds between two trims (default {TRIM_PERIOD_S:.0f}, at most {MAX_TRIM_PERIOD_S:.0f})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    token = TokenFile(args.token_file) if args.token_file else None
    if token is not None and not token.value:
        parser.error(f"--token-file {args.token_file} is empty")
    agent = Agent(args.root, args.serving, capacity_bytes=args.capacity_bytes, trim_period_s=args.trim_period, token=token,
                  server=_server(parser, args.server_url))
    if args.capacity_bytes and not args.serving:
        log.warning("--capacity-bytes without --serving: nothing to trim")
    server = make_server(agent, args.host, args.port)
    log.info("serving the inventory of %s and lmcache's %s on %s:%d", args.root or "no volume", args.server_url,
             args.host, args.port)
    if agent.trimming:
        log.info("trimming %s to %d bytes every %.1f s", args.serving, args.capacity_bytes, args.trim_period)
    agent.start_trimming()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        agent.stop()
        server.server_close()
    return 0


def _server(parser: argparse.ArgumentParser, url: str | None) -> tuple[str, int] | None:
    if not url:
        return None
    parsed = urlparse(url)
    if parsed.scheme != "http" or not parsed.hostname or not parsed.port or parsed.path not in ("", "/"):
        parser.error(f"--server-url {url}: must be http://HOST:PORT")
    return parsed.hostname, parsed.port


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of bytes")
    return value


def _period(text: str) -> float:
    """A bounded period: a trim that never comes back is no bound on the folder."""
    value = float(text)
    if not 0 < value <= MAX_TRIM_PERIOD_S:
        raise argparse.ArgumentTypeError(f"{text}: must be more than 0 and at most {MAX_TRIM_PERIOD_S:.0f} seconds")
    return value
