"""An old v1alpha1 spec in today's form, with the same namespace id (`kvpersist convert`): the API server prunes the
fields that went (docs/upgrading.md) from a stored object, so a manifest is converted where its author keeps it."""

from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any

from kvpersist.api.identity import CONNECTOR
from kvpersist.api.spec import IMAGE_REQUIRED, L2_KINDS


class ConvertError(ValueError):
    """A spec that cannot be converted without changing what it means; the message says why."""


def gib_quantity(value: Any, field: str) -> str:
    """A size in GiB (a JSON number) as the quantity naming the same bytes: 32 -> 32Gi, 0.25 -> 256Mi."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConvertError(f"{field}: {value!r} is not a number of GiB")
    exact = Decimal(str(value))
    for unit, scale in (("Gi", 1), ("Mi", 1024), ("Ki", 1024**2)):
        amount = exact * scale
        if amount == amount.to_integral_value():
            return f"{int(amount)}{unit}"
    return f"{int((exact * 1024**3).to_integral_value())}"  # bytes, to the nearest


# spec.l2.nvme.adapter's default before fs_native: an old manifest names it to keep its id.
OLD_DEFAULT_ADAPTER = "nixl_store_dynamic"


def convert_spec(spec: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the spec in today's form, what changed in words). Raises ConvertError where the old spec
    named two images (no one image keeps its id) or a connector other than the one there is."""
    out = copy.deepcopy(spec)
    notes: list[str] = []
    vllm, server = out.get("vllm") or {}, out.get("lmcacheServer") or {}
    images = {k: v for k, v in (("spec.vllm.image", vllm.pop("image", None)),
                                ("spec.lmcacheServer.image", server.pop("image", None))) if v is not None}
    if images and "image" not in out:
        if len(set(images.values())) > 1:
            raise ConvertError("spec.vllm.image and spec.lmcacheServer.image name different images: vLLM and the "
                               "lmcache server must run one build; pick it and set spec.image (the namespace id moves "
                               "unless its digest is the one both had)")
        out = {"image": next(iter(images.values())), **out}
        notes.append(f"{' and '.join(images)} -> spec.image")
    elif images:
        notes.append(f"dropped {' and '.join(images)} (spec.image is set)")
    if "image" not in out:
        raise ConvertError(IMAGE_REQUIRED)
    identity = out.get("identity") or {}
    if "connector" in identity:
        if identity.pop("connector") != CONNECTOR:
            raise ConvertError(f"identity.connector: only {CONNECTOR} was ever accepted")
        notes.append(f"dropped identity.connector (always {CONNECTOR})")
    if "httpPort" in server:
        notes.append(f"dropped lmcacheServer.httpPort {server.pop('httpPort')} (lmcache's admin port is on the pod's "
                     "loopback; the operator picks it)")
    l1 = out.get("l1") or {}
    if "sizeGB" in l1:
        l1["size"] = gib_quantity(l1.pop("sizeGB"), "spec.l1.sizeGB")
        notes.append(f"l1.sizeGB -> l1.size {l1['size']}")
    l2 = out.get("l2") or {}
    if "backend" in (l2.get("nvme") or {}):
        notes.append(f"dropped l2.nvme.backend {l2['nvme'].pop('backend')} (POSIX, the one there is)")
    if "nvme" in l2 and "adapter" not in l2["nvme"]:
        l2["nvme"]["adapter"] = OLD_DEFAULT_ADAPTER
        notes.append(f"l2.nvme.adapter {OLD_DEFAULT_ADAPTER} (the default then, and so in its namespace id; today's is "
                     "fs_native, a new namespace)")
    for kind in L2_KINDS:
        tier = l2.get(kind) or {}
        if "maxCapacityGB" in tier:
            tier["maxCapacity"] = gib_quantity(tier.pop("maxCapacityGB"), f"spec.l2.{kind}.maxCapacityGB")
            notes.append(f"l2.{kind}.maxCapacityGB -> maxCapacity {tier['maxCapacity']}")
    eviction = out.get("eviction") or {}
    if eviction.get("policy") == "IsolatedLRU":
        eviction["policy"] = "LRU"
        notes.append("eviction.policy IsolatedLRU (always refused: each resource has servers of its own) -> LRU")
    for section, value in (("vllm", vllm), ("lmcacheServer", server)):
        if section in out and not value:
            del out[section]
    return out, notes


def convert_object(obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A KVCacheNamespace manifest with its spec converted (convert_spec); other objects as they are."""
    if obj.get("kind") != "KVCacheNamespace" or not isinstance(obj.get("spec"), dict):
        return obj, []
    spec, notes = convert_spec(obj["spec"])
    return {**obj, "spec": spec}, notes
