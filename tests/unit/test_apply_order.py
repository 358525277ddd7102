"""The order apply_workloads writes a resource's objects in (kvpersist.controller.apply): the L2
key, the agent token and the namespace id's NetworkPolicy, side by side, have all ended before the lmcache
StatefulSet is applied (no server pod may exist before the policy that closes its ports, or
without the Secrets it mounts); vLLM comes last. A first step run one call after another, or a
StatefulSet applied early, fails here."""

from __future__ import annotations

import copy
import logging
import re
import threading
import time
from typing import Any

import pytest

from kvpersist.controller import kube, runtime
from kvpersist.controller.apply import apply_workloads
from kvpersist.status.workloads import Seen
from tests.cases.invalid_manifests import sample

CALL_S = 0.2  # each fake API call takes this long


def test_secrets_and_policies_side_by_side_then_the_statefulset(monkeypatch: pytest.MonkeyPatch) -> None:
    spans: list[tuple[str, float, float]] = []  # (kind/name, start, end)
    lock = threading.Lock()

    def call(manifest: dict[str, Any]) -> Any:
        start = time.monotonic()
        time.sleep(CALL_S)
        with lock:
            spans.append((f"{manifest['kind']}/{manifest['metadata']['name']}", start, time.monotonic()))
        return manifest

    monkeypatch.setattr(kube, "apply", call)
    monkeypatch.setattr(kube, "create_if_absent", call)
    monkeypatch.setattr(kube, "post_event", lambda *a: None)
    monkeypatch.setattr(kube, "get", lambda *a: None)  # no key Secret yet: generated (its fingerprint is in the id)
    monkeypatch.setattr(kube, "list_all", lambda *a, **kw: [])  # no other user of its claim, no route in the way
    monkeypatch.setattr(kube, "named_metadata", lambda *a: None)  # no object under its names yet
    monkeypatch.setattr(kube, "get_metadata", lambda *a: None)
    body = copy.deepcopy(sample())
    body["metadata"].update(namespace="ml", uid="u-order", generation=1)  # L2 encryption on (the default): a key Secret too
    key = ("ml", body["metadata"]["name"])
    runtime.CONTROLLER.forget(key)
    runtime.CONTROLLER.state(key)  # known, as after its first watch event
    assert apply_workloads(body, logging.getLogger("test"))
    assert runtime.CONTROLLER.state(key).apply_error is None

    kinds = [s[0].split("/")[0] for s in sorted(spans, key=lambda s: s[1])]
    first = [s for s in spans if s[0].split("/")[0] in ("Secret", "NetworkPolicy")]
    assert sorted(s[0].split("/")[0] for s in first) == ["NetworkPolicy", "Secret", "Secret"], spans
    [sts] = [s for s in spans if s[0].startswith("StatefulSet/")]
    assert all(end <= sts[1] for _, _, end in first), "the StatefulSet was applied before its Secrets and policies ended"
    # Side by side: the three took about one call, not three.
    assert max(end for *_, end in first) - min(start for _, start, _ in first) < 2 * CALL_S, first
    assert kinds[-1] == "Deployment" and kinds.count("StatefulSet") == 1
    runtime.CONTROLLER.forget(key)


def test_a_new_resource_reaches_its_statefulset_in_four_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The calls between a new resource's create and its StatefulSet (the operator's part of apply
    → first workload Ready; benchmarks/reconcile_bench.py latency prints them from the audit log):
    the key Secret read, then the id's route names (Service and NetworkPolicy side by side) and
    every other name looked up in one batch on the apply pool (the snapshot, read before anything
    is decided: kvpersist.controller.snapshot; not the route names again), the Secrets and
    policies side by side, then the StatefulSet: four rounds before it at most. The route lookups
    one after the other make it more; its apply posts no Event."""
    spans: list[tuple[tuple[str, ...], float, float]] = []
    lock = threading.Lock()

    def timed(what: tuple[str, ...], result: Any = None) -> Any:
        start = time.monotonic()
        time.sleep(CALL_S)
        with lock:
            spans.append((what, start, time.monotonic()))
        return result

    monkeypatch.setattr(kube, "get", lambda v, kind, name, ns: timed(("get", kind, name)))  # no key Secret yet
    monkeypatch.setattr(kube, "list_all", lambda v, kind, ns=None, label_selector=None, field_selector=None: timed(
        ("list", kind, (field_selector or "").removeprefix("metadata.name=")), []))
    monkeypatch.setattr(kube, "named_metadata", lambda v, kind, name, ns: timed(("lookup", kind, name)))
    monkeypatch.setattr(kube, "get_metadata", lambda v, kind, name, ns: timed(("lookup", kind, name)))
    monkeypatch.setattr(kube, "apply", lambda m: timed(("apply", m["kind"], m["metadata"]["name"]), m))
    monkeypatch.setattr(kube, "create_if_absent", lambda m: timed(("create", m["kind"], m["metadata"]["name"]), m))
    monkeypatch.setattr(kube, "post_event", lambda owner, type_, reason, message: timed(("event", reason)))
    body = copy.deepcopy(sample("hf-bucket"))
    body["metadata"].update(namespace="ml", uid="u-rounds", generation=1)
    key = ("ml", body["metadata"]["name"])
    runtime.CONTROLLER.forget(key)
    runtime.CONTROLLER.state(key)
    try:
        assert apply_workloads(body, logging.getLogger("test"), Seen(stores=()))  # stores from the watch caches, as in the operator
        assert runtime.CONTROLLER.state(key).apply_error is None
    finally:
        runtime.CONTROLLER.forget(key)

    [sts] = [s for s in spans if s[0][:2] == ("apply", "StatefulSet")]
    before = [s for s in spans if s[2] <= sts[1]]
    first = min(start for _, start, _ in spans)
    # Four rounds of CALL_S before the StatefulSet's apply starts (five would be 5 * CALL_S).
    assert sts[1] - first < 4.5 * CALL_S, sorted((s[1] - first, s[0]) for s in before)
    routes = [s for s in spans if s[0][0] == "lookup" and re.search(r"-lmcache-[0-9a-f]{8}$", s[0][2])]
    assert sorted(s[0][1] for s in routes) == ["NetworkPolicy", "Service"], routes  # each once: not looked up again
    assert abs(routes[0][1] - routes[1][1]) < CALL_S / 2, "the route lookups ran one after the other"
    assert [s for s in spans if s[0][0] == "event"] == [], "a new resource's apply posts no Event (status.l2Key names the key)"
