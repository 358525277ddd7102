"""benchmarks/gpu_run.py, the one command run on a lent GPU machine, runs end to end on the CPU in
its dry mode (issue 41 item 4): the real lmcache server's L2 path (datapath_bench.py --json), the
break-even (breakeven.py --device cpu --quick) fed with that server's measured rate, the vLLM
step's detection, one gpu_run.json holding them all, and its Markdown tables. A GPU lease is
minutes long: what a CPU can show breaking must not break there.

About 90 s on 2 cores (most of it the two lmcache server starts of the datapath step)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import LMCACHE

pytestmark = pytest.mark.datapath

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_run.py"


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_dry_run_measures_every_step_and_prints_the_tables(tmp_path: Path) -> None:
    if LMCACHE is None:
        pytest.fail("lmcache not on PATH: run through hack/test.sh (installs the datapath extra)")
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--out", str(out), "--work", str(work)],
                          capture_output=True, text=True, timeout=500, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    run = json.loads((out / "gpu_run.json").read_text())
    assert run["schema"] == "kvpersist-gpu-run/1" and run["dry"] is True
    assert run["stopped_early"] is False and 0 < run["used_s"] <= run["budget_s"]
    facts = run["machine"]
    assert facts["cpu_count"] >= 1 and facts["packages"]["lmcache"] and facts["torch"]["torch"]
    assert facts["torch"]["cuda_available"] is False  # CI: no GPU, so the CPU stand-ins ran
    steps = run["steps"]
    assert list(steps) == ["datapath", "breakeven", "vllm_ttft"]
    assert all(s.get("leftover_processes_killed", 0) == 0 for s in steps.values()), steps  # each step stopped its own

    # (a) The real server stored, was killed, restarted and read everything back, with the right bytes.
    dp = steps["datapath"]
    assert dp["status"] == "ok", dp
    assert dp["result"]["schema"] == "kvpersist-datapath/2" and (out / dp["json"]).exists()
    modes = [m for r in dp["result"]["runs"] for m in r["modes"]]
    assert [m["name"] for m in modes] == ["aesgcm"]
    for m in modes:
        assert m["hit_chunks"] == m["chunks"] > 0 and m["wrong_bytes"] == 0
        assert _positive(m["l2_to_l1_gbps"]) and _positive(m["end_to_end_gbps"]) and _positive(m["first_hit_ms"])

    # (b) The break-even composed that server's measured rate (a CPU stand-in: no host -> GPU step).
    be = steps["breakeven"]
    assert be["status"] == "ok", be
    assert "--datapath-json" in be["command"] and "lmcache server" in be["l2_to_l1_from"]
    result = be["result"]
    path = result["restore_path"]
    assert "lmcache server" in path["l2_to_l1_from"] and path["h2d"]["cpu_stand_in"] is True
    assert {s["label"]: s["l2_to_l1_gbps"] for s in path["sources"]} == {"server aesgcm": modes[0]["l2_to_l1_gbps"]}
    ok = [p for p in result["prefill"] if p["status"] == "ok"]
    assert {p["shape"] for p in ok} == {"mini-8b", "mini-70b"}
    assert all(_positive(p["tokens_per_s"]) and _positive(p["recompute_kv_gbps"]) for p in ok)
    assert {r["shape"] for r in result["breakeven"]} == {"mini-8b", "mini-70b"}
    for r in result["breakeven"]:
        cell = r["restore"]["server aesgcm"]
        assert _positive(r["breakeven_gbps"]) and _positive(cell["serial_gbps"]) and _positive(cell["ratio"])
        assert cell["beats_recompute"] == (cell["serial_gbps"] > r["breakeven_gbps"])
    assert all(_positive(v) for v in result["disk"]["rates_gbps"].values()) and result["disk"]["rates_gbps"]

    # (c) No CUDA here: detected and skipped, with why.
    ttft = steps["vllm_ttft"]
    assert ttft["status"] == "skipped" and ttft["skipped"]

    assert not work.exists() or not list(work.iterdir())  # the L2 and chunk files are removed
    assert {p.name for p in out.iterdir()} <= {"gpu_run.json", "datapath.json", "datapath.log", "breakeven.json",
                                              "breakeven.log", "tables.md"}  # what a GPU lease brings back (8 files at most)

    shown = subprocess.run([sys.executable, str(SCRIPT), "--tables", str(out / "gpu_run.json")],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert shown == (out / "tables.md").read_text()
    assert "| shape | tokens | break-even (GB/s) | server aesgcm: restore GB/s (x break-even): beats recompute |" in shown
    assert "| mini-70b | 256 |" in shown and "| 0.25 | aesgcm | " in shown and "Dry run on the CPU" in shown
    assert f"TTFT with real vLLM: skipped: {ttft['skipped']}" in shown
