"""L2's key in the namespace id (kvpersist.identity, kvpersist.controller.l2key) and what outlives a
resource kept out of GitOps prunes (kvpersist.builders.retained): the pure parts. The paths through
the real API server and the real lmcache servers are tests/e2e/test_l2_key.py and
tests/e2e/test_gitops_prune.py."""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import logging
from typing import Any

import pytest

from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.retained import (
    ARGOCD_COMPARE_OPTIONS,
    ARGOCD_SYNC_OPTIONS,
    FLUX_PRUNE,
    INSTANCE_LABEL,
    KEY_FINGERPRINT_ANNOTATION,
    TRACKING_LABEL,
    build_key_secret,
    protect_patch,
    retained_labels,
)
from kvpersist.builders.target import Target
from kvpersist.controller import agents, kube, l2key, reading, refresh, retention, runtime
from kvpersist.controller.apply import apply_workloads
from kvpersist.controller.state import Controller
from kvpersist.identity import L2_KEY_PIN, key_fingerprint, resolve
from kvpersist.inventory.volume import Inventory, NamespaceUsage
from kvpersist.status.conditions import Observation, compute_status
from kvpersist.status.workloads import Seen, index_entry, live_ids, owner_key
from tests.cases.invalid_manifests import sample

KEY_A, KEY_B = b"a" * 32, b"b" * 32
FP_A, FP_B = key_fingerprint(KEY_A), key_fingerprint(KEY_B)
NID, OLD = "kvp-" + "1" * 32, "kvp-" + "2" * 32
LOG = logging.getLogger("test")


def _spec(encrypted: bool = True) -> Any:
    obj = sample()
    obj["spec"]["l2"]["encryption"] = {"enabled": encrypted}
    return KVCacheNamespace.model_validate(obj).spec


# ---------------------------------------------------------------- the fingerprint and the pin


def test_the_fingerprint_is_an_hmac_of_the_key_and_reveals_none_of_it() -> None:
    assert hmac.new(KEY_A, b"kvpersist l2 key fingerprint v1", hashlib.sha256).hexdigest()[:16] == FP_A
    assert len(FP_A) == 16 and int(FP_A, 16) >= 0 and FP_A != FP_B
    assert key_fingerprint(KEY_A) == FP_A  # the same bytes, the same name
    # Not a plain hash of the key (which anyone holding a candidate key could match without the message).
    assert FP_A not in (hashlib.sha256(KEY_A).hexdigest(), KEY_A.hex())


def test_another_key_is_another_namespace_and_no_key_is_none() -> None:
    spec = _spec()
    a, b = resolve(spec.pins(FP_A)), resolve(spec.pins(FP_B))
    assert a.namespace_id and b.namespace_id and a.namespace_id != b.namespace_id
    assert resolve(spec.pins(FP_A.upper())).namespace_id == a.namespace_id  # hex compares case-insensitively
    unread = resolve(spec.pins())
    assert unread.namespace_id is None and unread.missing == (L2_KEY_PIN,) and unread.code == "L2KeyNotRead"
    assert "spec.l2.encryption" in unread.reason
    bad = resolve(spec.pins("not-a-fingerprint"))
    assert bad.namespace_id is None and bad.invalid == (L2_KEY_PIN,)
    # Plain L2 needs no key: the fingerprint is neither required nor hashed.
    plain = _spec(encrypted=False)
    assert resolve(plain.pins()).namespace_id == resolve(plain.pins(FP_A)).namespace_id is not None
    assert resolve(plain.pins()).namespace_id not in (a.namespace_id, b.namespace_id)


# ---------------------------------------------------------------- reading the Secret


def _secret(value: bytes | None) -> dict[str, Any]:
    return {"metadata": {"name": "s"}, "data": {"master-key": base64.b64encode(value).decode()} if value else {}}


@pytest.mark.parametrize(("secret", "value", "generated", "reason"), [
    (None, None, False, l2key.KEY_NOT_FOUND),
    (None, None, True, l2key.KEY_PENDING),
    (_secret(None), None, False, l2key.KEY_MISSING),
    (_secret(b"short"), b"short", True, l2key.KEY_TOO_SHORT),
])
def test_a_key_that_cannot_serve_names_no_fingerprint_and_says_why(secret, value, generated, reason) -> None:
    read = l2key.read(secret, "s", "master-key", "ml", generated, value)
    assert read.fingerprint is None and read.problem is not None and read.problem[0] == reason
    assert read.absent == (secret is None) and "Secret s key master-key" in read.problem[1]


def test_a_good_key_is_its_fingerprint_and_its_bytes_are_nowhere() -> None:
    secret = _secret(KEY_A)
    # Restored with kubectl apply: its last-applied annotation holds the data, the key.
    secret["metadata"]["annotations"] = {"kubectl.kubernetes.io/last-applied-configuration": repr(secret["data"]),
                                         ARGOCD_SYNC_OPTIONS: "Prune=false"}
    read = l2key.read(secret, "s", "master-key", "ml", True, KEY_A)
    assert (read.fingerprint, read.problem, read.absent) == (FP_A, None, False)
    assert KEY_A.decode() not in repr(read) and base64.b64encode(KEY_A).decode() not in repr(read)
    assert read.metadata == {"labels": {}, "annotations": {ARGOCD_SYNC_OPTIONS: "Prune=false"}}


# ---------------------------------------------------------------- the generated key gone over data

GONE = l2key.KeyRead("r-l2-key", "master-key", True, problem=(l2key.KEY_PENDING, "-"), absent=True)


def _status(bytes_: int | None, objects: int = 3, fp: str = FP_A, secret: str = "r-l2-key") -> dict[str, Any]:
    out: dict[str, Any] = {"l2Key": {"secret": secret, "generated": True, "fingerprint": fp, "namespaceId": NID}}
    if bytes_ is not None:
        out["inventory"] = {"measuredAt": "2026-01-01T00:00:00Z", "volumes": [{"location": "pvc/l2", "namespaces": [
            {"namespaceId": NID, "bytes": bytes_, "objects": objects}] if objects else []}]}
    return out


def test_a_generated_key_gone_over_data_is_a_loss_never_a_new_key() -> None:
    found = l2key.loss(_status(5 * 2**20), GONE, {})
    assert found == l2key.Loss("r-l2-key", FP_A, ((NID, (5 * 2**20, 3)),), "status.l2Key")
    message = l2key.loss_message(found, "r", "ml")
    for part in ("r-l2-key", FP_A, NID, "5Mi in 3 objects", "Restore the Secret",
                 f"kubectl annotate kvcachenamespace r -n ml {l2key.REPLACE_ANNOTATION}={FP_A}", "kvpersist gc"):
        assert part in message, part
    # Not measured yet: as good as data (nothing says it is empty).
    assert l2key.loss(_status(None), GONE, {}) is not None
    assert "unknown amount" in l2key.loss_message(l2key.loss(_status(None), GONE, {}), "r", "ml")


@pytest.mark.parametrize(("status", "annotations", "key", "why"), [
    (_status(0, objects=0), {}, GONE, "the inventory shows the namespace empty"),
    (_status(5), {l2key.REPLACE_ANNOTATION: FP_A}, GONE, "the user accepted the loss of exactly that key"),
    ({}, {}, GONE, "nothing recorded: a new resource"),
    (_status(5, secret="users-key"), {}, GONE, "the record is of another Secret (a switch, not a loss)"),
    (_status(5), {}, l2key.KeyRead("r-l2-key", "master-key", True, fingerprint=FP_B), "the Secret is there"),
    (_status(5), {}, l2key.KeyRead("k", "master-key", False, absent=True), "a user's Secret: never generated"),
])
def test_no_loss(status, annotations, key, why) -> None:
    assert l2key.loss(status, key, annotations) is None, why


def test_an_acceptance_of_another_key_covers_nothing() -> None:
    assert l2key.loss(_status(5), GONE, {l2key.REPLACE_ANNOTATION: FP_B}) is not None


def test_a_claim_remembers_the_key_when_status_is_gone() -> None:
    """The resource deleted and made again (status empty), its claim retained: the fingerprint the
    operator wrote on the claim is the record."""
    claim = {"metadata": {"name": "l2-r-lmcache-0", "annotations": {KEY_FINGERPRINT_ANNOTATION: FP_A}}}
    found = l2key.loss({}, GONE, {}, [claim])
    assert found is not None and found.fingerprint == FP_A and "claim l2-r-lmcache-0" in found.evidence
    assert l2key.loss({}, GONE, {l2key.REPLACE_ANNOTATION: FP_A}, [claim]) is None


def test_a_changed_key_is_said_with_both_fingerprints_and_the_orphan() -> None:
    old, new = _status(2**20), {"l2Key": {"secret": "r-l2-key", "fingerprint": FP_B, "namespaceId": OLD}}
    [(kind, reason, message)] = l2key.events(old, new, {})
    assert (kind, reason) == ("Warning", l2key.KEY_CHANGED)
    assert FP_A in message and FP_B in message and NID in message and OLD in message and "orphan" in message
    [(kind, reason, _)] = l2key.events(old, new, {l2key.REPLACE_ANNOTATION: FP_A})
    assert (kind, reason) == ("Normal", l2key.KEY_REPLACED)
    assert l2key.events(old, old, {}) == [] and l2key.events({}, new, {}) == []


def test_no_key_is_no_namespace_in_conditions() -> None:
    """IdentityResolved and L2Ready say why, phase CacheDisabled (vLLM without the cache)."""
    fields, conds = compute_status(Observation(generation=1, namespace_id=None, identity_reason="lost it",
                                               identity_code=l2key.KEY_LOST, l2_kind="nvme", server_desired=0,
                                               vllm_desired=1, key_problem=(l2key.KEY_LOST, "lost it")))
    by = {c["type"]: c for c in conds}
    assert fields["phase"] == "CacheDisabled" and fields["namespaceId"] is None
    assert (by["IdentityResolved"]["status"], by["IdentityResolved"]["reason"]) == ("False", l2key.KEY_LOST)
    assert (by["L2Ready"]["status"], by["L2Ready"]["reason"], by["L2Ready"]["message"]) == ("False", l2key.KEY_LOST, "lost it")
    assert "lost it" in by["Ready"]["message"]


# ---------------------------------------------------------------- the operator's own steps, API faked


class Api:
    """What apply_workloads and refresh_status ask of the API server, in memory."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, secret: dict[str, Any] | None) -> None:
        self.secret, self.created, self.applied, self.events, self.status, self.metadata = secret, [], [], [], [], []
        monkeypatch.setattr(runtime, "CONTROLLER", Controller())
        monkeypatch.setattr(kube, "get", lambda v, kind, name, ns: self.secret if kind == "Secret" else None)
        monkeypatch.setattr(kube, "list_all", lambda *a, **k: [])
        monkeypatch.setattr(kube, "named_metadata", lambda *a: None)  # no object under its names yet
        monkeypatch.setattr(kube, "get_metadata", lambda *a: None)
        monkeypatch.setattr(kube, "apply", lambda m: self.applied.append(m) or m)
        monkeypatch.setattr(kube, "create_if_absent", lambda m: self.created.append(m) or m)
        monkeypatch.setattr(kube, "post_event", lambda body, t, reason, message: self.events.append((t, reason, message)))
        monkeypatch.setattr(kube, "patch_status", lambda *a: self.status.append(a[-1]))
        monkeypatch.setattr(kube, "patch_metadata", lambda *a: self.metadata.append(a))


def _body(status: dict[str, Any] | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    body = copy.deepcopy(sample())
    body["metadata"].update(namespace="ml", uid="u1", generation=1, annotations=annotations or {})
    body["status"] = status or {}
    return body


def test_apply_makes_no_key_over_data_and_one_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    name = sample()["metadata"]["name"]
    lost = _status(2**20, secret=f"{name}-l2-key")
    api = Api(monkeypatch, None)
    body = _body(lost)
    runtime.CONTROLLER.state(("ml", name))
    assert apply_workloads(body, LOG)
    assert not [m for m in api.created if m["metadata"]["name"].endswith("-l2-key")]
    # No key, no namespace: the servers scaled to zero (their claims kept), vLLM without the cache.
    applied = {m["kind"]: m for m in api.applied}
    assert applied["StatefulSet"]["spec"]["replicas"] == 0
    assert "--kv-transfer-config" not in applied["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    # What was read is cached as read (a Secret that does not exist yet), never as judged: the
    # judgement follows the annotations of each round (the next test).
    read = runtime.CONTROLLER.state(("ml", name)).key_read[1]
    assert read.absent and read.problem is not None and read.problem[0] == l2key.KEY_PENDING

    # Accepted (the annotation names the lost key): a new key, and the namespace follows it.
    api = Api(monkeypatch, None)
    runtime.CONTROLLER.state(("ml", name))
    assert apply_workloads(_body(lost, {l2key.REPLACE_ANNOTATION: FP_A}), LOG)
    [key] = [m for m in api.created if m["metadata"]["name"] == f"{name}-l2-key"]
    raw = base64.b64decode(key["data"]["master-key"])
    assert len(raw) == 32 and key_fingerprint(raw) != FP_A
    assert runtime.CONTROLLER.state(("ml", name)).key_read[1].fingerprint == key_fingerprint(raw)
    assert api.events == []  # status.l2Key names the new key; its change is the status's Event (L2KeyReplaced)


class _NoSecretsSynced:
    """The operator's Secret watch cache, listed, holding no Secret: the key stays absent, so its
    read is never made again (the cache says nothing moved)."""

    def lookup(self, namespace: str, name: str) -> tuple[bool, None]:
        return True, None


def test_an_accepted_loss_is_applied_though_the_secret_never_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI's L2-key e2e failure: an apply judged the absent key lost before the user's annotation
    came, and cached the read as judged; with the Secret still absent the watch cache never let it
    be read again, so every later round judged it lost again, even with the annotation, and the
    key was never made. The annotation alone must lead to an apply that makes the key."""
    name = sample()["metadata"]["name"]
    key = ("ml", name)
    lost = _status(2**20, secret=f"{name}-l2-key")
    api = Api(monkeypatch, None)
    runtime.CONTROLLER.secret_cache = _NoSecretsSynced()
    runtime.CONTROLLER.state(key)
    assert apply_workloads(_body(lost), LOG)  # a drift apply while the loss stands
    assert not [m for m in api.created if m["metadata"]["name"].endswith("-l2-key")]
    state = runtime.CONTROLLER.state(key)
    state.drifted = False
    refresh.refresh_status(_body(lost), Seen(), LOG)
    assert not state.drifted  # still lost: nothing to make
    refresh.refresh_status(_body(lost, {l2key.REPLACE_ANNOTATION: FP_A}), Seen(), LOG)
    assert state.drifted  # accepted: the next tick applies, and the apply makes the key
    assert apply_workloads(_body(lost, {l2key.REPLACE_ANNOTATION: FP_A}), LOG)
    assert [m for m in api.created if m["metadata"]["name"] == f"{name}-l2-key"]


def test_the_generated_key_and_claims_are_patched_out_of_prunes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    name = sample()["metadata"]["name"]
    old_style = {"metadata": {"name": f"{name}-l2-key", "labels": {  # as the operator made it before retained labels
        "app.kubernetes.io/name": "kvpersist", TRACKING_LABEL: name, "app.kubernetes.io/component": "l2-key",
        "app.kubernetes.io/managed-by": "kvpersist"}},
                 "data": {"master-key": base64.b64encode(KEY_A).decode()}}
    api = Api(monkeypatch, old_style)
    body = _body()
    key = ("ml", name)
    runtime.CONTROLLER.state(key)
    target, _ = reading.target_of(body)
    claim = {"metadata": {"name": f"l2-{name}-lmcache-0", "namespace": "ml", "resourceVersion": "7",
                          "labels": {TRACKING_LABEL: name, "app.kubernetes.io/component": "lmcache-server"}}}
    seen = Seen(claims=[claim])
    read = reading.read_key(target)
    retention.protect_retained(reading.target_of(body, read.fingerprint)[0], read, seen, LOG)
    retention.protect_retained(reading.target_of(body, read.fingerprint)[0], reading.read_key(target), seen, LOG)
    assert [(a[1], a[2]) for a in api.metadata] == [("Secret", f"{name}-l2-key"), ("PersistentVolumeClaim", claim["metadata"]["name"])]
    secret_patch, claim_patch = api.metadata[0][-1], api.metadata[1][-1]
    assert secret_patch["metadata"]["labels"] == {TRACKING_LABEL: None, INSTANCE_LABEL: name}
    assert claim_patch["metadata"]["annotations"][KEY_FINGERPRINT_ANNOTATION] == FP_A


# ---------------------------------------------------------------- out of GitOps prunes


def test_protect_patch_takes_the_tracking_label_off_and_refuses_prunes_keeping_other_options() -> None:
    meta = {"name": "l2-r-lmcache-0", "labels": {TRACKING_LABEL: "r", "app.kubernetes.io/name": "kvpersist"},
            "annotations": {ARGOCD_SYNC_OPTIONS: "Validate=false,Prune=true"}}
    patch = protect_patch(meta, "r", FP_A)
    assert patch == {"metadata": {"labels": {TRACKING_LABEL: None, INSTANCE_LABEL: "r"}, "annotations": {
        ARGOCD_SYNC_OPTIONS: "Validate=false,Prune=false,Delete=false", ARGOCD_COMPARE_OPTIONS: "IgnoreExtraneous",
        FLUX_PRUNE: "disabled", KEY_FINGERPRINT_ANNOTATION: FP_A}}}
    # Applied as a merge patch, nothing is left to do.
    labels = {k: v for k, v in {**meta["labels"], **patch["metadata"]["labels"]}.items() if v is not None}
    after = {"labels": labels, "annotations": {**meta["annotations"], **patch["metadata"]["annotations"]}}
    assert protect_patch(after, "r", FP_A) is None and protect_patch(after, "r") is None
    assert protect_patch(after, "r", FP_B) == {"metadata": {"annotations": {KEY_FINGERPRINT_ANNOTATION: FP_B}}}


def test_the_generated_key_is_born_untracked_and_unprunable() -> None:
    spec = _spec()
    secret = build_key_secret(Target("r", "ml", spec, None), key=KEY_A)
    meta = secret["metadata"]
    assert TRACKING_LABEL not in meta["labels"] and meta["labels"][INSTANCE_LABEL] == "r"
    assert "ownerReferences" not in meta and protect_patch(meta, "r") is None


def test_a_claim_without_the_tracking_label_still_maps_to_its_resource() -> None:
    claim = {"metadata": {"name": "l2-r-lmcache-0", "namespace": "ml", "labels": {INSTANCE_LABEL: "r"},
                          "annotations": {ARGOCD_SYNC_OPTIONS: "Prune=false", "other": "x"}}}
    assert owner_key(claim) == ("ml", "r")
    slim = index_entry(claim)[("ml", "r")]
    assert slim["metadata"]["annotations"] == {ARGOCD_SYNC_OPTIONS: "Prune=false"}  # only what status reads


def test_a_namespace_waiting_for_its_key_is_live() -> None:
    waiting = {"status": {"l2Key": {"secret": "r-l2-key", "fingerprint": FP_A, "namespaceId": OLD}}}
    assert OLD in live_ids([waiting], [], [])


def test_status_follows_the_apply_when_the_key_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other bytes in the Secret: the next refresh writes no status (it would name the new id beside
    the old id's servers) and marks the resource for an apply; once applied, status names the new
    id and says the key changed."""
    from tests.unit.test_status_patch import FakeApi, _pod, _report, _rollout

    api = FakeApi(monkeypatch, [_report("s-0", 2048)])
    body = copy.deepcopy(sample())
    body["metadata"].update(namespace="ml", uid="u1", generation=1, annotations={})
    key = ("ml", body["metadata"]["name"])
    secret = {"metadata": {"name": f"{key[1]}-l2-key", "labels": retained_labels(key[1], "l2-key")},
              "data": {"master-key": base64.b64encode(KEY_A).decode()}}
    monkeypatch.setattr(kube, "get", lambda v, kind, name, ns: secret if kind == "Secret" else None)
    monkeypatch.setattr(kube, "list_all", lambda *a, **k: [])
    monkeypatch.setattr(kube, "named_metadata", lambda *a: None)
    monkeypatch.setattr(kube, "get_metadata", lambda *a: None)
    monkeypatch.setattr(kube, "apply", lambda m: m)
    monkeypatch.setattr(kube, "create_if_absent", lambda m: m)
    target, _ = reading.target_of(body, FP_A)
    seen = Seen(statefulsets=[{**_rollout(1, 1), "metadata": {"name": target.server_name, "generation": 1}}],
                deployments=[{**_rollout(1, 1), "metadata": {"name": target.vllm_name, "generation": 1}}],
                pods=[_pod(f"{target.server_name}-0")])
    runtime.CONTROLLER.state(key)
    assert apply_workloads(body, LOG)
    refresh.refresh_status(body, seen, LOG)
    assert api.patches[-1]["namespaceId"] == target.namespace_id and api.patches[-1]["l2Key"]["fingerprint"] == FP_A
    body["status"] = dict(api.patches[-1])

    secret["data"]["master-key"] = base64.b64encode(KEY_B).decode()  # rotated in place
    runtime.CONTROLLER.state(key).key_read = None  # the next read (the TTL passed)
    runtime.CONTROLLER.state(key).drifted = False
    writes = len(api.patches)
    refresh.refresh_status(body, seen, LOG)
    assert len(api.patches) == writes and runtime.CONTROLLER.state(key).drifted
    assert apply_workloads(body, LOG, seen)
    refresh.refresh_status(body, seen, LOG)
    new_id = reading.target_of(body, FP_B)[0].namespace_id
    assert api.patches[-1]["namespaceId"] == new_id != target.namespace_id
    assert api.patches[-1]["l2Key"] == {"secret": f"{key[1]}-l2-key", "generated": True, "fingerprint": FP_B,
                                        "namespaceId": new_id}


# ---------------------------------------------------------------- a loss judged on every namespace the key sealed

NEW = "kvp-" + "3" * 32  # where a pin change moved the resource: the same key, nothing written yet


def _pin_changed(old_bytes: int = 7 * 2**20, new_objects: int = 0) -> dict[str, Any]:
    """The status of a resource moved by a pin change from OLD (data) to NEW (empty), both on its
    claim and sealed with the generated key FP_A; then the generated Secret was deleted."""
    return {"l2Key": {"secret": "r-l2-key", "generated": True, "fingerprint": FP_A, "namespaceId": NEW},
            "sealedNamespaces": [{"namespaceId": OLD, "fingerprint": FP_A, "secret": "r-l2-key"},
                                 {"namespaceId": NEW, "fingerprint": FP_A, "secret": "r-l2-key"}],
            "inventory": {"measuredAt": "2026-01-01T00:00:00Z", "volumes": [{"location": "pvc/l2", "namespaces": [
                {"namespaceId": OLD, "bytes": old_bytes, "objects": 9 if old_bytes else 0, "orphan": True},
                {"namespaceId": NEW, "bytes": 4096 * new_objects, "objects": new_objects}]}]}}


def test_a_pin_change_to_an_empty_namespace_leaves_the_old_one_lost_with_the_key() -> None:
    """Issue 39: the loss was judged on status.l2Key's namespace only, so with the resource moved to
    an empty one the generated key was silently made anew (the event said 0B in 0 objects) and the
    old namespace, sealed with the deleted key on the same claim, was unreadable for good."""
    found = l2key.loss(_pin_changed(), GONE, {})
    assert found is not None and found.fingerprint == FP_A
    assert found.namespaces == ((OLD, (7 * 2**20, 9)),)  # the served one is empty: it does not count
    message = l2key.loss_message(found, "r", "ml")
    assert f"namespace {OLD} holds 7Mi in 9 objects" in message and NEW not in message and "0B" not in message
    assert f"{l2key.REPLACE_ANNOTATION}={FP_A}" in message
    # Both holding data: both named, with what each holds.
    both = l2key.loss(_pin_changed(new_objects=2), GONE, {})
    assert both is not None and both.namespaces == ((NEW, (8192, 2)), (OLD, (7 * 2**20, 9)))
    assert f"{NEW} (8Ki in 2 objects), {OLD} (7Mi in 9 objects)" in l2key.loss_message(both, "r", "ml")
    # The old namespace gone from the inventory (gc'd) and the new one empty: nothing to lose.
    assert l2key.loss(_pin_changed(old_bytes=0), GONE, {}) is None
    # Accepting exactly that key's loss covers them all.
    assert l2key.loss(_pin_changed(), GONE, {l2key.REPLACE_ANNOTATION: FP_A}) is None


def test_the_generated_key_left_for_another_secret_is_still_judged_by_what_it_sealed() -> None:
    """keySecretRef named another Secret (status.l2Key records that one), the generated Secret was
    deleted meanwhile, and the spec goes back to it: what the generated key sealed is lost."""
    status = _pin_changed()
    status["l2Key"] = {"secret": "mine", "generated": False, "fingerprint": FP_B, "namespaceId": NID}
    status["sealedNamespaces"].append({"namespaceId": NID, "fingerprint": FP_B, "secret": "mine"})
    found = l2key.loss(status, GONE, {})
    assert found is not None and (found.fingerprint, found.namespaces) == (FP_A, ((OLD, (7 * 2**20, 9)),))
    # A claim's annotation (the key in use last: the user's) is not taken for the generated key's.
    claim = {"metadata": {"name": "l2-r-lmcache-0", "annotations": {KEY_FINGERPRINT_ANNOTATION: FP_B}}}
    assert l2key.loss({"l2Key": status["l2Key"]}, GONE, {}, [claim]) is None


def test_sealed_namespaces_are_recorded_newest_last_and_bounded() -> None:
    a = {"secret": "r-l2-key", "fingerprint": FP_A, "namespaceId": OLD}
    b = {"secret": "r-l2-key", "fingerprint": FP_A, "namespaceId": NEW}
    # Seeded from the record a status held before the list existed, then the one served now.
    assert l2key.sealed_after({"l2Key": a}, a, b) == [
        {"namespaceId": OLD, "fingerprint": FP_A, "secret": "r-l2-key"},
        {"namespaceId": NEW, "fingerprint": FP_A, "secret": "r-l2-key"}]
    status = {"sealedNamespaces": l2key.sealed_after({}, a, b)}
    assert l2key.sealed_after(status, b, b) == status["sealedNamespaces"]  # unchanged: nothing to write
    assert [e["namespaceId"] for e in l2key.sealed_after(status, a)] == [NEW, OLD]  # served again: newest
    many = [{"secret": "s", "fingerprint": FP_A, "namespaceId": f"kvp-{i:032x}"} for i in range(20)]
    kept = l2key.sealed_after({}, *many)
    assert len(kept) == l2key.SEALED_MAX and kept[0]["namespaceId"] == f"kvp-{4:032x}"  # the oldest dropped


def test_the_refresh_round_records_every_namespace_and_judges_the_loss_on_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through whole refresh rounds (status written through the models): the resource serves OLD
    under the generated key and stores data, a pin change moves it to NEW (empty), the generated
    Secret is deleted. The next round says L2KeyLost naming OLD and its bytes, the apply makes no
    key; on today's code it said nothing and the apply made a new key."""
    from tests.unit.test_status_patch import FakeApi, _pod, _report, _rollout

    api = FakeApi(monkeypatch, [_report("s-0", 2048)])
    events: list[tuple[str, str, str]] = []
    monkeypatch.setattr(kube, "post_event", lambda body, t, reason, message: events.append((t, reason, message)))
    monkeypatch.setattr(kube, "list_all", lambda *a, **k: [])
    monkeypatch.setattr(kube, "apply", lambda m: m)
    created: list[dict[str, Any]] = []
    monkeypatch.setattr(kube, "create_if_absent", lambda m: created.append(m) or m)
    body = copy.deepcopy(sample("nvme-minimal"))
    body["metadata"].update(namespace="ml", uid="u1", generation=1, annotations={})
    name = body["metadata"]["name"]
    key = ("ml", name)
    fp = key_fingerprint(b"k" * 32)  # FakeApi's generated key
    scans: dict[str, tuple[int, int]] = {}
    monkeypatch.setattr(agents, "inventories", lambda pods, port, token: [
        Inventory("ignored", [NamespaceUsage(n, b, o, 1.7e9) for n, (b, o) in scans.items()], 0) for _ in pods])

    def round_on(spec_body: dict[str, Any]) -> str:
        target = reading.target_of(spec_body, fp)[0]
        seen = Seen(statefulsets=[{**_rollout(1, 1), "metadata": {"name": target.server_name, "generation": 1}}],
                    deployments=[{**_rollout(1, 1), "metadata": {"name": target.vllm_name, "generation": 1}}],
                    pods=[_pod(f"{target.server_name}-0")],
                    claims=[{"metadata": {"name": "l2", "labels": {"app.kubernetes.io/component": "lmcache-server"}},
                             "status": {"phase": "Bound"}}])
        runtime.CONTROLLER.state(key)
        assert apply_workloads(spec_body, LOG, seen)
        refresh.refresh_status(spec_body, seen, LOG)
        spec_body["status"] = {**spec_body.get("status", {}), **api.patches[-1]}
        return target.namespace_id

    old = round_on(body)
    scans[old] = (6 * 2**20, 12)  # data stored under the generated key
    round_on(body)
    body["spec"]["identity"]["maxModelLen"] = int(body["spec"]["identity"].get("maxModelLen") or 4096) + 1  # a pin
    new = round_on(body)
    scans[new] = (0, 0)
    round_on(body)
    assert new != old and body["status"]["l2Key"]["namespaceId"] == new

    monkeypatch.setattr(kube, "get", lambda v, kind, n, ns: None)  # the generated Secret deleted
    state = runtime.CONTROLLER.state(key)
    state.key_read, state.drifted = None, False  # read again
    events.clear()
    writes = len(api.patches)
    refresh.refresh_status(body, Seen(), LOG)  # no key, no id: status follows the apply
    assert state.drifted and len(api.patches) == writes
    assert apply_workloads(body, LOG)
    assert not [m for m in created if m["metadata"]["name"].endswith("-l2-key")]  # no key made over OLD's data
    refresh.refresh_status(body, Seen(), LOG)
    lost = next(c for c in api.patches[-1]["conditions"] if c["type"] == "IdentityResolved")
    assert lost["reason"] == l2key.KEY_LOST, lost
    assert f"namespace {old} holds 6Mi in 12 objects" in lost["message"] and fp in lost["message"]
    assert new not in lost["message"]
    assert [(t, r) for t, r, _ in events if r == l2key.KEY_LOST] == [("Warning", l2key.KEY_LOST)]
    assert api.patches[-1]["phase"] == "CacheDisabled"
    assert [e["namespaceId"] for e in body["status"]["sealedNamespaces"]] == [old, new]  # what it was judged on
