#!/usr/bin/env python3
"""Everything that needs a GPU, in one command that fits one 10-minute run (issue 41 item 4).

The GPU machine is lent for minutes at a time, with no network: this runs, in order and within one
total budget (--budget-s, 540 s by default; each step gets a share, and the run stops early,
writing what it has, rather than overrun):

(a) the L2 path with the real lmcache server: benchmarks/datapath_bench.py --json (store, kill -9,
    drop the page cache, restart, read back; the server's L2 -> L1 rate per mode);
(b) the break-even: benchmarks/breakeven.py --device cuda for the Llama-3.1-8B and -70B shapes,
    with --datapath-json from (a), so its verdict composes the server's L2 -> L1 rate with the
    host -> GPU copy it measures (without (a) it composes its own file read, and says so);
(c) TTFT with real vLLM: only detected. A CUDA vLLM importable next to a GPU is recorded, but
    benchmarks/vllm_bench.py needs the local Kubernetes cluster, so this step always records why it
    did not run ({"skipped": ...}); nothing is installed or downloaded to make it run.

It writes, under --out: gpu_run.json (schema kvpersist-gpu-run/1: the machine's facts, each step's
JSON or why it has none, rewritten after each step), each step's JSON and log, and tables.md, the
Markdown tables benchmarks/RESULTS.md is made from (`--tables gpu_run.json` prints them again).

On the GPU machine (one H200, where python3 is the interpreter with torch; give the command a
600 s limit; every file it writes comes back from $OUT):

    python3 benchmarks/gpu_run.py --out "$OUT"

Steps whose packages are missing there (lmcache for (a), cryptography for (b)'s sealed reads) are
skipped or cut down and say so; carry them as wheels to run them (benchmarks/gpu_wheels.py: 23
wheels, 29.5 MiB, beside what the machines' image has):

    python3 benchmarks/gpu_wheels.py fetch build/gpu-wheels --skip-present-in benchmarks/gpu-image-packages.txt
    # on the machine, with build/gpu-wheels carried:
    python3 benchmarks/gpu_run.py --wheels build/gpu-wheels --out "$OUT"

On a CPU, the whole orchestration runs at tiny sizes (breakeven --device cpu --quick, one 0.25 GiB
datapath trial), as CI does (tests/integration/test_gpu_run.py):

    python3 benchmarks/gpu_run.py --dry --out /tmp/gpu-run
    python3 benchmarks/gpu_run.py --tables /tmp/gpu-run/gpu_run.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from breakeven import temp_folder

ROOT = Path(__file__).resolve().parents[1]
DATAPATH = ROOT / "benchmarks" / "datapath_bench.py"
BREAKEVEN = ROOT / "benchmarks" / "breakeven.py"
SCHEMA = "kvpersist-gpu-run/1"
DATAPATH_SCHEMA = "kvpersist-datapath/2"
BREAKEVEN_SCHEMA = "kvpersist-breakeven/1"
END_RESERVE_S = 10.0  # writing the JSON and the tables after the last step
DATAPATH_SHARE = 0.50  # of the time left after the facts; breakeven gets what the datapath leaves
TTFT_RESERVE_S = 60.0  # `import vllm` with CUDA takes tens of seconds
STOP_GRACE_S = 20.0  # after SIGINT, for a step's own clean-up (its servers stopped, its files removed)


def say(*parts: object) -> None:
    print(*parts, flush=True)


# ---------------------------------------------------------------- processes


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of pid, or None once it is gone: the start time tells a pid reused."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[19]


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every process below pid (its children, theirs, ...), each with its start time. The servers a
    step starts have sessions of their own, so only the tree finds them, not the process group."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (st := _stat(int(entry))) is not None:
                children.setdefault(st[0], []).append(int(entry))
    found: list[tuple[int, str]] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            st = _stat(child)
            if st is not None:
                found.append((child, st[1]))
                todo.append(child)
    return found


def stop_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the step (its finally blocks stop its servers), then SIGKILL to whatever of its tree is left."""
    tree = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    tree += [d for pid, _ in list(tree) for d in descendants(pid) if d not in tree]  # started during the grace
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()
    for pid, started in tree:
        st = _stat(pid)
        if st is not None and st[1] == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def become_subreaper() -> bool:
    """Orphans of the steps (a server whose bench died) become this process's children, not init's,
    so that what a step leaves running is found and stopped (Linux prctl PR_SET_CHILD_SUBREAPER)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def running(pid: int) -> bool:
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def stop_leftovers() -> int:
    """Kills what the last step left running below this process (found as its orphans); how many
    were still running (a zombie, killed already, is only reaped)."""
    left = descendants(os.getpid())
    killed = 0
    for pid, started in left:
        st = _stat(pid)
        if st is not None and st[1] == started and running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    for pid, _ in left:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)  # reaped: an orphan of a step is now this process's child
    return killed


def step_env() -> dict[str, str]:
    """kvpersist and the tests' helpers importable from the checkout (the GPU machine has no kvpersist installed)."""
    path = os.pathsep.join([str(ROOT / "operator"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def run_command(cmd: list[str], timeout_s: float, log: Path) -> dict[str, Any]:
    """cmd with its output in log, stopped (its whole tree) at timeout_s."""
    t = time.monotonic()
    timed_out = False
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=step_env(), start_new_session=True)
        try:
            proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_tree(proc)
        except BaseException:
            stop_tree(proc)
            stop_leftovers()
            raise
    return {"exit_code": proc.returncode, "seconds": round(time.monotonic() - t, 2), "timed_out": timed_out,
            "leftover_processes_killed": stop_leftovers()}


def tail(path: Path, chars: int = 1500) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return ""


def probe(code: str, timeout_s: float) -> tuple[dict[str, Any] | None, str]:
    """A short Python snippet in a child (so this process never holds torch or a CUDA context): its
    last line as JSON, or None and why."""
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=step_env())
    except subprocess.TimeoutExpired:
        return None, f"no answer in {timeout_s:.0f} s"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return None, (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]
    return json.loads(lines[-1]), ""


# ---------------------------------------------------------------- facts


def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvidia_smi() -> dict[str, Any]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"gpus": [], "note": "nvidia-smi not found"}
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"gpus": [], "note": f"nvidia-smi failed: {exc}"}
    gpus = []
    for line in out.stdout.strip().splitlines():
        name, memory, driver = ([*(x.strip() for x in line.split(",")), "", ""])[:3]
        gpus.append({"name": name, "memory": memory, "driver": driver})
    return {"gpus": gpus, "note": "" if out.returncode == 0 else out.stderr.strip()[-300:]}


TORCH_PROBE = """import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": cuda,
                  "device": torch.cuda.get_device_name(0) if cuda else None}))"""


def machine_facts() -> dict[str, Any]:
    """What the numbers were measured on; packages by their installed metadata (nothing imported here)."""
    torch_facts, why = probe(TORCH_PROBE, 120)
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1]) * 1024
    return {"python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "cpu_usable": usable, "mem_total_bytes": mem, "nvidia_smi": nvidia_smi(),
            "torch": torch_facts or {"error": why, "cuda_available": False},
            "packages": {n: version(n) for n in ("torch", "lmcache", "nixl", "vllm", "cryptography", "pydantic")},
            "lmcache_on_path": shutil.which("lmcache", path=str(Path(sys.executable).parent)) or shutil.which("lmcache")}


# ---------------------------------------------------------------- steps


class Clock:
    """The run's one deadline; each step's share is taken from what is left."""

    def __init__(self, total_s: float) -> None:
        self.t0 = time.monotonic()
        self.total_s = total_s
        self.deadline = self.t0 + total_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def used(self) -> float:
        return time.monotonic() - self.t0


def rel(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.relative_to(ROOT))
    return str(path)


def datapath_step(args: argparse.Namespace, facts: dict[str, Any], timeout_s: float, work: Path) -> dict[str, Any]:
    """(a) The server's L2 path, datapath_bench.py --json, as a child stopped at its share."""
    lmcache_cli = facts["lmcache_on_path"]
    if facts["packages"]["lmcache"] is None or lmcache_cli is None:
        return {"status": "skipped", "skipped": f"lmcache is not installed for {sys.executable} (package "
                f"{facts['packages']['lmcache']}, `lmcache` command {lmcache_cli}): carry its wheels to run the server"}
    if timeout_s < args.min_step_s:
        return {"status": "skipped", "skipped": f"time budget: {timeout_s:.0f} s left for it"}
    out_json, log = args.out / "datapath.json", args.out / "datapath.log"
    out_json.unlink(missing_ok=True)  # an earlier run's, in a reused --out, is no result of this one
    cmd = [sys.executable, str(args.datapath_script), "--sizes-gb", args.datapath_sizes_gb, "--trials", str(args.datapath_trials),
           "--modes", args.datapath_modes, "--json", str(out_json), "--dir", str(work / "datapath")]
    say(f"\n== (a) the L2 path with the lmcache server, up to {timeout_s:.0f} s: {' '.join(rel(Path(c)) for c in cmd[1:2])} "
        f"{' '.join(cmd[2:])}")
    step: dict[str, Any] = {"command": [rel(Path(cmd[1])), *cmd[2:]], "timeout_s": round(timeout_s, 1), "log": log.name,
                            **run_command(cmd, timeout_s, log)}
    return finish(step, out_json, DATAPATH_SCHEMA, log)


def breakeven_step(args: argparse.Namespace, facts: dict[str, Any], timeout_s: float, work: Path,
                   datapath: dict[str, Any]) -> dict[str, Any]:
    """(b) breakeven.py with the server's rate from (a) when (a) gave one."""
    cuda = bool(facts["torch"].get("cuda_available"))
    if not args.dry and not cuda:
        return {"status": "skipped", "skipped": "torch sees no CUDA device (" + (facts["torch"].get("error") or "cuda unavailable")
                + "): on a CPU, run --dry"}
    slack = 10.0 if args.dry else 20.0  # its start before its own clock, and its clean-up after
    budget = min(args.dry_breakeven_s, timeout_s - slack) if args.dry else timeout_s - slack
    if budget < (10 if args.dry else args.min_step_s):
        return {"status": "skipped", "skipped": f"time budget: {timeout_s:.0f} s left for it"}
    out_json, log = args.out / "breakeven.json", args.out / "breakeven.log"
    out_json.unlink(missing_ok=True)
    device = ["--device", "cpu", "--quick", "--contexts", "256"] if args.dry else ["--device", "cuda"]
    cmd = [sys.executable, str(BREAKEVEN), *device, "--budget-s", f"{budget:.0f}", "--json", str(out_json),
           "--dir", str(work / "breakeven")]
    if datapath.get("status") == "ok":
        cmd += ["--datapath-json", str(args.out / "datapath.json")]
    say(f"\n== (b) break-even, up to {timeout_s:.0f} s: {rel(BREAKEVEN)} {' '.join(cmd[2:])}")
    step: dict[str, Any] = {"command": [rel(BREAKEVEN), *cmd[2:]], "timeout_s": round(timeout_s, 1), "log": log.name,
                            "l2_to_l1_from": "datapath step (the lmcache server)" if "--datapath-json" in cmd else
                            f"breakeven's own file read (the datapath step: {datapath.get('status')})",
                            **run_command(cmd, timeout_s, log)}
    return finish(step, out_json, BREAKEVEN_SCHEMA, log)


def finish(step: dict[str, Any], out_json: Path, schema: str, log: Path) -> dict[str, Any]:
    """The step's status from its exit and its JSON (kept whatever the status: a stopped step's partial results count)."""
    result = None
    with contextlib.suppress(OSError, ValueError):
        result = json.loads(out_json.read_text())
    if result is not None and result.get("schema") == schema:
        step["result"] = result
        step["json"] = out_json.name
    if step["timed_out"]:
        step.update(status="timeout", reason=f"stopped at its share of the budget ({step['timeout_s']} s)")
    elif step["exit_code"] != 0 or "result" not in step:
        why = f"exit {step['exit_code']}" + ("" if "result" in step else f", no {schema} JSON")
        step.update(status="error", reason=why, log_tail=tail(log))
    else:
        step["status"] = "ok"
    say(f"   {step['status']} in {step['seconds']} s" + (f": {step['reason']}" if "reason" in step else ""))
    return step


def ttft_step(facts: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """(c) Detected only: whether a CUDA vLLM is importable here; never installed or started."""
    if facts["packages"]["vllm"] is None or importlib.util.find_spec("vllm") is None:
        return {"status": "skipped", "skipped": f"vLLM is not installed for {sys.executable}"}
    if not facts["torch"].get("cuda_available"):
        return {"status": "skipped", "skipped": f"torch sees no CUDA device: vLLM {facts['packages']['vllm']} is installed, "
                "its CUDA build cannot run here (not imported)"}
    if timeout_s < 10:
        return {"status": "skipped", "skipped": f"time budget: {timeout_s:.0f} s left to import vLLM"}
    found, why = probe("import json, vllm; print(json.dumps({'vllm': vllm.__version__}))", timeout_s)
    if found is None:
        return {"status": "skipped", "skipped": f"import vllm failed: {why}"}
    return {"status": "skipped", "vllm": found["vllm"],
            "skipped": f"vLLM {found['vllm']} with CUDA imports here, but TTFT has no runner without a cluster: "
            "benchmarks/vllm_bench.py needs the local Kubernetes cluster, the operator and the test model; not run"}


# ---------------------------------------------------------------- tables


def num(x: Any, digits: int = 3) -> str:
    """A measured number readable at any scale; a dash when there is none."""
    if not isinstance(x, int | float) or isinstance(x, bool) or not math.isfinite(x):
        return "—"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.{digits}g}"


def md(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def machine_table(run: dict[str, Any]) -> str:
    f = run.get("machine", {})
    smi = f.get("nvidia_smi", {})
    gpus = ", ".join(f"{g['name']} ({g['memory']}, driver {g['driver']})" for g in smi.get("gpus", [])) or smi.get("note", "none")
    t = f.get("torch", {})
    pk = f.get("packages", {})
    rows = [["GPU (nvidia-smi)", gpus],
            ["CPU cores (usable / logical)", f"{f.get('cpu_usable')} / {f.get('cpu_count')}"],
            ["memory", num((f.get("mem_total_bytes") or 0) / 2**30) + " GiB"],
            ["torch", f"{t.get('torch', pk.get('torch'))} (CUDA {t.get('torch_cuda')}, available: {t.get('cuda_available')})"],
            ["lmcache / nixl / cryptography / vLLM", " / ".join(str(pk.get(n)) for n in ("lmcache", "nixl", "cryptography", "vllm"))],
            ["python", f"{f.get('python')} ({f.get('platform')})"],
            ["started; budget used", f"{run.get('started')}; {num(run.get('used_s'))} s of {num(run.get('budget_s'))} s"
             + (" (stopped early)" if run.get("stopped_early") else "")]]
    return md(["machine", "value"], rows)


def steps_table(run: dict[str, Any]) -> str:
    rows = []
    for name, s in run.get("steps", {}).items():
        note = s.get("skipped") or s.get("reason") or " ".join(s.get("command", []))
        rows.append([name, s.get("status", "?"), num(s.get("seconds")), num(s.get("timeout_s")), note])
    return md(["step", "status", "wall (s)", "limit (s)", "what / why"], rows)


def datapath_table(result: dict[str, Any]) -> str:
    rows = []
    for run in result.get("runs", []):
        base = run.get("baseline", {})
        fio = num(base.get("fio_gbps")) if base.get("fio_gbps") is not None else f"— ({base.get('fio_note', 'not run')})"
        for m in run.get("modes", []):
            rows.append([num(run.get("size_gb")), m["name"], f"{m.get('hit_chunks')}/{m.get('chunks')}", str(m.get("wrong_bytes")),
                         num(m.get("l2_to_l1_gbps")), num(m.get("end_to_end_gbps")), num(m.get("first_hit_ms")),
                         f"{num(base.get('threaded_read_gbps'))} (x{base.get('read_threads')})", fio])
    return md(["stored (GB asked)", "L2", "chunks hit", "wrong bytes", "L2 → L1 (GB/s)", "L2 → L1 → engine, CPU copy (GB/s)",
               "first hit after restart (ms)", "plain threaded read (GB/s)", "fio (GB/s)"], rows)


def prefill_table(result: dict[str, Any]) -> str:
    rows = []
    for p in result.get("prefill", []):
        if p.get("status") == "ok":
            rows.append([p["shape"], str(p["tokens"]), f"{p['layers_measured']}/{p['full_layers']}", p["dtype"], p["attention"],
                         num(p["full_model_s"]), num(p["tokens_per_s"]), num(p["recompute_kv_gbps"]), num(p["flop_based_tflops"])])
        else:
            rows.append([p["shape"], str(p["tokens"]), "—", "—", f"{p.get('status')}: {p.get('reason', '')[:80]}", "—", "—", "—", "—"])
    return md(["shape", "tokens", "layers measured / full", "dtype", "SDPA", "full model prefill (s)", "tokens/s",
               "recompute makes KV = break-even (GB/s)", "TFLOP/s (FLOP-based est.)"], rows)


def parts_table(result: dict[str, Any]) -> str:
    rp = result.get("restore_path", {})
    rows = [["L2 → L1: " + s["label"], num(s["l2_to_l1_gbps"]), s["note"]] for s in rp.get("sources", [])]
    rows += [["L2 → L1: " + s["label"] + " (not used)", num(s.get("l2_to_l1_gbps")), s["note"]] for s in rp.get("unused", [])]
    h2d = rp.get("h2d", {})
    rows.append(["host → GPU", num(h2d.get("gbps")) if h2d.get("gbps") is not None else h2d.get("status", "—"), h2d.get("note", "")])
    for key, rate in result.get("disk", {}).get("rates_gbps", {}).items():
        kind = "file read + serde open" if key.startswith("auth") else "plain file read"
        rows.append([f"own {key}", num(rate), f"breakeven.py's {kind}, cold, no server"])
    return md(["restore part", "GB/s", "what"], rows)


def verdict_table(result: dict[str, Any]) -> str:
    rows_be = result.get("breakeven", [])
    if not rows_be:
        return "(no prefill measured: no verdict)"
    keys = list(rows_be[0]["restore"])
    pipelined = result.get("restore_path", {}).get("h2d", {}).get("gbps") is not None

    def word(flag: bool | None) -> str:
        return "unknown" if flag is None else "**yes**" if flag else "no"

    rows = []
    for r in rows_be:
        cells = []
        for k in keys:
            c = r["restore"][k]
            cells.append(f"{num(c['serial_gbps'])} ({num(c['ratio'])}x): {word(c['beats_recompute'])}")
            if pipelined:
                cells.append(f"{num(c['pipelined_gbps_est'])}: {word(c['pipelined_beats_recompute_est'])}")
        rows.append([r["shape"], str(r["tokens"]), num(r["breakeven_gbps"]), *cells])
    heads = ["shape", "tokens", "break-even (GB/s)"]
    for k in keys:
        heads.append(f"{k}: restore GB/s (x break-even): beats recompute")
        if pipelined:
            heads.append(f"{k}: pipelined (est.)")
    return md(heads, rows)


def tables(run: dict[str, Any]) -> str:
    """The Markdown RESULTS.md's GPU section is made from, from one gpu_run.json alone."""
    steps = run.get("steps", {})
    out = [f"GPU run {run.get('started')} (`{' '.join(['python3 benchmarks/gpu_run.py', *run.get('argv', [])])}`)"]
    if run.get("dry"):
        out.append("\n**Dry run on the CPU**: tiny sizes and 1/4-width stand-in shapes; its numbers show that the script "
                   "works, not a break-even.")
    out += ["\n" + machine_table(run), "\n" + steps_table(run)]
    dp = steps.get("datapath", {})
    if "result" in dp:
        out += ["\nL2 → L1 with the lmcache server (datapath_bench.py: stored, `kill -9`, page cache dropped, restarted, read back):",
                "\n" + datapath_table(dp["result"])]
    be = steps.get("breakeven", {}).get("result")
    if be:
        out += ["\nPrefill of random-weight decoder layers, scaled to full depth (breakeven.py (a)):", "\n" + prefill_table(be),
                "\nThe restore path's parts (measured; the verdict composes the L2 → L1 rates listed first with host → GPU):",
                "\n" + parts_table(be)]
        rp = be.get("restore_path", {})
        stand_in = rp.get("h2d", {}).get("cpu_stand_in")
        notes = be.get("budget", {}).get("notes", [])
        if notes:
            out.append("\nbreakeven.py's notes:\n" + "\n".join(f"- {n}" for n in notes))
        out += ["\nVerdict: restore = " + ("the L2 → L1 read alone (a CPU stand-in: no host → GPU step)" if stand_in else
                                            "bytes / (bytes / L2 → L1 + bytes / host → GPU), serial")
                + "; a hit beats recomputing when it is above the break-even rate" + ("" if stand_in else
                "; pipelined (est.) = min(L2 → L1, host → GPU), assuming full overlap, not measured") + ":",
                "\n" + verdict_table(be)]
    ttft = steps.get("vllm_ttft", {})
    out.append(f"\nTTFT with real vLLM: {ttft.get('status', 'not run')}" + (f": {ttft['skipped']}" if "skipped" in ttft else ""))
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="folder for gpu_run.json, each step's JSON and log, and tables.md")
    p.add_argument("--dry", action="store_true", help="every step on the CPU at tiny sizes: the orchestration, not the numbers")
    p.add_argument("--tables", type=Path, metavar="RUN.json", help="print the Markdown tables of an earlier run's gpu_run.json")
    p.add_argument("--budget-s", type=float, help="total wall time (default 540; --dry 420, a cap for a loaded CI machine: "
                   "it takes about 80 s on 2 idle cores)")
    p.add_argument("--work", type=Path, help="folder for the L2 and chunk files (default: a temporary one in the current folder)")
    p.add_argument("--datapath-sizes-gb", help="datapath_bench --sizes-gb (default 1; --dry 0.25)")
    p.add_argument("--datapath-trials", type=int, help="datapath_bench --trials (default 2; --dry 1)")
    p.add_argument("--datapath-modes", help="datapath_bench --modes (default aesgcm,plain; --dry aesgcm)")
    p.add_argument("--wheels", type=Path, action="append", metavar="DIR",
                   help="folder of wheels from benchmarks/gpu_wheels.py fetch: what the lock pins and this Python lacks is "
                   "installed from it (offline, hash-checked) into a folder on PYTHONPATH, and the run goes on with it")
    p.add_argument("--datapath-script", type=Path, default=DATAPATH, help=argparse.SUPPRESS)  # a stand-in, for trying this script
    a = p.parse_args(argv)
    if a.tables is None and a.out is None:
        p.error("--out is required (or --tables RUN.json)")
    dry = a.dry
    for key, full, small in (("budget_s", 540.0, 420.0), ("datapath_sizes_gb", "1", "0.25"), ("datapath_trials", 2, 1),
                             ("datapath_modes", "aesgcm,plain", "aesgcm")):
        if getattr(a, key) is None:
            setattr(a, key, small if dry else full)
    a.min_step_s = 10.0 if dry else 60.0  # below this a step could not produce a number
    a.dry_breakeven_s = 20.0
    return a


WHEELS_ENV = "KVPERSIST_GPU_WHEELS"  # set in the run with --wheels installed: what gpu_wheels.install did, as JSON


def run_with_wheels(args: argparse.Namespace, argv: list[str]) -> None:
    """--wheels: install what is missing into a folder (in the temporary folder: not under --out, which
    comes back from the machine), then this script again with it on PYTHONPATH (never returns)."""
    import tempfile

    from gpu_wheels import install, with_target

    target = Path(tempfile.gettempdir()) / "kvpersist-gpu-wheels"
    facts = install(args.wheels, target)
    unmet = len(str(facts["pip_check"]).splitlines())
    say(f"== wheels: installed {len(facts['installed'])} packages into {target}; already here: {len(facts['present'])}; "
        f"pip check: {unmet} requirements unmet (the lock holds what this run imports, not lmcache's whole closure)")
    rest = [a for i, a in enumerate(argv) if a != "--wheels" and (i == 0 or argv[i - 1] != "--wheels")
            and not a.startswith("--wheels=")]
    env = {**with_target(target), WHEELS_ENV: json.dumps(facts)}
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *rest], env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.wheels and WHEELS_ENV not in os.environ:
        run_with_wheels(args, argv)
    if args.tables is not None:
        run = json.loads(args.tables.read_text())
        if run.get("schema") != SCHEMA:
            say(f"gpu_run: {args.tables}: schema {run.get('schema')!r}, expected {SCHEMA!r}")
            return 2
        sys.stdout.write(tables(run))
        return 0
    clock = Clock(args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    become_subreaper()
    # A step runs in a session of its own (so that SIGINT reaches it alone): on SIGTERM this process
    # unwinds through run_command, which stops the step's tree, instead of leaving it running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    run: dict[str, Any] = {"schema": SCHEMA, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "argv": argv, "dry": args.dry, "budget_s": args.budget_s,
                           "used_s": 0.0, "stopped_early": False, "machine": {}, "steps": {}}
    json_path = args.out / "gpu_run.json"

    def save() -> None:
        run["used_s"] = round(clock.used(), 1)
        run["stopped_early"] = any(s.get("status") == "timeout" or str(s.get("skipped", "")).startswith("time budget")
                                   for s in run["steps"].values())
        tmp = json_path.with_name(json_path.name + ".tmp")
        tmp.write_text(json.dumps(run, indent=1, default=str))
        tmp.replace(json_path)

    run["machine"] = machine_facts()
    run["machine"]["wheels"] = json.loads(os.environ[WHEELS_ENV]) if WHEELS_ENV in os.environ else None
    m = run["machine"]
    say(f"== machine: GPU {', '.join(g['name'] for g in m['nvidia_smi']['gpus']) or m['nvidia_smi']['note']}; "
        f"{m['cpu_usable']} cores; torch {m['torch'].get('torch')} (CUDA available: {m['torch'].get('cuda_available')}); "
        f"packages {m['packages']}; budget {args.budget_s:.0f} s" + (" (dry run on the CPU)" if args.dry else ""))
    save()
    cuda_vllm = bool(m["packages"]["vllm"] and m["torch"].get("cuda_available"))
    reserve = END_RESERVE_S + (TTFT_RESERVE_S if cuda_vllm else 0.0)
    # The steps' data files: outside --out (they would come back with it), removed at the end.
    with temp_folder(args.work, "gpu-run-") as work:
        run["steps"]["datapath"] = datapath_step(args, m, DATAPATH_SHARE * (clock.left() - reserve), work)
        save()
        run["steps"]["breakeven"] = breakeven_step(args, m, clock.left() - reserve, work, run["steps"]["datapath"])
        save()
    run["steps"]["vllm_ttft"] = ttft_step(m, min(TTFT_RESERVE_S, clock.left() - END_RESERVE_S))
    say(f"\n== (c) TTFT with real vLLM: {run['steps']['vllm_ttft']['skipped']}")
    save()
    text = tables(run)
    (args.out / "tables.md").write_text(text)
    say("\n" + text)
    say(f"== {clock.used():.0f} s of {args.budget_s:.0f} s; results in {json_path} (tables: {args.out / 'tables.md'})")
    return 1 if any(s.get("status") in ("error", "timeout") for s in run["steps"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
