"""The operator's LISTs meant to see every namespace (who else holds a bucket prefix, gc's last look
before deleting) go to each watched namespace by name when it watches named namespaces and its
account may not list those kinds cluster-wide: the chart then grants it a Role in each of them and
nothing cluster-wide, so a cluster-wide LIST would be refused (and with it every apply of a
bucket-backed resource). With the rights to (an admin's kubeconfig), it still looks everywhere. Against the real API server with
only the chart's Roles: tests/e2e/test_least_privilege.py::test_watch_namespaces_grant_nothing_elsewhere."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.builders.target import Target
from kvpersist.controller import decision, gc, kube, runtime, snapshot
from tests.cases.invalid_manifests import sample

NSID = "kvp-" + "a" * 32


@pytest.fixture(autouse=True)
def asked(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str, str, str | None]]]:
    """The SelfSubjectAccessReviews asked (verb, group, resource, namespace); all refused."""
    calls: list[tuple[str, str, str, str | None]] = []

    def may(verb: str, group: str, resource: str, namespace: str | None = None) -> bool:
        calls.append((verb, group, resource, namespace))
        return False

    monkeypatch.setattr(kube, "may", may)
    yield calls
    runtime.set_peering(None, "", 0)


@pytest.fixture()
def listed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str | None]]]:
    """(kind, namespace) of every kube.list_all call; an older resource on the same bucket prefix is
    in team-b (and so in a cluster-wide list), none in team-a."""
    calls: list[tuple[str, str | None]] = []

    def list_all(api_version: str, kind: str, namespace: str | None = None, label_selector: str | None = None,
                 field_selector: str | None = None) -> list[dict[str, Any]]:
        calls.append((kind, namespace))
        if kind != "KVCacheNamespace" or namespace not in (None, "team-b"):
            return []
        return [_bucket_body("other", "team-b")]

    monkeypatch.setattr(kube, "list_all", list_all)
    yield calls
    runtime.set_peering(None, "", 0)


def _bucket_body(name: str, namespace: str) -> dict[str, Any]:
    obj = copy.deepcopy(sample("hf-bucket"))
    obj["metadata"].update(name=name, namespace=namespace, creationTimestamp="2020-01-01T00:00:00Z")
    obj["status"] = {"namespaceId": NSID}
    return obj


def _bucket_target(namespace: str) -> tuple[Target, dict[str, Any]]:
    body = _bucket_body("mine", namespace)
    body["metadata"]["creationTimestamp"] = "2030-01-01T00:00:00Z"
    return Target("mine", namespace, KVCacheNamespaceSpec.model_validate(body["spec"]), NSID), body


@pytest.mark.parametrize(("watched", "scopes"), [
    (("team-a", "team-b"), ("team-a", "team-b")),
    (("team-a", "team-a"), ("team-a",)),
    ((), (None,)),  # all namespaces: one cluster-wide LIST (the ClusterRole grants it)
    (("team-*",), (None,)),  # a pattern (kvpersist run -n, never the chart): kopf scans the cluster, so do we
    (("team-a", "!team-b"), (None,)),
])
def test_where_the_lists_go(watched: tuple[str, ...], scopes: tuple[str | None, ...]) -> None:
    runtime.set_peering(None, "", 0, watched)
    try:
        assert runtime.listing_scopes() == scopes
    finally:
        runtime.set_peering(None, "", 0)


def test_the_account_is_asked_once_and_may_still_look_everywhere(monkeypatch: pytest.MonkeyPatch,
                                                                  asked: list[tuple[str, str, str, str | None]]) -> None:
    runtime.set_peering(None, "", 0, ("team-a", "team-b"))
    assert runtime.listing_scopes() == runtime.listing_scopes() == ("team-a", "team-b")
    assert asked == [("list", "kvpersist.dev", "kvcachenamespaces", None)]  # refused: pods not even asked
    runtime.set_peering(None, "", 0, ("team-a",))  # asked again for a new start
    monkeypatch.setattr(kube, "may", lambda verb, group, resource, namespace=None: asked.append(
        (verb, group, resource, namespace)) or True)
    assert runtime.listing_scopes() == runtime.ALL_NAMESPACES  # e.g. an admin's kubeconfig: the widest view
    assert asked[1:] == [("list", "kvpersist.dev", "kvcachenamespaces", None), ("list", "", "pods", None)]
    runtime.set_peering(None, "", 0, ())
    del asked[:]
    assert runtime.listing_scopes() == runtime.ALL_NAMESPACES and asked == []  # all namespaces: nothing to ask


def storage_refusal_from_api(target: Target, body: dict[str, Any]) -> str | None:
    """StorageInUse as an apply decides it when no watch caches were handed over: from the API server."""
    users, pods = snapshot.stores_from_api(target)
    return decision.storage_refusal(target, body["metadata"]["creationTimestamp"], users, pods)


def test_named_namespaces_are_listed_one_by_one_and_each_is_seen(listed: list[tuple[str, str | None]]) -> None:
    runtime.set_peering(None, "", 0, ("team-a", "team-b"))
    target, body = _bucket_target("team-a")
    refusal = storage_refusal_from_api(target, body)
    # team-b's older resource on the same prefix is seen: not only the resource's own namespace.
    assert refusal is not None and "team-b/other" in refusal, refusal
    assert listed == [("KVCacheNamespace", "team-a"), ("KVCacheNamespace", "team-b")]
    listed.clear()
    why = gc.in_use_now(NSID, None)
    assert why is not None and "team-b/other" in why, why
    assert sorted(listed) == [("KVCacheNamespace", "team-a"), ("KVCacheNamespace", "team-b"),
                              ("Pod", "team-a"), ("Pod", "team-b")]


def test_all_namespaces_is_one_cluster_wide_list(listed: list[tuple[str, str | None]]) -> None:
    runtime.set_peering(None, "", 0, ())
    target, body = _bucket_target("team-a")
    assert storage_refusal_from_api(target, body) is not None
    gc.in_use_now(NSID, None)
    assert {ns for _kind, ns in listed} == {None}


def test_a_refused_list_names_where_it_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes.client.exceptions import ApiException

    def refused(*_args: Any, **_kwargs: Any) -> list[dict[str, Any]]:
        raise ApiException(status=403)

    monkeypatch.setattr(kube, "list_all", refused)
    runtime.set_peering(None, "", 0, ("team-a", "team-b"))
    try:
        why = gc.in_use_now(NSID, None)
    finally:
        runtime.set_peering(None, "", 0)
    assert why is not None and "the watched namespaces team-a, team-b" in why and "403" in why, why
    assert "list on both in each of them" in why, why
