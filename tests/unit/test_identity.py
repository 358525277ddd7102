"""Namespace ids: every pin changes the id, formatting never does, a missing pin gives none."""

from __future__ import annotations

import json

import pytest

from kvpersist.identity import PIN_FIELDS, namespace_id, resolve

BASE = {
    "model_id": "meta-llama/Llama-3.1-8B-Instruct",
    "model_revision": "0e9e39f249a16976918f6564b8830bc894c89659",
    "tokenizer": "meta-llama/Llama-3.1-8B-Instruct",
    "tokenizer_revision": "0e9e39f249a16976918f6564b8830bc894c89659",
    "kv_cache_dtype": "bfloat16",
    "block_size": 16,
    "num_kv_heads": 8,
    "head_size": 128,
    "tensor_parallel_size": 1,
    "connector": "LMCacheMPConnector",
    "connector_build": "vllm-0.33.0+lmcache-0.5.6",
    "max_model_len": 32768,
    "chat_template_digest": "sha256:" + "ab" * 32,
}

# One different value per pin.
CHANGED = {
    "model_id": "meta-llama/Llama-3.1-70B-Instruct",
    "model_revision": "1" * 40,
    "tokenizer": "meta-llama/Llama-3.2-1B",
    "tokenizer_revision": "2" * 40,
    "kv_cache_dtype": "fp8_e4m3",
    "block_size": 32,
    "num_kv_heads": 4,
    "head_size": 64,
    "tensor_parallel_size": 2,
    "connector": "LMCacheConnectorV1",
    "connector_build": "vllm-0.33.1+lmcache-0.5.6",
    "max_model_len": 65536,
    "chat_template_digest": "sha256:" + "cd" * 32,
}


def test_table_covers_every_pin() -> None:
    assert set(CHANGED) == set(PIN_FIELDS) == set(BASE)


def test_id_shape_and_stability() -> None:
    nid = namespace_id(BASE)
    assert nid is not None and nid.startswith("kvp-") and len(nid) == 36
    int(nid[4:], 16)
    # Pinned value: the id is a storage contract, so a change to hashing must be deliberate.
    assert nid == "kvp-155cec36d4bd8a6654f45519895d0ad4"


@pytest.mark.parametrize("pin", PIN_FIELDS)
def test_each_pin_changes_id(pin: str) -> None:
    assert namespace_id({**BASE, pin: CHANGED[pin]}) != namespace_id(BASE)


def test_all_changed_ids_distinct() -> None:
    ids = {namespace_id({**BASE, pin: CHANGED[pin]}) for pin in PIN_FIELDS} | {namespace_id(BASE)}
    assert len(ids) == len(PIN_FIELDS) + 1


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(dict(reversed(list(BASE.items()))), id="reordered"),
        pytest.param(json.loads(json.dumps(BASE, indent=4)), id="reformatted-json"),
        pytest.param({**BASE, "model_id": "  meta-llama/Llama-3.1-8B-Instruct "}, id="whitespace"),
        pytest.param({**BASE, "model_revision": BASE["model_revision"].upper()}, id="hex-uppercase"),
        pytest.param({**BASE, "block_size": "16"}, id="int-as-string"),
        pytest.param({**BASE, "unrelated": "ignored"}, id="extra-key"),
    ],
)
def test_formatting_keeps_id(variant: dict) -> None:
    assert namespace_id(variant) == namespace_id(BASE)


@pytest.mark.parametrize("pin", PIN_FIELDS)
def test_missing_pin_gives_no_id(pin: str) -> None:
    pins = {k: v for k, v in BASE.items() if k != pin}
    res = resolve(pins)
    assert res.namespace_id is None
    assert res.missing == (pin,)
    assert pin in res.reason


@pytest.mark.parametrize("pin", PIN_FIELDS)
@pytest.mark.parametrize("empty", ["", "   ", None])
def test_empty_pin_gives_no_id(pin: str, empty: object) -> None:
    assert namespace_id({**BASE, pin: empty}) is None


@pytest.mark.parametrize(("pin", "bad"), [("block_size", True), ("block_size", 0), ("head_size", -1),
                                          ("model_id", 7), ("max_model_len", "lots")])
def test_malformed_pin_gives_no_id(pin: str, bad: object) -> None:
    res = resolve({**BASE, pin: bad})
    assert res.namespace_id is None and res.invalid == (pin,)
