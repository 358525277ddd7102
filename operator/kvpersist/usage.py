"""Cache usage and health, read from each lmcache server's HTTP /status."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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


def _sum(values: Iterable[Any]) -> int | None:
    nums = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return sum(nums) if nums else None


def fetch_status(pod: str, ip: str, port: int, timeout: float = STATUS_TIMEOUT_S) -> ServerReport:
    url = f"http://{ip}:{port}/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return parse_status(pod, json.loads(resp.read()))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return ServerReport(pod=pod, healthy=False, message=f"/status unreachable at {ip}:{port}: {reason}")


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
