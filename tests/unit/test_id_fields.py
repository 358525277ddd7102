"""kvpersist.api.identity.id_fields, the one list of spec fields that move the namespace id (what
the pin-change warning and `kvpersist plan` compare), checked against the code that computes the
id: every leaf of the CRD's spec schema is changed, one at a time, in full samples; a change the
API accepts either moves the id (resolve(spec.pins(...)), or the Secret the L2 key's fingerprint
is read from, builders.target.Target.key_secret) or not, and the fields whose change moves it are
exactly the list. A field added later that reaches the id fails here until it is listed."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from kvpersist.api.crd import build_crd
from kvpersist.api.identity import changed_id_fields, id_field_value, id_fields
from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.builders.target import Target
from kvpersist.identity import resolve
from tests.cases.invalid_manifests import sample

FP = "0123456789abcdef"
DIGEST = "@sha256:" + "0123456789abcdef" * 4


def _full_nvme() -> dict[str, Any]:
    """nvme-minimal with every optional field the API lets it hold set: the generated key replaced
    by a Secret of the user's, a budget, orphanRetention, the vLLM pod's extras."""
    spec = sample("nvme-minimal")["spec"]
    spec["l2"]["encryption"] = {"enabled": True, "keySecretRef": {"name": "l2-key", "key": "master-key"}}
    spec["l2"]["nvme"].update({"budget": "100Gi", "adapter": "nixl_store_dynamic", "directIO": True,
                               "reclaimPolicy": "Delete"})
    spec["l2"]["orphanRetention"] = {"maxAgeDays": 30}
    spec["eviction"] = {"policy": "LRU", "triggerWatermark": 0.9, "evictionRatio": 0.1}
    spec.setdefault("lmcacheServer", {}).update({"replicas": 2, "port": 5555, "agentPort": 8090,
                                  "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "40Gi"}},
                                  "runtimeClassName": "nvidia"})
    spec["vllm"].update({"replicas": 2, "gpusPerReplica": 1, "servedModelName": "llama", "port": 8000,
                         "extraArgs": ["--gpu-memory-utilization", "0.8"],
                         "resources": {"requests": {"cpu": "4"}, "limits": {"memory": "64Gi"}},
                         "tolerations": [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "present",
                                          "effect": "NoExecute", "tolerationSeconds": 30}],
                         "runtimeClassName": "nvidia", "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}],
                         "envFrom": [{"secretRef": {"name": "env-secret"}}, {"configMapRef": {"name": "env-config"}}],
                         "hfTokenSecretRef": {"name": "hf-reader", "key": "token"},
                         "apiKeySecretRef": {"name": "vllm-api", "key": "api-key"},
                         "modelCache": {"size": "100Gi", "storageClassName": "fast", "accessModes": ["ReadWriteOnce"]},
                         "service": {"enabled": True, "type": "ClusterIP", "port": 8000},
                         "kvEvents": {"enabled": True, "port": 5557, "replayPort": 5558},
                         "inferencePool": {"endpointPicker": {"name": "kv-router-epp", "port": 9002,
                                                              "failureMode": "FailClose"}}})
    spec["imagePullSecrets"] = [{"name": "pull"}]
    spec["canary"] = {"enabled": True, "prompt": "a prompt of its own", "maxTokens": 16, "intervalSeconds": 600}
    spec["prewarm"] = {"prompts": ["a prompt kept warm"], "systemPrompts": ["You are terse."],
                       "configMapRef": {"name": "warm-prompts"}}
    return spec


def _existing_claim() -> dict[str, Any]:
    """The user's claims (L2 and the model cache), shared by the servers, encryption off."""
    spec = _full_nvme()
    spec["l2"]["nvme"] = {"existingClaimName": "l2-claim", "maxCapacity": "450Gi", "shared": True, "adapter": "nixl_store_dynamic"}
    spec["l2"]["encryption"] = {"enabled": False}
    spec["vllm"]["modelCache"] = {"existingClaimName": "weights"}
    spec["vllm"]["envFrom"].reverse()  # the first entry is the one changed
    return spec


def _bucket() -> dict[str, Any]:
    spec = sample("hf-bucket")["spec"]
    spec["l2"]["hfBucket"]["metadataCacheTTLSeconds"] = 30
    spec["l2"]["encryption"] = {"enabled": True}  # the generated key
    return spec


def _fs() -> dict[str, Any]:
    """The fs adapter with a claim of the operator's and its storage class."""
    spec = _full_nvme()
    spec["l2"]["nvme"] = {"size": "500Gi", "storageClassName": "local-nvme", "maxCapacity": "450Gi", "adapter": "fs"}
    return spec


def _fs_native() -> dict[str, Any]:
    """fs_native, the default adapter (no budget: it counts writes but does not refuse them)."""
    spec = _full_nvme()
    del spec["l2"]["nvme"]["budget"]
    spec["l2"]["nvme"]["adapter"] = "fs_native"
    return spec


SAMPLES = {"nvme": _full_nvme, "existing-claim": _existing_claim, "bucket": _bucket, "fs": _fs, "fs-native": _fs_native}


def _leaves(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, schema) of every leaf of the CRD's spec schema; a list of objects' entries as `[]`."""
    props = node.get("properties")
    if props:
        for name, sub in props.items():
            yield from _leaves(sub, f"{path}.{name}")
    elif isinstance(node.get("items"), dict) and node["items"].get("properties"):
        yield from _leaves(node["items"], f"{path}[]")
    else:
        yield path, node


SPEC_SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
LEAVES = dict(_leaves(SPEC_SCHEMA, "spec"))
STRINGS = ["a", "other", "other-name", "fast", "a" * 40, "b" * 40, "sha256:" + "b" * 64, "Qwen/Qwen3-8B", "vllm-0.34.0",
           "hf://buckets/acme/other", "1Gi", "400Gi", "600Gi", "2Mi", "ReadWriteMany", "registry.example.com/x:y" + DIGEST]


UNSET = object()  # the field left out


def _candidates(value: Any, schema: dict[str, Any]) -> list[Any]:
    """Values to try in place of value: the field left out, the others of an enum, a flipped
    boolean, numbers around it, strings of the shapes the API's patterns take, one more entry or key."""
    return [UNSET, *_values(value, schema)]


def _values(value: Any, schema: dict[str, Any]) -> list[Any]:
    if "enum" in schema:
        return [v for v in schema["enum"] if v != value]
    kind = schema.get("type")
    if kind == "boolean":
        return [not value] if value is not None else [True, False]
    if kind == "integer":
        base = [value + 1, value - 1, value * 2] if value is not None else []
        return [*base, 1, 2, 8, 16, 64, 128, 4096]
    if kind == "number":
        base = [value / 2, value * 2, value + 1] if value is not None else []
        return [*base, 0.5, 1.0, 10.0]
    if kind == "array":
        return [[*(value or []), "--enforce-eager"], [*(value or []), "ReadWriteMany"],
                [*(value or []), "registry.example/proxy@sha256:" + "e" * 64]]
    if kind == "object":
        return [{**(value or {}), "cpu": "3"}, {**(value or {}), "kubernetes.io/os": "linux"}]
    out = []
    if isinstance(value, str):
        last = value[-1]
        out += [value[:-1] + ("0" if last != "0" else "1"), value + "x", value + "-x", value.upper()]
        if DIGEST in value:
            out.insert(0, value.replace(DIGEST, "@sha256:" + "f" * 64))
    return out + STRINGS


def _set(spec: dict[str, Any], path: str, value: Any) -> bool:
    """Sets path (`[]`: the first entry) in spec; False when a section on the way is absent."""
    node: Any = spec
    parts = path.split(".")[1:]
    for part in parts[:-1]:
        name, entries = part.removesuffix("[]"), part.endswith("[]")
        if not isinstance(node, dict) or name not in node:
            return False
        node = node[name]
        if entries:
            if not node:
                return False
            node = node[0]
    if not isinstance(node, dict):
        return False
    if value is UNSET:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value
    return True


def _get(spec: dict[str, Any], path: str) -> Any:
    node: Any = spec
    for part in path.split(".")[1:]:
        name, entries = part.removesuffix("[]"), part.endswith("[]")
        node = node.get(name) if isinstance(node, dict) else None
        if entries:
            node = node[0] if node else None
    return node


def _outcome(spec: KVCacheNamespaceSpec) -> tuple[str | None, tuple[str, str] | None]:
    """What the id depends on: the id with the key fingerprint fixed, and the Secret it is read from."""
    return resolve(spec.pins(FP)).namespace_id, Target("r", "ml", spec, None).key_secret


def _mutations() -> Iterator[tuple[str, str, KVCacheNamespaceSpec, KVCacheNamespaceSpec]]:
    """(sample, path, before, after) for every change of one leaf the API accepts."""
    for label, make in SAMPLES.items():
        raw = make()
        before = KVCacheNamespaceSpec.model_validate(raw)
        for path, schema in LEAVES.items():
            current = _get(raw, path)
            for value in _candidates(current, schema):
                if value == current:
                    continue
                changed = copy.deepcopy(raw)
                if not _set(changed, path, value):
                    break
                try:
                    after = KVCacheNamespaceSpec.model_validate(changed)
                except ValidationError:
                    continue
                if after != before:
                    yield label, path, before, after


MUTATIONS = list(_mutations())


def _stored(spec: KVCacheNamespaceSpec) -> dict[str, Any]:
    return spec.model_dump(by_alias=True, exclude_none=True, mode="json")


def test_the_samples_are_whole() -> None:
    """Each sample is valid and resolves (so a change that unresolves the id shows), and between
    them every leaf of the spec is changed by at least one accepted value."""
    for make in SAMPLES.values():
        spec = KVCacheNamespaceSpec.model_validate(make())
        assert _outcome(spec)[0] is not None
    changed = {path for _, path, _, _ in MUTATIONS}
    fixed = {path for path, schema in LEAVES.items() if len(schema.get("enum") or ()) == 1 and "default" in schema}
    assert fixed == set()  # a field of one allowed value is no field (the API has none)
    assert set(LEAVES) - changed == fixed, "no accepted change found for these fields: add a sample or a candidate value"


def test_the_fields_that_move_the_id_are_exactly_id_fields() -> None:
    moving = {path for _, path, before, after in MUTATIONS if _outcome(before) != _outcome(after)}
    assert moving == {f.path for f in id_fields()}


@pytest.mark.parametrize("label", sorted(SAMPLES))
def test_changed_id_fields_names_a_change_exactly_when_the_id_can_move(label: str) -> None:
    """The comparison the plan and the policy make: a change of a listed field is named exactly
    when the id or the key's Secret moves (an image's tag alone is not)."""
    for sample_label, path, before, after in MUTATIONS:
        if sample_label != label:
            continue
        named = changed_id_fields(_stored(before), _stored(after))
        assert bool(named) == (_outcome(before) != _outcome(after)), (path, named)
        assert named in ([], [path]), (path, named)


def test_an_image_tag_alone_keeps_the_id_and_is_not_named() -> None:
    spec = _full_nvme()
    before = KVCacheNamespaceSpec.model_validate(spec)
    spec["image"] = "mirror.example.com/other/name:v9" + DIGEST
    after = KVCacheNamespaceSpec.model_validate(spec)
    assert _outcome(before) == _outcome(after)
    assert changed_id_fields(_stored(before), _stored(after)) == []
    field = next(f for f in id_fields() if f.path == "spec.image")
    assert id_field_value(_stored(after), field) == DIGEST[1:]


def test_id_fields_paths_are_the_apis() -> None:
    """Each path is a leaf of the CRD's schema, spelled as the API spells it."""
    for f in id_fields():
        assert f.path in LEAVES, f.path
        assert re.fullmatch(r"spec(\.[a-zA-Z0-9]+)+", f.path)
