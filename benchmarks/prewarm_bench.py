#!/usr/bin/env python3
"""Warm restarts (spec.prewarm): time to first token (TTFT) of a declared prompt right after an
lmcache server restart, warmed by the operator against a prompt that was not declared, and against
an L1 hit.

Everything is real and as the operator renders it (benchmarks/vllm_bench.py's setting): the local
cluster, the operator, the real `lmcache server` with its inventory agent and vLLM's CPU build
under hack/kubelet_runner.py, the larger generated test model (hack/testmodel.py --size bench: 8
layers, hidden 512), vLLM's own prefix cache off so every request asks LMCache. Two distinct
prompts of the same length: W is declared in spec.prewarm.prompts, N is not; both were computed
once (W by the operator's first warm pass, N by a request), so both are in L2. Then, --cycles
times: the server pod is deleted (vLLM kept), the bench waits for the Warm condition to come back
True (the operator's pass after the restart: W loaded from L2 into the new server's L1), and then
measures, each request once the machine is quiet (--settle):
  warmed      W's first request after the restart
  not warmed  N's first request after the restart (lmcache reads it from L2 on the request)
  L1 hit      W and N again (lmcache keeps what L2 brought back in L1): L1 hits of the same length
The first two alternate in order from cycle to cycle. Each request's tier is the server's own
lookup_hit_{l1,l2} counters around it. "restart -> Warm" is `kubectl delete pod` to Warm True again.
Whether the cases differ at all is a Kruskal-Wallis test over their requests (vllm_bench's): on
these 2 cores the same L1 hit varies by tens of percent from request to request.

    python benchmarks/prewarm_bench.py [--cycles 6] [--prompt-words 3400] [--settle 60]
    python benchmarks/prewarm_bench.py --summarize RUN.log   # the table of an earlier run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tests.e2e.kube import LOCALCLUSTER, Kubectl, wait_for
from tests.e2e.operator_env import NAME, in_pod, kvpersist_env, target_of
from tests.e2e.test_real_vllm import prompt, real_manifest, server_ip, vllm_pod
from vllm_bench import bench_setup, kruskal_wallis, settle, timed

CHUNK = 256


def warm_condition(k: Kubectl, ns: str) -> dict:
    conds = (k.get("kvns", NAME, ns).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "Warm"), {})


def transitioned_after(cond: dict, when: float) -> bool:
    stamp = datetime.strptime(cond["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    return cond.get("status") == "True" and stamp >= int(when)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=6, help="server restarts, each measuring every case")
    ap.add_argument("--prompt-words", type=int, default=3400, help="pseudo-words per prompt (3400: ~4.2k tokens)")
    ap.add_argument("--settle", type=float, default=60.0,
                    help="seconds to wait at most for a quiet machine before each request")
    ap.add_argument("--summarize", type=Path, default=None,
                    help="print the table of an earlier run from its JSON (the last line it printed), and exit")
    args = ap.parse_args()
    if args.summarize is not None:
        data = json.loads(args.summarize.read_text().strip().splitlines()[-1])
        summarize(data["results"], data["restart_to_warm_s"])
        return

    k, model, hf_home, running = bench_setup()
    warmed_text, other_text = prompt(41, args.prompt_words), prompt(42, args.prompt_words)
    results: dict[str, list[dict]] = {"warmed": [], "not warmed": [], "L1 hit": []}
    restart_to_warm: list[float] = []
    try:
        with tempfile.TemporaryDirectory() as tmp, kvpersist_env(k, Path(tmp), vllm=model["vllm"], hf_home=hf_home) as env:
            ns = env.ns
            obj = real_manifest(ns, model, maxModelLen=8192)
            obj["spec"]["l1"]["size"] = "1Gi"
            obj["spec"]["prewarm"] = {"prompts": [warmed_text]}
            k.apply(obj)
            vllm = vllm_pod(k, ns, timeout=900)
            ip, mid = vllm["status"]["podIP"], model["modelId"]
            wait_for("Warm True (W computed by the first pass)", lambda: warm_condition(k, ns).get("status") == "True",
                     timeout=600, interval=2, explain=lambda: str(warm_condition(k, ns)))
            cold = timed(ip, other_text, mid, None)  # N computed once: into L1 and L2
            folder = env.volume() / str(target_of(obj, k).namespace_id)
            chunks = 2 * (cold["tokens"] // CHUNK)
            wait_for("both prompts' chunks in L2", lambda: len([p for p in folder.glob("*") if p.is_file()]) >= chunks,
                     timeout=120, interval=1)
            for cycle in range(args.cycles):
                old = k.get("pod", f"{NAME}-lmcache-0", ns)["metadata"]["uid"]
                t0 = time.time()
                k.run("delete", "pod", f"{NAME}-lmcache-0", "-n", ns, "--wait=false")
                server = in_pod(server_ip(k, ns, exclude_uid=old))
                wait_for("Warm True again", lambda t0=t0: transitioned_after(warm_condition(k, ns), t0), timeout=600,
                         interval=0.5, explain=lambda: str(warm_condition(k, ns)))
                restart_to_warm.append(round(time.time() - t0, 1))
                order = [("warmed", warmed_text), ("not warmed", other_text)]
                for case, text in (order if cycle % 2 == 0 else order[::-1]):
                    background = settle(args.settle)
                    results[case].append({**timed(ip, text, mid, server), "background_cpu": round(background, 3)})
                for text in (warmed_text, other_text):
                    background = settle(args.settle)
                    results["L1 hit"].append({**timed(ip, text, mid, server), "background_cpu": round(background, 3)})
                print(f"cycle {cycle + 1}: " + ", ".join(f"{c} {r[-1]['ttft_s']:.3f} s (L1 {r[-1]['l1']}, L2 {r[-1]['l2']})"
                                                          for c, r in results.items()), flush=True)
    finally:
        if not running:
            subprocess.run([*LOCALCLUSTER, "down"], check=False, timeout=120)
    summarize(results, restart_to_warm)
    print(json.dumps({"results": results, "restart_to_warm_s": restart_to_warm}))


def summarize(results: dict[str, list[dict]], restart_to_warm: list[float]) -> None:
    """Median TTFT per case, x the L1 hit's, the range, tokens computed and from cache, the tiers."""
    l1 = statistics.median(r["ttft_s"] for r in results["L1 hit"])
    print(f"model kvpersist/bench-llama, prompts of {results['warmed'][0]['tokens']} tokens, "
          f"{len(results['warmed'])} server restarts, median over them")
    print(f"{'case':12s} {'TTFT s':>8s} {'x L1 hit':>9s} {'min':>6s} {'max':>6s} {'bg cpu':>7s} {'computed':>9s} "
          f"{'cached':>7s}  tiers")
    for case, rows in results.items():
        t = [r["ttft_s"] for r in rows]
        med = statistics.median(t)
        computed = statistics.median(r["tokens"] - r["from_cache"] for r in rows)
        cached = statistics.median(r["from_cache"] for r in rows)
        bg = statistics.median(r["background_cpu"] for r in rows)
        tiers = sorted({f"L1 {r['l1']}, L2 {r['l2']}" for r in rows})
        print(f"{case:12s} {med:8.3f} {med / l1:9.2f} {min(t):6.2f} {max(t):6.2f} {bg:7.0%} {computed:9.0f} {cached:7.0f}  "
              f"{'; '.join(tiers)}")
    print(f"kubectl delete pod (server) -> Warm True again: median {statistics.median(restart_to_warm):.1f} s "
          f"({', '.join(f'{s:.1f}' for s in restart_to_warm)})")
    warmed = statistics.median(r["ttft_s"] for r in results["warmed"])
    print(f"warmed / L1 hit: {warmed / l1:.2f} (target <= 1.2)")
    for case in ("warmed", "not warmed"):
        h, df, p = kruskal_wallis({case: [r["ttft_s"] for r in results[case]],
                                   "L1 hit": [r["ttft_s"] for r in results["L1 hit"]]})
        print(f"does {case} differ from an L1 hit? Kruskal-Wallis: H {h:.2f}, df {df}, p {p:.2f} "
              f"({'yes' if p < 0.05 else 'no'} at 5%)")


if __name__ == "__main__":
    main()
