"""benchmarks/datapath_bench.py --clients: with several drivers at once, the L2 → L1 time is the
union of their lookups' intervals (the time during which at least one was in progress), not their
sum, and every sequence is read by exactly one driver."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from benchmarks import datapath_bench  # a namespace package: the repository's root is on the path


@pytest.mark.parametrize(("intervals", "union"), [
    ([], 0.0),
    ([(1.0, 3.0)], 2.0),
    ([(1.0, 2.0), (5.0, 7.0)], 3.0),  # apart: the sum
    ([(1.0, 4.0), (2.0, 6.0)], 5.0),  # overlapping: once
    ([(1.0, 10.0), (2.0, 3.0), (4.0, 5.0)], 9.0),  # inside another: nothing more
    ([(1.0, 2.0), (2.0, 3.0)], 2.0),  # touching
    ([(5.0, 8.0), (0.0, 1.0), (0.5, 6.0)], 8.0),  # in any order
])
def test_busy_s_is_the_length_of_the_union(intervals: list[tuple[float, float]], union: float) -> None:
    assert datapath_bench.busy_s(intervals) == pytest.approx(union)


def test_verify_with_two_clients_splits_the_sequences_and_merges_by_union(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    ids: list[str] = []

    def drive(mode: str, rpc: str, http: str, seqs: str, timeout: float, extra: tuple[str, ...]) -> dict[str, Any]:
        calls.append(seqs)
        ids.append(extra[extra.index("--instance-id") + 1])
        start, end = (int(x) for x in seqs.split(":"))
        # Both drivers begin at t=100: sequence k of each runs [100 + k, 100 + k + 0.5] (and its retrieve after).
        rows = [{"seq": s, "lookup_at": 100.0 + s - start, "lookup_ms": 500.0, "hit_chunks": 4,
                 "retrieve_at": 100.5 + s - start, "retrieve_ms": 250.0} for s in range(start, end)]
        return {"sequences": rows, "late_s": 0.0, "summary": {"hit_chunks": 4 * len(rows), "wrong_bytes": 0}}

    monkeypatch.setattr(datapath_bench, "drive_subprocess", drive)
    monkeypatch.setattr(datapath_bench, "START_MARGIN_S", 0.0)
    mode = SimpleNamespace(seqs=4, server=SimpleNamespace(rpc_url="tcp://x", http_url="http://x"))
    read = datapath_bench.verify(mode, 2)
    assert sorted(calls) == ["0:2", "2:4"]
    assert len(set(ids)) == 2  # each driver's KV under an id of its own, or retrieves land in the other's
    assert [r["seq"] for r in read["sequences"]] == [0, 1, 2, 3]
    assert read["summary"] == {"hit_chunks": 16, "wrong_bytes": 0}
    assert read["lookup_s"] == pytest.approx(1.0)  # two 0.5 s lookups at once, twice: not their sum, 2.0
    assert read["retrieve_s"] == pytest.approx(0.5)


def test_a_profile_is_summed_to_cpu_seconds_by_kind_and_thread() -> None:
    """--profile's server view: AES-GCM wherever it is in the stack, the rest by the leaf frame."""
    script = "\n\n".join([
        "  11     100000 \n\t aaa ossl_aes_gcm_decrypt_avx512 (_rust.abi3.so)\n\t bbb Py_Call (libpython3.11.so)",
        "  12     300000 \n\t ccc shmem_file_read_iter ([kernel.kallsyms])",
        "  12     200000 \n\t ddd _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)\n\t eee gcm_open (x.so)",
        "  13     400000 \n\t fff something_else (libfoo.so)",
        "  not a sample",
    ]) + "\n"
    text = datapath_bench.cpu_seconds(script)
    assert text.splitlines()[0] == "server CPU-seconds in the window: 0.001"
    lines = {line.split("%  ", 1)[1]: line.split()[0] for line in text.splitlines() if "%  " in line}
    assert lines == {"AES-GCM (the serde's open)": "0.000", "kernel copy of the file's pages (the adapter's reads)": "0.000",
                     "other": "0.000"}, text
    assert "busiest threads: 12 0.00 s, 13 0.00 s, 11 0.00 s" in text
    shares = [float(line.split("%")[0].split()[-1]) for line in text.splitlines() if "%  " in line]
    assert shares == [40.0, 30.0, 30.0], text  # 0.4 other; AES-GCM 0.1 + 0.2 (in the stack); the copy 0.3
