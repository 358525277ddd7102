"""The pydantic models accept every sample and refuse every invalid manifest, naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvpersist.api.v1alpha1 import KVCacheNamespace, parse_quantity, validation_message
from tests.cases.invalid_manifests import CASES, SAMPLES, Case, sample


@pytest.mark.parametrize("name", sorted(p.stem for p in SAMPLES.glob("*.yaml")))
def test_samples_validate(name: str) -> None:
    obj = KVCacheNamespace.model_validate(sample(name))
    assert obj.spec.identity.model_id


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_invalid_manifest_refused_naming_field(case: Case) -> None:
    with pytest.raises(ValidationError) as info:
        KVCacheNamespace.model_validate(case.manifest())
    assert case.field in validation_message(info.value)


def test_defaults_are_the_source_setups() -> None:
    """Eviction at 0.9 a tenth at a time (the source setup), not lmcache's own 0.8 / 0.2."""
    spec = KVCacheNamespace.model_validate(sample()).spec
    assert (spec.eviction.policy, spec.eviction.trigger_watermark, spec.eviction.eviction_ratio) == ("LRU", 0.9, 0.1)
    assert spec.l2.nvme is not None
    assert (spec.l2.nvme.adapter, spec.l2.nvme.backend, spec.l2.nvme.reclaim_policy) == (
        "nixl_store_dynamic", "POSIX", "Retain")
    assert (spec.lmcache_server.port, spec.lmcache_server.http_port) == (5555, 8080)


@pytest.mark.parametrize(
    ("text", "value"),
    [("500Gi", 500 * 2**30), ("1Ti", 2**40), ("10G", 10e9), ("1.5Gi", 1.5 * 2**30), ("1e3", 1000.0), ("128", 128.0)],
)
def test_parse_quantity(text: str, value: float) -> None:
    assert parse_quantity(text) == value


def test_parse_quantity_refuses_garbage() -> None:
    with pytest.raises(ValueError, match="not a quantity"):
        parse_quantity("lots")


def test_isolated_lru_is_refused_saying_why_and_the_fix() -> None:
    obj = sample()
    obj["spec"]["eviction"] = {"policy": "IsolatedLRU"}
    with pytest.raises(ValidationError) as info:
        KVCacheNamespace.model_validate(obj)
    message = validation_message(info.value)
    assert "spec.eviction.policy" in message and "quota" in message and "use policy LRU" in message

