"""A resource's spec is parsed once per distinct spec (issue 46): every status round parsed it
again (a fifth of the operator's CPU at 500 resources). The cache is keyed by the spec itself, so
an edit is never served the old parse, and a spec the models refuse is refused every time."""

from __future__ import annotations

import copy
import logging

import pytest
from pydantic import ValidationError

from kvpersist.api import v1alpha1 as api
from kvpersist.controller import decision, reading, runtime, tracking
from tests.cases.invalid_manifests import sample


def body(**spec_changes: object) -> dict:
    obj = copy.deepcopy(sample("hf-bucket"))
    obj["metadata"].update(namespace="ml", name="r", uid="u-1", generation=1)
    obj["spec"].update(spec_changes)
    return obj


def test_the_same_spec_is_parsed_once_and_an_edit_parses_again(monkeypatch: pytest.MonkeyPatch) -> None:
    reading._PARSED.clear()
    parsed: list[int] = []
    validate = api.KVCacheNamespace.model_validate
    monkeypatch.setattr(api.KVCacheNamespace, "model_validate",
                        classmethod(lambda cls, data, **kw: parsed.append(1) or validate(data, **kw)))
    first = reading.target_of(body())[0]
    again = reading.target_of(copy.deepcopy(body()))[0]  # an equal spec in another dict (the next watch event)
    assert len(parsed) == 1 and again.spec is first.spec
    edited = body()
    edited["spec"]["l1"] = {**edited["spec"]["l1"], "size": "3Gi"}
    assert reading.target_of(edited)[0].spec.l1.size_gb == 3 and len(parsed) == 2  # same uid and generation, new spec
    renamed = body()
    renamed["metadata"]["name"] = "other"
    assert reading.target_of(renamed)[0].name == "other" and len(parsed) == 3
    broken = body()
    broken["spec"]["l1"] = {"size": "-1Gi"}
    for _ in range(2):
        with pytest.raises(ValidationError):
            reading.target_of(broken)
    assert len(parsed) == 5  # refused each time, never cached


def test_an_unchanged_resource_is_neither_parsed_nor_hashed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its watch copy keeps the same spec object across status events (tracking.remember), so its
    rounds reuse the last answer; another key fingerprint, or an edited spec, is worked out anew."""
    key = ("ml", "r")
    reading._PARSED.clear()
    resolved: list[int] = []
    resolve = decision.resolve  # reading.target_of's (kvpersist.controller.decision.target_for)
    monkeypatch.setattr(decision, "resolve", lambda pins: resolved.append(1) or resolve(pins))
    try:
        tracking.remember(key, body(), logging.getLogger("test"))
        first = runtime.CONTROLLER.get(key).body
        status_event = body()
        status_event["status"] = {"phase": "Ready"}
        tracking.remember(key, status_event, logging.getLogger("test"))
        stored = runtime.CONTROLLER.get(key).body
        assert stored["spec"] is first["spec"] and stored["status"] == {"phase": "Ready"}
        n = len(resolved)
        answers = [reading.target_of(stored, "f1") for _ in range(3)]
        assert len(resolved) == n + 1 and all(a[1] is answers[0][1] for a in answers)
        assert reading.target_of(stored, "f2")[1] is not answers[0][1] and len(resolved) == n + 2
        edited = body()
        edited["spec"]["l1"] = {**edited["spec"]["l1"], "size": "3Gi"}
        tracking.remember(key, edited, logging.getLogger("test"))
        assert reading.target_of(runtime.CONTROLLER.get(key).body, "f2")[0].spec.l1.size_gb == 3
    finally:
        runtime.CONTROLLER.forget(key)
