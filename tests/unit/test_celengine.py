"""kvpersist.api.celrules.extension: the CEL extension without the library's REPL (issue 58)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvpersist.api import celrules

REPL = ("typer", "rich", "prompt_toolkit", "pygments")


def test_validating_a_spec_imports_none_of_the_librarys_repl() -> None:
    """A fresh process as the operator's: the models and their rules loaded, a rule evaluated."""
    code = ("import sys; from kvpersist.api import v1alpha1, celrules; assert celrules.holds('self.a > 1', {'a': 2}); "
            f"print(sorted(m for m in {REPL!r} if m in sys.modules))")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "operator"), str(root)])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_package_imported_after_it_shares_the_one_extension() -> None:
    """A PyO3 extension initialises once a process: `import cel` after celrules (a test, a tool) must
    find the extension loaded, not load it again (which panics)."""
    import cel

    assert celrules.extension() is celrules.celexpr
    assert cel.compile is celrules.celexpr.compile
    assert celrules.holds("self.a.size() == 2", {"a": [1, 2]}) and not celrules.holds("self.a > 5", {"a": 2})
