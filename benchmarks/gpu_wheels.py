#!/usr/bin/env python3
"""The Python packages benchmarks/gpu_run.py needs beyond torch, carried to a GPU machine as wheels (issue 56 item 5).

The GPU machine has a CUDA torch and no network. benchmarks/gpu-wheels.lock pins, with their
sha256, the wheels (CPython 3.12, manylinux x86_64) that the lmcache server with kvpersist's serde,
datapath_bench.py and breakeven.py import in a Python that has torch and nothing else: found by
starting them in such a Python and adding what each import error named. lmcache 0.5.6 pulls in many
more (its adapters for clouds it does not use here); nixl is left out: its wheel alone (69 MB) is
over what a call may carry (64 MiB), and fs_native, the default adapter, does not need it.

    python3 benchmarks/gpu_wheels.py fetch build/gpu-wheels [--skip-present-in NAMES.txt]
        downloads the locked wheels (hashes checked), leaving out packages the target already has;
        prints the total and fails above 64 MiB
    python3 benchmarks/gpu_run.py --wheels build/gpu-wheels ...
        installs what is missing there (--no-index --no-deps --require-hashes) into a folder put on
        PYTHONPATH beside the machine's own packages (torch), then runs with it
    python3 benchmarks/gpu_wheels.py check --python python3.12 --torch 2.14.0
        the same install in a clean Python 3.12 venv with only torch (from PyPI), then gpu_run.py --dry in it
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "benchmarks" / "gpu-wheels.lock"
CARRY_LIMIT_BYTES = 64 * 2**20  # what one device call may carry, the working tree included
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
             "manylinux_2_5_x86_64", "manylinux2010_x86_64", "manylinux_2_12_x86_64")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_entries(lock: Path | None = None) -> dict[str, str]:
    """name -> its requirement text (`name==version --hash=...`), from the pip-format lock."""
    text = re.sub(r"\\\n\s*", " ", (lock or LOCK).read_text())
    entries = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            entries[norm(line.split("==", 1)[0])] = line
    return entries


def installed(python: str) -> dict[str, str]:
    """norm(name) -> version of every distribution that python sees."""
    code = "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    return {norm(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items() if k}


def fetch(folder: Path, skip: set[str], limit: int | None = CARRY_LIMIT_BYTES) -> int:
    """Downloads the locked wheels not in skip into folder, each checked against the lock's hashes;
    1 when that fails or they come to more than limit."""
    entries = {n: r for n, r in lock_entries().items() if n not in skip}
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as req:
        req.write("\n".join(entries.values()) + "\n")
        req.flush()
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--require-hashes", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS),
               "-d", str(folder), "-r", req.name]
        if subprocess.run(cmd).returncode:
            return 1
    # Only the wheels asked for now: a folder reused from a fetch with another skip list holds others.
    wheels = sorted(w for w in folder.glob("*.whl") if norm(w.name.split("-", 1)[0]) in entries)
    total = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels ({len(entries)} locked, {len(skip & set(lock_entries()))} left out as present), "
          f"{total / 2**20:.1f} MiB in {folder}")
    if limit is not None and total > limit:
        print(f"over the {limit // 2**20} MiB a device call carries: leave out what the machine has (--skip-present-in)")
        return 1
    return 0


def install(folders: list[Path], target: Path) -> dict[str, object]:
    """The locked packages this interpreter lacks, installed from folders (offline, hash-checked) into
    target, a folder for PYTHONPATH: a venv would not see the packages of the interpreter's own venv
    (torch, on the GPU machine). What was installed, what was already there (its version, which may
    differ from the lock's), and pip check's word with target on the path."""
    have = installed(sys.executable)
    entries = lock_entries()
    missing = {n: r for n, r in entries.items() if n not in have}
    facts: dict[str, object] = {"target": str(target), "installed": sorted(missing),
                                "present": {n: have[n] for n in sorted(entries) if n in have}}
    if missing:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as req:
            req.write("\n".join(missing.values()) + "\n")
            req.flush()
            links = [a for f in folders for a in ("--find-links", str(f))]
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--require-hashes",
                            "--no-compile", "--upgrade", "--target", str(target), *links, "-r", req.name], check=True, timeout=600)
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120,
                           env=with_target(target))
    facts["pip_check"] = check.stdout.strip()[-2000:]
    return facts


def with_target(target: Path) -> dict[str, str]:
    """This environment with target's packages importable and its commands (`lmcache`) on PATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join(filter(None, [str(target / "bin"), env.get("PATH")]))
    return env


def check(python: str, torch: str, cache: Path) -> int:
    """Issue 56 item 5's demonstration: a clean venv of python with torch alone (PyPI's build, with
    what it requires), the locked wheels fetched and installed as on the GPU machine, then
    gpu_run.py --dry there: the lmcache server started with the serde, the bench and breakeven run."""
    base = cache / f"torch-only-{norm(Path(python).name)}-{torch}"
    if not (base / ".complete").exists():
        subprocess.run([python, "-m", "venv", "--clear", str(base)], check=True)
        subprocess.run([str(base / "bin" / "python"), "-m", "pip", "install", "-q", f"torch=={torch}"], check=True)
        (base / ".complete").touch()
    wheels = cache / "gpu-wheels-all"
    if fetch(wheels, set(), limit=None):
        return 1
    out = Path(tempfile.mkdtemp(prefix="gpu-wheels-check-"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([str(base / "bin" / "python"), str(ROOT / "benchmarks" / "gpu_run.py"), "--wheels", str(wheels),
                           "--dry", "--out", str(out)], env=env)
    run = json.loads((out / "gpu_run.json").read_text())
    steps = {k: v.get("status") for k, v in run["steps"].items()}
    print(f"gpu_run.py --dry in a clean {python} with torch {torch} only: exit {proc.returncode}, steps {steps}, "
          f"installed {len(run['machine']['wheels']['installed'])} packages; results in {out}")
    return 0 if proc.returncode == 0 and steps.get("datapath") == "ok" else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download the locked wheels into a folder")
    f.add_argument("folder", type=Path)
    f.add_argument("--skip-present-in", type=Path, help="a file of package names (one a line, or comma-separated) the target has")
    c = sub.add_parser("check", help="install into a clean venv with only torch and run gpu_run.py --dry there")
    c.add_argument("--python", default="python3.12")
    c.add_argument("--torch", default="2.14.0")
    c.add_argument("--cache", type=Path, default=Path(os.environ.get("KVPERSIST_CACHE", Path.home() / ".cache" / "kvpersist")))
    args = p.parse_args(argv)
    if args.cmd == "fetch":
        skip = set()
        if args.skip_present_in:
            skip = {norm(n) for n in re.split(r"[\s,]+", re.sub(r"#.*", "", args.skip_present_in.read_text())) if n}
        return fetch(args.folder, skip)
    with contextlib.suppress(KeyboardInterrupt):
        return check(args.python, args.torch, args.cache)
    return 130


if __name__ == "__main__":
    sys.exit(main())
