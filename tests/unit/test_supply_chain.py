"""The operator image's supply chain, read from the files that decide it: its base image is named by
digest, every Python package it installs comes from a hashed lock that still satisfies
pyproject.toml, and nothing is fetched unhashed (the project installs without dependencies or
build isolation). test_operator_image.py builds the image's venv from the same Dockerfile lines, so
a lock that misses a dependency fails there too (pip --require-hashes refuses an unpinned one).
The images under images/ (vllm-lmcache runs beside every GPU and holds the L2 key and the bucket
token) are held to the same: every pip install there takes a hashed lock with --require-hashes, and
vllm-lmcache's lock pins the lmcache and nixl the rest of the project runs."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.devtools import REPO

sys.path.insert(0, str(REPO / "hack"))
import operator_image_venv

DOCKERFILE = REPO / "operator" / "Dockerfile"
LOCK = REPO / "operator" / "requirements.lock"
BUILD_LOCK = REPO / "operator" / "build-requirements.lock"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
IMAGE_DOCKERFILES = sorted((REPO / "images").glob("*/Dockerfile"))
VLLM_LMCACHE = REPO / "images" / "vllm-lmcache"


def locked(path: Path) -> dict[str, tuple[Version, list[str]]]:
    """name -> (pinned version, sha256 hashes) of a pip-compile --generate-hashes file."""
    entries: dict[str, tuple[Version, list[str]]] = {}
    for block in re.split(r"\n(?=\S)", path.read_text()):
        head = block.split("\\", 1)[0].split("\n", 1)[0].strip()
        if not head or head.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", head)
        assert match, f"{path.name}: {head!r} is not pinned as name==version"
        entries[canonicalize_name(match.group(1))] = (Version(match.group(2)), re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
    return entries


def base_images(text: str) -> list[str]:
    """Each stage's image reference, ARGs given their defaults (an ARG without one stays ${NAME})."""
    args: dict[str, str] = {}
    refs = []
    for word, rest in operator_image_venv.instructions(text):
        if word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default if default else f"${{{name}}}"
        elif word == "FROM":
            ref = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), rest.split()[0])
            refs.append(ref)
    return refs


def by_digest(ref: str, text: str) -> bool:
    """name@sha256:<64 hex>, or name@${ARG} where the ARG has no default (the build must be given one)."""
    if re.fullmatch(r"[^@\s]+@sha256:[0-9a-f]{64}", ref):
        return True
    arg = re.fullmatch(r"[^@\s]+@\$\{(\w+)\}", ref)
    return bool(arg) and re.search(rf"^ARG {arg.group(1)}\s*$", text, re.M) is not None


@pytest.mark.parametrize("lock", [LOCK, BUILD_LOCK, VLLM_LMCACHE / "requirements.lock", REPO / "benchmarks" / "gpu-wheels.lock"],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_locked_package_is_pinned_with_hashes(lock: Path) -> None:
    assert lock.is_file(), f"{lock.relative_to(REPO)} is missing: run bash hack/lock.sh"
    entries = locked(lock)
    assert entries, f"{lock.name} pins nothing"
    unhashed = sorted(name for name, (_, hashes) in entries.items() if not hashes)
    assert not unhashed, f"{lock.name}: no --hash for {unhashed}: run bash hack/lock.sh"


def test_the_lock_satisfies_every_dependency_of_pyproject() -> None:
    entries = locked(LOCK)
    for text in PYPROJECT["project"]["dependencies"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in entries, f"{requirement.name} is in pyproject.toml but not in operator/requirements.lock: run bash hack/lock.sh"
        assert requirement.specifier.contains(entries[name][0], prereleases=True), (
            f"operator/requirements.lock pins {name}=={entries[name][0]}, outside pyproject's {text!r}: run bash hack/lock.sh")


def test_the_build_lock_satisfies_the_build_backend() -> None:
    entries = locked(BUILD_LOCK)
    for text in PYPROJECT["build-system"]["requires"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in entries and requirement.specifier.contains(entries[name][0]), (
            f"operator/build-requirements.lock does not satisfy {text!r}: run bash hack/lock.sh")


def test_the_image_installs_only_hashed_locks_and_the_project_without_fetching() -> None:
    image = operator_image_venv.parse(DOCKERFILE.read_text())
    for args in image.installs:
        if "-r" in args:
            assert "--require-hashes" in args and "--no-deps" in args, args
            assert args[args.index("-r") + 1] in (LOCK.name, BUILD_LOCK.name), args
        else:
            assert args[-1] == "." and {"--no-deps", "--no-build-isolation"} <= set(args), (
                f"pip install {' '.join(args)} may fetch unhashed packages (dependencies or the build backend)")
    copied = {src for src, _ in image.copies}
    assert {"operator/requirements.lock", "operator/build-requirements.lock"} <= copied, copied


def test_every_base_image_is_named_by_digest() -> None:
    text = DOCKERFILE.read_text()
    refs = base_images(text)
    assert len(refs) == 2, refs
    assert all(by_digest(ref, text) for ref in refs), f"operator/Dockerfile: a base not by digest: {refs}"


def unhashed_installs(dockerfile: Path) -> list[str]:
    """Each `pip install` in the Dockerfile's RUN lines that could fetch a file no hash checks: one
    without --require-hashes, or one that names a package rather than only `-r LOCK`, where LOCK is
    a file beside the Dockerfile that a COPY puts where -r reads it."""
    steps = operator_image_venv.instructions(dockerfile.read_text())
    copied = {Path(dest).name: src for word, rest in steps if word == "COPY"
              for *sources, dest in [rest.split()] for src in sources if not src.startswith("--")}
    problems = []
    for word, rest in steps:
        if word != "RUN":
            continue
        for args in operator_image_venv.pip_installs(rest):
            said = "pip install " + " ".join(args)
            if "--require-hashes" not in args:
                problems.append(f"{said}: no --require-hashes")
                continue
            named = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] not in ("-r", "-c"))]
            locks = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-r"]
            source = copied.get(Path(locks[0]).name) if locks else None
            if named or not locks or source is None or not (dockerfile.parent / source).is_file():
                problems.append(f"{said}: must install only -r a lock file that is COPYied from {dockerfile.parent.name}/")
    return problems


@pytest.mark.parametrize("dockerfile", IMAGE_DOCKERFILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_image_installs_python_packages_only_from_a_hashed_lock(dockerfile: Path) -> None:
    """Not only the operator's: the data-plane image holds the L2 key and the bucket token."""
    problems = unhashed_installs(dockerfile)
    assert not problems, f"{dockerfile.relative_to(REPO)}: {problems}; install a hashed lock (bash hack/lock.sh) with --require-hashes"


def test_the_images_are_the_ones_checked() -> None:
    assert VLLM_LMCACHE / "Dockerfile" in IMAGE_DOCKERFILES, IMAGE_DOCKERFILES


def shell_default(path: Path, name: str) -> str:
    match = re.search(rf"^{name}=(\S+)$", path.read_text(), re.M)
    assert match, f"{path.relative_to(REPO)} sets no {name}"
    return match.group(1)


def test_the_vllm_lmcache_lock_pins_the_lmcache_and_nixl_the_project_runs() -> None:
    """The connector inside vLLM and the lmcache server share one build (no protocol handshake): the
    lock must pin the lmcache the Dockerfile declares, the samples' connectorBuild names (test_dockerfiles)
    and the tests run (pyproject's extras, hack/vllm_cpu_venv.sh), and the nixl beside it; and it
    must not move vLLM's own stack, which the base image provides (it installs with --no-deps)."""
    lock = VLLM_LMCACHE / "requirements.lock"
    assert lock.is_file(), "images/vllm-lmcache/requirements.lock is missing: run bash hack/lock.sh vllm-lmcache"
    entries = locked(lock)
    dockerfile = (VLLM_LMCACHE / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", dockerfile, re.M))
    extras = PYPROJECT["project"]["optional-dependencies"]
    pins = {Requirement(r).name: Requirement(r) for r in extras["datapath"] + extras["contract"]}
    lmcache = Version(args["LMCACHE_VERSION"])
    assert "lmcache" in entries, "images/vllm-lmcache/requirements.lock does not pin lmcache: run bash hack/lock.sh vllm-lmcache"
    assert entries["lmcache"][0] == lmcache, (
        f"images/vllm-lmcache/requirements.lock pins lmcache=={entries['lmcache'][0]}, the Dockerfile declares "
        f"LMCACHE_VERSION={lmcache}: run bash hack/lock.sh vllm-lmcache")
    assert str(pins["lmcache"].specifier) == f"=={lmcache}", pins["lmcache"]
    assert Version(shell_default(REPO / "hack" / "vllm_cpu_venv.sh", "LMCACHE_VERSION")) == lmcache
    nixl = Version(args["NIXL_VERSION"])
    assert Version(shell_default(REPO / "hack" / "vllm_cpu_venv.sh", "NIXL_VERSION")) == nixl
    for name in ("nixl", "nixl-cu12", "nixl-cu13"):
        assert name in entries and entries[name][0] == nixl, (
            f"images/vllm-lmcache/requirements.lock: {name} is not pinned at NIXL_VERSION={nixl}: run bash hack/lock.sh vllm-lmcache")
    moved = sorted({"vllm", "torch"} & entries.keys())
    assert not moved, f"images/vllm-lmcache/requirements.lock pins {moved}, which the base image provides"
    assert f"vllm=={args['VLLM_VERSION']}" in lock.read_text(), "the lock does not say which vllm it was resolved with"
    install = next(a for w, r in operator_image_venv.instructions(dockerfile) if w == "RUN"
                   for a in operator_image_venv.pip_installs(r))
    # Exactly the locked lines, and no sdist built: its build backend would be fetched unhashed.
    assert {"--no-deps", "--only-binary=:all:"} <= set(install), (
        f"images/vllm-lmcache/Dockerfile: pip install {' '.join(install)} needs --no-deps --only-binary=:all:")


def test_the_checks_above_can_fail(tmp_path: Path) -> None:
    """A tag, an ARG with a default tag, an unhashed or unpinned line and a lock that misses a
    dependency are all caught."""
    for text in ("FROM python:3.11-slim\n", "ARG D=latest\nFROM python:3.11-slim@${D}\n", "FROM python@sha256:abc\n"):
        assert not all(by_digest(ref, text) for ref in base_images(text)), text
    assert by_digest("python:3.11-slim@sha256:" + "a" * 64, "")
    bad = tmp_path / "requirements.lock"
    bad.write_text("kopf==1.45.0\n    # via kvpersist\n")
    assert locked(bad)["kopf"][1] == []
    bad.write_text("kopf>=1.45\n")
    with pytest.raises(AssertionError, match="not pinned"):
        locked(bad)
    image = tmp_path / "image"
    image.mkdir()
    dockerfile = image / "Dockerfile"
    for text in ('RUN pip install --no-cache-dir "lmcache==0.5.6"\n',
                 "COPY requirements.lock /r.lock\nRUN python3 -m pip install --no-deps -r /r.lock\n",
                 "COPY requirements.lock /r.lock\nRUN python3 -m pip install --require-hashes -r /r.lock nixl\n",
                 "RUN python3 -m pip install --require-hashes -r /r.lock\n"):
        (image / "requirements.lock").unlink(missing_ok=True)
        dockerfile.write_text(text)
        assert unhashed_installs(dockerfile), text
    (image / "requirements.lock").write_text("")
    dockerfile.write_text("COPY requirements.lock /r.lock\nRUN python3 -m pip install --require-hashes --no-deps -r /r.lock\n")
    assert unhashed_installs(dockerfile) == []
    entries = locked(LOCK)
    assert Requirement("httpx2>=2.0").specifier.contains(entries["httpx2"][0])
    assert canonicalize_name("no-such-dependency") not in entries


def test_the_chart_runs_the_operator_and_agent_by_digest_when_given_one() -> None:
    from tests import rbac_needs

    helm = rbac_needs.helm_binary()
    if helm is None:
        pytest.skip("helm not built: python3 hack/localcluster.py build")
    digest = "sha256:" + "0123456789abcdef" * 4

    def images(*values: str) -> set[str]:
        done = subprocess.run([str(helm), "template", "x", str(REPO / "charts" / "kvpersist"), *values],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        deployment = next(d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "Deployment")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        agent = next(e["value"] for e in container["env"] if e["name"] == "KVPERSIST_AGENT_IMAGE")
        return {container["image"], agent}

    repository = yaml.safe_load((REPO / "charts" / "kvpersist" / "values.yaml").read_text())["image"]["repository"]
    assert images("--set", f"image.digest={digest}", "--set", "image.tag=moved") == {f"{repository}@{digest}"}
    assert images("--set", "image.tag=v9") == {f"{repository}:v9"}
    refused = subprocess.run([str(helm), "template", "x", str(REPO / "charts" / "kvpersist"),
                              "--set", "image.digest=latest"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "image/digest" in refused.stderr, refused.stderr
