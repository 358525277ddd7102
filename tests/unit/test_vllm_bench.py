"""benchmarks/vllm_bench.py's tables say what each figure is (issue 41): cold is the median of
several prompts, a restart's first request is its own row with its tier, the repeats are apart,
and a run's JSON from before issue 41 still prints, with its published medians and without a
'first after restart' it never measured."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("zmq")  # the bench imports tests/e2e/test_real_vllm's helpers
pytest.importorskip("msgspec")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_bench", ROOT / "benchmarks" / "vllm_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("vllm_bench", module)
    spec.loader.exec_module(module)
    return module


def req(ttft: float, l1: int = 0, l2: int = 0, tokens: int = 6215) -> dict:
    return {"ttft_s": ttft, "tokens": tokens, "from_cache": l1 + l2, "l1": l1, "l2": l2}


def restart(first: dict, repeats: list[float], ready_s: float, settle_s: float) -> dict:
    """A restart case as after_restart() records it."""
    rest = [req(x, l1=6144) for x in repeats]
    return {"first": {**first, "background_cpu": 0.1, "settle_s": settle_s}, "repeats": rest, "ttft_first_s": first["ttft_s"],
            "ttft_repeats_s": sorted(repeats)[len(repeats) // 2], "background_cpu": 0.1, "prompt_tokens": 6215,
            "from_cache": first["from_cache"], "computed": 6215 - first["from_cache"], "delete_to_ready_s": ready_s,
            "settle_s": settle_s, "delete_to_first_token_s": round(ready_s + settle_s + first["ttft_s"], 2), "ready": {}}


def run(bench: ModuleType) -> dict:
    cold = [req(4.0, tokens=6215), req(3.0, tokens=6230), req(5.0, tokens=6190)]
    return {"format": bench.FORMAT, "run": {}, "cases": {
        "cold": {"ttft_s": 4.0, "prompt_tokens": 6215, "from_cache": 0, "computed": 6215, "requests": cold},
        "vLLM restarted": restart(req(1.2, l1=6144), [0.5, 0.6, 0.7], 40.0, 2.0),
        "server restarted": restart(req(1.5, l2=6144), [0.6, 0.6, 0.8], 25.0, 3.0),
    }}


def row(lines: list[str], table: str, case: str) -> str:
    """The line of `case` in the table whose title starts with `table`."""
    start = next(i for i, line in enumerate(lines) if line.startswith(table))
    return next(line for line in lines[start:] if line.startswith(case))


def test_cold_is_the_median_of_its_prompts_and_says_each(bench: ModuleType) -> None:
    lines = bench.summary(run(bench), "test")
    line = next(x for x in lines if x.startswith("cold:"))
    assert "3 distinct prompts" in line and "median 4.000 s" in line and "4.000, 3.000, 5.000" in line


def test_the_first_request_after_a_restart_is_its_own_row_with_its_tier(bench: ModuleType) -> None:
    lines = bench.summary(run(bench), "test")
    header = next(x for x in lines if x.startswith("case") and "delete->ready s" in x)
    assert "delete->1st token s" in header and "settle s" in header
    server = row(lines, "first request", "server restarted").split()
    assert server[2:4] == ["1.500", "0.38"]  # its TTFT, and against cold's median (4.0)
    assert server[-4:] == ["L1", "0,", "L2", "6144"]
    assert server[-7:-4] == ["25.0", "3.0", "29.5"]  # delete->ready, settle, delete->first token
    vllm = row(lines, "repeats", "vLLM restarted").split()
    assert vllm[2:4] == ["3", "0.600"]  # the repeats' own median, apart from the first request


def test_a_first_request_that_nothing_served_says_so(bench: ModuleType) -> None:
    data = run(bench)
    data["cases"]["server restarted"] = restart(req(4.1), [0.6, 0.6, 0.8], 25.0, 3.0)
    assert row(bench.summary(data, "test"), "first request", "server restarted").endswith("none (computed)")


def test_restart_cases_are_compared_on_their_repeats(bench: ModuleType) -> None:
    lines = bench.summary(run(bench), "test")
    assert "worst restart case / best: 1.00" in "\n".join(lines)
    h, df, p = bench.kruskal_wallis({"a": [1.0, 2.0, 3.0], "b": [1.5, 2.5, 3.5]})
    assert df == 1 and 0 <= h < 1 and p > 0.5


def test_a_run_from_before_issue_41_still_prints_with_its_published_medians(bench: ModuleType) -> None:
    """docs/measurements' run (RESULTS.md: both first, 6 repeats): 1.23x worst/best, H 1.33, p 0.86."""
    old = json.loads((ROOT / "docs" / "measurements" / "vllm-restarts-2026-12-01-both-first-6.json").read_text())
    text = "\n".join(lines := bench.summary(old, "old"))
    assert "from before issue 41" in text and "worst restart case / best: 1.23" in text and "H 1.33, df 4, p 0.86" in text
    assert row(lines, "first request", "server restarted #1").split()[3] == "-"  # never measured then
    assert row(lines, "first request", "vLLM restarted").split()[2] == "1.036"  # it was, then
    assert row(lines, "repeats", "server restarted #1").split()[3:5] == ["6", "0.733"]
