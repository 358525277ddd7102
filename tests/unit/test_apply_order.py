"""The order apply_workloads writes a resource's objects in (kvpersist.controller.apply): the L2
key, the agent token and both NetworkPolicies, side by side, have all ended before the lmcache
StatefulSet is applied (no server pod may exist before the policies that close its ports, or
without the Secrets it mounts); vLLM comes last. A first step run one call after another, or a
StatefulSet applied early, fails here."""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any

import pytest

from kvpersist.controller import kube, runtime
from kvpersist.controller.apply import apply_workloads
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
    monkeypatch.setattr(kube, "create_if_absent", lambda m: bool(call(m)))
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
    assert sorted(s[0].split("/")[0] for s in first) == ["NetworkPolicy", "NetworkPolicy", "Secret", "Secret"], spans
    [sts] = [s for s in spans if s[0].startswith("StatefulSet/")]
    assert all(end <= sts[1] for _, _, end in first), "the StatefulSet was applied before its Secrets and policies ended"
    # Side by side: the four took about one call, not four.
    assert max(end for *_, end in first) - min(start for _, start, _ in first) < 2 * CALL_S, first
    assert kinds[-1] == "Deployment" and kinds.count("StatefulSet") == 1
    runtime.CONTROLLER.forget(key)
