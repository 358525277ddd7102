"""Everything one KVCacheNamespace becomes, in the order it should be applied."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpersist.builders.lmcache import build_lmcache_statefulset, build_local_service, build_network_policy, build_server_pdb
from kvpersist.builders.target import Target
from kvpersist.builders.vllm import attached, build_inference_pool, build_model_cache_claim, build_vllm_deployment, build_vllm_service


def build_all(target: Target, operator_ns: str | None = None, scraper: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The policy first (no window where the admin port is open), then the lmcache StatefulSet (what a
    user waits for: benchmarks/reconcile_bench.py), then its Service. The policy and local Service
    are per namespace id (an old id's stay until none of its pods is left: controller.apply); with
    target.routes False no local Service, and the policy of every server (builders.lmcache.build_network_policy).
    operator_ns, scraper: who may reach the agents."""
    local = build_local_service(target)
    vllm_service = build_vllm_service(target)
    pool = build_inference_pool(target)
    model_cache = build_model_cache_claim(target)
    vllm = build_vllm_deployment(target)
    pdb = build_server_pdb(target)
    manifests = [
        build_network_policy(target, operator_ns, scraper),
        build_lmcache_statefulset(target),
        local,
        pdb,
        model_cache,  # spec.vllm.modelCache.size: created once, never applied over (controller.apply)
        vllm,
        vllm_service,  # spec.vllm.service, when enabled
        pool,  # spec.vllm.inferencePool, where the API server serves InferencePool
    ]
    # Left out in place, not filtered into a new list: tests/rbac_needs.py follows this literal
    # list to its builders to derive the operator's grants. Attached: the user's own vLLM pods
    # (builders.vllm.attach_status), no Deployment of the operator's.
    left_out = ((local, target.cache_enabled and not target.routes), (pdb, pdb is None),
                (vllm_service, vllm_service is None), (pool, pool is None or not target.inference_pool_served),
                (model_cache, model_cache is None), (vllm, attached(target)))
    for manifest in [m for m, out in left_out if out]:
        manifests.remove(manifest)
    return manifests  # type: ignore[return-value]
