"""Hub calls never on the refresh path: a bucket listing or preflight that hangs costs a refresh
nothing (it returns the last result at once), runs once at a time per resource, and its result
shows on a later refresh (the resource is marked for one when the call ends)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.target import Target
from kvpersist.controller import l2runtime, runtime
from kvpersist.inventory.bucket import Preflight
from kvpersist.inventory.volume import Inventory
from tests.cases.invalid_manifests import sample


class Token:
    """SecretOnce's part a bucket call uses: a Secret that exists, with a token."""

    def get(self) -> dict[str, Any]:
        return {"metadata": {"resourceVersion": "1"}}

    def token(self) -> str:
        return "hf_x"


def bucket_target() -> Target:
    obj = sample("hf-bucket")
    return Target(obj["metadata"]["name"], "ns", KVCacheNamespace.model_validate(obj).spec, "kvp-" + "a" * 32)


def wait_until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture()
def hub(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A Hub whose every call blocks until released, counting the calls."""
    state = {"release": threading.Event(), "listings": 0, "preflights": 0}
    target = bucket_target()
    inventory = Inventory(target.spec.l2.hf_bucket.bucket_handle, [], 7)

    def scan(*_a: Any, **_k: Any) -> Inventory:
        state["listings"] += 1
        assert state["release"].wait(10)
        return inventory

    def preflight(*_a: Any, **_k: Any) -> Preflight:
        state["preflights"] += 1
        assert state["release"].wait(10)
        return Preflight(True, "BucketReachable", "bucket reachable")

    monkeypatch.setattr(l2runtime, "scan_bucket", scan)
    monkeypatch.setattr(l2runtime, "preflight_bucket", preflight)
    runtime.CONTROLLER.forget((target.namespace, target.name))
    runtime.CONTROLLER.state((target.namespace, target.name))  # known, as after its first watch event
    state.update(target=target, inventory=inventory)
    yield state
    state["release"].set()


def test_a_hanging_listing_costs_the_refresh_nothing(hub: dict) -> None:
    target, key = hub["target"], (hub["target"].namespace, hub["target"].name)
    start = time.monotonic()
    for _ in range(5):  # five refreshes while the Hub hangs: each returns at once, one listing runs
        assert l2runtime.bucket_inventory_of(target, Token()) is None
    assert time.monotonic() - start < 0.5
    wait_until(lambda: hub["listings"] == 1)
    assert hub["listings"] == 1 and not runtime.CONTROLLER.state(key).dirty
    hub["release"].set()
    wait_until(lambda: runtime.CONTROLLER.state(key).dirty)  # marked for a refresh when it ended
    assert l2runtime.bucket_inventory_of(target, Token()) is hub["inventory"]
    assert hub["listings"] == 1  # and cached for its TTL


def test_a_hanging_preflight_leaves_the_check_unknown_then_shows_its_verdict(hub: dict) -> None:
    target, key = hub["target"], (hub["target"].namespace, hub["target"].name)
    start = time.monotonic()
    assert l2runtime.bucket_check(target, Token()) is None  # unknown: L2Ready is not judged on it yet
    assert l2runtime.bucket_check(target, Token()) is None
    assert time.monotonic() - start < 0.5
    wait_until(lambda: hub["preflights"] == 1)
    hub["release"].set()
    wait_until(lambda: runtime.CONTROLLER.state(key).dirty)
    assert l2runtime.bucket_check(target, Token()) == (True, "BucketReachable", "bucket reachable")
    assert hub["preflights"] == 1
