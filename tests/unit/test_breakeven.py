"""benchmarks/breakeven.py runs end to end in its quickest CPU mode within a small budget, and
its GPU plan builds on a machine without a GPU (--dry-run): the script is meant to be carried to
a GPU machine with minutes of time on it, so it must not fail there on something a CPU shows.

The quick run checks the JSON's shape and that what it reports was measured: positive rates, a
break-even row per shape, and an authenticated read that really decrypted the written bytes and
refused a flipped byte, another key and another frame version."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("cryptography")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "breakeven.py"


def _run(tmp_path: Path, *args: str, timeout: float = 150) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "breakeven.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out), "--dir", str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, json.loads(out.read_text())


def test_quick_cpu_run_measures_both_sides_and_checks_bytes(tmp_path: Path) -> None:
    proc, result = _run(tmp_path, "--device", "cpu", "--quick", "--budget-s", "30", "--contexts", "256")
    assert result["schema"] == "kvpersist-breakeven/1"
    assert result["dry_run"] is False
    facts = result["device"]
    assert facts["torch"] and facts["cpu_usable"] >= 1 and facts["disk"]["free_bytes"] > 0

    shapes = set(result["plan"]["shapes"])
    assert shapes == {"mini-8b", "mini-70b"}
    ok = [p for p in result["prefill"] if p["status"] == "ok"]
    assert {p["shape"] for p in ok} == shapes, result["prefill"]
    for p in ok:
        assert p["tokens_per_s"] > 0 and p["recompute_kv_gbps"] > 0 and p["median_s"] > 0
        assert len(p["times_s"]) >= 1 and p["warmup"] >= 1
        assert p["kv_bytes_per_token"] == result["plan"]["shapes"][p["shape"]]["kv_bytes_per_token"]

    disk = result["disk"]
    assert disk["write"]["files"] >= 1
    rates = disk["rates_gbps"]
    assert any(k.startswith("plain x") for k in rates) and any(k.startswith("auth x") for k in rates), rates
    assert all(v > 0 for v in rates.values())
    assert all(p["failures"] == 0 and p["header_mismatches"] == 0 for p in disk["passes"] if p["kind"] == "auth")
    assert all(p["cold"]["method"] == "fadvise" for p in disk["passes"])  # quick mode leaves others' page cache alone

    verify = disk["verify"]
    assert verify["decrypted_bytes_match"] is True and verify["all_files"] is True
    assert verify["files_verified"] == disk["write"]["files"] and verify["mismatched_files"] == 0
    assert verify["bytes_compared"] == verify["files_verified"] * disk["chunk_bytes"]
    assert verify["flipped_ciphertext_refused"] and verify["flipped_tag_refused"]
    assert verify["other_key_refused"] and verify["other_version_refused"] and verify["other_name_refused"]

    rows = result["breakeven"]
    assert {r["shape"] for r in rows} == shapes
    for r in rows:
        assert r["breakeven_l2_gbps"] > 0
        assert set(r["restore"]) == set(rates)
        for cell in r["restore"].values():
            assert cell["beats_recompute"] == (cell["gbps"] > r["breakeven_l2_gbps"])

    assert result["budget"]["used_s"] <= 30 + 10
    assert "break-even" in proc.stdout and "auth x1" in proc.stdout
    assert not list((tmp_path / "data").iterdir())  # the chunk files are removed


def test_gpu_plan_builds_without_a_gpu(tmp_path: Path) -> None:
    proc, result = _run(tmp_path, "--device", "cuda", "--dry-run", timeout=60)
    plan = result["plan"]
    assert result["dry_run"] is True and plan["device"] == "cuda" and plan["dtype"] == "bfloat16"
    assert plan["contexts"] == [4096, 8192, 16384, 32768]
    assert plan["shapes"]["llama-8b"]["kv_bytes_per_token"] == 128 * 1024
    assert plan["shapes"]["llama-70b"]["kv_bytes_per_token"] == 320 * 1024
    assert len(plan["prefill"]) == 8
    budget = plan["budget"]
    assert budget["total_s"] == 420
    assert budget["prefill_s"] + budget["disk_s"] + budget["reserve_s"] == pytest.approx(420, abs=0.2)
    assert plan["disk"]["chunk_bytes"] == 32 * 2**20 and plan["disk"]["files"] >= 1
    assert result["prefill"] == [] and result["disk"]["passes"] == []  # nothing measured
    assert "dry run" in proc.stdout
    assert not (tmp_path / "data").exists() or not list((tmp_path / "data").iterdir())
