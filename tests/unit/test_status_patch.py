"""Status patches against the status models the CRD is generated from: a key the CRD lacks would
be pruned by the API server without a word, so it must fail here. The patches checked are the
ones the real builders produce (conditions, usage, hits, inventory, budget, gc), down to a whole
refresh_status round, so a builder that emits a key the model lacks fails this file."""

from __future__ import annotations

import ast
import base64
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from kvpersist.api import status as status_api
from kvpersist.api.status import StatusPatchError, checked_patch, validate_patch
from kvpersist.api.statusmodels import KVCacheNamespaceStatus
from kvpersist.builders.retained import retained_labels
from kvpersist.builders.target import SERVER
from kvpersist.controller import agents, kube, reading, refresh, runtime
from kvpersist.controller.policy import IMAGE_NOT_ALLOWED, SECRET_NOT_ALLOWED, refused_status
from kvpersist.controller.state import Controller
from kvpersist.identity import key_fingerprint, resolve
from kvpersist.inventory.cleanup import result as gc_result
from kvpersist.inventory.volume import Inventory, NamespaceUsage, status_summary
from kvpersist.status import conditions
from kvpersist.status.conditions import Observation, compute_status, failed_status, status_patch
from kvpersist.status.usage import HitTracker, LookupCounters, ServerReport
from kvpersist.status.workloads import COMPONENT_LABEL, Seen
from tests.cases.invalid_manifests import sample

ROOT = Path(__file__).resolve().parents[2]
NID, ORPHAN = "kvp-" + "a" * 32, "kvp-" + "b" * 32
STAMP = "2026-01-01T00:00:00Z"
LOG = logging.getLogger("test")


def _condition(**kw: Any) -> dict[str, Any]:
    return {"type": "Ready", "status": "True", "reason": "AllReady", "message": "", **kw}


# ---------------------------------------------------------------- (a) what does not fit fails


@pytest.mark.parametrize(("patch", "named"), [
    ({"phse": "Ready"}, "status.phse"),
    ({"usage": {"l1UsedByte": 1, "l1UsedBytes": 1}}, "status.usage.l1UsedByte"),
    ({"conditions": [{"type": "Ready", "status": "True", "reasn": "AllReady"}]}, "status.conditions[0].reasn"),
    ({"conditions": [_condition(), _condition(type="L2Ready", lastTransitionTim=STAMP)]},
     "status.conditions[1].lastTransitionTim"),
    ({"hits": {"window": {"seconds": 10, "hitRat": "1.0%"}}}, "status.hits.window.hitRat"),
    ({"hits": {"servers": [{"pod": "s-0", "startedat": STAMP}]}}, "status.hits.servers[0].startedat"),
    ({"inventory": {"volumes": [{"location": "pvc/x", "namespaces": [{"namespaceId": NID, "bytes": 1, "objects": 1,
                                                                       "lastWrites": STAMP}]}]}},
     "status.inventory.volumes[0].namespaces[0].lastWrites"),
    ({"inventory": {"volumes": [{"location": "pvc/x", "capacityBytes": 5}]}}, "status.inventory.volumes[0].capacityBytes"),
    ({"budget": {"usedByte": 1}}, "status.budget.usedByte"),
    ({"gc": {"requestId": "r", "namespaceId": ORPHAN, "outcom": "Deleted"}}, "status.gc.outcom"),
    ({"namespace_id": NID}, "status.namespace_id"),  # the Python name is no status key: the alias is
    ({"servers": [{"pod": "s-0", "healthy": True, "mesage": ""}]}, "status.servers[0].mesage"),
])
def test_a_key_the_model_lacks_fails_and_is_named(patch: dict[str, Any], named: str) -> None:
    with pytest.raises(StatusPatchError) as err:
        validate_patch(patch)
    assert any(p.startswith(named + ":") for p in err.value.problems), err.value.problems


@pytest.mark.parametrize(("patch", "named"), [
    ({"readyReplicas": "1"}, "status.readyReplicas"),  # JSON as the API server gets it: "1" is no integer
    ({"phase": "Fine"}, "status.phase"),
    ({"usage": {"l1UsedBytes": 1.5}}, "status.usage.l1UsedBytes"),
    ({"usage": {"measuredAt": "yesterday"}}, "status.usage.measuredAt"),
    ({"namespaceId": "kvp-nothex"}, "status.namespaceId"),
    ({"hits": {"hitRate": "62.5%"}}, "status.hits.hitRate"),  # a number now, never a string
    ({"hits": {"hitRate": 1.5}}, "status.hits.hitRate"),  # a share: at most 1
    ({"conditions": [_condition(status="Yes")]}, "status.conditions[0].status"),
    ({"conditions": [{"type": "Ready", "status": "True"}]}, "status.conditions[0].reason"),  # a list item is whole
    ({"budget": {"bytes": 10, "state": None}}, "status.budget.state"),  # required: cannot be removed
    ({"usage": 5}, "status.usage"),
    ({"usage": {"measuredAt": object()}}, "status.usage.measuredAt"),  # not JSON at all
])
def test_a_value_of_the_wrong_type_fails_and_is_named(patch: dict[str, Any], named: str) -> None:
    with pytest.raises(StatusPatchError) as err:
        validate_patch(patch)
    assert any(p.startswith(named) for p in err.value.problems), err.value.problems


def test_every_status_model_forbids_extra_keys() -> None:
    """What makes a misspelled key in a list item (validated by the model) fail at all."""
    seen: set[type[BaseModel]] = set()

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        assert model.model_config.get("extra") == "forbid", model.__name__
        for info in model.model_fields.values():
            for inner in _models_in(info.annotation):
                walk(inner)

    walk(KVCacheNamespaceStatus)
    assert len(seen) >= 12  # Condition, Usage, ServerHealth, Inventory..., Budget, Hit..., GC: the walk went deep


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]


# ---------------------------------------------------------------- (c) None removes a field


def test_none_removes_an_optional_field() -> None:
    validate_patch({"budget": None, "usage": None, "inventory": None, "gc": None, "hits": None, "namespaceId": None,
                    "observedGeneration": None, "conditions": None})
    validate_patch({"hits": {"window": None, "hitRate": None, "hitRateL1": None, "hitRateL2": None, "summary": None},
                    "usage": {"l2UsedBytes": None, "l2Used": None}})
    validate_patch({"inventory": {"volumes": [{"location": "pvc/x", "pod": None, "otherBytes": None,
                                               "namespaces": [{"namespaceId": NID, "bytes": 0, "objects": 0,
                                                               "lastWrite": None, "orphan": None}]}]}})


# ---------------------------------------------------------------- (b) what the builders produce fits


def _rollout(ready: int, desired: int) -> dict[str, Any]:
    return {"metadata": {"generation": 1},
            "status": {"observedGeneration": 1, "readyReplicas": ready, "updatedReplicas": desired, "replicas": desired}}


def _pod(name: str, ready: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {COMPONENT_LABEL: SERVER}},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def _report(pod: str, lookups: int = 0, **kw: Any) -> ServerReport:
    figures = dict(l1_used=3 * 2**20, l1_capacity=2**30, l2_used=5 * 2**20, l2_capacity=4 * 2**30, l2_objects=7,
                   l2_healthy=True, l2_writes_failed=0, l2_writes_submitted=7,
                   lookups=LookupCounters(lookups, lookups // 2, lookups // 4, lookups // 4, STAMP))
    return ServerReport(pod, True, **{**figures, **kw})


def _inventory() -> dict[str, Any]:
    volume = Inventory("pvc/l2-s-0", [NamespaceUsage(NID, 5 * 2**20, 7, 1.7e9), NamespaceUsage(ORPHAN, 2**20, 3, None)],
                       other_bytes=12, capacity_bytes=2**40, free_bytes=2**39)
    return status_summary([("pvc/l2-s-0", "s-0", volume)], NID, {NID})


def _obs(**kw: Any) -> Observation:
    base: dict[str, Any] = dict(generation=3, namespace_id=NID, identity_reason="", l2_kind="nvme", server_desired=1,
                                vllm_desired=1, statefulset=_rollout(1, 1), deployment=_rollout(1, 1),
                                server_pods=[_pod("s-0")], claims=[{"metadata": {"name": "l2-s-0"}, "status": {"phase": "Bound"}}],
                                reports=[_report("s-0", 2048)], inventory=_inventory())
    return Observation(**{**base, **kw})


def _hits(rounds: int = 2) -> dict[str, Any] | None:
    """status.hits from the real tracker: the second round has a window too."""
    tracker, hits = HitTracker(), None
    for i in range(rounds):
        hits = tracker.observe("k", "u", hits, [_report("s-0", 2048 * (i + 1))], 10.0 * i, STAMP)
    return hits


OBSERVATIONS = {
    "ready with usage, inventory and budget": _obs(budget_bytes=64 * 2**20),
    "budget exhausted": _obs(budget_bytes=2**20, budget_floor=2**20, budget_floor_exhausted=True),
    "budget, nothing measured yet": _obs(budget_bytes=2**20, reports=[], inventory=None),
    "cache disabled": _obs(namespace_id=None, identity_reason="missing pins: head_size", server_desired=0,
                           statefulset=_rollout(0, 0), server_pods=[], claims=[], reports=[], inventory=None),
    "pending": _obs(statefulset=_rollout(0, 1), deployment=_rollout(0, 1), server_pods=[_pod("s-0", False)],
                    reports=[ServerReport("s-0", False, "unreachable")], inventory=None),
    "degraded, L2 writes failing": _obs(writes_failing=["s-0"], reports=[_report("s-0", l2_writes_failed=3)]),
    "pods forbidden": _obs(statefulset={"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": 0}},
                           server_create_failure="violates PodSecurity \"baseline:latest\": host namespaces"),
    "claim pending": _obs(claims=[{"metadata": {"name": "l2-s-0"}, "status": {"phase": "Pending"}}]),
    "bucket refused": _obs(l2_kind="hfBucket", claims=[], bucket_check=(False, "BucketNotFound", "no such bucket")),
    "key secret missing": _obs(key_problem=("KeySecretNotFound", "create it")),
}


@pytest.mark.parametrize("name", sorted(OBSERVATIONS))
def test_patches_of_every_situation_fit(name: str) -> None:
    fields, conds = compute_status(OBSERVATIONS[name])
    obs = OBSERVATIONS[name]
    patch = status_patch({}, fields, conds, obs.reports, obs.inventory, _hits())
    assert patch is not None and {"phase", "conditions", "hits"} <= set(patch)
    validate_patch(patch)
    # The next round: what changed since the status the first one left.
    later = status_patch({**patch, "budget": {"bytes": 1, "state": "Available"}}, fields, conds, obs.reports,
                         obs.inventory, _hits(3), datetime.now(UTC))
    assert later is not None
    validate_patch(later)


def test_the_full_patch_has_every_part() -> None:
    """Not vacuous: the builders' usage, inventory, hits (with its window and servers) and budget
    are all in the patch checked above."""
    obs = OBSERVATIONS["ready with usage, inventory and budget"]
    fields, conds = compute_status(obs)
    patch = status_patch({}, fields, conds, obs.reports, obs.inventory, _hits())
    assert patch is not None
    assert {"usage", "inventory", "hits", "budget", "servers", "conditions", "namespaceId"} <= set(patch)
    assert patch["hits"]["window"] and patch["hits"]["servers"] and patch["inventory"]["volumes"][0]["namespaces"]
    assert {c["type"] for c in patch["conditions"]} >= {"WithinBudget", "Ready"}
    validate_patch(patch)


def test_a_budget_taken_off_the_spec_is_removed_with_none() -> None:
    fields, conds = compute_status(_obs())
    patch = status_patch({"budget": {"bytes": 2**20, "state": "Available"}}, fields, conds, [], None)
    assert patch is not None and patch["budget"] is None
    validate_patch(patch)


@pytest.mark.parametrize("refusal", [(IMAGE_NOT_ALLOWED, "spec.image: not allowed"),
                                     (SECRET_NOT_ALLOWED, "spec.l2.hfBucket.tokenSecretRef: not labelled")])
def test_refused_and_failed_status_fit(refusal: tuple[str, str]) -> None:
    """The patches themselves, not `patch or {}`: an empty patch would fit whatever the builders did."""
    fields, conds = refused_status(*compute_status(_obs()), refusal, 3)
    patch = status_patch({}, fields, conds, [], None)
    assert patch is not None and patch["phase"] == "Failed", patch
    ready = next(c for c in patch["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"], ready["message"], ready["observedGeneration"]) == ("False", *refusal, 3)
    validate_patch(patch)
    fields, conds = failed_status(4, "spec.l2: set exactly one of nvme or hfBucket")
    patch = status_patch({}, fields, conds, [], None)
    assert patch is not None and patch["phase"] == "Failed" and patch["observedGeneration"] == 4, patch
    assert [(c["type"], c["reason"]) for c in patch["conditions"]] == [("Ready", "InvalidSpec")]
    validate_patch(patch)


@pytest.mark.parametrize("outcome", ["Deleted", "Refused", "NotFound", "Failed"])
def test_gc_results_fit(outcome: str) -> None:
    request = {"requestId": "r-1", "namespaceId": ORPHAN}
    validate_patch({"gc": {**gc_result(request, outcome, "what happened", NamespaceUsage(ORPHAN, 10, 2)),
                           "completedAt": conditions.now()}})
    validate_patch({"gc": gc_result(request, outcome, "x" * 5000, completed_at=STAMP)})


def test_a_builder_emitting_a_misspelled_key_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the tests above guard against: a builder's typo reaches the check and fails it."""
    monkeypatch.setattr(conditions, "summarize", lambda reports, measured_at, **_: {"l1UsedByte": 1, "measuredAt": measured_at})
    fields, conds = compute_status(_obs())
    patch = status_patch({}, fields, conds, [_report("s-0")], None)
    assert patch is not None and patch["usage"]["l1UsedByte"] == 1
    with pytest.raises(StatusPatchError, match=r"status\.usage\.l1UsedByte"):
        validate_patch(patch)


KEY = b"k" * 32  # the generated L2 key Secret's bytes, as FakeApi serves them


class FakeApi:
    """The API server as refresh_status and run_gc see it: status patches merged into the body,
    the generated L2 key Secret (KEY) read, metadata patches recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, reports: list[ServerReport]) -> None:
        self.patches: list[dict[str, Any]] = []
        self.metadata_patches: list[tuple[str, str, dict[str, Any]]] = []
        secret = {"metadata": {"name": "llama31-8b-l2-key", "labels": retained_labels("llama31-8b", "l2-key")},
                  "data": {"master-key": base64.b64encode(KEY).decode()}}
        monkeypatch.setattr(kube, "get", lambda v, kind, name, ns: secret if kind == "Secret" else None)
        monkeypatch.setattr(kube, "named_metadata", lambda *a: None)  # no object under its names yet
        monkeypatch.setattr(kube, "get_metadata", lambda *a: None)
        monkeypatch.setattr(kube, "patch_metadata", lambda v, kind, name, ns, patch: self.metadata_patches.append(
            (kind, name, patch)))
        monkeypatch.setattr(kube, "patch_status", lambda *a: self.patches.append(a[-1]))
        monkeypatch.setattr(kube, "post_event", lambda *a: None)
        monkeypatch.setattr(agents, "agent_token", lambda target: "token")  # refresh's and gc's
        monkeypatch.setattr(refresh, "collect_usage", lambda running, port, token=None: reports)
        monkeypatch.setattr(agents, "inventories", lambda pods, port, token: [
            Inventory("ignored", [NamespaceUsage(NID, 5 * 2**20, 7, 1.7e9), NamespaceUsage(ORPHAN, 2**20, 3)], 12)
            for _ in pods])
        monkeypatch.setattr(runtime, "CONTROLLER", Controller())


def test_refresh_status_writes_what_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole refresh round with the real observation, judgement and patch: every write checked."""
    body = sample("nvme-minimal")
    body["metadata"].update(namespace="ml", uid="u1", generation=2)
    body["spec"]["l2"]["nvme"].update(budget="64Mi", adapter="nixl_store_dynamic")
    api = FakeApi(monkeypatch, [_report("s-0", 2048)])
    target, _resolution = reading.target_of(body, key_fingerprint(KEY))
    assert target.namespace_id == resolve(target.spec.pins(key_fingerprint(KEY))).namespace_id is not None
    pods = [_pod(f"{target.server_name}-0")]
    seen = Seen(statefulsets=[{**_rollout(1, 1), "metadata": {"name": target.server_name, "generation": 1}}],
                deployments=[{**_rollout(1, 1), "metadata": {"name": target.vllm_name, "generation": 1}}], pods=pods,
                claims=[{"metadata": {"name": "l2", "labels": {COMPONENT_LABEL: SERVER}}, "status": {"phase": "Bound"}}],
                live_ids=frozenset({target.namespace_id or ""}))
    refresh.refresh_status(body, seen, LOG)
    monkeypatch.setattr(refresh, "collect_usage", lambda running, port, token=None: [_report("s-0", 4096)])
    body["status"] = dict(api.patches[-1])
    del body["spec"]["l2"]["nvme"]["budget"]
    refresh.refresh_status(body, seen, LOG)
    assert len(api.patches) == 2
    first, second = api.patches
    assert {"usage", "inventory", "hits", "budget", "conditions", "phase", "l2Key"} <= set(first)
    assert first["l2Key"] == {"secret": "llama31-8b-l2-key", "generated": True, "fingerprint": key_fingerprint(KEY),
                              "namespaceId": target.namespace_id} and first["namespaceId"] == target.namespace_id
    assert second["budget"] is None and second["hits"]["window"] is not None


def test_refresh_of_a_spec_the_models_refuse_writes_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the schema let in and the models refuse (a stale CRD, or the two disagreeing; CI's fuzz
    found one) is written as Failed / InvalidSpec naming the field, through the whole refresh round.
    It crashed the round once (a name bound only for a readable spec), so the resource never got a
    status and kopf retried it forever."""
    body = sample("nvme-minimal")
    body["metadata"].update(namespace="ml", uid="u1", generation=3)
    body["status"] = {"phase": "Ready", "observedGeneration": 2}  # the last spec was readable
    body["spec"]["l2"]["nvme"]["maxCapacity"] = "0"  # the models want at least 1Mi
    api = FakeApi(monkeypatch, [_report("s-0", 2048)])
    refresh.refresh_status(body, Seen(), LOG)
    assert len(api.patches) == 1
    written = api.patches[0]
    assert written["phase"] == "Failed" and written["observedGeneration"] == 3
    ready = [c for c in written["conditions"] if c["type"] == "Ready"]
    assert len(ready) == 1 and ready[0]["status"] == "False" and ready[0]["reason"] == "InvalidSpec"
    assert "spec.l2.nvme.maxCapacity" in ready[0]["message"]


# ---------------------------------------------------------------- production: never crash the loop


def test_in_production_a_bad_field_is_left_out_and_logged(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(status_api, "STRICT", False)
    monkeypatch.delenv(status_api.STRICT_ENV, raising=False)
    patch = {"phase": "Ready", "usage": {"l1UsedByte": 1, "l1UsedBytes": 1}, "replicas": "1/1"}
    with caplog.at_level(logging.ERROR):
        sent = checked_patch(patch, LOG, "ml/a")
    assert sent == {"phase": "Ready", "replicas": "1/1"}
    assert "status.usage" in caplog.text and "l1UsedByte" in caplog.text and "ml/a" in caplog.text
    assert checked_patch({"phse": "Ready"}, LOG) is None  # nothing valid: nothing sent

    sent_to_api: list[dict[str, Any]] = []
    monkeypatch.setattr(kube, "patch_status", lambda *a: sent_to_api.append(a[-1]))
    meta = {"name": "a", "namespace": "ml"}
    assert refresh.write_status(meta, {"phse": "Ready"}, LOG) is None and sent_to_api == []
    assert refresh.write_status(meta, patch, LOG) == {"phase": "Ready", "replicas": "1/1"}
    assert sent_to_api == [{"phase": "Ready", "replicas": "1/1"}]


def test_strict_mode_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status_api, "STRICT", False)
    monkeypatch.setenv(status_api.STRICT_ENV, "1")
    with pytest.raises(StatusPatchError):
        checked_patch({"phse": "Ready"}, LOG)


def test_in_tests_a_bad_patch_raises_before_anything_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[Any] = []
    monkeypatch.setattr(kube, "patch_status", lambda *a: sent.append(a))
    with pytest.raises(StatusPatchError, match=r"status\.gc\.outcom"):
        refresh.write_status({"name": "a", "namespace": "ml"}, {"gc": {"outcom": "Deleted"}}, LOG)
    assert sent == []


def test_every_status_write_goes_through_the_check() -> None:
    """kube.patch_status is called in one place only: refresh.write_status, which checks first."""
    callers = []
    for path in sorted((ROOT / "operator" / "kvpersist").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "patch_status":
                    callers.append((path.relative_to(ROOT / "operator").as_posix(), func.name))
    assert sorted(set(callers)) == [("kvpersist/controller/refresh.py", "write_status")]
