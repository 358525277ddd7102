"""kopf's settings as `kvpersist run` sets them (kvpersist.controller.runtime.configure)."""

from __future__ import annotations

import kopf
import pytest

from kvpersist.controller import runtime


def test_an_idle_object_worker_lets_its_last_event_go_within_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 58: kopf's worker of an object holds its last watch event (the whole object) until it
    has idled idle_timeout; kopf's 5 s kept every object that changed in the last 5 s while
    resources converge. The operator's event handlers keep what they need themselves."""
    monkeypatch.setattr(runtime.kube, "load_config", lambda: None)
    settings = kopf.OperatorSettings()
    assert settings.queueing.idle_timeout == 5.0  # kopf's default, what this test guards against
    runtime.configure(settings=settings)
    assert settings.queueing.idle_timeout <= 1.0
