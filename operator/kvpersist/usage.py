"""Cache usage and health, read from each lmcache server's HTTP /status."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

STATUS_TIMEOUT_S = 2.0


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


def parse_status(pod: str, status: Mapping[str, Any]) -> ServerReport:
    """Reads lmcache 0.5.6's /status: L1 from l1_manager, L2 bytes from the L2 eviction
    controller's per-adapter accounting, objects from the adapters' in-memory index (lazy after a
    restart: files on disk count once they are looked up)."""
    sm = status.get("storage_manager") or {}
    l1 = sm.get("l1_manager") or {}
    adapters = sm.get("l2_adapters") or []
    evictions = (sm.get("l2_eviction_controller") or {}).get("adapters") or []
    unhealthy = [name for name, part in (("storage manager", sm), ("L1", l1)) if part and part.get("is_healthy") is False]
    bad_l2 = [a.get("type", "?") for a in adapters if a.get("is_healthy") is False]
    healthy = bool(status.get("is_healthy")) and not unhealthy and not bad_l2
    message = "" if healthy else "unhealthy: " + ", ".join(unhealthy + [f"L2 adapter {t}" for t in bad_l2] or ["server"])
    return ServerReport(
        pod=pod,
        healthy=healthy,
        message=message,
        l1_used=l1.get("memory_used_bytes"),
        l1_capacity=l1.get("memory_total_bytes"),
        l2_used=_sum(e.get("total_bytes_used") for e in evictions),
        l2_capacity=_sum(e.get("total_capacity_bytes") for e in evictions),
        l2_objects=_sum(a.get("stored_object_count") for a in adapters),
        l2_healthy=(not bad_l2) if adapters else None,
    )


# Counters from /metrics: objects handed to the L2 store path, and objects that landed. The
# difference, less what is still pending, is what failed (ENOSPC, I/O errors): /status does not
# show it, its adapters stay "healthy" while every write fails.
SUBMITTED = "lmcache_mp_l2_store_submitted_objects_chunks_total"
COMPLETED = "lmcache_mp_l2_store_completed_objects_chunks_total"


def parse_metrics(text: str, names: Iterable[str] = (SUBMITTED, COMPLETED)) -> dict[str, float]:
    """Sums of the named Prometheus samples over all label sets."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        if name in wanted:
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return out


def with_write_failures(report: ServerReport, status: Mapping[str, Any], metrics: Mapping[str, float]) -> ServerReport:
    """The report plus failed L2 writes: submitted - completed - still pending."""
    if SUBMITTED not in metrics or COMPLETED not in metrics:
        return report
    ctl = (status.get("storage_manager") or {}).get("store_controller") or {}
    pending = int(ctl.get("pending_keys_count") or 0) + int(ctl.get("in_flight_task_count") or 0)
    submitted = int(metrics[SUBMITTED])
    failed = max(0, submitted - int(metrics[COMPLETED]) - pending)
    return replace(report, l2_writes_failed=failed, l2_writes_submitted=submitted)


def _sum(values: Iterable[Any]) -> int | None:
    nums = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return sum(nums) if nums else None


def fetch_status(pod: str, ip: str, port: int, timeout: float = STATUS_TIMEOUT_S) -> ServerReport:
    """GET /status (health, usage), then /metrics (failed writes); both bounded by timeout."""
    base = f"http://{ip}:{port}"
    try:
        with urllib.request.urlopen(base + "/status", timeout=timeout) as resp:
            status = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return ServerReport(pod=pod, healthy=False, message=f"/status unreachable at {ip}:{port}: {reason}")
    report = parse_status(pod, status)
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=timeout) as resp:
            metrics = parse_metrics(resp.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError):
        return report
    return with_write_failures(report, status, metrics)


def collect_usage(pods: Iterable[tuple[str, str | None]], port: int, timeout: float = STATUS_TIMEOUT_S) -> list[ServerReport]:
    """Asks every (pod, ip) in parallel; a pod without an IP yet is reported as not healthy."""
    pods = list(pods)
    with_ip = [(p, ip) for p, ip in pods if ip]
    reports = {p: ServerReport(pod=p, healthy=False, message="pod has no IP yet") for p, ip in pods if not ip}
    if with_ip:
        with ThreadPoolExecutor(max_workers=min(8, len(with_ip))) as pool:
            for rep in pool.map(lambda pi: fetch_status(pi[0], pi[1], port, timeout), with_ip):
                reports[rep.pod] = rep
    return [reports[p] for p, _ in pods]


def human_bytes(n: int | None) -> str | None:
    if n is None:
        return None
    for unit, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= size:
            value = n / size
            return f"{value:.1f}{unit}".replace(".0" + unit, unit)
    return f"{n}B"


def summarize(reports: list[ServerReport], measured_at: str) -> dict[str, Any]:
    """Usage summed over servers that answered, in the status's shape."""
    answered = [r for r in reports if r.l1_capacity is not None]
    if not answered:
        return {}
    total = {k: _sum(getattr(r, k) for r in answered) for k in ("l1_used", "l1_capacity", "l2_used", "l2_capacity",
                                                                 "l2_objects")}
    usage: dict[str, Any] = {
        "l1UsedBytes": total["l1_used"],
        "l1CapacityBytes": total["l1_capacity"],
        "l2UsedBytes": total["l2_used"],
        "l2CapacityBytes": total["l2_capacity"],
        "l2Objects": total["l2_objects"],
        "measuredAt": measured_at,
    }
    if total["l1_used"] is not None and total["l1_capacity"]:
        usage["l1Used"] = f"{human_bytes(total['l1_used'])}/{human_bytes(total['l1_capacity'])}"
    if total["l2_used"] is not None and total["l2_capacity"]:
        usage["l2Used"] = f"{human_bytes(total['l2_used'])}/{human_bytes(total['l2_capacity'])}"
    return {k: v for k, v in usage.items() if v is not None}


class WriteFailureTracker:
    """Remembers each server's failed-write count between polls: writes are failing *now* when
    the count grew within the last hold_s seconds. Cumulative counts alone would flag a server
    forever after one bad minute."""

    def __init__(self, hold_s: float = 120.0) -> None:
        self.hold_s = hold_s
        self._last: dict[str, tuple[int, float]] = {}  # key -> (failed count, when it last grew)

    def failing(self, key: str, failed: int | None, now: float) -> bool:
        if failed is None:
            return False
        previous = self._last.get(key)
        if previous is None:
            grew_at = now if failed > 0 else float("-inf")
        elif failed > previous[0]:
            grew_at = now
        elif failed < previous[0]:  # the server restarted: counters began again
            grew_at = now if failed > 0 else float("-inf")
        else:
            grew_at = previous[1]
        self._last[key] = (failed, grew_at)
        return now - grew_at <= self.hold_s
