"""The operator's own Prometheus metrics on /metrics: what costs the API server something (so a scrape
shows whether an idle cluster costs nothing), the resources per phase, and per resource what alerts need
(kube-state-metrics style). A resource's series go when it is deleted, a condition's when it changes."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvpersist.httpserver import BoundedHTTPServer, QuietHandler

_lock = threading.Lock()
_counters: Counter[str] = Counter()
_phases: dict[tuple[str, str], str] = {}
_refreshes: Counter[tuple[str, str]] = Counter()

HELP = {
    "kvpersist_reconciles_total": "Reconciles of a KVCacheNamespace (create, spec update, resume).",
    "kvpersist_applies_total": "Objects applied with server-side apply.",
    "kvpersist_apply_errors_total": "Applies the API server refused.",
    "kvpersist_status_refreshes_total": "Status computations (periodic and after reconciles).",
    "kvpersist_status_writes_total": "Status patches written (only when something changed).",
    "kvpersist_events_total": "Kubernetes Events posted.",
    "kvpersist_gc_total": "Explicit gc requests (kvpersist gc) carried out, whatever their outcome.",
}

# Per resource, labelled {namespace, name}: HELP by type, then where each value comes from.
RESOURCE_GAUGES = {
    "kvpersist_resource_l1_used_bytes": "L1 (host RAM) bytes in use, summed over the servers (status.usage.l1UsedBytes).",
    "kvpersist_resource_l1_capacity_bytes": "L1 capacity in bytes (status.usage.l1CapacityBytes).",
    "kvpersist_resource_l2_used_bytes": "L2 bytes of this namespace, what a budget counts (status.usage.l2UsedBytes).",
    "kvpersist_resource_l2_capacity_bytes": "L2 capacity in bytes the servers were given (status.usage.l2CapacityBytes).",
    "kvpersist_resource_l2_budget_bytes": "The L2 budget in bytes (status.budget.bytes; absent without spec.l2.nvme.budget).",
    "kvpersist_resource_last_refresh_timestamp_seconds": "When the resource's status was last refreshed in full (observed, "
                                                         "judged, written or found current), in Unix seconds.",
}
RESOURCE_COUNTERS = {
    "kvpersist_resource_lookup_tokens_total": "Tokens vLLM looked up in the cache (status.hits.lookupTokens).",
    "kvpersist_resource_hit_tokens_total": "Tokens served from the cache, L1 and L2 (status.hits.hitTokens).",
    "kvpersist_resource_hit_tokens_l1_total": "Of them, found in L1 (status.hits.hitTokensL1).",
    "kvpersist_resource_hit_tokens_l2_total": "Of them, added by L2 (status.hits.hitTokensL2).",
    "kvpersist_resource_l2_write_failures_total": "Objects whose L2 write failed (submitted, not completed, not pending) "
                                                  "since the operator first read each server, summed over the servers.",
    "kvpersist_resource_l2_writes_submitted_total": "Objects handed to the L2 store path, folded the same way.",
}
CONDITION = "kvpersist_resource_condition"
_USAGE = {"kvpersist_resource_l1_used_bytes": ("usage", "l1UsedBytes"),
          "kvpersist_resource_l1_capacity_bytes": ("usage", "l1CapacityBytes"),
          "kvpersist_resource_l2_used_bytes": ("usage", "l2UsedBytes"),
          "kvpersist_resource_l2_capacity_bytes": ("usage", "l2CapacityBytes"),
          "kvpersist_resource_l2_budget_bytes": ("budget", "bytes")}
_HITS = {"kvpersist_resource_lookup_tokens_total": "lookupTokens", "kvpersist_resource_hit_tokens_total": "hitTokens",
         "kvpersist_resource_hit_tokens_l1_total": "hitTokensL1", "kvpersist_resource_hit_tokens_l2_total": "hitTokensL2"}


CREATOR_RIGHTS = "kvpersist_creator_rights_enforced"
_creator_rights: list[float] = []  # the gauge's value, when the check has an answer


def creator_rights(ok: bool | None) -> None:
    """1 while the creator-rights policy and its Deny binding exist, 0 while either is missing; absent while
    the operator cannot tell (it may not read them) or the check is off."""
    with _lock:
        _creator_rights[:] = [] if ok is None else [1.0 if ok else 0.0]


def families() -> set[str]:
    """Every metric name /metrics can show (what the alert rules may refer to)."""
    return {*HELP, "kvpersist_resources", "kvpersist_resource_refreshes_total", CONDITION, *RESOURCE_GAUGES,
            *RESOURCE_COUNTERS, CREATOR_RIGHTS}


@dataclass
class _Fold:
    """A counter folded from each server's cumulative count: what it counted since last read is added (all of it after
    its restart: a lower count); one not read keeps its baseline, so nothing counts twice. A first reading is only a
    baseline: else a restarted operator's first scrape would show every failure the servers ever had as new."""

    total: int = 0
    last: dict[str, int] = field(default_factory=dict)

    def add(self, counts: Mapping[str, int | None]) -> None:
        known = {pod: v for pod, v in counts.items() if v is not None}
        for pod, value in known.items():
            before = self.last.get(pod)
            if before is not None:
                self.total += value if value < before else value - before
        self.last.update(known)  # bounded: the StatefulSet's pod names, reused across restarts


@dataclass
class _Resource:
    conditions: list[tuple[str, str, str]] = field(default_factory=list)  # (type, status, reason)
    values: dict[str, float] = field(default_factory=dict)
    failures: _Fold = field(default_factory=_Fold)
    submitted: _Fold = field(default_factory=_Fold)


_resources: dict[tuple[str, str], _Resource] = {}


def inc(name: str, n: int = 1) -> None:
    with _lock:
        _counters[name] += n


def set_phase(namespace: str, name: str, phase: str | None) -> None:
    """A resource's phase; None when it is gone (all of its series go too)."""
    with _lock:
        if phase is None:
            for held in (_phases, _refreshes, _resources):
                held.pop((namespace, name), None)
        else:
            _phases[(namespace, name)] = phase


def standby(namespace: str, name: str) -> None:
    """This replica no longer refreshes the resource: its series go, so alerts read only the active replica's."""
    with _lock:
        _resources.pop((namespace, name), None)


def refreshed(namespace: str, name: str, phase: str | None) -> None:
    """One status refresh of a resource and its phase, counted per resource too: "nothing happened" only
    after it had another round, whatever it wrote."""
    with _lock:
        _counters["kvpersist_status_refreshes_total"] += 1
        _refreshes[(namespace, name)] += 1
    set_phase(namespace, name, phase)


def observed(namespace: str, name: str, status: Mapping[str, Any], hits: Mapping[str, Any] | None = None,
             reports: Iterable[Any] = (), at: float | None = None) -> None:
    """A finished refresh: the status, the hit totals (the tracker's, fresher) and the servers' reports; replaces its series."""
    conditions = sorted({(str(c.get("type", "")), str(c.get("status", "")), str(c.get("reason", "")))
                         for c in status.get("conditions") or [] if isinstance(c, Mapping)})
    read = {**{metric: (status.get(part) or {}).get(key) for metric, (part, key) in _USAGE.items()},
            **{metric: (hits or {}).get(key) for metric, key in _HITS.items()}}
    values = {metric: float(v) for metric, v in read.items() if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0}
    values["kvpersist_resource_last_refresh_timestamp_seconds"] = time.time() if at is None else at
    reports = list(reports)
    with _lock:
        res = _resources.setdefault((namespace, name), _Resource())
        res.conditions, res.values = conditions, values
        res.failures.add({r.pod: r.l2_writes_failed for r in reports})
        res.submitted.add({r.pod: r.l2_writes_submitted for r in reports})
        values["kvpersist_resource_l2_write_failures_total"] = res.failures.total
        values["kvpersist_resource_l2_writes_submitted_total"] = res.submitted.total


def _family(kind: str, name: str, text: str, labels: Iterable[str],
            samples: Iterable[tuple[list[str], float]]) -> CounterMetricFamily | GaugeMetricFamily:
    """One family and its samples (label values, value); prometheus_client escapes label values (users' names)."""
    family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text, labels=list(labels))
    for values, value in samples:
        family.add_metric(values, value)
    return family


class _Collector(Collector):
    """What render() shows, read under the lock at each scrape (nothing kept in prometheus_client's objects)."""

    def collect(self) -> Iterator[Metric]:
        with _lock:
            families: list[Metric] = [_family("counter", name, text, (), [([], _counters[name])]) for name, text in HELP.items()]
            if _creator_rights:
                families.append(_family("gauge", CREATOR_RIGHTS, "1 while the creator-rights ValidatingAdmissionPolicy and its "
                                        "Deny binding exist, 0 while not (then any creator of a KVCacheNamespace gets its pods).",
                                        (), [([], _creator_rights[0])]))
            families.append(_family("gauge", "kvpersist_resources", "KVCacheNamespaces by phase.", ["phase"],
                                    [([phase], count) for phase, count in sorted(Counter(_phases.values()).items())]))
            families.append(_family("counter", "kvpersist_resource_refreshes_total",
                                    "Status refreshes of one KVCacheNamespace (dropped when it is deleted).", ["namespace", "name"],
                                    [(list(key), count) for key, count in sorted(_refreshes.items())]))
            resources = sorted(_resources.items())
            families.append(_family("gauge", CONDITION, "A KVCacheNamespace's conditions as last refreshed: one series of value 1 "
                                    "per condition, with its status and reason.", ["namespace", "name", "type", "status", "reason"],
                                    [([*key, *condition], 1) for key, res in resources for condition in res.conditions]))
            for kind, texts in (("gauge", RESOURCE_GAUGES), ("counter", RESOURCE_COUNTERS)):
                families += [_family(kind, metric, text, ["namespace", "name"],
                                     [(list(key), res.values[metric]) for key, res in resources if metric in res.values])
                             for metric, text in texts.items()]
        yield from families


_REGISTRY = CollectorRegistry(auto_describe=False)
_REGISTRY.register(_Collector())


def render() -> str:
    """The Prometheus text format (0.0.4) of every series, as prometheus_client writes it."""
    return generate_latest(_REGISTRY).decode()


class _Handler(QuietHandler):
    def do_GET(self) -> None:
        if self.path != "/metrics":
            self.send_error(404)
            return
        self.answer(200, CONTENT_TYPE_LATEST, render().encode())


def serve(host: str, port: int) -> BoundedHTTPServer:
    """/metrics on a daemon thread, bounded (kvpersist.httpserver): a scrape is one short GET, so two workers."""
    return BoundedHTTPServer((host, port), _Handler, workers=2, queue_size=8, name="metrics").start()
