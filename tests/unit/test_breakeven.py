"""benchmarks/breakeven.py runs end to end in its quickest CPU mode within a small budget, and
its GPU plan builds on a machine without a GPU (--dry-run): the script is meant to be carried to
a GPU machine with minutes of time on it, so it must not fail there on something a CPU shows.

The quick run checks the JSON's shape and that what it reports was measured: positive rates, a
break-even row per shape, and an authenticated read that really decrypted the written bytes and
refused a flipped byte, another key and another frame version. The verdict's arithmetic (the
restore path composed of the server's L2 -> L1 rate and the host -> GPU copy, issue 41) is checked
on fixed numbers, as a GPU run would feed it."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("cryptography")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "breakeven.py"


def _module(script: Path = SCRIPT) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{script.stem}_under_test", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _datapath_json(path: Path, modes: list[dict[str, Any]], schema: str = "kvpersist-datapath/2") -> Path:
    """A file of datapath_bench.py --json's shape (its fields that the verdict reads)."""
    path.write_text(json.dumps({"schema": schema, "runs": [{
        "size_gb": 1.0, "dir": "/x", "direct_io": True, "workers": 2,
        "baseline": {"fio_gbps": None, "fio_note": "not installed", "threaded_read_gbps": 2.0, "read_threads": 2},
        "aesgcm_gbps_per_core": 2.0, "modes": modes}]}))
    return path


def _mode(name: str, gbps: float, hit: int = 8, wrong: int = 0) -> dict[str, Any]:
    return {"name": name, "l2_to_l1_gbps": gbps, "end_to_end_gbps": gbps / 2, "first_hit_ms": 300.0, "chunks": 8,
            "hit_chunks": hit, "wrong_bytes": wrong}


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

    # No --datapath-json: the verdict composes this script's own best reads, labelled so, and on a
    # CPU no host -> GPU step (a stand-in verdict that says so).
    path = result["restore_path"]
    assert "own file reads" in path["l2_to_l1_from"] and path["h2d"]["gbps"] is None and path["h2d"]["cpu_stand_in"]
    best = {kind: max(v for k, v in rates.items() if k.startswith(kind + " x")) for kind in ("auth", "plain")}
    labelled = {s["label"].split(" x")[0]: s["l2_to_l1_gbps"] for s in path["sources"]}
    assert labelled == {"own auth": best["auth"], "own plain": best["plain"]}
    rows = result["breakeven"]
    assert {r["shape"] for r in rows} == shapes
    for r in rows:
        assert r["breakeven_gbps"] > 0 and r["cpu_stand_in"] is True
        assert set(r["restore"]) == {s["label"] for s in path["sources"]}
        for cell in r["restore"].values():
            assert cell["h2d_gbps"] is None and cell["serial_gbps"] == cell["l2_to_l1_gbps"] > 0
            assert cell["beats_recompute"] == (cell["serial_gbps"] > r["breakeven_gbps"])

    assert result["budget"]["used_s"] <= 30 + 10
    assert "break-even" in proc.stdout and "auth x1" in proc.stdout and "CPU stand-in" in proc.stdout
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
    assert result["breakeven"] == [] and result["restore_path"]["h2d"]["status"] == "missing"  # no verdict without H2D
    assert "dry run" in proc.stdout
    assert not (tmp_path / "data").exists() or not list((tmp_path / "data").iterdir())


def test_verdict_composes_server_rate_and_h2d(tmp_path: Path) -> None:
    """On a GPU the restore path is the server's L2 -> L1 then the host -> GPU copy, one after the
    other: a hit that the L2 read alone would win can lose once the copy is added; a mode whose
    read missed chunks or returned wrong bytes is left out of the verdict, and said so."""
    be = _module()
    datapath = be.load_datapath(str(_datapath_json(tmp_path / "dp.json", [
        _mode("aesgcm", 1.0), _mode("plain", 4.0), _mode("short", 9.0, hit=7), _mode("wrong", 9.0, wrong=5)])))
    assert [s["label"] for s in datapath["sources"] if s["usable"]] == ["server aesgcm", "server plain"]
    out = {"plan": {"device": "cuda"}, "datapath": datapath, "h2d": {"status": "ok", "gbps": 4.0},
           "disk": {"rates_gbps": {"auth x4": 50.0}},
           "prefill": [{"status": "ok", "shape": "llama-8b", "tokens": 4096, "tokens_per_s": 1.0, "recompute_kv_gbps": 0.9},
                       {"status": "oom", "shape": "llama-70b", "tokens": 4096}]}
    rows = be.breakeven_rows(out)
    assert len(rows) == 1 and rows[0]["breakeven_gbps"] == 0.9 and rows[0]["cpu_stand_in"] is False
    aes, plain = rows[0]["restore"]["server aesgcm"], rows[0]["restore"]["server plain"]
    assert set(rows[0]["restore"]) == {"server aesgcm", "server plain"}  # not the own read, nor the unusable modes
    assert aes["serial_gbps"] == pytest.approx(1 / (1 / 1.0 + 1 / 4.0)) == pytest.approx(0.8)
    assert aes["beats_recompute"] is False and aes["ratio"] == pytest.approx(0.8 / 0.9)
    assert aes["pipelined_gbps_est"] == 1.0 and aes["pipelined_beats_recompute_est"] is True  # the read alone would win
    assert plain["serial_gbps"] == pytest.approx(2.0) and plain["beats_recompute"] is True
    path = be.restore_path(out)
    assert "lmcache server" in path["l2_to_l1_from"] and path["h2d"]["gbps"] == 4.0
    assert sorted(s["label"] for s in path["unused"]) == ["server short", "server wrong"]
    assert all(s["note"].startswith("not used") for s in path["unused"])

    # The host -> GPU copy not measured on a GPU: no verdict rather than the read alone.
    missing = be.breakeven_rows({**out, "h2d": {"status": "skipped", "reason": "time budget"}})
    assert all(c["beats_recompute"] is None and math.isclose(c["serial_gbps"], c["l2_to_l1_gbps"])
               for c in missing[0]["restore"].values())
    assert "time budget" in be.h2d_part({**out, "h2d": {"status": "skipped", "reason": "time budget"}})["note"]


def test_a_read_after_a_failed_cache_drop_is_unusable_for_the_verdict(tmp_path: Path) -> None:
    """A pass whose files were still in memory (or whose drop failed where residency is unknown) is
    no read from the device: it is left out of the rates; a server mode with no valid trial is unusable."""
    be = _module()
    cold = {"resident_fraction": 0.0, "drop_caches": "failed: EPERM", "fadvise": "ok"}
    assert be.cold_read({"cold": cold})
    assert not be.cold_read({"cold": {**cold, "resident_fraction": 0.9}})
    assert not be.cold_read({"cold": {"resident_fraction": None, "drop_caches": "failed: EPERM", "fadvise": "failed: x"}})
    assert be.cold_read({"cold": {"resident_fraction": None, "drop_caches": "ok", "fadvise": None}})
    invalid = {**_mode("plain", 9.0), "valid_trials": 0}
    del invalid["l2_to_l1_gbps"]
    datapath = be.load_datapath(str(_datapath_json(tmp_path / "dp.json", [_mode("aesgcm", 1.0), invalid])))
    unusable = [s for s in datapath["sources"] if not s["usable"]]
    assert [s["mode"] for s in unusable] == ["plain"] and "page cache drop failed" in unusable[0]["note"]
    own = {"plan": {"device": "cpu"}, "disk": {"rates_gbps": {}, "warm_passes": 2}, "prefill": []}
    assert be.restore_path(own)["sources"] == [] and "failed page cache drop" in be.restore_path(own)["unused"][0]["note"]


def _gpu_shaped_out(tmp_path: Path, be: ModuleType) -> dict[str, Any]:
    """breakeven's JSON as a GPU run with the server's rates would write it (fixed numbers)."""
    datapath = be.load_datapath(str(_datapath_json(tmp_path / "dp.json", [_mode("aesgcm", 1.0), _mode("plain", 4.0)])))
    prefill = {"status": "ok", "shape": "llama-8b", "tokens": 4096, "tokens_per_s": 1.0, "recompute_kv_gbps": 0.9,
               "layers_measured": 2, "full_layers": 32, "dtype": "bfloat16", "attention": "CUDNN_ATTENTION (native GQA)",
               "full_model_s": 0.5, "flop_based_tflops": 500.0}
    out = {"schema": "kvpersist-breakeven/1", "plan": {"device": "cuda"}, "datapath": datapath, "h2d": {"status": "ok", "gbps": 4.0},
           "disk": {"rates_gbps": {"auth x16": 3.0}}, "prefill": [prefill]}
    return {**out, "breakeven": be.breakeven_rows(out), "restore_path": be.restore_path(out)}


def test_gpu_run_tables_of_a_gpu_run(tmp_path: Path) -> None:
    """What only a GPU run renders (the host -> GPU part, the serial verdict and its pipelined
    estimate beside it) comes out of gpu_run.py --tables right, on numbers a CPU can check."""
    be, gr = _module(), _module(ROOT / "benchmarks" / "gpu_run.py")
    run = {"schema": "kvpersist-gpu-run/1", "started": "t", "argv": ["--out", "x"], "dry": False, "budget_s": 540, "used_s": 400,
           "machine": {"nvidia_smi": {"gpus": [{"name": "NVIDIA H200", "memory": "143771 MiB", "driver": "580"}]},
                       "cpu_count": 16, "cpu_usable": 16, "torch": {"torch": "2.11.0", "cuda_available": True}, "packages": {}},
           "steps": {"datapath": {"status": "skipped", "skipped": "lmcache is not installed"},
                     "breakeven": {"status": "ok", "seconds": 300, "result": _gpu_shaped_out(tmp_path, be)},
                     "vllm_ttft": {"status": "skipped", "skipped": "vLLM is not installed"}}}
    text = gr.tables(run)
    assert "Dry run" not in text and "NVIDIA H200 (143771 MiB, driver 580)" in text
    assert "| host → GPU | 4.00 | pinned host -> GPU copy, measured on this GPU |" in text
    assert "bytes / (bytes / L2 → L1 + bytes / host → GPU), serial" in text and "pipelined (est.)" in text
    # serial: aesgcm 1/(1/1 + 1/4) = 0.8 < 0.9, loses; plain 1/(1/4 + 1/4) = 2.0 wins; pipelined: min(L2, H2D)
    assert "| llama-8b | 4096 | 0.9 | 0.8 (0.889x): no | 1.00: **yes** | 2.00 (2.22x): **yes** | 4.00: **yes** |" in text
    assert "| datapath | skipped | — | — | lmcache is not installed |" in text
    assert "TTFT with real vLLM: skipped: vLLM is not installed" in text


def test_datapath_json_of_another_schema_is_refused(tmp_path: Path) -> None:
    be = _module()
    with pytest.raises(ValueError, match="schema"):
        be.load_datapath(str(_datapath_json(tmp_path / "dp.json", [_mode("plain", 1.0)], schema="something-else/1")))
    bad = _datapath_json(tmp_path / "bad.json", [_mode("plain", 1.0)], schema="other/1")
    assert be.main(["--device", "cpu", "--quick", "--dry-run", "--datapath-json", str(bad), "--json", str(tmp_path / "o.json")]) == 2
    assert not (tmp_path / "o.json").exists()
