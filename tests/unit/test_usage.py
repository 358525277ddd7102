"""Parsing lmcache 0.5.6's /status (a response captured from the real server after 8 stores)."""

from __future__ import annotations

import json
from pathlib import Path

from kvpersist.status.usage import (
    LMCacheStatus,
    WriteFailureTracker,
    collect_usage,
    human_bytes,
    parse_exposition,
    report_of,
    summarize,
    with_write_failures,
)

CAPTURED = json.loads((Path(__file__).parent / "data" / "lmcache-0.5.6-status-nixl-8-objects.json").read_text())
MODEL = LMCacheStatus.model_validate(CAPTURED)


def test_parse_real_status() -> None:
    rep = report_of("s-0", MODEL)
    assert rep.healthy and rep.message == ""
    assert (rep.l1_used, rep.l1_capacity) == (4194304, 536870912)
    assert (rep.l2_used, rep.l2_capacity, rep.l2_objects) == (4194304, 1073741824, 8)
    assert rep.l2_healthy is True


def test_unhealthy_adapter_is_reported() -> None:
    bad = json.loads(json.dumps(CAPTURED))
    bad["storage_manager"]["l2_adapters"][0]["is_healthy"] = False
    rep = report_of("s-0", LMCacheStatus.model_validate(bad))
    assert not rep.healthy and rep.l2_healthy is False and "DynamicNixlStoreL2Adapter" in rep.message


def test_summarize_sums_servers() -> None:
    reps = [report_of("s-0", MODEL), report_of("s-1", MODEL)]
    usage = summarize(reps, measured_at="2026-11-30T00:00:00Z")
    assert usage["l1UsedBytes"] == 2 * 4194304 and usage["l2Objects"] == 16
    assert usage["l1Used"] == "8Mi/1Gi" and usage["l2Used"] == "8Mi/2Gi"


def test_unreachable_server_is_unhealthy_with_reason() -> None:
    # Port 9 on loopback: nothing listens; the answer must come back quickly and say why.
    [rep] = collect_usage([("s-0", "127.0.0.1")], port=9, timeout=1.0)
    assert not rep.healthy and "unreachable" in rep.message
    [none] = collect_usage([("s-1", None)], port=9)
    assert not none.healthy and "no IP" in none.message


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (None, 512, 2048, 1536 * 2**20, 2**40)] == [None, "512B", "2Ki", "1.5Gi", "1Ti"]


METRICS = """# HELP lmcache_mp_l2_store_submitted_objects_chunks_total objects submitted
# TYPE lmcache_mp_l2_store_submitted_objects_chunks_total counter
lmcache_mp_l2_store_submitted_objects_chunks_total 32.0
lmcache_mp_l2_store_completed_objects_chunks_total 8.0
lmcache_mp_l2_store_completed_requests_total{l2_name="nixl_store_dynamic"} 16.0
lmcache_mp_l2_usage_bytes{l2_name="nixl_store_dynamic"} 4.194304e+06
"""


def test_parse_metrics_and_failed_writes() -> None:
    # The counters as a real lmcache 0.5.6 server showed them after filling a 4 MiB volume.
    metrics = parse_exposition(METRICS) or {}
    assert (metrics["lmcache_mp_l2_store_submitted_objects_chunks_total"],
            metrics["lmcache_mp_l2_store_completed_objects_chunks_total"]) == (32.0, 8.0)
    rep = with_write_failures(report_of("s-0", MODEL), MODEL, metrics)
    assert (rep.l2_writes_failed, rep.l2_writes_submitted) == (24, 32)
    assert with_write_failures(report_of("s-0", MODEL), MODEL, {}).l2_writes_failed is None


# A real lmcache 0.5.6 server's L2 store counters after 8 chunks whose every upload the bucket refused
# (tests/integration/test_hfbucket_datapath.py's stand-in, every addFile failed): the completed-objects
# counter has no sample at all until a first chunk lands.
METRICS_EVERY_WRITE_FAILED = """lmcache_mp_l2_store_submitted_requests_total 4.0
lmcache_mp_l2_store_submitted_objects_chunks_total 8.0
lmcache_mp_l2_store_completed_requests_total{l2_name="hfbucket"} 4.0
lmcache_mp_l2_store_adapters{l1_tag="_default",state="active"} 1.0
"""


def test_every_write_failed_counts_as_failed_writes() -> None:
    metrics = parse_exposition(METRICS_EVERY_WRITE_FAILED) or {}
    assert metrics["lmcache_mp_l2_store_submitted_objects_chunks_total"] == 8.0
    assert "lmcache_mp_l2_store_completed_objects_chunks_total" not in metrics
    rep = with_write_failures(report_of("s-0", MODEL), MODEL, metrics)
    assert (rep.l2_writes_failed, rep.l2_writes_submitted) == (8, 8)
    # A completed counter that is there but not a counter still leaves the report alone.
    bad = {**metrics, "lmcache_mp_l2_store_completed_objects_chunks_total": -1.0}
    assert with_write_failures(report_of("s-0", MODEL), MODEL, bad).l2_writes_failed is None


def test_write_failure_tracker_flags_growth_then_forgets() -> None:
    t = WriteFailureTracker(hold_s=60)
    assert not t.failing("p", 0, now=0)
    assert t.failing("p", 5, now=10)  # grew
    assert t.failing("p", 5, now=60)  # within hold
    assert not t.failing("p", 5, now=71)  # quiet for longer than hold
    assert t.failing("p", 6, now=80)  # grew again
    assert not t.failing("p", 0, now=90)  # server restarted, no failures since
    assert not t.failing("p", None, now=100)
