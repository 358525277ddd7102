"""Hostile values in the spec's quantities and bucket prefixes: refused by the models naming the
field (a ValidationError, which the operator writes as InvalidSpec), never another exception out
of a handler (kopf would retry it forever). 1e309 used to be an OverflowError in parse_quantity.
The same values at `kubectl apply` time: tests/cases/invalid_manifests.py, run by tests/e2e/test_api.py."""

from __future__ import annotations

import copy
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvpersist.api.quantity import MAX_INT64, parse_quantity
from kvpersist.api.spec import BUCKET_HANDLE, QUANTITY
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.all import build_all
from kvpersist.builders.target import Target
from kvpersist.identity import resolve
from tests.cases.invalid_manifests import sample

# Where a quantity goes (path under spec, the sample that has the object holding it).
QUANTITY_FIELDS = [
    (("l2", "nvme", "size"), "nvme-minimal"),
    (("l2", "nvme", "budget"), "nvme-minimal"),
    (("lmcacheServer", "resources", "requests", "memory"), "nvme-minimal"),
    (("vllm", "resources", "limits", "memory"), "nvme-minimal"),
]
HOSTILE = ["1e309", "9e99", "-500Gi", "-1", "99999999999999999999Ei", "1e-309", "+.5Gi", "0x10", "1E+2", "nan", "inf",
           "5e", "1Ei", "8Ei", "9Ei", 2**63, -1]


def with_value(path: tuple[str, ...], base: str, value: object) -> dict:
    obj = copy.deepcopy(sample(base))
    node = obj["spec"]
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return obj


def judged(obj: dict) -> str | None:
    """None when the models accept it (and then the builders render it); the error otherwise.
    Anything but a ValidationError propagates and fails the test."""
    try:
        spec = KVCacheNamespace.model_validate(obj).spec
    except ValidationError as exc:
        return str(exc)
    build_all(Target(obj["metadata"]["name"], "ml", spec, resolve(spec.pins()).namespace_id))
    return None


def names(error: str, path: tuple[str, ...]) -> bool:
    """The error names the field, or is a rule of the object holding it that names it too
    ("spec.l2.nvme.maxCapacity: must fit in the claim: ... or raise size")."""
    field = "spec." + ".".join(path)
    return field in error or ("spec." + ".".join(path[:-1]) in error and re.search(rf"\b{path[-1]}\b", error) is not None)


@pytest.mark.parametrize("value", HOSTILE, ids=[str(v) for v in HOSTILE])
@pytest.mark.parametrize("where", QUANTITY_FIELDS, ids=[".".join(p) for p, _ in QUANTITY_FIELDS])
def test_a_hostile_quantity_is_refused_naming_its_field_or_works(where: tuple[tuple[str, ...], str], value: object) -> None:
    path, base = where
    error = judged(with_value(path, base, value))
    if error is not None:
        assert names(error, path), error
    else:  # accepted: a size the operator can compute with
        assert 0 <= parse_quantity(str(value)) <= MAX_INT64


def test_overflowing_and_negative_sizes_are_refused() -> None:
    for value in ("1e309", "9e99", "-500Gi", "99999999999999999999Ei", 2**63):
        assert judged(with_value(("l2", "nvme", "size"), "nvme-minimal", value)) is not None, value
    assert judged(with_value(("l2", "nvme", "size"), "nvme-minimal", "500Gi")) is None


def test_a_quantity_string_is_never_read_as_a_number() -> None:
    """What the API server's pattern refuses, the models refuse too: pydantic's lax int strips
    whitespace (U+2028 and newlines included) and reads True as 1 (found by tests/unit/test_free_text.py).
    1.0 is not here: the API server reads it as the integer 1, and so do the models (test_cel_rules.py)."""
    for value in ("0\u2028", " 5", "5\n", "\t1", True, 1.5):
        assert judged(with_value(("vllm", "resources", "limits", "memory"), "nvme-minimal", value)) is not None, ascii(value)
        assert judged(with_value(("l2", "nvme", "size"), "nvme-minimal", value)) is not None, ascii(value)
    assert judged(with_value(("vllm", "resources", "limits", "memory"), "nvme-minimal", 5)) is None


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=30), st.from_regex(QUANTITY, fullmatch=True), st.integers()))
def test_any_quantity_text_is_a_refusal_or_a_finite_size(value: object) -> None:
    error = judged(with_value(("l2", "nvme", "size"), "nvme-minimal", value))
    assert error is None or names(error, ("l2", "nvme", "size")), error


@settings(max_examples=300, deadline=None)
@given(st.from_regex(QUANTITY, fullmatch=True))
def test_what_the_schema_admits_parses_to_a_finite_size(value: str) -> None:
    """The pattern is the API server's: whatever it lets through, the operator can compute with
    (no sign, an exponent of two digits at most), so no OverflowError and no inf."""
    assert 0 <= parse_quantity(value) < math.inf


@pytest.mark.parametrize("handle", ["hf://buckets/acme/kv/../other", "hf://buckets/acme/kv/./x", "hf://buckets/acme/kv//x",
                                    "hf://buckets/acme/kv/", "hf://buckets/acme/kv/..", "hf://buckets/acme/kv/.hidden"])
def test_a_bucket_prefix_that_walks_or_is_empty_is_refused(handle: str) -> None:
    assert not re.fullmatch(BUCKET_HANDLE, handle)
    error = judged(with_value(("l2", "hfBucket", "bucketHandle"), "hf-bucket", handle))
    assert error is not None and "spec.l2.hfBucket.bucketHandle" in error, error


@pytest.mark.parametrize("handle", ["hf://buckets/acme/kv", "hf://buckets/acme/kv/team-a/llama_8b", "hf://buckets/a.b/c-d/v1.2"])
def test_a_plain_bucket_prefix_is_accepted(handle: str) -> None:
    assert judged(with_value(("l2", "hfBucket", "bucketHandle"), "hf-bucket", handle)) is None
