"""Compatibility namespaces: the pins that decide whether stored KV may be reused, and their id.

KV computed under one model revision, tokenizer, dtype, geometry, parallelism, connector build,
length limit, chat template, image digest (a tag can move) or L2 key (its fingerprint, never the key)
must never be served under another. So the id hashes them all, and a missing pin yields no id: a
cache that is off is slower, a guessed namespace is wrong.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

NAMESPACE_PREFIX = "kvp-"
# Bump when the meaning of a pin changes, so old and new ids can never collide.
SCHEMA_VERSION = 3  # 2: the image digests and the L2 serde joined the pins; 3: the L2 layout (and the key fingerprint)

# Canonical pin names, in the order people read them. The hash does not depend on this order.
PIN_FIELDS = (
    "model_id",
    "model_revision",
    "tokenizer",
    "tokenizer_revision",
    "kv_cache_dtype",
    "block_size",
    "num_kv_heads",
    "head_size",
    "tensor_parallel_size",
    "connector",
    "connector_build",
    "max_model_len",
    "chat_template_digest",
    "vllm_image_digest",
    "lmcache_server_image_digest",
    "l2_serde",
    "l2_layout",
    "l2_key_fingerprint",
)
# The L2 key's fingerprint, a pin only while L2 is encrypted: an HMAC names the key without revealing
# it, so it may be in status, events and logs (the key never is).
L2_KEY_PIN = "l2_key_fingerprint"
KEY_FINGERPRINT_MESSAGE = b"kvpersist l2 key fingerprint v1"
KEY_FINGERPRINT_RE = re.compile(r"[0-9a-f]{16}")
# Pins taken from what runs: spec.image's digest. Both containers run spec.image (one lmcache
# build); the two pin names stay from when each had its own image, so old ids still match.
IMAGE_PINS = ("vllm_image_digest", "lmcache_server_image_digest")
# The fix for an image named by tag alone (no image of this project is published to pin it to).
IMAGE_FIX = ("spec.image is not pinned by digest: build images/vllm-lmcache, push it and name that image by "
             "digest, as <image>@sha256:<64 hex> (`docker buildx imagetools inspect <image>` prints the digest; "
             "docs/gpu-cluster.md); a tag can move to another build under the same namespace")
IMAGE_DIGEST_RE = re.compile(r"@(sha256:[0-9a-f]{64})$")
INT_PINS = {"block_size", "num_kv_heads", "head_size", "tensor_parallel_size", "max_model_len"}
# Hex digests compare case-insensitively; ids and names are case-sensitive.
LOWERCASE_PINS = {"model_revision", "tokenizer_revision", "chat_template_digest", L2_KEY_PIN, *IMAGE_PINS}


def key_fingerprint(key: bytes) -> str:
    """16 hex of HMAC-SHA256(key, KEY_FINGERPRINT_MESSAGE), over the bytes exactly as the key file holds them."""
    return hmac.new(key, KEY_FINGERPRINT_MESSAGE, hashlib.sha256).hexdigest()[:16]


# L2 serde pins that take no key: none (before every object was framed) and encryption off's checksum frames, the
# same frames under a public key (a checksum bound to the object's name and namespace): a damaged or misplaced
# object is a miss, never wrong bytes, in every mode.
CHECKED_SERDE = "kvpersist-checked/v3"
KEYLESS_SERDES = ("none", CHECKED_SERDE)


def encrypted(pins: Mapping[str, Any]) -> bool:
    """Whether these pins name an encrypting serde, and so need the key's fingerprint."""
    serde = _normalize("l2_serde", pins.get("l2_serde"))
    return serde is not None and serde not in KEYLESS_SERDES


def image_digest(reference: str | None) -> str | None:
    """sha256:<64 hex> of an image reference pinned by digest, else None (a tag names whatever was pushed last)."""
    match = IMAGE_DIGEST_RE.search((reference or "").strip())
    return match.group(1) if match else None


# Pins the operator derives from other fields (never typed in spec.identity).
DERIVED_PINS = {"l2_serde", "l2_layout", L2_KEY_PIN, *IMAGE_PINS}


def field_path(pin: str) -> str:
    """The field a user edits for a pin (chat_template_digest: spec.identity.chatTemplateDigest); a derived
    pin keeps its name (its messages name the field to fix themselves)."""
    if pin in DERIVED_PINS:
        return pin
    if pin == "num_kv_heads":  # the API's one alias that is not plain camelCase
        return "spec.identity.numKVHeads"
    head, *rest = pin.split("_")
    return "spec.identity." + head + "".join(w.capitalize() for w in rest)


@dataclass(frozen=True)
class Resolution:
    """The outcome of resolving pins: an id, or the pins that are missing or malformed."""

    namespace_id: str | None
    missing: tuple[str, ...] = ()
    invalid: tuple[str, ...] = ()
    canonical: dict[str, Any] | None = field(default=None, compare=False)
    # (reason, message): complete pins the operator withholds the cache under anyway (a pin the
    # model's files contradict: kvpersist.controller.pincheck).
    blocked: tuple[str, str] | None = None

    @property
    def code(self) -> str:
        """The condition reason: ImageNotPinned when only an image lacks its digest, L2KeyNotRead when only the
        key's fingerprint is missing (the handlers say why it could not be read), else IdentityIncomplete."""
        if self.blocked is not None:
            return self.blocked[0]
        unpinned = set(self.missing) | set(self.invalid)
        if unpinned == {L2_KEY_PIN}:
            return "L2KeyNotRead"
        rest = unpinned - {L2_KEY_PIN}
        return "ImageNotPinned" if rest and rest <= set(IMAGE_PINS) else "IdentityIncomplete"

    @property
    def reason(self) -> str:
        """What is missing and how to fix it, by the fields a user edits."""
        if self.blocked is not None:
            return self.blocked[1]
        parts = []
        for label, pins, fix in (("missing", self.missing, "set them"), ("malformed", self.invalid, "fix them")):
            if shown := [p for p in pins if p not in IMAGE_PINS and p != L2_KEY_PIN]:
                parts.append(f"{label} pins: " + ", ".join(map(field_path, shown)) + f" ({fix})")
        if any(pin in self.missing or pin in self.invalid for pin in IMAGE_PINS):  # both are spec.image's
            parts.append(IMAGE_FIX)
        if L2_KEY_PIN in self.missing or L2_KEY_PIN in self.invalid:
            parts.append(f"the L2 key (spec.l2.encryption) has not been read ({L2_KEY_PIN}): without it no namespace "
                         "can be named")
        return "; ".join(parts)


def _normalize(name: str, value: Any) -> Any:
    """The canonical form of one pin, or None when it is empty or of the wrong type."""
    if value is None or isinstance(value, bool):
        return None
    if name in INT_PINS:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value.strip())
        return value if isinstance(value, int) and value > 0 else None
    if not isinstance(value, str):
        return None
    text = value.strip().lower() if name in LOWERCASE_PINS else value.strip()  # L2_KEY_PIN is lower-cased
    if not text or (name == L2_KEY_PIN and not KEY_FINGERPRINT_RE.fullmatch(text)):
        return None
    return text


def resolve(pins: Mapping[str, Any]) -> Resolution:
    """Resolves snake_case pins to a namespace id. Unknown keys are ignored, and so is the key
    fingerprint while L2 is not encrypted (plain objects need no key)."""
    canonical: dict[str, Any] = {}
    missing, invalid = [], []
    for name in PIN_FIELDS:
        if name == L2_KEY_PIN and not encrypted(pins):
            continue
        raw = pins.get(name)
        value = _normalize(name, raw)
        if value is None:
            empty = raw is None or (isinstance(raw, str) and not raw.strip())
            (missing if empty else invalid).append(name)
        else:
            canonical[name] = value
    if missing or invalid:
        return Resolution(None, tuple(missing), tuple(invalid))
    document = json.dumps({"v": SCHEMA_VERSION, "pins": canonical}, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True)
    digest = hashlib.sha256(document.encode("ascii")).hexdigest()
    return Resolution(NAMESPACE_PREFIX + digest[:32], canonical=canonical)
