"""Unit-test settings: a status patch that does not fit the status models raises (in production
its field is left out and logged, kvpersist.api.status), so a misspelled key fails a test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpersist.api import status


@pytest.fixture(autouse=True)
def _strict_status_patches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(status, "STRICT", True)
    yield
