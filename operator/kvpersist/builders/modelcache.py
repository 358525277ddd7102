"""The claim the operator makes for the model's weights (spec.vllm.modelCache.size).

Owned by the resource, so deleted with it: weights can be downloaded again, unlike L2's KV. Made once
and never patched (kvpersist.controller.apply): most of a claim's spec is immutable, so a later change
of size, class or access modes is reported, not applied.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from kvpersist.api.quantity import parse_quantity
from kvpersist.builders.target import MODEL_CACHE, Target, manifest

DEFAULT_ACCESS_MODES = ("ReadWriteOnce",)


def build_model_cache_claim(target: Target) -> dict[str, Any] | None:
    """PersistentVolumeClaim `<name>-model-cache`, or None when the user names their own claim
    (or there is no model cache). No namespace id label: the weights serve every id."""
    cache = target.spec.vllm.model_cache
    if cache is None or cache.size is None:
        return None
    return manifest("v1", "PersistentVolumeClaim", target.metadata(target.model_cache_claim, MODEL_CACHE, per_id=False),
                    claim_spec(list(cache.access_modes or DEFAULT_ACCESS_MODES), cache.size, cache.storage_class_name))


def claim_spec(access_modes: list[str], size: Any, storage_class: str | None) -> dict[str, Any]:
    """A claim's spec; without storage_class, the cluster's default StorageClass (no key)."""
    spec: dict[str, Any] = {"accessModes": access_modes, "resources": {"requests": {"storage": str(size)}}}
    if storage_class is not None:
        spec["storageClassName"] = storage_class
    return spec


def claim_differences(manifest: dict[str, Any], existing: dict[str, Any]) -> list[str]:
    """What spec.vllm.modelCache declares that the existing claim (made once, kept as is) lacks, by field."""
    want, have = manifest["spec"], existing.get("spec") or {}
    out = []
    wanted_size = want["resources"]["requests"]["storage"]
    had_size = ((have.get("resources") or {}).get("requests") or {}).get("storage")
    if _quantity(wanted_size) != _quantity(had_size):
        out.append(f"spec.vllm.modelCache.size is {wanted_size}, the claim's {had_size}")
    if "storageClassName" in want and want["storageClassName"] != have.get("storageClassName"):
        out.append(f"spec.vllm.modelCache.storageClassName is {want['storageClassName']}, the claim's "
                   f"{have.get('storageClassName')}")
    if sorted(want["accessModes"]) != sorted(have.get("accessModes") or []):
        out.append(f"spec.vllm.modelCache.accessModes is {want['accessModes']}, the claim's {have.get('accessModes')}")
    return out


def _quantity(value: Any) -> Decimal | None:
    try:
        return parse_quantity(value) if value is not None else None
    except ValueError:
        return None
