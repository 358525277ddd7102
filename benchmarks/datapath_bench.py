#!/usr/bin/env python3
"""Data path: time from an lmcache server restart to its first L2 hit, and L2 read throughput
for 1 GB and 4 GB of stored KV, against a plain sequential read of the same files.

Real lmcache 0.5.6 on the CPU, started with the args the operator renders (nixl_store_dynamic,
POSIX), on a folder of this machine's disk. KV is driven with lmcache's own bench client
(tests/integration/kvdriver.py) in chunks of 32 MiB (a 32-layer, 8-KV-head, 128-dim fp16
model's 256-token chunk). Page cache is dropped before each cold read (needs root).

With spec.l2.encryption on (the default) and off, so the cost of authenticated encryption shows.

    .venv/bin/python benchmarks/datapath_bench.py --sizes-gb 1,4 [--l2 aesgcm,plain]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.conftest import LocalServer, make_target, write_key
from tests.integration.kvdriver import drive_subprocess

SHAPE = "(2,64,16,8,128):float16:32"  # 128 KiB per token, 32 MiB per 256-token chunk
CHUNK_BYTES = 32 * 2**20
TOKENS_PER_SEQ = 1024  # 4 chunks per request
CHUNKS_PER_SEQ = TOKENS_PER_SEQ // 256
BATCH_SEQS = 2  # 8 chunks, 256 MiB: with their serde copies, within the free room of a 3 GiB L1
EXTRA = ("--shape", SHAPE, "--num-blocks", "64", "--num-tokens", str(TOKENS_PER_SEQ))


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def sequential_read(folder: Path) -> tuple[int, float]:
    total, t0 = 0, time.monotonic()
    for path in sorted(folder.glob("*.bin")):
        with path.open("rb", buffering=0) as f:
            while chunk := f.read(8 * 2**20):
                total += len(chunk)
    return total, time.monotonic() - t0


def wait_files(folder: Path, count: int, timeout: float) -> bool:
    """Whether count files are in folder within timeout (L2 writes are asynchronous)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(list(folder.glob("*.bin"))) >= count:
            return True
        time.sleep(0.5)
    return False


def bench(size_gb: float, root: Path, encrypted: bool, l1_gb: float) -> dict:
    chunks = int(size_gb * 2**30 // CHUNK_BYTES)
    seqs = chunks // CHUNKS_PER_SEQ
    target = make_target(l1_gb=l1_gb, capacity_gb=size_gb * 1.25 + 1, encrypted=encrypted)
    label = f"{size_gb}-{'aesgcm' if encrypted else 'plain'}"
    server = LocalServer(target, root / f"volume-{label}", root / f"server-{label}.log",
                         write_key(root / f"key-{label}") if encrypted else None)
    server.volume.mkdir(parents=True)
    server.start()
    try:
        # In batches that fit L1: a burst larger than L1 while L2 writes are pending is
        # refused by lmcache ("Failed to batched allocate"), and those chunks never reach L2.
        t0 = time.monotonic()
        # A store that L1 refused is simply stored again: the driver looks up first, so a retry
        # writes only what is still missing.
        for start in range(0, seqs, BATCH_SEQS):
            end = min(seqs, start + BATCH_SEQS)
            for _attempt in range(5):
                drive_subprocess("store", server.rpc_url, server.http_url, f"{start}:{end}", timeout=1800, extra=EXTRA)
                if wait_files(server.l2_dir, end * CHUNKS_PER_SEQ, timeout=60):
                    break
            else:
                raise SystemExit(f"chunks of sequences {start}:{end} never reached L2")
        store_s = time.monotonic() - t0
        l2_bytes = sum(p.stat().st_size for p in server.l2_dir.glob("*.bin"))

        server.stop(signal.SIGKILL)
        cold = drop_caches()
        healthy_s = server.start()
        first = drive_subprocess("verify", server.rpc_url, server.http_url, "0:1", extra=EXTRA)["sequences"][0]
        first_hit_ms = first["lookup_ms"] + first.get("retrieve_ms", 0.0)

        server.stop(signal.SIGKILL)
        drop_caches()
        server.start()
        read = drive_subprocess("verify", server.rpc_url, server.http_url, f"0:{seqs}", timeout=1800, extra=EXTRA)
        summary = read["summary"]
        read_s = sum(r["lookup_ms"] + r.get("retrieve_ms", 0.0) for r in read["sequences"]) / 1000
    finally:
        server.stop()
    drop_caches()
    raw_bytes, raw_s = sequential_read(server.l2_dir)
    return {
        "size_gb": size_gb, "encrypted": encrypted, "chunks": chunks, "store_gbps": l2_bytes / store_s / 1e9,
        "l2_bytes": l2_bytes, "store_s": store_s, "cold": cold,
        "restart_healthy_s": healthy_s, "first_hit_ms": first_hit_ms, "hit_chunks": summary["hit_chunks"],
        "wrong": summary["wrong_bytes"], "read_s": read_s, "lmcache_gbps": l2_bytes / read_s / 1e9,
        "raw_gbps": raw_bytes / raw_s / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gb", default="1,4")
    parser.add_argument("--dir", default=None, help="where the L2 folders go (default: a temp dir on /var/tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the stored files afterwards")
    parser.add_argument("--l1-gb", type=float, default=3.0,
                        help="L1 of the server: with the serde each L2 write needs a temporary copy in L1's free room "
                        "(1 - trigger watermark), so 1 GiB (a tenth free) is too small for 128 MiB writes")
    parser.add_argument("--l2", default="aesgcm,plain",
                        help="aesgcm (spec.l2.encryption on, the default), plain (off), or both, in this order")
    args = parser.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvpersist-bench-", dir="/var/tmp"))
    try:
        rows = [bench(float(s), root, mode == "aesgcm", args.l1_gb) for s in args.sizes_gb.split(",")
                for mode in args.l2.split(",")]
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print("| L2 | stored KV | chunks | store (s) | store (GB/s) | restart → healthy (s) | first L2 hit after restart (ms) | "
          "chunks hit after restart | wrong bytes | L2 read via lmcache (GB/s) | plain sequential read (GB/s) | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {'aesgcm' if r['encrypted'] else 'plain'} | {r['l2_bytes'] / 1e9:.2f} GB | {r['chunks']} | "
              f"{r['store_s']:.1f} | {r['store_gbps']:.2f} | {r['restart_healthy_s']:.2f} | "
              f"{r['first_hit_ms']:.1f} | {r['hit_chunks']}/{r['chunks']} | {r['wrong']} | {r['lmcache_gbps']:.2f} | "
              f"{r['raw_gbps']:.2f} | {r['lmcache_gbps'] / r['raw_gbps']:.2f} |")
    print(f"\npage cache dropped before cold reads: {all(r['cold'] for r in rows)}")


if __name__ == "__main__":
    main()
