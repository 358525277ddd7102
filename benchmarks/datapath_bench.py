#!/usr/bin/env python3
"""Data path: time from an lmcache server restart to its first L2 hit, and L2 read throughput,
against a plain sequential read of the same files.

Real lmcache 0.5.6 on the CPU, started with the args the operator renders (nixl_store_dynamic,
POSIX, unless --adapter fs), on a folder of this machine's disk. KV is driven with lmcache's own
bench client (tests/integration/kvdriver.py) in chunks of 32 MiB (a 32-layer, 8-KV-head, 128-dim
fp16 model's 256-token chunk), 4 chunks per request. Page cache is dropped before each cold read
(needs root).

Modes: `aesgcm` (spec.l2.encryption on, the default: kvpersist's serde, kvpersist.inserver.serve),
`lmcache-aesgcm` (lmcache 0.5.6's own serde, same keys, its own frames, for comparison) and `plain`
(encryption off). Each mode's data is stored once; then every trial restarts each mode's server in
turn (the order rotates), reads everything back cold, and reads the same files plainly, so both
sides of every ratio come from the same trial. Medians over trials are printed; these machines are
noisy, so each ratio is taken per trial first.

Each read is split as lmcache splits it: the lookup (for an L2 hit: L2 -> L1, which includes the
serde's decryption) and the retrieve (L1 -> the engine's KV buffers; here a CPU copy into the
client's buffers, on a GPU node a host-to-device copy).

    <venv>/bin/python benchmarks/datapath_bench.py --sizes-gb 1 [--modes aesgcm,lmcache-aesgcm,plain] [--trials 3]

(the venv `bash hack/venv.sh` prints; its bin need not be on PATH)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.conftest import LocalServer, make_target, write_key
from tests.integration.kvdriver import drive_subprocess

SHAPE = "(2,64,16,8,128):float16:32"  # 128 KiB per token, 32 MiB per 256-token chunk
SHAPE_PINS = {"numKVHeads": 8, "headSize": 128, "kvCacheDtype": "float16"}  # the same geometry as pins
CHUNK_BYTES = 32 * 2**20
TOKENS_PER_SEQ = 1024  # 4 chunks per request
CHUNKS_PER_SEQ = TOKENS_PER_SEQ // 256
BATCH_SEQS = 2  # 8 chunks, 256 MiB: with their serde copies, within the free room of a 3 GiB L1
EXTRA = ("--shape", SHAPE, "--num-blocks", "64", "--num-tokens", str(TOKENS_PER_SEQ))
MODES = ("aesgcm", "lmcache-aesgcm", "plain")


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def chunk_files(folder: Path) -> list[Path]:
    """The committed chunk files: nixl_store_dynamic's `*.bin`, fs's `*.data`."""
    return sorted([*folder.glob("*.bin"), *folder.glob("*.data")])


def sequential_read(folder: Path) -> tuple[int, float]:
    total, t0 = 0, time.monotonic()
    for path in chunk_files(folder):
        with path.open("rb", buffering=0) as f:
            while chunk := f.read(8 * 2**20):
                total += len(chunk)
    return total, time.monotonic() - t0


def wait_files(folder: Path, count: int, timeout: float) -> bool:
    """Whether count files are in folder within timeout (L2 writes are asynchronous)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(chunk_files(folder)) >= count:
            return True
        time.sleep(0.5)
    return False


@dataclass
class Trial:
    healthy_s: float
    first_hit_ms: float
    lookup_s: float  # L2 -> L1 for an L2 hit (with the serde's work)
    retrieve_s: float  # L1 -> the engine's buffers
    raw_gbps: float
    hit_chunks: int
    wrong: int


@dataclass
class Mode:
    name: str
    server: LocalServer
    chunks: int
    seqs: int
    store_s: float = 0.0
    l2_bytes: int = 0
    trials: list[Trial] = field(default_factory=list)


def store_all(server: LocalServer, seqs: int, label: str) -> None:
    """Stores sequences 0..seqs through the server in batches that fit L1 (BATCH_SEQS), each
    until its chunks are files in L2. A store that L1 refused is simply stored again: the driver
    looks up first, so a retry writes only what is still missing."""
    for start in range(0, seqs, BATCH_SEQS):
        end = min(seqs, start + BATCH_SEQS)
        for _attempt in range(5):
            drive_subprocess("store", server.rpc_url, server.http_url, f"{start}:{end}", timeout=1800, extra=EXTRA)
            if wait_files(server.l2_dir, end * CHUNKS_PER_SEQ, timeout=60):
                break
        else:
            raise SystemExit(f"{label}: chunks of sequences {start}:{end} never reached L2")


def prepare(mode: str, size_gb: float, root: Path, l1_gb: float, nvme: dict, extra_args: tuple[str, ...]) -> Mode:
    """A server for mode with size_gb of KV stored in L2 (and stopped)."""
    chunks = int(size_gb * 2**30 // CHUNK_BYTES)
    encrypted = mode != "plain"
    target = make_target(l1_gb=l1_gb, capacity_gb=size_gb * 1.25 + 1, encrypted=encrypted,
                         nvme=nvme, **SHAPE_PINS)
    label = f"{size_gb}-{mode}"
    server = LocalServer(target, root / f"volume-{label}", root / f"server-{label}.log",
                         write_key(root / f"key-{label}") if encrypted else None,
                         serde_type="aesgcm" if mode == "lmcache-aesgcm" else None, extra_args=extra_args)
    server.volume.mkdir(parents=True)
    m = Mode(mode, server, chunks, chunks // CHUNKS_PER_SEQ)
    server.start()
    try:
        # In batches that fit L1: a burst larger than L1 while L2 writes are pending is
        # refused by lmcache ("Failed to batched allocate"), and those chunks never reach L2.
        t0 = time.monotonic()
        store_all(server, m.seqs, mode)
        m.store_s = time.monotonic() - t0
    finally:
        server.stop(signal.SIGKILL)
    m.l2_bytes = sum(p.stat().st_size for p in chunk_files(server.l2_dir))
    return m


def trial(m: Mode) -> Trial:
    """One cold restart of m's server and a read of everything it stored, then a plain read."""
    drop_caches()
    healthy_s = m.server.start()
    try:
        read = drive_subprocess("verify", m.server.rpc_url, m.server.http_url, f"0:{m.seqs}", timeout=1800, extra=EXTRA)
    finally:
        m.server.stop(signal.SIGKILL)
    rows = read["sequences"]
    drop_caches()
    raw_bytes, raw_s = sequential_read(m.server.l2_dir)
    return Trial(healthy_s=healthy_s, first_hit_ms=rows[0]["lookup_ms"] + rows[0].get("retrieve_ms", 0.0),
                 lookup_s=sum(r["lookup_ms"] for r in rows) / 1000, retrieve_s=sum(r.get("retrieve_ms", 0.0) for r in rows) / 1000,
                 raw_gbps=raw_bytes / raw_s / 1e9, hit_chunks=read["summary"]["hit_chunks"], wrong=read["summary"]["wrong_bytes"])


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(size_gb: float, modes: list[Mode]) -> None:
    print(f"\n### {size_gb} GiB stored, {len(modes[0].trials)} trials (medians; ratios taken per trial)\n")
    print("| L2 | stored | chunks | store (s) | restart → healthy (s) | first L2 hit after restart (ms) | chunks hit | "
          "wrong bytes | L2 → L1 (GB/s) | L2 → L1 → engine (GB/s) | plain sequential read (GB/s) | "
          "L2 → L1 / plain read | end to end / plain read |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in modes:
        t = m.trials
        print(f"| {m.name} | {m.l2_bytes / 1e9:.2f} GB | {m.chunks} | {m.store_s:.1f} | "
              f"{median([x.healthy_s for x in t]):.2f} | {median([x.first_hit_ms for x in t]):.1f} | "
              f"{min(x.hit_chunks for x in t)}/{m.chunks} | {sum(x.wrong for x in t)} | "
              f"{median([m.l2_bytes / x.lookup_s / 1e9 for x in t]):.2f} | "
              f"{median([m.l2_bytes / (x.lookup_s + x.retrieve_s) / 1e9 for x in t]):.2f} | "
              f"{median([x.raw_gbps for x in t]):.2f} | "
              f"{median([m.l2_bytes / x.lookup_s / 1e9 / x.raw_gbps for x in t]):.2f} | "
              f"{median([m.l2_bytes / (x.lookup_s + x.retrieve_s) / 1e9 / x.raw_gbps for x in t]):.2f} |")
    plain = next((m for m in modes if m.name == "plain"), None)
    if plain is None:
        return
    print("\n| encrypted mode | L2 → L1, per trial: encrypted / plain (GB/s) | end to end: encrypted / plain | "
          "first L2 hit: encrypted / plain (time) |")
    print("| --- | --- | --- | --- |")
    for m in modes:
        if m is plain:
            continue
        pairs = list(zip(m.trials, plain.trials, strict=True))
        l2 = [(m.l2_bytes / a.lookup_s) / (plain.l2_bytes / b.lookup_s) for a, b in pairs]
        e2e = [(m.l2_bytes / (a.lookup_s + a.retrieve_s)) / (plain.l2_bytes / (b.lookup_s + b.retrieve_s)) for a, b in pairs]
        first = [a.first_hit_ms / b.first_hit_ms for a, b in pairs]
        print(f"| {m.name} | {median(l2):.2f} ({', '.join(f'{x:.2f}' for x in l2)}) | "
              f"{median(e2e):.2f} ({', '.join(f'{x:.2f}' for x in e2e)}) | "
              f"{median(first):.2f} ({', '.join(f'{x:.2f}' for x in first)}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gb", default="1")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the L2 folders go (default: a temp dir on /var/tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the stored files afterwards")
    parser.add_argument("--l1-gb", type=float, default=3.0,
                        help="L1 of the server: with the serde each L2 write needs a temporary copy in L1's free room "
                        "(1 - trigger watermark), so 1 GiB (a tenth free) is too small for 128 MiB writes")
    parser.add_argument("--modes", "--l2", default=",".join(MODES),
                        help="aesgcm (spec.l2.encryption on, the default: kvpersist's serde), lmcache-aesgcm (lmcache's "
                        "own serde), plain (off); any of them")
    parser.add_argument("--adapter", choices=["nixl_store_dynamic", "fs"], default=None,
                        help="spec.l2.nvme.adapter (default: the API's default)")
    parser.add_argument("--direct-io", action="store_true", help="spec.l2.nvme.directIO: O_DIRECT reads and writes")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra `lmcache server` argument after the rendered ones (repeat it), to try a setting")
    args = parser.parse_args()
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvpersist-bench-", dir="/var/tmp"))
    cold = drop_caches()
    try:
        for size in (float(s) for s in args.sizes_gb.split(",")):
            nvme = {**({"adapter": args.adapter} if args.adapter else {}), **({"directIO": True} if args.direct_io else {})}
            modes = [prepare(name, size, root, args.l1_gb, nvme, tuple(args.server_arg))
                     for name in args.modes.split(",")]
            for i in range(args.trials):
                for m in modes[i % len(modes):] + modes[:i % len(modes)]:
                    m.trials.append(trial(m))
            report(size, modes)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\npage cache dropped before cold reads: {cold}; extra server args: {args.server_arg or 'none'}; "
          f"adapter: {args.adapter or 'default'}; direct I/O: {args.direct_io}")


if __name__ == "__main__":
    main()
