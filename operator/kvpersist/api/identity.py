"""spec.identity, the pins that decide whether stored KV may be reused, and id_fields, every spec field the
namespace id depends on (the pin-change warning, `kvpersist plan` and status.attach's pins read it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from kvpersist.api.models import SpecPart
from kvpersist.identity import field_path as pin_field  # the API's spelling of a pin's field (builders.vllm's status.attach too)
from kvpersist.identity import image_digest

# vLLM 0.33.0's --kv-cache-dtype values less the two unresolved ones, auto and fp8 (tests/contract checks it against vLLM's).
KV_CACHE_DTYPES = (
    "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
    "octave_k3v4", "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit",
    "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6",
)
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
# The one vLLM connector the operator wires (builders.vllm): a pin of every namespace id, not a field.
CONNECTOR = "LMCacheMPConnector"
# On every pod of a namespace id, the operator's and attached ones (kvpersist.api.attachpolicy): what routes select by.
NAMESPACE_ID_LABEL = "kvpersist.dev/namespace-id"

HEX40 = r"^[0-9a-f]{40}$"
SHA256_DIGEST = r"^sha256:[0-9a-f]{64}$"
HF_REPO_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$"


class Identity(SpecPart):
    """The pins that decide whether a stored KV block may be reused; their hash is the namespace kvp-<32 hex>.
    modelId and modelRevision are enough: the operator fills the rest from the model's files, vLLM's defaults and
    spec.image's digest (status.identity), cache off until then (PinsUnresolved); a pin written is checked."""

    model_id: str = Field(
        min_length=1, max_length=256, pattern=HF_REPO_ID,
        description="Hugging Face model id served by vLLM, e.g. Qwen/Qwen3-8B.",
    )
    model_revision: str | None = Field(
        None, pattern=HEX40,
        description="Full 40-character commit SHA of the model repository; branch names and tags move, SHAs do not.",
    )
    tokenizer: str | None = Field(
        None, min_length=1, max_length=256, pattern=HF_REPO_ID,
        description="Hugging Face id of the tokenizer repository. Unset: the model's own (modelId), as vLLM does.",
    )
    tokenizer_revision: str | None = Field(
        None, pattern=HEX40, description="Full 40-character commit SHA of the tokenizer repository. Unset: "
        "modelRevision when the tokenizer is the model's own; another tokenizer needs its own revision (else no cache).",
    )
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] | None = Field(  # type: ignore[valid-type]
        None,
        description="Resolved KV cache dtype passed to vLLM as --kv-cache-dtype. 'auto' and 'fp8' are refused: "
        "they resolve differently per model or platform, so they cannot identify stored KV. Unset: the config's "
        "float16 or bfloat16 dtype, what 'auto' resolves to.",
    )
    block_size: Literal[BLOCK_SIZES] | None = Field(  # type: ignore[valid-type]
        None, description="vLLM KV block size in tokens (--block-size). Unset: 16, vLLM's default (an MLA model's "
        "must be written).",
    )
    num_kv_heads: int | None = Field(
        None, ge=1, le=1024, alias="numKVHeads",
        description="Number of KV heads of the model. Unset: its config's num_key_value_heads.",
    )
    head_size: int | None = Field(None, ge=1, le=4096, description="Attention head size of the model. Unset: from "
                                  "its config.")
    tensor_parallel_size: int | None = Field(
        None, ge=1, le=64, description="vLLM tensor-parallel size (--tensor-parallel-size); KV is sharded by it. Unset: 1.",
    )
    connector_build: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+:@/=-]*$",
        description="Pinned identity of the connector and vLLM build, e.g. vllm-0.33.0+lmcache-0.5.6 or an image "
        "digest; KV layouts may change between builds. Unset: spec.image's digest.",
    )
    max_model_len: int | None = Field(
        None, ge=1, le=16_777_216, description="Maximum model length in tokens (--max-model-len). Unset: the config's "
        "max_position_embeddings.",
    )
    chat_template_digest: str | None = Field(
        None, pattern=SHA256_DIGEST,
        description="sha256 of the chat template's text as the tokenizer's files at tokenizerRevision carry it, as "
        "sha256:<64 hex>; another template gives other tokens. Unset: from those files.",
    )

    def resolved(self) -> dict[str, Any]:
        """The pins as they reach vLLM and the namespace id: an unset tokenizer is the model's own at its
        revision (what vLLM loads without --tokenizer), plus the one connector the operator wires."""
        pins = self.model_dump()
        if pins["tokenizer"] is None:
            pins["tokenizer"] = self.model_id
        if pins["tokenizer_revision"] is None and pins["tokenizer"] == self.model_id:
            pins["tokenizer_revision"] = self.model_revision
        pins["connector"] = CONNECTOR
        return pins


@dataclass(frozen=True)
class IdField:
    """A spec field the namespace id depends on (through pins()), as the API spells it. kind: `value`, the field;
    `digest`, only an image's @sha256:<64 hex>; `key`, it names the Secret whose key's fingerprint is a pin (another
    Secret with the same bytes keeps the id); `fs_native`, the field only while the adapter is fs_native (l2_layout)."""

    path: str
    kind: Literal["value", "digest", "key", "fs_native"] = "value"


# The adapter: an fs_native-only field is a change of its own only while the adapter stayed.
ADAPTER_FIELD = IdField("spec.l2.nvme.adapter")


def id_fields() -> tuple[IdField, ...]:
    """Every spec field that moves the namespace id (the L2 kind too reaches l2_layout, but the CRD refuses to change
    it): the one list the pin-change warning and `kvpersist plan` compare; tests/unit/test_id_fields.py checks it."""
    identity = tuple(IdField(pin_field(name)) for name in Identity.model_fields)
    return (*identity, IdField("spec.image", "digest"),
            IdField("spec.l2.encryption.enabled"), IdField("spec.l2.encryption.keySecretRef.name", "key"),
            IdField("spec.l2.encryption.keySecretRef.key", "key"), ADAPTER_FIELD,
            IdField("spec.l2.nvme.directIO", "fs_native"))


def id_field_value(spec: Mapping[str, Any], field: IdField) -> Any:
    """The field's value as the id sees it, in a spec as the API stores it (camelCase, defaults
    applied): None when unset, an image's digest alone (None without one)."""
    node: Any = spec
    for part in field.path.split(".")[1:]:
        node = node.get(part) if isinstance(node, Mapping) else None
    if field.kind == "digest":
        return image_digest(node) if isinstance(node, str) else None
    if field.kind == "fs_native" and id_field_value(spec, ADAPTER_FIELD) != "fs_native":
        return None
    return node


def changed_id_fields(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The id_fields paths whose value differs between two specs as stored (an fs_native-only field
    not when the adapter itself changed: that is the adapter's change)."""
    moved = id_field_value(old, ADAPTER_FIELD) != id_field_value(new, ADAPTER_FIELD)
    return [f.path for f in id_fields()
            if id_field_value(old, f) != id_field_value(new, f) and not (f.kind == "fs_native" and moved)]
