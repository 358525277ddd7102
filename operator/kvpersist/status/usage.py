"""Cache usage and health, read from each lmcache server's HTTP /status and /metrics; and the
hit figures (per tier, in total and over a recent window) folded from its lookup counters."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass, field, replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from pydantic import BaseModel, StrictBool

from kvpersist import httpclient
from kvpersist.httpclient import Count, PeerError
from kvpersist.inventory.volume import human_bytes, iso

STATUS_TIMEOUT_S = 2.0  # all of one server's answer, /status and /metrics together
# A /metrics body larger than this is not read further: the figures it carries become unknown.
# lmcache 0.5.6 answers with about 15 KB; each extra (model_name, cache_salt) pair adds ~1 KB.
MAX_METRICS_BYTES = 4 * 2**20


@dataclass(frozen=True)
class ServerReport:
    """One server's answer (or why there was none)."""

    pod: str
    healthy: bool
    message: str = ""
    l1_used: int | None = None
    l1_capacity: int | None = None
    l2_used: int | None = None
    l2_capacity: int | None = None
    l2_objects: int | None = None
    l2_healthy: bool | None = None
    l2_writes_failed: int | None = None  # objects whose L2 write failed since the server started
    l2_writes_submitted: int | None = None
    lookups: LookupCounters | None = None  # the lookup counters of /metrics; None: unknown


# The parts of lmcache 0.5.6's /status the operator reads (all else is ignored). Absent or null
# parts read as empty, as they always have; present ones must have the right shape and types.
class _Part(BaseModel):
    is_healthy: StrictBool | None = None


class L1Manager(_Part):
    memory_used_bytes: Count | None = None
    memory_total_bytes: Count | None = None


class L2Adapter(_Part):
    type: str = "?"
    stored_object_count: Count | None = None


class L2EvictionAdapter(BaseModel):
    total_bytes_used: Count | None = None
    total_capacity_bytes: Count | None = None


class L2EvictionController(BaseModel):
    adapters: list[L2EvictionAdapter] | None = None


class StoreController(BaseModel):
    pending_keys_count: Count | None = None
    in_flight_task_count: Count | None = None


class StorageManager(_Part):
    l1_manager: L1Manager | None = None
    l2_adapters: list[L2Adapter] | None = None
    l2_eviction_controller: L2EvictionController | None = None
    store_controller: StoreController | None = None


class LMCacheStatus(_Part):
    storage_manager: StorageManager | None = None


def report_of(pod: str, status: LMCacheStatus) -> ServerReport:
    """lmcache 0.5.6's /status as a report (L2 objects: the adapters' index, lazy after a restart)."""
    sm = status.storage_manager or StorageManager()
    l1 = sm.l1_manager or L1Manager()
    adapters = sm.l2_adapters or []
    evictions = (sm.l2_eviction_controller or L2EvictionController()).adapters or []
    unhealthy = [name for name, part in (("storage manager", sm), ("L1", l1)) if part.is_healthy is False]
    bad_l2 = [a.type for a in adapters if a.is_healthy is False]
    healthy = bool(status.is_healthy) and not unhealthy and not bad_l2
    message = "" if healthy else "unhealthy: " + ", ".join(unhealthy + [f"L2 adapter {t}" for t in bad_l2] or ["server"])
    return ServerReport(pod=pod, healthy=healthy, message=message, l1_used=l1.memory_used_bytes,
                        l1_capacity=l1.memory_total_bytes, l2_used=_total(e.total_bytes_used for e in evictions),
                        l2_capacity=_total(e.total_capacity_bytes for e in evictions),
                        l2_objects=_total(a.stored_object_count for a in adapters), l2_healthy=(not bad_l2) if adapters else None)


# /metrics: objects handed to the L2 store path, and those that landed. The difference, less what
# is pending, failed (ENOSPC, I/O errors): /status's adapters stay "healthy" while every write fails.
SUBMITTED = "lmcache_mp_l2_store_submitted_objects_chunks_total"
COMPLETED = "lmcache_mp_l2_store_completed_objects_chunks_total"


def _summed(text: str, key: Callable[[Sample], str | None]) -> dict[str, float] | None:
    """A Prometheus text body's samples summed per key(sample) (None: left out); None when it is not
    that format or is over MAX_METRICS_BYTES. Never raises: a peer's body is whatever it sent."""
    if not isinstance(text, str) or len(text) > MAX_METRICS_BYTES:
        return None
    try:
        samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    except Exception:  # the parser raises ValueError, and others on odd input
        return None
    out: dict[str, float] = {}
    for sample in samples:
        k = key(sample)
        if k is not None:
            out[k] = out.get(k, 0.0) + float(sample.value)
    return out


def parse_exposition(text: str) -> dict[str, float] | None:
    """Every sample summed per name over its label sets; None as _summed."""
    return _summed(text, lambda sample: sample.name)


def sum_by_label(text: str, name: str, label: str) -> dict[str, float] | None:
    """One metric's samples summed per value of a label (samples without it left out); None as _summed."""
    return _summed(text, lambda sample: sample.labels.get(label) if sample.name == name else None)


def is_count(value: float) -> bool:
    """Whether a sample's value is a counter's: finite, not negative, exact as a float."""
    return math.isfinite(value) and 0 <= value <= MAX_COUNTER


def _counter(metrics: Mapping[str, float], name: str) -> int | None:
    v = metrics.get(name)
    return int(v) if v is not None and is_count(v) else None


def with_write_failures(report: ServerReport, status: LMCacheStatus, metrics: Mapping[str, float]) -> ServerReport:
    """The report plus failed L2 writes (submitted - completed - pending); unchanged if the counters are malformed."""
    # lmcache's OTel counter has no sample before its first chunk lands: a server whose every L2
    # write failed since it started (a Hub refusing every upload) shows only SUBMITTED.
    submitted, completed = _counter(metrics, SUBMITTED), _counter(metrics, COMPLETED) if COMPLETED in metrics else 0
    if submitted is None or completed is None:
        return report
    ctl = (status.storage_manager or StorageManager()).store_controller or StoreController()
    pending = (ctl.pending_keys_count or 0) + (ctl.in_flight_task_count or 0)
    failed = max(0, submitted - completed - pending)
    return replace(report, l2_writes_failed=failed, l2_writes_submitted=submitted)


# Lookup counters (lmcache 0.5.6, mp_observability/subscribers/metrics/lookup.py), in tokens, summed
# over model_name and cache_salt, from the first lookup on: requested (chunk-aligned), hit (the
# contiguous prefix found in L1 or L2), and its split hit_l1 + hit_l2 (what L2 added) == hit.
LOOKUP_REQUESTED = "lmcache_mp_lookup_requested_tokens_total"
LOOKUP_HIT = "lmcache_mp_lookup_hit_tokens_total"
LOOKUP_HIT_L1 = "lmcache_mp_lookup_hit_l1_tokens_total"
LOOKUP_HIT_L2 = "lmcache_mp_lookup_hit_l2_tokens_total"
# Restore rates (l2_throughput.py, and L1 -> engine): histograms of one GB/s figure per load (_sum,
# _count). L2 -> L1 is what an L2 hit costs first, L1 -> engine what every hit costs.
RESTORE_L2 = "lmcache_mp_l2_load_throughput_GB_per_second"
RESTORE_L1 = "lmcache_mp_l0_l1_load_throughput_GB_per_second"
# prometheus_client's process collector: tells a restarted server from one whose counters grew.
PROCESS_START = "process_start_time_seconds"
# lmcache counts lookups on its event bus's drain thread (mp_observability/event_bus.py): events
# still queued, and events dropped from a full queue, are lookups the counters above do not show.
EVENTS_QUEUED = "lmcache_mp_event_bus_queue_depth"
EVENTS_DROPPED = "lmcache_mp_event_bus_dropped_events_total"
MAX_COUNTER = 2**53  # beyond this a float counter is no longer exact: treat it as garbage

# The recent window of status.hits.window.
HIT_WINDOW_S = 300.0
MAX_SAMPLES = 512  # per resource; the status loop adds about one per 10 s


@dataclass(frozen=True)
class LookupCounters:
    """One server's lookup counters as read from its /metrics (cumulative since it started)."""

    requested: int = 0
    hit: int = 0
    hit_l1: int = 0
    hit_l2: int = 0
    started: str | None = None  # process start, RFC 3339 to the second; None: not exported
    # Sums of per-load GB/s and how many loads, L2 -> L1 and L1 -> engine (RESTORE_L2, RESTORE_L1).
    l2_gbps_sum: float = 0.0
    l2_loads: int = 0
    l1_gbps_sum: float = 0.0
    l1_loads: int = 0
    # The event bus's queued and dropped events (EVENTS_QUEUED, EVENTS_DROPPED); None: not exported.
    events_queued: int | None = None
    events_dropped: int | None = None


def lookup_counters(metrics: Mapping[str, float] | None) -> LookupCounters | None:
    """The lookup counters of a parsed /metrics; None when unknown (no body, no lmcache_ sample, a
    counter that is no count). A server that served no lookup yet exports none of them: zeros."""
    if not metrics or not any(k.startswith("lmcache_") for k in metrics):
        return None
    values = [metrics.get(name, 0.0) for name in (LOOKUP_REQUESTED, LOOKUP_HIT, LOOKUP_HIT_L1, LOOKUP_HIT_L2)]
    if not all(is_count(v) for v in values):
        return None
    start = metrics.get(PROCESS_START)
    started = None
    if start is not None and math.isfinite(start) and start > 0:
        try:
            started = iso(start)
        except (OverflowError, OSError, ValueError):  # a value no clock shows (a hostile /metrics)
            started = None
    restores = []
    for name in (RESTORE_L2, RESTORE_L1):
        total, loads = metrics.get(name + "_sum", 0.0), metrics.get(name + "_count", 0.0)
        # A garbled histogram: no rate, the rest stands.
        restores += [total, int(loads)] if is_count(total) and is_count(loads) else [0.0, 0]
    queued, dropped = (_counter(metrics, name) for name in (EVENTS_QUEUED, EVENTS_DROPPED))
    return LookupCounters(*(int(v) for v in values), started, *restores, events_queued=queued, events_dropped=dropped)


@dataclass(frozen=True)
class HitTotals:
    """Token counts: looked up, found in cache (L1 + L2), found in L1, added by L2; and the
    restore-rate sums and load counts per tier (in memory only: status keeps no totals of them)."""

    lookup: int = 0
    hit: int = 0
    l1: int = 0
    l2: int = 0
    l2_gbps_sum: float = 0.0
    l2_loads: int = 0
    l1_gbps_sum: float = 0.0
    l1_loads: int = 0

    def __add__(self, other: HitTotals) -> HitTotals:
        return HitTotals(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: HitTotals) -> HitTotals:
        return HitTotals(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


def _as_totals(c: LookupCounters) -> HitTotals:
    return HitTotals(c.requested, c.hit, c.hit_l1, c.hit_l2, c.l2_gbps_sum, c.l2_loads, c.l1_gbps_sum, c.l1_loads)


def counter_delta(previous: LookupCounters | None, current: LookupCounters) -> HitTotals:
    """What a server counted since previous; all of current without previous, or when its process
    start changed or a counter went down (it restarted: all it shows is new)."""
    previous = previous or LookupCounters()  # none: zeros, so the delta is all of current
    restarted = previous.started is not None and current.started is not None and previous.started != current.started
    delta = _as_totals(current) - _as_totals(previous)
    if restarted or min(delta.lookup, delta.hit, delta.l1, delta.l2, delta.l2_loads, delta.l1_loads) < 0:
        return _as_totals(current)
    return delta


def fold_counters(totals: HitTotals, baselines: Mapping[str, LookupCounters],
                  current: Mapping[str, LookupCounters | None]) -> tuple[HitTotals, dict[str, LookupCounters]]:
    """Totals plus what each server counted since its baseline, and the new baselines. Unknown
    counters keep their baseline (nothing is lost); servers no longer listed are forgotten, but
    only when some server is listed (an empty list says nothing about who runs)."""
    new_baselines = dict(baselines) if not current else {p: c for p, c in baselines.items() if p in current}
    for pod, counters in sorted(current.items()):
        if counters is None:
            continue
        totals = totals + counter_delta(baselines.get(pod), counters)
        new_baselines[pod] = counters
    return totals, new_baselines


def percent(part: int, whole: int) -> str | None:
    """A ratio for people, to 0.1%: 2048 of 5120 -> 40.0%; None without a whole."""
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else None


def ratio(part: int, whole: int) -> float | None:
    """A share as a number, to 4 decimals (0.625 for 62.5%); None without a whole."""
    return round(part / whole, 4) if whole > 0 else None


def _figures(t: HitTotals) -> dict[str, Any]:
    return {"lookupTokens": t.lookup, "hitTokens": t.hit, "hitTokensL1": t.l1, "hitTokensL2": t.l2,
            "hitRate": ratio(t.hit, t.lookup), "hitRateL1": ratio(t.l1, t.lookup), "hitRateL2": ratio(t.l2, t.lookup)}


def window_figures(samples: Sequence[tuple[float, HitTotals]], now: float) -> dict[str, Any] | None:
    """The figures from the newest (monotonic time, totals) sample at least HIT_WINDOW_S old (else the
    oldest) to the newest; None with fewer than two, or the newest older than the window."""
    if len(samples) < 2 or now - samples[-1][0] > HIT_WINDOW_S:
        return None
    old = [s for s in samples if s[0] <= now - HIT_WINDOW_S]
    first = old[-1] if old else samples[0]
    last = samples[-1]
    elapsed = last[0] - first[0]
    if elapsed <= 0:
        return None
    d = last[1] - first[1]
    out = {"seconds": int(HIT_WINDOW_S) if old else int(elapsed), **_figures(d)}
    out["lookupTokensPerSecond"] = round(d.lookup / elapsed)
    out["hitTokensPerSecond"] = round(d.hit / elapsed)
    out["restoresL2"], out["restoreGbpsL2"] = d.l2_loads, restore_rate(d.l2_gbps_sum, d.l2_loads)
    out["restoresL1"], out["restoreGbpsL1"] = d.l1_loads, restore_rate(d.l1_gbps_sum, d.l1_loads)
    return out


def restore_rate(gbps_sum: float, loads: int) -> float | None:
    """The mean GB/s of the window's loads of one tier, to 0.01; None without a load."""
    return round(max(0.0, gbps_sum) / loads, 2) if loads > 0 else None


def hits_status(totals: HitTotals, baselines: Mapping[str, LookupCounters], window: Mapping[str, Any] | None,
                since: str | None) -> dict[str, Any]:
    """status.hits: totals, window, the HIT column's summary (the window's rate, else the total's)
    and each server's last counters (a restarted operator folds from them). Absent figures are None
    so that a merge patch removes them."""
    summary = None
    if window is not None and window.get("hitRate") is not None:
        seconds = window["seconds"]
        shown = f"{seconds // 60}m" if seconds >= 60 and seconds % 60 == 0 else f"{seconds}s"
        summary = f"{percent(window['hitTokens'], window['lookupTokens'])} ({shown})"
    elif totals.lookup > 0:
        summary = f"{percent(totals.hit, totals.lookup)} (total)"
    servers = [{"pod": pod, "startedAt": c.started, "lookupTokens": c.requested, "hitTokens": c.hit,
                "hitTokensL1": c.hit_l1, "hitTokensL2": c.hit_l2} for pod, c in sorted(baselines.items())]
    return {**_figures(totals), "window": dict(window) if window is not None else None, "summary": summary,
            "since": since, "servers": [{k: v for k, v in s.items() if v is not None} for s in servers]}


def _counts(stored: Mapping[str, Any]) -> list[int]:
    """lookupTokens, hitTokens, hitTokensL1, hitTokensL2 as stored; 0 for any that is no count."""
    values = [stored.get(k) for k in ("lookupTokens", "hitTokens", "hitTokensL1", "hitTokensL2")]
    return [v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNTER else 0 for v in values]


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


@dataclass
class _HitState:
    uid: str | None
    totals: HitTotals
    baselines: dict[str, LookupCounters]
    since: str | None
    samples: deque[tuple[float, HitTotals]] = field(default_factory=deque)


class HitTracker:
    """Per resource: hit totals, each server's last counters and the window's samples. Totals are
    seeded from status.hits (they survive operator restarts); the window lives only in memory."""

    def __init__(self) -> None:
        self._state: dict[Any, _HitState] = {}
        self._lock = threading.Lock()  # refreshes of one resource may overlap (status loop and reconcile)

    def observe(self, key: Any, uid: str | None, stored: Mapping[str, Any] | None, reports: Iterable[ServerReport],
                now: float, wall: str) -> dict[str, Any] | None:
        """Folds one refresh's reports in; status.hits, or None while nothing was ever counted."""
        current = {r.pod: r.lookups for r in reports}
        with self._lock:
            state = self._state.get(key)
            if state is None or state.uid != uid:  # seeded from a stored status.hits: zeros without one
                hits = stored if isinstance(stored, Mapping) else {}
                baselines = {s["pod"]: LookupCounters(*_counts(s), _text(s.get("startedAt"))) for s in hits.get("servers") or []
                             if isinstance(s, Mapping) and isinstance(s.get("pod"), str)}
                state = self._state[key] = _HitState(uid, HitTotals(*_counts(hits)), baselines, _text(hits.get("since")))
            if any(c is not None for c in current.values()):
                state.totals, state.baselines = fold_counters(state.totals, state.baselines, current)
                state.since = state.since or wall
                state.samples.append((now, state.totals))
                samples = state.samples  # the window needs none older than the newest at least HIT_WINDOW_S old
                while len(samples) > MAX_SAMPLES or (len(samples) > 1 and samples[1][0] <= now - HIT_WINDOW_S):
                    samples.popleft()
            if state.since is None:
                return None
            return hits_status(state.totals, state.baselines, window_figures(state.samples, now), state.since)

    def forget(self, key: Any) -> None:
        with self._lock:
            self._state.pop(key, None)


def _total(values: Iterable[Any], op: Callable[[list[int]], int] = sum) -> int | None:
    """op (sum, max) of the counts among values; None without one."""
    nums = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return op(nums) if nums else None


# lmcache's admin API listens on its pod's loopback only; the agent forwards these two reads.
# DIRECT reads a server's own API (tests, or a process in its pod).
THROUGH_AGENT = "/server"
DIRECT = ""


def fetch_status(pod: str, ip: str, port: int, timeout: float = STATUS_TIMEOUT_S, token: str | None = None,
                 prefix: str = THROUGH_AGENT) -> ServerReport:
    """GET /status, then /metrics, both within timeout in all, through the pod's agent: a slow,
    trickling, oversized or garbled answer costs at most that and makes an unhealthy report saying
    why. A /metrics that fails or is not Prometheus text leaves only its figures unknown."""
    deadline = time.monotonic() + timeout
    where = f"{ip}:{port}" + (" (the pod's agent)" if prefix == THROUGH_AGENT else "")
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        reply = httpclient.get(ip, port, prefix + "/status", timeout=timeout, headers=headers)
    except PeerError as exc:
        return ServerReport(pod=pod, healthy=False, message=f"/status unreachable at {where}: {exc}")
    if not reply.ok:
        agent_up = reply.status in (502, 504) and prefix == THROUGH_AGENT  # lmcache is not answering the agent
        what = f"unreachable from the agent at {where}: HTTP" if agent_up else f"at {where} answered HTTP"
        try:  # the agent's short reason for a refused or failed read (a JSON {"error": ...}), if any
            error = httpclient.load_json(reply.body[:1024]).get("error")
        except (PeerError, AttributeError):
            error = None
        detail = f": {str(error)[:200]}" if error else ""
        return ServerReport(pod=pod, healthy=False, message=f"/status {what} {reply.status}{detail}")
    try:
        status = httpclient.parse(reply.body, LMCacheStatus)
    except PeerError as exc:  # another shape: an unhealthy report saying why, never an exception
        return ServerReport(pod=pod, healthy=False, message=f"malformed /status: {exc}")
    report = report_of(pod, status)
    metrics = _fetch_metrics(ip, port, deadline - time.monotonic(), prefix, headers)
    report = with_write_failures(report, status, metrics or {})
    return replace(report, lookups=lookup_counters(metrics))


def fetch_lookup_counters(ip: str, port: int, timeout: float = STATUS_TIMEOUT_S, token: str | None = None) -> LookupCounters | None:
    """One server's lookup counters alone (its /metrics, through the pod's agent), within timeout; None when unknown."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return lookup_counters(_fetch_metrics(ip, port, timeout, THROUGH_AGENT, headers))


def _fetch_metrics(ip: str, port: int, timeout: float, prefix: str,
                   headers: Mapping[str, str] | None) -> dict[str, float] | None:
    """The parsed /metrics of a server, or None (no time left, no answer, not Prometheus text)."""
    if timeout <= 0:
        return None
    try:
        reply = httpclient.get(ip, port, prefix + "/metrics", timeout=timeout, max_bytes=MAX_METRICS_BYTES, headers=headers)
    except PeerError:
        return None
    return parse_exposition(reply.body.decode("utf-8", errors="replace")) if reply.ok else None


def collect_usage(pods: Iterable[tuple[str, str | None]], port: int, timeout: float = STATUS_TIMEOUT_S,
                  token: str | None = None) -> list[ServerReport]:
    """Asks every (pod, ip) in parallel (stuck servers cost one timeout together); no IP yet: unhealthy."""
    pods = list(pods)
    with_ip = [(p, ip) for p, ip in pods if ip]
    reports = {p: ServerReport(pod=p, healthy=False, message="pod has no IP yet") for p, ip in pods if not ip}
    for rep in httpclient.in_parallel(lambda pi: fetch_status(pi[0], pi[1], port, timeout, token), with_ip):
        reports[rep.pod] = rep
    return [reports[p] for p, _ in pods]


def namespace_l2(reports: list[ServerReport], shared: bool, volume: tuple[int, int] | None,
                 floor: int = 0) -> tuple[int, int]:
    """The namespace's (bytes, objects) on L2 (usage.l2UsedBytes, and what the budget counts): the
    larger of the servers' count (a restarted server counts from zero) and the volume's, never
    below floor. Servers are summed, or with shared (one folder, each counting all) their largest."""
    counted = [r for r in reports if r.l2_used is not None]
    used, objects = [r.l2_used or 0 for r in counted], [r.l2_objects or 0 for r in counted]
    servers_bytes, servers_objects = (max(used, default=0), max(objects, default=0)) if shared else (sum(used), sum(objects))
    volume_bytes, volume_objects = volume or (0, 0)
    return max(servers_bytes, volume_bytes, floor), max(servers_objects, volume_objects)


def summarize(reports: list[ServerReport], measured_at: str, shared: bool = False,
              volume: tuple[int, int] | None = None, floor: int = 0) -> dict[str, Any]:
    """Usage over the servers that answered, in the status's shape, L2 as namespace_l2 counts it
    (shared: one folder each server counts whole, so the largest count, never the sum)."""
    answered = [r for r in reports if r.l1_capacity is not None]
    if not answered:
        return {}
    l2_op = max if shared else sum
    usage: dict[str, Any] = {
        "l1UsedBytes": _total(r.l1_used for r in answered),
        "l1CapacityBytes": _total(r.l1_capacity for r in answered),
        "l2UsedBytes": None,
        "l2CapacityBytes": _total((r.l2_capacity for r in answered), l2_op),
        "l2Objects": _total((r.l2_objects for r in answered), l2_op),
        "measuredAt": measured_at,
    }
    if volume is not None or any(r.l2_used is not None for r in answered):  # L2's figure as the budget counts it
        usage["l2UsedBytes"], usage["l2Objects"] = namespace_l2(answered, shared, volume, floor)
    for tier in ("l1", "l2"):
        used, capacity = usage[f"{tier}UsedBytes"], usage[f"{tier}CapacityBytes"]
        if used is not None and capacity:
            usage[f"{tier}Used"] = f"{human_bytes(used)}/{human_bytes(capacity)}"
    return {k: v for k, v in usage.items() if v is not None}


class WriteFailureTracker:
    """Writes are failing *now* when a server's failed-write count grew within hold_s: cumulative
    counts alone would flag a server forever after one bad minute."""

    def __init__(self, hold_s: float = 120.0) -> None:
        self.hold_s = hold_s
        self._last: dict[str, tuple[int, float]] = {}  # key -> (failed count, when it last grew)

    def failing(self, key: str, failed: int | None, now: float) -> bool:
        if failed is None:
            return False
        previous = self._last.get(key)
        if previous is None or failed < previous[0]:  # first seen, or the server restarted: counters began again
            grew_at = now if failed > 0 else float("-inf")
        elif failed > previous[0]:
            grew_at = now
        else:
            grew_at = previous[1]
        self._last[key] = (failed, grew_at)
        return now - grew_at <= self.hold_s
