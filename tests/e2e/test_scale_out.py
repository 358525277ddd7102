"""Scale-out across the two real nodes of the local cluster, with real parts on both: the operator,
a real `lmcache server` per node (hack/kubelet_runner.py plays real-gpu-0's kubelet and a second
runner real-gpu-1's), real vLLM (CPU build) beside each, and one L2 for both servers:
`spec.l2.nvme.shared` makes one ReadWriteMany claim, which both runners map to one folder (a
shared filesystem; its PV is a stand-in, tests/e2e/operator_env.second_node_storage).

One scenario, asserted on counters (vLLM's, lmcache's and status.hits), never on timing: one vLLM
pod and one server on node A, the long prompt cold (stored to the shared L2); then a scale-out,
one server and one vLLM replica more: the anti-affinity between servers puts the new server on
node B, vLLM's affinity the new vLLM pod beside it (the node-local Service resolves there to node
B's server). Its first request of that prompt is served from L2 (node B's server never had it in
L1), with the greedy tokens and logprobs node A computed cold.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, Env, in_pod, kvpersist_env, on_real_nodes, target_of
from tests.e2e.test_real_vllm import (  # the real-vLLM module's model, manifest and counters
    CHUNK,
    LONG,
    complete,
    external_hits,
    lmcache_hits,
    metrics,
    model,
    print_logs,
    real_manifest,
)
from tests.e2e.test_real_vllm import cacheable as whole_chunks

pytestmark = [pytest.mark.e2e, pytest.mark.datapath, pytest.mark.vllm]

__all__ = ["model"]  # the module fixture, shared with test_real_vllm (same model, built once)

SHARED_CLAIM = f"l2-{NAME}-lmcache-shared"


def shared_manifest(ns: str, model: dict) -> dict:
    """The real-vLLM resource on both real nodes, one replica of each, L2 on one shared claim."""
    obj = on_real_nodes(real_manifest(ns, model))
    obj["spec"]["l2"]["nvme"].update(shared=True, adapter="nixl_store_dynamic", storageClassName=f"{ns}-shared")
    obj["spec"]["lmcacheServer"] = {**obj["spec"].get("lmcacheServer", {}), "replicas": 1}
    obj["spec"]["vllm"]["replicas"] = 1
    return obj


def ready_pod(kubectl: Kubectl, ns: str, prefix: str, exclude: set[str] = frozenset()) -> dict | None:
    """A Ready, not deleted pod whose name starts with prefix and is none of `exclude`."""
    for p in kubectl.get("pods", namespace=ns)["items"]:
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
        if ready and p["metadata"]["name"].startswith(prefix) and p["metadata"]["name"] not in exclude \
                and not p["metadata"].get("deletionTimestamp"):
            return p
    return None


def greedy_long(ip: str) -> dict:
    """8 greedy tokens of the long prompt, with their logprobs (top 5): what must not change."""
    choice = complete(ip, LONG, max_tokens=8, logprobs=5)["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"], "logprobs": choice["logprobs"]["token_logprobs"],
            "top": choice["logprobs"]["top_logprobs"]}


@pytest.fixture(scope="module")
def two_nodes(kubectl: Kubectl, crd: None, model: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with kvpersist_env(kubectl, tmp_path_factory.mktemp("scaleout"), vllm=model["vllm"], hf_home=Path(model["hfHome"]),
                       two_nodes=True) as env:
        try:
            yield env
        except BaseException:
            print_logs(env)
            if env.second:
                for log in sorted((env.second.workdir / "logs").glob("*.log")):
                    print(f"==== {env.second.node} {log.name}\n{log.read_text(errors='replace')[-3000:]}")
            raise


def test_a_prefix_computed_on_node_a_is_served_from_the_shared_l2_on_node_b_after_a_scale_out(
        kubectl: Kubectl, two_nodes: Env, model: dict) -> None:
    env, ns = two_nodes, two_nodes.ns
    obj = shared_manifest(ns, model)
    kubectl.apply(obj)
    nsid = target_of(obj, kubectl).namespace_id
    claim = kubectl.get("pvc", SHARED_CLAIM, ns)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], claim["spec"]

    # Node A: one server, one vLLM pod beside it; the long prompt cold.
    vllm_a = wait_for("a Ready vLLM pod", lambda: ready_pod(kubectl, ns, f"{NAME}-vllm-"), timeout=600, interval=2)
    server_a = ready_pod(kubectl, ns, f"{NAME}-lmcache-")
    assert server_a and "kvpersist.dev/simulated" not in vllm_a["metadata"].get("annotations", {})
    node_a = vllm_a["spec"]["nodeName"]
    assert server_a["spec"]["nodeName"] == node_a and node_a in (env.runner.node, env.second.node)
    ip_a = vllm_a["status"]["podIP"]
    before = external_hits(metrics(f"http://{ip_a}:8000/metrics"))
    cold = greedy_long(ip_a)
    assert external_hits(metrics(f"http://{ip_a}:8000/metrics")) == before  # cold: nothing from outside
    tokens = complete(ip_a, LONG)["usage"]["prompt_tokens"]
    cacheable = whole_chunks(tokens)
    assert cacheable >= 6 * CHUNK
    runner_a = env.runner if node_a == env.runner.node else env.second
    folder = runner_a.volume_dir(SHARED_CLAIM) / nsid
    wait_for("the prompt's chunks in the shared L2", lambda: len([p for p in folder.glob("*") if p.is_file()])
             >= tokens // CHUNK, timeout=120)

    # Scale-out: a second server (anti-affinity: the other node), then a second vLLM replica,
    # which its affinity puts beside a server: the new node (the scheduler spreads a Deployment).
    kubectl.run("patch", "kvns", NAME, "-n", ns, "--type=merge", "-p", '{"spec":{"lmcacheServer":{"replicas":2}}}')
    server_b = wait_for("the second lmcache server Ready", lambda: ready_pod(
        kubectl, ns, f"{NAME}-lmcache-", exclude={server_a["metadata"]["name"]}), timeout=300, interval=2)
    node_b = server_b["spec"]["nodeName"]
    assert node_b != node_a and {node_a, node_b} == {env.runner.node, env.second.node}
    runner_b = env.second if runner_a is env.runner else env.runner
    assert runner_b.volume_dir(SHARED_CLAIM) / nsid == folder  # one folder: both nodes' view of the one claim
    kubectl.run("scale", "kvns", NAME, "-n", ns, "--replicas=2")
    vllm_b = wait_for("the second vLLM pod Ready", lambda: ready_pod(
        kubectl, ns, f"{NAME}-vllm-", exclude={vllm_a["metadata"]["name"]}), timeout=600, interval=2)
    assert vllm_b["spec"]["nodeName"] == node_b, (vllm_b["spec"]["nodeName"], node_b)

    # Node B's first request of the prompt: node B's server never held it in L1; served from L2.
    ip_b, srv_b = vllm_b["status"]["podIP"], in_pod(server_b["status"]["podIP"])
    l1_before, l2_before = lmcache_hits(metrics(f"{srv_b}/metrics"))
    assert (l1_before, l2_before) == (0, 0)
    hits_before = external_hits(metrics(f"http://{ip_b}:8000/metrics"))
    warm = greedy_long(ip_b)
    served = external_hits(metrics(f"http://{ip_b}:8000/metrics")) - hits_before
    l1, l2 = lmcache_hits(metrics(f"{srv_b}/metrics"))
    assert served == cacheable and l2 >= cacheable and l1 == 0, (served, l1, l2)
    assert warm == cold  # token ids and logprobs: node A computed them cold, node B read them from L2

    # status.hits counts node B's server (at most once a minute): what it served, and no more.
    def row_b() -> dict | None:
        want = metrics(f"{srv_b}/metrics").get("lmcache_mp_lookup_hit_tokens_total", 0.0)
        rows = ((kubectl.get("kvns", NAME, ns).get("status") or {}).get("hits") or {}).get("servers", [])
        mine = next((r for r in rows if r["pod"] == server_b["metadata"]["name"]), None)
        return mine if mine and mine.get("hitTokens", 0) == want > 0 else None

    assert wait_for("status.hits to count node B's server", row_b, timeout=180, interval=3)["hitTokens"] >= cacheable
