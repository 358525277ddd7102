"""Condition and event messages name fields as the API spells them (spec.identity.modelRevision),
never by the Python names of the models (model_revision), which a user cannot find in the CRD.

The messages are produced here for a set of failing specs through the pure functions the status is
made of: identity resolution, the operator's own reading of a spec (validation_message), the
conditions of compute_status, the image and Secret policies. Each is scanned for the snake_case
name of any field of the API models."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from pydantic import BaseModel, ValidationError

from kvpersist.api import v1alpha1 as api
from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.api.statusmodels import KVCacheNamespaceStatus
from kvpersist.controller.policy import image_refusal, secret_refusal
from kvpersist.identity import PIN_FIELDS, resolve
from kvpersist.status.conditions import Observation, compute_status
from tests.cases.invalid_manifests import CASES, sample


def _models(root: type[BaseModel]) -> Iterator[type[BaseModel]]:
    seen: set[type] = set()
    todo = [root]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        yield model
        for info in model.model_fields.values():
            todo += [t for t in _types(info.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]


def _types(annotation) -> Iterator:
    yield annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        yield from _types(arg)


SNAKE_FIELDS = sorted({name for root in (KVCacheNamespaceSpec, KVCacheNamespaceStatus) for m in _models(root)
                       for name in m.model_fields if "_" in name})
SNAKE = re.compile(r"(?<![-\w])(" + "|".join(map(re.escape, SNAKE_FIELDS)) + r")\b")


def test_the_scan_knows_the_names_it_looks_for() -> None:
    assert {"model_revision", "kv_cache_dtype", "existing_claim_name", "chat_template_digest",
            "token_secret_ref", "metadata_cache_ttl_seconds"} <= set(SNAKE_FIELDS)
    assert SNAKE.search("missing pins: model_revision") and not SNAKE.search("spec.identity.modelRevision")


def _spec(mutate=None) -> KVCacheNamespaceSpec:
    obj = sample()
    if mutate:
        mutate(obj)
    return api.KVCacheNamespace.model_validate(obj).spec


def _messages() -> Iterator[tuple[str, str]]:
    spec = _spec()
    pins = spec.pins("0" * 16)
    for pin in PIN_FIELDS:  # each pin missing, then malformed
        yield f"missing {pin}", resolve({k: v for k, v in pins.items() if k != pin}).reason
        malformed = resolve({**pins, pin: -1}).reason  # where a pin has a form (a number, a digest)
        if malformed:
            yield f"malformed {pin}", malformed
    yield "all missing", resolve({}).reason
    for case in CASES:  # what the operator says of a spec the CRD was bypassed for
        try:
            api.KVCacheNamespace.model_validate(case.manifest())
        except ValidationError as exc:
            yield f"invalid {case.id}", api.validation_message(exc)
    res = resolve({k: v for k, v in pins.items() if k not in ("model_revision", "kv_cache_dtype")})
    for name, obs in {
        "cache off": Observation(3, None, res.reason, "nvme", 0, 1, identity_code=res.code),
        "claim missing": Observation(3, "kvp-" + "0" * 32, "", "nvme", 1, 1, existing_claim="kv-data"),
        "claims pending": Observation(3, "kvp-" + "0" * 32, "", "nvme", 1, 1,
                                      claims=[{"metadata": {"name": "c"}, "status": {"phase": "Pending"}}]),
    }.items():
        _, conds = compute_status(obs)
        yield from ((f"{name}: {c['type']}", c["message"]) for c in conds)
    refusal = image_refusal(spec, ("mirror.example.org/",))  # the samples' image is under registry.example.com
    assert refusal is not None
    yield "image refused", refusal[1]
    yield "secret refused", secret_refusal("spec.l2.encryption.keySecretRef", "k", "ml", None, ("a", "b"))[1]


MESSAGES = list(_messages())


def test_the_failing_specs_produce_messages() -> None:
    assert len(MESSAGES) > 40 and all(text for _, text in MESSAGES)


@pytest.mark.parametrize(("what", "message"), MESSAGES, ids=[w for w, _ in MESSAGES])
def test_messages_name_fields_in_camel_case(what: str, message: str) -> None:
    found = SNAKE.findall(message)
    assert not found, f"{what}: {found} in {message!r}"
