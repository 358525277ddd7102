#!/usr/bin/env python3
"""Data path: time from an lmcache server restart to its first L2 hit, and L2 read throughput,
against the real ceilings of the same run: the device as `fio` measures it and threaded reads of
the same files.

Real lmcache 0.5.6 on the CPU, started with the args the operator renders (its default adapter, or
--adapter fs_native / nixl_store_dynamic / fs), on a folder of this machine's disk, on --dir (e.g. a
tmpfs), or on --ram-device N: an ext4 on a loop device over an N GiB file in /dev/shm that the bench
sets up and removes itself (needs root), the production path (O_DIRECT, --direct-io on) at memory
speed, so what is left is the server's own cost. KV is driven with lmcache's own bench client
(tests/integration/kvdriver.py) in chunks of 32 MiB (a 32-layer, 8-KV-head, 128-dim fp16 model's
256-token chunk), 4 chunks per request. Page cache is dropped before each cold read (needs root):
a trial in which any drop failed is marked invalid (its reads may have come from memory) and left
out of the medians and ratios; the bench exits non-zero when no trial of a size was valid.

Modes: `aesgcm` (spec.l2.encryption on, the default: kvpersist's serde, kvpersist.inserver.serve),
`lmcache-aesgcm` (lmcache 0.5.6's own serde, same keys, its own frames, for comparison), `plain`
(encryption off: the same frames under a public key, every object checked) and `unchecked`
(lmcache's bare read with no serde, what encryption off was before: the baseline the others are
divided by when it runs, else plain). Each mode's data is stored once; then every trial restarts each mode's server in
turn (the order rotates, and each trial line says it) and reads everything back cold, and measures
the ceilings beside it:
- `fio`: its own files of the same total size in the same folder, sequential reads with the
  settings of the server (O_DIRECT with libaio when direct I/O is on, buffered otherwise), into
  buffers fio wrote before (as pinned L1 is: no page faults), over a sweep of block sizes and
  queue depths at the start (printed whole). Two points are kept:
  `fio best`, the sweep's fastest point, whose buffer (block size x depth, a few MiB) may stay in
  the CPU's cache, and `fio landing`, the fastest point whose buffer is at least 256 MiB, so its
  reads land in memory as the server's reads into L1 (about 1 GiB of distinct memory) do. On the
  RAM device one thread read 32 MiB blocks at 5.4-6.0 GB/s into a reused 16 MiB buffer and at
  3.6-3.9 into 1 GiB of distinct memory: `fio best` overstates what any reader into L1 can reach,
  `fio landing` is that ceiling. Each trial reads at both points just before and just after each
  server read, the faster of the two being that moment's ceiling (a virtual disk drifts by the
  minute). fio is a Debian package (`apt-get install fio`); without it the columns say so.
- a threaded read of each mode's own files with as many threads as the server has cores (the
  same O_DIRECT or buffered opening), into fresh memory, as this CPU build's L1 is after a restart
  (every page faults in on its first write), and into memory written before, as a GPU node's
  pinned L1 is (a read into fresh memory ran at 1.7 GB/s here where one into touched memory ran at
  4.5, both from a RAM-backed folder); and once more into touched memory with as many threads as
  `fio landing`'s depth (at most 64), each reading whole files, as fs_native's I/O threads do: as
  many reads in flight as the device needed to saturate;
- AES-GCM open of 2 MiB segments on one core (the serde's unit of work), from memory.
Medians over valid trials are printed; ratios are taken per trial first (these machines are noisy).

The server pod's CPU request (`--server-cpus`, default the rendered 2) sets the serde's workers
(builders/lmcache.serde_workers) and the process is held to that many cores with taskset, as a
pod's CPU limit would.

Each read is split as lmcache splits it: the lookup (for an L2 hit: L2 -> L1, which includes the
serde's decryption) and the retrieve (L1 -> the engine's KV buffers; here lmcache's CPU copy into
the client's paged buffers, on a GPU node a copy from pinned L1 to the GPU, see docs/datapath.md).

One driver reads one request at a time, as one vLLM replica with one request would: a request's
chunks are opened before the next read begins, and the driver's own checks share the server's
cores. A node's server serves several replicas at once: `--clients N` reads back with N drivers at
once, each over its own part of the sequences, starting together. The L2 → L1 time is then the
union of their lookups' intervals (the time during which at least one was in progress), not their
sum, and so is L1 → engine's; end to end adds the two, so it counts one client's lookup beside
another's retrieve twice (a low figure). The first L2 hit is sequence 0's, beside the others' reads.

    <venv>/bin/python benchmarks/datapath_bench.py --sizes-gb 1 [--modes aesgcm,lmcache-aesgcm,plain] [--trials 3]
        [--dir /dev/shm/kvp --direct-io off | --ram-device 6] [--adapter fs_native] [--server-cpus 1] [--json out.json]

(the venv `bash hack/venv.sh` prints; its bin need not be on PATH). JSON schema kvpersist-datapath/2:
/1's keys, plus the fio landing figures, the read with fio's depth, each trial's validity and each
run's `clients`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.conftest import NO_SERDE, LocalServer, make_target, write_key
from tests.integration.kvdriver import drive_subprocess

from kvpersist.builders.lmcache import DEFAULT_SERVER_CPU, serde_workers

SCHEMA = "kvpersist-datapath/2"
SHAPE = "(2,64,16,8,128):float16:32"  # 128 KiB per token, 32 MiB per 256-token chunk
SHAPE_PINS = {"numKVHeads": 8, "headSize": 128, "kvCacheDtype": "float16"}  # the same geometry as pins
CHUNK_BYTES = 32 * 2**20
BATCH_CHUNKS = 8  # stored at once, 256 MiB: with their serde copies, within the free room of a 3 GiB L1
TOKENS_PER_SEQ = CHUNKS_PER_SEQ = BATCH_SEQS = 0  # set by request_tokens, below
EXTRA: tuple[str, ...] = ()


def request_tokens(tokens: int) -> None:
    """Each request (the driver's sequence) this long: a longer prompt is more chunks per lookup,
    whose reads and opens overlap (the server loads one chunk per load) where 4 chunks finish together."""
    global TOKENS_PER_SEQ, CHUNKS_PER_SEQ, BATCH_SEQS, EXTRA
    TOKENS_PER_SEQ, CHUNKS_PER_SEQ = tokens, tokens // 256
    BATCH_SEQS = max(1, BATCH_CHUNKS // CHUNKS_PER_SEQ)
    shape = SHAPE.replace("(2,64,", f"(2,{tokens // 16},")  # the driver's paged buffer holds one request
    EXTRA = ("--shape", shape, "--num-blocks", str(tokens // 16), "--num-tokens", str(tokens))


request_tokens(1024)  # 4 chunks per request, unless --request-tokens says otherwise


MODES = ("aesgcm", "lmcache-aesgcm", "plain", "unchecked")
BASELINES = ("unchecked", "plain")  # what the other modes' rates are divided by: the first that runs
SEGMENT_BYTES = 2 * 2**20  # the serde's unit of work (kvpersist.inserver.serve.SEGMENT_BYTES)
# fio's sweep: (block size, queue depth). With O_DIRECT, libaio keeps that many reads in flight;
# buffered, psync reads one at a time (the depth is 1 whatever is asked). The small points' buffer
# (block size x depth) stays in the CPU's cache; the 32M points' (chunk-sized reads, 128 MiB to
# 1 GiB of buffer) does not, as the server's reads into L1 do not; 1M/qd32..128 find the depth
# that saturates the device.
FIO_DIRECT_POINTS = (("1M", 1), ("1M", 16), ("1M", 32), ("1M", 64), ("1M", 128), ("4M", 8), ("4M", 32),
                     ("32M", 4), ("32M", 8), ("32M", 16), ("32M", 32))
FIO_BUFFERED_POINTS = (("1M", 1), ("4M", 1))
FIO_TIMEOUT_S = 120
LANDING_BYTES = 256 * 2**20  # a fio buffer at least this large: its reads land in memory, not in the CPU's cache
MAX_READ_THREADS = 64  # the threaded read with fio's depth
RAM_DEVICE_TIMEOUT_S = 60  # each command that sets up or removes --ram-device
START_MARGIN_S = 5.0  # --clients: each driver imports torch and lmcache before its first request, per driver


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


@dataclass
class Cold:
    """One trial's page cache drops, by the cold read each came before. A read after a failed drop
    may come from memory, not the device: the trial's figures are then no cold ones (left out)."""

    drops: dict[str, bool] = field(default_factory=dict)

    def drop(self, read: str) -> bool:
        ok = drop_caches()
        self.drops[read] = self.drops.get(read, True) and ok
        return ok

    @property
    def failed(self) -> list[str]:
        return [read for read, ok in self.drops.items() if not ok]


def chunk_files(folder: Path) -> list[Path]:
    """The committed chunk files: nixl_store_dynamic's `*.bin` (in shard folders), fs's and
    fs_native's `*.data` (fs_native's `*.tmp`, writes in progress, are not chunks)."""
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
    of reading these files with that many reads in flight (os.preadv releases the GIL)."""
    threads = max(1, min(threads, len(files)))
    lengths = [p.stat().st_size for p in files]
    sizes = [-(-n // mmap.PAGESIZE) * mmap.PAGESIZE for n in lengths]
    buffers = [_aligned(sum(sizes[i::threads]), touched) for i in range(threads)]
    totals = [0] * threads
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)

    def work(i: int) -> None:
        view, at = memoryview(buffers[i]), 0
        for path, length, size in zip(files[i::threads], lengths[i::threads], sizes[i::threads], strict=True):
            fd = os.open(path, flags)
            try:
                offset = 0  # stops at the file's end: O_DIRECT refuses a read at the unaligned offset after it
                while offset < length and (n := os.preadv(fd, [view[at + offset:at + size]], offset)):
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


def size_bytes(size: str) -> int:
    """fio's size notation (1M, 32M, 4K, 1G) in bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(size[:-1]) * units[size[-1].upper()] if size[-1:].upper() in units else int(size)


def point_buffer(point: str) -> int:
    """A sweep point's buffer ("32M/qd8": 32 MiB x 8): the memory fio's reads in flight land in."""
    bs, depth = point.split("/qd")
    return size_bytes(bs) * int(depth)


def _mib(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


@dataclass
class Fio:
    """fio's own files in the bench's folder, read with the server's I/O settings."""

    folder: Path
    files: int
    total_bytes: int
    direct: bool
    note: str = ""
    points: dict[str, float] = field(default_factory=dict)
    best: str | None = None  # the sweep's fastest point, e.g. "1M/qd16"
    landing: str | None = None  # the fastest point whose buffer is >= LANDING_BYTES
    sweep_drops_ok: bool = True

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
        """GB/s of one fio job. Reads run as `rw` with 100% reads: fio then fills its buffers
        before the clock starts (it does for any job that may write), so the reads land in memory
        written before, as the touched reads here; a plain `read` job's buffers fault in on their
        first read, which measured 2.9-3.7 GB/s at 32M/qd32 against 4.2-4.4 touched (RAM device,
        0.5 GiB: each buffer page was read into once), no ceiling."""
        engine = "libaio" if direct else "psync"
        mode = ["--rw=rw", "--rwmixread=100"] if rw == "read" else [f"--rw={rw}"]
        argv = ["fio", "--name=kvp", f"--directory={self.folder}", *mode, f"--bs={bs}",
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
        """GB/s per point (block size / queue depth), each after a page cache drop; then the two
        points each trial reads at: `best` (fastest overall) and `landing` (fastest with a buffer
        beyond the CPU's cache, None when no point has one, e.g. buffered)."""
        points = FIO_DIRECT_POINTS if self.direct else FIO_BUFFERED_POINTS
        out: dict[str, float] = {}
        for bs, depth in points:
            self.sweep_drops_ok = drop_caches() and self.sweep_drops_ok
            gbps = self._run("read", bs, depth, self.direct)
            if gbps is not None:
                out[f"{bs}/qd{depth}"] = gbps
        self.points = out
        landing = {k: v for k, v in out.items() if point_buffer(k) >= LANDING_BYTES}
        self.best = max(out, key=out.__getitem__) if out else None
        self.landing = max(landing, key=landing.__getitem__) if landing else None
        return out

    def read_at(self, point: str | None, cold: Cold, label: str) -> float | None:
        """One cold read at a point of the sweep."""
        if point is None:
            return None
        cold.drop(f"fio {point} {label}")
        bs, depth = point.split("/qd")
        return self._run("read", bs, int(depth), self.direct)

    def read(self, cold: Cold, label: str) -> tuple[float | None, float | None]:
        """One cold read at `best` and one at `landing`: run beside each server read, so both sides
        of the ratios see the same moment of a device whose rate drifts."""
        best = self.read_at(self.best, cold, label)
        landing = best if self.landing == self.best else self.read_at(self.landing, cold, label)
        return best, landing

    def sweep_line(self) -> str:
        """The whole sweep, each point with its buffer, the two kept points named."""
        def mark(k: str) -> str:
            return "".join((" = fio best" if k == self.best else "", " = fio landing" if k == self.landing else ""))
        return ", ".join(f"{k} {v:.2f} ({_mib(point_buffer(k))}{mark(k)})" for k, v in self.points.items())


def read_threads(fio: Fio | None) -> int | None:
    """The threaded read's second variant: as many threads as reads in flight at fio's landing
    point (at most MAX_READ_THREADS); None without one (no fio, or buffered: psync's depth is 1)."""
    if fio is None or fio.landing is None:
        return None
    return min(MAX_READ_THREADS, int(fio.landing.split("/qd")[1]))


def faster(*rates: float | None) -> float | None:
    return max((x for x in rates if x is not None), default=None)


@dataclass
class Ceilings:
    """What one mode's files and fio's could be read at beside one server read (GB/s)."""

    read_gbps: float  # a threaded read of the same files, as many threads as the server's cores, into fresh memory
    read_touched_gbps: float  # the same into memory written before (no page faults)
    read_deep_gbps: float | None  # into touched memory with as many threads as fio landing's depth
    read_deep_threads: int | None
    fio_best_gbps: float | None  # fio at its sweep's best point, the faster of its reads before and after
    fio_landing_gbps: float | None  # fio at its best point with a buffer >= 256 MiB, the same way


@dataclass
class Trial:
    healthy_s: float
    first_hit_ms: float
    lookup_s: float  # L2 -> L1 for an L2 hit (with the serde's work), into L1 memory fresh after the restart
    retrieve_s: float  # L1 -> the engine's buffers
    warm_lookup_s: float  # the same into L1 memory the first read faulted in (as pinned L1 on a GPU node)
    warm_wrong: int
    ceilings: Ceilings
    aes_gbps: float | None  # AES-GCM open per core, this trial
    hit_chunks: int
    wrong: int
    order: tuple[str, ...] = ()  # the modes in the order this trial read them
    failed_drops: tuple[str, ...] = ()  # the cold reads whose page cache drop failed

    @property
    def valid(self) -> bool:
        return not self.failed_drops


@dataclass
class Mode:
    name: str
    server: LocalServer
    chunks: int
    seqs: int
    store_s: float = 0.0
    l2_bytes: int = 0
    trials: list[Trial] = field(default_factory=list)

    @property
    def valid(self) -> list[Trial]:
        return [t for t in self.trials if t.valid]


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
    clients: int = 1  # drivers reading back at once (--clients)

    @property
    def cpu_list(self) -> str | None:
        """The cores the server is held to, or None when the machine has fewer (then unpinned)."""
        have = os.cpu_count() or 1
        return f"0-{self.server_cpus - 1}" if self.server_cpus <= have and shutil.which("taskset") else None


def prepare(mode: str, size_gb: float, setup: Setup) -> Mode:
    """A server for mode with size_gb of KV stored in L2 (and stopped)."""
    chunks = int(size_gb * 2**30 // CHUNK_BYTES)
    encrypted = mode not in ("plain", "unchecked")
    target = make_target(l1_gb=setup.l1_gb, capacity_gb=size_gb * 1.25 + 1, encrypted=encrypted,
                         nvme=setup.nvme, server_cpu=str(setup.server_cpus), **SHAPE_PINS)
    label = f"{size_gb}-{mode}"
    root = setup.root
    server = TunedServer(target, root / f"volume-{label}", root / f"server-{label}.log",
                         write_key(root / f"key-{label}") if encrypted else None,
                         serde_type={"lmcache-aesgcm": "aesgcm", "unchecked": NO_SERDE}.get(mode), extra_args=setup.extra_args,
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



def _cold_read(files: list[Path], threads: int, direct: bool, touched: bool, cold: Cold, label: str) -> float:
    """One threaded read of files after a page cache drop (GB/s)."""
    cold.drop(label)
    raw_bytes, raw_s = threaded_read(files, threads, direct, touched)
    return raw_bytes / raw_s / 1e9


PROFILE: list[Path] = []  # --profile: the folder for perf's records of each cold L2 -> L1 read


@contextlib.contextmanager
def profiled(label: str, server_pid: int | None = None) -> Iterator[None]:
    """With --profile, `perf record -a -g` (cpu-clock: every process and kernel thread, the loop
    device's included) around the block, and the top of its report by thread name, library and
    symbol: the whole machine's, and the lmcache server's alone (`.server.txt`), whose share the
    client's own work would otherwise drown."""
    perf = shutil.which("perf")
    if not PROFILE or perf is None:
        yield
        return
    data = PROFILE[0] / (re.sub(r"\W+", "-", label) + ".data")
    rec = subprocess.Popen([perf, "record", "-q", "-e", "cpu-clock", "-F", "10000", "-a", "-g", "-o", str(data)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # perf's own start
    try:
        yield
    finally:
        rec.send_signal(signal.SIGINT)
        rec.wait(timeout=60)
        views = {".txt": [], ".server.txt": ["--pid", str(server_pid)] if server_pid else None}
        for suffix, only in views.items():
            if only is None:
                continue
            report = subprocess.run([perf, "report", "-i", str(data), "--no-children", "--sort", "comm,dso,sym", "--stdio",
                                     "-g", "none", "--percent-limit", "0.5", *only], capture_output=True, text=True,
                                    timeout=300)
            data.with_suffix(suffix).write_text(report.stdout)
        if server_pid:
            script = subprocess.run([perf, "script", "-i", str(data), "--pid", str(server_pid), "-F", "tid,period,ip,sym,dso"],
                                    capture_output=True, text=True, timeout=300)
            data.with_suffix(".server-seconds.txt").write_text(cpu_seconds(script.stdout))


# What a server sample's time went to, by its leaf frame (AES-GCM anywhere in the stack): CPU-seconds,
# not percentages of the whole machine, in which the client's own work drowns the server's.
CPU_KINDS = (("AES-GCM (the serde's open)", re.compile(r"aes_gcm|gcm_|ghash", re.I), True),
             ("kernel copy of the file's pages (the adapter's reads)",
              re.compile(r"copy_user|rep_movs|shmem_file_read_iter|filemap_read|copy_page_to_iter|_copy_to_iter"), False),
             ("page faults and zeroing", re.compile(r"clear_page|do_anonymous_page|handle_mm_fault|exc_page_fault"), False),
             ("memcpy and torch copies (the retrieve into the client's buffers)",
              re.compile(r"memcpy|memmove|direct_copy_kernel|index_copy|copy_kernel|loop_2d"), False),
             ("waiting (futex, scheduler)", re.compile(r"futex|__schedule|finish_task_switch|poll"), False),
             ("Python interpreter (lmcache's request path)", re.compile(r"libpython"), False))


def cpu_seconds(script: str) -> str:
    """`perf script -F tid,period,ip,sym,dso` of one process, summed: CPU-seconds by kind and by thread."""
    kinds: dict[str, int] = {}
    threads: dict[str, int] = {}
    for block in script.split("\n\n"):
        lines = [line.strip() for line in block.strip().splitlines() if line.strip()]
        if not lines or len(head := lines[0].split()) < 2 or not head[1].isdigit():
            continue
        tid, period, stack = head[0].split("/")[-1], int(head[1]), lines[1:]
        threads[tid] = threads.get(tid, 0) + period
        kind = next((name for name, pattern, whole in CPU_KINDS
                     if any(pattern.search(frame) for frame in (stack if whole else stack[:1]))), "other")
        kinds[kind] = kinds.get(kind, 0) + period
    total = sum(kinds.values()) or 1
    rows = [f"{v / 1e9:7.3f} s {100 * v / total:5.1f}%  {k}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
    busiest = ", ".join(f"{t} {v / 1e9:.2f} s" for t, v in sorted(threads.items(), key=lambda kv: -kv[1])[:8])
    return "\n".join([f"server CPU-seconds in the window: {total / 1e9:.3f}", *rows, f"busiest threads: {busiest}", ""])


def busy_s(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: the time during which at least one was in
    progress. Several drivers' lookups overlap, so their sum would count the same seconds twice."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def verify(m: Mode, clients: int) -> dict[str, Any]:
    """kvdriver verify over all of m's sequences. With clients > 1, that many drivers at once, each
    over its own part, beginning together (--start-at), under ids of their own: their rows in
    sequence order, their summed summary, and `lookup_s` / `retrieve_s`, the unions of their
    lookups' and retrieves' intervals."""
    clients = min(clients, m.seqs)
    if clients == 1:
        return drive_subprocess("verify", m.server.rpc_url, m.server.http_url, f"0:{m.seqs}", timeout=1800, extra=EXTRA)
    bounds = [m.seqs * i // clients for i in range(clients + 1)]
    extra = (*EXTRA, "--start-at", str(time.time() + START_MARGIN_S * clients))

    def part(i: int) -> dict[str, Any]:  # each driver's KV under an id of its own, as each vLLM replica's
        seqs = f"{bounds[i]}:{bounds[i + 1]}"
        return drive_subprocess("verify", m.server.rpc_url, m.server.http_url, seqs, timeout=1800,
                                extra=(*extra, "--instance-id", str(1000 + i)))

    with ThreadPoolExecutor(clients) as pool:
        parts = list(pool.map(part, range(clients)))
    rows = sorted((r for p in parts for r in p["sequences"]), key=lambda r: r["seq"])
    late = max(p["late_s"] for p in parts)
    if late > 0:
        print(f"{m.name}: a driver was up {late:.1f} s after the common start (START_MARGIN_S)", flush=True)
    return {"sequences": rows, "summary": {k: sum(p["summary"][k] for p in parts) for k in parts[0]["summary"]},
            "lookup_s": busy_s((r["lookup_at"], r["lookup_at"] + r["lookup_ms"] / 1000) for r in rows),
            "retrieve_s": busy_s((r["retrieve_at"], r["retrieve_at"] + r["retrieve_ms"] / 1000)
                                 for r in rows if "retrieve_at" in r)}


def read_back(m: Mode, direct: bool, threads: int, deep_threads: int | None, fio: Fio | None,
              cold: Cold, clients: int = 1) -> tuple[dict[str, Any], Ceilings]:
    """One cold restart of m's server and a read of everything it stored, then threaded reads of
    the same files into fresh and into touched memory, and into touched memory with fio's depth
    (each cold); fio reads its own files at its best and its landing point before and after, and
    the faster of the two is each point's ceiling at that moment. Why both: this virtual disk's
    rate drifts by the minute (0.33 to 2.57 GB/s in one session), so whichever read came at a slow
    minute alone would misstate the ceiling. Every drop is recorded in cold."""
    fio_before = fio.read(cold, f"before {m.name}") if fio else (None, None)
    cold.drop(f"{m.name} L2 → L1")
    healthy_s = m.server.start()
    try:
        with profiled(f"{m.name} L2 to L1", m.server.proc.pid if m.server.proc else None):
            read = verify(m, clients)
        # Again into L1 memory the first read faulted in: L1 emptied (lmcache's POST /cache/clear,
        # L1 only), the page cache dropped, everything read from L2 once more.
        clear_l1(m.server.http_url)
        cold.drop(f"{m.name} L2 → L1, touched L1")
        warm = verify(m, clients)
    finally:
        m.server.stop(signal.SIGKILL)
    files = chunk_files(m.server.l2_dir)
    fresh = _cold_read(files, threads, direct, False, cold, f"{m.name} read, {threads} threads, fresh")
    touched = _cold_read(files, threads, direct, True, cold, f"{m.name} read, {threads} threads, touched")
    deep_n = min(deep_threads, len(files)) if deep_threads else None
    deep = _cold_read(files, deep_n, direct, True, cold, f"{m.name} read, {deep_n} threads") if deep_n else None
    fio_after = fio.read(cold, f"after {m.name}") if fio else (None, None)
    ceilings = Ceilings(fresh, touched, deep, deep_n, faster(fio_before[0], fio_after[0]), faster(fio_before[1], fio_after[1]))
    return {**read, "healthy_s": healthy_s, "warm": warm}, ceilings




def clear_l1(http_url: str) -> None:
    """Empties the server's L1 (its admin API); the memory stays with lmcache's allocator."""
    request = urllib.request.Request(http_url + "/cache/clear", data=b'{"tier": "l1", "force": false}',
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as r:
        r.read()


def _lookup_s(read: dict[str, Any]) -> float:
    """A read's L2 → L1 time: its lookups' sum, or their union when several drivers read (verify)."""
    return read["lookup_s"] if "lookup_s" in read else sum(r["lookup_ms"] for r in read["sequences"]) / 1000


def trial(modes: list[Mode], fio: Fio | None, direct: bool, threads: int, deep_threads: int | None,
          clients: int = 1) -> None:
    """Every mode read back once (in the order given), then the ceilings of this trial; the trial
    is invalid when any of its page cache drops failed."""
    cold = Cold()
    reads = {m.name: read_back(m, direct, threads, deep_threads, fio, cold, clients) for m in modes}
    aes = aesgcm_open_per_core()
    order = tuple(m.name for m in modes)
    for m in modes:
        read, ceilings = reads[m.name]
        rows = read["sequences"]
        m.trials.append(Trial(
            healthy_s=read["healthy_s"], first_hit_ms=rows[0]["lookup_ms"] + rows[0].get("retrieve_ms", 0.0),
            lookup_s=_lookup_s(read),
            retrieve_s=read.get("retrieve_s", sum(r.get("retrieve_ms", 0.0) for r in rows) / 1000),
            warm_lookup_s=_lookup_s(read["warm"]),
            warm_wrong=read["warm"]["summary"]["wrong_bytes"] + m.chunks - read["warm"]["summary"]["hit_chunks"],
            ceilings=ceilings, aes_gbps=aes, hit_chunks=read["summary"]["hit_chunks"], wrong=read["summary"]["wrong_bytes"],
            order=order, failed_drops=tuple(cold.failed)))
    print(trial_line(modes, aes), flush=True)


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _over(a: float, b: float | None) -> float | None:
    return a / b if b else None


def trial_line(modes: list[Mode], aes: float | None) -> str:
    """The last trial of modes: its order, its validity, and per mode the server's rates beside
    the ceilings (fio best / landing, and L2 → L1 over fio landing, the ceiling that lands in memory)."""
    last = modes[0].trials[-1]
    head = f"trial {len(modes[0].trials)} (order {', '.join(last.order)})"
    if not last.valid:
        head += (f" INVALID, left out of medians and ratios: the page cache drop failed before "
                 f"{'; '.join(last.failed_drops)}")
    parts = []
    for m in modes:
        t, c = m.trials[-1], m.trials[-1].ceilings
        l2 = m.l2_bytes / t.lookup_s / 1e9
        parts.append(f"{m.name} L2→L1 {l2:.2f} GB/s (touched L1 {m.l2_bytes / t.warm_lookup_s / 1e9:.2f}), "
                     f"read {c.read_gbps:.2f} (touched {c.read_touched_gbps:.2f}; {c.read_deep_threads or 'n/a'} threads "
                     f"{_f(c.read_deep_gbps)}), fio best {_f(c.fio_best_gbps)} landing {_f(c.fio_landing_gbps)}, "
                     f"L2→L1 / fio landing {_f(_over(l2, c.fio_landing_gbps))}")
    return f"{head}: " + "; ".join(parts) + f"; AES-GCM/core {_f(aes)}"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_or_none(values: list[float]) -> float | None:
    """A median for the JSON: None, not NaN (no valid JSON), when nothing was measured."""
    return statistics.median(values) if values else None


def _ratios(values: list[float]) -> str:
    return f"{median(values):.2f} ({', '.join(f'{x:.2f}' for x in values)})" if values else "n/a"


def _per(trials: list[Trial], rate: Callable[[Trial], float], ceiling: Callable[[Trial], float | None]) -> list[float]:
    """rate(t) / ceiling(t) for each trial that has the ceiling."""
    return [rate(t) / c for t in trials if (c := ceiling(t))]


def trial_entry(m: Mode, t: Trial) -> dict[str, Any]:
    """One trial of one mode as the JSON keeps it (invalid ones too, marked)."""
    c = t.ceilings
    return {"order": list(t.order), "valid": t.valid, "failed_drops": list(t.failed_drops),
            "l2_to_l1_gbps": m.l2_bytes / t.lookup_s / 1e9, "l2_to_l1_touched_gbps": m.l2_bytes / t.warm_lookup_s / 1e9,
            "end_to_end_gbps": m.l2_bytes / (t.lookup_s + t.retrieve_s) / 1e9, "healthy_s": t.healthy_s,
            "first_hit_ms": t.first_hit_ms, "hit_chunks": t.hit_chunks, "wrong_bytes": t.wrong,
            "fio_best": c.fio_best_gbps, "fio_landing": c.fio_landing_gbps, "threaded_read_gbps": c.read_gbps,
            "threaded_read_touched_gbps": c.read_touched_gbps, "threaded_read_deep_gbps": c.read_deep_gbps,
            "read_deep_threads": c.read_deep_threads}


def figures(m: Mode) -> dict[str, Any]:
    """One mode's medians over its valid trials (the JSON's mode entry; the table prints the same
    numbers); without a valid trial, only what was stored and the trials."""
    t = m.valid
    out: dict[str, Any] = {"name": m.name, "chunks": m.chunks, "l2_bytes": m.l2_bytes, "store_s": round(m.store_s, 2),
                           "valid_trials": len(t), "trials": [trial_entry(m, x) for x in m.trials]}
    if not t:
        return out

    def l2(x: Trial) -> float:
        return m.l2_bytes / x.lookup_s / 1e9

    def l2_touched(x: Trial) -> float:
        return m.l2_bytes / x.warm_lookup_s / 1e9

    def e2e(x: Trial) -> float:
        return m.l2_bytes / (x.lookup_s + x.retrieve_s) / 1e9

    def fio_best(x: Trial) -> float | None:
        return x.ceilings.fio_best_gbps

    def fio_landing(x: Trial) -> float | None:
        return x.ceilings.fio_landing_gbps

    def deep(x: Trial) -> float | None:
        return x.ceilings.read_deep_gbps

    return {
        **out, "hit_chunks": min(x.hit_chunks for x in t), "wrong_bytes": sum(x.wrong for x in t),
        "touched_l1_misses_or_wrong": sum(x.warm_wrong for x in t),
        "l2_to_l1_touched_gbps": median([l2_touched(x) for x in t]),
        "l2_to_l1_touched_over_read_touched": [l2_touched(x) / x.ceilings.read_touched_gbps for x in t],
        "l2_to_l1_touched_over_fio": _per(t, l2_touched, fio_best),
        "l2_to_l1_touched_over_fio_landing": _per(t, l2_touched, fio_landing),
        "l2_to_l1_touched_over_read_deep": _per(t, l2_touched, deep),
        "healthy_s": median([x.healthy_s for x in t]), "first_hit_ms": median([x.first_hit_ms for x in t]),
        "l2_to_l1_gbps": median([l2(x) for x in t]),
        "end_to_end_gbps": median([e2e(x) for x in t]),
        "retrieve_gbps": median([m.l2_bytes / x.retrieve_s / 1e9 for x in t if x.retrieve_s > 0]),
        "threaded_read_gbps": median([x.ceilings.read_gbps for x in t]),
        "threaded_read_touched_gbps": median([x.ceilings.read_touched_gbps for x in t]),
        "threaded_read_deep_gbps": median_or_none([g for x in t if (g := deep(x)) is not None]),
        "read_deep_threads": t[0].ceilings.read_deep_threads,
        "fio_best_gbps": median_or_none([g for x in t if (g := fio_best(x)) is not None]),
        "fio_landing_gbps": median_or_none([g for x in t if (g := fio_landing(x)) is not None]),
        "l2_to_l1_over_read": [l2(x) / x.ceilings.read_gbps for x in t],
        "l2_to_l1_over_read_touched": [l2(x) / x.ceilings.read_touched_gbps for x in t],
        "l2_to_l1_over_read_deep": _per(t, l2, deep),
        "l2_to_l1_over_fio": _per(t, l2, fio_best),
        "l2_to_l1_over_fio_landing": _per(t, l2, fio_landing),
        "end_to_end_over_fio": _per(t, e2e, fio_best),
        "end_to_end_over_fio_landing": _per(t, e2e, fio_landing),
    }


def report(size_gb: float, modes: list[Mode], setup: Setup, fio: Fio | None) -> dict[str, Any]:
    """Prints the tables (valid trials only) and returns the run's JSON entry."""
    every = modes[0].trials
    t0 = modes[0].valid
    invalid = [(i + 1, x.failed_drops) for i, x in enumerate(every) if not x.valid]
    aes = [x.aes_gbps for x in t0 if x.aes_gbps]
    threads = setup.server_cpus
    rows = [figures(m) for m in modes]
    direct = bool(setup.nvme.get("directIO", True))
    deep_n = next((x.ceilings.read_deep_threads for x in every if x.ceilings.read_deep_threads), None)
    fio_best = [g for x in t0 if (g := x.ceilings.fio_best_gbps) is not None]
    fio_landing = [g for x in t0 if (g := x.ceilings.fio_landing_gbps) is not None]
    entry = {"size_gb": size_gb, "dir": str(setup.root), "direct_io": direct, "workers": serde_workers_of(setup),
             "clients": setup.clients,
             "server_cpus": threads, "pinned_cores": setup.cpu_list, "trials": len(every), "valid_trials": len(t0),
             "invalid_trials": [{"trial": i, "failed_drops": list(d)} for i, d in invalid],
             "baseline": {"fio_gbps": median(fio_best) if fio_best else None, "fio_note": fio.note if fio else "off",
                          "fio_sweep": fio.points if fio else {}, "fio_sweep_drops_ok": fio.sweep_drops_ok if fio else None,
                          "fio_best_point": fio.best if fio else None, "fio_best_gbps": median(fio_best) if fio_best else None,
                          "fio_landing_point": fio.landing if fio else None,
                          "fio_landing_gbps": median(fio_landing) if fio_landing else None,
                          "fio_landing_min_buffer_bytes": LANDING_BYTES,
                          "threaded_read_gbps": median_or_none([r["threaded_read_gbps"] for r in rows if "threaded_read_gbps" in r]),
                          "threaded_read_touched_gbps": median_or_none([r["threaded_read_touched_gbps"] for r in rows
                                                                        if "threaded_read_touched_gbps" in r]),
                          "threaded_read_deep_gbps": median_or_none([r["threaded_read_deep_gbps"] for r in rows
                                                                     if r.get("threaded_read_deep_gbps") is not None]),
                          "read_threads": threads, "read_deep_threads": deep_n},
             "aesgcm_gbps_per_core": median(aes) if aes else None, "modes": rows}
    print(f"\n### {size_gb} GiB stored, {len(t0)} valid trials of {len(every)} "
          f"(medians; ratios per trial, each trial in brackets)\n")
    for i, drops in invalid:
        print(f"INVALID trial {i}: the page cache drop failed before {'; '.join(drops)}; left out of everything below")
    if not t0:
        print("No valid trial: no figure.")
        return entry
    print(f"Server: {threads} CPU requested ({serde_workers_of(setup)} serde workers), held to cores "
          f"{setup.cpu_list or 'all (this machine has fewer)'}; direct I/O {'on' if direct else 'off'}; "
          + (f"{setup.clients} drivers at once (L2 → L1: the union of their lookups); " if setup.clients > 1 else "")
          + f"{fio_line(fio, fio_best, fio_landing)}; AES-GCM open {median(aes):.2f} GB/s a core.\n")
    deep = f"read, {deep_n} threads" if deep_n else "read, fio's depth"
    print(f"| L2 | stored | chunks hit | wrong bytes | restart → healthy (s) | first L2 hit after restart (ms) | "
          f"L2 → L1 (GB/s) | L1 → engine alone (GB/s) | L2 → L1 → engine (GB/s) | read, {threads} threads, fresh / "
          f"touched memory (GB/s) | {deep}, touched (GB/s) | fio best / landing (GB/s) | L2 → L1 / fio best | "
          f"L2 → L1 / fio landing | L2 → L1 / read, fresh | L2 → L1 / read, touched | L2 → L1 / {deep} | "
          f"end to end / fio best | end to end / fio landing |")
    print("|" + " --- |" * 19)
    for r in rows:
        print(f"| {r['name']} | {r['l2_bytes'] / 1e9:.2f} GB | {r['hit_chunks']}/{r['chunks']} | {r['wrong_bytes']} | "
              f"{r['healthy_s']:.2f} | {r['first_hit_ms']:.1f} | {r['l2_to_l1_gbps']:.2f} | {r['retrieve_gbps']:.2f} | "
              f"{r['end_to_end_gbps']:.2f} | {r['threaded_read_gbps']:.2f} / {r['threaded_read_touched_gbps']:.2f} | "
              f"{_f(r['threaded_read_deep_gbps'])} | {_f(r['fio_best_gbps'])} / {_f(r['fio_landing_gbps'])} | "
              f"{_ratios(r['l2_to_l1_over_fio'])} | {_ratios(r['l2_to_l1_over_fio_landing'])} | "
              f"{_ratios(r['l2_to_l1_over_read'])} | {_ratios(r['l2_to_l1_over_read_touched'])} | "
              f"{_ratios(r['l2_to_l1_over_read_deep'])} | {_ratios(r['end_to_end_over_fio'])} | "
              f"{_ratios(r['end_to_end_over_fio_landing'])} |")
    print("\nRead again from L2 into L1 memory the first read faulted in (L1 emptied by lmcache's /cache/clear, "
          "page cache dropped), as a GPU node's pinned L1 is:\n")
    print(f"| L2 | misses or wrong chunks | L2 → L1, touched L1 (GB/s) | read, {threads} threads, touched memory (GB/s) | "
          f"{deep}, touched (GB/s) | fio best / landing (GB/s) | L2 → L1 / read, touched | L2 → L1 / {deep} | "
          f"L2 → L1 / fio best | L2 → L1 / fio landing |")
    print("|" + " --- |" * 10)
    for r in rows:
        print(f"| {r['name']} | {r['touched_l1_misses_or_wrong']} | {r['l2_to_l1_touched_gbps']:.2f} | "
              f"{r['threaded_read_touched_gbps']:.2f} | {_f(r['threaded_read_deep_gbps'])} | "
              f"{_f(r['fio_best_gbps'])} / {_f(r['fio_landing_gbps'])} | "
              f"{_ratios(r['l2_to_l1_touched_over_read_touched'])} | {_ratios(r['l2_to_l1_touched_over_read_deep'])} | "
              f"{_ratios(r['l2_to_l1_touched_over_fio'])} | {_ratios(r['l2_to_l1_touched_over_fio_landing'])} |")
    print(f"\n{fio_legend(fio)}")
    plain = next((m for name in BASELINES for m in modes if m.name == name), None)
    if plain is not None and len(modes) > 1:
        over_baseline(modes, plain, rows, aes, setup)
    return entry


def over_baseline(modes: list[Mode], plain: Mode, rows: list[dict[str, Any]], aes: list[float], setup: Setup) -> None:
    """Each mode's rates over the baseline's (unchecked when it ran, else plain), trial by trial
    (valid trials: the same for all modes)."""
    base = plain.name
    print(f"\n| mode | L2 → L1: mode / {base} | L2 → L1, touched L1: mode / {base} | end to end: "
          f"mode / {base} | first L2 hit: mode / {base} (time) | AES-GCM open, {serde_workers_of(setup)} workers "
          f"x one core (GB/s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for m in modes:
        if m is plain:
            continue
        pairs = [(a, b) for a, b in zip(m.trials, plain.trials, strict=True) if a.valid and b.valid]
        l2 = [(m.l2_bytes / a.lookup_s) / (plain.l2_bytes / b.lookup_s) for a, b in pairs]
        e2e = [(m.l2_bytes / (a.lookup_s + a.retrieve_s)) / (plain.l2_bytes / (b.lookup_s + b.retrieve_s)) for a, b in pairs]
        touched = [(m.l2_bytes / a.warm_lookup_s) / (plain.l2_bytes / b.warm_lookup_s) for a, b in pairs]
        first = [a.first_hit_ms / b.first_hit_ms for a, b in pairs]
        row = next(r for r in rows if r["name"] == m.name)
        row["over_baseline"], row["touched_over_baseline"], row["baseline"] = median(l2), median(touched), base
        print(f"| {m.name} | {_ratios(l2)} | {_ratios(touched)} | {_ratios(e2e)} | {_ratios(first)} | "
              f"{median(aes) * serde_workers_of(setup):.2f} |")


def fio_line(fio: Fio | None, best: list[float], landing: list[float]) -> str:
    """What fio measured, or why it did not."""
    if fio is None:
        return "fio not run (--no-fio)"
    if not best or fio.best is None:
        return f"fio: no figure ({fio.note or 'no read succeeded'})"
    return (f"fio best {median(best):.2f} GB/s at {fio.best}, fio landing "
            + (f"{median(landing):.2f} GB/s at {fio.landing}" if landing and fio.landing else "n/a (no point with a "
               f"buffer of {_mib(LANDING_BYTES)})")
            + (f" ({fio.note})" if fio.note else "") + ("" if fio.sweep_drops_ok else " (a drop of its sweep failed)"))


def fio_legend(fio: Fio | None) -> str:
    """Which fio figure is which, in words."""
    if fio is None or fio.best is None:
        return "No fio figure."
    landing = (f"fio landing = {fio.landing} (buffer {_mib(point_buffer(fio.landing))}): the fastest point whose "
               f"buffer is at least {_mib(LANDING_BYTES)}, so its reads land in memory as the server's reads into L1 "
               f"do: the ceiling to hold L2 → L1 against." if fio.landing else
               f"fio landing: none (no point of the sweep has a buffer of {_mib(LANDING_BYTES)}).")
    return (f"fio best = {fio.best} (buffer {_mib(point_buffer(fio.best))}): the sweep's fastest point whatever its "
            f"buffer; a small buffer stays in the CPU's cache, which no read into L1 does, so it can overstate the "
            f"ceiling. {landing} Sweep (GB/s, buffer): {fio.sweep_line()}.")


def serde_workers_of(setup: Setup) -> int:
    return serde_workers(make_target(server_cpu=str(setup.server_cpus), **SHAPE_PINS))


@dataclass(frozen=True)
class RamDevice:
    """An ext4 on a loop device over a file in /dev/shm: O_DIRECT works on it (a tmpfs refuses
    O_DIRECT), so the server reads as in production while the device reads at memory speed."""

    image: Path
    device: str
    mount: Path
    size_gb: int


def _command(argv: list[str]) -> str:
    """One command of --ram-device's setup, bounded (a wedged losetup or mount must not hang the
    bench); a failure stops the bench with the command and what it said."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=RAM_DEVICE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"--ram-device: `{' '.join(argv)}` failed: {e}") from e
    if done.returncode != 0:
        raise SystemExit(f"--ram-device: `{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


def _undo(argv: list[str]) -> bool:
    """One clean-up command, bounded; a failure is printed, not raised, so the steps after it still run."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=RAM_DEVICE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"--ram-device clean-up: `{' '.join(argv)}` failed: {e}", file=sys.stderr, flush=True)
        return False
    if done.returncode != 0:
        print(f"--ram-device clean-up: `{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}",
              file=sys.stderr, flush=True)
    return done.returncode == 0


def _unmount(mount: Path) -> None:
    """umount, retried while a just-killed server's files may still be open; lazily at last, so
    the loop device can still be detached (it then goes once the last user closes it)."""
    for _ in range(3):
        if _undo(["umount", str(mount)]):
            return
        time.sleep(1)
    _undo(["umount", "-l", str(mount)])


def _ram_device_checks(size_gb: int) -> None:
    if os.geteuid() != 0:
        raise SystemExit("--ram-device needs root (losetup, mkfs.ext4 and mount): run as root, or give --dir")
    missing = [c for c in ("truncate", "losetup", "mkfs.ext4", "mount", "umount") if shutil.which(c) is None]
    if missing:
        raise SystemExit(f"--ram-device: {', '.join(missing)} not found")
    free = shutil.disk_usage("/dev/shm").free
    if size_gb * 2**30 > free:
        raise SystemExit(f"--ram-device {size_gb}: /dev/shm has {free / 2**30:.1f} GiB free")


@contextlib.contextmanager
def ram_device(size_gb: int) -> Iterator[RamDevice]:
    """--ram-device: set up, yielded, and removed again whatever happens (an error, Ctrl-C, a
    SIGTERM: main turns it into SystemExit): unmounted, detached, the image and the mount dir
    deleted. The clean-up ignores further Ctrl-C/SIGTERM, so a second one cannot strand a device."""
    _ram_device_checks(size_gb)
    image = Path(f"/dev/shm/kvp-bench-{os.getpid()}.img")
    mount = Path(tempfile.mkdtemp(prefix="kvp-bench-mnt-"))
    device: str | None = None
    mounted = False
    try:
        _command(["truncate", "-s", f"{size_gb}G", str(image)])
        device = _command(["losetup", "-f", "--show", str(image)])
        if not device.startswith("/dev/"):
            raise SystemExit(f"--ram-device: `losetup -f --show {image}` printed no device: {device!r}")
        # Inode tables and journal written now, not by ext4's background thread during the reads.
        _command(["mkfs.ext4", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", device])
        _command(["mount", device, str(mount)])
        mounted = True
        yield RamDevice(image, device, mount, size_gb)
    finally:
        handlers = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if mounted:
                _unmount(mount)
            if device is not None:
                _undo(["losetup", "-d", device])
            image.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                mount.rmdir()
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)


def _terminated(signum: int, _frame: Any) -> None:
    """SIGTERM (a `timeout`, a kill) as an exception: the finally blocks stop the servers and
    remove the RAM device, which Python's default (dying at once) would leave behind."""
    raise SystemExit(128 + signum)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-gb", default="1")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--request-tokens", type=int, default=TOKENS_PER_SEQ,
                        help="tokens per request, a multiple of 256 (a chunk); default %(default)s")
    parser.add_argument("--dir", default=None, help="where the L2 folders go (default: a temp dir on /var/tmp)")
    parser.add_argument("--ram-device", type=int, default=None, metavar="SIZE_GB",
                        help="put the L2 folders on an ext4 on a loop device over a SIZE_GB GiB file in /dev/shm, set "
                        "up and removed by the bench (root): O_DIRECT as in production, at memory speed; not with --dir")
    parser.add_argument("--keep", action="store_true", help="keep the stored files afterwards")
    parser.add_argument("--l1-gb", type=float, default=3.0,
                        help="L1 of the server: with the serde each L2 write needs a temporary copy in L1's free room "
                        "(1 - trigger watermark), so 1 GiB (a tenth free) is too small for 128 MiB writes")
    parser.add_argument("--modes", "--l2", default=",".join(MODES),
                        help="aesgcm (spec.l2.encryption on, the default: kvpersist's serde), lmcache-aesgcm (lmcache's "
                        "own serde), plain (off: checked frames), unchecked (no serde: the baseline); any of them")
    parser.add_argument("--adapter", choices=["fs_native", "nixl_store_dynamic", "fs"], default=None,
                        help="spec.l2.nvme.adapter (default: the API's default)")
    parser.add_argument("--direct-io", choices=["on", "off"], default=None,
                        help="spec.l2.nvme.directIO (default: the API's, on); off for a RAM-backed --dir (tmpfs)")
    parser.add_argument("--server-cpus", type=int, default=int(DEFAULT_SERVER_CPU),
                        help="the server pod's CPU request: the serde's workers follow it, and the process is held "
                        "to that many cores (default: the rendered request)")
    parser.add_argument("--backend-param", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra nixl_store_dynamic backend_params entry (repeat it), e.g. use_posix_aio=true")
    parser.add_argument("--clients", type=int, default=1,
                        help="read back with this many drivers at once, each over its own part of the sequences, as "
                        "several vLLM replicas read from one server (default 1: one request at a time)")
    parser.add_argument("--no-fio", action="store_true", help="skip fio's ceiling")
    parser.add_argument("--json", default=None, help=f"also write the figures here (schema {SCHEMA})")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="perf record (whole machine, cpu-clock) each cold L2 -> L1 read into DIR, with its report by "
                        "thread, library and symbol (DIR/<mode>-L2-to-L1.txt)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra `lmcache server` argument after the rendered ones (repeat it), to try a setting")
    args = parser.parse_args()
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.ram_device is not None and args.dir:
        parser.error("--ram-device and --dir: give one (--ram-device makes the folder itself)")
    if args.ram_device is not None and args.keep:
        parser.error("--ram-device and --keep: the device is removed afterwards, with its files")
    if args.ram_device is not None and args.ram_device < 1:
        parser.error("--ram-device: at least 1 (GiB)")
    if args.clients < 1:
        parser.error("--clients: at least 1")
    return args


def bench(args: argparse.Namespace, root: Path, ram: RamDevice | None) -> list[float]:
    """Every size's run; the sizes that had no valid trial."""
    nvme = {**({"adapter": args.adapter} if args.adapter else {}),
            **({"directIO": args.direct_io == "on"} if args.direct_io else {})}
    setup = Setup(root, args.l1_gb, nvme, tuple(args.server_arg), max(1, args.server_cpus),
                  dict(kv.split("=", 1) for kv in args.backend_param), args.clients)
    direct = args.direct_io != "off"
    cold = drop_caches()
    runs: list[dict[str, Any]] = []
    for size in (float(s) for s in args.sizes_gb.split(",")):
        modes = [prepare(name, size, setup) for name in args.modes.split(",")]
        chunks = modes[0].chunks
        fio = None if args.no_fio else Fio(root / f"fio-{size}", chunks, chunks * CHUNK_BYTES, direct)
        if fio is not None and not fio.prepare():
            print(f"fio: {fio.note}", flush=True)  # no ceiling from fio: its read() says None
        elif fio is not None:
            print(f"fio sweep (GB/s, buffer = block size x depth): {fio.sweep_line()}; each trial reads at fio best "
                  f"{fio.best} and fio landing {fio.landing or 'n/a'}" + (f" ({fio.note})" if fio.note else "")
                  + ("" if fio.sweep_drops_ok else " (a page cache drop of the sweep failed)"), flush=True)
        deep = read_threads(fio)
        for i in range(args.trials):
            trial(modes[i % len(modes):] + modes[:i % len(modes)], fio, fio.direct if fio else direct,
                  setup.server_cpus, deep, setup.clients)
        runs.append(report(size, modes, setup, fio))
        if args.json:  # after each size, so a run stopped later still leaves what it measured
            Path(args.json).write_text(json.dumps({
                "schema": SCHEMA, "cores": os.cpu_count(), "page_cache_dropped": cold,
                "ram_device": {"device": ram.device, "size_gb": ram.size_gb, "image": str(ram.image)} if ram else None,
                "invalid_trials": sum(len(r["invalid_trials"]) for r in runs), "runs": runs}, indent=1) + "\n")
    print(f"\npage cache dropped before cold reads: {cold}; extra server args: {args.server_arg or 'none'}; "
          f"extra backend params: {setup.backend_params or 'none'}; "
          f"adapter: {args.adapter or 'default'}; direct I/O: {'on' if direct else 'off'}; cores here: {os.cpu_count()}; "
          f"L2 on: {f'{ram.device} (ext4 on a {ram.size_gb} GiB file in /dev/shm) at {root}' if ram else root}")
    print("invalid trials (a page cache drop failed): " + ", ".join(
        f"{len(r['invalid_trials'])} of {r['trials']} at {r['size_gb']:g} GiB" for r in runs))
    return [r["size_gb"] for r in runs if r["trials"] and not r["valid_trials"]]


def main() -> None:
    args = parse_args()
    request_tokens(args.request_tokens)
    signal.signal(signal.SIGTERM, _terminated)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        PROFILE.append(args.profile)
    if args.ram_device is not None:
        with ram_device(args.ram_device) as ram:
            print(f"RAM device: {ram.device}, ext4 on {ram.image} ({ram.size_gb} GiB), mounted at {ram.mount}", flush=True)
            failed = bench(args, ram.mount, ram)
    else:
        root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvpersist-bench-", dir="/var/tmp"))
        root.mkdir(parents=True, exist_ok=True)
        try:
            failed = bench(args, root, None)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    if failed:
        raise SystemExit(f"no valid trial at {', '.join(f'{s:g} GiB' for s in failed)}: every one had a failed page "
                         "cache drop (not root?), so no cold figure was measured")


if __name__ == "__main__":
    main()
