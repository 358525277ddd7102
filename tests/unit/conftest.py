"""Unit-test settings: a status patch that does not fit the status models raises (in production
its field is left out and logged, kvpersist.api.status), so a misspelled key fails a test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvpersist.api import status

if TYPE_CHECKING:
    from kvpersist.controller.state import Controller


@pytest.fixture(autouse=True)
def _strict_status_patches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(status, "STRICT", True)
    yield


@pytest.fixture()
def controller(monkeypatch: pytest.MonkeyPatch) -> Iterator[Controller]:
    """A fresh kvpersist.controller.state.Controller in place of the operator's one (runtime.CONTROLLER,
    which every handler module reads), for a test that sets up or reads the per-resource state."""
    from kvpersist.controller import runtime
    from kvpersist.controller.state import Controller

    fresh = Controller()
    monkeypatch.setattr(runtime, "CONTROLLER", fresh)
    yield fresh


@pytest.fixture(scope="session")
def helm() -> Path:
    """The helm binary the local cluster's build made (the chart checks render with it)."""
    from tests import rbac_needs

    path = rbac_needs.helm_binary()
    if path is None:
        pytest.skip("helm not built: python3 hack/localcluster.py build")
    return path
