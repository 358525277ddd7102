#!/usr/bin/env python3
"""The demo's proof, asserted: a long prompt to the resource's real vLLM, the vLLM pod deleted, the
same prompt to its replacement. Each claim the demo prints is checked, and any that does not hold,
or any wait that runs out, exits non-zero saying which:
  - the first answer is cold: vLLM got 0 tokens from outside (`vllm:external_prefix_cache_hits`)
    and lmcache's own lookup counters (L1 and L2, read from the servers' `/metrics` through their
    agents) did not move. The prompt is drawn from --seed (a fresh one each run), so a rerun on
    retained L2 is cold too rather than passing on last run's KV;
  - the new pod's answer is served from cache: vLLM's external hits are every whole chunk of the
    prompt, lmcache counted at least as many hit tokens (L1 + L2), and the greedy continuation
    (token by token, with its logprobs) is the one computed cold;
  - status.hits then counts them.
tests/e2e/test_real_vllm.py runs this script on the e2e cluster (with --json), so the suite checks
what the demo shows. Standard library and kubectl only.

    python3 hack/demo_prompt.py --name tiny-llama [--namespace default] [--kubeconfig PATH] [--seed N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

WAIT_S = 300  # a new vLLM pod (three processes importing torch on this CPU) is Ready within it
HITS_WAIT_S = 150  # status.hits is written at most once a minute when only the figures change
CHUNK = 256  # lmcache's chunk in tokens: a hit is whole chunks
GREEDY_TOKENS = 8
PROMPT_WORDS = 1300  # about 2,400 tokens of the test tokenizer
VLLM_PORT = 8000
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
LMCACHE_HITS = ("lmcache_mp_lookup_hit_l1_tokens_total", "lmcache_mp_lookup_hit_l2_tokens_total")


class DemoFailed(Exception):
    """A claim of the demo that did not hold, or a wait that ran out."""


@dataclass
class Answer:
    pod: str
    prompt_tokens: int
    external_hits: int  # vLLM's own count of tokens it got from the cache for this prompt
    lmcache_l1: int  # lmcache's hit tokens for it, by tier (the resource's servers, summed)
    lmcache_l2: int
    seconds: float
    tokens: list[str]  # the greedy continuation
    logprobs: list[float]


def prompt(seed: int, words: int = PROMPT_WORDS) -> str:
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    return " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(words)) + "."


def cacheable(prompt_tokens: int) -> int:
    """The tokens a hit serves: whole chunks, and never the last token (vLLM computes at least one)."""
    return (prompt_tokens - 1) // CHUNK * CHUNK


def kubectl(args: argparse.Namespace, *cmd: str) -> str:
    base = [args.kubectl, "-n", args.namespace] + ([f"--kubeconfig={args.kubeconfig}"] if args.kubeconfig else [])
    return subprocess.run([*base, *cmd], check=True, capture_output=True, text=True, timeout=60).stdout


def _ready(pod: dict) -> bool:
    conds = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds) and not pod["metadata"].get("deletionTimestamp")


def ready_vllm_pod(args: argparse.Namespace, exclude: str = "") -> dict:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for pod in json.loads(kubectl(args, "get", "pods", "-o", "json"))["items"]:
            if pod["metadata"]["name"].startswith(f"{args.name}-vllm-") and pod["metadata"]["name"] != exclude and _ready(pod):
                return pod
        time.sleep(1)
    raise DemoFailed(f"no Ready vLLM pod of {args.name} within {WAIT_S}s: see the runner's and the operator's logs")


def server_metrics_urls(args: argparse.Namespace, namespace_id: str) -> list[str]:
    """lmcache's /metrics of each Ready server of the namespace id, as its agent forwards them
    (lmcache's admin API listens on the pod's loopback only)."""
    selector = (f"app.kubernetes.io/instance={args.name},app.kubernetes.io/component=lmcache-server,"
                f"kvpersist.dev/namespace-id={namespace_id}")
    urls = []
    for pod in json.loads(kubectl(args, "get", "pods", "-l", selector, "-o", "json"))["items"]:
        ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", []) if p.get("name") == "agent"]
        if _ready(pod) and ports:
            urls.append(f"http://{pod['status']['podIP']}:{ports[0]}/server/metrics")
    if not urls:
        raise DemoFailed(f"no Ready lmcache server of {namespace_id}: its hit counters cannot be read")
    return urls


def scrape(url: str, names: tuple[str, ...]) -> list[float]:
    """The named samples of a Prometheus text page, each summed over its labels."""
    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return [sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.split("{", 1)[0].split(" ", 1)[0] == name)
            for name in names]


def lmcache_hits(urls: list[str]) -> tuple[float, float]:
    per_server = [scrape(url, LMCACHE_HITS) for url in urls]
    return sum(s[0] for s in per_server), sum(s[1] for s in per_server)


def ask(pod: dict, model: str, text: str, servers: list[str]) -> Answer:
    """The prompt, greedy, and what each side counted for it."""
    ip = pod["status"]["podIP"]
    vllm_metrics = f"http://{ip}:{VLLM_PORT}/metrics"
    [before] = scrape(vllm_metrics, (EXTERNAL_HITS,))
    l1_before, l2_before = lmcache_hits(servers)
    body = json.dumps({"model": model, "prompt": text, "max_tokens": GREEDY_TOKENS, "temperature": 0.0, "logprobs": 1}).encode()
    req = urllib.request.Request(f"http://{ip}:{VLLM_PORT}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    seconds = time.monotonic() - t0
    [after] = scrape(vllm_metrics, (EXTERNAL_HITS,))
    l1, l2 = lmcache_hits(servers)
    choice = out["choices"][0]["logprobs"]
    return Answer(pod["metadata"]["name"], out["usage"]["prompt_tokens"], int(after - before), int(l1 - l1_before),
                  int(l2 - l2_before), seconds, choice["tokens"], choice["token_logprobs"])


def check_cold(cold: Answer) -> None:
    if cold.external_hits or cold.lmcache_l1 or cold.lmcache_l2:
        raise DemoFailed(f"the first answer was not cold: vLLM got {cold.external_hits} tokens from outside, lmcache counted "
                         f"L1 {cold.lmcache_l1} and L2 {cold.lmcache_l2} hit tokens; a prompt of another --seed is cold")
    if cold.prompt_tokens <= 2 * CHUNK:
        raise DemoFailed(f"a {cold.prompt_tokens}-token prompt holds too few whole {CHUNK}-token chunks to show a hit")


def check_warm(cold: Answer, warm: Answer) -> None:
    want = cacheable(warm.prompt_tokens)
    if warm.prompt_tokens != cold.prompt_tokens:
        raise DemoFailed(f"the same prompt counted {cold.prompt_tokens} tokens, then {warm.prompt_tokens}")
    if warm.external_hits != want:
        raise DemoFailed(f"the new pod got {warm.external_hits} tokens from the cache, not the prompt's {want} in whole chunks")
    if warm.lmcache_l1 + warm.lmcache_l2 < want:
        raise DemoFailed(f"lmcache counted L1 {warm.lmcache_l1} + L2 {warm.lmcache_l2} hit tokens, fewer than vLLM's {want}")
    if (warm.tokens, warm.logprobs) != (cold.tokens, cold.logprobs):
        raise DemoFailed(f"the answer served from cache differs from the one computed: {warm.tokens} {warm.logprobs} "
                         f"vs {cold.tokens} {cold.logprobs}")


def wait_status_hits(args: argparse.Namespace, at_least: int) -> dict[str, Any]:
    """status.hits once it counts the hit (it follows the servers' counters)."""
    deadline = time.monotonic() + HITS_WAIT_S
    hits: dict[str, Any] = {}
    while time.monotonic() < deadline:
        hits = json.loads(kubectl(args, "get", "kvns", args.name, "-o", "json")).get("status", {}).get("hits") or {}
        if hits.get("hitTokens", 0) >= at_least:
            return hits
        time.sleep(2)
    raise DemoFailed(f"status.hits did not count the {at_least} hit tokens within {HITS_WAIT_S}s (last: {hits})")


def run(args: argparse.Namespace) -> dict[str, Any]:
    obj = json.loads(kubectl(args, "get", "kvns", args.name, "-o", "json"))
    model, namespace_id = obj["spec"]["identity"]["modelId"], (obj.get("status") or {}).get("namespaceId")
    if not namespace_id:
        raise DemoFailed(f"{args.name} has no namespace id in status: the cache is off (kubectl describe kvns {args.name})")
    text = prompt(args.seed)
    servers = server_metrics_urls(args, namespace_id)

    pod = ready_vllm_pod(args)
    cold = ask(pod, model, text, servers)
    print(f"[demo] {cold.pod}: a {cold.prompt_tokens}-token prompt (seed {args.seed}), {cold.external_hits} tokens from "
          f"cache (lmcache hits L1 {cold.lmcache_l1}, L2 {cold.lmcache_l2}), answered in {cold.seconds:.2f} s", flush=True)
    check_cold(cold)
    print(f"[demo] deleting {cold.pod}: its process and its memory go; the lmcache server keeps the KV", flush=True)
    kubectl(args, "delete", "pod", cold.pod, "--wait=false")
    new = ready_vllm_pod(args, exclude=cold.pod)
    warm = ask(new, model, text, servers)
    print(f"[demo] {warm.pod} (new pod): the same prompt, {warm.external_hits} of {warm.prompt_tokens} tokens served from "
          f"cache (vLLM external_prefix_cache_hits; lmcache hits L1 {warm.lmcache_l1}, L2 {warm.lmcache_l2}), the same "
          f"{len(warm.tokens)} greedy tokens as computed cold, answered in {warm.seconds:.2f} s", flush=True)
    check_warm(cold, warm)
    hits = wait_status_hits(args, warm.lmcache_l1 + warm.lmcache_l2)
    print(f"[demo] status.hits: {hits['hitTokens']} of {hits['lookupTokens']} looked-up tokens served from cache "
          f"(L1 {hits['hitTokensL1']}, L2 {hits['hitTokensL2']}), {hits.get('summary')}", flush=True)
    return {"namespaceId": namespace_id, "seed": args.seed, "cacheable": cacheable(warm.prompt_tokens), "cold": asdict(cold),
            "warm": asdict(warm), "statusHits": hits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True)
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--kubeconfig", default="")
    ap.add_argument("--kubectl", default="kubectl")
    ap.add_argument("--seed", type=int, default=None, help="the prompt's seed (default: a fresh one, printed)")
    ap.add_argument("--json", type=Path, default=None, help="also write what was measured to this file")
    args = ap.parse_args()
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(10**6)
    try:
        summary = run(args)
    except (DemoFailed, subprocess.SubprocessError, OSError, KeyError, ValueError) as exc:
        sys.exit(f"[demo] FAILED: {exc}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
