#!/usr/bin/env python3
"""Runs the unit tests against the lowest versions pyproject.toml allows, so its lower bounds stay
true: every `name>=X` of [project].dependencies is installed as `name==X` (pip's equivalent of a
lowest-direct resolution; their own dependencies resolve normally), with the dev tools as they
come. The venv is cached under ~/.cache/kvpersist, keyed by those dependencies.

    python3 hack/lowest_deps.py [pytest args...]
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("KVPERSIST_CACHE", Path.home() / ".cache" / "kvpersist"))


def lowest(requirement: str) -> str:
    """`kopf>=1.45` -> `kopf==1.45`; a requirement without a lower bound is refused (it has none to test)."""
    match = re.fullmatch(r"\s*([A-Za-z0-9_.\-\[\]]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*(,.*)?", requirement)
    if not match:
        raise SystemExit(f"pyproject.toml: {requirement!r} has no lower bound (name>=X) to test")
    return f"{match.group(1)}=={match.group(2)}"


def main() -> int:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = [lowest(r) for r in project["dependencies"]]
    tools = project["optional-dependencies"]["dev"]
    key = hashlib.sha256("\n".join([sys.version, *pins, *tools]).encode()).hexdigest()[:12]
    venv = CACHE / f"lowest-{key}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f"lowest-{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once must not fill one venv together
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", *pins, *tools],
                           check=True)
            (venv / ".complete").write_text("\n".join(pins) + "\n")
    print(f"[lowest-deps] {' '.join(pins)}", flush=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'operator'}:{REPO}"}
    args = sys.argv[1:] or ["-q"]
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider", *args, "tests/unit"],
                          cwd=REPO, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
