"""spec.vllm.inferencePool: the InferencePool over the operator's own vLLM pods (kvpersist.builders
.inferencepool), made only where the API server serves that API (kvpersist.controller.inferencepool),
deleted when turned off, a Warning event once per generation when the API is missing, and refused
by the CRD's rule with mode Attached."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes.dynamic.exceptions import ResourceNotFoundError
from pydantic import ValidationError

from kvpersist.api import v1alpha1 as api
from kvpersist.api.spec import EndpointPicker, InferencePool
from kvpersist.builders.all import build_all
from kvpersist.builders.target import VLLM, Target
from kvpersist.builders.vllm import POOL_API_VERSION as API_VERSION
from kvpersist.builders.vllm import POOL_KIND as KIND
from kvpersist.builders.vllm import build_inference_pool
from kvpersist.controller import apply, decision, inferencepool, kube, l2key
from kvpersist.controller.decision import Snapshot, decide
from kvpersist.identity import key_fingerprint, resolve
from tests.cases.invalid_manifests import sample

FP = key_fingerprint(b"k" * 32)
PICKER = {"name": "kv-router-epp"}


def spec_obj(pool: dict[str, Any] | None = None, **vllm: Any) -> dict[str, Any]:
    obj = copy.deepcopy(sample())
    obj["metadata"] = {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": 2,
                       "creationTimestamp": "2026-12-04T10:00:00Z"}
    obj["spec"]["vllm"].update(vllm)
    if pool is not None:
        obj["spec"]["vllm"]["inferencePool"] = pool
    return obj


def target(obj: dict[str, Any], served: bool = True) -> Target:
    spec = api.KVCacheNamespace.model_validate(obj).spec
    return Target(obj["metadata"]["name"], "ml", spec, resolve(spec.pins(FP)).namespace_id, key_fingerprint=FP,
                  inference_pool_served=served)


def test_the_pool_selects_every_id_of_the_operators_vllm_pods_on_its_port() -> None:
    t = target(spec_obj({"endpointPicker": PICKER}, port=8123))
    pool = build_inference_pool(t)
    assert pool is not None and pool["apiVersion"] == API_VERSION and pool["kind"] == KIND
    assert pool["metadata"]["name"] == "llama-vllm" and pool["metadata"]["namespace"] == "ml"
    assert pool["metadata"]["labels"] == t.labels(VLLM)
    # The pods' selector, not the id's: a pin change keeps the pool serving (as the vLLM Service).
    assert pool["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/name": "kvpersist",
                                                        "app.kubernetes.io/instance": "llama",
                                                        "app.kubernetes.io/component": "vllm"}}
    deployment = next(m for m in build_all(t) if m["kind"] == "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": 8123}]
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "kv-router-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailClose"}


def test_the_picker_port_and_failure_mode_are_the_specs() -> None:
    pool = build_inference_pool(target(spec_obj({"endpointPicker": {**PICKER, "port": 9100, "failureMode": "FailOpen"}})))
    assert pool is not None
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9100}
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_no_pool_when_unset_or_the_api_is_not_served() -> None:
    assert build_inference_pool(target(spec_obj())) is None
    assert KIND not in [m["kind"] for m in build_all(target(spec_obj()))]
    kinds = [m["kind"] for m in build_all(target(spec_obj({"endpointPicker": PICKER}), served=False))]
    assert KIND not in kinds and kinds[-1] == "Deployment"
    kinds = [m["kind"] for m in build_all(target(spec_obj({"endpointPicker": PICKER})))]
    assert kinds[-1] == KIND  # last, after vLLM: it selects vLLM's pods


def test_no_pool_in_attached_mode() -> None:
    obj = spec_obj(mode="Attached")
    spec = api.KVCacheNamespace.model_validate(obj).spec.model_copy(
        update={"vllm": api.KVCacheNamespace.model_validate(obj).spec.vllm.model_copy(
            update={"inference_pool": InferencePool(endpoint_picker=EndpointPicker(name="epp"))})})
    t = Target("llama", "ml", spec, None, inference_pool_served=True)  # past the CRD's rule: still no pool
    assert build_inference_pool(t) is None


def test_the_crd_refuses_a_pool_with_mode_attached() -> None:
    with pytest.raises(ValidationError) as info:
        api.KVCacheNamespace.model_validate(spec_obj({"endpointPicker": PICKER}, mode="Attached"))
    assert "not the operator's to pool" in api.validation_message(info.value)


def test_the_picker_name_is_a_dns_label() -> None:
    with pytest.raises(ValidationError):
        api.KVCacheNamespace.model_validate(spec_obj({"endpointPicker": {"name": "Not_A_Label"}}))


def test_the_pool_is_not_part_of_the_namespace_id() -> None:
    assert target(spec_obj()).namespace_id == target(spec_obj({"endpointPicker": PICKER})).namespace_id


def snap(obj: dict[str, Any], served: bool, own: frozenset[tuple[str, str, str]] = frozenset()) -> Snapshot:
    """As read_snapshot reads it for a resource whose names are all free (the key present)."""
    base: dict[str, Any] = {"body": obj, "spec": api.KVCacheNamespace.model_validate(obj).spec, "l2_claims": {},
                            "key": l2key.KeyRead("llama-l2-key", "master-key", True, fingerprint=FP), "stores": (),
                            "inference_pool_served": served, "own": own}
    first = Snapshot(**base)
    manifests, token = decision.names_to_read(first)
    names = {decision.child_key(m): None for m in [*manifests, token]}
    names.update({k: None for k in decision.route_keys(decision.written_target(first))})
    return Snapshot(**{**base, "names": names})


POOL_KEY = (KIND, "ml", "llama-vllm")


def test_decide_applies_the_pool_where_served_and_says_when_the_api_is_missing() -> None:
    d = decide(snap(spec_obj({"endpointPicker": PICKER}), served=True))
    assert d.applies and d.manifests[-1]["kind"] == KIND and not d.pool_api_missing and d.drops == ()
    assert d.manifests[-1]["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    d = decide(snap(spec_obj({"endpointPicker": PICKER}), served=False))
    assert d.applies and KIND not in [m["kind"] for m in d.manifests] and d.pool_api_missing


def test_decide_deletes_its_own_pool_once_turned_off() -> None:
    assert decide(snap(spec_obj(), served=True, own=frozenset({POOL_KEY}))).drops == (POOL_KEY,)
    assert decide(snap(spec_obj(), served=True)).drops == ()  # not known as its own: never touched
    assert decide(snap(spec_obj(), served=False, own=frozenset({POOL_KEY}))).drops == ()


def test_the_missing_api_is_a_warning_event_once_per_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[tuple[str, str, str]] = []
    monkeypatch.setattr(kube, "post_event", lambda owner, type_, reason, message: posted.append((type_, reason, message)))
    obj = spec_obj({"endpointPicker": PICKER})
    d = decide(snap(obj, served=False))
    state = SimpleNamespace(pool_api_missing_warned=None)
    log = logging.getLogger("test")
    apply._pool_api_missing(d, obj, state, log)
    apply._pool_api_missing(d, obj, state, log)
    assert len(posted) == 1 and posted[0][:2] == ("Warning", inferencepool.API_MISSING)
    assert "inference.networking.k8s.io/v1" in posted[0][2] and "llama-vllm" in posted[0][2]
    apply._pool_api_missing(d, {**obj, "metadata": {**obj["metadata"], "generation": 3}}, state, log)
    assert len(posted) == 2
    apply._pool_api_missing(decide(snap(obj, served=True)), {**obj, "metadata": {**obj["metadata"], "generation": 4}},
                            state, log)
    assert len(posted) == 2


def test_discovery_is_asked_once_a_cache_period(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    installed = False

    def get(api_version: str, kind: str) -> object:
        asked.append(kind)
        if not installed:
            raise ResourceNotFoundError(f"{api_version} {kind}")
        return object()

    fresh: list[bool] = []
    resources = SimpleNamespace(get=get, invalidate_cache=lambda: fresh.append(True))
    monkeypatch.setattr(kube, "client", lambda: SimpleNamespace(resources=resources))
    monkeypatch.setattr(inferencepool, "_answer", None)  # nothing asked yet (restored after the test)
    assert not inferencepool.served(now=100.0) and not inferencepool.served(now=100.0 + inferencepool.CACHE_S - 1)
    assert asked == [KIND]
    installed = True
    assert inferencepool.served(now=100.0 + inferencepool.CACHE_S)
    assert asked == [KIND, KIND] and len(fresh) == 2  # never from the dynamic client's shared cache file
