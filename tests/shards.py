"""Which e2e modules run in which of the suite's parallel shards (hack/test.sh: each shard its own
pytest process and its own local cluster), so that the tier's wall time is about half its sum.

The weights are each module's wall time in seconds as measured (`pytest --durations` and the
tier's log, issue 40), kept roughly: they only balance the shards. The modules that run the real
vLLM stay in one shard, so two vLLM processes (about 5 GB each on these CPUs) never run at once
beside the integration tier's lmcache servers. A module missing here gets DEFAULT_WEIGHT, and
tests/unit/test_shards.py fails until it is added (so a slow new module is placed on purpose).
"""

from __future__ import annotations

DEFAULT_WEIGHT = 60
# Modules that start the real vLLM (kvpersist_env(vllm=...)): kept together.
VLLM_MODULES = frozenset({"test_canary.py", "test_real_vllm.py", "test_scale_out.py", "test_build_check.py",
                          "test_prewarm.py", "test_attach_vllm.py"})
WEIGHTS = {
    "test_admin.py": 200, "test_api.py": 250, "test_attach.py": 30, "test_attach_vllm.py": 300, "test_basics.py": 20,
    "test_budget.py": 150,
    "test_build_check.py": 150, "test_cache_fallback.py": 112, "test_canary.py": 711,
    "test_canary_fairness.py": 135, "test_cluster_smoke.py": 40, "test_drain.py": 20,
    "test_creator_rights.py": 42, "test_exclusive_stores.py": 154, "test_faults.py": 482, "test_fuzz.py": 42,
    "test_gitops_prune.py": 119, "test_ha.py": 57, "test_helm.py": 137, "test_helm_ha.py": 42,
    "test_hfbucket_status.py": 55, "test_hostile_objects.py": 5, "test_hostile_peers_e2e.py": 124, "test_idle_reads.py": 79,
    "test_inference_pool.py": 80, "test_l2_full.py": 70,
    "test_l2_key.py": 324, "test_least_privilege.py": 87, "test_no_adoption.py": 122, "test_orphan_status.py": 8,
    "test_operator_bounds.py": 34,
    "test_pin_change_plan.py": 50, "test_pin_check.py": 19, "test_pod_security.py": 40, "test_pod_trust.py": 60,
    "test_prewarm.py": 138,
    "test_quiet.py": 140,
    "test_real_vllm.py": 404, "test_reconcile.py": 108, "test_rollout_pairing.py": 67, "test_runner_writes.py": 8,
    "test_samples.py": 23, "test_scale_out.py": 192, "test_secrets.py": 46, "test_shared_l2.py": 16,
    "test_upgrade.py": 51, "test_user_guide.py": 30, "test_vllm_pod.py": 26,
}


def assign(modules: list[str], shards: int) -> dict[str, int]:
    """module file name -> shard (1..shards): the vLLM modules as one block on shard 1, then the
    rest, heaviest first, each onto the lightest shard (ties: the lower shard, by name), so the
    split is the same on every machine for the same set of modules."""
    load = [0] * shards
    out: dict[str, int] = {}
    vllm = sorted(m for m in modules if m in VLLM_MODULES)
    for module in vllm:
        out[module] = 1
        load[0] += WEIGHTS.get(module, DEFAULT_WEIGHT)
    rest = sorted((m for m in modules if m not in VLLM_MODULES), key=lambda m: (-WEIGHTS.get(m, DEFAULT_WEIGHT), m))
    for module in rest:
        lightest = min(range(shards), key=lambda i: (load[i], i))
        out[module] = lightest + 1
        load[lightest] += WEIGHTS.get(module, DEFAULT_WEIGHT)
    return out


def parse(value: str) -> tuple[int, int]:
    """`K/N` -> (K, N), 1 <= K <= N."""
    k, _, n = value.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"--shard {value!r}: expected K/N with 1 <= K <= N")
    return int(k), int(n)
