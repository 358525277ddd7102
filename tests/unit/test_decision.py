"""One apply's whole verdict from a snapshot (kvpersist.controller.decision), with no API server at
all: every function of kvpersist.controller.kube fails the test if called. Each case builds the
snapshot by hand, as read_snapshot would have read it, and checks the decision: StorageInUse (an
older resource names the claim), NameTaken, a route name another id holds, a fresh key, a plain
apply, the policy, a foreign L2 claim, a lost key. And what read_snapshot reads covers what decide
judges (nothing unchecked)."""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Mapping
from typing import Any

import pytest

from kvpersist.api import v1alpha1 as api
from kvpersist.builders.target import NAMESPACE_ID_LABEL
from kvpersist.controller import decision as dec
from kvpersist.controller import kube, l2key, ownership, sharing
from kvpersist.controller.decision import Snapshot, decide
from kvpersist.controller.policy import IMAGE_NOT_ALLOWED, Policy
from kvpersist.controller.stale_routes import ROUTE_TAKEN
from kvpersist.status.workloads import INSTANCE_LABEL
from tests.cases.invalid_manifests import sample

NS, UID = "ml", "uid-b"
FP, FRESH = "0123456789abcdef", "fedcba9876543210"


@pytest.fixture(autouse=True)
def no_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any call into kvpersist.controller.kube fails the test: decide reads nothing."""
    for name, fn in inspect.getmembers(kube, inspect.isfunction):
        if fn.__module__ == kube.__name__:
            monkeypatch.setattr(kube, name, lambda *a, _n=name, **k: pytest.fail(f"decide called kube.{_n}"))


def body(claim: str | None = "kv-data", name: str = "b", created: str = "2026-12-04T10:00:00Z") -> dict[str, Any]:
    obj = copy.deepcopy(sample())
    obj["metadata"] = {"name": name, "namespace": NS, "uid": UID, "generation": 3, "creationTimestamp": created}
    if claim is not None:
        obj["spec"]["l2"]["nvme"] = {"existingClaimName": claim, "maxCapacity": "100Gi"}
    return obj


def snapshot(obj: dict[str, Any], **fields: Any) -> Snapshot:
    """What read_snapshot reads for a resource whose names are all free: the key present (FP),
    nobody else on its store."""
    name = obj["metadata"]["name"]
    extra = fields.pop("names", {})
    base: dict[str, Any] = {"body": obj, "spec": api.KVCacheNamespace.model_validate(obj).spec, "l2_claims": {},
                            "key": l2key.KeyRead(f"{name}-l2-key", "master-key", True, fingerprint=FP), "stores": ()}
    snap = Snapshot(**{**base, **fields})
    manifests, token = dec.names_to_read(snap)
    free: dict[dec.ChildKey, Any] = {dec.child_key(m): None for m in [*manifests, token]}
    free.update({k: None for k in dec.route_keys(dec.written_target(snap))})
    return Snapshot(**{**base, **fields, "names": {**free, **extra}})


def kinds(d: dec.Decision) -> list[str]:
    return [m["kind"] for m in d.manifests]


def test_a_plain_apply_renders_every_object_in_order_and_reads_nothing() -> None:
    d = decide(snapshot(body()))
    assert d.applies and d.refusal is None and d.unchecked == () and d.conditions == ()
    assert d.target.cache_enabled and d.key_id == d.target.namespace_id and d.generated_key is None
    assert kinds(d)[:3] == ["NetworkPolicy", "StatefulSet", "Service"] and kinds(d)[-1] == "Deployment"
    assert d.token_secret is not None and d.token_secret["metadata"]["name"] == "b-agent-token"
    assert all(m["metadata"]["ownerReferences"][0]["uid"] == UID for m in d.manifests)


class ReadsOf(dict):  # type: ignore[type-arg]
    """os.environ that notes every key read (the real values are kept: pytest reads some too)."""

    def __init__(self, real: Mapping[str, str]) -> None:
        super().__init__(real)
        self.read: list[str] = []

    def __getitem__(self, key: str) -> str:
        self.read.append(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.read.append(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.append(str(key))
        return super().__contains__(key)


def test_decide_is_a_function_of_its_snapshot_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 59: the same snapshot decides the same, twice, reading no environment and drawing no
    random token: the token, the agent image and the chart's settings come in through it."""
    scraper = {"namespaceSelector": {"matchLabels": {"team": "obs"}}}
    image = "ghcr.io/kvpersist/kvpersist-operator@sha256:" + "c" * 64
    snap = snapshot(body(), agent_token="t" * 64, agent_image=image,
                    policy=Policy(operator_namespace="kvpersist-system", metrics_scraper=scraper))
    environ = ReadsOf(os.environ)
    with monkeypatch.context() as patched:
        patched.setattr(os, "environ", environ)
        first, second = decide(snap), decide(snap)
    assert environ.read == [] and first == second and first.applies
    assert first.token_secret is not None and first.token_secret["data"] == second.token_secret["data"]
    [sts] = [m for m in first.manifests if m["kind"] == "StatefulSet"]
    assert image in [c["image"] for c in sts["spec"]["template"]["spec"]["containers"]]
    admin_policy = first.manifests[0]
    assert [r["from"][0].get("namespaceSelector") for r in admin_policy["spec"]["ingress"][:-1]] == [  # then ZMQ
        {"matchLabels": {"kubernetes.io/metadata.name": "kvpersist-system"}}, scraper["namespaceSelector"]]


def test_a_claim_an_older_resource_names_turns_the_cache_off_storage_in_use() -> None:
    holder = sharing.User(NS, "a", "2026-12-01T00:00:00Z", claim="kv-data")
    d = decide(snapshot(body(), stores=(holder,)))
    assert d.applies and d.storage_refused is not None and "KVCacheNamespace ml/a" in d.storage_refused
    assert not d.target.cache_enabled and d.key_id is not None  # the id resolves; the store is another's
    assert d.phase == "CacheDisabled"
    assert {(c["type"], c["status"], c["reason"]) for c in d.conditions} >= {
        ("L2Ready", "False", sharing.STORAGE_IN_USE), ("Ready", "False", sharing.STORAGE_IN_USE)}
    sts = next(m for m in d.manifests if m["kind"] == "StatefulSet")
    assert sts["spec"]["replicas"] == 0
    # Created after it: this resource is the holder, the other one is refused.
    younger = sharing.User(NS, "a", "2026-12-05T00:00:00Z", claim="kv-data")
    assert decide(snapshot(body(), stores=(younger,))).storage_refused is None


def test_a_name_held_by_someone_elses_object_applies_nothing_name_taken() -> None:
    obj = body()
    users = {"name": "b-vllm", "namespace": NS, "labels": {}}  # a user's Deployment, no controller reference
    d = decide(snapshot(obj, names={("Deployment", NS, "b-vllm"): users}))
    assert not d.applies and d.stage == dec.NAMES and d.refusal is not None
    assert d.refusal[0] == ownership.NAME_TAKEN and "Deployment b-vllm" in d.refusal[1]
    assert d.phase == "Failed"
    assert [(c["type"], c["reason"]) for c in d.conditions] == [("Ready", ownership.NAME_TAKEN)]
    # Its own (a controller reference to its uid): recorded, applied over.
    own = {**users, "ownerReferences": [{"apiVersion": api.API_VERSION, "kind": api.KIND, "name": "b", "uid": UID,
                                         "controller": True}]}
    d = decide(snapshot(obj, names={("Deployment", NS, "b-vllm"): own}))
    assert d.applies and ("Deployment", NS, "b-vllm") in d.owned


def test_a_route_name_another_id_holds_applies_without_routes() -> None:
    snap = snapshot(body())
    route = dec.route_keys(dec.written_target(snap))[0]
    other = {"name": route[2], "namespace": NS, "labels": {NAMESPACE_ID_LABEL: "kvp-" + "ab" * 16, INSTANCE_LABEL: "b"}}
    d = decide(snapshot(body(), names={route: other}))
    assert d.applies and d.route_taken is not None and not d.target.routes and d.target.cache_bypassed
    assert [(c["type"], c["status"], c["reason"]) for c in d.conditions] == [("CacheBypassed", "True", ROUTE_TAKEN)]
    # Every server's agent-port policy under b-lmcache, no ZMQ; neither the id's policy nor its local Service.
    [policy] = [m for m in d.manifests if m["kind"] == "NetworkPolicy"]
    assert policy["metadata"]["name"] == "b-lmcache" and len(policy["spec"].get("ingress") or []) <= 1
    assert route[2] not in [m["metadata"]["name"] for m in d.manifests]
    # Known as its own, it is applied over, never dropped as an earlier version's (decision.RETIRED).
    own = frozenset({("NetworkPolicy", NS, "b-lmcache"), ("ConfigMap", NS, "b-connection")})
    d = decide(snapshot(body(), names={route: other}, own=own))
    assert d.drops == (("ConfigMap", NS, "b-connection"),)
    assert decide(snapshot(body(), own=own)).drops == (("NetworkPolicy", NS, "b-lmcache"), ("ConfigMap", NS, "b-connection"))


def test_an_absent_generated_key_is_made_with_the_offered_fingerprint() -> None:
    obj = body()
    absent = l2key.read(None, "b-l2-key", "master-key", NS, True, None)
    d = decide(snapshot(obj, key=absent, proposed_key=FRESH))
    assert d.applies and d.generated_key == FRESH and d.key is not None and d.key.fingerprint == FRESH
    assert d.key_id == dec.target_for("b", NS, api.KVCacheNamespace.model_validate(obj).spec, FRESH)[0].namespace_id
    # No fresh key offered (kvpersist plan): the cache stays off, L2Ready says the key is pending.
    d = decide(snapshot(obj, key=absent))
    assert d.applies and d.generated_key is None and not d.target.cache_enabled
    assert [(c["type"], c["reason"]) for c in d.conditions] == [("L2Ready", l2key.KEY_PENDING)]


def test_a_lost_key_is_not_made_again() -> None:
    obj = body()
    obj["status"] = {"l2Key": {"secret": "b-l2-key", "generated": True, "fingerprint": FP, "namespaceId": "kvp-" + "1" * 32}}
    absent = l2key.read(None, "b-l2-key", "master-key", NS, True, None)
    d = decide(snapshot(obj, key=absent, proposed_key=FRESH))
    assert d.applies and d.generated_key is None and d.key_lost is not None and not d.target.cache_enabled
    assert d.conditions[0]["reason"] == l2key.KEY_LOST


def test_the_policy_and_a_foreign_claim_refuse_before_anything_else() -> None:
    refused = decide(Snapshot(body=body(), spec=api.KVCacheNamespace.model_validate(body()).spec,
                              policy=Policy(allowed_images=("registry.other.example/",))))
    assert refused.stage == dec.POLICY and refused.refusal is not None and refused.refusal[0] == IMAGE_NOT_ALLOWED
    assert refused.manifests == () and refused.phase == "Failed"
    sized = body(claim=None)  # the StatefulSet's claims, l2-b-lmcache-<n>: one exists without the operator's labels
    foreign = {"metadata": {"name": "l2-b-lmcache-0", "namespace": NS, "labels": {}}}
    d = decide(snapshot(sized, l2_claims={"l2-b-lmcache-0": foreign}))
    assert d.stage == dec.CLAIMS and d.refusal is not None and d.refusal[0] == ownership.CLAIM_NOT_OWNED
    assert [(c["type"], c["reason"]) for c in d.conditions] == [("Ready", ownership.CLAIM_NOT_OWNED)]


def test_a_name_missing_from_the_snapshot_is_said_unchecked() -> None:
    """read_snapshot reads every name decide judges; one it did not is never judged free silently."""
    snap = snapshot(body())
    names = dict(snap.names)
    names.pop(("Deployment", NS, "b-vllm"))
    d = decide(Snapshot(**{**snap.__dict__, "names": names}))
    assert ("Deployment", NS, "b-vllm") in d.unchecked
