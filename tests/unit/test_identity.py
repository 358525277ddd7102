"""Namespace ids: every pin changes the id, formatting never does, a missing pin gives none."""

from __future__ import annotations

import copy
import json

import pytest

from kvpersist.identity import (
    DERIVED_PINS,
    IMAGE_PINS,
    L2_KEY_PIN,
    PIN_FIELDS,
    field_path,
    image_digest,
    key_fingerprint,
    resolve,
)

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
    "vllm_image_digest": "sha256:" + "1a" * 32,
    "lmcache_server_image_digest": "sha256:" + "2b" * 32,
    "l2_serde": "aesgcm-256",
    "l2_layout": "nixl_store_dynamic",
    "l2_key_fingerprint": "0123456789abcdef",
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
    "vllm_image_digest": "sha256:" + "3c" * 32,
    "lmcache_server_image_digest": "sha256:" + "4d" * 32,
    "l2_serde": "none",
    "l2_layout": "fs",
    "l2_key_fingerprint": "fedcba9876543210",
}


def test_table_covers_every_pin() -> None:
    assert set(CHANGED) == set(PIN_FIELDS) == set(BASE)


def test_id_shape_and_stability() -> None:
    nid = resolve(BASE).namespace_id
    assert nid is not None and nid.startswith("kvp-") and len(nid) == 36
    int(nid[4:], 16)
    # Pinned value: the id is a storage contract, so a change to hashing must be deliberate (schema 2: images and serde
    # joined; 3: the L2 layout and the L2 key's fingerprint).
    assert nid == "kvp-d62351ce81b6c166f0cd3c1be0f121d7"


@pytest.mark.parametrize("pin", PIN_FIELDS)
def test_each_pin_changes_id(pin: str) -> None:
    assert resolve({**BASE, pin: CHANGED[pin]}).namespace_id != resolve(BASE).namespace_id


def test_all_changed_ids_distinct() -> None:
    ids = {resolve({**BASE, pin: CHANGED[pin]}).namespace_id for pin in PIN_FIELDS} | {resolve(BASE).namespace_id}
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
    assert resolve(variant).namespace_id == resolve(BASE).namespace_id


@pytest.mark.parametrize("pin", PIN_FIELDS)
def test_missing_pin_gives_no_id(pin: str) -> None:
    pins = {k: v for k, v in BASE.items() if k != pin}
    res = resolve(pins)
    assert res.namespace_id is None
    assert res.missing == (pin,)
    assert ("spec.image" if pin in IMAGE_PINS else field_path(pin)) in res.reason
    assert res.code == ("ImageNotPinned" if pin in IMAGE_PINS else "L2KeyNotRead" if pin == L2_KEY_PIN else
                        "IdentityIncomplete")


@pytest.mark.parametrize("pin", PIN_FIELDS)
@pytest.mark.parametrize("empty", ["", "   ", None])
def test_empty_pin_gives_no_id(pin: str, empty: object) -> None:
    assert resolve({**BASE, pin: empty}).namespace_id is None


@pytest.mark.parametrize(("pin", "bad"), [("block_size", True), ("block_size", 0), ("head_size", -1),
                                          ("model_id", 7), ("max_model_len", "lots")])
def test_malformed_pin_gives_no_id(pin: str, bad: object) -> None:
    res = resolve({**BASE, pin: bad})
    assert res.namespace_id is None and res.invalid == (pin,)


# ---------------------------------------------------------------- what runs: the image digests

DIGEST = "sha256:" + "5e" * 32


@pytest.mark.parametrize(("reference", "digest"), [
    ("vllm/vllm-openai:v0.33.0@" + DIGEST, DIGEST),
    ("registry.local:5000/mirror/vllm@" + DIGEST, DIGEST),
    ("vllm/vllm-openai:v0.33.0", None),  # a tag moves
    ("vllm/vllm-openai", None),
    ("vllm/vllm-openai@sha256:" + "5e" * 31, None),  # short
    ("vllm/vllm-openai@sha256:" + "5E" * 32, None),  # registries print lowercase; anything else is not a digest
    ("vllm/vllm-openai@sha512:" + "5e" * 64, None),
    ("", None),
    (None, None),
])
def test_image_digest(reference: str | None, digest: str | None) -> None:
    assert image_digest(reference) == digest


def _spec(image: str | None = None):
    from kvpersist.api.v1alpha1 import KVCacheNamespace
    from tests.cases.invalid_manifests import sample

    obj = sample()
    obj["spec"]["image"] = image or obj["spec"]["image"]
    return KVCacheNamespace.model_validate(obj).spec


FP = key_fingerprint(b"k" * 32)  # the L2 key's pin (spec.l2.encryption is on in the sample)


def test_sample_images_are_pinned_and_in_the_id() -> None:
    spec = _spec()
    pins = spec.pins(FP)
    # One image, under both pins it had when each container named its own (ids stay the same).
    assert pins["vllm_image_digest"] == pins["lmcache_server_image_digest"] == image_digest(spec.image) is not None
    assert resolve(pins).namespace_id is not None


def test_a_changed_image_is_a_new_namespace() -> None:
    """The same pins with another build never share stored KV."""
    base = resolve(_spec().pins(FP)).namespace_id
    other = resolve(_spec("example.org/other@" + DIGEST).pins(FP)).namespace_id
    assert other is not None and other != base


def test_switching_the_l2_adapter_is_a_new_namespace_and_folder() -> None:
    """fs and nixl_store_dynamic name their files otherwise (*.data, *.bin) and the agent trims only
    nixl's: one folder under both would let the trim count files it cannot delete and remove live
    chunks. The layout is a pin, so a switch is a new id, hence a new folder (l2backends.nvme.l2_path)."""
    from kvpersist.api.spec import l2_layout
    from kvpersist.api.v1alpha1 import KVCacheNamespace
    from kvpersist.builders.target import Target
    from kvpersist.l2backends.nvme import l2_path
    from tests.cases.invalid_manifests import sample

    def target(obj: dict) -> Target:
        obj["spec"]["l2"]["encryption"] = {"enabled": False}  # the layout alone, no key to read
        spec = KVCacheNamespace.model_validate(obj).spec
        return Target("r", "ns", spec, resolve(spec.pins()).namespace_id)

    nixl = sample()
    nixl["spec"]["l2"]["nvme"]["adapter"] = "nixl_store_dynamic"
    fs = sample()
    fs["spec"]["l2"]["nvme"]["adapter"] = "fs"
    layouts = [l2_layout(KVCacheNamespace.model_validate(o).spec) for o in (nixl, fs, sample(), sample("hf-bucket"))]
    assert layouts[0].startswith("nixl_store_dynamic") and layouts[1:] == ["fs", "fs_native/direct_io=true", "hfbucket"]
    a, b = target(nixl), target(fs)
    assert a.namespace_id and b.namespace_id and a.namespace_id != b.namespace_id
    assert l2_path(a) != l2_path(b)
    # Nothing else of the NVMe settings that keeps the files readable moves the id.
    direct = copy.deepcopy(nixl)
    direct["spec"]["l2"]["nvme"].update(directIO=False, maxCapacity="100Gi")  # (true is the default)
    assert target(direct).namespace_id == a.namespace_id
    # fs_native's files are whole 4 KiB pages with direct I/O: a file written without it is shorter
    # than such a read (a miss), so there directIO is the layout too.
    native, buffered = sample(), sample()
    buffered["spec"]["l2"]["nvme"]["directIO"] = False
    assert target(native).namespace_id != target(buffered).namespace_id


def test_the_same_bytes_under_another_name_keep_the_namespace() -> None:
    """A mirror serving the same digest runs the same build: the id follows the bytes, not the name."""
    spec = _spec()
    mirrored = _spec("mirror.local/vllm@" + image_digest(spec.image))
    assert resolve(mirrored.pins(FP)).namespace_id == resolve(spec.pins(FP)).namespace_id


def test_a_tag_alone_turns_the_cache_off_and_says_how_to_pin() -> None:
    res = resolve(_spec("vllm/vllm-openai:v0.33.0").pins(FP))
    assert res.namespace_id is None and res.code == "ImageNotPinned"
    assert res.reason.startswith("spec.image is not pinned by digest"), res.reason
    assert "@sha256:" in res.reason and "images/vllm-lmcache" in res.reason
    assert "spec.identity" not in res.reason  # the identity pins are all there; only the image is the fix


def test_a_manifest_without_an_image_is_refused_naming_spec_image() -> None:
    """No default image (no image of kvpersist is published to default to): spec.image is required,
    and the message names it and the fix."""
    from pydantic import ValidationError

    from kvpersist.api.v1alpha1 import KVCacheNamespace, validation_message
    from tests.cases.invalid_manifests import sample

    obj = sample()
    del obj["spec"]["image"]
    with pytest.raises(ValidationError) as err:
        KVCacheNamespace.model_validate(obj)
    assert "spec.image is required" in validation_message(err.value) and "@sha256:" in validation_message(err.value)


def test_every_identity_field_is_hashed_and_launched_or_says_why_not() -> None:
    """One table: a field added to spec.identity that is left out of the hash, or out of vLLM's
    command line without a reason here, fails this test."""
    from kvpersist.api.identity import Identity
    from kvpersist.builders.vllm import PIN_FLAGS

    fields = set(Identity.model_fields)
    assert fields <= set(PIN_FIELDS), f"not hashed: {fields - set(PIN_FIELDS)}"
    assert set(PIN_FIELDS) - fields == {"connector", *DERIVED_PINS}  # the connector: one value, not a field
    # Pins vLLM takes no flag for: checked against the model (geometry), carried by the
    # connector config, or only describing what the user renders (the chat template).
    not_flags = {"model_id": "the positional model argument", "num_kv_heads": "the model's config",
                 "head_size": "the model's config",
                 "connector_build": "the image (its digest is hashed too)",
                 "chat_template_digest": "the client renders the template"}
    flagged = {attr for attr, _flag in PIN_FLAGS}
    assert fields == flagged | set(not_flags), f"neither launched nor explained: {fields - flagged - set(not_flags)}"
    assert not flagged & set(not_flags)
