"""Forgetting a resource leaves nothing of it behind (kvpersist.controller.state): state is made for
one resource through the paths the operator takes (a watch event, an apply that fails and is to be
retried, a refresh with the cache on), then forgotten; nothing the controller holds, no table of
a kvpersist.controller module and no metric may still name it. A per-resource table added anywhere
there without being covered by forget fails this test."""

from __future__ import annotations

import asyncio
import collections
import importlib
import logging
import pkgutil
import types
from collections.abc import Mapping
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

import kvpersist.controller
from kvpersist.controller import kube, reading, refresh, runtime, status_loop, tracking
from kvpersist.controller.apply import apply_workloads
from kvpersist.controller.state import Controller, ResourceState
from kvpersist.status.workloads import COMPONENT_LABEL, Seen
from tests.cases.invalid_manifests import sample
from tests.unit.test_status_patch import FakeApi, _pod, _report, _rollout

LOG = logging.getLogger("test")


def _holding(roots: Mapping[str, Any], key: tuple[str, str]) -> list[str]:
    """Where anything reachable from roots names key: the key itself (or a tuple beginning with it),
    a "namespace/name..." string, or a ResourceState (the walk goes into containers and into the
    attributes of kvpersist's own objects; thread pools, locks and tasks are not state)."""
    found: list[str] = []
    visited: set[int] = set()

    def walk(obj: Any, path: str, depth: int) -> None:
        if isinstance(obj, tuple) and obj[:2] == key:  # before the visited check: one key object is in many places
            found.append(path)
            return
        if isinstance(obj, str):
            if obj.startswith(f"{key[0]}/{key[1]}"):
                found.append(path)
            return
        if depth > 12 or id(obj) in visited:
            return
        visited.add(id(obj))
        if isinstance(obj, ResourceState):
            found.append(path)
        elif isinstance(obj, Mapping):
            for k, v in list(obj.items()):
                walk(k, f"{path} key {k!r}", depth + 1)
                walk(v, f"{path}[{k!r}]", depth + 1)
        elif isinstance(obj, list | tuple | set | frozenset | collections.deque):
            for i, v in enumerate(list(obj)):
                walk(v, f"{path}[{i}]", depth + 1)
        elif type(obj).__module__.startswith("kvpersist") and hasattr(obj, "__dict__"):
            for name, v in vars(obj).items():
                walk(v, f"{path}.{name}", depth + 1)

    for name, root in roots.items():
        walk(root, name, 0)
    return found


def _roots() -> dict[str, Any]:
    """The controller, and every table (and kvpersist object) at module level in every module of
    kvpersist.controller (the handlers' roles, metrics and the rest)."""
    roots: dict[str, Any] = {"CONTROLLER": runtime.CONTROLLER}
    package = kvpersist.controller
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, types.ModuleType | type | types.FunctionType) or name.startswith("__"):
                continue
            if isinstance(value, dict | set | list | collections.deque) or type(value).__module__.startswith("kvpersist"):
                roots[f"{module.__name__}.{name}"] = value
    return roots


def test_forget_leaves_nothing_of_a_resource(monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApi(monkeypatch, [_report("s-0", 2048)])  # a fresh controller too
    body = sample("nvme-minimal")
    body["metadata"].update(namespace="ml", uid="u1", generation=2)
    key = ("ml", body["metadata"]["name"])
    target, _ = reading.target_of(body)

    # Seen by a watch event; applied, and the apply failed (to be retried); refreshed twice.
    asyncio.run(tracking.track(event={"type": "ADDED"}, body=body, logger=LOG))
    monkeypatch.setattr(kube, "create_if_absent", lambda m: m)

    def unavailable(_m: Any) -> Any:
        raise ApiException(status=503)

    monkeypatch.setattr(kube, "apply", unavailable)
    assert apply_workloads(body, LOG)
    seen = Seen(statefulsets=[{**_rollout(1, 1), "metadata": {"name": target.server_name, "generation": 1}}],
                deployments=[{**_rollout(1, 1), "metadata": {"name": target.vllm_name, "generation": 1}}],
                pods=[_pod(f"{target.server_name}-0")],
                claims=[{"metadata": {"name": "l2", "labels": {COMPONENT_LABEL: "lmcache-server"}},
                         "status": {"phase": "Bound"}}],
                live_ids=frozenset({target.namespace_id or ""}))
    refresh.refresh_status(body, seen, LOG)
    body["status"] = dict(api.patches[-1])
    refresh.refresh_status(body, seen, LOG)

    held = _holding(_roots(), key)
    # What the test relies on: the paths above reached every kind of place state is kept in.
    for place in ("CONTROLLER.resources", "CONTROLLER.apply_backoff", "CONTROLLER.fallback", "CONTROLLER.build_bypass",
                  "CONTROLLER.hits", "kvpersist.controller.metrics._phases", "kvpersist.controller.metrics._resources"):
        assert any(path.startswith(place) for path in held), (place, held)

    tracking.forget(key)
    assert _holding(_roots(), key) == []
    assert runtime.CONTROLLER.get(key) is None


def test_every_tracker_of_the_controller_is_forgotten() -> None:
    """forget() reaches each member with a forget(key): the trackers are found, not listed."""
    controller = runtime.CONTROLLER
    trackers = {type(t).__name__ for t in controller._trackers()}
    assert {"Backoff", "Fallback", "BuildBypass", "HitTracker"} <= trackers


def test_reconcile_and_the_status_loop_never_run_one_resource_at_once(monkeypatch: pytest.MonkeyPatch,
                                                                     controller: Controller) -> None:
    """One key's lock is taken by reconcile() and by the loop's round (its drift re-apply and its
    refresh): the blocking work of one resource never overlaps, however the two interleave."""
    import threading
    import time

    key = ("ns", "a")
    body = {"metadata": {"namespace": key[0], "name": key[1]}}
    controller.state(key).body = body
    running, most, guard = [0], [0], threading.Lock()

    def work(*_a: Any) -> bool:
        with guard:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with guard:
            running[0] -= 1
        return True

    for caller in (tracking, status_loop):  # where each round looks them up
        monkeypatch.setattr(caller, "apply_workloads", work)
        monkeypatch.setattr(caller, "refresh_status", work)

    async def both() -> None:
        await asyncio.gather(tracking.reconcile(body=body, logger=LOG),
                             status_loop._refresh_one(key, body, Seen(), True, LOG),
                             tracking.reconcile(body=body, logger=LOG))

    asyncio.run(both())
    assert most[0] == 1


def test_a_spec_is_reconciled_once_per_change_and_once_after_a_start(monkeypatch: pytest.MonkeyPatch,
                                                                      controller: Controller) -> None:
    """The watch event handler stands in for kopf's create, update (of spec) and resume: a new
    resource is applied, a status or metadata event is not, a changed spec is, and an operator that
    starts again (a fresh controller) applies each resource it lists once. No annotation is written."""
    applied: list[Any] = []
    monkeypatch.setattr(tracking, "apply_workloads", lambda body, *_a: applied.append(dict(body["spec"])) or True)
    monkeypatch.setattr(tracking, "refresh_status", lambda *_a: None)
    body = {"metadata": {"namespace": "ns", "name": "a", "uid": "u1"}, "spec": {"l1": {"size": "1Gi"}}}

    def event(**changes: Any) -> None:
        asyncio.run(tracking.on_event(event={"type": "MODIFIED"}, body={**body, **changes}, logger=LOG))

    event()
    event(status={"phase": "Pending"})
    event(metadata={**body["metadata"], "annotations": {"a": "b"}})
    assert applied == [{"l1": {"size": "1Gi"}}]
    event(spec={"l1": {"size": "2Gi"}}, status={"phase": "Ready"})
    event(spec={"l1": {"size": "2Gi"}}, status={"phase": "Ready"})
    assert applied == [{"l1": {"size": "1Gi"}}, {"l1": {"size": "2Gi"}}]
    monkeypatch.setattr(runtime, "CONTROLLER", Controller())  # started again: every resource once
    event(spec={"l1": {"size": "2Gi"}})
    assert len(applied) == 3
    asyncio.run(tracking.on_event(event={"type": "DELETED"}, body=body, logger=LOG))
    assert len(applied) == 3 and runtime.CONTROLLER.get(("ns", "a")) is None


def test_a_refresh_running_when_its_resource_is_deleted_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The resource is deleted (its DELETED event, forget) while its refresh still runs in a worker
    thread: what that refresh writes afterwards (its state, the hit totals, the phase metric) must
    not bring the resource back as an entry nobody refreshes or forgets."""
    import threading

    api = FakeApi(monkeypatch, [_report("s-0", 2048)])
    body = sample("nvme-minimal")
    body["metadata"].update(namespace="ml", uid="u2", generation=1)
    key = ("ml", body["metadata"]["name"])
    target, _ = reading.target_of(body)
    seen = Seen(statefulsets=[{**_rollout(1, 1), "metadata": {"name": target.server_name, "generation": 1}}],
                deployments=[{**_rollout(1, 1), "metadata": {"name": target.vllm_name, "generation": 1}}],
                pods=[_pod(f"{target.server_name}-0")], live_ids=frozenset({target.namespace_id or ""}))
    entered, release = threading.Event(), threading.Event()
    refusal = refresh.policy_refusal

    def slow_refusal(t: Any) -> Any:  # early in refresh_status, before it observes and writes
        entered.set()
        assert release.wait(10), "never released"
        return refusal(t)

    monkeypatch.setattr(refresh, "policy_refusal", slow_refusal)

    async def scene() -> None:
        await tracking.track(event={"type": "ADDED"}, body=body, logger=LOG)
        round_ = asyncio.create_task(status_loop._refresh_one(key, body, seen, False, LOG))
        assert await asyncio.to_thread(entered.wait, 10)
        await tracking.track(event={"type": "DELETED"}, body=body, logger=LOG)
        release.set()
        await asyncio.wait_for(round_, 20)

    asyncio.run(scene())
    assert api.patches, "the refresh ran to its end (it wrote status)"
    assert runtime.CONTROLLER.get(key) is None
    assert _holding(_roots(), key) == []
