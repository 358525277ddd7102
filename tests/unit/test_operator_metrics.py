"""The operator's per-resource series (kvpersist.controller.metrics): read back with
prometheus_client's own text parser (the format's reference implementation in Python), so an
unescaped quote, backslash or line feed in a user's name breaks the test as it would break a
scrape; a changed condition and a deleted resource leave no series behind; failed L2 writes are
a counter that survives server restarts and never counts a server's past as new."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpersist.controller import metrics, refresh, tracking
from kvpersist.status.usage import ServerReport
from kvpersist.status.workloads import COMPONENT_LABEL, Seen
from tests.cases.invalid_manifests import sample
from tests.unit.test_status_patch import FakeApi, _pod, _report, _rollout

LOG = logging.getLogger("test")
HOSTILE = ['a"b', "back\\slash", "line\nfeed", 'x"} 1\nkvpersist_fake 9', "\\n\\\"", "é✓"]


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def _of(text: str, namespace: str) -> list[tuple[str, dict[str, str], float]]:
    return [s for s in _samples(text) if s[1].get("namespace") == namespace]


def _ns() -> str:
    return f"ml-{uuid.uuid4().hex[:6]}"


def _report_of(pod: str, failed: int | None, submitted: int | None = None) -> ServerReport:
    return ServerReport(pod, True, l2_writes_failed=failed, l2_writes_submitted=submitted if submitted is not None else failed)


def test_hostile_names_and_reasons_are_escaped() -> None:
    """Every label value the operator writes comes out of the parser exactly as it went in, and
    nothing a name holds can add a series of its own."""
    ns = _ns()
    try:
        for i, name in enumerate(HOSTILE):
            metrics.refreshed(ns, name, "Ready")
            metrics.observed(ns, name, {"conditions": [{"type": "Ready", "status": "False", "reason": HOSTILE[-1 - i]}],
                                        "usage": {"l2UsedBytes": 5}}, at=1.0)
        text = metrics.render()
        got = _of(text, ns)
        conditions = {(s[1]["name"], s[1]["reason"]) for s in got if s[0] == metrics.CONDITION}
        assert conditions == {(name, HOSTILE[-1 - i]) for i, name in enumerate(HOSTILE)}
        assert {s[1]["name"] for s in got if s[0] == "kvpersist_resource_l2_used_bytes"} == set(HOSTILE)
        assert {s[1]["name"] for s in got if s[0] == "kvpersist_resource_refreshes_total"} == set(HOSTILE)
        assert not any(s[0] == "kvpersist_fake" for s in _samples(text))
    finally:
        for name in HOSTILE:
            metrics.set_phase(ns, name, None)


def test_hostile_phase_label_is_escaped() -> None:
    """kvpersist_resources{phase} too: the phase is the operator's own word today, but the text
    must stay parseable whatever it is."""
    ns = _ns()
    try:
        metrics.refreshed(ns, "a", 'Ready"\n')
        assert any(s[0] == "kvpersist_resources" and s[1] == {"phase": 'Ready"\n'} for s in _samples(metrics.render()))
    finally:
        metrics.set_phase(ns, "a", None)


def test_one_series_per_condition_replaced_when_it_changes_and_gone_with_the_resource() -> None:
    ns = _ns()
    ready_false = {"type": "Ready", "status": "False", "reason": "ServersStarting"}
    metrics.refreshed(ns, "a", "Progressing")
    metrics.observed(ns, "a", {"conditions": [ready_false, {"type": "WithinBudget", "status": "True", "reason": "UnderBudget"}],
                               "usage": {"l1UsedBytes": 3, "l1CapacityBytes": 8, "l2UsedBytes": 5, "l2CapacityBytes": 9},
                               "budget": {"bytes": 100, "state": "Available"}},
                     hits={"lookupTokens": 10, "hitTokens": 4, "hitTokensL1": 3, "hitTokensL2": 1}, at=1234.5)
    got = {(s[0], tuple(sorted((k, v) for k, v in s[1].items() if k not in ("namespace", "name")))): s[2]
           for s in _of(metrics.render(), ns)}
    assert got[(metrics.CONDITION, (("reason", "ServersStarting"), ("status", "False"), ("type", "Ready")))] == 1
    assert got[(metrics.CONDITION, (("reason", "UnderBudget"), ("status", "True"), ("type", "WithinBudget")))] == 1
    values = {name: v for (name, labels), v in got.items() if not labels}
    assert values == {"kvpersist_resource_refreshes_total": 1, "kvpersist_resource_l1_used_bytes": 3,
                      "kvpersist_resource_l1_capacity_bytes": 8, "kvpersist_resource_l2_used_bytes": 5,
                      "kvpersist_resource_l2_capacity_bytes": 9, "kvpersist_resource_l2_budget_bytes": 100,
                      "kvpersist_resource_lookup_tokens_total": 10,
                      "kvpersist_resource_hit_tokens_total": 4, "kvpersist_resource_hit_tokens_l1_total": 3,
                      "kvpersist_resource_hit_tokens_l2_total": 1, "kvpersist_resource_last_refresh_timestamp_seconds": 1234.5,
                      "kvpersist_resource_l2_write_failures_total": 0, "kvpersist_resource_l2_writes_submitted_total": 0}

    # Ready turns True, the budget goes from the spec: the old condition series and the budget's go.
    metrics.observed(ns, "a", {"conditions": [{**ready_false, "status": "True", "reason": "AllReady"}]}, at=1300.0)
    got2 = _of(metrics.render(), ns)
    assert [(s[1]["type"], s[1]["status"], s[1]["reason"]) for s in got2 if s[0] == metrics.CONDITION] == [
        ("Ready", "True", "AllReady")]
    assert not any(s[0].startswith(("kvpersist_resource_l2_budget", "kvpersist_resource_l1_")) for s in got2)

    tracking.forget((ns, "a"))  # deleted: every series of it goes
    assert _of(metrics.render(), ns) == []


def test_l2_write_failures_count_what_is_new_across_server_restarts() -> None:
    ns = _ns()
    try:
        def failures(*reports: ServerReport) -> float:
            metrics.observed(ns, "a", {}, reports=reports, at=1.0)
            return next(s[2] for s in _of(metrics.render(), ns) if s[0] == "kvpersist_resource_l2_write_failures_total")

        # First readings are baselines: what the servers counted before the operator saw them is not new.
        assert failures(_report_of("s-0", 40), _report_of("s-1", 7)) == 0
        assert failures(_report_of("s-0", 45), _report_of("s-1", 7)) == 5
        assert failures(_report_of("s-0", None), _report_of("s-1", 9)) == 7  # s-0 unread: its baseline stays
        assert failures(_report_of("s-0", 46)) == 8  # s-1 not running: nothing lost, nothing counted twice
        assert failures(_report_of("s-0", 3), _report_of("s-1", 9)) == 11  # s-0 restarted: all 3 are new
        assert failures() == 11  # no server answered: a counter never goes down
    finally:
        metrics.set_phase(ns, "a", None)


def test_a_refresh_publishes_the_resources_conditions_and_when_it_finished(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real refresh path (observation, judgement, status write): the series are those of the
    status written, the timestamp is set only once that write went through."""
    from kvpersist.controller import reading

    body = sample("nvme-minimal")
    ns = _ns()
    body["metadata"].update(namespace=ns, uid="u1", generation=2)
    api = FakeApi(monkeypatch, [_report("s-0", 2048, l2_writes_failed=0)])
    target, _ = reading.target_of(body)
    seen = Seen(statefulsets=[{**_rollout(1, 1), "metadata": {"name": target.server_name, "generation": 1}}],
                deployments=[{**_rollout(1, 1), "metadata": {"name": target.vllm_name, "generation": 1}}],
                pods=[_pod(f"{target.server_name}-0")],
                claims=[{"metadata": {"name": "l2", "labels": {COMPONENT_LABEL: "lmcache-server"}}, "status": {"phase": "Bound"}}],
                live_ids=frozenset({target.namespace_id or ""}))
    try:
        refresh.refresh_status(body, seen, LOG)
        written = api.patches[-1]
        got = _of(metrics.render(), ns)
        shown = {(s[1]["type"], s[1]["status"], s[1]["reason"]) for s in got if s[0] == metrics.CONDITION}
        assert shown == {(c["type"], c["status"], c["reason"]) for c in written["conditions"]} and shown
        assert ("Ready", "True", next(c["reason"] for c in written["conditions"] if c["type"] == "Ready")) in shown
        stamp = [s[2] for s in got if s[0] == "kvpersist_resource_last_refresh_timestamp_seconds"]
        assert len(stamp) == 1 and stamp[0] > 1.7e9
        assert [s[2] for s in got if s[0] == "kvpersist_resource_l2_used_bytes"] == [written["usage"]["l2UsedBytes"]]

        # A write the API server refuses: no new timestamp (the alert on a stale one is what sees it).
        def refused(*_a: Any) -> None:
            raise RuntimeError("refused")

        monkeypatch.setattr(refresh.kube, "patch_status", refused)
        body["metadata"]["generation"] = 3  # something to write
        with pytest.raises(RuntimeError):
            refresh.refresh_status(body, seen, LOG)
        again = [s[2] for s in _of(metrics.render(), ns) if s[0] == "kvpersist_resource_last_refresh_timestamp_seconds"]
        assert again == stamp
    finally:
        tracking.forget((ns, body["metadata"]["name"]))


def test_a_replica_that_stands_down_drops_its_resource_series(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the active replica's view is current: a replica that stood down (another peer became
    active) must not keep showing a condition it can no longer update."""
    from kvpersist.controller import status_loop

    ns, other = _ns(), _ns()
    for n in (ns, other):
        metrics.refreshed(n, "a", "Ready")
        metrics.observed(n, "a", {"conditions": [{"type": "Ready", "status": "False", "reason": "ServersStarting"}]}, at=1.0)
    monkeypatch.setattr(status_loop, "active", lambda now, namespace: namespace == other)
    try:
        assert status_loop._active_keys([(ns, "a"), (other, "a")], 0.0) == [(other, "a")]
        text = metrics.render()
        assert not any(s[0] == metrics.CONDITION for s in _of(text, ns))
        assert any(s[0] == metrics.CONDITION for s in _of(text, other))
    finally:
        metrics.set_phase(ns, "a", None)
        metrics.set_phase(other, "a", None)


def test_every_counter_the_operator_counts_is_rendered() -> None:
    """A name given to metrics.inc but missing from metrics.HELP is counted and never shown (as
    kvpersist_gc_total was): every literal name the operator's code counts must be rendered."""
    import re
    from pathlib import Path

    package = Path(metrics.__file__).resolve().parents[1]
    counted = {m for path in package.rglob("*.py")
               for m in re.findall(r'metrics\.inc\(\s*"([a-z_]+)"', path.read_text())}
    assert "kvpersist_gc_total" in counted and counted <= set(metrics.HELP), counted - set(metrics.HELP)
    text = metrics.render()
    assert all(f"# TYPE {name} counter" in text for name in counted)
