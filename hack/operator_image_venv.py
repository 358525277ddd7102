#!/usr/bin/env python3
"""A virtualenv holding exactly what operator/Dockerfile installs into the operator image (which is
also the inventory agent's image), so tests can run the image's entry points with nothing else
importable: a module that imports an undeclared package fails here, not in a cluster.

The Dockerfile is read, not restated: its COPY lines (from the build context) lay the context out
in a temporary folder and each `pip install` of its RUN lines runs there with the same arguments,
less those that only say where or how quietly to install. The interpreter is the Dockerfile's own
`python:X.Y` version. The venv is cached under ~/.cache/kvpersist, keyed by that version, those
arguments and the dependencies they pull in from pyproject.toml; the local project itself is
reinstalled (--no-deps) on every call, so the venv always runs this tree's code.

    python3 hack/operator_image_venv.py      # prints the venv's path
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("KVPERSIST_CACHE", Path.home() / ".cache" / "kvpersist"))
DOCKERFILE = REPO / "operator" / "Dockerfile"

# pip options that change where or how verbosely things are installed, not what: dropped.
_WHERE_FLAGS = {"--no-cache-dir", "--user", "--no-compile", "--compile", "-q", "--quiet", "-v", "--verbose",
                "--disable-pip-version-check", "--no-warn-script-location", "--break-system-packages"}
_WHERE_OPTIONS = {"--prefix", "--root", "--target", "-t", "--progress-bar", "--cache-dir"}
_PIP = ([["pip", "install"], ["pip3", "install"]]
        + [[py, "-m", "pip", "install"] for py in ("python", "python3", "python3.11", "python3.12", "python3.13")])


@dataclasses.dataclass(frozen=True)
class Image:
    """What the image installs and runs, as its Dockerfile says."""

    python: str  # X.Y of the final stage's python:X.Y base
    copies: tuple[tuple[str, str], ...]  # (source in the repository, destination relative to WORKDIR; / ends a folder)
    installs: tuple[tuple[str, ...], ...]  # pip install arguments, one tuple per invocation
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs: comments dropped, backslash continuations joined."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#"):  # a comment, also between continuation lines
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        current = ""
    return out


def _exec_form(rest: str) -> tuple[str, ...]:
    return tuple(json.loads(rest)) if rest.startswith("[") else tuple(shlex.split(rest))


def pip_installs(command: str) -> list[tuple[str, ...]]:
    """The arguments of each `pip install` in a shell command, location-only options dropped."""
    found: list[tuple[str, ...]] = []
    segment: list[str] = []
    for token in [*shlex.split(command, posix=True), "&&"]:
        if token not in ("&&", "||", ";", "|"):
            segment.append(token)
            continue
        prefix = next((p for p in _PIP if segment[:len(p)] == p), None)
        if prefix is not None:
            args: list[str] = []
            rest = iter(segment[len(prefix):])
            for arg in rest:
                name = arg.split("=", 1)[0]
                if arg in _WHERE_FLAGS:
                    continue
                if name in _WHERE_OPTIONS:
                    if "=" not in arg:
                        next(rest, None)
                    continue
                args.append(arg)
            found.append(tuple(args))
        segment = []
    return found


def parse(text: str) -> Image:
    """The parts of a Dockerfile that decide what the image can import."""
    python = ""
    workdir = PurePosixPath("/")
    copies: list[tuple[str, str]] = []
    installs: list[tuple[str, ...]] = []
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    for word, rest in instructions(text):
        if word == "FROM":
            match = re.match(r"(?:docker\.io/)?(?:library/)?python:(\d+\.\d+)", rest)
            python = match.group(1) if match else ""
            workdir = PurePosixPath("/")
        elif word == "WORKDIR":
            workdir = workdir / rest
        elif word in ("COPY", "ADD") and "--from=" not in rest:
            *sources, dest = [p for p in _exec_form(rest) if not p.startswith("--")]
            try:
                relative = (workdir / dest).relative_to(workdir)
            except ValueError:
                raise SystemExit(f"COPY to {dest} is outside WORKDIR {workdir}: cannot mirror it") from None
            # A trailing / (or several sources) makes dest a folder: lay_out puts a file into it.
            into = dest.endswith("/") or dest in (".", "..") or len(sources) > 1
            copies += [(src, f"{relative}/" if into else str(relative)) for src in sources]
        elif word == "RUN":
            command = " ".join(_exec_form(rest)) if rest.startswith("[") else re.sub(r"^(--\S+\s+)+", "", rest)
            found = pip_installs(command)
            if not found and re.search(r"\b(pip3?|uv|poetry|pdm|conda)\b.*\b(install|sync|add)\b", command):
                raise SystemExit(f"RUN {command!r} installs packages in a way this script cannot mirror")
            installs += found
        elif word == "ENTRYPOINT":
            entrypoint = _exec_form(rest)
        elif word == "CMD":
            cmd = _exec_form(rest)
    if not python:
        raise SystemExit("the image's final stage is not FROM python:X.Y; cannot choose the interpreter")
    if not installs:
        raise SystemExit("no `pip install` in the Dockerfile: nothing to mirror")
    return Image(python, tuple(copies), tuple(installs), entrypoint, cmd)


def _local_project(arg: str, context: Path) -> tuple[Path, list[str]] | None:
    """`.` or `./x[extra]` naming a folder of the context: (that folder, its extras)."""
    match = re.fullmatch(r"([^\[]+)(?:\[([^\]]*)\])?", arg)
    if arg.startswith("-") or not match or not (context / match.group(1) / "pyproject.toml").exists():
        return None
    return context / match.group(1), [e.strip() for e in (match.group(2) or "").split(",") if e.strip()]


def declared(image: Image, context: Path) -> dict[str, object]:
    """Everything the venv's contents depend on (the cache key's input): the Python version, the pip
    arguments, each local project's dependencies (and the extras named) and each requirements file."""
    inputs: dict[str, object] = {}
    for args in image.installs:
        for i, arg in enumerate(args):
            local = _local_project(arg, context)
            if local is not None:
                project = tomllib.loads((local[0] / "pyproject.toml").read_text())["project"]
                extras = project.get("optional-dependencies", {})
                inputs[arg] = [project.get("dependencies", []), {e: extras.get(e, []) for e in local[1]}]
            if i and args[i - 1] in ("-r", "-c", "--requirement", "--constraint"):
                inputs[arg] = (context / arg).read_text()
    return {"python": image.python, "installs": image.installs, "inputs": inputs}


def interpreter(version: str) -> str:
    """The image's Python X.Y on this machine: this one, or python{X.Y} on PATH."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        return sys.executable
    found = shutil.which(f"python{version}")
    if found is None:
        raise SystemExit(f"the operator image runs Python {version}; no python{version} on PATH to build its venv")
    return found


def lay_out(image: Image, context: Path) -> None:
    """The build context as the Dockerfile's COPY lines place it under WORKDIR."""
    for src, dest in image.copies:
        source = REPO / src
        # A folder's contents go to dest (as docker copies them); a file goes into a dest folder.
        target = context / dest / source.name if dest.endswith("/") and not source.is_dir() else context / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
        else:
            shutil.copy2(source, target)


def _pip(venv: Path, args: list[str], cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_USER", "PIP_TARGET", "PIP_PREFIX")}
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                   cwd=cwd, env=env, check=True, stdout=sys.stderr)


def ensure(dockerfile: Path = DOCKERFILE) -> Path:
    """The venv's path: built the first time for this dependency set, the project reinstalled each time.
    Nothing holds it afterwards: a caller that runs things in it while another run may reinstall
    (the unit tier beside the lowest-versions tier) uses `using`."""
    with using(dockerfile) as venv:
        return venv


@contextlib.contextmanager
def using(dockerfile: Path = DOCKERFILE) -> Iterator[Path]:
    """ensure()'s venv, held with a shared lock until the block ends: another run's reinstall of the
    project (a --force-reinstall removes the package's files before writing them again) waits
    for it, so a command in the venv never finds the package half there."""
    image = parse(dockerfile.read_text())
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvpersist-image-ctx-") as tmp:
        context = Path(tmp)
        lay_out(image, context)
        key = hashlib.sha256(json.dumps(declared(image, context), sort_keys=True).encode()).hexdigest()[:12]
        venv = CACHE / f"image-{key}"
        lock = (CACHE / f"image-{key}.lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once must not fill or reinstall one venv together
            if not (venv / ".complete").exists():
                print(f"[image-venv] creating {venv}: what {dockerfile.relative_to(REPO)} installs", file=sys.stderr)
                shutil.rmtree(venv, ignore_errors=True)
                subprocess.run([interpreter(image.python), "-m", "venv", str(venv)], check=True)
                for args in image.installs:
                    _pip(venv, list(args), context)
                (venv / ".complete").write_text(json.dumps(image.installs) + "\n")
            else:
                for args in image.installs:
                    local = [a for a in args if _local_project(a, context) is not None]
                    if local:
                        _pip(venv, ["--no-deps", "--force-reinstall", *local], context)
        except BaseException:
            lock.close()
            raise
    try:
        # Not atomic (flock drops the exclusive lock first): a reinstall waiting for it may run now,
        # and this call then waits for it to end; either way the block runs on a whole package.
        fcntl.flock(lock, fcntl.LOCK_SH)
        yield venv
    finally:
        lock.close()


def main() -> int:
    print(ensure())
    return 0


if __name__ == "__main__":
    sys.exit(main())
