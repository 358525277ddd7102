"""The smaller API keeps every namespace id: an unchanged deployment, written in the old form or the
new, hashes to the id it had (docs/upgrading.md, "One image, fewer fields").

tests/cases/before_one_image/ holds config/samples as they were before spec.image; OLD_IDS are the
ids the operator of that time computed for them (KVCacheNamespaceSpec.pins with the key fingerprint
below, kvpersist.identity.namespace_id), written down then: if pins() or the hash moved, these fail.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from kvpersist import identity
from kvpersist.api import v1alpha1 as api
from kvpersist.api.convert import OLD_DEFAULT_ADAPTER, ConvertError, convert_object, convert_spec, gib_quantity
from kvpersist.api.spec import KVCacheNamespaceSpec

ROOT = Path(__file__).resolve().parents[2]
BEFORE = ROOT / "tests" / "cases" / "before_one_image"
FINGERPRINT = "0123456789abcdef"
OLD_IDS = {
    "nvme-minimal": "kvp-549f072e5268607d27be57357001e2f1",
    "hf-bucket": "kvp-ed443c2b64716c23ea10ffbb9142e26a",
    "tp2-fp8": "kvp-28e7bdb4bbf5923bf87b96614f65d2f5",
}


def _id(spec: dict) -> str | None:
    return identity.resolve(KVCacheNamespaceSpec.model_validate(spec).pins(FINGERPRINT)).namespace_id


def _doc(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("sample", sorted(OLD_IDS))
def test_an_old_manifest_converted_keeps_its_id(sample: str) -> None:
    old = _doc(BEFORE / f"{sample}.yaml")
    with pytest.raises(ValidationError):  # the old form is refused as it is: its fields are gone
        KVCacheNamespaceSpec.model_validate(old["spec"])
    converted, notes = convert_object(old)
    assert "spec.vllm.image and spec.lmcacheServer.image -> spec.image" in notes
    assert _id(converted["spec"]) == OLD_IDS[sample]


def _old_default(spec: dict) -> dict:
    """spec with the adapter the API defaulted to before fs_native (an existing resource has it stored)."""
    if "nvme" in spec["l2"]:
        spec["l2"]["nvme"].setdefault("adapter", OLD_DEFAULT_ADAPTER)
    return spec


@pytest.mark.parametrize("sample", sorted(OLD_IDS))
def test_todays_sample_has_the_id_the_old_one_had(sample: str) -> None:
    """With the adapter it had (the API stored its default then, so a resource keeps it); named no
    adapter today, an NVMe sample is fs_native: another layout, another namespace."""
    spec = _doc(ROOT / "config" / "samples" / f"{sample}.yaml")["spec"]
    assert _id(_old_default(copy.deepcopy(spec))) == OLD_IDS[sample]
    if "nvme" in spec["l2"]:
        assert _id(spec) != OLD_IDS[sample]


def test_the_tokenizer_defaults_to_the_models_own_at_its_revision() -> None:
    spec = _old_default(_doc(ROOT / "config" / "samples" / "nvme-minimal.yaml")["spec"])
    assert "tokenizer" not in spec["identity"]
    explicit = copy.deepcopy(spec)
    explicit["identity"]["tokenizer"] = spec["identity"]["modelId"]
    explicit["identity"]["tokenizerRevision"] = spec["identity"]["modelRevision"]
    assert _id(spec) == _id(explicit) == OLD_IDS["nvme-minimal"]
    # Another tokenizer without its revision is a missing pin, not the model's revision.
    other = copy.deepcopy(spec)
    other["identity"]["tokenizer"] = "other-org/other-tokenizer"
    assert _id(other) is None
    # The model's tokenizer at another revision is another namespace.
    moved = copy.deepcopy(spec)
    moved["identity"]["tokenizerRevision"] = "f" * 40
    assert _id(moved) not in (None, OLD_IDS["nvme-minimal"])


def test_vllm_is_given_the_tokenizer_the_id_hashes() -> None:
    from kvpersist.builders.vllm import vllm_args
    from tests.unit.test_builders import target

    args = vllm_args(target("nvme-minimal"))
    ident = _doc(ROOT / "config" / "samples" / "nvme-minimal.yaml")["spec"]["identity"]
    assert args[args.index("--tokenizer") + 1] == ident["modelId"]
    assert args[args.index("--tokenizer-revision") + 1] == ident["modelRevision"]


def test_two_different_images_are_not_converted() -> None:
    old = _doc(BEFORE / "nvme-minimal.yaml")
    old["spec"]["lmcacheServer"]["image"] = old["spec"]["vllm"]["image"].replace("0123", "4567")
    with pytest.raises(ConvertError, match="different images"):
        convert_object(old)


def test_a_stored_object_the_api_server_pruned_says_what_to_set() -> None:
    """What the operator reads of an old object after the CRD upgrade: the removed fields pruned."""
    old = _doc(BEFORE / "nvme-minimal.yaml")["spec"]
    del old["vllm"]["image"], old["lmcacheServer"], old["identity"]["connector"]
    with pytest.raises(ValidationError) as err:
        KVCacheNamespaceSpec.model_validate(old)
    assert "spec.image is required" in api.validation_message(err.value)
    assert "docs/upgrading.md" in api.validation_message(err.value)


@pytest.mark.parametrize(("gib", "quantity"), [(32, "32Gi"), (0.25, "256Mi"), (0.5, "512Mi"), (1.5, "1536Mi"),
                                               (2000, "2000Gi"), (1e-06, "1074")])
def test_sizes_in_gib_become_the_same_bytes(gib: float, quantity: str) -> None:
    from kvpersist.api.quantity import parse_quantity

    assert gib_quantity(gib, "f") == quantity
    assert abs(parse_quantity(quantity) - round(__import__("decimal").Decimal(str(gib)) * 1024**3)) < 1


def test_what_went_is_converted_and_said() -> None:
    old = _doc(BEFORE / "tp2-fp8.yaml")["spec"]
    old["lmcacheServer"]["httpPort"] = 9000
    old["eviction"]["policy"] = "IsolatedLRU"
    old["l2"]["nvme"]["backend"] = "POSIX"
    new, notes = convert_spec(old)
    assert new["l1"] == {"size": "64Gi"} and new["l2"]["nvme"]["maxCapacity"] == "900Gi"
    assert new["eviction"]["policy"] == "LRU" and "lmcacheServer" not in new
    assert "connector" not in new["identity"]
    assert any("httpPort 9000" in n for n in notes) and any("IsolatedLRU" in n for n in notes)
    assert "backend" not in new["l2"]["nvme"] and any("backend POSIX" in n for n in notes)
    KVCacheNamespaceSpec.model_validate(new)
