"""Hit figures from lmcache's lookup counters: parsing /metrics (real lmcache 0.5.6 bodies, and
garbage), folding per-server counters into totals across server and operator restarts, and the
recent window.

The captures in data/ come from one real `lmcache server` (0.5.6, fs L2) driven by
tests/integration/kvdriver.py: 4 lookups that miss (store), 6 lookups of which 4 hit L1; then the
server restarted (new process, counters from zero) and the same 6 lookups hit L2.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvpersist.api.statusmodels import KVCacheNamespaceStatus
from kvpersist.status.usage import (
    HIT_WINDOW_S,
    MAX_METRICS_BYTES,
    HitTotals,
    HitTracker,
    LookupCounters,
    ServerReport,
    counter_delta,
    fetch_status,
    fold_counters,
    lookup_counters,
    parse_exposition,
    percent,
    window_figures,
)
from tests.serving import in_thread

DATA = Path(__file__).parent / "data"
STATUS = json.loads((DATA / "lmcache-0.5.6-status-nixl-8-objects.json").read_text())


def capture(n: int) -> str:
    return next(DATA.glob(f"lmcache-0.5.6-metrics-{n}-*.txt")).read_text()


def counters_of(n: int) -> LookupCounters:
    c = lookup_counters(parse_exposition(capture(n)))
    assert c is not None
    return c


# ---------------------------------------------------------------- parsing


def test_real_captures_give_exact_counters() -> None:
    fresh, no_hits, l1, l2 = (counters_of(n) for n in range(4))
    # A server that has served no lookup exports no lookup counters: zeros, not unknown.
    assert (fresh.requested, fresh.hit, fresh.hit_l1, fresh.hit_l2) == (0, 0, 0, 0)
    assert (no_hits.requested, no_hits.hit, no_hits.hit_l1, no_hits.hit_l2) == (2048, 0, 0, 0)
    assert (l1.requested, l1.hit, l1.hit_l1, l1.hit_l2) == (5120, 2048, 2048, 0)
    assert (l2.requested, l2.hit, l2.hit_l1, l2.hit_l2) == (3072, 2048, 0, 2048)
    # process_start_time_seconds 1.79602228205e+09, then 1.79602231424e+09 after the restart
    assert no_hits.started == l1.started == "2026-11-30T07:04:42Z"
    assert l2.started == "2026-11-30T07:05:14Z"
    # The event bus that counts lookups: nothing queued or dropped (the canary's L1/L2 split needs that).
    assert {(c.events_queued, c.events_dropped) for c in (fresh, no_hits, l1, l2)} == {(0, 0)}


def test_labels_are_summed_and_quoted_values_parsed() -> None:
    body = (
        '# HELP lmcache_mp_lookup_requested_tokens_total x\n'
        'lmcache_mp_lookup_requested_tokens_total{cache_salt="a b}c",model_name="m,\\"q\\""} 100.0\n'
        'lmcache_mp_lookup_requested_tokens_total{cache_salt="",model_name="m"} 1e3 1700000000000\n'
        'lmcache_mp_lookup_hit_tokens_total{model_name="m"} 256\n'
        'lmcache_mp_lookup_hit_l1_tokens_total{model_name="m",} 200\r\n'
        'lmcache_mp_lookup_hit_l2_tokens_total{} 56\n'
        '\n'
    )
    c = lookup_counters(parse_exposition(body))
    assert c == LookupCounters(1100, 256, 200, 56, None)


GARBAGE = [
    "",  # nothing
    "<html><body>502 Bad Gateway</body></html>",
    '{"error": "not found"}',
    "lmcache_mp_lookup_requested_tokens_total 100\nthis is not a sample\n",  # one bad line spoils the body
    "lmcache_mp_lookup_requested_tokens_total{model_name=\"m} 100\n",  # unterminated label value
    "lmcache_mp_lookup_requested_tokens_total 1_000\n",  # Python would take it; Prometheus would not
    "lmcache_mp_lookup_requested_tokens_total\n",
    "python_gc_objects_collected_total 5\n",  # well formed, but not lmcache's
    "lmcache_mp_lookup_requested_tokens_total NaN\n",
    "lmcache_mp_lookup_requested_tokens_total -5\n",
    "lmcache_mp_lookup_requested_tokens_total +Inf\n",
    "lmcache_mp_lookup_requested_tokens_total 1e300\n",
    "\x00\xff\xfe" * 1000,
]


@pytest.mark.parametrize("body", GARBAGE)
def test_garbage_makes_the_figures_unknown(body: str) -> None:
    assert lookup_counters(parse_exposition(body)) is None


def test_a_huge_body_is_unknown_not_parsed() -> None:
    line = 'lmcache_mp_lookup_requested_tokens_total{model_name="m"} 1\n'
    body = line * (MAX_METRICS_BYTES // len(line) + 1)
    assert parse_exposition(body) is None
    assert parse_exposition(line * 10) == {"lmcache_mp_lookup_requested_tokens_total": 10.0}


def test_random_bytes_never_raise() -> None:
    rng = random.Random(18)
    real = capture(2)
    for _ in range(300):
        cut = rng.randrange(len(real))
        noise = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))).decode("utf-8", errors="replace")
        body = real[:cut] + noise + real[cut:]
        got = lookup_counters(parse_exposition(body))
        assert got is None or isinstance(got, LookupCounters)
    # a hostile label (many escapes, no closing quote) is refused in linear time
    assert parse_exposition('m{a="' + "\\\\" * 200_000 + "} 1\n") is None


# ---------------------------------------------------------------- folding


def test_counter_delta_growth_and_restarts() -> None:
    a = LookupCounters(1000, 500, 400, 100, started="2026-01-01T00:00:00Z")
    grown = LookupCounters(1500, 700, 550, 150, started="2026-01-01T00:00:00Z")
    assert counter_delta(a, grown) == HitTotals(500, 200, 150, 50)
    assert counter_delta(None, grown) == HitTotals(1500, 700, 550, 150)  # a server never seen: all of it is new
    # Restarted: a counter went down, so what it shows is all new (no start time exported).
    down = LookupCounters(300, 200, 100, 100)
    assert counter_delta(LookupCounters(1000, 500, 400, 100), down) == HitTotals(300, 200, 100, 100)
    # Restarted and already past the old values: only the new start time tells.
    past = LookupCounters(2000, 900, 500, 400, started="2026-01-01T01:00:00Z")
    assert counter_delta(a, past) == HitTotals(2000, 900, 500, 400)


def tokens(t: HitTotals) -> tuple[int, int, int, int]:
    return t.lookup, t.hit, t.l1, t.l2


def test_fold_real_captures_across_a_server_restart() -> None:
    totals, base = fold_counters(HitTotals(), {}, {"s-0": counters_of(1)})
    assert tokens(totals) == (2048, 0, 0, 0)
    totals, base = fold_counters(totals, base, {"s-0": counters_of(2)})
    assert tokens(totals) == (5120, 2048, 2048, 0)
    # the server restarted: 3072 < 5120 and a new start time; its counts are all new
    totals, base = fold_counters(totals, base, {"s-0": counters_of(3)})
    assert tokens(totals) == (8192, 4096, 2048, 2048)
    assert (totals.l2_loads, totals.l1_loads) == (4, 4 + counters_of(2).l1_loads)  # the restore counts fold alike
    assert (percent(totals.hit, totals.lookup), percent(totals.l1, totals.lookup), percent(totals.l2, totals.lookup)) == (
        "50.0%", "25.0%", "25.0%")
    assert base == {"s-0": counters_of(3)}


def test_restart_detected_by_start_time_when_counters_grew_past_the_old_ones() -> None:
    # baseline: 2048 looked up; after a restart the new process has 3072. A fold that only looked
    # for a drop would add 1024.
    totals, base = fold_counters(HitTotals(), {}, {"s-0": counters_of(1)})
    totals, _ = fold_counters(totals, base, {"s-0": counters_of(3)})
    assert tokens(totals) == (2048 + 3072, 2048, 0, 2048)


def test_unknown_server_keeps_its_baseline_and_gone_servers_are_forgotten() -> None:
    c1, c2 = LookupCounters(100, 50, 50, 0), LookupCounters(400, 250, 200, 50)
    totals, base = fold_counters(HitTotals(), {}, {"s-0": c1, "s-1": LookupCounters(10, 0, 0, 0)})
    assert totals == HitTotals(110, 50, 50, 0)
    totals, base = fold_counters(totals, base, {"s-0": None, "s-1": LookupCounters(10, 0, 0, 0)})  # s-0 unreachable
    assert totals == HitTotals(110, 50, 50, 0) and base["s-0"] == c1
    totals, base = fold_counters(totals, base, {"s-0": c2})  # back: everything since c1 counts, once; s-1 gone
    assert totals == HitTotals(410, 250, 200, 50) and set(base) == {"s-0"}
    # an empty listing (no server running, or the spec unreadable) forgets nobody
    assert fold_counters(totals, base, {}) == (totals, base)


# ---------------------------------------------------------------- window


def test_window_from_samples() -> None:
    t = [(0.0, HitTotals(0, 0, 0, 0)), (100.0, HitTotals(1000, 500, 400, 100)), (200.0, HitTotals(3000, 2000, 1500, 500))]
    assert window_figures(t[:1], now=0.0) is None  # one sample: unknown, not zero
    w = window_figures(t, now=200.0)
    assert w is not None
    assert (w["seconds"], w["lookupTokens"], w["hitTokens"], w["hitTokensL1"], w["hitTokensL2"]) == (200, 3000, 2000, 1500, 500)
    assert (w["hitRate"], w["hitRateL1"], w["hitRateL2"]) == (0.6667, 0.5, 0.1667)
    assert (w["lookupTokensPerSecond"], w["hitTokensPerSecond"]) == (15, 10)
    # later: the window starts at the newest sample at least HIT_WINDOW_S old
    later = [*t, (400.0, HitTotals(3600, 2000, 1500, 500))]
    w = window_figures(later, now=400.0)
    assert w is not None and w["seconds"] == int(HIT_WINDOW_S)
    assert (w["lookupTokens"], w["hitTokens"], w["hitRate"]) == (2600, 1500, 0.5769)  # from t=100
    # nothing answered for longer than the window: unknown
    assert window_figures(later, now=400.0 + HIT_WINDOW_S + 1) is None


def test_restore_rates_per_tier_from_real_captures_and_the_window() -> None:
    """lmcache's load-throughput histograms: L2 -> L1 only where L2 served (capture 3, after the
    restart), L1 -> engine for every hit; the window's rate is its loads' mean, None without one."""
    l1_only, l2 = counters_of(2), counters_of(3)
    assert l1_only.l2_loads == 0 and l1_only.l1_loads > 0
    assert l2.l2_loads == 4 and l2.l2_gbps_sum == pytest.approx(3.788196966889448) and l2.l1_loads == 4
    samples = [(0.0, HitTotals()), (10.0, counter_delta(None, l2))]
    w = window_figures(samples, now=10.0)
    assert w is not None and w["restoresL2"] == 4 and w["restoreGbpsL2"] == round(3.788196966889448 / 4, 2)
    assert w["restoresL1"] == 4 and w["restoreGbpsL1"] == round(1.2820079721745947 / 4, 2)
    idle = window_figures([(0.0, HitTotals(10, 5, 5, 0)), (10.0, HitTotals(20, 5, 5, 0))], now=10.0)
    assert idle is not None and idle["restoreGbpsL2"] is None and idle["restoresL2"] == 0
    KVCacheNamespaceStatus.model_validate({"hits": {"window": w}})  # what the CRD takes
    # A garbled histogram leaves the rate unknown (zero loads), the lookup counters stand.
    garbled = lookup_counters({**parse_exposition(capture(3)), "lmcache_mp_l2_load_throughput_GB_per_second_count": -1.0})
    assert garbled is not None and garbled.l2_loads == 0 and garbled.requested == l2.requested
    # A server restart (counts back to zero) is a restart for these counters too.
    assert counter_delta(l2, counters_of(2)).l2_loads == 0


def _report(pod: str, c: LookupCounters | None) -> ServerReport:
    return ServerReport(pod, True, lookups=c)


def test_tracker_totals_window_and_operator_restart() -> None:
    tr = HitTracker()
    key, uid = ("ns", "a"), "uid-1"
    assert tr.observe(key, uid, None, [_report("s-0", None)], 0.0, "2026-01-01T00:00:00Z") is None  # nothing known yet
    first = tr.observe(key, uid, None, [_report("s-0", counters_of(1))], 10.0, "2026-01-01T00:00:10Z")
    assert first is not None
    assert first["window"] is None  # right after start: unknown, not zero
    assert (first["lookupTokens"], first["hitTokens"], first["hitRate"]) == (2048, 0, 0.0)
    assert first["summary"] == "0.0% (total)" and first["since"] == "2026-01-01T00:00:10Z"
    second = tr.observe(key, uid, first, [_report("s-0", counters_of(2))], 20.0, "2026-01-01T00:00:20Z")
    assert second is not None and second["window"] is not None
    assert (second["window"]["seconds"], second["window"]["lookupTokens"], second["window"]["hitTokensL1"]) == (10, 3072, 2048)
    assert second["window"]["hitRate"] == 0.6667 and second["summary"] == "66.7% (10s)"
    assert (second["lookupTokens"], second["hitTokens"], second["hitTokensL1"]) == (5120, 2048, 2048)
    assert second["servers"] == [{"pod": "s-0", "startedAt": "2026-11-30T07:04:42Z", "lookupTokens": 5120, "hitTokens": 2048,
                                  "hitTokensL1": 2048, "hitTokensL2": 0}]
    # The status the API server validates accepts it.
    KVCacheNamespaceStatus.model_validate({"hits": {k: v for k, v in second.items() if v is not None}})

    # The operator restarts: a new tracker continues from the stored status, without counting
    # again what the stored per-server counters already hold; the server restarted meanwhile.
    stored = {**second, "measuredAt": "2026-01-01T00:00:20Z"}
    tr2 = HitTracker()
    again = tr2.observe(key, uid, stored, [_report("s-0", counters_of(2))], 5.0, "2026-01-01T01:00:00Z")
    assert again is not None and again["window"] is None and again["summary"] == "40.0% (total)"
    assert (again["lookupTokens"], again["hitTokens"]) == (5120, 2048)  # nothing new, nothing counted twice
    after = tr2.observe(key, uid, stored, [_report("s-0", counters_of(3))], 15.0, "2026-01-01T01:00:10Z")
    assert after is not None
    assert (after["lookupTokens"], after["hitTokens"], after["hitTokensL1"], after["hitTokensL2"]) == (8192, 4096, 2048, 2048)
    assert (after["hitRateL1"], after["hitRateL2"]) == (0.25, 0.25)
    assert after["window"]["hitTokensL2"] == 2048 and after["since"] == "2026-01-01T00:00:10Z"
    # A resource deleted and created again under the same name starts from its own (empty) status.
    fresh = tr2.observe(key, "uid-2", None, [_report("s-0", counters_of(1))], 20.0, "2026-01-01T02:00:00Z")
    assert fresh is not None and fresh["lookupTokens"] == 2048


def test_idle_window_falls_back_to_the_total() -> None:
    tr = HitTracker()
    c = LookupCounters(1000, 600, 600, 0)
    for t in (0.0, 10.0):
        hits = tr.observe("k", "u", None, [_report("s-0", c)], t, "2026-01-01T00:00:00Z")
    assert hits is not None
    assert hits["window"]["lookupTokens"] == 0 and hits["window"]["hitRate"] is None
    assert hits["summary"] == "60.0% (total)"


# ---------------------------------------------------------------- fetch


@contextmanager
def serve(metrics: bytes) -> Iterator[int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(STATUS).encode() if self.path.endswith("/status") else metrics
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with in_thread(ThreadingHTTPServer(("127.0.0.1", 0), Handler)) as port:
        yield port


def test_fetch_reads_lookup_counters_and_refuses_garbage() -> None:
    with serve(capture(2).encode()) as port:
        rep = fetch_status("s-0", "127.0.0.1", port)
    assert rep.healthy and rep.lookups == counters_of(2)
    assert (rep.l2_writes_submitted, rep.l2_writes_failed) == (8, 0)
    for body in (b"<html>oops</html>", b"\xff\xfe\x00garbage", b"x" * (MAX_METRICS_BYTES + 10)):
        with serve(body) as port:
            rep = fetch_status("s-0", "127.0.0.1", port)
        assert rep.healthy and rep.lookups is None and rep.l2_writes_failed is None


# ---------------------------------------------------------------- chart


def test_chart_dashboard_and_podmonitor_match_what_the_servers_export() -> None:
    from kvpersist.api.v1alpha1 import KVCacheNamespace
    from kvpersist.builders.lmcache import agent_container
    from kvpersist.builders.target import SERVER, Target
    from kvpersist.status.usage import LOOKUP_HIT, LOOKUP_HIT_L1, LOOKUP_HIT_L2, LOOKUP_REQUESTED, RESTORE_L1, RESTORE_L2
    from tests.cases.invalid_manifests import sample

    chart = Path(__file__).resolve().parents[2] / "charts" / "kvpersist"
    dash = json.loads((chart / "files" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for name in (LOOKUP_REQUESTED, LOOKUP_HIT, LOOKUP_HIT_L1, LOOKUP_HIT_L2):
        assert name in exprs
        assert name in capture(2)  # and a real lmcache 0.5.6 exports it
    for name in (RESTORE_L2, RESTORE_L1):  # the restore rates, as status.hits.window has them
        assert f"rate({name}_sum{{" in exprs and f"rate({name}_count{{" in exprs
        assert f"{name}_sum{{" in capture(3) and f"{name}_count{{" in capture(3)
    podmonitor = (chart / "templates" / "lmcache-podmonitor.yaml").read_text()
    obj = sample("nvme-minimal")
    target = Target(obj["metadata"]["name"], "ns", KVCacheNamespace.model_validate(obj).spec, None)
    ports = {p["name"]: p["containerPort"] for p in agent_container(target, "img")["ports"]}
    # lmcache's admin API is loopback only: its /metrics is scraped through the agent's port.
    assert ports["agent"] == target.spec.lmcache_server.agent_port and "- port: agent\n" in podmonitor
    assert "path: /server/metrics\n" in podmonitor
    selector = target.selector(SERVER)
    for label in ("app.kubernetes.io/name", "app.kubernetes.io/component"):
        assert f"{label}: {selector[label]}\n" in podmonitor
