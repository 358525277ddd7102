"""The operator image (also the inventory agent's) runs with only what operator/Dockerfile installs:
the hashed lock of pyproject's [project].dependencies, nothing from the test venv. hack/operator_image_venv.py builds
exactly that set into a venv (cached, about a minute the first time); here every kvpersist module
imports in it, every console script and `kvpersist` subcommand answers --help, the image's own
ENTRYPOINT and CMD among them, and every third-party import anywhere in the package, including
the lazy ones inside functions that no --help reaches, resolves there and is declared."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import operator_image_venv  # noqa: E402

PACKAGE = REPO / "operator" / "kvpersist"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def venv() -> Iterator[Path]:
    """Held for the module: the lowest-versions tier, beside this one, reinstalls the project in it too."""
    with operator_image_venv.using() as path:
        yield path


def in_image(venv: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A command in the image's venv: no PYTHONPATH, no user site, run outside the work tree."""
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8",
           "PYTHONNOUSERSITE": "1"}
    return subprocess.run(list(argv), env=env, cwd=venv, capture_output=True, text=True, timeout=timeout)


INSERVER = PACKAGE / "inserver"


def third_party_imports(root: Path) -> dict[str, list[str]]:
    """Top-level module -> where it is imported, for every absolute import outside the standard
    library and kvpersist itself, at any depth (function-level imports included)."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if INSERVER in path.parents:
            continue  # runs in the lmcache server's image, never in the operator's (test_inserver_imports)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("kvpersist", "__future__"):
                    found.setdefault(top, []).append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


RESOLVE = """
import importlib.metadata as md, importlib.util, json, sys
mods = json.loads(sys.argv[1])
dists = md.packages_distributions()
print(json.dumps({m: dists.get(m) if importlib.util.find_spec(m) else None for m in mods}))
"""


def resolve(venv: Path, modules: list[str]) -> dict[str, list[str] | None]:
    """Module -> the distributions that provide it in the image's venv; None: not importable there."""
    done = in_image(venv, "python", "-I", "-c", RESOLVE, json.dumps(modules))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_names() -> set[str]:
    return {norm(re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0]) for r in PROJECT["dependencies"]}


def test_the_dockerfile_installs_the_lock_then_the_project_and_runs_its_console_script() -> None:
    image = operator_image_venv.parse(operator_image_venv.DOCKERFILE.read_text())
    assert image.installs == (
        ("--require-hashes", "--no-deps", "-r", "build-requirements.lock"),
        ("--require-hashes", "--no-deps", "-r", "requirements.lock"),
        ("--no-deps", "--no-build-isolation", "."),
    ), "operator/Dockerfile should install the hashed locks, then the project itself without fetching anything"
    assert image.entrypoint and image.entrypoint[0] in PROJECT["scripts"], image.entrypoint
    assert image.python == "3.11"


def test_every_module_imports_in_the_image(venv: Path) -> None:
    source = sorted(".".join(("kvpersist", *p.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
                    for p in PACKAGE.rglob("*.py"))
    code = ("import importlib, json, pkgutil, kvpersist\n"
            "names = ['kvpersist'] + [m.name for m in pkgutil.walk_packages(kvpersist.__path__, 'kvpersist.')]\n"
            "for n in names: importlib.import_module(n)\n"
            "print(json.dumps([kvpersist.__file__, sorted(names)]))")
    done = in_image(venv, "python", "-I", "-c", code)
    assert done.returncode == 0, f"a kvpersist module does not import with only the image's dependencies:\n{done.stderr}"
    where, installed = json.loads(done.stdout)
    assert Path(where).is_relative_to(venv), f"kvpersist came from {where}, not the image's venv"
    assert installed == sorted(source), "the installed package lacks modules of the source tree (packaging)"


def test_every_entry_point_and_subcommand_answers_help(venv: Path) -> None:
    image = operator_image_venv.parse(operator_image_venv.DOCKERFILE.read_text())
    for script in PROJECT["scripts"]:
        done = in_image(venv, script, "--help")
        assert done.returncode == 0, f"{script} --help: {done.stderr}"
    # Users' commands and the operator's own apart (kvpersist.cli), each answering --help.
    for script, expected in (("kvpersist", {"status", "report", "gc", "plan", "pins", "convert", "version", "completion"}),
                             ("kvpersist-operator", {"run", "agent", "crd", "pin-change-policy", "attach-policy", "api-reference"})):
        top = in_image(venv, script, "--help").stdout
        subcommands = re.search(r"\{([a-z,-]+)\}", top)
        assert subcommands, top
        names = subcommands.group(1).split(",")
        assert set(names) == expected, (script, names)
        for name in names:
            done = in_image(venv, script, name, "--help")
            assert done.returncode == 0 and "usage:" in done.stdout, f"{script} {name} --help: {done.stderr}"
    # What the image runs by default, and what the agent container runs (builders/lmcache.py).
    done = in_image(venv, *image.entrypoint, *image.cmd, "--help")
    assert done.returncode == 0, f"{' '.join(image.entrypoint + image.cmd)} --help: {done.stderr}"
    done = in_image(venv, "kvpersist", "crd")
    assert done.returncode == 0 and "kind: CustomResourceDefinition" in done.stdout, done.stderr


def test_every_third_party_import_is_declared(venv: Path) -> None:
    imports = third_party_imports(PACKAGE)
    assert {"kopf", "kubernetes", "pydantic"} <= set(imports), imports  # the scan sees the package's imports
    providers = resolve(venv, sorted(imports))
    missing = {m: imports[m] for m, d in providers.items() if d is None}
    assert not missing, f"imported but not installed in the operator image: {missing}"
    declared = declared_names()
    undeclared = {m: (d, imports[m]) for m, d in providers.items()
                  if d is not None and not {norm(x) for x in d} & declared}
    assert not undeclared, f"imported but not declared in pyproject's [project].dependencies: {undeclared}"


def test_an_undeclared_import_is_caught(venv: Path, tmp_path: Path) -> None:
    """The check above can fail: a lazy `import lmcache` (the server's package, never the
    operator's) in a copy of the package is found by the scan and is not importable in the image."""
    copy = tmp_path / "kvpersist"
    copy.mkdir()
    (copy / "sneaky.py").write_text("def load():\n    import lmcache.v1\n    return lmcache\n")
    imports = third_party_imports(copy)
    assert imports == {"lmcache": ["kvpersist/sneaky.py:2"]}
    found = resolve(venv, ["lmcache", "pytest", "kopf"])
    assert found["lmcache"] is None and found["pytest"] is None, found  # the test venv has both; the image neither
    assert found["kopf"] == ["kopf"], found


def test_the_dockerfile_reader_keeps_what_decides_the_contents() -> None:
    image = operator_image_venv.parse(
        "# syntax=docker/dockerfile:1\nFROM python:3.12-slim AS build\nWORKDIR /src\nCOPY a.toml b.md ./\n"
        "COPY --chown=1:1 pkg ./pkg\n"
        "RUN --mount=type=cache,target=/root/.cache pip install --no-cache-dir --prefix /install \\\n"
        "    # a comment between continuation lines\n    -c constraints.txt . && python3 -m pip install -q x==1\n"
        "FROM python:3.11-slim\nCOPY --from=build /install /usr/local\nENTRYPOINT [\"tool\"]\nCMD [\"serve\", \"-v\"]\n")
    assert image.python == "3.11"  # the final stage's
    assert image.copies == (("a.toml", "./"), ("b.md", "./"), ("pkg", "pkg"))
    assert image.installs == (("-c", "constraints.txt", "."), ("x==1",))
    assert (image.entrypoint, image.cmd) == (("tool",), ("serve", "-v"))
    with pytest.raises(SystemExit, match="cannot mirror"):
        operator_image_venv.parse("FROM python:3.11\nRUN uv pip install --system x==1\n")
