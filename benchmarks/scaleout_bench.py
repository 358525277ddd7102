#!/usr/bin/env python3
"""Scale-out TTFT: how fast a vLLM replica on node B answers a prefix node A computed, read from the
shared L2 (`spec.l2.nvme.shared`: one ReadWriteMany claim for every node's lmcache server), against
cold and against an L1 hit on the node that computed it.

Everything is real and as the operator renders it, on the local cluster's two real nodes (one
hack/kubelet_runner.py per node, tests/e2e/test_scale_out.py's setting): the operator, a real
`lmcache server` per node, vLLM's CPU build beside each, the larger generated test model
(hack/testmodel.py --size bench: 8 layers, hidden 512). vLLM's own prefix cache is off. For each
of --prompts distinct prompts, in this order:
  cold      the prompt's first request, on node A (one server, one vLLM replica)
  L1, A     the same prompt again on node A (after every prompt's cold one): from node A's server's L1
then one server and one vLLM replica more (the scale-out; the new pair lands on node B), and
  L2, B     the prompt's first request on node B: node B's server never had it in L1, so it is
            read from the shared folder node A's server wrote
  L1, B     the prompt again on node B: its server keeps what it read from L2 in L1 (the L1 hit
            of the same node, at the same stage of the run as the L2 case)
Each figure is the median over the prompts, with each request's tier (the server's L1/L2 hit
counters around it) and the CPU the rest of the machine used in the second before it (each
request waits up to --settle seconds for a quiet machine: vLLM's CPU build computes on the same
2 cores). Both nodes are this one 2-core machine: "node B" is a second server and
vLLM process on other loopback addresses, and the shared folder is a local disk, not a network
filesystem: what this measures is the L2 read path across servers, not a network's.

    python benchmarks/scaleout_bench.py [--prompts 3] [--prompt-words 3400] [--settle 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tests.e2e.kube import LOCALCLUSTER, wait_for
from tests.e2e.operator_env import NAME, in_pod, kvpersist_env
from tests.e2e.test_real_vllm import prompt
from tests.e2e.test_scale_out import ready_pod, shared_manifest
from vllm_bench import bench_setup, settle, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3, help="distinct prompts, each measured in every case")
    ap.add_argument("--prompt-words", type=int, default=3400, help="pseudo-words per prompt (3400: ~4.2k tokens)")
    ap.add_argument("--settle", type=float, default=30.0, help="seconds to wait at most for a quiet machine before each request")
    args = ap.parse_args()

    k, model, hf_home, running = bench_setup()
    texts = [prompt(21 + i, args.prompt_words) for i in range(args.prompts)]
    results: dict[str, list[dict]] = {"cold": [], "L1, node A": [], "L2 (shared), node B": [], "L1, node B": []}
    try:
        with tempfile.TemporaryDirectory() as tmp, kvpersist_env(k, Path(tmp), vllm=model["vllm"], hf_home=hf_home,
                                                                 two_nodes=True) as env:
            ns = env.ns
            obj = shared_manifest(ns, model)
            obj["spec"]["identity"]["maxModelLen"] = 8192
            obj["spec"]["l1"]["size"] = "1Gi"
            k.apply(obj)
            vllm_a = wait_for("a Ready vLLM pod", lambda: ready_pod(k, ns, f"{NAME}-vllm-"), timeout=900, interval=2)
            server_a = wait_for("a Ready server", lambda: ready_pod(k, ns, f"{NAME}-lmcache-"), timeout=300, interval=2)
            ip_a, srv_a = vllm_a["status"]["podIP"], in_pod(server_a["status"]["podIP"])
            for case in ("cold", "L1, node A"):  # all prompts cold first: their stores are done before the L1 case
                for text in texts:
                    results[case].append(request(ip_a, text, model["modelId"], srv_a, args.settle))
            k.run("patch", "kvns", NAME, "-n", ns, "--type=merge", "-p", '{"spec":{"lmcacheServer":{"replicas":2}}}')
            server_b = wait_for("the second server", lambda: ready_pod(k, ns, f"{NAME}-lmcache-",
                                                                        exclude={server_a["metadata"]["name"]}),
                                timeout=300, interval=2)
            k.run("scale", "kvns", NAME, "-n", ns, "--replicas=2")
            vllm_b = wait_for("the second vLLM pod", lambda: ready_pod(k, ns, f"{NAME}-vllm-",
                                                                        exclude={vllm_a["metadata"]["name"]}),
                              timeout=900, interval=2)
            nodes = {vllm_a["spec"]["nodeName"], vllm_b["spec"]["nodeName"], server_b["spec"]["nodeName"]}
            assert len(nodes) == 2 and vllm_b["spec"]["nodeName"] == server_b["spec"]["nodeName"], nodes
            ip_b, srv_b = vllm_b["status"]["podIP"], in_pod(server_b["status"]["podIP"])
            for case in ("L2 (shared), node B", "L1, node B"):  # the second time, node B's server has it in L1
                for text in texts:
                    results[case].append(request(ip_b, text, model["modelId"], srv_b, args.settle))
    finally:
        if not running:
            subprocess.run([*LOCALCLUSTER, "down"], check=False, timeout=120)
    summarize(results)
    print(json.dumps(results))


def request(ip: str, text: str, model: str, server: str, settle_s: float) -> dict:
    """One timed request once the machine is quiet (settle_s at most), with the background CPU then."""
    background = settle(settle_s)
    return {**timed(ip, text, model, server), "background_cpu": round(background, 3)}


def summarize(results: dict[str, list[dict]]) -> None:
    """Median TTFT per case (x cold), its range, tokens computed and from cache, and the tiers seen."""
    cold = statistics.median(r["ttft_s"] for r in results["cold"])
    print(f"model kvpersist/bench-llama, {len(results['cold'])} prompts of {results['cold'][0]['tokens']} tokens, "
          "median over the prompts")
    print(f"{'case':22s} {'TTFT s':>8s} {'x cold':>7s} {'min':>6s} {'max':>6s} {'bg cpu':>7s} {'computed':>9s} {'cached':>7s}  tiers")
    for case, rows in results.items():
        t = [r["ttft_s"] for r in rows]
        med = statistics.median(t)
        computed = statistics.median(r["tokens"] - r["from_cache"] for r in rows)
        cached = statistics.median(r["from_cache"] for r in rows)
        tiers = sorted({f"L1 {r['l1']}, L2 {r['l2']}" for r in rows})
        bg = statistics.median(r["background_cpu"] for r in rows)
        print(f"{case:22s} {med:8.3f} {med / cold:7.2f} {min(t):6.2f} {max(t):6.2f} {bg:7.0%} {computed:9.0f} {cached:7.0f}  "
              f"{'; '.join(tiers)}")


if __name__ == "__main__":
    main()
