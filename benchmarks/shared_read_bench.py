#!/usr/bin/env python3
"""A shared L2 folder's read rate (spec.l2.nvme.shared): two lmcache servers reading the same
KV from one folder at once, against one server alone.

Real lmcache 0.5.6 on the CPU, both servers started with the args the operator renders for a
shared resource (nixl_store_dynamic, POSIX, O_DIRECT, encrypted unless --plain), one folder, one key, as the servers
of two nodes over one ReadWriteMany claim. The KV (benchmarks/datapath_bench.py's 32 MiB chunks)
is stored once by one server. Then each trial reads all of it cold from L2, first with one fresh
server, then with two fresh servers at once (their drivers begin at the same instant: kvdriver
--start-at) and look every chunk up back to back (lmcache loads an L2 hit into L1 at lookup; the
driver's `lookup` mode, which checks no bytes: tests/integration/test_shared_folder.py does). Fresh
servers, since a chunk read from L2 stays in the reader's L1. A rate is the KV bytes over the
lookups' time (L2 -> L1, decryption included), per server; "together" is the sum of the two
servers' bytes over the longer of their two read spans.

    <venv>/bin/python benchmarks/shared_read_bench.py --size-gb 0.5 --trials 2

Here both "nodes" share one machine's disk and CPUs: two readers compete for the same cores
(decryption is CPU-bound), so this is a floor for two real nodes on a shared filesystem, whose
own read rate is what the operator cannot measure from here.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from datapath_bench import (
    CHUNK_BYTES,
    CHUNKS_PER_SEQ,
    EXTRA,
    SHAPE_PINS,
    chunk_files,
    drop_caches,
    store_all,
)
from tests.integration.conftest import LocalServer, make_target, write_key
from tests.integration.kvdriver import drive_subprocess

START_MARGIN_S = 40.0  # each driver imports torch and lmcache before its first request
LATE_S = 1.0  # a pair whose second reader began later than this did not read together: left out


def servers(root: Path, size_gb: float, l1_gb: float, encrypted: bool, count: int, tag: str) -> list[LocalServer]:
    """count servers of one shared resource on root/volume (free ports each, one key)."""
    key = write_key(root / "key") if encrypted else None
    out = []
    for i in range(count):
        target = make_target(l1_gb=l1_gb, capacity_gb=size_gb * 1.25 + 1, encrypted=encrypted, nvme={"shared": True},
                             **SHAPE_PINS)
        out.append(LocalServer(target, root / "volume", root / f"server-{tag}-{i}.log", key))
    return out


def store(root: Path, size_gb: float, l1_gb: float, encrypted: bool) -> tuple[int, int]:
    """(sequences, bytes on disk) of the KV one server stored into the shared folder."""
    (root / "volume").mkdir(parents=True, exist_ok=True)
    srv = servers(root, size_gb, l1_gb, encrypted, 1, "store")[0]
    seqs = int(size_gb * 2**30 // CHUNK_BYTES) // CHUNKS_PER_SEQ
    srv.start()
    try:
        store_all(srv, seqs, "shared folder")
    finally:
        srv.stop(signal.SIGKILL)
    return seqs, sum(p.stat().st_size for p in chunk_files(srv.l2_dir))


def read_at_once(group: list[LocalServer], seqs: int) -> list[dict[str, Any]]:
    """Every server of group reads all seqs, beginning together; their drivers' JSON."""
    for srv in group:
        srv.start()
    drop_caches()
    start_at = time.time() + START_MARGIN_S
    results: list[dict[str, Any] | None] = [None] * len(group)

    def one(i: int) -> None:
        results[i] = drive_subprocess("lookup", group[i].rpc_url, group[i].http_url, f"0:{seqs}", timeout=1800,
                                      extra=(*EXTRA, "--start-at", str(start_at)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(group))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(1800)
    finally:
        for srv in group:
            srv.stop(signal.SIGKILL)
    if any(r is None for r in results):
        raise SystemExit("a reader did not finish")
    return [r for r in results if r is not None]


def rates(results: list[dict[str, Any]], l2_bytes: int) -> tuple[list[float], float, int, int, float]:
    """(per server GB/s over its lookups, together GB/s over the longest span, chunks hit, lookup
    errors, latest start in s)."""
    per = [l2_bytes / (sum(r["lookup_ms"] for r in res["sequences"]) / 1000) / 1e9 for res in results]
    together = l2_bytes * len(results) / max(res["wall_s"] for res in results) / 1e9
    hit = min(res["summary"]["hit_chunks"] for res in results)
    wrong = sum(res["summary"]["lookup_errors"] for res in results)
    return per, together, hit, wrong, max(res.get("late_s", 0.0) for res in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=0.5)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--l1-gb", type=float, default=1.5, help="each server's L1: the read KV stays there")
    parser.add_argument("--plain", action="store_true", help="spec.l2.encryption off")
    parser.add_argument("--dir", default=None, help="where the shared folder goes (default: a temp dir on /var/tmp)")
    args = parser.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvpersist-shared-bench-", dir="/var/tmp"))
    encrypted = not args.plain
    try:
        seqs, l2_bytes = store(root, args.size_gb, args.l1_gb, encrypted)
        chunks = seqs * CHUNKS_PER_SEQ
        rows = []
        for i in range(args.trials):
            alone = rates(read_at_once(servers(root, args.size_gb, args.l1_gb, encrypted, 1, f"alone-{i}"), seqs), l2_bytes)
            pair = rates(read_at_once(servers(root, args.size_gb, args.l1_gb, encrypted, 2, f"pair-{i}"), seqs), l2_bytes)
            if pair[4] <= LATE_S:
                rows.append((alone, pair))
            print(f"trial {i + 1}: one server {alone[0][0]:.2f} GB/s; two at once {pair[0][0]:.2f} + {pair[0][1]:.2f} GB/s "
                  f"(together {pair[1]:.2f} GB/s over the longer span); hits {alone[2]}/{chunks}, {pair[2]}/{chunks}; "
                  f"late start {pair[4]:.1f} s{' (left out: they did not read together)' if pair[4] > LATE_S else ''}",
                  flush=True)
        if not rows:
            raise SystemExit("no trial read together: a reader began late every time (a loaded machine)")
        med = statistics.median
        print(f"\n{l2_bytes / 1e9:.2f} GB in {chunks} chunks, {'encrypted' if encrypted else 'plain'}, "
              f"{len(rows)} of {args.trials} trials read together (medians)\n")
        print("| readers | per server L2 -> L1 (GB/s) | together (GB/s) | chunks hit | lookup errors |")
        print("| --- | --- | --- | --- | --- |")
        print(f"| one server | {med([a[0][0] for a, _ in rows]):.2f} | {med([a[1] for a, _ in rows]):.2f} | "
              f"{min(a[2] for a, _ in rows)}/{chunks} | {sum(a[3] for a, _ in rows)} |")
        print(f"| two servers at once | {med([x for _, p in rows for x in p[0]]):.2f} | {med([p[1] for _, p in rows]):.2f} | "
              f"{min(p[2] for _, p in rows)}/{chunks} | {sum(p[3] for _, p in rows)} |")
        print(f"\npage cache dropped before each read: {drop_caches()}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
