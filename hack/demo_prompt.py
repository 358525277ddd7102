#!/usr/bin/env python3
"""The demo's proof: a long prompt to the resource's real vLLM, the vLLM pod deleted, the same
prompt to its replacement, and the tokens the new pod got from the cache instead of computing
(vLLM's own `vllm:external_prefix_cache_hits_total`). Standard library and kubectl only.

    python3 hack/demo_prompt.py --name tiny-llama [--namespace default] [--kubeconfig PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import urllib.request

WAIT_S = 300


def kubectl(args: argparse.Namespace, *cmd: str) -> str:
    base = ["kubectl", "-n", args.namespace] + ([f"--kubeconfig={args.kubeconfig}"] if args.kubeconfig else [])
    return subprocess.run([*base, *cmd], check=True, capture_output=True, text=True, timeout=60).stdout


def ready_vllm_pod(args: argparse.Namespace, exclude: str = "") -> dict:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for pod in json.loads(kubectl(args, "get", "pods", "-o", "json"))["items"]:
            meta, status = pod["metadata"], pod.get("status", {})
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
            if meta["name"].startswith(f"{args.name}-vllm-") and meta["name"] != exclude and ready \
                    and not meta.get("deletionTimestamp"):
                return pod
        time.sleep(1)
    sys.exit(f"no Ready vLLM pod of {args.name} within {WAIT_S}s: see the runner's and the operator's logs")


def external_hits(ip: str) -> float:
    with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:external_prefix_cache_hits_total"))


def ask(ip: str, model: str, text: str) -> tuple[int, int, float]:
    """Prompt tokens, tokens vLLM got from the cache, seconds to the answer."""
    before = external_hits(ip)
    body = json.dumps({"model": model, "prompt": text, "max_tokens": 1, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://{ip}:8000/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        usage = json.loads(r.read())["usage"]
    return usage["prompt_tokens"], int(external_hits(ip) - before), time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True)
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--kubeconfig", default="")
    args = ap.parse_args()
    obj = json.loads(kubectl(args, "get", "kvns", args.name, "-o", "json"))
    model = obj["spec"]["identity"]["modelId"]
    rng = random.Random(2026)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    text = " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(1300)) + "."

    pod = ready_vllm_pod(args)
    tokens, cached, secs = ask(pod["status"]["podIP"], model, text)
    print(f"[demo] {pod['metadata']['name']}: a {tokens}-token prompt, {cached} tokens from cache, answered in {secs:.2f} s")
    print(f"[demo] deleting {pod['metadata']['name']}: its process and its memory go; the lmcache server keeps the KV")
    kubectl(args, "delete", "pod", pod["metadata"]["name"], "--wait=false")
    new = ready_vllm_pod(args, exclude=pod["metadata"]["name"])
    tokens, cached, secs = ask(new["status"]["podIP"], model, text)
    print(f"[demo] {new['metadata']['name']} (new pod): the same prompt, {cached} of {tokens} tokens served from cache, "
          f"answered in {secs:.2f} s")
    if cached == 0:
        sys.exit("[demo] no tokens came from the cache: see the runner's log")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # status.hits follows the servers' counters (written at most once a minute)
        hits = json.loads(kubectl(args, "get", "kvns", args.name, "-o", "json")).get("status", {}).get("hits") or {}
        if hits.get("hitTokens", 0) > 0:
            print(f"[demo] status.hits: {hits['hitTokens']} of {hits['lookupTokens']} looked-up tokens served from cache "
                  f"(L1 {hits['hitTokensL1']}, L2 {hits['hitTokensL2']}), {hits.get('summary')}")
            break
        time.sleep(2)


if __name__ == "__main__":
    main()
