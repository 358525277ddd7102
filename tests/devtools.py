"""What the lint tests share: the dev extra's command-line tools and the repository's files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def dev_tool(name: str, wheel: str) -> str:
    """A tool the dev extra installs from a wheel: beside this interpreter (the test venv), else on
    PATH. Missing is a failure, not a skip: the suite's venv always has it."""
    beside = Path(sys.executable).parent / name
    path = str(beside) if beside.exists() else shutil.which(name)
    assert path, f"{name} is missing: it comes with the dev extra ({wheel}), e.g. bash hack/venv.sh"
    return path


def repo_files() -> list[Path]:
    """Tracked files and new ones git does not ignore (a script or Dockerfile not yet committed is
    checked too), those that exist."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True, timeout=30).stdout.split()
    return sorted({REPO / p for p in listed if (REPO / p).is_file()})
