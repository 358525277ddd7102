"""spec.l2.nvme: a PersistentVolumeClaim per server (or one shared), written by one of LMCache's file adapters
in a folder per namespace id, read and trimmed by the inventory agent beside each server."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpersist.api.spec import GIB, KVCacheNamespaceSpec, chunk_layer_bytes, l1_page_bytes
from kvpersist.builders.target import L2_MOUNT_PATH, Target
from kvpersist.l2backends.backend import L2Backend, lmcache_number

NIXL_BACKEND = "POSIX"  # nixl_store_dynamic's one backend here (files on the mounted claim): not a field

# lmcache counts an object at its framed size (its chunk and a few bytes), a file takes whole pages
# (4 KiB; nixl_store_dynamic: L1's page, one more than the chunk). The adapter gets that share of the
# capacity, so the disk stays within it (the agent trims to it) without trimming what lmcache still
# counts as stored. 63/64: chunks of 252 KiB or more on 4 KiB pages.
FOUR_KIB_DISK_SHARE = 63 / 64

# A shared folder's trimmer spares younger files: another server may have just written or found one
# (docs/design.md, "Several writers on one folder").
SHARED_TRIM_GRACE_S = 120


def l2_path(target: Target) -> str:
    """One folder per namespace id, so two KVCacheNamespaces on one volume never read each other's files."""
    return f"{L2_MOUNT_PATH}/{target.namespace_id}"


def framed_disk_share(spec: KVCacheNamespaceSpec) -> float:
    """The share of the capacity lmcache may count: a chunk over its file. nixl_store_dynamic: one layer
    over a layer and a page, at most a seventeenth lost (a page is at most 1/16 of a layer: api l1_page_bytes)."""
    layer = chunk_layer_bytes(spec)
    page = l1_page_bytes(spec)
    if spec.l2.nvme is None or spec.l2.nvme.adapter != "nixl_store_dynamic" or layer is None or layer % page:
        return FOUR_KIB_DISK_SHARE
    return layer / (layer + page)


class NVMe(L2Backend):
    field = "nvme"
    namespaced = True  # claims are namespaced
    mounts_volume = True

    def adapter_config(self, target: Target, eviction: dict[str, Any], io_workers: int) -> dict[str, Any]:
        """Its own eviction and capacity: L2 under maxCapacity, or the budget (a hard cap, no eviction)."""
        nvme = self.settings(target.spec.l2)
        capacity_gb = nvme.max_capacity_gb
        if nvme.budget_bytes is not None:
            # A hard cap, no eviction: at the cap stores are refused and what is stored stays (measured).
            capacity_gb = nvme.budget_bytes / GIB
            eviction["eviction_policy"] = "noop"
        capacity_gb *= framed_disk_share(target.spec)
        if nvme.adapter == "fs_native":
            adapter = {"type": "fs_native", "base_path": l2_path(target), "num_workers": io_workers,
                       "use_odirect": nvme.direct_io, "max_capacity_gb": capacity_gb}
        elif nvme.adapter == "fs":
            adapter = {"type": "fs", "base_path": l2_path(target), "use_odirect": nvme.direct_io}
        else:
            adapter = {"type": "nixl_store_dynamic", "backend": NIXL_BACKEND,  # backend_params takes strings
                       "backend_params": {"file_path": l2_path(target), "use_direct_io": "true" if nvme.direct_io else "false",
                                          "max_capacity_gb": lmcache_number(capacity_gb)}}
        return {**adapter, "persist_enabled": True, "eviction": eviction}

    def agent_args(self, target: Target) -> list[str]:
        """Serving a namespace, the agent holds its folder to the adapter's capacity (fs_native,
        nixl_store_dynamic), which lmcache 0.5.6 loses track of after a restart."""
        nvme = self.settings(target.spec.l2)
        if not target.namespace_id:
            return []
        args = ["--serving", target.namespace_id]
        if nvme.adapter in ("nixl_store_dynamic", "fs_native"):  # the agent's (inventory.volume.TRIMMED_ADAPTERS)
            capacity = nvme.budget_bytes if nvme.budget_bytes is not None else int(nvme.max_capacity_gb * GIB)
            args += ["--capacity-bytes", str(capacity), "--adapter", nvme.adapter]
        if nvme.shared:  # only ordinal 0's agent trims (kvpersist.inventory.agent.trimmer_of)
            args += ["--shared-folder", "--trim-grace", str(SHARED_TRIM_GRACE_S)]
        return args

    def store(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The user's claim (existingClaimName), else the claims made for it (generated)."""
        claim = settings.get("existingClaimName")
        claim = claim if isinstance(claim, str) and claim else None
        return {"claim": claim, "generated": claim is None,
                "field": "spec.l2.nvme.existingClaimName" if claim else "spec.l2.nvme.size (its StatefulSet's claims)"}
