"""The models enforce the CRD's own CEL rules (kvpersist.api.celrules), each with the CRD's message,
and the quantity binding those rules call behaves as Kubernetes' CEL library does."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvpersist.api import celrules
from kvpersist.api.crd import build_crd
from kvpersist.api.quantity import as_approximate_float, parse, parse_quantity
from kvpersist.api.spec import EXTRA_ARGS, spec_schema
from kvpersist.api.v1alpha1 import KVCacheNamespace, validation_message
from tests.cases.invalid_manifests import sample
from tests.cases.oracles import extra_args_problem

Edit = Callable[[dict[str, Any]], None]


def _nvme(**fields: Any) -> Edit:
    return lambda spec: spec["l2"]["nvme"].update(fields)


def _vllm(**fields: Any) -> Edit:
    return lambda spec: spec["vllm"].update(fields)


def _drop_size(spec: dict[str, Any]) -> None:
    spec["l2"]["nvme"].pop("size")
    spec["l2"]["nvme"].pop("storageClassName")


def _bucket_and_nvme(spec: dict[str, Any]) -> None:
    spec["l2"]["hfBucket"] = sample("hf-bucket")["spec"]["l2"]["hfBucket"]


def _orphans_on_bucket(spec: dict[str, Any]) -> None:
    spec["l2"] = {**sample("hf-bucket")["spec"]["l2"], "orphanRetention": {"maxAgeDays": 7}}


def _existing_and_replicas(spec: dict[str, Any]) -> None:
    _drop_size(spec)
    spec["l2"]["nvme"]["existingClaimName"] = "mine"
    spec["lmcacheServer"] = {**spec.get("lmcacheServer", {}), "replicas": 2}


def _toleration(**fields: Any) -> Edit:
    return lambda spec: spec["vllm"].update(tolerations=[fields])


# (the field path the refusal names, a word of the CRD's message, how to break the rule): one row a rule.
CASES: list[tuple[str, str, Edit]] = [
    ("spec.vllm.gpusPerReplica", "at least identity.tensorParallelSize",
     lambda spec: (spec["identity"].update(tensorParallelSize=2), spec["vllm"].update(gpusPerReplica=1))),
    ("spec.lmcacheServer.replicas", "an existing claim serves one lmcache server", _existing_and_replicas),
    ("spec.l2", "set exactly one of nvme or hfBucket", _bucket_and_nvme),
    ("spec.l2.orphanRetention", "orphanRetention applies to NVMe claims", _orphans_on_bucket),
    ("spec.l2.nvme", "set exactly one of size (a new claim", _drop_size),
    ("spec.l2.nvme.storageClassName", "storageClassName applies to a new claim",
     lambda spec: (_drop_size(spec), spec["l2"]["nvme"].update(existingClaimName="mine", storageClassName="x"))),
    ("spec.l2.nvme.maxCapacity", "maxCapacity must be at least 1Mi and fit in the claim", _nvme(size="400Gi", maxCapacity="450Gi")),
    ("spec.l2.nvme.reclaimPolicy", "an existing claim is not the operator's to delete",
     lambda spec: (_drop_size(spec), spec["l2"]["nvme"].update(existingClaimName="mine", reclaimPolicy="Delete"))),
    ("spec.l2.nvme.budget", "budget must be at least 1Mi", _nvme(budget="1023Ki")),
    ("spec.l2.nvme.budget", "budget needs adapter nixl_store_dynamic", _nvme(budget="1Gi", adapter="fs")),
    ("spec.l2.nvme.budget", "budget needs adapter nixl_store_dynamic", _nvme(budget="1Gi")),  # fs_native, the default
    ("spec.l2.nvme.shared", "shared needs adapter nixl_store_dynamic", _nvme(shared=True)),
    ("spec.l2.nvme.shared", "shared needs adapter nixl_store_dynamic", _nvme(shared=True, adapter="fs")),
    ("spec.l2.nvme.size", "a quantity must be less than 8Ei", _nvme(size="8Ei")),
    ("spec.lmcacheServer.agentPort", "agentPort must differ from port",
     lambda spec: spec.setdefault("lmcacheServer", {}).update(agentPort=5555)),
    ("spec.l1.size", "size must be at least 1Mi and at most 4Ti", lambda spec: spec["l1"].update(size="1023Ki")),
    ("spec.l2.nvme.size", "size must be at least 1Mi", _nvme(size="1000")),
    ("spec.l1.size", "size must be at least 1Mi and at most 4Ti", lambda spec: spec["l1"].update(size="5Ti")),
    ("spec.l2.nvme.maxCapacity", "maxCapacity is required with existingClaimName",
     lambda spec: spec["l2"].update(nvme={"existingClaimName": "kv-data"})),
    ("spec.l2.nvme.budget", "at most maxCapacity (90% of size when unset)", _nvme(budget="460Gi")),
    ("spec.vllm.kvEvents.port", "kvEvents.port and kvEvents.replayPort must differ from port",
     _vllm(kvEvents={"enabled": True, "port": 8000})),
    ("spec.vllm.kvEvents.replayPort", "replayPort must differ from port", _vllm(kvEvents={"port": 6000, "replayPort": 6000})),
    ("spec.vllm.mode", "with vllm.mode Attached your own pods carry their arguments",
     _vllm(mode="Attached", extraArgs=["--enforce-eager"])),
    ("spec.vllm.mode", "with vllm.mode Attached your own pods carry their arguments",
     _vllm(mode="Attached", service={"enabled": True})),
    ("spec.vllm.inferencePool", "not the operator's to pool",
     _vllm(mode="Attached", inferencePool={"endpointPicker": {"name": "kv-router-epp"}})),
    ("spec.vllm.extraArgs", "extraArgs may set only these vLLM flags", _vllm(extraArgs=["--kv-cache-dtype=fp8"])),
    ("spec.vllm.extraArgs", "any other word would reach vLLM as a positional argument", _vllm(extraArgs=["--seed"])),
    ("spec.vllm.resources.limits[memory]", "a quantity must be less than 8Ei",
     _vllm(resources={"limits": {"memory": "99999999999999999999Ei"}})),
    ("spec.vllm.tolerations[0].key", "operator Exists without a key", _toleration(operator="Exists")),
    ("spec.vllm.tolerations[0].key", "operator Equal matches a taint by key", _toleration(value="x")),
    ("spec.vllm.tolerations[0].value", "operator Exists matches every value",
     _toleration(key="k", operator="Exists", value="v")),
    ("spec.vllm.tolerations[0].tolerationSeconds", "applies to NoExecute taints only",
     _toleration(key="k", tolerationSeconds=5)),
    ("spec.vllm.env[0].name", "env names refused", _vllm(env=[{"name": "HF_TOKEN", "value": "x"}])),
    ("spec.vllm.envFrom[0]", "set exactly one of secretRef or configMapRef",
     _vllm(envFrom=[{"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}])),
    ("spec.vllm.modelCache", "set exactly one of size (a claim the operator makes", _vllm(modelCache={})),
    ("spec.vllm.modelCache.storageClassName", "storageClassName applies to the claim the operator makes",
     _vllm(modelCache={"existingClaimName": "mine", "storageClassName": "x"})),
    ("spec.vllm.modelCache.accessModes", "accessModes applies to the claim the operator makes",
     _vllm(modelCache={"existingClaimName": "mine", "accessModes": ["ReadWriteMany"]})),
]


@pytest.mark.parametrize(("path", "words", "edit"), CASES, ids=[f"{c[0]}:{c[1][:30]}" for c in CASES])
def test_each_rule_is_enforced_by_the_models_with_its_message(path: str, words: str, edit: Edit) -> None:
    obj = sample()
    obj["spec"].setdefault("lmcacheServer", {})
    edit(obj["spec"])
    with pytest.raises(ValidationError) as info:
        KVCacheNamespace.model_validate(obj)
    message = validation_message(info.value)
    assert re.search(rf"(^|: |; ){re.escape(path)}: [^;]*{re.escape(words)}", message), message


def _rules(node: dict[str, Any]) -> list[dict[str, str]]:
    out = list(node.get("x-kubernetes-validations", ()))
    for sub in (*node.get("properties", {}).values(), node.get("items"), node.get("additionalProperties")):
        if isinstance(sub, dict):
            out += _rules(sub)
    return out


def test_every_rule_the_models_can_judge_has_a_case() -> None:
    """A new rule without a row above fails here: each one is shown to be enforced. Transition rules
    (oldSelf) are the API server's alone; the map-key rules are pydantic's key types as well
    (tests/unit/test_free_text.py)."""
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    judged = {r["message"] for r in _rules(spec) if "oldSelf" not in r["rule"] and not r["message"].startswith("each key")}
    covered = {m for m in judged if any(words in m for _, words, _ in CASES)}
    assert judged - covered == set()


def test_transition_rules_are_left_to_the_api_server() -> None:
    assert celrules.violations({"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "fixed"}]}, 1, "spec") == []


@pytest.mark.parametrize("name", ["nvme-minimal", "hf-bucket", "tp2-fp8"])
def test_every_rule_evaluates_on_every_sample(name: str) -> None:
    """No rule errors on a real spec (an evaluation error would refuse it, as on the API server)."""
    stored = KVCacheNamespace.model_validate(sample(name)).spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert celrules.violations(spec_schema(), stored, "spec") == []


def test_an_evaluation_error_refuses() -> None:
    assert not celrules.holds("self.missing == 1", {"present": 1})
    assert not celrules.holds("quantity('lots').asApproximateFloat() > 0.0", {})


# Kubernetes' values, from apimachinery's resource.ParseQuantity and AsApproximateFloat64.
@pytest.mark.parametrize(("text", "exact", "approx"), [
    ("0", Decimal(0), 0.0),
    ("500Gi", Decimal(500 * 2**30), 500.0 * 2**30),
    ("1.5Gi", Decimal(3 * 2**29), 1.5 * 2**30),
    ("100m", Decimal("0.1"), 0.1),
    ("1.5", Decimal("1.5"), 1.5),
    ("1e3", Decimal(1000), 1000.0),
    ("1E", Decimal(10**18), 1e18),
    ("12e-3", Decimal("0.012"), 12 * 1e-3),
    (".5", Decimal("0.5"), 0.5),
    ("1.", Decimal(1), 1.0),
    ("0.9n", Decimal("1e-9"), 1e-9),  # finer than nano rounds away from zero
    ("1.0000000001", Decimal("1.000000001"), 1.000000001),
    ("7Ei", Decimal(7 * 2**60), 7.0 * 2**60),
    ("8Ei", Decimal(2**63 - 1), 2.0**63),  # a binary suffix is capped at 2^63 - 1, silently
    ("99999999999999999999Ei", Decimal(2**63 - 1), 2.0**63),
    ("1e30", Decimal(10**30), 1e30),  # a decimal one is not
    ("9223372036854775807", Decimal(2**63 - 1), 2.0**63),
    ("9e99", Decimal("9e99"), 9e99),
])
def test_quantity_is_parsed_as_kubernetes_parses_it(text: str, exact: Decimal, approx: float) -> None:
    assert parse_quantity(text) == exact
    assert as_approximate_float(parse(text)) == approx
    assert celrules.holds(f"quantity('{text}').asApproximateFloat() == {approx!r}", {}) or not math.isfinite(approx)


def test_approximate_float_is_gos_arithmetic_not_the_nearest_double() -> None:
    """0.3 is 3 times Go's Pow10(-1) in Kubernetes, 0.30000000000000004, not the double nearest 0.3;
    5e35 is 5 times Pow10(35), a product of two of Go's table entries."""
    assert as_approximate_float(parse("0.3")) == 0.30000000000000004
    assert as_approximate_float(parse("5e35")) == 4.9999999999999995e35
    assert celrules.holds("quantity('0.3').asApproximateFloat() > 0.3", {})


@pytest.mark.parametrize("text", ["", "lots", "1K", "1e", "--1", "1.2.3", "1Gi5"])
def test_what_is_not_a_quantity(text: str) -> None:
    with pytest.raises(ValueError, match="not a quantity"):
        parse(text)
    assert not celrules.holds(f"quantity('{text}').asApproximateFloat() >= 0.0", {})


def test_the_binding_never_goes_through_a_float() -> None:
    """2^63 - 1 and 2^63 - 2 differ exactly (a float holds neither)."""
    assert parse_quantity("9223372036854775807") - parse_quantity("9223372036854775806") == 1
    assert parse_quantity("1.1") * 3 == Decimal("3.3")


TOKENS = [*sorted(EXTRA_ARGS), "--seed=1", "--enforce-eager=1", "1", "x", "-O3", "--kv-cache-dtype", "fp8", "-", ""]


@settings(max_examples=300, deadline=None, database=None)
@given(args=st.lists(st.sampled_from(TOKENS), max_size=6))
def test_the_extra_args_rules_say_what_extra_args_problem_says(args: list[str]) -> None:
    """extra_args_problem (the contract test's words for a list) and the CRD's two rules agree."""
    schema = spec_schema()["properties"]["vllm"]["properties"]["extraArgs"]
    assert (celrules.violations(schema, args, "extraArgs") == []) == (extra_args_problem(args) is None), args


def _set(spec: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        spec = spec.setdefault(part, {})
    spec[last] = value


@pytest.mark.parametrize(("path", "value", "stored"), [
    ("vllm.replicas", 2.0, 2), ("identity.headSize", 128.0, 128), ("l2.nvme.size", 536870912000.0, 536870912000),
])
def test_an_integral_float_is_the_integer_the_api_server_stores(path: str, value: float, stored: int) -> None:
    """The API server takes 2.0 for an integer (and stores 2): so do the models, no lax coercion else."""
    obj = sample()
    _set(obj["spec"], path, value)
    spec = KVCacheNamespace.model_validate(obj).spec.model_dump(by_alias=True, mode="json")
    *parents, last = path.split(".")
    for part in parents:
        spec = spec[part]
    assert spec[last] == stored and type(spec[last]) is int


@pytest.mark.parametrize(("path", "value"), [
    ("identity.blockSize", True), ("vllm.replicas", True), ("vllm.replicas", "2"), ("l1.size", 32.5), ("l1.size", False),
    ("vllm.service.enabled", 1), ("vllm.replicas", 2.5),
])
def test_what_the_api_server_refuses_for_its_json_type_the_models_refuse(path: str, value: Any) -> None:
    """true for an enum of integers (pydantic's Literal would take it as 1), "2" for an integer, 1
    for a boolean: each one the API server refuses (checked on it by tests/e2e/test_fuzz.py)."""
    obj = sample()
    _set(obj["spec"], path, value)
    with pytest.raises(ValidationError, match=re.escape(f"spec.{path}")):
        KVCacheNamespace.model_validate(obj)
