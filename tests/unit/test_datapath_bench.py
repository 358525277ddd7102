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
