#!/usr/bin/env python3
"""Real vLLM with the persistent cache: time to first token (TTFT) and prefill tokens computed for a
long prompt, cold and after each kind of restart, and end to end from `kubectl delete pod` of vLLM
to the first answer served from cache. Each figure is also given as a ratio to cold.

Everything is real and as the operator renders it: the local cluster, the operator, the real
`lmcache server` and vLLM's CPU build under hack/kubelet_runner.py, with the larger generated test
model (hack/testmodel.py --size bench: 8 layers, hidden 512). Cases, in order:
  cold                   first request: nothing cached
  vLLM restarted         the vLLM pod deleted; the new one is served from the server's L1
  server restarted       the server pod deleted; vLLM kept: served from L2 (L1 is gone)
  both restarted         both pods deleted: served from L2
Between cases vLLM's own prefix cache is off (--no-enable-prefix-caching), so every request asks
LMCache. Each case sends the prompt --repeats times after the first (cached) answer; TTFT is the
median of those, the first answer's own TTFT is printed too, and every repeat with the tier
lmcache served it from (its L1/L2 hit counters, read from the server around each request). The
two restart cases run --cycles times each, so a slow case shows whether it recurs, and in the
order --order says (server first, or both first), so a spread that follows run order rather than
the case shows as such. Before each case's measured requests the bench waits (up to --settle
seconds) for the machine to go quiet, and prints the CPU the rest of the machine used in the
second before (background: starting pods, the inventory agent's scan, the cluster): on these
2-core machines vLLM's CPU build computes the uncached tokens on the same cores.

    python benchmarks/vllm_bench.py [--prompt-words 3400] [--repeats 3] [--cycles 1] [--order server-first|both-first]
                                    [--settle 60]
    python benchmarks/vllm_bench.py --summarize RUN.json   # the table of an earlier run, from its last line
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.e2e.kube import LOCALCLUSTER, REPO, Kubectl, bin_dir, wait_for
from tests.e2e.operator_env import NAME, in_pod, kvpersist_env
from tests.e2e.test_real_vllm import (
    external_hits,
    lmcache_hits,
    metrics,
    pod,
    prompt,
    real_manifest,
    server_ip,
    vllm_build,
    vllm_pod,
)


def ttft(ip: str, text: str, model: str) -> tuple[float, int]:
    """Seconds to the first streamed token, and the prompt's token count."""
    body = json.dumps({"model": model, "prompt": text, "max_tokens": 1, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(ip, 8000, timeout=600)
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    first, tokens = None, 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if first is None and chunk.get("choices"):
            first = time.monotonic() - t0
        tokens = (chunk.get("usage") or {}).get("prompt_tokens", tokens)
    conn.close()
    assert first is not None, "no token streamed"
    return first, tokens


def cpu_busy(seconds: float = 1.0) -> float:
    """The machine's busy share of all its cores over `seconds` (from /proc/stat), 0..1."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields), idle
    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def settle(bound_s: float, quiet: float = 0.15) -> float:
    """Waits (at most bound_s) until the machine's background CPU is under `quiet`; what it was last."""
    deadline = time.monotonic() + bound_s
    busy = cpu_busy()
    while busy >= quiet and time.monotonic() < deadline:
        busy = cpu_busy()
    return busy


def timed(ip: str, text: str, model: str, server: str | None) -> dict:
    """One request: TTFT, tokens, vLLM's external hits and lmcache's L1/L2 hit tokens for it."""
    v0 = external_hits(metrics(f"http://{ip}:8000/metrics"))
    s0 = lmcache_hits(metrics(server + "/metrics")) if server else (0.0, 0.0)
    seconds, tokens = ttft(ip, text, model)
    v1 = external_hits(metrics(f"http://{ip}:8000/metrics"))
    s1 = lmcache_hits(metrics(server + "/metrics")) if server else (0.0, 0.0)
    return {"ttft_s": round(seconds, 4), "tokens": tokens, "from_cache": int(v1 - v0), "l1": int(s1[0] - s0[0]),
            "l2": int(s1[1] - s0[1])}


def measure(ip: str, text: str, model: str, repeats: int, server: str | None = None, settle_s: float = 0.0) -> dict:
    """The first answer's TTFT, the median of `repeats` more, tokens computed vs from cache, and
    each request's own figures (server: the lmcache admin API, for the tier of each hit). The
    repeats start once the machine is quiet (settle_s at most); its background CPU then is kept."""
    first = timed(ip, text, model, server)
    background = settle(settle_s) if repeats else None
    rest = [timed(ip, text, model, server) for _ in range(repeats)]
    return {"ttft_first_s": first["ttft_s"], "ttft_s": statistics.median(r["ttft_s"] for r in rest) if rest else first["ttft_s"],
            "background_cpu": background,
            "prompt_tokens": first["tokens"], "from_cache": first["from_cache"], "computed": first["tokens"] - first["from_cache"],
            "requests": [first, *rest]}


def bench_setup() -> tuple[Kubectl, dict, Path, bool]:
    """The local cluster up (started when it is not) with the CRD, vLLM's CPU build and the bench
    model in the HF cache: (kubectl, the model's record with its `vllm` program, the HF home, whether
    the cluster was already running: one the bench started, it stops)."""
    running = subprocess.run([*LOCALCLUSTER, "status"], capture_output=True, timeout=30).returncode == 0
    if not running:
        subprocess.run([*LOCALCLUSTER, "up"], check=True, stdout=subprocess.DEVNULL, timeout=300)
    kubeconfig = Path(os.environ.get("KVPERSIST_CLUSTER_DIR", Path.home() / ".cache" / "kvpersist" / "cluster")) / "kubeconfig"
    k = Kubectl(kubeconfig, bin_dir() / "kubectl")
    k.run("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    venv = vllm_build()
    hf_home = Path(os.environ.get("KVPERSIST_CACHE", Path.home() / ".cache" / "kvpersist")) / "hf"
    model = json.loads(subprocess.run([str(venv / "bin" / "python"), str(REPO / "hack" / "testmodel.py"), "--size", "bench",
                                       "--hf-home", str(hf_home)], check=True, capture_output=True, text=True).stdout)
    model["vllm"] = str(venv / "bin" / "vllm")
    return k, model, hf_home, running


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-words", type=int, default=3400, help="pseudo-words in the prompt (3400: ~4.2k tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=1, help="how many times each restart case runs")
    ap.add_argument("--order", choices=("server-first", "both-first"), default="server-first",
                    help="which restart case of each cycle runs first")
    ap.add_argument("--settle", type=float, default=60.0, help="seconds to wait at most for a quiet machine before repeats")
    ap.add_argument("--summarize", type=Path, default=None,
                    help="print the table of an earlier run from its JSON line (the last line it printed), and exit")
    args = ap.parse_args()
    if args.summarize is not None:
        summarize(json.loads(args.summarize.read_text()), f"from {args.summarize.name}")
        return

    k, model, hf_home, running = bench_setup()
    text = prompt(11, args.prompt_words)
    results: dict[str, dict] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp, kvpersist_env(k, Path(tmp), vllm=model["vllm"], hf_home=hf_home) as env:
            ns = env.ns
            obj = real_manifest(ns, model, maxModelLen=8192)
            obj["spec"]["l1"]["sizeGB"] = 1
            k.apply(obj)
            vllm = vllm_pod(k, ns, timeout=600)
            results["cold"] = measure(vllm["status"]["podIP"], text, model["modelId"], 0)

            t0 = time.monotonic()
            k.run("delete", "pod", vllm["metadata"]["name"], "-n", ns, "--wait=false")
            vllm = vllm_pod(k, ns, exclude={vllm["metadata"]["name"]}, timeout=600)
            results["vLLM restarted"] = measure(vllm["status"]["podIP"], text, model["modelId"], args.repeats,
                                                in_pod(server_ip(k, ns)), args.settle)
            results["vLLM restarted"]["delete_to_cached_answer_s"] = time.monotonic() - t0

            def server_restarted(suffix: str) -> None:
                old = k.get("pod", f"{NAME}-lmcache-0", ns)["metadata"]["uid"]
                k.run("delete", "pod", f"{NAME}-lmcache-0", "-n", ns, "--wait=false")
                server = in_pod(server_ip(k, ns, exclude_uid=old))
                ip = vllm["status"]["podIP"]
                t0 = time.monotonic()
                wait_for("vLLM to hit the new server", lambda: timed(ip, text, model["modelId"], None)["from_cache"] > 0,
                         timeout=180, interval=2)
                results["server restarted" + suffix] = measure(ip, text, model["modelId"], args.repeats, server, args.settle)
                results["server restarted" + suffix]["first_hit_after_s"] = time.monotonic() - t0

            def both_restarted(suffix: str) -> None:
                nonlocal vllm
                old = k.get("pod", f"{NAME}-lmcache-0", ns)["metadata"]["uid"]
                k.run("delete", "pod", f"{NAME}-lmcache-0", vllm["metadata"]["name"], "-n", ns, "--wait=false")
                server = in_pod(server_ip(k, ns, exclude_uid=old))
                vllm = vllm_pod(k, ns, exclude={vllm["metadata"]["name"]}, timeout=600)
                ip = vllm["status"]["podIP"]
                t0 = time.monotonic()
                wait_for("vLLM to hit", lambda: timed(ip, text, model["modelId"], None)["from_cache"] > 0, timeout=180,
                         interval=2)
                results["both restarted" + suffix] = measure(ip, text, model["modelId"], args.repeats, server, args.settle)
                results["both restarted" + suffix]["first_hit_after_s"] = time.monotonic() - t0

            cases = (server_restarted, both_restarted) if args.order == "server-first" else (both_restarted, server_restarted)
            for cycle in range(1, args.cycles + 1):
                for case in cases:
                    case(f" #{cycle}" if args.cycles > 1 else "")
            assert pod(k, ns, f"{NAME}-vllm-") is not None
    finally:
        if not running:
            subprocess.run([*LOCALCLUSTER, "down"], check=False, timeout=120)
    summarize(results, f"{args.repeats} repeats (median), restart cases {args.order}")
    print(json.dumps(results))


def chi2_sf(x: float, k: int) -> float:
    """P(X >= x) for a chi-square of k degrees of freedom (the regularized upper gamma Q(k/2, x/2),
    by its power series: enough for the few cases here)."""
    if x <= 0:
        return 1.0
    a, z = k / 2.0, x / 2.0
    term = total = 1.0 / a
    n = 1
    while term > total * 1e-12 and n < 10000:
        term *= z / (a + n)
        total += term
        n += 1
    return max(0.0, 1.0 - math.exp(a * math.log(z) - z - math.lgamma(a)) * total)


def kruskal_wallis(groups: dict[str, list[float]]) -> tuple[float, int, float]:
    """(H, degrees of freedom, p): whether the groups' values could come from one distribution
    (ties get their mean rank; no tie correction, which only makes H a little smaller)."""
    values = sorted((v, g) for g, xs in groups.items() for v in xs)
    n = len(values)
    ranks: dict[str, list[float]] = {}
    i = 0
    while i < n:
        j = i
        while j + 1 < n and values[j + 1][0] == values[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks.setdefault(values[k][1], []).append((i + j) / 2 + 1)
        i = j + 1
    h = 12 / (n * (n + 1)) * sum(sum(r) ** 2 / len(r) for r in ranks.values()) - 3 * (n + 1)
    df = len(groups) - 1
    return h, df, chi2_sf(h, df)


def summarize(results: dict[str, dict], how: str) -> None:
    """The table: per case its median TTFT (x cold, x the best case), the spread of its repeats,
    and whether the restart cases differ at all (Kruskal-Wallis over their repeats)."""
    cold = results["cold"]["ttft_s"]
    best = min(r["ttft_s"] for case, r in results.items() if case != "cold")
    print(f"model kvpersist/bench-llama, prompt {results['cold']['prompt_tokens']} tokens, {how}")
    print(f"{'case':20s} {'TTFT s':>8s} {'x cold':>7s} {'x best':>7s} {'min':>6s} {'q1':>6s} {'q3':>6s} {'max':>6s} {'bg cpu':>7s} "
          f"{'first s':>8s} {'computed':>9s} {'cached':>7s}  tiers")
    repeats: dict[str, list[float]] = {}
    for case, r in results.items():
        rest = [q["ttft_s"] for q in r["requests"][1:]] or [r["ttft_s"]]
        if case != "cold":
            repeats[case] = rest
        q1, _, q3 = statistics.quantiles(rest, n=4) if len(rest) > 1 else (rest[0], 0, rest[0])
        bg = f"{r['background_cpu']:.0%}" if r.get("background_cpu") is not None else "-"
        tiers = sorted({f"L1 {q['l1']}, L2 {q['l2']}" for q in r["requests"]})
        print(f"{case:20s} {r['ttft_s']:8.3f} {r['ttft_s'] / cold:7.2f} {r['ttft_s'] / best:7.2f} {min(rest):6.2f} {q1:6.2f} "
              f"{q3:6.2f} {max(rest):6.2f} {bg:>7s} {r['ttft_first_s']:8.3f} {r['computed']:9d} {r['from_cache']:7d}  "
              f"{'; '.join(tiers)}")
    worst = max(statistics.median(x) for x in repeats.values()) / min(statistics.median(x) for x in repeats.values())
    print(f"steady cached TTFT, worst restart case / best: {worst:.2f} (target <= 1.2)")
    if len(repeats) > 1 and all(len(x) > 1 for x in repeats.values()):
        h, df, p = kruskal_wallis(repeats)
        print(f"do the restart cases differ? Kruskal-Wallis over their repeats: H {h:.2f}, df {df}, p {p:.2f} "
              f"({'yes' if p < 0.05 else 'no'} at 5%)")
    if "delete_to_cached_answer_s" in results.get("vLLM restarted", {}):
        print(f"kubectl delete pod (vLLM) -> first answer from cache: {results['vLLM restarted']['delete_to_cached_answer_s']:.1f} s")

if __name__ == "__main__":
    main()
