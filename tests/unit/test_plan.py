"""`kvpersist plan`'s pure parts (kvpersist.plancmd): the new id computed with the operator's code
and the fingerprint status records (or the key read from another Secret), the fields that moved
it, what the old id holds (status.usage), whether the new one already has data, the text and
the JSON, and the exit status. The command against the real API server:
tests/e2e/test_pin_change_plan.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvpersist import cli, plancmd
from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.controller.l2key import read as read_key
from kvpersist.controller.l2key import unreadable
from kvpersist.identity import key_fingerprint, resolve
from kvpersist.inventory.volume import served_of
from tests.cases.invalid_manifests import sample

FP = "0123456789abcdef"
OTHER_KEY = bytes(range(32))
REVISION = "1" * 40


def _live(obj: dict[str, Any], volumes: list[dict[str, Any]] | None = None, fingerprint: str = FP) -> dict[str, Any]:
    """obj as the API server would return it once served: status.namespaceId the id its spec
    resolves to with the recorded key, status.l2Key, an inventory of the volumes given."""
    spec = KVCacheNamespaceSpec.model_validate(obj["spec"])
    served = resolve(spec.pins(fingerprint)).namespace_id
    live = copy.deepcopy(obj)
    live["metadata"].update({"namespace": "ml", "generation": 3})
    live["spec"] = spec.model_dump(by_alias=True, exclude_none=True, mode="json")  # defaults applied, as stored
    live["status"] = {"observedGeneration": 3, "namespaceId": served,
                      "l2Key": {"secret": f"{obj['metadata']['name']}-l2-key", "generated": True, "fingerprint": fingerprint,
                                "namespaceId": served},
                      "hits": {"summary": "64.0% (5m)"}}
    if volumes is not None:
        live["status"]["inventory"] = {"measuredAt": "2026-01-01T00:00:00Z", "volumes": volumes}
        # status.usage as the operator writes it: the served id's bytes, the volume's count folded in.
        used, objects = served_of(live["status"]["inventory"], served) or (0, 0)
        live["status"]["usage"] = {"l2UsedBytes": used, "l2Objects": objects, "measuredAt": "2026-01-01T00:00:00Z"}
    return live


def _share(namespace_id: str, size: int, objects: int) -> dict[str, Any]:
    return {"namespaceId": namespace_id, "bytes": size, "objects": objects}


def _plan(obj: dict[str, Any], live: dict[str, Any] | None, key: Any = None) -> plancmd.Plan:
    return plancmd.compute("ml", obj["metadata"]["name"], KVCacheNamespaceSpec.model_validate(obj["spec"]), live, key)


def test_the_same_spec_keeps_the_id_with_the_recorded_fingerprint() -> None:
    obj = sample()
    live = _live(obj, [])
    plan = _plan(obj, live)
    assert (plan.old_id, plan.new_id, plan.changed_fields, plan.code) == (live["status"]["namespaceId"],) * 2 + ([], 0)
    assert plan.old_held is None and "(unchanged)" in plancmd.format_plan(plan)


def test_a_revision_change_names_the_new_id_and_the_data_left_behind() -> None:
    obj = sample()
    old = _live(obj)["status"]["namespaceId"]
    live = _live(obj, [{"location": "pvc/l2-a-0", "namespaces": [_share(old, 2**30 * 12 + 2**29, 300)]},
                       {"location": "pvc/l2-a-1", "namespaces": [_share(old, 2**29, 156), _share("kvp-" + "e" * 32, 9, 1)]}])
    new = copy.deepcopy(obj)
    new["spec"]["identity"]["modelRevision"] = REVISION
    plan = _plan(new, live)
    want = resolve(KVCacheNamespaceSpec.model_validate(new["spec"]).pins(FP)).namespace_id
    assert plan.new_id == want != old
    assert plan.changed_fields == ["spec.identity.modelRevision"]
    assert plan.old_held == (2**30 * 13, 456)  # both volumes' shares of the old id
    assert plan.new_held == (0, 0) and plan.code == plancmd.CHANGES
    text = plancmd.format_plan(plan)
    assert f"{old} -> {want}" in text
    assert f"{old}: 13Gi ({2**30 * 13} bytes) in 456 objects, hit rate 64.0% (5m)" in text
    assert f"`kvpersist gc {old}`" in text and "it starts cold" in text


def test_a_rollback_finds_the_new_id_already_on_the_volumes() -> None:
    obj = sample()
    new = copy.deepcopy(obj)
    new["spec"]["identity"]["modelRevision"] = REVISION
    earlier = resolve(KVCacheNamespaceSpec.model_validate(new["spec"]).pins(FP)).namespace_id
    served = _live(obj)["status"]["namespaceId"]
    live = _live(obj, [{"location": "pvc/l2-a-0", "namespaces": [_share(earlier, 3 * 2**20, 12), _share(served, 10, 1)]}])
    plan = _plan(new, live)
    assert plan.new_id == earlier and plan.new_held == (3 * 2**20, 12)
    assert "3Mi (3145728 bytes) in 12 objects already on this resource's L2: served at once (a rollback)" in (
        plancmd.format_plan(plan))


def test_no_inventory_says_so_rather_than_zero() -> None:
    obj = sample()
    new = copy.deepcopy(obj)
    new["spec"]["identity"]["maxModelLen"] = 8192
    plan = _plan(new, _live(obj))
    assert plan.old_held is None and plan.new_held is None
    text = plancmd.format_plan(plan)
    assert "its size not measured yet" in text and "not known (no inventory yet)" in text


def test_an_image_tag_alone_is_no_change_and_a_tag_without_digest_turns_the_cache_off() -> None:
    obj = sample()
    live = _live(obj, [])
    retagged = copy.deepcopy(obj)
    retagged["spec"]["image"] = "mirror.example.com/v:1@" + obj["spec"]["image"].split("@")[1]
    assert _plan(retagged, live).code == plancmd.UNCHANGED
    untagged = copy.deepcopy(obj)
    untagged["spec"]["image"] = "vllm/vllm-openai:v0.33.0"
    plan = _plan(untagged, live)
    assert plan.new_id is None and plan.code == plancmd.CHANGES and plan.changed_fields == ["spec.image"]
    assert plan.new_id_reason is not None and plan.new_id_reason.startswith("the cache turns off: spec.image is not pinned")
    assert " -> none" in plancmd.format_plan(plan)


def test_another_secret_is_read_or_the_id_is_unknown() -> None:
    obj = sample()
    live = _live(obj, [])
    new = copy.deepcopy(obj)
    new["spec"]["l2"]["encryption"] = {"keySecretRef": {"name": "team-key"}}
    unread = _plan(new, live)
    assert unread.unknown and unread.new_id is None and unread.code == plancmd.UNKNOWN
    assert unread.changed_fields == ["spec.l2.encryption.keySecretRef.name", "spec.l2.encryption.keySecretRef.key"]
    assert "Secret team-key key master-key" in (unread.new_id_reason or "")
    forbidden = _plan(new, live, unreadable("team-key", "master-key", False, 403))
    assert forbidden.code == plancmd.UNKNOWN and "403" in (forbidden.new_id_reason or "")
    secret = {"metadata": {"name": "team-key"}, "data": {}}
    readable = _plan(new, live, read_key(secret, "team-key", "master-key", "ml", False, OTHER_KEY))
    spec = KVCacheNamespaceSpec.model_validate(new["spec"])
    assert readable.new_id == resolve(spec.pins(key_fingerprint(OTHER_KEY))).namespace_id
    assert readable.code == plancmd.CHANGES
    # The same key in the other Secret: the fields changed, the id did not.
    relive = _live(obj, [], fingerprint=key_fingerprint(OTHER_KEY))
    kept = _plan(new, relive, read_key(secret, "team-key", "master-key", "ml", False, OTHER_KEY))
    assert kept.code == plancmd.UNCHANGED and kept.changed_fields


def test_plain_l2_needs_no_key() -> None:
    obj = sample()
    new = copy.deepcopy(obj)
    new["spec"]["l2"]["encryption"] = {"enabled": False}
    plan = _plan(new, _live(obj, []))
    assert not plan.unknown and plan.new_id == resolve(KVCacheNamespaceSpec.model_validate(new["spec"]).pins()).namespace_id
    assert plan.changed_fields == ["spec.l2.encryption.enabled"]


def test_a_resource_not_created_yet() -> None:
    obj = sample()
    obj["spec"]["l2"]["encryption"] = {"enabled": False}
    plan = _plan(obj, None)
    assert not plan.exists and plan.new_id and plan.code == plancmd.CHANGES
    assert "not created yet" in plancmd.format_plan(plan)


def test_another_resource_serving_the_old_id_keeps_it_from_being_an_orphan() -> None:
    obj = sample()
    new = copy.deepcopy(obj)
    new["spec"]["identity"]["modelRevision"] = REVISION
    plan = _plan(new, _live(obj, []))
    plan.still_used_by = ["KVCacheNamespace ml/twin"]
    text = plancmd.format_plan(plan)
    assert "still served by KVCacheNamespace ml/twin" in text and "orphan" not in text


def test_a_stale_status_is_said() -> None:
    obj = sample()
    live = _live(obj, [])
    live["metadata"]["generation"] = 4
    assert "has not caught up" in plancmd.format_plan(_plan(obj, live))


def test_json() -> None:
    obj = sample()
    old = _live(obj)["status"]["namespaceId"]
    new = copy.deepcopy(obj)
    new["spec"]["identity"]["modelRevision"] = REVISION
    out = plancmd.plan_json(_plan(new, _live(obj, [{"location": "pvc/x", "namespaces": [_share(old, 5, 2)]}])))
    assert json.loads(json.dumps(out)) == out
    assert out["oldId"] == old and out["oldHeld"] == {"bytes": 5, "objects": 2} and out["newHeld"] == {"bytes": 0, "objects": 0}
    assert out["changedFields"] == ["spec.identity.modelRevision"] and out["moves"] is True and out["exitCode"] == 2
    assert {"namespace", "name", "exists", "newId", "newIdReason", "unknown", "oldHits", "stillUsedBy", "staleStatus"} <= set(out)


@pytest.mark.parametrize(("codes", "want"), [([], 0), ([0, 0], 0), ([0, 2], 2), ([2, 3, 0], 3), ([3, 1], 1), ([2, 4, 3], 4),
                                            ([4, 1], 1)])
def test_exit_code(codes: list[int], want: int) -> None:
    assert plancmd.exit_code(codes) == want


def test_a_file_without_a_kvcachenamespace_is_an_error_before_any_api_call(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "cm.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    assert cli.main(["plan", "-f", str(path)]) == 1
    assert "no KVCacheNamespace" in capsys.readouterr().err
    path.write_text("a: [")
    assert cli.main(["plan", "-f", str(path)]) == 1
    assert cli.main(["plan", "-f", str(tmp_path / "missing.yaml")]) == 1
    path.write_text(json.dumps(sample()))
    assert cli.main(["plan", "-f", str(path), "--kubeconfig", str(tmp_path / "no-kubeconfig")]) == 1
    assert "no cluster to ask" in capsys.readouterr().err


class _Cluster:
    """What plan_one reads, in memory: objects by (kind, name); a kind listed by kind."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, objects: list[dict[str, Any]]) -> None:
        from kvpersist.controller import kube

        self.objects = {(o["kind"], o["metadata"]["name"]): o for o in objects}
        monkeypatch.setattr(kube, "get", lambda v, kind, name, ns: copy.deepcopy(self.objects.get((kind, name))))
        monkeypatch.setattr(kube, "get_metadata", lambda v, kind, name, ns: (self.objects.get((kind, name)) or {}).get("metadata"))
        monkeypatch.setattr(kube, "list_all", lambda v, kind, ns=None, label_selector=None, field_selector=None: [
            copy.deepcopy(o) for (k, _), o in self.objects.items() if k == kind])
        for name in ("apply", "create_if_absent", "delete", "patch_status", "post_event"):
            monkeypatch.setattr(kube, name, lambda *a, _n=name, **k: pytest.fail(f"plan wrote: kube.{_n}"))


def _claiming(name: str, created: str | None) -> dict[str, Any]:
    obj = sample()
    obj["metadata"] = {"name": name, "namespace": "ml", **({"uid": f"u-{name}", "creationTimestamp": created} if created else {})}
    obj["spec"]["l2"]["nvme"] = {"existingClaimName": "kv-data", "maxCapacity": "100Gi"}
    return obj


def test_the_plan_says_the_operator_would_refuse_a_claim_another_resource_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's own decide on what the plan reads: B names the claim A (older) holds, so the
    operator would keep B's cache off (StorageInUse) and write L2Ready and Ready False."""
    _Cluster(monkeypatch, [_claiming("a", "2026-12-01T00:00:00Z")])
    plan = plancmd.plan_one(_claiming("b", None), "ml")
    assert plan.verdict == "StorageInUse" and plan.refused and plan.code == plancmd.REFUSED, plan
    assert plan.verdict_message is not None and "KVCacheNamespace ml/a" in plan.verdict_message
    assert {(c["type"], c["status"], c["reason"]) for c in plan.conditions} >= {("L2Ready", "False", "StorageInUse"),
                                                                                ("Ready", "False", "StorageInUse")}
    text = plancmd.format_plan(plan)
    assert "applied with the cache off (StorageInUse)" in text and "Ready=False StorageInUse" in text, text
    out = plancmd.plan_json(plan)
    assert out["verdict"] == "StorageInUse" and out["refused"] is True and out["exitCode"] == 4


def test_the_plan_says_a_taken_name_refuses_the_whole_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    users = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "b-vllm", "namespace": "ml"}}
    _Cluster(monkeypatch, [users])
    plan = plancmd.plan_one(_claiming("b", None), "ml")
    assert plan.verdict == "NameTaken" and not plan.applied and plan.code == plancmd.REFUSED
    assert "Deployment b-vllm" in (plan.verdict_message or "")
    assert "refused, nothing applied (NameTaken)" in plancmd.format_plan(plan)
    _Cluster(monkeypatch, [])
    free = plancmd.plan_one(_claiming("b", None), "ml")
    line = next(x for x in plancmd.format_plan(free).splitlines() if x.strip().startswith("operator:"))
    assert free.verdict is None and free.applied and line.endswith(" applies it") and free.code == plancmd.UNKNOWN


def test_the_plan_reads_the_policy_of_every_server_when_another_id_holds_a_route_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another id's Service under the new id's route name: the operator leaves the routes out and
    applies the policy of every server (RouteNameTaken); the plan reads that policy's name too, so
    it says so rather than "not checked"; a user's object under that name refuses the apply."""
    obj = _claiming("b", None)
    obj["spec"]["l2"]["encryption"] = {"enabled": False}
    _Cluster(monkeypatch, [])
    nid = plancmd.plan_one(obj, "ml").new_id
    assert nid is not None
    other = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"b-lmcache-{nid[4:12]}", "namespace": "ml", "labels": {
        "kvpersist.dev/namespace-id": "kvp-" + "0" * 32, "app.kubernetes.io/instance": "b"}}}
    _Cluster(monkeypatch, [other])
    plan = plancmd.plan_one(obj, "ml")
    assert plan.verdict == "RouteNameTaken" and plan.applied and not plan.unchecked, plan
    users = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "b-lmcache", "namespace": "ml"}}
    _Cluster(monkeypatch, [other, users])
    plan = plancmd.plan_one(obj, "ml")
    assert plan.verdict == "NameTaken" and not plan.applied and "NetworkPolicy b-lmcache" in (plan.verdict_message or "")


def test_a_planted_generated_key_secret_names_no_id_in_the_plan_as_in_the_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Secret under the generated key's name that the operator did not make: the operator never
    uses its bytes (KeySecretNotOwned, the cache off), so the plan names no id from them either;
    the same bytes in a Secret with the operator's labels name the id."""
    import base64

    from kvpersist.builders.retained import retained_labels
    from kvpersist.builders.target import Target

    doc = _claiming("b", None)
    spec = KVCacheNamespaceSpec.model_validate(doc["spec"])
    target = Target("b", "ml", spec, None)
    assert target.key_secret is not None and target.key_secret_generated
    name, item = target.key_secret
    raw = b"p" * 32

    def secret(labels: dict[str, str]) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": "ml", "labels": labels},
                "data": {item: base64.b64encode(raw).decode()}}

    _Cluster(monkeypatch, [secret({"team": "someone-else"})])
    planted = plancmd.plan_one(doc, "ml")
    assert planted.new_id is None and planted.unknown, planted
    assert "was not made by the operator" in (planted.new_id_reason or ""), planted.new_id_reason
    _Cluster(monkeypatch, [secret(retained_labels("b", "l2-key"))])
    own = plancmd.plan_one(doc, "ml")
    assert own.new_id == resolve(spec.pins(key_fingerprint(raw))).namespace_id, own


def test_two_pins_plan_the_id_of_the_pins_the_files_fill_and_unread_files_leave_it_unknown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan fills unset pins as the operator does: from the files the live status keeps for the
    same commits, else from the Hub (here refused: no Hub is reachable), never a guess."""
    from kvpersist.controller import pincheck
    from kvpersist.identity import image_digest

    obj = sample()
    ident = obj["spec"]["identity"]
    ident["connectorBuild"] = image_digest(obj["spec"]["image"])
    live = _live(obj)
    two = copy.deepcopy(obj)
    two["spec"]["identity"] = {k: ident[k] for k in ("modelId", "modelRevision")}
    spec = KVCacheNamespaceSpec.model_validate(two["spec"])
    files = {"numKVHeads": ident["numKVHeads"], "headSize": ident["headSize"], "kvCacheDtype": ident["kvCacheDtype"],
             "maxModelLen": ident["maxModelLen"], "chatTemplateDigest": ident["chatTemplateDigest"], "blockSize": 16}
    live["status"]["identity"] = {"files": {"at": f"{ident['modelId']}@{ident['modelRevision']}", **files}}
    pins = plancmd.pin_facts(spec, live)
    plan = plancmd.compute("ml", "llama31-8b", spec, live, None, pins)
    assert plan.new_id == live["status"]["namespaceId"] and not plan.unknown, plancmd.format_plan(plan)

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pins = plancmd.pin_facts(spec, None)
    assert isinstance(pins, pincheck.Facts) and pins.values is None
    plan = plancmd.compute("ml", "llama31-8b", spec, None, None, pins)
    assert plan.unknown and plan.new_id is None and "could not read" in (plan.new_id_reason or "")


def test_pins_the_model_files_contradict_plan_the_cache_off_as_the_operator_decides() -> None:
    """PinMismatch turns the cache off in the operator (decision.target_for): the plan names no new id either."""
    from kvpersist.controller import pincheck

    obj = sample()
    live = _live(obj)
    spec = KVCacheNamespaceSpec.model_validate(obj["spec"])
    facts = pincheck.Facts("m@r", (), mismatch="spec.identity.headSize 128 but the files say 64")
    plan = plancmd.compute("ml", "llama31-8b", spec, live, None, facts)
    assert plan.new_id is None and not plan.unknown and plan.code == plancmd.CHANGES
    assert plan.new_id_reason == "the cache turns off: spec.identity.headSize 128 but the files say 64"
