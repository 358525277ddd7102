"""One user per L2 store (kvpersist.controller.sharing), route names never re-pointed
(kvpersist.controller.stale_routes.route_conflicts), and one name per object (builders.all):
the pure decisions. The same paths against the real API server: tests/e2e/test_exclusive_stores.py."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.all import build_all
from kvpersist.builders.target import NAMESPACE_ID_LABEL, Target
from kvpersist.controller import sharing
from kvpersist.controller.stale_routes import route_conflicts, stale
from kvpersist.identity import resolve
from kvpersist.status.conditions import condition
from tests.cases.invalid_manifests import sample

ID_A, ID_B = "kvp-" + "a" * 32, "kvp-" + "b" * 32


def body(name: str, created: str, namespace: str = "ml", claim: str | None = "shared", bucket: str | None = None,
         namespace_id: str | None = ID_A, deleting: bool = False) -> dict[str, Any]:
    obj = copy.deepcopy(sample("hf-bucket" if bucket else "nvme-minimal"))
    obj["metadata"].update(name=name, namespace=namespace, creationTimestamp=created)
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    if bucket:
        obj["spec"]["l2"]["hfBucket"]["bucketHandle"] = bucket
    elif claim:
        obj["spec"]["l2"]["nvme"] = {"existingClaimName": claim, "maxCapacity": "1Gi"}
    else:
        obj["spec"]["l2"]["nvme"] = {"size": "10Gi", "maxCapacity": "1Gi"}
    if namespace_id:
        obj["status"] = {"namespaceId": namespace_id}
    return obj


def user(b: dict[str, Any]) -> sharing.User:
    u = sharing.user_of(b)
    assert u is not None
    return u


def test_a_resource_reads_alike_from_its_parsed_spec_and_from_its_stored_object() -> None:
    """The operator judges its own resource from the parsed spec and the others from the stored
    objects (never parsed: every known resource, every status round): both must say the same."""
    for b in (body("a", "2030-01-01T00:00:00Z"), body("a", "2030-01-01T00:00:00Z", claim=None),
              body("a", "2030-01-01T00:00:00Z", bucket="hf://buckets/o/b/p")):
        spec = KVCacheNamespace.model_validate(b).spec
        assert sharing.user("ml", "a", "2030-01-01T00:00:00Z", spec, ID_A) == user(b)


# ---- claims


def test_the_second_user_of_a_claim_is_refused_naming_the_first_whatever_the_ids() -> None:
    first, second = body("first", "2030-01-01T00:00:00Z"), body("second", "2030-01-01T00:00:05Z", namespace_id=ID_B)
    users = [user(first), user(second)]
    assert sharing.refusal(users[0], users) is None
    why = sharing.refusal(users[1], users)
    assert why is not None and "ml/first" in why and "claim shared" in why and "spec.l2.nvme.existingClaimName" in why
    # The same verdict whatever order they are listed in, from every replica and restart.
    assert sharing.refusal(users[1], users[::-1]) == why and sharing.refusal(users[0], users[::-1]) is None


def test_same_second_creation_the_name_decides_and_the_refusal_clears_when_the_first_goes() -> None:
    b, a = user(body("b", "2030-01-01T00:00:00Z")), user(body("a", "2030-01-01T00:00:00Z"))
    assert sharing.holder(b, [a, b]) == (a, "claim shared") and sharing.holder(a, [a, b]) is None
    assert sharing.refusal(b, [b]) is None  # a deleted: b keeps it
    # Being deleted, it no longer holds the claim by age (while its pods last, they do: below).
    assert sharing.user_of(body("a", "2030-01-01T00:00:00Z", deleting=True)) is None


def test_another_namespace_or_claim_shares_nothing() -> None:
    me = user(body("me", "2030-01-01T00:00:05Z"))
    assert sharing.holder(me, [user(body("x", "2030-01-01T00:00:00Z", namespace="other"))]) is None
    assert sharing.holder(me, [user(body("x", "2030-01-01T00:00:00Z", claim="elsewhere"))]) is None


def test_naming_the_claim_another_resources_statefulset_makes_is_sharing_it() -> None:
    made = user(body("made", "2030-01-01T00:00:00Z", claim=None))  # size: claims l2-made-lmcache-<n>
    thief = user(body("thief", "2030-01-01T00:00:05Z", claim="l2-made-lmcache-3"))
    assert "l2-made-lmcache-3" in (sharing.refusal(thief, [made, thief]) or "")
    # The other way round (the one naming it is older): the StatefulSet's resource waits.
    early = user(body("early", "2030-01-01T00:00:00Z", claim="l2-late-lmcache-0"))
    late = user(body("late", "2030-01-01T00:00:05Z", claim=None))
    assert "ml/early" in (sharing.refusal(late, [early, late]) or "")
    assert sharing.holder(early, [early, user(body("near", "2030-01-01T00:00:05Z", claim="l2-made-lmcache-x"))]) is None
    assert sharing.holder(made, [made, user(body("made-x", "2030-01-01T00:00:00Z", claim=None))]) is None


def test_a_claim_is_taken_over_only_once_no_other_resources_server_pod_mounts_it() -> None:
    me = user(body("second", "2030-01-01T00:00:05Z"))

    def pod(name: str, instance: str, claim: str, component: str = "lmcache-server") -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "ml", "labels": {"app.kubernetes.io/instance": instance,
                                                                          "app.kubernetes.io/component": component}},
                "spec": {"volumes": [{"name": "l2", "persistentVolumeClaim": {"claimName": claim}}]}}

    lingering = pod("first-lmcache-0", "first", "shared")
    why = sharing.refusal(me, [me], [lingering])
    assert why is not None and "first-lmcache-0" in why
    assert sharing.refusal(me, [me], [pod("second-lmcache-0", "second", "shared")]) is None  # its own
    assert sharing.refusal(me, [me], [pod("x-lmcache-0", "x", "other")]) is None
    assert sharing.refusal(me, [me], [pod("x-vllm-1", "x", "shared", component="vllm")]) is None
    made = user(body("made", "2030-01-01T00:00:00Z", claim=None))
    assert "l2-made-lmcache-1" in (sharing.refusal(made, [made], [pod("y-lmcache-0", "y", "l2-made-lmcache-1")]) or "")


# ---- bucket prefixes


def test_one_bucket_prefix_and_id_is_one_store_across_namespaces() -> None:
    handle = "hf://buckets/org/kv/prod"
    first = user(body("first", "2030-01-01T00:00:00Z", namespace="team-a", bucket=handle))
    second = user(body("second", "2030-01-01T00:00:05Z", namespace="team-b", bucket=handle + "/"))
    why = sharing.refusal(second, [first, second])
    assert why is not None and "team-a/first" in why and f"{handle}/{ID_A}" in why and "bucketHandle" in why
    # Another id under the prefix is another prefix: both serve.
    other_id = user(body("third", "2030-01-01T00:00:05Z", namespace="team-b", bucket=handle, namespace_id=ID_B))
    assert sharing.refusal(other_id, [first, other_id]) is None
    # A prefix inside the other's namespace folder shares it.
    nested = user(body("nested", "2030-01-01T00:00:05Z", namespace="team-c", bucket=f"{handle}/{ID_A}",
                       namespace_id=ID_B))
    assert sharing.refusal(nested, [first, nested]) is not None
    assert sharing.refusal(user(body("x", "2030-01-01T00:00:05Z", bucket="hf://buckets/org/kv/prod2")), [first]) is None
    # No id reported yet: nothing to share yet (its own apply decides once it has one).
    assert sharing.refusal(user(body("y", "2030-01-01T00:00:05Z", bucket=handle, namespace_id=None)), [first]) is None


def test_refused_status_keeps_the_id_and_says_why_in_l2ready_and_ready() -> None:
    conds = [condition("IdentityResolved", False, "IdentityIncomplete", "cache disabled"),
             condition("L2Ready", None, "CacheDisabled", "no namespace"),
             condition("LMCacheReady", None, "CacheDisabled", "scaled to zero"),
             condition("VLLMReady", True, "PodsReady", "1/1"), condition("Ready", False, "CacheDisabled", "off")]
    fields, out = sharing.refused_status({"phase": "CacheDisabled", "namespaceId": None}, conds, ID_A, "held by ml/a", 3)
    by = {c["type"]: c for c in out}
    assert fields == {"phase": "CacheDisabled", "namespaceId": ID_A}
    assert (by["IdentityResolved"]["status"], by["L2Ready"]["reason"], by["Ready"]["reason"]) == (
        "True", "StorageInUse", "StorageInUse")
    assert by["Ready"]["message"] == "held by ml/a" and by["VLLMReady"]["status"] == "True"


# ---- route names


def target(mutate=None) -> Target:
    obj = sample()
    obj["spec"]["l2"]["encryption"] = {"enabled": False}  # an id without a key to read
    if mutate:
        mutate(obj)
    spec = KVCacheNamespace.model_validate(obj).spec
    return Target(obj["metadata"]["name"], "ml", spec, resolve(spec.pins()).namespace_id)


def route(name: str, namespace_id: str | None, instance: str = "llama31-8b") -> dict[str, Any]:
    labels = {"app.kubernetes.io/instance": instance, **({NAMESPACE_ID_LABEL: namespace_id} if namespace_id else {})}
    return {"metadata": {"name": name, "labels": labels}}


def test_a_route_name_another_id_holds_is_a_conflict_never_its_own() -> None:
    t = target()
    assert t.namespace_id
    name = t.per_id_name(t.namespace_id)
    twin = t.namespace_id[:12] + "0" * 24  # another id with the same 8 hex
    assert twin != t.namespace_id and t.per_id_name(twin) == name
    assert route_conflicts(t, [("Service", route(name, t.namespace_id))]) == []
    found = route_conflicts(t, [("Service", route(name, twin)), ("NetworkPolicy", route(name, t.namespace_id))])
    assert found == [f"Service {name} (namespace id {twin})"]
    assert route_conflicts(t, [("Service", route(name, None, instance="someone"))]) == [
        f"Service {name} (namespace id none, not this resource's)"]
    assert route_conflicts(t, [("Service", route(name + "x", twin))]) == []
    # The twin's route is stale once no pod carries the twin id: then the name frees itself.
    assert stale(t, [route(name, twin)], in_use={twin}) == [] and stale(t, [route(name, twin)], in_use=set()) == [name]


def _names(objs: list[dict[str, Any]]) -> Counter:
    return Counter((o["kind"], o["metadata"]["name"]) for o in objs)


def test_every_object_has_a_name_of_its_own_with_the_cache_on_off_or_without_routes() -> None:
    """With the cache off the admin-port policy and the ZMQ policy were once both `<name>-lmcache`,
    applied side by side: which one the API server kept was left to chance. Now one policy."""
    import dataclasses

    on = target()
    off = target(lambda o: o["spec"]["identity"].pop("chatTemplateDigest"))
    assert off.namespace_id is None
    for t in (on, off, dataclasses.replace(on, routes=False, cache_bypassed=True)):
        names = _names(build_all(t, operator_ns="kvpersist-system"))
        assert max(names.values()) == 1, names
    policies = {o["metadata"]["name"]: o for o in build_all(off, "kvpersist-system") if o["kind"] == "NetworkPolicy"}
    assert list(policies) == ["llama31-8b-lmcache"]  # the agent port's: ZMQ stays closed (no rule admits it)
    assert [p["port"] for r in policies["llama31-8b-lmcache"]["spec"]["ingress"] for p in r["ports"]] == [8090]
    without = build_all(dataclasses.replace(on, routes=False, cache_bypassed=True), "kvpersist-system")
    name = on.per_id_name(on.namespace_id)
    assert not any(o["metadata"]["name"] == name for o in without)
    vllm = next(o for o in without if o["kind"] == "Deployment")
    assert "--kv-transfer-config" not in vllm["spec"]["template"]["spec"]["containers"][0]["args"]
