#!/usr/bin/env python3
"""Break-even of an L2 hit: is bringing a prefix's KV back from L2 faster than the GPU recomputing it?

A hit pays only when the restore runs faster than prefill "produces" KV. This script measures both
sides on one machine (issues #26 item 4, #41 item 4) and prints, per model shape and context length,
the restore rate above which a hit beats recomputing, next to the whole restore path's measured rate:

(a) Prefill: a stack of a few random-weight decoder layers shaped like Llama-3.1-8B (hidden 4096,
    32 query / 8 KV heads of 128, SwiGLU MLP 14336) and Llama-3.1-70B (8192, 64 / 8, 28672) with
    RMSNorm, RoPE (included in the time) and torch's SDPA (causal, GQA), in bfloat16. The median
    time of one forward over T tokens, per layer, scaled to the full depth (32 / 80 layers), gives
    tokens/s; times the full model's KV bytes per token (bfloat16: 128 KiB / 320 KiB) it is the KV
    bytes/s that recomputing produces = the break-even L2 read rate. The SDPA time alone is
    measured beside it, and a FLOP-based TFLOP/s (FLOPs computed from the shapes, over the measured
    time) is printed as a sanity check, labelled so.
(b) Restore: N chunk files of 32 MiB (a Llama-8B 256-token chunk), sealed with the project's own
    serde (kvpersist.inserver.serve: seal / open_frame / AeadKeys, its frames of 2 MiB segments,
    AES-256-GCM), written to a folder on this machine's disk; page cache dropped before every
    pass (drop_caches, which needs root, and/or posix_fadvise DONTNEED per file; the share of pages
    still resident is measured with mincore and printed); then read back (i) plainly with 1, 4 and
    all-cores threads, (ii) as the authenticated path does it: each file into a buffer, then
    authenticated and decrypted into a destination buffer, with 1, 4 and all-cores threads. An
    untimed pass then checks every decrypted byte against what was written, and that a flipped
    byte, another key and another frame version are refused. Also measured: AES-GCM open from
    memory (the CPU's ceiling for (ii)) and, on a GPU, the pinned host-to-device copy rate (H2D).
(c) The verdict: a hit beats recomputing only if the whole restore path does, L2 -> L1 then L1 -> GPU,
    composed serially: bytes / (bytes / L2->L1 + bytes / H2D), against recompute's KV rate. L2 -> L1
    is the lmcache server's measured rate when --datapath-json gives one (benchmarks/datapath_bench.py
    --json: the server's lookup of cold L2 chunks, its serde included), else this script's own best
    file read from (b) (labelled "own": no server in it). H2D is the copy measured in (b); on a CPU
    there is none, and the verdict is a CPU stand-in that composes the read alone. A pipelined
    variant, min(L2 -> L1, H2D), is printed beside it as an estimate (it assumes full overlap).

Every printed rate and time is measured on the run; estimates are labelled. Everything also goes
to one JSON file (--json), rewritten after each phase so a killed run leaves what it had.

On the GPU machine, run it through benchmarks/gpu_run.py, which runs the server's L2 path first and
passes its JSON here, within one 10-minute command (give it a 600 s limit):

    python3 benchmarks/gpu_run.py --out "$OUT"

Alone (torch with CUDA, `cryptography` >= 45 importable; --budget-s 420 by default, split over the
measurements, and the run stops early, printing what it has, rather than overrun):

    python benchmarks/breakeven.py --device cuda --json "$OUT/breakeven.json" [--datapath-json datapath.json]

(without cryptography only the plain reads run, and the JSON says so.)

Check the plan first without running anything big (works on a CPU-only machine too):
`python benchmarks/breakeven.py --device cuda --dry-run`. Try it on a CPU:
`python benchmarks/breakeven.py --device cpu --quick` (1/4-width stand-in shapes that are no
real model, 256 MiB of chunks, about 20 s on 2 cores; its numbers only show the script works).

What it cannot show:
- There is no vLLM: random-weight layers with torch's SDPA (FlashAttention-2, cuDNN or
  memory-efficient, whichever is fastest here) stand in for a real model's prefill. vLLM's own
  kernels (FlashAttention-3 on Hopper, fused norms/RoPE, CUDA graphs, chunked prefill, writing
  the paged KV cache, the LM head) make real prefill somewhat faster or slower; the embedding and
  LM head (logits for the last token only) are left out.
- Without --datapath-json the L2 -> L1 step is the serde and the file path alone, not the lmcache
  server (its L1 allocation, nixl/fs adapter, scheduling). The H2D step is one 1 GiB pinned copy,
  not lmcache's own copy of a hit into vLLM's paged KV cache. 32 MiB files (and datapath_bench's
  32 MiB chunks) are the 8B chunk size; a 70B 256-token chunk is 80 MiB.
- The disk is whatever holds --dir on the machine it runs on: a GPU test machine's disk is not
  necessarily a GPU node's NVMe array (its mount, file system and device are printed).
- Restore and recompute are compared as rates; overlapping a restore with other work, or a
  layer-wise pipelined load, moves the break-even in the restore's favour (the pipelined column
  is an estimate of that bound, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import itertools
import json
import os
import platform
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SERVE_PY = ROOT / "operator" / "kvpersist" / "inserver" / "serve.py"
SCHEMA = "kvpersist-breakeven/1"
KV_ITEMSIZE = 2  # the KV cache is stored in bfloat16 / float16, whatever dtype the stand-in computes in
MAGIC = 0x6B7670657273  # "kvpers": the second half of each chunk's 16-byte header
GB = 1e9  # rates are decimal GB/s


@dataclass(frozen=True)
class Shape:
    """A decoder layer's shape and the full model's depth (for KV bytes per token and scaling)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    note: str

    def linear_params(self) -> int:
        """Weights of one layer's matmuls: fused QKV, O, fused gate/up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, as the KV cache stores them (bfloat16)."""
        return self.layers * self.kv_heads * self.head_dim * 2 * KV_ITEMSIZE

    def flops_per_layer(self, tokens: int) -> float:
        """Matmul FLOPs of one layer's causal prefill of `tokens` (QK^T and PV over the lower triangle)."""
        return 2.0 * tokens * self.linear_params() + 2.0 * self.heads * self.head_dim * tokens * (tokens + 1)

    def weight_bytes(self, layers: int, itemsize: int) -> int:
        return layers * (self.linear_params() + 2 * self.hidden) * itemsize

    def activation_bytes(self, tokens: int, itemsize: int, math_attention: bool) -> int:
        """A generous estimate of a forward's peak activations (to skip what would not fit)."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        per_token = 4 * self.intermediate + 8 * self.hidden + 4 * qkv + 2 * self.heads * self.head_dim
        scores = 2 * self.heads * tokens * tokens if math_attention else 0
        return tokens * (per_token + scores) * itemsize


SHAPES: dict[str, Shape] = {
    "llama-8b": Shape("llama-8b", 4096, 32, 8, 128, 14336, 32, "Llama-3.1-8B"),
    "llama-70b": Shape("llama-70b", 8192, 64, 8, 128, 28672, 80, "Llama-3.1-70B"),
    "mini-8b": Shape("mini-8b", 1024, 8, 2, 128, 3584, 32, "quick stand-in: llama-8b at 1/4 width, not a real model"),
    "mini-70b": Shape("mini-70b", 2048, 16, 2, 128, 7168, 80, "quick stand-in: llama-70b at 1/4 width, not a real model"),
}


def say(*parts: object) -> None:
    print(*parts, flush=True)


# ---------------------------------------------------------------- setup


def _load_internals() -> None:
    """kvpersist.inserver.lmcache_internals, which serve.py imports: the installed one, else by path
    under that name inside stand-in packages (the GPU machine has no kvpersist), as the server's
    program does (kvpersist.inserver.program_source)."""
    try:
        importlib.import_module("kvpersist.inserver.lmcache_internals")
        return
    except ImportError:
        pass
    for name in ("kvpersist", "kvpersist.inserver"):
        package = sys.modules.setdefault(name, ModuleType(name))
        package.__path__ = []  # type: ignore[attr-defined]
    name = "kvpersist.inserver.lmcache_internals"
    spec = importlib.util.spec_from_file_location(name, SERVE_PY.with_name("lmcache_internals.py"))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def load_serve() -> ModuleType:
    """kvpersist.inserver.serve by path: the GPU machine has no kvpersist installed."""
    _load_internals()
    spec = importlib.util.spec_from_file_location("kvpersist_inserver_serve", SERVE_PY)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {SERVE_PY}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="small stand-in shapes and little data (a CPU trial)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the budget split, run nothing big")
    p.add_argument("--budget-s", type=float, help="total wall time (default 420 on cuda, 40 quick, 300 cpu)")
    p.add_argument("--json", default="breakeven.json", help="where to write the results")
    p.add_argument("--datapath-json", help="benchmarks/datapath_bench.py --json output: the lmcache server's measured L2 -> L1 "
                   "rate, used in the verdict instead of this script's own file read")
    p.add_argument("--dir", help="folder for the chunk files (default: a temporary one under the current folder)")
    p.add_argument("--shapes", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--contexts", help="comma list of token counts")
    p.add_argument("--layers", type=int, help="layers measured per shape (scaled to the full depth)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    p.add_argument("--warmup", type=int, help="warm-up forwards per measurement (excluded)")
    p.add_argument("--repeats", type=int, help="timed forwards per measurement (median)")
    p.add_argument("--l2-gib", type=float, help="chunk data to write (capped at a third of the free disk)")
    p.add_argument("--chunk-mib", type=float, default=32.0)
    p.add_argument("--threads", help="comma list of reader threads (default 1,4,all cores)")
    p.add_argument("--rounds", type=int, help="rounds of all read passes (median)")
    p.add_argument("--cache-drop", choices=("auto", "drop_caches", "fadvise", "none"),
                   help="auto: drop_caches (root) and fadvise per file; quick default fadvise (per file, leaves others' cache alone)")
    a = p.parse_args(argv)
    gpu, quick = a.device == "cuda", a.quick
    cores = usable_cores()
    defaults: dict[str, Any] = {
        "budget_s": 40.0 if quick else 420.0 if gpu else 300.0,
        "shapes": "mini-8b,mini-70b" if quick else "llama-8b,llama-70b",
        "contexts": "256,512" if quick else "4096,8192,16384,32768" if gpu else "512,1024,2048",
        "layers": 1 if quick or not gpu else 2,
        "warmup": 2 if gpu else 1,
        "repeats": 3 if quick else 5 if gpu else 3,
        "l2_gib": 0.25 if quick else 16.0 if gpu else 4.0,
        "threads": ",".join(str(t) for t in sorted({1, 4, cores})),
        "rounds": 1 if quick else 3,
        "cache_drop": "fadvise" if quick else "auto",
    }
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.shape_list = [SHAPES[s.strip()] for s in a.shapes.split(",") if s.strip()]
    a.context_list = sorted(ints(a.contexts))
    a.thread_list = sorted(set(ints(a.threads)))
    if not a.shape_list or not a.context_list or not a.thread_list or min(a.thread_list) < 1:
        p.error("--shapes, --contexts and --threads need at least one valid entry")
    return a


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def read_kv_file(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(":")
            out.setdefault(key.strip(), value.strip())
    return out


def meminfo_bytes(key: str) -> int | None:
    value = read_kv_file("/proc/meminfo").get(key)
    return int(value.split()[0]) * 1024 if value else None


def cpu_flags() -> set[str]:
    return set(read_kv_file("/proc/cpuinfo").get("flags", "").split())


def mount_of(path: Path) -> dict[str, Any]:
    """The mount that holds path (longest mount point prefix): its source, file system type and,
    for a block device, whether it is rotational."""
    real = str(path.resolve())
    best: tuple[str, str, str] = ("", "?", "?")
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            point = parts[1].replace("\\040", " ")
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best[0]):
                best = (point, parts[0], parts[2])
    info: dict[str, Any] = {"mount_point": best[0], "source": best[1], "fstype": best[2], "rotational": None}
    name = os.path.basename(best[1]) if best[1].startswith("/dev/") else ""
    for candidate in (f"/sys/class/block/{name}/queue/rotational", f"/sys/class/block/{name}/../queue/rotational"):
        if name and os.path.exists(candidate):
            info["rotational"] = Path(candidate).read_text().strip() == "1"
            break
    return info


def device_facts(args: argparse.Namespace, data_parent: Path) -> dict[str, Any]:
    """The raw facts of the machine: what the numbers were measured on."""
    import torch

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_model": read_kv_file("/proc/cpuinfo").get("model name"),
        "cpu_logical": os.cpu_count(),
        "cpu_usable": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "cpu_flags": sorted(cpu_flags() & {"aes", "vaes", "avx2", "avx512f", "avx512_bf16", "amx_bf16"}),
        "mem_total_bytes": meminfo_bytes("MemTotal"),
        "mem_available_bytes": meminfo_bytes("MemAvailable"),
        "root": os.geteuid() == 0 if hasattr(os, "geteuid") else None,
        "gpu": None,
    }
    try:
        import cryptography
        from cryptography.hazmat.backends.openssl.backend import backend

        facts["cryptography"] = cryptography.__version__
        facts["openssl"] = backend.openssl_version_text()
    except Exception as exc:  # the authenticated path is then reported as not run
        facts["cryptography"] = f"missing ({type(exc).__name__}: {exc})"
    if args.device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts["gpu"] = {"name": props.name, "count": torch.cuda.device_count(), "capability": f"{props.major}.{props.minor}",
                        "memory_bytes": props.total_memory, "sm_count": props.multi_processor_count,
                        "cudnn": torch.backends.cudnn.version()}
    usage = shutil.disk_usage(data_parent)
    facts["disk"] = {"dir": str(data_parent.resolve()), "total_bytes": usage.total, "free_bytes": usage.free, **mount_of(data_parent)}
    return facts


def pick_dtype(args: argparse.Namespace) -> tuple[str, str]:
    """bfloat16 on a GPU; on a CPU bfloat16 only where it has native bf16 math (AMX / AVX512-BF16)."""
    if args.dtype != "auto":
        return args.dtype, "asked"
    if args.device == "cuda":
        return "bfloat16", "GPU"
    flags = cpu_flags()
    if flags & {"amx_bf16", "avx512_bf16"}:
        return "bfloat16", "CPU has " + "/".join(sorted(flags & {"amx_bf16", "avx512_bf16"}))
    return "float32", "CPU without native bfloat16"


# ---------------------------------------------------------------- budget


class Budget:
    """The total wall time, split: prefill first (its share), then the disk gets what is left."""

    PREFILL_SHARE = 0.40

    def __init__(self, total_s: float) -> None:
        self.t0 = time.monotonic()
        self.total_s = total_s
        self.reserve_s = max(3.0, 0.04 * total_s)  # printing, the JSON, removing the files
        self.prefill_end = self.t0 + self.PREFILL_SHARE * (total_s - self.reserve_s)
        self.end = self.t0 + total_s - self.reserve_s
        self.notes: list[str] = []
        self.stops: list[str] = []

    def stop(self, note: str) -> None:
        """Something left out or cut short to keep within the budget (the run 'stopped early')."""
        self.stops.append(note)
        self.notes.append(note)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.end - time.monotonic()

    def start_prefill(self) -> None:
        """Prefill's share of what is left once torch is imported and the facts are read."""
        now = time.monotonic()
        self.prefill_end = now + self.PREFILL_SHARE * (self.end - now)

    def prefill_left(self) -> float:
        return self.prefill_end - time.monotonic()

    def split(self) -> dict[str, float]:
        work = self.total_s - self.reserve_s
        return {"total_s": self.total_s, "reserve_s": round(self.reserve_s, 1), "prefill_s": round(self.PREFILL_SHARE * work, 1),
                "disk_s": round((1 - self.PREFILL_SHARE) * work, 1)}


# ---------------------------------------------------------------- (a) prefill


@dataclass
class AttnChoice:
    backend: Any  # an SDPBackend, or None for torch's own choice
    native_gqa: bool

    @property
    def label(self) -> str:
        name = getattr(self.backend, "name", "default")
        return f"{name} ({'native GQA' if self.native_gqa else 'K/V repeated'})"


def sdpa_context(choice: AttnChoice) -> contextlib.AbstractContextManager[Any]:
    if choice.backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel([choice.backend])


def attend(q: Any, k: Any, v: Any, choice: AttnChoice) -> Any:
    """Causal SDPA with GQA: natively (enable_gqa) or with K/V repeated to the query heads."""
    import torch.nn.functional as F

    if choice.native_gqa:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), is_causal=True)


def make_weights(shape: Shape, layers: int, device: str, dtype: Any) -> list[dict[str, Any]]:
    """Random weights, std 0.02 (bfloat16 activations stay finite over a few layers): one random
    block of a prime length tiled over each matrix, as drawing a billion normals takes a CPU half a
    minute and the values do not change a dense matmul's speed."""
    import torch

    q, kv, h = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden
    block = torch.randn(1048573, device=device, dtype=torch.float32).mul_(0.02).to(dtype)  # the largest prime < 2**20

    def rnd(rows: int, cols: int) -> Any:
        count = rows * cols
        return block.repeat(-(-count // block.numel()))[:count].view(rows, cols)

    out = []
    for _ in range(layers):
        out.append({"ln1": torch.ones(h, device=device, dtype=dtype), "qkv": rnd(q + 2 * kv, h), "o": rnd(h, q),
                    "ln2": torch.ones(h, device=device, dtype=dtype), "gate_up": rnd(2 * shape.intermediate, h),
                    "down": rnd(h, shape.intermediate)})
    return out


def rope_tables(tokens: int, head_dim: int, device: str, dtype: Any) -> tuple[Any, Any]:
    """Llama-3's RoPE cos/sin (theta 500000), computed once per length as vLLM caches them."""
    import torch

    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(tokens, device=device, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope(x: Any, cos: Any, sin: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention_inputs(qkv: Any, shape: Shape, cos: Any, sin: Any) -> tuple[Any, Any, Any]:
    """q, k, v for SDPA, (1, heads, T, 128), laid out as the layer makes them (views of the fused
    projection, RoPE on q and k): a backend is probed on the very strides it will be timed on."""
    t, d = qkv.shape[0], shape.head_dim
    q, k, v = qkv.split([shape.heads * d, shape.kv_heads * d, shape.kv_heads * d], dim=-1)
    q = rope(q.view(t, shape.heads, d).transpose(0, 1), cos, sin)
    k = rope(k.view(t, shape.kv_heads, d).transpose(0, 1), cos, sin)
    v = v.view(t, shape.kv_heads, d).transpose(0, 1)
    return q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)


def random_qkv(shape: Shape, tokens: int, device: str, dtype: Any) -> Any:
    import torch

    return torch.randn(tokens, (shape.heads + 2 * shape.kv_heads) * shape.head_dim, device=device, dtype=dtype)


def decoder_layer(x: Any, w: dict[str, Any], shape: Shape, cos: Any, sin: Any, choice: AttnChoice) -> Any:
    """One Llama decoder layer's prefill: RMSNorm, QKV, RoPE, causal GQA SDPA, O, RMSNorm, SwiGLU."""
    import torch.nn.functional as F

    t = x.shape[0]
    h = F.rms_norm(x, (shape.hidden,), w["ln1"], 1e-5)
    o = attend(*attention_inputs(F.linear(h, w["qkv"]), shape, cos, sin), choice)
    x = x + F.linear(o.squeeze(0).transpose(0, 1).reshape(t, shape.heads * shape.head_dim), w["o"])
    gate, up = F.linear(F.rms_norm(x, (shape.hidden,), w["ln2"], 1e-5), w["gate_up"]).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w["down"])


def timer(device: str) -> Callable[[Callable[[], Any]], float]:
    """Seconds of one call: CUDA events around it on a GPU (synchronized), perf_counter on a CPU."""
    import torch

    if device == "cuda":
        def cuda_time(fn: Callable[[], Any]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return cuda_time

    def cpu_time(fn: Callable[[], Any]) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return cpu_time


def is_oom(exc: BaseException) -> bool:
    import torch

    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    text = str(exc).lower()
    return isinstance(exc, oom | MemoryError) or "out of memory" in text or "can't allocate memory" in text


def free_memory(device: str) -> int:
    import torch

    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    return meminfo_bytes("MemAvailable") or 0


def release(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def attention_candidates(device: str) -> list[Any]:
    """Fused SDPA backends only on a GPU: the math one would need T x T scores per head (128 GiB at 32k)."""
    from torch.nn.attention import SDPBackend

    if device == "cuda":
        return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def rank_attention(shape: Shape, tokens: int, device: str, dtype: Any) -> tuple[list[AttnChoice], list[dict[str, Any]]]:
    """Times each SDPA backend (native GQA, and K/V repeated) at one length: those that ran, fastest first."""
    import torch

    measure = timer(device)
    probes: list[dict[str, Any]] = []
    ranked: list[tuple[float, AttnChoice]] = []
    with torch.inference_mode():
        cos, sin = rope_tables(tokens, shape.head_dim, device, dtype)
        q, k, v = attention_inputs(random_qkv(shape, tokens, device, dtype), shape, cos, sin)
        for backend in attention_candidates(device):
            for native in (True, False):
                choice = AttnChoice(backend, native)

                def once(c: AttnChoice = choice) -> Any:
                    return attend(q, k, v, c)

                try:
                    with sdpa_context(choice), warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # torch explains each backend it cannot use
                        measure(once)
                        seconds = statistics.median(measure(once) for _ in range(3))
                except RuntimeError as exc:
                    if is_oom(exc):
                        raise
                    probes.append({"backend": choice.label, "tokens": tokens, "error": str(exc).splitlines()[0][:160]})
                    continue
                probes.append({"backend": choice.label, "tokens": tokens, "seconds": seconds})
                ranked.append((seconds, choice))
    if not ranked:
        raise RuntimeError("no SDPA backend ran: " + "; ".join(p.get("error", "") for p in probes))
    return [c for _, c in sorted(ranked, key=lambda r: r[0])], probes


def time_forward(shape: Shape, weights: list[dict[str, Any]], tokens: int, choice: AttnChoice, args: argparse.Namespace,
                 dtype: Any, share: float) -> tuple[list[float], list[float], bool]:
    """Warm-up forwards (excluded), then as many timed ones as the share allows (at most --repeats),
    then SDPA alone at the same length: (forward times, SDPA times, whether the output is finite).
    Its own frame, so that an OOM's tensors go with it."""
    import torch

    device, measure, started = args.device, timer(args.device), time.monotonic()
    with torch.inference_mode(), sdpa_context(choice):
        x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype)
        cos, sin = rope_tables(tokens, shape.head_dim, device, dtype)

        def forward() -> Any:
            y = x
            for w in weights:
                y = decoder_layer(y, w, shape, cos, sin, choice)
            return y

        per_run = min([measure(forward) for _ in range(max(1, args.warmup))])
        repeats = max(1, min(args.repeats, int((share - (time.monotonic() - started)) / max(per_run, 1e-6))))
        times = [measure(forward) for _ in range(repeats)]
        finite = bool(torch.isfinite(forward()).all())
        q, k, v = attention_inputs(random_qkv(shape, tokens, device, dtype), shape, cos, sin)
        measure(lambda: attend(q, k, v, choice))
        attn = [measure(lambda: attend(q, k, v, choice)) for _ in range(min(3, repeats))]
    return times, attn, finite


@dataclass
class PrefillResult:
    shape: str
    tokens: int
    status: str  # ok | skipped | oom | error
    reason: str = ""
    layers_measured: int = 0
    full_layers: int = 0
    dtype: str = ""
    attention: str = ""
    warmup: int = 0
    times_s: list[float] = field(default_factory=list)
    median_s: float | None = None
    per_layer_s: float | None = None
    attention_per_layer_s: float | None = None
    full_model_s: float | None = None
    tokens_per_s: float | None = None
    kv_bytes_per_token: int = 0
    recompute_kv_gbps: float | None = None
    flops_full_model: float = 0.0
    flop_based_tflops: float | None = None


def run_prefill(args: argparse.Namespace, budget: Budget, dtype_name: str, out: dict[str, Any], save: Callable[[], None]) -> None:
    """Every (context, shape) in turn, shortest context first, each within its share of the prefill budget."""
    import torch

    device, dtype = args.device, getattr(torch, dtype_name)
    results: list[PrefillResult] = out["prefill"]
    stacks: dict[str, list[dict[str, Any]]] = {}
    choices: dict[str, list[AttnChoice]] = {}  # shape -> the SDPA backends that ran, fastest first
    dead: dict[str, str] = {}  # shape -> why its larger contexts are skipped
    last: dict[str, tuple[float, float]] = {}  # shape -> (flops, seconds) of its last forward
    for shape in args.shape_list:
        need = shape.weight_bytes(args.layers, dtype.itemsize)
        if need > 0.8 * free_memory(device):
            dead[shape.name] = f"its {args.layers} layers' weights ({need / 2**30:.1f} GiB) would not fit memory"
            continue
        if budget.prefill_left() <= 0:
            dead[shape.name] = "time budget: no prefill time left to set it up"
            budget.stop(f"prefill {shape.name} left out: {dead[shape.name]}")
            continue
        try:
            t = time.monotonic()
            with torch.inference_mode():
                stacks[shape.name] = make_weights(shape, args.layers, device, dtype)
                choices[shape.name], probes = rank_attention(shape, min(args.context_list[0], 4096), device, dtype)
            out["attention_probes"][shape.name] = probes
            say(f"  {shape.name}: {args.layers} layers of random weights ({need / 2**30:.2f} GiB) in {time.monotonic() - t:.1f} s; "
                f"SDPA: {choices[shape.name][0].label}")
        except Exception as exc:
            stacks.pop(shape.name, None)
            dead[shape.name] = ("out of memory: " if is_oom(exc) else "failed: ") + str(exc).splitlines()[0][:160]
            release(device)
    todo = [(t, s) for t in args.context_list for s in args.shape_list]
    for index, (tokens, shape) in enumerate(todo):
        row = PrefillResult(shape.name, tokens, "skipped", layers_measured=args.layers, full_layers=shape.layers, dtype=dtype_name,
                            kv_bytes_per_token=shape.kv_bytes_per_token(),
                            flops_full_model=shape.flops_per_layer(tokens) * shape.layers)
        results.append(row)
        if shape.name in dead:
            row.reason = dead[shape.name]
            continue
        share = budget.prefill_left() / (len(todo) - index)
        flops = shape.flops_per_layer(tokens) * args.layers
        predicted = None
        if shape.name in last:
            predicted = last[shape.name][1] * flops / last[shape.name][0]
        elif last:  # another shape's achieved FLOP rate
            f0, s0 = next(reversed(last.values()))
            predicted = s0 * flops / f0
        if budget.prefill_left() <= 0:
            row.reason = "time budget: no prefill time left"
            budget.stop(f"prefill {shape.name} at {tokens} tokens skipped: {row.reason}")
            continue
        # Each shape's first length runs whenever prefill time is left (a row per shape), unless it
        # would overrun the whole budget; the rest only within about their share.
        limit = budget.left() if shape.name not in last else 2 * share
        if predicted is not None and (args.warmup + 1) * predicted > limit:
            row.reason = f"time budget (predicted {predicted:.2f} s a forward, {limit:.1f} s left for it)"
            budget.stop(f"prefill {shape.name} at {tokens} tokens skipped: {row.reason}")
            continue
        need = shape.activation_bytes(tokens, dtype.itemsize, getattr(choices[shape.name][0].backend, "name", "") == "MATH")
        if need > 0.9 * free_memory(device):
            row.reason = (f"would not fit memory (estimated {need / 2**30:.1f} GiB of activations, "
                          f"{free_memory(device) / 2**30:.1f} free)")
            continue
        failure = ""
        for choice in list(choices[shape.name]):
            try:
                row.times_s, attn, finite = time_forward(shape, stacks[shape.name], tokens, choice, args, dtype, share)
                failure = ""
                break
            except Exception as exc:  # OOM: this shape's longer contexts are skipped; another error: the next backend
                failure = ("oom: " if is_oom(exc) else "error: ") + f"{choice.label}: " + str(exc).splitlines()[0][:200]
            release(device)
            if failure.startswith("oom"):
                break
            choices[shape.name].remove(choice)
            budget.notes.append(f"prefill {shape.name} at {tokens} tokens: SDPA {failure[7:]}; dropped for this shape")
        if failure:
            row.status, row.reason = failure.split(": ", 1)
            if row.status == "oom":
                dead[shape.name] = f"out of memory at {tokens} tokens"
            elif not choices[shape.name]:
                dead[shape.name] = f"no SDPA backend left ({row.reason})"
            continue
        release(device)
        repeats = len(row.times_s)
        row.attention = choice.label
        row.warmup = max(1, args.warmup)
        if not finite:
            row.reason = "non-finite activations (timing kept)"
        row.status = "ok"
        row.median_s = statistics.median(row.times_s)
        row.per_layer_s = row.median_s / args.layers
        row.attention_per_layer_s = statistics.median(attn)
        row.full_model_s = row.per_layer_s * shape.layers
        row.tokens_per_s = tokens / row.full_model_s
        row.recompute_kv_gbps = row.tokens_per_s * shape.kv_bytes_per_token() / GB
        row.flop_based_tflops = flops / row.median_s / 1e12
        last[shape.name] = (flops, row.median_s)
        say(f"  {shape.name:9} {tokens:6} tokens: {row.median_s * 1000:8.1f} ms for {args.layers} layers (median of {repeats}), "
            f"{row.tokens_per_s:10.0f} tokens/s full depth, recompute makes KV at {sig(row.recompute_kv_gbps)} GB/s")
        save()
    stacks.clear()
    release(device)


def measure_h2d(budget: Budget) -> dict[str, Any]:
    """Pinned host -> GPU copy rate: the last step of a real hit, after the serde."""
    import torch

    if budget.left() < 10:
        return {"status": "skipped", "reason": "time budget"}
    size = 1 << 30
    buffers: dict[str, Any] = {}

    def copy() -> Any:
        return buffers["dev"].copy_(buffers["host"], non_blocking=True)

    try:
        buffers["host"] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        buffers["dev"] = torch.empty(size, dtype=torch.uint8, device="cuda")
        measure = timer("cuda")
        for _ in range(2):
            measure(copy)
        times = [measure(copy) for _ in range(5)]
        buffers.clear()
        release("cuda")
        return {"status": "ok", "bytes": size, "times_s": times, "gbps": size / statistics.median(times) / GB}
    except Exception as exc:
        buffers.clear()
        release("cuda")
        return {"status": "error", "reason": str(exc).splitlines()[0][:200]}


# ---------------------------------------------------------------- (b) restore


def header(index: int) -> bytes:
    return struct.pack("<QQ", index, MAGIC)


def filled(size: int) -> bytearray:
    """A buffer with every page touched (as lmcache's preallocated L1 is), so no page fault is timed."""
    return bytearray(b"\0") * size


def read_into(path: str, view: memoryview) -> int:
    with open(path, "rb", buffering=0) as f:
        n = 0
        while n < len(view):
            got = f.readinto(view[n:])
            if not got:
                break
            n += got
    return n


def write_all(path: str, view: memoryview) -> None:
    with open(path, "wb", buffering=0) as f:
        n = 0
        while n < len(view):
            n += f.write(view[n:]) or 0


def resident_fraction(paths: list[str], sample: int = 64) -> float | None:
    """The share of the files' pages in the page cache (mincore), on an even sample of the files:
    whether a 'cold' read really is one."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        page = os.sysconf("SC_PAGE_SIZE")
        step = max(1, len(paths) // sample)
        resident = total = 0
        for path in paths[::step]:
            size = os.path.getsize(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr is None or addr == ctypes.c_void_p(-1).value:
                    return None
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                rc = libc.mincore(addr, size, vec)
                libc.munmap(addr, size)
                if rc != 0:
                    return None
                resident += sum(b & 1 for b in bytes(vec))
                total += pages
            finally:
                os.close(fd)
        return resident / total if total else None
    except (OSError, AttributeError, ValueError):
        return None


def make_cold(paths: list[str], method: str) -> dict[str, Any]:
    """Drops the files from the page cache by the asked method and measures what is still resident."""
    out: dict[str, Any] = {"method": method, "drop_caches": None, "fadvise": None}
    if method != "none":
        os.sync()
    if method in ("auto", "drop_caches"):
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            out["drop_caches"] = "ok"
        except OSError as exc:
            out["drop_caches"] = f"failed: {exc.strerror or exc}"
    if method in ("auto", "fadvise"):
        try:
            for path in paths:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            out["fadvise"] = "ok"
        except (OSError, AttributeError) as exc:
            out["fadvise"] = f"failed: {exc}"
    out["resident_fraction"] = resident_fraction(paths)
    return out


COLD_RESIDENT_MAX = 0.02  # of the files' pages still in memory before a read that counts as cold


def cold_read(read_pass: dict[str, Any]) -> bool:
    """Whether a read pass came from the device: the drop left at most COLD_RESIDENT_MAX of the files
    resident or, where residency cannot be measured, a drop worked. Other passes are unusable for the verdict."""
    cold = read_pass["cold"]
    if cold["resident_fraction"] is not None:
        return cold["resident_fraction"] <= COLD_RESIDENT_MAX
    return "ok" in (cold["drop_caches"], cold["fadvise"])


def _run_threads(workers: list[threading.Thread]) -> float:
    """Starts every worker, waits for all, and returns the wall seconds from first start to last join."""
    t = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.monotonic() - t


class Chunks:
    """The chunk files on disk and what they hold: file i's plaintext is `base` with header(i) in
    its first 16 bytes, sealed under one key (the project's AeadKeys, HKDF as lmcache derives it)."""

    def __init__(self, serve: ModuleType | None, folder: Path, chunk_bytes: int) -> None:
        self.serve = serve
        self.folder = folder
        self.plain_len = chunk_bytes
        self.frame_len = serve.sealed_size(chunk_bytes) if serve else chunk_bytes
        self.base = bytearray(os.urandom(chunk_bytes))
        keys = serve.AeadKeys(os.urandom(32), 32) if serve else None
        self.aead = keys.aead("breakeven") if keys else None
        self.fingerprint = keys.fingerprint if keys else b""
        self.files: list[tuple[int, str]] = []

    def binding(self, index: int) -> bytes:
        """File index's name as the serde binds it (a stand-in ObjectKey: the index as its hash)."""
        assert self.serve is not None
        name = SimpleNamespace(model_name="breakeven", kv_rank=0, object_group_id=0, chunk_hash=index.to_bytes(8, "big"),
                               cache_salt="breakeven")
        return self.serve.object_binding(self.fingerprint, "kvp-breakeven", name)

    def paths(self) -> list[str]:
        return [p for _, p in self.files]

    def write(self, count: int, threads: int, deadline: float) -> dict[str, Any]:
        """Seals and writes up to count files side by side, stopping at the deadline; then sync."""
        local = threading.local()

        def one(index: int) -> tuple[int, str] | None:
            if time.monotonic() > deadline:
                return None
            if not hasattr(local, "plain"):
                local.plain, local.frame = bytearray(self.base), filled(self.frame_len)
            local.plain[:16] = header(index)
            path = str(self.folder / f"chunk-{index:05d}.bin")
            if self.serve is not None:
                self.serve.seal(self.aead, self.fingerprint, self.binding(index), os.urandom(self.serve.IV_LEN),
                                memoryview(local.plain), memoryview(local.frame))
                write_all(path, memoryview(local.frame))
            else:
                write_all(path, memoryview(local.plain))
            return index, path

        t = time.monotonic()
        with ThreadPoolExecutor(max_workers=threads) as pool:
            done = [r for r in pool.map(one, range(count)) if r is not None]
        os.sync()
        seconds = time.monotonic() - t
        self.files = sorted(done)
        written = len(self.files) * self.frame_len
        return {"files": len(self.files), "asked": count, "bytes": written, "seconds": seconds, "threads": threads,
                "gbps": written / seconds / GB if seconds > 0 else None, "sealed": self.serve is not None,
                "note": "sealing + write + sync"}

    def read_pass(self, kind: str, threads: int, deadline: float) -> dict[str, Any]:
        """One pass over the files with `threads` readers: plain (file -> buffer) or auth (file ->
        buffer -> open_frame into a destination, its header checked). Stops taking files at the
        deadline; the rate is over what was read."""
        auth = kind == "auth"
        counter = itertools.count()
        lock = threading.Lock()
        state = {"bytes": 0, "files": 0, "failures": 0, "header_mismatches": 0}
        buffers = [(filled(self.frame_len), filled(self.plain_len) if auth else None) for _ in range(threads)]
        errors: list[BaseException] = []

        def worker(frame: bytearray, dst: bytearray | None) -> None:
            fv = memoryview(frame)
            dv = memoryview(dst) if dst is not None else None
            try:
                while True:
                    i = next(counter)
                    if i >= len(self.files) or time.monotonic() > deadline:
                        return
                    index, path = self.files[i]
                    n = read_into(path, fv)
                    failed = mismatch = False
                    if dv is not None:
                        try:
                            self.serve.open_frame(self.aead, self.fingerprint, self.binding(index), fv[:n], dv)  # type: ignore[union-attr]
                            mismatch = dv[:16] != header(index)
                        except Exception:
                            failed = True
                    with lock:
                        state["bytes"] += len(dv) if dv is not None else n
                        state["files"] += 1
                        state["failures"] += failed
                        state["header_mismatches"] += mismatch
            except BaseException as exc:  # reported, never a hung pass
                errors.append(exc)

        seconds = _run_threads([threading.Thread(target=worker, args=b, daemon=True) for b in buffers])
        if errors:
            raise errors[0]
        return {"kind": kind, "threads": threads, **state, "seconds": seconds, "partial": state["files"] < len(self.files),
                "gbps": state["bytes"] / seconds / GB if seconds > 0 and state["bytes"] else None}

    def verify(self, threads: int, deadline: float) -> dict[str, Any]:
        """Untimed: every file decrypts to exactly the bytes written, and a flipped byte, another
        key or another frame version is refused."""
        from cryptography.exceptions import InvalidTag

        serve = self.serve
        assert serve is not None
        counter = itertools.count()
        lock = threading.Lock()
        state = {"files_verified": 0, "mismatched_files": 0, "failed_files": 0, "bytes_compared": 0}

        def worker() -> None:
            frame, dst, expected = filled(self.frame_len), filled(self.plain_len), bytearray(self.base)
            while True:
                i = next(counter)
                if i >= len(self.files) or time.monotonic() > deadline:
                    return
                index, path = self.files[i]
                n = read_into(path, memoryview(frame))
                expected[:16] = header(index)
                try:
                    serve.open_frame(self.aead, self.fingerprint, self.binding(index), memoryview(frame)[:n], memoryview(dst))
                    same, failed = dst == expected, False
                except Exception:
                    same, failed = False, True
                with lock:
                    state["files_verified"] += 1
                    state["mismatched_files"] += not same and not failed
                    state["failed_files"] += failed
                    state["bytes_compared"] += len(dst)

        workers = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

        frame, dst = filled(self.frame_len), filled(self.plain_len)
        n = read_into(self.files[0][1], memoryview(frame))

        def refused(mutate: Callable[[], Any], aead: Any, expect: tuple[type[BaseException], ...],
                    fingerprint: bytes = self.fingerprint, binding: bytes = self.binding(self.files[0][0])) -> bool:
            undo = mutate()
            try:
                serve.open_frame(aead, fingerprint, binding, memoryview(frame)[:n], memoryview(dst))
                return False
            except expect:
                return True
            finally:
                undo()

        mid = serve.HEADER_LEN + self.plain_len // 2

        def flip(at: int) -> Callable[[], None]:
            frame[at] ^= 0x01
            return lambda: frame.__setitem__(at, frame[at] ^ 0x01)

        other = serve.AeadKeys(os.urandom(32), 32)
        tamper = refused(lambda: flip(mid), self.aead, (InvalidTag,))
        tag = refused(lambda: flip(n - 1), self.aead, (InvalidTag,))
        key = refused(lambda: (lambda: None), other.aead("breakeven"), (InvalidTag, serve.FrameError), other.fingerprint)
        name = refused(lambda: (lambda: None), self.aead, (InvalidTag,), binding=self.binding(self.files[0][0] + 1))

        def other_version() -> Callable[[], None]:
            was = frame[0]
            frame[0] = 0x7F  # no version of ours
            return lambda: frame.__setitem__(0, was)

        version = refused(other_version, self.aead, (serve.FrameError,))
        complete = state["files_verified"] == len(self.files)
        ok = state["files_verified"] > 0 and state["mismatched_files"] == 0 and state["failed_files"] == 0
        return {**state, "all_files": complete, "decrypted_bytes_match": ok, "flipped_ciphertext_refused": tamper,
                "flipped_tag_refused": tag, "other_key_refused": key, "other_name_refused": name,
                "other_version_refused": version}

    def aead_from_memory(self, threads: int, seconds: float) -> dict[str, Any]:
        """open_frame of a frame already in memory, for `seconds`: the CPU's ceiling for the auth path."""
        serve = self.serve
        assert serve is not None
        frame = filled(self.frame_len)
        n = read_into(self.files[0][1], memoryview(frame))
        done = [0] * threads
        copies = [(bytearray(frame[:n]), filled(self.plain_len)) for _ in range(threads)]
        binding = self.binding(self.files[0][0])
        stop = time.monotonic() + seconds

        def worker(slot: int) -> None:
            src, dst = copies[slot]
            while True:  # at least one open per thread
                serve.open_frame(self.aead, self.fingerprint, binding, memoryview(src), memoryview(dst))
                done[slot] += 1
                if time.monotonic() >= stop:
                    return

        wall = _run_threads([threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)])
        total = sum(done) * self.plain_len
        return {"threads": threads, "opens": sum(done), "seconds": wall, "gbps": total / wall / GB if wall > 0 else None}


def run_disk(args: argparse.Namespace, budget: Budget, serve: ModuleType | None, folder: Path, out: dict[str, Any],
             save: Callable[[], None]) -> None:
    """Write, then rounds of cold read passes (plain and auth, each thread count), then verify."""
    disk = out["disk"]
    chunk_bytes = int(args.chunk_mib * 2**20)
    free = shutil.disk_usage(folder).free
    count = max(1, min(int(args.l2_gib * 2**30 // chunk_bytes), int(free // 3 // chunk_bytes)))
    if count * chunk_bytes < args.l2_gib * 2**30:
        budget.notes.append(f"chunk data capped at {count} files (a third of the free {free / 2**30:.1f} GiB)")
    chunks = Chunks(serve, folder, chunk_bytes)
    kinds = ["plain", "auth"] if serve is not None else ["plain"]
    passes_per_round = len(kinds) * len(args.thread_list)
    disk_s = budget.left()
    disk.update({"dir": str(folder), "chunk_bytes": chunk_bytes, "frame_bytes": chunks.frame_len, "budget_s": round(disk_s, 1)})
    say(f"  writing {count} chunk files of {chunk_bytes / 2**20:.0f} MiB ({count * chunk_bytes / 2**30:.2f} GiB) to {folder} ...")
    disk["write"] = chunks.write(count, max(args.thread_list), time.monotonic() + 0.25 * disk_s)
    w = disk["write"]
    say(f"  wrote {w['files']} files, {w['bytes'] / GB:.2f} GB in {w['seconds']:.1f} s ({sig(w['gbps'] or 0)} GB/s, {w['note']})")
    if w["files"] < count:
        budget.stop(f"writing stopped at its share of the budget: {w['files']} of {count} files")
    save()
    tail = 0.10 * disk_s  # verify + AEAD from memory
    for rnd in range(args.rounds):
        round_left = budget.left() - tail
        if round_left <= 0:
            budget.stop(f"read rounds stopped after {rnd} of {args.rounds}: time budget")
            break
        if rnd > 0:
            last_round = sum(p["seconds"] + p.get("cold_s", 0) for p in disk["passes"] if p["round"] == rnd - 1)
            if last_round > round_left:
                budget.stop(f"read rounds stopped after {rnd} of {args.rounds}: another would overrun the budget")
                break
        share = round_left / ((args.rounds - rnd) * passes_per_round)
        for kind in kinds:
            for threads in args.thread_list:
                t = time.monotonic()
                cold = make_cold(chunks.paths(), args.cache_drop)
                cold_s = time.monotonic() - t
                result = chunks.read_pass(kind, threads, time.monotonic() + max(share - cold_s, 0.5))
                result.update({"round": rnd, "cold": cold, "cold_s": cold_s})
                disk["passes"].append(result)
                res = cold["resident_fraction"]
                say(f"  round {rnd + 1} {kind:5} x{threads:<3}: {result['bytes'] / GB:6.2f} GB in {result['seconds']:6.2f} s = "
                    f"{(result['gbps'] or 0):6.2f} GB/s{' (partial: budget)' if result['partial'] else ''}; resident before: "
                    f"{'unknown' if res is None else f'{res:.1%}'}; drop_caches {cold['drop_caches']}, fadvise {cold['fadvise']}")
                if result["partial"]:
                    budget.stop(f"{kind} x{threads} round {rnd + 1} read {result['files']} of {len(chunks.files)} files: time budget")
                if kind == "auth" and (result["failures"] or result["header_mismatches"]):
                    budget.notes.append(f"auth x{threads} round {rnd + 1}: {result['failures']} failed opens, "
                                        f"{result['header_mismatches']} wrong headers")
        save()
    rates: dict[str, float] = {}
    for kind in kinds:
        for threads in args.thread_list:
            got = [p["gbps"] for p in disk["passes"] if p["kind"] == kind and p["threads"] == threads and p["gbps"] and cold_read(p)]
            if got:
                rates[f"{kind} x{threads}"] = statistics.median(got)
    disk["rates_gbps"] = rates
    disk["warm_passes"] = sum(not cold_read(p) for p in disk["passes"])
    if disk["warm_passes"]:
        budget.notes.append(f"{disk['warm_passes']} of {len(disk['passes'])} read passes left out of the verdict: the page cache "
                            "could not be dropped before them (their reads may have come from memory)")
    residents = [p["cold"]["resident_fraction"] for p in disk["passes"] if p["cold"]["resident_fraction"] is not None]
    disk["max_resident_fraction_before_reads"] = max(residents) if residents else None
    disk["drop_caches_worked"] = any(p["cold"]["drop_caches"] == "ok" for p in disk["passes"])
    if serve is not None and chunks.files:
        per = max(0.3, min(1.5, max(budget.left() - 2, 0) * 0.05 / len(args.thread_list)))
        disk["aead_from_memory"] = [chunks.aead_from_memory(t, per) for t in args.thread_list]
        for a in disk["aead_from_memory"]:
            say(f"  AES-GCM open from memory x{a['threads']:<3}: {(a['gbps'] or 0):6.2f} GB/s")
        disk["verify"] = chunks.verify(max(args.thread_list), time.monotonic() + max(budget.left() - 1, 2.0))
        v = disk["verify"]
        say(f"  verify: {v['files_verified']}/{len(chunks.files)} files decrypted to the written bytes: {v['decrypted_bytes_match']}; "
            f"refused: flipped ciphertext {v['flipped_ciphertext_refused']}, flipped tag {v['flipped_tag_refused']}, "
            f"other key {v['other_key_refused']}, other name {v['other_name_refused']}, "
            f"other version {v['other_version_refused']}")
    else:
        disk["verify"] = {"decrypted_bytes_match": False, "reason": "cryptography missing: the authenticated path was not run"}
    save()


# ---------------------------------------------------------------- report


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


DATAPATH_SCHEMA = "kvpersist-datapath/2"
SERIAL = "bytes / (bytes / L2->L1 + bytes / H2D): the two steps one after the other"
PIPELINED = "min(L2->L1, H2D): an estimate that assumes the two steps overlap fully (not measured)"


def load_datapath(path: str) -> dict[str, Any]:
    """The lmcache server's L2 -> L1 rates from a datapath_bench.py --json file, one per run and mode.
    A mode that missed chunks or returned wrong bytes is kept but marked unusable: its rate is not a restore's."""
    data = json.loads(Path(path).read_text())
    if data.get("schema") != DATAPATH_SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {DATAPATH_SCHEMA!r}")
    runs = data.get("runs") or []
    sources = []
    for run in runs:
        for mode in run.get("modes", []):
            label = f"server {mode['name']}" + (f" {run['size_gb']:g} GB" if len(runs) > 1 else "")
            gbps = mode.get("l2_to_l1_gbps")
            complete = mode.get("hit_chunks") == mode.get("chunks") and mode.get("wrong_bytes") == 0
            usable = complete and isinstance(gbps, int | float) and gbps > 0
            sources.append({"label": label, "kind": "server", "mode": mode["name"], "size_gb": run.get("size_gb"),
                            "l2_to_l1_gbps": gbps, "end_to_end_gbps": mode.get("end_to_end_gbps"),
                            "first_hit_ms": mode.get("first_hit_ms"), "chunks": mode.get("chunks"),
                            "hit_chunks": mode.get("hit_chunks"), "wrong_bytes": mode.get("wrong_bytes"), "usable": usable,
                            "note": "the lmcache server's L2 -> L1 (lookup of cold L2 chunks, a sealed mode's decryption "
                            "included), benchmarks/datapath_bench.py"
                            if usable else "not used: no valid trial (every trial's page cache drop failed: its reads may "
                            "have come from memory)" if mode.get("valid_trials") == 0 else
                            f"not used: {mode.get('hit_chunks')}/{mode.get('chunks')} chunks hit, "
                            f"{mode.get('wrong_bytes')} wrong bytes, rate {gbps}"})
    return {"file": str(Path(path).resolve()), "schema": DATAPATH_SCHEMA, "sources": sources}


def restore_sources(out: dict[str, Any]) -> list[dict[str, Any]]:
    """The L2 -> L1 rates the verdict composes: the server's (--datapath-json) when given, else this
    script's own best file reads (the serde's and the plain one), which leave out the server."""
    if out.get("datapath"):
        return [s for s in out["datapath"]["sources"] if s["usable"]]
    rates: dict[str, float] = out["disk"].get("rates_gbps", {})
    sources = []
    for kind, what in (("auth", "file read + serde open"), ("plain", "plain file read")):
        got = {k: v for k, v in rates.items() if k.startswith(kind + " x")}
        if got:
            best = max(got, key=lambda k: got[k])
            sources.append({"label": f"own {kind} {best.split(' ')[1]}", "kind": "own", "l2_to_l1_gbps": got[best], "usable": True,
                            "note": f"this script's {what} ({best}, the fastest thread count), no lmcache server"})
    return sources


def compose(l2_gbps: float, h2d_gbps: float | None) -> dict[str, float]:
    """The restore path's rate: L2 -> L1, then L1 -> GPU, serial (and the fully pipelined estimate).
    Without an H2D rate (a CPU run) the path is the L2 -> L1 read alone."""
    if h2d_gbps is None:
        return {"serial_gbps": l2_gbps, "pipelined_gbps_est": l2_gbps}
    return {"serial_gbps": 1.0 / (1.0 / l2_gbps + 1.0 / h2d_gbps), "pipelined_gbps_est": min(l2_gbps, h2d_gbps)}


def h2d_part(out: dict[str, Any]) -> dict[str, Any]:
    """The host -> GPU step of the verdict: its measured rate, or why there is none."""
    h = out.get("h2d")
    if out.get("plan", {}).get("device") != "cuda":
        return {"gbps": None, "status": "not applicable", "cpu_stand_in": True,
                "note": "no GPU: a CPU stand-in verdict, the restore path is the L2 -> L1 read alone"}
    if h and h.get("status") == "ok":
        return {"gbps": h["gbps"], "status": "ok", "cpu_stand_in": False, "note": "pinned host -> GPU copy, measured on this GPU"}
    return {"gbps": None, "status": "missing", "cpu_stand_in": False,
            "note": f"host -> GPU copy not measured ({(h or {}).get('reason', 'not run')}): no verdict"}


def breakeven_rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Per shape and context: recompute's KV rate (the break-even) against each composed restore path."""
    sources = restore_sources(out)
    h2d = h2d_part(out)
    rows = []
    for p in out["prefill"]:
        if p["status"] != "ok":
            continue
        need = p["recompute_kv_gbps"]
        restore = {}
        for src in sources:
            path = compose(src["l2_to_l1_gbps"], h2d["gbps"])
            known = h2d["status"] != "missing"
            restore[src["label"]] = {"l2_to_l1_gbps": src["l2_to_l1_gbps"], "h2d_gbps": h2d["gbps"], **path,
                                     "ratio": path["serial_gbps"] / need,
                                     "beats_recompute": path["serial_gbps"] > need if known else None,
                                     "pipelined_beats_recompute_est": path["pipelined_gbps_est"] > need if known else None}
        rows.append({"shape": p["shape"], "tokens": p["tokens"], "tokens_per_s": p["tokens_per_s"], "breakeven_gbps": need,
                     "cpu_stand_in": h2d["cpu_stand_in"], "restore": restore})
    return rows


def restore_path(out: dict[str, Any]) -> dict[str, Any]:
    """What the verdict composed, for the JSON and the report."""
    sources = restore_sources(out)
    return {"l2_to_l1_from": "lmcache server (--datapath-json)" if out.get("datapath") else
            "this script's own file reads (no lmcache server: no --datapath-json)",
            "sources": sources, "h2d": h2d_part(out), "serial": SERIAL, "pipelined": PIPELINED,
            "unused": [s for s in (out.get("datapath") or {}).get("sources", []) if not s["usable"]]
            + ([{"label": "own reads", "usable": False, "note": f"{warm} read passes after a failed page cache drop"}]
               if (warm := out.get("disk", {}).get("warm_passes")) and not out.get("datapath") else [])}


def sig(x: float) -> str:
    """A rate or ratio readable at any scale (a CPU trial's KV rates are tiny)."""
    if x >= 100:
        return f"{x:.0f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def report_device(f: dict[str, Any]) -> None:
    gpu = f.get("gpu") or {}
    disk = f["disk"]
    say("== device (facts of this machine)")
    say(f"  GPU: {gpu.get('name', 'none')}" + (f", {gpu['memory_bytes'] / 2**30:.0f} GiB, cc {gpu['capability']}, cuDNN {gpu['cudnn']}"
                                                if gpu else ""))
    say(f"  torch {f['torch']} (CUDA {f['torch_cuda']}), python {f['python']}, cryptography {f.get('cryptography')}, "
        f"{f.get('openssl', '')}")
    say(f"  CPU: {f['cpu_model']}, {f['cpu_usable']} usable of {f['cpu_logical']} logical cores, flags {' '.join(f['cpu_flags'])}; "
        f"RAM {(f['mem_total_bytes'] or 0) / 2**30:.0f} GiB")
    say(f"  disk: {disk['dir']} on {disk['source']} ({disk['fstype']}, mounted at {disk['mount_point']}, rotational "
        f"{disk['rotational']} (kernel flag)), {disk['free_bytes'] / 2**30:.1f} GiB free of {disk['total_bytes'] / 2**30:.1f}")


def report(out: dict[str, Any]) -> None:
    f = out["device"]
    say(f"\n== measured on: {(f.get('gpu') or {}).get('name', 'no GPU')}, torch {f['torch']}, {f['cpu_usable']} cores, "
        f"disk {f['disk']['source']} ({f['disk']['fstype']}) with {f['disk']['free_bytes'] / 2**30:.1f} GiB free")
    pre = out["prefill"]
    if pre:
        say("\n== (a) prefill of random-weight decoder layers, scaled to full depth")
        rows = []
        for p in pre:
            if p["status"] == "ok":
                rows.append([p["shape"], str(p["tokens"]), f"{p['layers_measured']}/{p['full_layers']}", p["dtype"],
                             f"{p['median_s'] * 1000:.1f}", f"{p['attention_per_layer_s'] / p['per_layer_s']:.0%}",
                             f"{p['full_model_s']:.3f}", f"{p['tokens_per_s']:.0f}", f"{p['kv_bytes_per_token'] // 1024}",
                             sig(p["recompute_kv_gbps"]), sig(p["flop_based_tflops"])])
            else:
                rows.append([p["shape"], str(p["tokens"]), "-", "-", p["status"], "-", "-", "-", "-", "-", p["reason"][:60]])
        say(table(["shape", "tokens", "layers", "dtype", "ms (median)", "SDPA share", "full model s", "tokens/s", "KV KiB/tok",
                   "recompute KV GB/s", "TFLOP/s (FLOP-based est.)"], rows))
    d = out["disk"]
    if d.get("rates_gbps"):
        say("\n== (b) L2 restore: serde and file path only (median GB/s over rounds)")
        w = d["write"]
        most = d["max_resident_fraction_before_reads"]
        resident = "unknown (mincore failed)" if most is None else f"{most:.1%}"
        say(f"  {w['files']} files x {d['chunk_bytes'] / 2**20:.0f} MiB; cache drop: drop_caches worked: {d['drop_caches_worked']}; "
            f"most pages resident before a read: {resident}")
        say("  " + ", ".join(f"{k}: {sig(v)}" for k, v in d["rates_gbps"].items()))
        if (d["max_resident_fraction_before_reads"] or 0) > 0.05:
            say("  WARNING: part of the data was still in the page cache before a read; those rates are not the disk's alone")
    if out.get("h2d"):
        h = out["h2d"]
        say(f"  pinned host -> GPU copy: {h['gbps']:.1f} GB/s" if h.get("status") == "ok" else f"  host -> GPU copy: {h}")
    rp = out["restore_path"]
    rows_be = out["breakeven"]
    if rows_be:
        h2d = rp["h2d"]
        say("\n== break-even: a hit beats recomputing when the whole restore path (L2 -> L1, then host -> GPU) is faster")
        say("   than recompute makes KV (the break-even rate)")
        say(f"  L2 -> L1 from {rp['l2_to_l1_from']}:")
        for src in rp["sources"]:
            say(f"    {src['label']}: {sig(src['l2_to_l1_gbps'])} GB/s ({src['note']})")
        for src in rp["unused"]:
            say(f"    {src['label']}: {src['note']}")
        say(f"  host -> GPU: {'none' if h2d['gbps'] is None else sig(h2d['gbps']) + ' GB/s'} ({h2d['note']})")
        path = "the L2 -> L1 read alone (CPU stand-in: no host -> GPU step)" if h2d["cpu_stand_in"] else rp["serial"]
        say(f"  restore = {path}; a cell: restore GB/s, its ratio to the break-even rate, whether the hit wins")
        keys = list(rows_be[0]["restore"])

        def verdict(flag: bool | None) -> str:
            return "unknown" if flag is None else "yes" if flag else "no"

        rows = []
        for r in rows_be:
            got = [r["restore"][k] for k in keys]
            cells = [f"{sig(c['serial_gbps'])} {sig(c['ratio'])}x {verdict(c['beats_recompute'])}" for c in got]
            if h2d["gbps"] is not None:
                cells += [f"{sig(c['pipelined_gbps_est'])} {verdict(c['pipelined_beats_recompute_est'])}" for c in got]
            rows.append([r["shape"], str(r["tokens"]), sig(r["breakeven_gbps"]), *cells])
        heads = ["shape", "tokens", "break-even GB/s", *keys]
        if h2d["gbps"] is not None:
            heads += [f"{k} pipelined (est.)" for k in keys]
            say(f"  pipelined (est.) = {rp['pipelined']}")
        say(table(heads, rows))
    b = out["budget"]
    say(f"\n== budget: {b['used_s']:.1f} s used of {b['total_s']:.0f} s; stopped early: {b['stopped_early']}")
    for note in b["notes"]:
        say(f"  - {note}")


# ---------------------------------------------------------------- plan and main


def build_plan(args: argparse.Namespace, budget: Budget, dtype_name: str, dtype_reason: str, free_disk: int) -> dict[str, Any]:
    itemsize = 4 if dtype_name == "float32" else 2
    chunk_bytes = int(args.chunk_mib * 2**20)
    count = max(1, min(int(args.l2_gib * 2**30 // chunk_bytes), int(free_disk // 3 // chunk_bytes)))
    prefill = []
    for s in args.shape_list:
        for t in args.context_list:
            prefill.append({"shape": s.name, "tokens": t, "layers": args.layers, "full_layers": s.layers,
                            "weights_gib": s.weight_bytes(args.layers, itemsize) / 2**30,
                            "activations_gib_est": s.activation_bytes(t, itemsize, False) / 2**30,
                            "tflop_measured_stack": s.flops_per_layer(t) * args.layers / 1e12,
                            "tflop_full_model": s.flops_per_layer(t) * s.layers / 1e12})
    passes = 2 * len(args.thread_list) * args.rounds
    return {"device": args.device, "dtype": dtype_name, "dtype_reason": dtype_reason, "quick": args.quick,
            "shapes": {s.name: {**asdict(s), "kv_bytes_per_token": s.kv_bytes_per_token()} for s in args.shape_list},
            "contexts": args.context_list, "layers": args.layers, "warmup": args.warmup, "repeats": args.repeats,
            "prefill": prefill, "budget": budget.split(),
            "disk": {"files": count, "chunk_bytes": chunk_bytes, "bytes": count * chunk_bytes, "threads": args.thread_list,
                     "rounds": args.rounds, "read_passes": passes, "cache_drop": args.cache_drop,
                     "split": "write <= 25% of the disk time, read passes share 65% equally, verify and AES-GCM from memory 10%"}}


def print_plan(plan: dict[str, Any]) -> None:
    say(f"\n== plan: {plan['device']}, {plan['dtype']} ({plan['dtype_reason']}), {plan['layers']} layer(s) per shape, "
        f"{plan['warmup']} warm-up + up to {plan['repeats']} timed forwards (median)")
    for name, s in plan["shapes"].items():
        say(f"  {name}: hidden {s['hidden']}, {s['heads']}/{s['kv_heads']} heads x {s['head_dim']}, MLP {s['intermediate']}, "
            f"{s['layers']} layers, KV {s['kv_bytes_per_token'] // 1024} KiB/token ({s['note']})")
    say(table(["shape", "tokens", "weights GiB", "activations GiB (est.)", "TFLOP measured stack", "TFLOP full model"],
              [[p["shape"], str(p["tokens"]), f"{p['weights_gib']:.2f}", f"{p['activations_gib_est']:.2f}",
                f"{p['tflop_measured_stack']:.2f}", f"{p['tflop_full_model']:.1f}"] for p in plan["prefill"]]))
    b, d = plan["budget"], plan["disk"]
    say(f"  budget {b['total_s']:.0f} s: prefill up to {b['prefill_s']} s (each measurement its share of what is left), disk "
        f"{b['disk_s']} s plus what prefill leaves, reserve {b['reserve_s']} s")
    say(f"  disk: {d['files']} files x {d['chunk_bytes'] / 2**20:.0f} MiB = {d['bytes'] / 2**30:.2f} GiB; threads {d['threads']}; "
        f"{d['rounds']} round(s); cache drop {d['cache_drop']}; {d['split']}")


@contextlib.contextmanager
def temp_folder(parent: Path | None, prefix: str) -> Iterator[Path]:
    """A fresh folder under parent (the working directory when None), removed afterwards."""
    parent = parent or Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget(args.budget_s)
    import torch

    if args.device == "cuda" and not args.dry_run and not torch.cuda.is_available():
        say("breakeven: --device cuda but torch sees no GPU (use --device cpu, or --dry-run to see the plan)")
        return 2
    parent = Path(args.dir) if args.dir else Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    dtype_name, dtype_reason = pick_dtype(args)
    datapath = None
    if args.datapath_json:
        try:
            datapath = load_datapath(args.datapath_json)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            say(f"breakeven: --datapath-json {args.datapath_json}: {exc}")
            return 2
    out: dict[str, Any] = {"schema": SCHEMA, "datapath": datapath, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "argv": sys.argv[1:] if argv is None else argv,
                           "dry_run": args.dry_run, "device": device_facts(args, parent), "prefill": [], "attention_probes": {},
                           "h2d": None, "disk": {"passes": []}, "breakeven": [], "budget": {}}
    report_device(out["device"])
    plan = build_plan(args, budget, dtype_name, dtype_reason, out["device"]["disk"]["free_bytes"])
    out["plan"] = plan
    json_path = Path(args.json)

    def save() -> None:
        view = {**out, "prefill": [asdict(r) for r in out["prefill"]],
                "budget": {**budget.split(), "used_s": budget.elapsed(), "notes": budget.notes, "stopped_early": bool(budget.stops)}}
        view["breakeven"] = breakeven_rows(view)
        view["restore_path"] = restore_path(view)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_path.with_name(json_path.name + ".tmp")
        tmp.write_text(json.dumps(view, indent=1, default=str))
        tmp.replace(json_path)

    print_plan(plan)
    if args.dry_run:
        save()
        say(f"\ndry run: nothing measured; plan written to {json_path}")
        return 0
    serve: ModuleType | None = None
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if not hasattr(AESGCM, "decrypt_into"):
            raise ImportError("this cryptography has no AESGCM.decrypt_into (the serde needs it)")
        serve = load_serve()
    except ImportError as exc:
        budget.notes.append(f"authenticated path not run: {exc}")
    if args.device == "cpu":
        torch.set_num_threads(usable_cores())
    budget.start_prefill()
    say(f"\n== (a) prefill (budget up to {budget.prefill_left():.0f} s)")
    run_prefill(args, budget, dtype_name, out, save)
    if args.device == "cuda":
        out["h2d"] = measure_h2d(budget)
    save()
    say(f"\n== (b) restore (budget {budget.left():.0f} s)")
    with temp_folder(Path(args.dir) if args.dir else None, "breakeven-chunks-") as folder:
        try:
            run_disk(args, budget, serve, folder, out, save)
        except OSError as exc:
            budget.notes.append(f"disk measurement failed: {exc}")
    budget.notes.extend(f"prefill {p.shape} at {p.tokens}: {p.status} ({p.reason})"
                        for p in out["prefill"] if p.status != "ok" and "time budget" not in p.reason)
    save()
    out_view = json.loads(json_path.read_text())
    report(out_view)
    say(f"\nresults: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
