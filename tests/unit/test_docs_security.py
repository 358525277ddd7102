"""docs/security.md's threat model names the tests that back each control: each must exist, so
the table cannot point at a test that was renamed or removed."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_test_the_security_doc_names_exists() -> None:
    text = (REPO / "docs" / "security.md").read_text()
    named = set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text))
    assert len(named) >= 10, named  # the threat model table is there
    missing = [f"{path}::{name}" for path, name in sorted(named)
               if not re.search(rf"^(async )?def {name}\(", (REPO / path).read_text(), re.M)]
    assert missing == []
