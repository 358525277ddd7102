#!/usr/bin/env python3
"""Real vLLM with the persistent cache: time to first token (TTFT) and prefill tokens computed for a
long prompt, cold and after each kind of restart, and end to end from `kubectl delete pod` to the
first token of the first request after the restart. Figures are also given as a ratio to cold.

Everything is real and as the operator renders it: the local cluster, the operator, the real
`lmcache server` and vLLM's CPU build under hack/kubelet_runner.py, with the larger generated test
model (hack/testmodel.py --size bench: 8 layers, hidden 512). vLLM's own prefix cache is off
(--no-enable-prefix-caching), so every request asks LMCache. Cases, in order:
  cold                   --cold-prompts distinct prompts of the same length (each its own prefix,
                         so none is cached), each timed; TTFT is their median. The first of them is
                         the measured prompt: its KV is what the restart cases find.
  vLLM restarted         the vLLM pod deleted; the new one is served from the server's L1
  server restarted       the server pod deleted; vLLM kept: served from L2 (L1 is gone)
  both restarted         both pods deleted: served from L2
After a restart the bench sends nothing to vLLM until it is ready: the restarted pods Ready (vLLM's
/health), a vLLM worker registered with the server that was not before (its /status; the same
worker again after a server restart) and vLLM's LMCache connector out of degraded mode (its log).
Then it waits (up to --settle seconds) for the machine to go quiet and times the first request of
the prompt after the restart: no request of the prompt precedes it, so it is what a user's first
request meets. --repeats more follow at once, their median a separate column. Every request's
tier is the server's L1/L2 hit counters read around it. "delete -> ready" is `kubectl delete pod`
to that readiness (pod restart, re-registration; no request, no settle wait); "delete -> 1st
token" is `kubectl delete pod` to the first request's first token, so it includes the settle wait.
The background CPU is what the rest of the machine used in the second before the first request
(starting pods, the inventory agent's scan, the cluster): on these 2-core machines vLLM's CPU build
computes the uncached tokens on the same cores. The two restart cases run --cycles times each, so
a slow case shows whether it recurs, in the order --order says, so a spread that follows run
order rather than the case shows as such.

    python benchmarks/vllm_bench.py [--prompt-words 3400] [--cold-prompts 5] [--repeats 3] [--cycles 1]
                                    [--order server-first|both-first] [--settle 60]
    python benchmarks/vllm_bench.py --summarize RUN.json   # the tables of an earlier run, from its last line
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
import urllib.request
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.e2e.kube import LOCALCLUSTER, REPO, Kubectl, bin_dir, wait_for
from tests.e2e.operator_env import NAME, Env, in_pod, kvpersist_env
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

FORMAT = 2  # the run JSON's shape; a file without "format" is the one before issue 41 (upgrade())
SEED = 11  # the measured prompt's; the other cold prompts take the seeds after it
# What vLLM logs when its LMCache connector's heartbeat to the server fails and when it comes back
# (lmcache 0.5.6 integration/vllm/vllm_multi_process_adapter.py, HeartbeatThread): a lookup while
# degraded is a miss, so the first request waits for every such period to have ended.
CONNECTOR_DOWN = "entering degraded mode"
CONNECTOR_UP = "resuming normal operation"


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


def quiet_then_timed(ip: str, text: str, model: str, server: str, settle_s: float) -> dict:
    """timed() once the machine is quiet (settle_s at most), with its background CPU then and the
    seconds the wait took."""
    t0 = time.monotonic()
    background = settle(settle_s)
    waited = time.monotonic() - t0
    return {**timed(ip, text, model, server), "background_cpu": background, "settle_s": round(waited, 2)}


def cold(ip: str, texts: list[str], model: str, server: str, settle_s: float) -> dict:
    """Each distinct prompt once, none cached, each after a quiet wait: the median TTFT and each."""
    reqs = [quiet_then_timed(ip, text, model, server, settle_s) for text in texts]
    first = reqs[0]
    return {"ttft_s": statistics.median(r["ttft_s"] for r in reqs), "prompt_tokens": first["tokens"],
            "from_cache": first["from_cache"], "computed": first["tokens"] - first["from_cache"], "requests": reqs}


def registrations(server: str) -> set[str]:
    """The vLLM workers registered with an lmcache server: the instance ids its /status lists (both
    transfer modules; kvpersist.inventory.prefetch reads the same keys)."""
    with urllib.request.urlopen(server + "/status", timeout=10) as r:
        status = json.loads(r.read())
    return {*(status.get("non_cuda_context_meta") or {}), *(status.get("cache_context_meta") or {})}


def connector_periods(log: str) -> tuple[int, int]:
    """How often vLLM's LMCache connector went degraded, and came back, by its log."""
    return log.count(CONNECTOR_DOWN), log.count(CONNECTOR_UP)


def pod_log(env: Env, pod_name: str) -> str:
    """A pod's log as the runner writes it (hack/kubelet_runner.py: logs/<ns>-<pod>-<container>.log)."""
    return "".join(p.read_text(errors="replace") for p in sorted((env.work / "pods" / "logs").glob(f"{env.ns}-{pod_name}-*.log")))


def wait_ready(server: str, seen: set[str], log: Callable[[], str], timeout: float = 300) -> dict:
    """Waits, sending nothing to vLLM, until a worker not in `seen` is registered with the server
    and vLLM's connector has come back from every degraded period: what a request of the prompt
    would otherwise have raced (a miss, then its KV stored afresh)."""
    def ready() -> dict | None:
        try:
            new = registrations(server) - seen
        except OSError:
            return None
        down, up = connector_periods(log())
        return {"registered": sorted(new), "degraded": down, "recovered": up} if new and up >= down else None
    return wait_for("vLLM registered with the server and its connector healthy", ready, timeout=timeout, interval=0.5)


def after_restart(ip: str, text: str, model: str, server: str, repeats: int, settle_s: float, deleted_at: float,
                  ready: dict) -> dict:
    """Called once the restart is ready (wait_ready): the first request of the prompt after it,
    timed once the machine is quiet, then `repeats` more at once; and the restart's timeline."""
    ready_at = time.monotonic()
    first = quiet_then_timed(ip, text, model, server, settle_s)
    rest = [timed(ip, text, model, server) for _ in range(repeats)]
    return {"first": first, "repeats": rest,
            "ttft_first_s": first["ttft_s"],
            "ttft_repeats_s": statistics.median(r["ttft_s"] for r in rest) if rest else None,
            "background_cpu": first["background_cpu"], "prompt_tokens": first["tokens"], "from_cache": first["from_cache"],
            "computed": first["tokens"] - first["from_cache"],
            "delete_to_ready_s": round(ready_at - deleted_at, 2), "settle_s": first["settle_s"],
            "delete_to_first_token_s": round(ready_at - deleted_at + first["settle_s"] + first["ttft_s"], 2),
            "ready": ready}


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


def run_cases(k: Kubectl, env: Env, model: dict, texts: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Cold, then each restart case, on a resource of its own in env's namespace."""
    ns, mid, text = env.ns, model["modelId"], texts[0]
    obj = real_manifest(ns, model, maxModelLen=8192)
    obj["spec"]["l1"]["size"] = "1Gi"
    k.apply(obj)
    vllm = vllm_pod(k, ns, timeout=600)
    server = in_pod(server_ip(k, ns))
    cases: dict[str, dict] = {"cold": cold(vllm["status"]["podIP"], texts, mid, server, args.settle)}

    def restart(label: str, delete_vllm: bool, delete_server: bool) -> None:
        nonlocal vllm, server
        old_server = k.get("pod", f"{NAME}-lmcache-0", ns)["metadata"]["uid"]
        # The old vLLM's worker stays listed until lmcache reaps it; a restarted server with vLLM kept
        # gets that same worker (its instance id) again.
        seen = set() if delete_server and not delete_vllm else registrations(server)
        names = [*([f"{NAME}-lmcache-0"] if delete_server else []), *([vllm["metadata"]["name"]] if delete_vllm else [])]
        deleted_at = time.monotonic()
        k.run("delete", "pod", *names, "-n", ns, "--wait=false")
        if delete_server:
            server = in_pod(server_ip(k, ns, exclude_uid=old_server))
        if delete_vllm:
            vllm = vllm_pod(k, ns, exclude={vllm["metadata"]["name"]}, timeout=600)
        ready = wait_ready(server, seen, lambda: pod_log(env, vllm["metadata"]["name"]))
        cases[label] = after_restart(vllm["status"]["podIP"], text, mid, server, args.repeats, args.settle, deleted_at, ready)

    restart("vLLM restarted", True, False)
    order = ("server", "both") if args.order == "server-first" else ("both", "server")
    for cycle in range(1, args.cycles + 1):
        suffix = f" #{cycle}" if args.cycles > 1 else ""
        for which in order:
            restart(f"{which} restarted{suffix}", which == "both", True)
    assert pod(k, ns, f"{NAME}-vllm-") is not None
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-words", type=int, default=3400, help="pseudo-words in each prompt (3400: ~6.2k tokens)")
    ap.add_argument("--cold-prompts", type=int, default=5, help="distinct cold prompts timed; cold TTFT is their median")
    ap.add_argument("--repeats", type=int, default=3, help="requests after the first one after each restart")
    ap.add_argument("--cycles", type=int, default=1, help="how many times each server restart case runs")
    ap.add_argument("--order", choices=("server-first", "both-first"), default="server-first",
                    help="which restart case of each cycle runs first")
    ap.add_argument("--settle", type=float, default=60.0,
                    help="seconds to wait at most for a quiet machine before each cold request and each first request")
    ap.add_argument("--summarize", type=Path, default=None,
                    help="print the tables of an earlier run from its JSON line (the last line it printed), and exit")
    args = ap.parse_args()
    if args.summarize is not None:
        print("\n".join(summary(json.loads(args.summarize.read_text()), f"from {args.summarize.name}")))
        return
    if args.cold_prompts < 1:
        ap.error("--cold-prompts must be at least 1")

    k, model, hf_home, running = bench_setup()
    texts = [prompt(SEED + i, args.prompt_words) for i in range(args.cold_prompts)]
    try:
        with tempfile.TemporaryDirectory() as tmp, kvpersist_env(k, Path(tmp), vllm=model["vllm"], hf_home=hf_home) as env:
            cases = run_cases(k, env, model, texts, args)
    finally:
        if not running:
            subprocess.run([*LOCALCLUSTER, "down"], check=False, timeout=120)
    data = {"format": FORMAT, "run": {"prompt_words": args.prompt_words, "cold_prompts": args.cold_prompts,
                                      "repeats": args.repeats, "cycles": args.cycles, "order": args.order,
                                      "settle_s": args.settle}, "cases": cases}
    print("\n".join(summary(data, f"restart cases {args.order}")))
    print(json.dumps(data))


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


def upgrade(old: dict) -> dict:
    """A run's JSON from before issue 41 in today's shape. Its cold was one request. Its server and
    both restart cases resent the prompt, untimed, until one hit, so no recorded request is the
    first after the restart (first: None); its vLLM restart's first request was. The repeats are
    the requests after the first recorded one, as that run's medians were. Dropped: its background
    CPU (read before the repeats, not the first request), `first_hit_after_s` and
    `delete_to_cached_answer_s` (both ran past the settle wait and the repeats)."""
    cases: dict[str, dict] = {}
    for label, r in old.items():
        reqs = r.get("requests") or [{"ttft_s": r["ttft_s"], "tokens": r["prompt_tokens"], "from_cache": r["from_cache"],
                                      "l1": 0, "l2": 0}]
        if label == "cold":
            cases[label] = {**r, "ttft_s": reqs[0]["ttft_s"], "requests": reqs[:1]}
            continue
        first = reqs[0] if label.startswith("vLLM") else None
        rest = reqs[1:]
        cases[label] = {"first": first, "repeats": rest, "ttft_first_s": first["ttft_s"] if first else None,
                        "ttft_repeats_s": statistics.median(q["ttft_s"] for q in rest) if rest else None,
                        "background_cpu": None, "prompt_tokens": r["prompt_tokens"],
                        "from_cache": r["from_cache"], "computed": r["computed"], "delete_to_ready_s": None,
                        "settle_s": None, "delete_to_first_token_s": None}
    return {"format": 1, "run": {}, "cases": cases}


def tier(req: dict) -> str:
    """Where lmcache served a request from: its L1 and L2 hit tokens, or that nothing was."""
    return f"L1 {req['l1']}, L2 {req['l2']}" if req["l1"] or req["l2"] else "none (computed)"


def tiers(reqs: list[dict]) -> str:
    """Each distinct tier of the requests, with how many had it."""
    counts: dict[str, int] = {}
    for q in reqs:
        counts[tier(q)] = counts.get(tier(q), 0) + 1
    return "; ".join(f"{t} x{n}" for t, n in sorted(counts.items()))


def spread(xs: list[float]) -> tuple[float, float, float, float]:
    """min, first quartile, third quartile, max."""
    q1, _, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0], 0.0, xs[0])
    return min(xs), q1, q3, max(xs)


def num(x: float | None, fmt: str, width: int) -> str:
    """A figure in a column, or '-' where the run has none."""
    return format(x, fmt).rjust(width) if x is not None else "-".rjust(width)


def summary(data: dict, how: str) -> list[str]:
    """The tables of a run (this format or upgrade()'s): cold, each restart's first request, the
    repeats after it, and whether the restart cases' repeats differ at all (Kruskal-Wallis)."""
    if "format" not in data:
        data = upgrade(data)
    cases = data["cases"]
    c = cases["cold"]
    cold_s = c["ttft_s"]
    restarts = {label: r for label, r in cases.items() if label != "cold"}
    out = [f"model kvpersist/bench-llama, prompt {c['prompt_tokens']} tokens, {how}"]
    each, n = ", ".join(f"{q['ttft_s']:.3f}" for q in c["requests"]), len(c["requests"])
    out.append(f"cold: {n} distinct prompt{'s' if n > 1 else ''}, none cached; TTFT median {cold_s:.3f} s (each: {each}; "
               f"tokens {', '.join(str(q['tokens']) for q in c['requests'])}); 'x cold' below is against this median")
    if data["format"] < FORMAT:
        out.append("(a run from before issue 41: cold is one request; the server and both restart cases have no first "
                   "request after the restart, as the prompt was resent untimed until it hit; no restart timings)")
    out += ["", "first request of the prompt after the restart (none of the prompt before it):",
            f"{'case':20s} {'TTFT s':>7s} {'x cold':>6s} {'x rep med':>9s} {'bg cpu':>6s} {'computed':>8s} {'cached':>6s} "
            f"{'delete->ready s':>15s} {'settle s':>8s} {'delete->1st token s':>19s}  tier"]
    for label, r in restarts.items():
        first, rep = r["first"], r["ttft_repeats_s"]
        bg = f"{r['background_cpu']:.0%}" if r.get("background_cpu") is not None else "-"
        ratio = first["ttft_s"] / rep if first and rep else None
        out.append(f"{label:20s} {num(r['ttft_first_s'], '.3f', 7)} "
                   f"{num(r['ttft_first_s'] / cold_s if first else None, '.2f', 6)} {num(ratio, '.2f', 9)} {bg:>6s} "
                   f"{num(r['computed'] if first else None, 'd', 8)} {num(r['from_cache'] if first else None, 'd', 6)} "
                   f"{num(r['delete_to_ready_s'], '.1f', 15)} {num(r['settle_s'], '.1f', 8)} "
                   f"{num(r['delete_to_first_token_s'], '.1f', 19)}  {tier(first) if first else '-'}")
    out += ["  TTFT s: that request's time to first token; x rep med: against the median of the repeats after it.",
            "  delete->ready s: `kubectl delete pod` to the restarted pods Ready, vLLM registered with the server and its",
            "  connector healthy (pod restart; no request sent). settle s: the wait for a quiet machine after that.",
            "  delete->1st token s: delete->ready + settle + TTFT. tier: the server's hit tokens for that request.",
            "", "repeats after it (sent at once, same prompt):",
            f"{'case':20s} {'n':>3s} {'median s':>8s} {'x cold':>6s} {'x best':>6s} "
            f"{'min':>6s} {'q1':>6s} {'q3':>6s} {'max':>6s}  tiers"]
    repeats = {label: [q["ttft_s"] for q in r["repeats"]] for label, r in restarts.items() if r["repeats"]}
    best = min((statistics.median(x) for x in repeats.values()), default=None)
    for label, r in restarts.items():
        xs = repeats.get(label)
        if not xs:
            out.append(f"{label:20s} {0:3d}")
            continue
        med = statistics.median(xs)
        lo, q1, q3, hi = spread(xs)
        out.append(f"{label:20s} {len(xs):3d} {med:8.3f} {med / cold_s:6.2f} {med / best:6.2f} {lo:6.2f} {q1:6.2f} {q3:6.2f} "
                   f"{hi:6.2f}  {tiers(r['repeats'])}")
    if len(repeats) > 1:
        worst = max(statistics.median(x) for x in repeats.values())
        out.append(f"repeats' median TTFT, worst restart case / best: {worst / best:.2f} (target <= 1.2)")
    if len(repeats) > 1 and all(len(x) > 1 for x in repeats.values()):
        h, df, p = kruskal_wallis(repeats)
        out.append(f"do the restart cases differ? Kruskal-Wallis over their repeats: H {h:.2f}, df {df}, p {p:.2f} "
                   f"({'yes' if p < 0.05 else 'no'} at 5%)")
    return out


if __name__ == "__main__":
    main()
