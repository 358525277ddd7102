"""StorageInUse decided from the watch caches (issue 46): an apply used to LIST every resource of
every watched namespace from the API server (500 resources: 250,000 bodies decoded to converge).
Now every resource's store is mirrored from a kopf index (kvpersist.controller.indexes.kvp_stores,
complete before any handler runs) and versioned, so an apply reads no list and an idle refresh
does not look at the others at all. The same decisions against the real API server:
tests/e2e/test_exclusive_stores.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.builders.target import Target
from kvpersist.controller import decision, kube, l2key, refresh, runtime, sharing
from kvpersist.controller.decision import Snapshot
from kvpersist.status.workloads import Seen, slim
from tests.unit.test_exclusive_stores import ID_A, body

NEWER = "2030-01-01T00:00:00Z"
OLDER = "2020-01-01T00:00:00Z"


@pytest.fixture(autouse=True)
def no_api(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refused(*_: Any, **__: Any) -> Any:
        raise AssertionError("the API server was asked: the watch caches were handed over")
    monkeypatch.setattr(kube, "list_all", refused)
    yield
    for key in list(runtime.CONTROLLER.store_users):
        runtime.CONTROLLER.forget(key)


def target_of(b: dict[str, Any]) -> Target:
    meta = b["metadata"]
    return Target(meta["name"], meta["namespace"], KVCacheNamespaceSpec.model_validate(b["spec"]), ID_A)


def seen_now() -> Seen:
    return Seen(stores=runtime.CONTROLLER.stores())


def storage_refusal(target: Target, b: dict[str, Any], seen: Seen) -> str | None:
    """StorageInUse as decide judges it on the stores and pods an apply's snapshot takes from seen."""
    return decision.storage_refusal(target, b["metadata"]["creationTimestamp"], tuple(seen.stores or ()),
                                    tuple(seen.all_server_pods))


def note(b: dict[str, Any]) -> None:
    runtime.CONTROLLER.note_store((b["metadata"]["namespace"], b["metadata"]["name"]), sharing.user_of(b))


def test_an_older_resource_on_the_same_prefix_is_found_in_the_caches_without_a_list() -> None:
    mine, other = body("mine", NEWER, bucket="hf://buckets/o/b/p"), body("other", OLDER, namespace="team-b",
                                                                          bucket="hf://buckets/o/b/p")
    note(mine)
    assert storage_refusal(target_of(mine), mine, seen_now()) is None
    note(other)
    why = storage_refusal(target_of(mine), mine, seen_now())
    assert why is not None and "team-b/other" in why, why


def test_a_claim_still_mounted_by_another_resources_server_is_seen_on_its_slim_pod() -> None:
    """The pods index keeps a server pod's claim names (nothing else of its volumes)."""
    mine = body("mine", NEWER, claim="data")
    note(mine)
    pod = {"metadata": {"name": "gone-lmcache-0", "namespace": "ml",
                        "labels": {"app.kubernetes.io/instance": "gone", "app.kubernetes.io/component": "lmcache-server"}},
           "spec": {"containers": [{"name": "lmcache"}], "nodeName": "n",
                    "volumes": [{"name": "l2", "persistentVolumeClaim": {"claimName": "data"}}, {"name": "shm", "emptyDir": {}}]}}
    slimmed = slim(pod)
    assert slimmed["spec"]["volumes"] == [{"persistentVolumeClaim": {"claimName": "data"}}]
    why = storage_refusal(target_of(mine), mine, Seen(stores=runtime.CONTROLLER.stores(), all_server_pods=(slimmed,)))
    assert why is not None and "gone-lmcache-0" in why, why


def test_the_version_moves_only_when_a_store_changes() -> None:
    a = body("a", OLDER, bucket="hf://buckets/o/b/p")
    note(a)
    version, first = runtime.CONTROLLER.stores_version, runtime.CONTROLLER.stores()
    note(a)  # the same store again (a status write, say): nothing moved, the same tuple
    assert runtime.CONTROLLER.stores_version == version and runtime.CONTROLLER.stores() is first
    a["status"]["namespaceId"] = "kvp-" + "c" * 32
    note(a)
    assert runtime.CONTROLLER.stores_version > version and runtime.CONTROLLER.stores() != first
    moved = runtime.CONTROLLER.stores_version
    runtime.CONTROLLER.forget(("ml", "a"))  # deleted: the others may take its store now
    assert runtime.CONTROLLER.stores_version == moved + 1 and runtime.CONTROLLER.stores() == ()


def test_an_idle_refresh_looks_at_the_others_only_after_a_store_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refresh decides again (refresh._redecide) only on a snapshot that changed: the same
    stores version and the same resource decide nothing, and walk no other resource's store."""
    mine = body("mine", NEWER, bucket="hf://buckets/o/b/p")
    key = ("ml", "mine")
    state = runtime.CONTROLLER.state(key)
    state.body = mine
    note(mine)
    looked: list[str] = []
    holder = sharing.holder
    monkeypatch.setattr(sharing, "holder", lambda me, others: looked.append(me.name) or holder(me, others))
    policy = Snapshot(body=mine, spec=KVCacheNamespaceSpec.model_validate(mine["spec"]))
    read = l2key.KeyRead("mine-l2-key", "master-key", True, fingerprint="0123456789abcdef")
    for _ in range(3):
        first = refresh._redecide(state, policy, read, seen_now())
    assert looked == ["mine"] and first.storage_refused is None and first.key_id  # once: then nothing changed
    note(body("other", OLDER, namespace="team-b", bucket="hf://buckets/o/b/p", namespace_id=first.key_id))
    now = refresh._redecide(state, policy, read, seen_now())
    assert looked == ["mine", "mine"] and now.storage_refused is not None and "team-b/other" in now.storage_refused
    assert now.applied_view() != first.applied_view()  # an older user came: the refresh applies again
