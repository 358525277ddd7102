"""The status refresh decides with the apply's own decide (issue 59): on the last apply's snapshot
as the watch caches show it now (snapshot.refreshed), applying again exactly when that decision
differs from the applied one. Against the in-memory API of test_l2key (no cluster: the same
paths against a real API server are the e2e tier's, e.g. test_exclusive_stores)."""

from __future__ import annotations

import pytest

from kvpersist.controller import kube, pincheck, refresh, runtime
from kvpersist.controller.apply import apply_workloads
from kvpersist.controller.policy import IMAGE_NOT_ALLOWED, Policy
from kvpersist.status.workloads import Seen
from tests.cases.invalid_manifests import sample
from tests.unit.test_l2key import LOG, Api, _body

KEY = ("ml", sample()["metadata"]["name"])


@pytest.fixture(autouse=True)
def no_pin_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pin check off: its read of the Hub, ending between two rounds, changes what they see
    (a decision made again for a reason of its own: a CI failure on 4722039, lowest versions)."""
    monkeypatch.setenv(pincheck.ENV, "off")


def made(monkeypatch: pytest.MonkeyPatch) -> Api:
    """The in-memory API, where what the apply created can be read back (the agent token's Secret)."""
    api = Api(monkeypatch, None)
    monkeypatch.setattr(kube, "get", lambda v, kind, name, ns: next(
        (m for m in api.created if m["kind"] == kind and m["metadata"]["name"] == name and not name.endswith("-l2-key")), None))
    return api


def decides(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = refresh.decide
    monkeypatch.setattr(refresh, "decide", lambda snap: calls.append(snap.name) or real(snap))
    return calls


def test_a_refresh_after_an_apply_decides_the_same_once_and_applies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    made(monkeypatch)
    state = runtime.CONTROLLER.state(KEY)
    body = state.body = _body()  # as its watch event left it
    assert apply_workloads(body, LOG) and state.applied is not None and state.applied[1].generated_key
    calls = decides(monkeypatch)
    for _ in range(3):
        refresh.refresh_status(body, Seen(), LOG)
    assert not state.drifted, "the refresh's decision on an unchanged world differs from the applied one"
    assert calls == [KEY[1]]  # decided once; the idle rounds after it reuse that decision
    assert state.applied[1].token_secret is None and state.applied[0].agent_token == ""  # no token kept


def test_the_key_gone_after_it_was_made_applies_again(monkeypatch: pytest.MonkeyPatch) -> None:
    made(monkeypatch)
    state = runtime.CONTROLLER.state(KEY)
    body = state.body = _body()  # as its watch event left it
    assert apply_workloads(body, LOG)
    refresh.refresh_status(body, Seen(), LOG)
    assert not state.drifted
    state.key_read = None  # read again: the Secret is absent (the Api holds none)
    refresh.refresh_status(body, Seen(), LOG)
    assert state.drifted  # no key, no id: the next apply makes one


def test_a_policy_refusal_lifted_applies_and_one_that_stands_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    api = Api(monkeypatch, None)
    monkeypatch.setattr(runtime.CONTROLLER, "policy", Policy(allowed_images=("nowhere.example/",)))
    state = runtime.CONTROLLER.state(KEY)
    body = state.body = _body()
    assert apply_workloads(body, LOG) and state.applied[1].refusal[0] == IMAGE_NOT_ALLOWED
    assert api.applied == [] and api.created == []
    for _ in range(2):
        refresh.refresh_status(body, Seen(), LOG)
    assert not state.drifted  # still refused (its key never made: no reason to apply)
    monkeypatch.setattr(runtime.CONTROLLER, "policy", Policy())
    refresh.refresh_status(body, Seen(), LOG)
    assert state.drifted
