"""Issue 42 item 9: the operator says when the creator-rights policy is not there to enforce
anything. The judge, the caches it reads and what a change of verdict does, without a cluster; the
API server's side is tests/e2e/test_least_privilege.py::test_a_missing_creator_rights_policy_is_said_everywhere."""

from __future__ import annotations

from typing import Any

import pytest

from kvpersist.controller import admissioncheck, metrics, runtime
from kvpersist.controller.watchcache import WatchCache
from kvpersist.status import creatorrights
from kvpersist.status.conditions import compute_status
from tests.unit.test_conditions import obs

NAME = "kvpersist-creator-rights"
POLICY = {"metadata": {"name": NAME}, "spec": {}}
BINDING = {"metadata": {"name": NAME}, "spec": {"policyName": NAME, "validationActions": ["Deny"]}}


@pytest.mark.parametrize(("served", "policy", "binding", "reason"), [
    (True, POLICY, BINDING, creatorrights.ENFORCED),
    (True, None, BINDING, creatorrights.ABSENT),
    (True, POLICY, None, creatorrights.UNBOUND),
    (True, POLICY, {"metadata": {"name": NAME}, "spec": {"policyName": NAME, "validationActions": ["Warn", "Audit"]}},
     creatorrights.UNBOUND),
    (True, POLICY, {"metadata": {"name": NAME}, "spec": {"policyName": "another", "validationActions": ["Deny"]}},
     creatorrights.UNBOUND),
    (False, None, None, creatorrights.NOT_SERVED),
])
def test_the_verdict_names_what_is_missing_the_risk_and_the_fix(served: bool, policy: Any, binding: Any, reason: str) -> None:
    ok, got, message = creatorrights.judge(NAME, served, policy, binding)
    assert (ok, got) == (reason == creatorrights.ENFORCED, reason)
    if not ok:
        assert "onto GPU nodes" in message and NAME in message
    if reason in (creatorrights.ABSENT, creatorrights.UNBOUND):
        assert "config/creator-rights/creator-rights.yaml" in message and "creatorRights.enabled=true" in message


def test_unreadable_claims_nothing() -> None:
    assert creatorrights.judge(NAME, True, None, None, refused="403")[:2] == (None, creatorrights.UNREADABLE)


def test_the_condition_is_informational_never_holding_ready_back() -> None:
    fields, conds = compute_status(obs(creator_rights=creatorrights.judge(NAME, True, None, None)))
    by_type = {c["type"]: c for c in conds}
    assert by_type["CreatorRightsEnforced"]["status"] == "False" and fields["phase"] == "Ready"


def _cache(objects: list[dict[str, Any]] | None) -> WatchCache:
    """A cache that has listed these objects (None: not listed yet)."""
    cache = WatchCache("X", None, lambda _s, _keep: (objects or [], "1"), lambda *_a: iter(()), keep=dict)
    if objects is not None:
        cache._relist(None)
    return cache


def test_the_verdict_comes_from_the_caches_and_waits_for_them() -> None:
    assert admissioncheck.verdict_of(NAME, _cache(None), _cache([BINDING]), None) is None  # not listed: nothing said
    assert admissioncheck.verdict_of(NAME, _cache(None), _cache(None), "not listed")[1] == creatorrights.UNREADABLE
    assert admissioncheck.verdict_of(NAME, _cache([]), _cache([BINDING]), None)[1] == creatorrights.ABSENT
    assert admissioncheck.verdict_of(NAME, _cache([POLICY]), _cache([BINDING]), None)[1] == creatorrights.ENFORCED


def test_a_change_marks_every_resource_sets_the_gauge_and_logs(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setattr(runtime.CONTROLLER, "creator_rights", None)
    monkeypatch.setattr(metrics, "_creator_rights", [])  # the gauge, restored after
    posted = []
    monkeypatch.setattr(admissioncheck, "_post_operator_event", posted.append)
    monkeypatch.setattr(runtime.CONTROLLER, "resources", {})
    state = runtime.CONTROLLER.state(("ns", "r"))
    state.body, state.dirty = {"metadata": {"name": "r", "namespace": "ns"}}, False
    missing = creatorrights.judge(NAME, True, None, None)
    assert admissioncheck.observe(missing) is True
    assert state.dirty and posted == [missing] and "PolicyMissing" in caplog.text
    assert f"{metrics.CREATOR_RIGHTS} 0" in metrics.render()
    state.dirty = False
    assert admissioncheck.observe(missing) is False and not state.dirty and len(posted) == 1  # the same: nothing
    assert admissioncheck.observe(creatorrights.judge(NAME, True, POLICY, BINDING)) is True
    assert f"{metrics.CREATOR_RIGHTS} 1" in metrics.render() and state.dirty and len(posted) == 2


def test_the_check_is_named_by_the_install_and_can_be_turned_off() -> None:
    assert admissioncheck.policy_name({}) == NAME
    assert admissioncheck.policy_name({admissioncheck.POLICY_ENV: "r-kvpersist-creator-rights"}) == "r-kvpersist-creator-rights"
    assert admissioncheck.policy_name({admissioncheck.POLICY_ENV: "off"}) is None
