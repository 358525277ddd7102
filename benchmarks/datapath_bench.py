#!/usr/bin/env python3
"""Data path: time from an lmcache server restart to its first L2 hit, and L2 read throughput,
against the real ceilings of the same run: the device as `fio` measures it and a threaded read of
the same files.

Real lmcache 0.5.6 on the CPU, started with the args the operator renders (nixl_store_dynamic,
POSIX, unless --adapter fs), on a folder of this machine's disk (or --dir, e.g. a tmpfs). KV is
driven with lmcache's own bench client (tests/integration/kvdriver.py) in chunks of 32 MiB (a
32-layer, 8-KV-head, 128-dim fp16 model's 256-token chunk), 4 chunks per request. Page cache is
dropped before each cold read (needs root).

Modes: `aesgcm` (spec.l2.encryption on, the default: kvpersist's serde, kvpersist.inserver.serve),
`lmcache-aesgcm` (lmcache 0.5.6's own serde, same keys, its own frames, for comparison) and `plain`
(encryption off). Each mode's data is stored once; then every trial restarts each mode's server in
turn (the order rotates) and reads everything back cold, and measures the ceilings beside it:
- `fio`: its own files of the same total size in the same folder, sequential reads with the
  settings of the server (O_DIRECT with libaio when direct I/O is on, buffered otherwise) over a
  small sweep of block sizes and queue depths at the start; each trial then reads at the best
  point just before and just after each server read, the faster of the two being that moment's
  ceiling (this virtual disk drifts by the minute). fio is a Debian
  package (`apt-get install fio`); without it the column says so and no fio ratio is printed.
- a threaded read of each mode's own files with as many threads as the server has cores (the
  same O_DIRECT or buffered opening), twice: into fresh memory, as this CPU build's L1 is after a
  restart (every page faults in on its first write), and into memory written before, as a GPU
  node's pinned L1 is (a read into fresh memory ran at 1.7 GB/s here where one into touched
  memory ran at 4.5, both from a RAM-backed folder);
- AES-GCM open of 2 MiB segments on one core (the serde's unit of work), from memory.
Medians over trials are printed; ratios are taken per trial first (these machines are noisy).

The server pod's CPU request (`--server-cpus`, default the rendered 2) sets the serde's workers
(builders/lmcache.serde_workers) and the process is held to that many cores with taskset, as a
pod's CPU limit would.

Each read is split as lmcache splits it: the lookup (for an L2 hit: L2 -> L1, which includes the
serde's decryption) and the retrieve (L1 -> the engine's KV buffers; here lmcache's CPU copy into
the client's paged buffers, on a GPU node a copy from pinned L1 to the GPU, see docs/datapath.md).

    <venv>/bin/python benchmarks/datapath_bench.py --sizes-gb 1 [--modes aesgcm,lmcache-aesgcm,plain] [--trials 3]
        [--dir /dev/shm/kvp --direct-io off] [--server-cpus 1] [--json out.json]

(the venv `bash hack/venv.sh` prints; its bin need not be on PATH)
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.conftest import LocalServer, make_target, write_key
from tests.integration.kvdriver import drive_subprocess

from kvpersist.builders.lmcache import DEFAULT_SERVER_CPU, serde_workers

SHAPE = "(2,64,16,8,128):float16:32"  # 128 KiB per token, 32 MiB per 256-token chunk
SHAPE_PINS = {"numKVHeads": 8, "headSize": 128, "kvCacheDtype": "float16"}  # the same geometry as pins
CHUNK_BYTES = 32 * 2**20
TOKENS_PER_SEQ = 1024  # 4 chunks per request
CHUNKS_PER_SEQ = TOKENS_PER_SEQ // 256
BATCH_SEQS = 2  # 8 chunks, 256 MiB: with their serde copies, within the free room of a 3 GiB L1
EXTRA = ("--shape", SHAPE, "--num-blocks", "64", "--num-tokens", str(TOKENS_PER_SEQ))
MODES = ("aesgcm", "lmcache-aesgcm", "plain")
SEGMENT_BYTES = 2 * 2**20  # the serde's unit of work (kvpersist.inserver.serve.SEGMENT_BYTES)
# fio's sweep: (block size, queue depth). With O_DIRECT, libaio keeps that many reads in flight;
# buffered, psync reads one at a time (the depth is 1 whatever is asked).
FIO_DIRECT_POINTS = (("1M", 1), ("1M", 16), ("1M", 64), ("4M", 8), ("4M", 32))
FIO_BUFFERED_POINTS = (("1M", 1), ("4M", 1))
FIO_TIMEOUT_S = 120


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def chunk_files(folder: Path) -> list[Path]:
    """The committed chunk files: nixl_store_dynamic's `*.bin` (in shard folders), fs's `*.data`."""
    return sorted([*folder.rglob("*.bin"), *folder.rglob("*.data")])


def _aligned(size: int, touched: bool) -> mmap.mmap:
    """An anonymous, page-aligned buffer (O_DIRECT needs aligned memory). touched: written once
    before, so a read into it pays no page faults, as into L1 on a GPU node (lmcache pins it with
    cudaHostRegister, which faults every page in at start); untouched, as L1 on this CPU build
    after a restart (lmcache's CPU allocator is a torch.empty nobody has written yet)."""
    buf = mmap.mmap(-1, max(size, mmap.PAGESIZE))
    if touched:
        buf.write(b"\0" * len(buf))
    return buf


def threaded_read(files: list[Path], threads: int, direct: bool, touched: bool) -> tuple[int, float]:
    """Reads every file whole into memory of its own with `threads` threads: the software ceiling
    of reading these files with the server's cores (os.preadv releases the GIL)."""
    threads = max(1, min(threads, len(files)))
    sizes = [-(-p.stat().st_size // mmap.PAGESIZE) * mmap.PAGESIZE for p in files]
    buffers = [_aligned(sum(sizes[i::threads]), touched) for i in range(threads)]
    totals = [0] * threads
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)

    def work(i: int) -> None:
        view, at = memoryview(buffers[i]), 0
        for path, size in zip(files[i::threads], sizes[i::threads], strict=True):
            fd = os.open(path, flags)
            try:
                offset = 0
                while n := os.preadv(fd, [view[at + offset:at + size]], offset):
                    offset += n
                totals[i] += offset
            finally:
                os.close(fd)
            at += size
        view.release()

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t0 = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - t0
    for b in buffers:
        b.close()
    return sum(totals), elapsed


def aesgcm_open_per_core(seconds: float = 0.5) -> float | None:
    """AES-256-GCM open of 2 MiB segments on one thread, from memory (GB/s): one core's share of
    the serde's work. None without the cryptography package."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        return None
    aead = AESGCM(AESGCM.generate_key(256))
    nonce, aad = os.urandom(12), b"bench"
    sealed = aead.encrypt(nonce, os.urandom(SEGMENT_BYTES), aad)
    done, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        aead.decrypt(nonce, sealed, aad)
        done += SEGMENT_BYTES
    return done / (time.monotonic() - t0) / 1e9


@dataclass
class Fio:
    """fio's own files in the bench's folder, read with the server's I/O settings."""

    folder: Path
    files: int
    total_bytes: int
    direct: bool
    note: str = ""
    points: dict[str, float] = field(default_factory=dict)
    best: tuple[str, int] | None = None

    def prepare(self) -> bool:
        if shutil.which("fio") is None:
            self.note = "fio not installed (Debian package fio)"
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        result = self._run("write", "1M", 16, self.direct)
        if result is None and self.direct:
            self.direct, self.note = False, "O_DIRECT refused by this file system: fio read buffered"
            result = self._run("write", "1M", 16, False)
        if result is None:
            self.note = self.note or "fio failed to lay out its files"
            return False
        self.sweep()
        if self.best is None:
            self.note = self.note or "fio's reads failed"
        return self.best is not None

    def _run(self, rw: str, bs: str, depth: int, direct: bool) -> float | None:
        engine = "libaio" if direct else "psync"
        argv = ["fio", "--name=kvp", f"--directory={self.folder}", f"--rw={rw}", f"--bs={bs}",
                f"--size={self.total_bytes}", f"--nrfiles={self.files}", f"--direct={int(direct)}",
                f"--ioengine={engine}", f"--iodepth={depth}", "--file_service_type=sequential",
                "--output-format=json"]
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=FIO_TIMEOUT_S, check=True).stdout
            job = json.loads(out[out.index("{"):])["jobs"][0]
            return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9
        except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError):
            return None

    def sweep(self) -> dict[str, float]:
        """GB/s per point (block size / queue depth), each after a page cache drop; the best point
        is then the one each trial reads at (`best`)."""
        points = FIO_DIRECT_POINTS if self.direct else FIO_BUFFERED_POINTS
        out: dict[str, float] = {}
        for bs, depth in points:
            drop_caches()
            gbps = self._run("read", bs, depth, self.direct)
            if gbps is not None:
                out[f"{bs}/qd{depth}"] = gbps
        self.points = out
        if out:
            bs, depth = max(out, key=out.__getitem__).split("/qd")
            self.best = (bs, int(depth))
        return out

    def read(self) -> float | None:
        """One cold read at the saturating point: run beside each server read, so both sides of
        the ratio see the same moment of a device whose rate drifts."""
        if self.best is None:
            return None
        drop_caches()
        return self._run("read", self.best[0], self.best[1], self.direct)


@dataclass
class Trial:
    healthy_s: float
    first_hit_ms: float
    lookup_s: float  # L2 -> L1 for an L2 hit (with the serde's work), into L1 memory fresh after the restart
    retrieve_s: float  # L1 -> the engine's buffers
    warm_lookup_s: float  # the same into L1 memory the first read faulted in (as pinned L1 on a GPU node)
    warm_wrong: int
    read_gbps: float  # a threaded read of the same files, as many threads as the server's cores, into fresh memory
    read_touched_gbps: float  # the same into memory written before (no page faults)
    fio_gbps: float | None  # fio at its sweep's best point, the faster of its reads before and after
    aes_gbps: float | None  # AES-GCM open per core, this trial
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


def wait_files(folder: Path, count: int, timeout: float) -> bool:
    """Whether count files are in folder within timeout (L2 writes are asynchronous)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(chunk_files(folder)) >= count:
            return True
        time.sleep(0.5)
    return False


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


@dataclass
class TunedServer(LocalServer):
    """A LocalServer whose adapter's backend_params get more entries (--backend-param), to try a
    NIXL setting the operator does not render."""

    backend_params: dict[str, str] = field(default_factory=dict)

    @property
    def argv(self) -> list[str]:
        argv = super().argv
        if self.backend_params:
            at = argv.index("--l2-adapter") + 1
            adapter = json.loads(argv[at])
            adapter.setdefault("backend_params", {}).update(self.backend_params)
            argv[at] = json.dumps(adapter, separators=(",", ":"), sort_keys=True)
        return argv


@dataclass(frozen=True)
class Setup:
    """What every mode's server shares: the L2 settings and the server pod's CPU."""

    root: Path
    l1_gb: float
    nvme: dict[str, Any]
    extra_args: tuple[str, ...]
    server_cpus: int
    backend_params: dict[str, str] = field(default_factory=dict)

    @property
    def cpu_list(self) -> str | None:
        """The cores the server is held to, or None when the machine has fewer (then unpinned)."""
        have = os.cpu_count() or 1
        return f"0-{self.server_cpus - 1}" if self.server_cpus <= have and shutil.which("taskset") else None


def prepare(mode: str, size_gb: float, setup: Setup) -> Mode:
    """A server for mode with size_gb of KV stored in L2 (and stopped)."""
    chunks = int(size_gb * 2**30 // CHUNK_BYTES)
    encrypted = mode != "plain"
    target = make_target(l1_gb=setup.l1_gb, capacity_gb=size_gb * 1.25 + 1, encrypted=encrypted,
                         nvme=setup.nvme, server_cpu=str(setup.server_cpus), **SHAPE_PINS)
    label = f"{size_gb}-{mode}"
    root = setup.root
    server = TunedServer(target, root / f"volume-{label}", root / f"server-{label}.log",
                         write_key(root / f"key-{label}") if encrypted else None,
                         serde_type="aesgcm" if mode == "lmcache-aesgcm" else None, extra_args=setup.extra_args,
                         cpus=setup.cpu_list, backend_params=setup.backend_params)
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
    print(f"stored {label}: {m.l2_bytes / 1e9:.2f} GB in {m.store_s:.1f} s", flush=True)
    return m


def read_back(m: Mode, direct: bool, threads: int, fio: Fio | None) -> tuple[dict[str, Any], float, float, float | None]:
    """One cold restart of m's server and a read of everything it stored, then threaded reads of
    the same files into fresh and into touched memory (each cold); fio reads its own files before
    and after, and the faster of the two is the device's ceiling at that moment. Why both: this
    virtual disk's rate drifts by the minute (0.33 to 2.57 GB/s in one session), so whichever read
    came at a slow minute alone would misstate the ceiling."""
    fio_before = fio.read() if fio else None
    drop_caches()
    healthy_s = m.server.start()
    try:
        read = drive_subprocess("verify", m.server.rpc_url, m.server.http_url, f"0:{m.seqs}", timeout=1800, extra=EXTRA)
        # Again into L1 memory the first read faulted in: L1 emptied (lmcache's POST /cache/clear,
        # L1 only), the page cache dropped, everything read from L2 once more.
        clear_l1(m.server.http_url)
        drop_caches()
        warm = drive_subprocess("verify", m.server.rpc_url, m.server.http_url, f"0:{m.seqs}", timeout=1800, extra=EXTRA)
    finally:
        m.server.stop(signal.SIGKILL)
    files = chunk_files(m.server.l2_dir)
    rates = []
    for touched in (False, True):
        drop_caches()
        raw_bytes, raw_s = threaded_read(files, threads, direct, touched)
        rates.append(raw_bytes / raw_s / 1e9)
    fio_after = fio.read() if fio else None
    ceiling = max((x for x in (fio_before, fio_after) if x is not None), default=None)
    return {**read, "healthy_s": healthy_s, "warm": warm}, rates[0], rates[1], ceiling


def clear_l1(http_url: str) -> None:
    """Empties the server's L1 (its admin API); the memory stays with lmcache's allocator."""
    request = urllib.request.Request(http_url + "/cache/clear", data=b'{"tier": "l1", "force": false}',
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as r:
        r.read()


def trial(modes: list[Mode], fio: Fio | None, direct: bool, threads: int) -> None:
    """Every mode read back once (in the order given), then the ceilings of this trial."""
    reads = {m.name: read_back(m, direct, threads, fio) for m in modes}
    aes = aesgcm_open_per_core()
    for m in modes:
        read, read_gbps, read_touched_gbps, fio_gbps = reads[m.name]
        rows = read["sequences"]
        m.trials.append(Trial(
            healthy_s=read["healthy_s"], first_hit_ms=rows[0]["lookup_ms"] + rows[0].get("retrieve_ms", 0.0),
            lookup_s=sum(r["lookup_ms"] for r in rows) / 1000, retrieve_s=sum(r.get("retrieve_ms", 0.0) for r in rows) / 1000,
            warm_lookup_s=sum(r["lookup_ms"] for r in read["warm"]["sequences"]) / 1000,
            warm_wrong=read["warm"]["summary"]["wrong_bytes"] + m.chunks - read["warm"]["summary"]["hit_chunks"],
            read_gbps=read_gbps, read_touched_gbps=read_touched_gbps, fio_gbps=fio_gbps, aes_gbps=aes,
            hit_chunks=read["summary"]["hit_chunks"], wrong=read["summary"]["wrong_bytes"]))
    print(f"trial {len(modes[0].trials)}: " + "; ".join(
        f"{m.name} L2→L1 {m.l2_bytes / m.trials[-1].lookup_s / 1e9:.2f} GB/s "
        f"(touched L1 {m.l2_bytes / m.trials[-1].warm_lookup_s / 1e9:.2f}), read {m.trials[-1].read_gbps:.2f} "
        f"(touched {m.trials[-1].read_touched_gbps:.2f}), "
        f"fio {m.trials[-1].fio_gbps or float('nan'):.2f}" for m in modes) + f"; AES-GCM/core {aes or float('nan'):.2f}",
        flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _ratios(values: list[float]) -> str:
    return f"{median(values):.2f} ({', '.join(f'{x:.2f}' for x in values)})"


def figures(m: Mode) -> dict[str, Any]:
    """One mode's medians (the JSON's mode entry; the table prints the same numbers)."""
    t = m.trials
    fio = [x for x in t if x.fio_gbps]
    return {
        "name": m.name, "chunks": m.chunks, "l2_bytes": m.l2_bytes, "store_s": round(m.store_s, 2),
        "hit_chunks": min(x.hit_chunks for x in t), "wrong_bytes": sum(x.wrong for x in t),
        "touched_l1_misses_or_wrong": sum(x.warm_wrong for x in t),
        "l2_to_l1_touched_gbps": median([m.l2_bytes / x.warm_lookup_s / 1e9 for x in t]),
        "l2_to_l1_touched_over_read_touched": [m.l2_bytes / x.warm_lookup_s / 1e9 / x.read_touched_gbps for x in t],
        "l2_to_l1_touched_over_fio": [m.l2_bytes / x.warm_lookup_s / 1e9 / x.fio_gbps for x in fio],  # type: ignore[operator]
        "healthy_s": median([x.healthy_s for x in t]), "first_hit_ms": median([x.first_hit_ms for x in t]),
        "l2_to_l1_gbps": median([m.l2_bytes / x.lookup_s / 1e9 for x in t]),
        "end_to_end_gbps": median([m.l2_bytes / (x.lookup_s + x.retrieve_s) / 1e9 for x in t]),
        "retrieve_gbps": median([m.l2_bytes / x.retrieve_s / 1e9 for x in t if x.retrieve_s > 0]),
        "threaded_read_gbps": median([x.read_gbps for x in t]),
        "threaded_read_touched_gbps": median([x.read_touched_gbps for x in t]),
        "l2_to_l1_over_read": [m.l2_bytes / x.lookup_s / 1e9 / x.read_gbps for x in t],
        "l2_to_l1_over_read_touched": [m.l2_bytes / x.lookup_s / 1e9 / x.read_touched_gbps for x in t],
        "l2_to_l1_over_fio": [m.l2_bytes / x.lookup_s / 1e9 / x.fio_gbps for x in fio],  # type: ignore[operator]
        "end_to_end_over_fio": [m.l2_bytes / (x.lookup_s + x.retrieve_s) / 1e9 / x.fio_gbps for x in fio],  # type: ignore[operator]
    }


def report(size_gb: float, modes: list[Mode], setup: Setup, fio: Fio | None) -> dict[str, Any]:
    """Prints the tables and returns the run's JSON entry."""
    t0 = modes[0].trials
    fio_gbps = [x.fio_gbps for x in t0 if x.fio_gbps]
    aes = [x.aes_gbps for x in t0 if x.aes_gbps]
    threads = setup.server_cpus
    rows = [figures(m) for m in modes]
    direct = bool(setup.nvme.get("directIO", True))
    print(f"\n### {size_gb} GiB stored, {len(t0)} trials (medians; ratios per trial, each trial in brackets)\n")
    print(f"Server: {threads} CPU requested ({serde_workers_of(setup)} serde workers), held to cores "
          f"{setup.cpu_list or 'all (this machine has fewer)'}; direct I/O {'on' if direct else 'off'}; "
          f"{fio_line(fio, fio_gbps)}; AES-GCM open {median(aes):.2f} GB/s a core.\n")
    print(f"| L2 | stored | chunks hit | wrong bytes | restart → healthy (s) | first L2 hit after restart (ms) | "
          f"L2 → L1 (GB/s) | L1 → engine alone (GB/s) | L2 → L1 → engine (GB/s) | read, {threads} threads, fresh / "
          f"touched memory (GB/s) | fio (GB/s) | L2 → L1 / fio | L2 → L1 / read, fresh | L2 → L1 / read, touched | "
          f"end to end / fio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['name']} | {r['l2_bytes'] / 1e9:.2f} GB | {r['hit_chunks']}/{r['chunks']} | {r['wrong_bytes']} | "
              f"{r['healthy_s']:.2f} | {r['first_hit_ms']:.1f} | {r['l2_to_l1_gbps']:.2f} | {r['retrieve_gbps']:.2f} | "
              f"{r['end_to_end_gbps']:.2f} | {r['threaded_read_gbps']:.2f} / {r['threaded_read_touched_gbps']:.2f} | "
              f"{median(fio_gbps):.2f} | {_ratios(r['l2_to_l1_over_fio']) if fio_gbps else 'no fio'} | "
              f"{_ratios(r['l2_to_l1_over_read'])} | {_ratios(r['l2_to_l1_over_read_touched'])} | "
              f"{_ratios(r['end_to_end_over_fio']) if fio_gbps else 'no fio'} |")
    print("\nRead again from L2 into L1 memory the first read faulted in (L1 emptied by lmcache's /cache/clear, "
          "page cache dropped), as a GPU node's pinned L1 is:\n")
    print(f"| L2 | misses or wrong chunks | L2 → L1, touched L1 (GB/s) | read, {threads} threads, touched memory (GB/s) | "
          f"fio (GB/s) | L2 → L1 / read, touched | L2 → L1 / fio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['name']} | {r['touched_l1_misses_or_wrong']} | {r['l2_to_l1_touched_gbps']:.2f} | "
              f"{r['threaded_read_touched_gbps']:.2f} | {median(fio_gbps):.2f} | "
              f"{_ratios(r['l2_to_l1_touched_over_read_touched'])} | "
              f"{_ratios(r['l2_to_l1_touched_over_fio']) if fio_gbps else 'no fio'} |")
    plain = next((m for m in modes if m.name == "plain"), None)
    if plain is not None and len(modes) > 1:
        print(f"\n| encrypted mode | L2 → L1: encrypted / plain | L2 → L1, touched L1: encrypted / plain | end to end: "
              f"encrypted / plain | first L2 hit: encrypted / plain (time) | AES-GCM open, {serde_workers_of(setup)} workers "
              f"x one core (GB/s) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for m in modes:
            if m is plain:
                continue
            pairs = list(zip(m.trials, plain.trials, strict=True))
            l2 = [(m.l2_bytes / a.lookup_s) / (plain.l2_bytes / b.lookup_s) for a, b in pairs]
            e2e = [(m.l2_bytes / (a.lookup_s + a.retrieve_s)) / (plain.l2_bytes / (b.lookup_s + b.retrieve_s)) for a, b in pairs]
            touched = [(m.l2_bytes / a.warm_lookup_s) / (plain.l2_bytes / b.warm_lookup_s) for a, b in pairs]
            first = [a.first_hit_ms / b.first_hit_ms for a, b in pairs]
            row = next(r for r in rows if r["name"] == m.name)
            row["over_plain"], row["touched_over_plain"] = median(l2), median(touched)
            print(f"| {m.name} | {_ratios(l2)} | {_ratios(touched)} | {_ratios(e2e)} | {_ratios(first)} | "
                  f"{median(aes) * serde_workers_of(setup):.2f} |")
    return {"size_gb": size_gb, "dir": str(setup.root), "direct_io": direct, "workers": serde_workers_of(setup),
            "server_cpus": threads, "pinned_cores": setup.cpu_list, "trials": len(t0),
            "baseline": {"fio_gbps": median(fio_gbps) if fio_gbps else None, "fio_note": fio.note if fio else "off",
                         "fio_sweep": fio.points if fio else {},
                         "threaded_read_gbps": median([r["threaded_read_gbps"] for r in rows]),
                         "threaded_read_touched_gbps": median([r["threaded_read_touched_gbps"] for r in rows]),
                         "read_threads": threads},
            "aesgcm_gbps_per_core": median(aes) if aes else None, "modes": rows}


def fio_line(fio: Fio | None, gbps: list[float]) -> str:
    """What fio measured, or why it did not."""
    if fio is None:
        return "fio not run (--no-fio)"
    if not gbps or fio.best is None:
        return f"fio: no figure ({fio.note or 'no read succeeded'})"
    return (f"fio {median(gbps):.2f} GB/s at {fio.best[0]}/qd{fio.best[1]}, the best of its sweep {fio.points}"
            + (f" ({fio.note})" if fio.note else ""))


def serde_workers_of(setup: Setup) -> int:
    return serde_workers(make_target(server_cpu=str(setup.server_cpus), **SHAPE_PINS))


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
    parser.add_argument("--direct-io", choices=["on", "off"], default=None,
                        help="spec.l2.nvme.directIO (default: the API's, on); off for a RAM-backed --dir (tmpfs)")
    parser.add_argument("--server-cpus", type=int, default=int(DEFAULT_SERVER_CPU),
                        help="the server pod's CPU request: the serde's workers follow it, and the process is held "
                        "to that many cores (default: the rendered request)")
    parser.add_argument("--backend-param", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra nixl_store_dynamic backend_params entry (repeat it), e.g. use_posix_aio=true")
    parser.add_argument("--no-fio", action="store_true", help="skip fio's ceiling")
    parser.add_argument("--json", default=None, help="also write the figures here (schema kvpersist-datapath/1)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra `lmcache server` argument after the rendered ones (repeat it), to try a setting")
    args = parser.parse_args()
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvpersist-bench-", dir="/var/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    nvme = {**({"adapter": args.adapter} if args.adapter else {}),
            **({"directIO": args.direct_io == "on"} if args.direct_io else {})}
    setup = Setup(root, args.l1_gb, nvme, tuple(args.server_arg), max(1, args.server_cpus),
                  dict(kv.split("=", 1) for kv in args.backend_param))
    direct = args.direct_io != "off"
    cold = drop_caches()
    runs: list[dict[str, Any]] = []
    try:
        for size in (float(s) for s in args.sizes_gb.split(",")):
            modes = [prepare(name, size, setup) for name in args.modes.split(",")]
            chunks = modes[0].chunks
            fio = None if args.no_fio else Fio(root / f"fio-{size}", chunks, chunks * CHUNK_BYTES, direct)
            if fio is not None and not fio.prepare():
                print(f"fio: {fio.note}", flush=True)  # no ceiling from fio: its read() says None
            elif fio is not None:
                print("fio sweep (GB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in fio.points.items())
                      + f"; each trial reads at {fio.best[0]}/qd{fio.best[1]}" + (f" ({fio.note})" if fio.note else ""),
                      flush=True)
            for i in range(args.trials):
                trial(modes[i % len(modes):] + modes[:i % len(modes)], fio, fio.direct if fio else direct,
                      setup.server_cpus)
            runs.append(report(size, modes, setup, fio))
            if args.json:  # after each size, so a run stopped later still leaves what it measured
                Path(args.json).write_text(json.dumps({"schema": "kvpersist-datapath/1", "cores": os.cpu_count(),
                                                       "page_cache_dropped": cold, "runs": runs}, indent=1) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\npage cache dropped before cold reads: {cold}; extra server args: {args.server_arg or 'none'}; "
          f"extra backend params: {setup.backend_params or 'none'}; "
          f"adapter: {args.adapter or 'default'}; direct I/O: {'on' if direct else 'off'}; cores here: {os.cpu_count()}")


if __name__ == "__main__":
    main()
