"""The agent image roll (kvpersist.status.agentroll, kvpersist.controller.agentroll): a new operator
image rolls the lmcache StatefulSets a few at a time, the next only once the last is Ready again."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpersist.builders.lmcache import AGENT_CONTAINER, AGENT_IMAGE_ENV
from kvpersist.controller import agentroll as glue
from kvpersist.status import agentroll as plan
from kvpersist.status.agentroll import AgentSet
from kvpersist.status.workloads import fleet, slim

OLD = "ghcr.io/kvpersist/kvpersist-operator@sha256:" + "a" * 64
NEW = "ghcr.io/kvpersist/kvpersist-operator@sha256:" + "b" * 64
A, B, C = ("ns", "a"), ("ns", "b"), ("other", "c")
CHART = Path(__file__).resolve().parents[2] / "charts" / "kvpersist"


def sts(image: str, replicas: int = 1, ready: int | None = None, updated: int | None = None,
        generation: int = 2, observed: int = 2, name: str = "a",
        revisions: tuple[str, str] | None = None) -> dict[str, Any]:
    """A StatefulSet as the API server serves it; revisions: its status's (currentRevision,
    updateRevision), left out (unknown) by default."""
    ready = replicas if ready is None else ready
    updated = replicas if updated is None else updated
    status: dict[str, Any] = {"observedGeneration": observed, "replicas": replicas, "readyReplicas": ready,
                              "updatedReplicas": updated}
    if revisions is not None:
        status["currentRevision"], status["updateRevision"] = revisions
    return {"kind": "StatefulSet",
            "metadata": {"name": f"{name}-lmcache", "namespace": "ns", "generation": generation,
                         "labels": {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": "lmcache-server"}},
            "spec": {"replicas": replicas, "template": {"spec": {"containers": [
                {"name": "lmcache-server", "image": "lmcache@sha256:" + "c" * 64},
                {"name": AGENT_CONTAINER, "image": image}]}}},
            "status": status}


def test_view_reads_image_size_and_whether_the_rollout_is_done() -> None:
    assert plan.view(sts(OLD)) == AgentSet(OLD, 1, True)
    assert not plan.view(sts(NEW, ready=0)).settled  # its server restarting
    assert not plan.view(sts(NEW, updated=0)).settled  # the controller has not replaced the pod yet
    assert not plan.view(sts(NEW, generation=3, observed=2)).settled  # the new template not seen yet
    assert plan.view(sts(NEW, replicas=0, ready=0)) == AgentSet(NEW, 0, True)


def test_the_slim_cache_keeps_what_the_plan_reads() -> None:
    """The watch cache holds slim objects (status.workloads): the plan must see the same there."""
    full = sts(NEW, replicas=2, ready=1)
    assert plan.view(slim(full)) == plan.view(full) == AgentSet(NEW, 2, False)
    assert fleet({A: [slim(full)]}) == {A: AgentSet(NEW, 2, False)}


def test_only_one_rolls_at_a_time_and_the_next_after_it_is_ready() -> None:
    everyone_old = {A: AgentSet(OLD, 1, True), B: AgentSet(OLD, 1, True), C: AgentSet(OLD, 1, True)}
    assert plan.decide(A, NEW, everyone_old, [], 1) == "roll"
    # A was handed the image; the watch cache has not shown it yet: its claim holds the slot.
    assert plan.decide(C, NEW, everyone_old, [A], 1) == "hold"
    assert plan.decide(B, NEW, everyone_old, [A], 1) == "hold"
    assert plan.decide(A, NEW, everyone_old, [A], 1) == "rolling"
    # A on the new image, its server restarting: still its slot.
    restarting = {**everyone_old, A: AgentSet(NEW, 1, False)}
    assert plan.in_flight(NEW, restarting, []) == {A}
    assert plan.decide(B, NEW, restarting, [A], 1) == "hold"
    assert plan.decide(C, NEW, restarting, [], 1) == "hold"  # an operator restart loses claims, not the slot
    # A Ready again on the new image: the next one goes.
    done = {**everyone_old, A: AgentSet(NEW, 1, True)}
    assert plan.decide(A, NEW, done, [A], 1) == "current"
    assert plan.decide(B, NEW, done, [A], 1) == "roll"
    assert plan.decide(C, NEW, done, [], 1) == "roll"


def test_a_larger_limit_rolls_that_many() -> None:
    fleet_ = {k: AgentSet(OLD, 1, True) for k in (A, B, C)}
    assert plan.decide(B, NEW, fleet_, [A], 2) == "roll"
    assert plan.decide(C, NEW, fleet_, [A, B], 2) == "hold"
    assert plan.decide(C, NEW, {**fleet_, A: AgentSet(NEW, 1, True)}, [A, B], 2) == "roll"


def test_new_idle_and_current_sets_never_wait_nor_take_a_slot() -> None:
    busy = {A: AgentSet(NEW, 1, False)}
    assert plan.decide(B, NEW, busy, [], 1) == "new"  # no StatefulSet yet: nothing to lose
    assert plan.decide(B, NEW, {**busy, B: AgentSet(OLD, 0, True)}, [], 1) == "idle"  # scaled to zero
    assert plan.decide(A, NEW, busy, [], 1) == "current"
    assert plan.in_flight(NEW, {**busy, B: AgentSet(NEW, 0, True)}, []) == {A}


def test_an_old_image_server_that_is_down_does_not_hold_the_slot() -> None:
    """Only a set on the wanted image that is not settled is rolling: one on the old image that is
    down (its L1 already gone) takes no slot, and is itself a candidate."""
    fleet_ = {A: AgentSet(OLD, 1, False), B: AgentSet(OLD, 1, True)}
    assert plan.in_flight(NEW, fleet_, []) == set()
    assert plan.decide(A, NEW, fleet_, [], 1) == "roll"


# How kube-controller-manager's StatefulSet controller writes status (k8s.io/kubernetes v1.37.2,
# pkg/controller/statefulset): a new set's first revision is both its current and its update
# revision (getStatefulSetRevisions); a new template is a new updateRevision, and currentRevision
# becomes it only once updated, ready and existing replicas all equal spec.replicas (completeUpdate,
# completeRollingUpdate before).
FIRST, SECOND = "a-lmcache-5d8f7b9c4", "a-lmcache-6f4c8d7b5"


def test_a_new_statefulset_that_never_becomes_ready_does_not_hold_the_roll() -> None:
    """Issue 39: a resource made directly on the wanted agent image whose server never becomes Ready
    (its pod Pending, crash-looping) was counted as rolling forever, and with the limit at 1 no other
    StatefulSet ever got the new agent. It has no rollout in progress: its revisions are equal."""
    stuck = sts(NEW, ready=0, generation=1, observed=1, revisions=(FIRST, FIRST))
    seen = fleet({A: [slim(stuck)], B: [slim(sts(OLD, name="b", revisions=(FIRST, FIRST)))]})
    assert plan.in_flight(NEW, seen, []) == set()
    assert seen[A].image == NEW and not seen[A].settled and not seen[A].rollout  # the watch cache keeps both revisions
    assert plan.decide(B, NEW, seen, [], 1) == "roll"
    assert plan.decide(A, NEW, seen, [], 1) == "current"


def test_a_statefulset_rolling_from_another_image_still_holds_its_slot() -> None:
    """What the slot is for stays counted: a set handed the wanted image whose new template the
    controller has not seen yet (generation ahead; its revisions still the old, equal ones), one
    whose pods are being replaced (the revisions differ), and one whose new pod never becomes Ready
    (the revisions stay different: the roll stops there, as docs/upgrading.md says)."""
    unseen = sts(NEW, ready=1, updated=1, generation=3, observed=2, revisions=(FIRST, FIRST))
    replacing = sts(NEW, replicas=2, ready=1, updated=1, revisions=(FIRST, SECOND))
    never_ready = sts(NEW, ready=0, updated=1, revisions=(FIRST, SECOND))
    done = sts(NEW, revisions=(SECOND, SECOND))
    for rolling in (unseen, replacing, never_ready):
        seen = fleet({A: [slim(rolling)], B: [slim(sts(OLD, name="b", revisions=(FIRST, FIRST)))]})
        assert plan.in_flight(NEW, seen, []) == {A} and plan.decide(B, NEW, seen, [], 1) == "hold"
        assert plan.in_flight(NEW, seen, [A]) == {A}  # claimed and not yet done: the claim changes nothing
    seen = fleet({A: [slim(done)], B: [slim(sts(OLD, name="b"))]})
    assert plan.in_flight(NEW, seen, [A]) == set() and plan.decide(B, NEW, seen, [A], 1) == "roll"
    # Claimed and still on the old image in the watch cache (the apply's event not seen yet): counted.
    old_seen = fleet({A: [slim(sts(OLD, revisions=(FIRST, FIRST)))], B: [slim(sts(OLD, name="b"))]})
    assert plan.in_flight(NEW, old_seen, [A]) == {A}


def test_a_claim_whose_statefulset_went_is_dropped() -> None:
    assert plan.in_flight(NEW, {B: AgentSet(OLD, 1, True)}, [A]) == set()
    assert plan.decide(B, NEW, {B: AgentSet(OLD, 1, True)}, [A], 1) == "roll"


def test_the_controller_claims_under_one_lock_and_tells_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two applies from one snapshot of the watch cache (one tick): only the first rolls; the other
    is held on the image it runs, and gets one AgentUpdatePending event, not one per apply."""
    monkeypatch.setenv(AGENT_IMAGE_ENV, NEW)
    monkeypatch.delenv(glue.ROLL_MAX_ENV, raising=False)
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(glue.kube, "post_event", lambda body, type_, reason, message: events.append(
        (body["metadata"]["name"], reason)))
    roller = glue.Roller()
    snapshot = {A: AgentSet(OLD, 1, True), B: AgentSet(OLD, 1, True)}
    body = {"metadata": {"name": "x", "namespace": "ns"}}
    assert roller.image_for(A, snapshot, {**body, "metadata": {"name": "a"}}) == NEW
    assert roller.image_for(B, snapshot, {**body, "metadata": {"name": "b"}}) == OLD
    assert roller.image_for(B, snapshot, {**body, "metadata": {"name": "b"}}) == OLD
    assert events == [("a", glue.UPDATING), ("b", glue.PENDING)]
    assert not roller.may_go(B, snapshot)
    # A's servers Ready again on the new image (the watch cache says so): B may go, and goes.
    after = {A: AgentSet(NEW, 1, True), B: AgentSet(OLD, 1, True)}
    assert roller.may_go(B, after)
    assert roller.image_for(B, after, {**body, "metadata": {"name": "b"}}) == NEW
    assert not roller.may_go(A, after)


def test_the_limit_comes_from_the_chart_and_is_at_least_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(glue.ROLL_MAX_ENV, "3")
    assert glue.limit() == 3
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv(glue.ROLL_MAX_ENV, bad)
        assert glue.limit() == 1


def test_a_held_image_reaches_only_the_agent_container_and_never_the_namespace_id() -> None:
    """What the apply holds back is the agent's image alone: the server's container, its args and
    the namespace id (in every label) are those of the wanted image's render. The agent is off
    the data path, so it must not reach the id."""
    import dataclasses

    from kvpersist.builders.all import build_all
    from tests.unit.test_builders import target

    wanted = build_all(dataclasses.replace(target(), agent_image=NEW))
    held = build_all(dataclasses.replace(target(), agent_image=OLD))
    [w_sts] = [m for m in wanted if m["kind"] == "StatefulSet"]
    [h_sts] = [m for m in held if m["kind"] == "StatefulSet"]
    assert plan.agent_image_of(w_sts) == NEW and plan.agent_image_of(h_sts) == OLD
    agent = next(c for c in h_sts["spec"]["template"]["spec"]["containers"] if c["name"] == AGENT_CONTAINER)
    agent["image"] = NEW
    assert held == wanted  # nothing else differs: not the server, not the namespace id, not vLLM


def _helm_template(*values: str) -> subprocess.CompletedProcess:
    from tests import rbac_needs

    helm = rbac_needs.helm_binary()
    if helm is None:
        pytest.skip("helm not built: python3 hack/localcluster.py build")
    return subprocess.run([str(helm), "template", "x", str(CHART), *values],
                          capture_output=True, text=True, timeout=60)


def test_the_chart_passes_the_roll_limit_and_refuses_a_tag_when_asked_to() -> None:
    """agentRoll.maxUnavailable reaches the operator (at least 1); image.requireDigest refuses an
    operator (and so agent) image named by tag alone, naming image.digest; a digest passes."""
    def operator_env(*values: str) -> dict[str, str]:
        done = _helm_template(*values)
        assert done.returncode == 0, done.stderr
        deployment = next(d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "Deployment")
        return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}

    assert operator_env()[glue.ROLL_MAX_ENV] == "1"
    assert operator_env("--set", "agentRoll.maxUnavailable=3")[glue.ROLL_MAX_ENV] == "3"
    assert _helm_template("--set", "agentRoll.maxUnavailable=0").returncode != 0
    refused = _helm_template("--set", "image.requireDigest=true")
    assert refused.returncode != 0 and "image.digest" in refused.stderr and "docs/upgrading.md" in refused.stderr
    digest = "sha256:" + "0123456789abcdef" * 4
    env = operator_env("--set", "image.requireDigest=true", "--set", f"image.digest={digest}")
    assert env[AGENT_IMAGE_ENV].endswith(f"@{digest}")


def test_a_tag_only_agent_image_is_warned_about(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(AGENT_IMAGE_ENV, "ghcr.io/kvpersist/kvpersist-operator:0.1.0")
    with caplog.at_level("WARNING"):
        glue.warn_if_unpinned()
    assert "image.digest" in caplog.text
    caplog.clear()
    monkeypatch.setenv(AGENT_IMAGE_ENV, NEW)
    with caplog.at_level("WARNING"):
        glue.warn_if_unpinned()
    assert caplog.text == ""


def test_a_claim_that_never_reached_its_statefulset_frees_the_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """A's apply was handed the image but never landed (its apply failed, the resource is refused
    now): after CLAIM_TTL_S the next one may go, so one broken resource does not stop the roll.
    Once A's StatefulSet shows the new image, only its servers' readiness frees the slot."""
    monkeypatch.setenv(AGENT_IMAGE_ENV, NEW)
    monkeypatch.setattr(glue.kube, "post_event", lambda *a: None)
    roller = glue.Roller()
    old = {A: AgentSet(OLD, 1, True), B: AgentSet(OLD, 1, True)}
    body = {"metadata": {"name": "x", "namespace": "ns"}}
    assert roller.image_for(A, old, body, now=0.0) == NEW
    assert not roller.may_go(B, old, now=glue.CLAIM_TTL_S - 1)
    assert roller.may_go(B, old, now=glue.CLAIM_TTL_S + 1)
    roller = glue.Roller()
    assert roller.image_for(A, old, body, now=0.0) == NEW
    restarting = {**old, A: AgentSet(NEW, 1, False)}
    assert not roller.may_go(B, restarting, now=10 * glue.CLAIM_TTL_S)
