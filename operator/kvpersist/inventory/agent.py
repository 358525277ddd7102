"""The inventory agent: a sidecar beside each lmcache server, the one door into its pod.

lmcache's admin API listens on the pod's loopback only: the agent forwards a few bounded reads of it
and spec.prewarm's prefetch. The operator cannot mount a claim, and lmcache reports only what its lazy
index has seen since a restart, so the agent reads the volume itself (/inventory, /gc, /expire) and,
with --capacity-bytes, trims the served folder: lmcache 0.5.6's fs_native and nixl_store_dynamic
count L2 from zero after a restart, so the folder outgrows its capacity (measured: 14 MiB in an 8 MiB
namespace after one restart).
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from kvpersist import httpclient
from kvpersist.httpclient import PeerError
from kvpersist.httpserver import BodyError, BoundedHTTPServer, ProbeAnswer, QuietHandler, read_body
from kvpersist.inventory import prefetch
from kvpersist.inventory.space import effective_capacity, judge_expiry, others_bytes
from kvpersist.inventory.volume import (
    ABANDONED_TEMP_S,
    DEFAULT_TRIMMED,
    MAX_SCAN_FILES,
    NAMESPACE_ID_RE,
    TRIMMED_ADAPTERS,
    Inventory,
    NamespaceUsage,
    iso,
    namespace_usage,
    remove_namespace,
    scan_volume,
    trim_namespace,
)

log = logging.getLogger("kvpersist.agent")
DEFAULT_PORT = 8090
SCAN_TTL_S = 30.0  # a walk of a big volume is not free: answer from a recent scan
TRIM_PERIOD_S = 30.0  # the folder's overshoot is what lmcache writes in one period; a trim walks only that folder
# An excess the trim waits out first: lmcache's own L2 eviction runs every second past its watermark and
# takes a few rounds to undo a burst (measured with fs_native: 128% of an 8 MiB capacity back under it in 5 s).
EXCESS_SETTLE_S = 15.0
MAX_TRIM_PERIOD_S = 3600.0
# agent path -> (lmcache's path, token required, content type). Each read is bounded (a tenant's stalled or
# flooding server must not hold the agent's threads or memory), under the operator's 2-second deadline.
PROXIED = {"/server/status": ("/status", True, "application/json"),
           "/server/metrics": ("/metrics", False, "text/plain; version=0.0.4")}
PROXY_TIMEOUT_S = 1.5
PROXY_MAX_BYTES = 4 * 2**20
NO_VOLUME = {"error": "this agent has no L2 volume (the cache's L2 is a bucket)"}
MAX_GC_BODY = 4096  # {"namespaceId": ..., "dryRun": ...}
MAX_EXPIRE_BODY = 256 * 1024  # {"maxAgeDays", "protected": [ids], "remove": [ids]}: thousands of ids
MAX_EXPIRE_IDS = 4096
OTHERS_TTL_S = 300.0  # the other folders change rarely: the trim re-reads them at most this often
# /healthz fails when a request has waited this long for a worker: all stuck (a hung volume), which a restart
# clears. Reads take seconds; a /gc or /expire of a huge folder holds the lock longer, and must be let finish.
STUCK_S = 300.0

POD_NAME_ENV = "KVPERSIST_POD_NAME"  # the downward API's metadata.name (kvpersist.builders.lmcache)


def trimmer_of(pod_name: str | None) -> bool:
    """Whether this StatefulSet pod (<set>-<n>) trims its shared folder: only ordinal 0, which exists while
    any server runs (two trimmers would delete up to twice the excess). No ordinal, no trim."""
    return (pod_name or "").endswith("-0")


class TokenFile:
    """A mounted Secret's token, re-read when the file changes: a re-created Secret must not lock the
    operator out until a restart."""

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
    """Scans (cached for SCAN_TTL_S), deletes and trims; one deletion or trim at a time. The trim target is
    the capacity, not capacity x (1 - evictionRatio): a deleted file lmcache has re-indexed turns that key
    into misses until lmcache drops it, so the agent deletes as little as it can."""

    def __init__(self, root: Path | None, serving: str | None, capacity_bytes: int | None = None,
                 trim_period_s: float = TRIM_PERIOD_S, token: str | TokenFile | None = None,
                 server: tuple[str, int] | None = None, trims: bool = True, trim_grace_s: float = 0.0,
                 adapter: str = DEFAULT_TRIMMED, settle_s: float = 0.0) -> None:
        self.root = root  # None: no volume here (a bucket's L2), only the forwarded reads
        self.adapter = adapter  # whose chunk and temp files the trim counts and deletes (volume.TRIMMED_ADAPTERS)
        self.settle_s = settle_s  # an excess is trimmed once it has lasted this long (EXCESS_SETTLE_S)
        self._over_since: float | None = None  # when the served folder was first seen over its capacity
        self.trims = trims  # False: a shared folder another pod's agent trims (trimmer_of)
        self.trim_grace_s = trim_grace_s  # no chunk file younger than this is trimmed
        self.server = server  # (host, port) of lmcache's admin API inside the pod
        self.prefetcher = prefetch.Prefetcher(server) if server is not None else None
        self.token = token
        self.serving = serving
        self.capacity_bytes = capacity_bytes
        self.trim_period_s = trim_period_s
        self.trim_passes = 0  # completed passes, whether they deleted anything or not (tests wait on it)
        self.last_trim: dict[str, Any] | None = None  # the last pass that deleted something
        self.effective_capacity: int | None = None  # the last trim's watermark (space.effective_capacity)
        self._lock = threading.Lock()
        self._scan: tuple[float, Inventory] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def inventory(self, fresh: bool = False, max_age_s: float = SCAN_TTL_S) -> Inventory:
        """The volume's scan (bounded: scan_volume's max_files), at most max_age_s old."""
        assert self.root is not None
        with self._lock:
            now = time.monotonic()
            if fresh or self._scan is None or now - self._scan[0] > max_age_s:
                self._scan = (now, scan_volume(self.root, self.serving))
            return self._scan[1]

    def expire(self, max_age_days: Any, protected: Any, remove: Any, dry_run: bool,
               now: float | None = None) -> tuple[int, dict[str, Any]]:
        """(HTTP code, body) of an age-limit pass (spec.l2.orphanRetention): removes the folders in remove
        whose newest file is older than max_age_days, never the served one nor any in protected (every id
        in use; without it, or without --serving, it refuses), each judged from its own walk right before."""
        if self.root is None:
            return 404, NO_VOLUME
        if not self.serving:
            return 409, {"error": "this agent was started without --serving: it cannot be sure which namespace its "
                         "server uses, so it removes nothing"}
        if not isinstance(max_age_days, int) or isinstance(max_age_days, bool) or max_age_days < 1:
            return 400, {"error": "maxAgeDays must be a whole number of days, at least 1"}
        ids = {}
        for name, value in (("protected", protected), ("remove", remove)):
            if not isinstance(value, list) or len(value) > MAX_EXPIRE_IDS or not all(
                    isinstance(i, str) and NAMESPACE_ID_RE.fullmatch(i) for i in value):
                return 400, {"error": f"{name} must be a list of namespace ids (kvp-<32 hex>), at most {MAX_EXPIRE_IDS}: "
                             "without the protected ids the agent cannot be sure what is in use, so it removes nothing"}
            ids[name] = frozenset(value)
        now = time.time() if now is None else now
        removed, kept = [], []
        for nsid in sorted(ids["remove"] - ids["protected"] - {self.serving}):
            held = namespace_usage(self.root, nsid, MAX_SCAN_FILES)  # that folder only, bounded
            if held is None:
                continue
            verdict = judge_expiry([held], self.serving, ids["protected"], max_age_days, now)[0]
            if not verdict.removable:
                kept.append({"namespaceId": nsid, "why": verdict.why})
                continue
            if not dry_run:
                with self._lock:
                    held = remove_namespace(self.root, nsid)
                    self._scan = None
                log.warning("removed namespace %s under the age limit of %d days: %d bytes in %d objects, newest "
                            "written %s", nsid, max_age_days, held.bytes, held.objects, iso(held.last_write))
            removed.append(held.to_json())
        refused = sorted(ids["remove"] & (ids["protected"] | {self.serving}))
        kept += [{"namespaceId": i, "why": "protected: in use" if i != self.serving else "served here"} for i in refused]
        return 200, {"dryRun": dry_run, "removed": removed, "kept": kept}

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
        if not dry_run:
            with self._lock:
                held = remove_namespace(self.root, namespace_id)
                self._scan = None
            log.warning("deleted namespace %s: %d bytes in %d objects", namespace_id, held.bytes, held.objects)
        return 200, {**held.to_json(), "dryRun": dry_run, "deleted": not dry_run}

    def forward(self, path: str) -> tuple[int, dict[str, Any] | bytes, str]:
        """(HTTP code, body, content type) of one allowed read of lmcache's admin API: a server down, slow or
        oversized answers 502/504 with why, never a hung request."""
        upstream, _, kind = PROXIED[path]
        if self.server is None:
            return 404, {"error": "this agent was started without --server-url"}, "application/json"
        host, port = self.server
        try:
            reply = httpclient.get(host, port, upstream, timeout=PROXY_TIMEOUT_S, max_bytes=PROXY_MAX_BYTES)
        except PeerError as exc:
            return prefetch.peer_code(exc), {"error": f"lmcache {upstream}: {exc}"}, "application/json"
        return reply.status, reply.body, kind

    def refusal(self, header: str | None, deleting: bool) -> tuple[int, str] | None:
        """(HTTP code, why) when a request may not go on, else None. With a token every route but
        /server/metrics must carry it (401); without one, all but /inventory are off (403)."""
        expected = self.token.value if isinstance(self.token, TokenFile) else self.token
        if not expected:
            why = "this agent was started without --token-file: /gc, /server/status and /server/prefetch are off"
            return (403, why) if deleting else None
        given = (header or "").removeprefix("Bearer ").strip()
        return None if hmac.compare_digest(given.encode(), expected.encode()) else (401, "missing or wrong bearer token")

    @property
    def trimming(self) -> bool:
        return bool(self.root and self.serving and self.capacity_bytes and self.trims)

    def trim_once(self) -> NamespaceUsage | None:
        """One pass over the served folder; None when trimming is off."""
        if not self.trimming:
            return None
        assert self.root and self.serving and self.capacity_bytes
        # What else is on the claim lowers the served folder's watermark (kvpersist.inventory.space).
        inv = self.inventory(max_age_s=OTHERS_TTL_S)
        capacity = effective_capacity(self.capacity_bytes, inv.capacity_bytes, others_bytes(inv, self.serving))
        with self._lock:
            # Temp files of writes that died are never renamed: gone first (kvpersist.inventory.volume).
            self.effective_capacity = capacity
            swept, trimmed = trim_namespace(self.root, self.serving, capacity, self.trim_grace_s, adapter=self.adapter,
                                            settled=lambda total: self._settled(total, capacity))
            if swept.objects or trimmed.objects:
                self._scan = None
            if trimmed.objects:
                self.last_trim = {"bytes": trimmed.bytes, "objects": trimmed.objects, "at": iso(time.time()),
                                  "newestTrimmed": iso(trimmed.last_write), "capacityBytes": capacity}
            self.trim_passes += 1
        if swept.objects:
            log.warning("deleted %d abandoned temp files (%d bytes) of %s: no write touched them for %.0f s",
                        swept.objects, swept.bytes, self.serving, ABANDONED_TEMP_S)
        if trimmed.objects:
            log.warning("trimmed %s to its capacity of %d bytes (%d configured, less what else the claim holds): deleted "
                        "%d bytes in %d oldest chunk files (newest written %s)", self.serving, capacity,
                        self.capacity_bytes, trimmed.bytes, trimmed.objects, iso(trimmed.last_write))
        return trimmed

    def _settled(self, total: int, capacity: int) -> bool:
        """Whether the chunk files (total bytes) have been over capacity for settle_s: a burst overshoots
        until lmcache's own eviction catches up, and trimming that too would delete twice what must go."""
        now = time.monotonic()
        if total <= capacity:
            self._over_since = None
            return self.settle_s <= 0
        self._over_since = self._over_since if self._over_since is not None else now
        return now - self._over_since >= self.settle_s

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

    def alive(self) -> str | None:
        """Why the agent is not alive (its trim thread ended), or None; never blocks (/healthz's selector thread)."""
        if self.trimming and self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            return f"the trim thread of {self.serving} ended: the folder is no longer held to its capacity"
        return None

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


def make_server(agent: Agent, host: str, port: int, **bounds: Any) -> BoundedHTTPServer:
    """The agent's HTTP server, bounded by kvpersist.httpserver (`bounds` override its limits, for tests)."""

    def healthz() -> ProbeAnswer:
        why = agent.alive() or server.stalled(STUCK_S)
        body = {"status": "ok"} if why is None else {"error": why}
        return 200 if why is None else 503, "application/json", json.dumps(body).encode()

    class Handler(QuietHandler):
        def _send(self, code: int, body: dict[str, Any] | bytes, kind: str = "application/json") -> None:
            self.answer(code, kind, body if isinstance(body, bytes) else json.dumps(body).encode())

        def _refused(self, deleting: bool = True, warn: bool = False) -> bool:
            """Whether the request lacks the token it needs (Agent.refusal); if so, it is answered here."""
            refused = agent.refusal(self.headers.get("Authorization"), deleting)
            if refused is not None:
                if warn:
                    log.warning("refused %s from %s: %s", urlparse(self.path).path, self.client_address[0], refused[1])
                self._send(refused[0], {"error": refused[1]})
            return refused is not None

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path in PROXIED:
                if not (PROXIED[url.path][1] and self._refused()):
                    self._send(*agent.forward(url.path))
            elif url.path == "/inventory" and agent.root is None:
                self._send(404, NO_VOLUME)
            elif url.path == "/inventory":
                if not self._refused(deleting=False):
                    fresh = parse_qs(url.query).get("fresh", ["0"])[0] in ("1", "true")
                    self._send(200, {**agent.inventory(fresh).to_json(), "serving": agent.serving, "trimmed": agent.last_trim,
                                     "trims": agent.trimming, "trimPasses": agent.trim_passes,
                                     "effectiveCapacityBytes": agent.effective_capacity})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            path = urlparse(self.path).path
            if path not in ("/gc", "/expire", prefetch.PATH):
                self._send(404, {"error": "not found"})
                return
            if self._refused(warn=path != prefetch.PATH):  # prefetch too: it makes lmcache read L2 and fill L1
                return
            try:
                if path == prefetch.PATH:  # lmcache's warm prefetch of one prompt (kvpersist.inventory.prefetch)
                    code, out = (agent.prefetcher.run(read_body(self, prefetch.MAX_BODY)) if agent.prefetcher is not None
                                 else (404, {"error": "this agent was started without --server-url"}))
                else:
                    body = json.loads(read_body(self, MAX_GC_BODY if path == "/gc" else MAX_EXPIRE_BODY) or b"{}")
                    if not isinstance(body, dict):
                        raise BodyError(400, "the body must be a JSON object")
                    if path == "/gc":
                        code, out = agent.gc(str(body.get("namespaceId", "")), bool(body.get("dryRun", True)))
                    else:
                        code, out = agent.expire(body.get("maxAgeDays"), body.get("protected"), body.get("remove"),
                                                 body.get("dryRun", True) is not False)
            except BodyError as exc:
                code, out = exc.code, {"error": str(exc)}
            except (ValueError, OSError) as exc:
                code, out = 500, {"error": str(exc)}
            self._send(code, out)

    server = BoundedHTTPServer((host, port), Handler, name="agent", probes={"/healthz": healthz}, **bounds)
    return server


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
    parser.add_argument("--adapter", choices=sorted(TRIMMED_ADAPTERS), default=DEFAULT_TRIMMED,
                        help="the L2 adapter whose chunk files the trim counts and deletes")
    parser.add_argument("--trim-period", type=_period, default=TRIM_PERIOD_S, metavar="SECONDS",
                        help=f"seconds between two trims (default {TRIM_PERIOD_S:.0f}, at most {MAX_TRIM_PERIOD_S:.0f})")
    parser.add_argument("--shared-folder", action="store_true",
                        help="the servers of a StatefulSet share the folder: only the pod of ordinal 0 (its name in "
                        f"${POD_NAME_ENV}, else the hostname) trims it")
    parser.add_argument("--trim-settle", type=float, default=EXCESS_SETTLE_S, metavar="SECONDS",
                        help=f"trim an excess only once it has lasted this long (default {EXCESS_SETTLE_S:.0f}: lmcache's "
                        "own eviction catches up with a burst of writes within a few seconds)")
    parser.add_argument("--trim-grace", type=float, default=0.0, metavar="SECONDS",
                        help="never trim a chunk file written less than this long ago")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    token = TokenFile(args.token_file) if args.token_file else None
    if token is not None and not token.value:
        parser.error(f"--token-file {args.token_file} is empty")
    pod = os.environ.get(POD_NAME_ENV) or socket.gethostname()
    trims = not args.shared_folder or trimmer_of(pod)
    agent = Agent(args.root, args.serving, capacity_bytes=args.capacity_bytes, trim_period_s=args.trim_period, token=token,
                  server=_server(parser, args.server_url), trims=trims, trim_grace_s=max(0.0, args.trim_grace),
                  adapter=args.adapter, settle_s=max(0.0, args.trim_settle))
    if args.shared_folder:
        log.info("shared folder: pod %s %s", pod, "trims it (ordinal 0)" if trims else
                 "reports only; the pod of ordinal 0 trims it")
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
