"""vLLM keeps serving when its lmcache servers cannot run (kvpersist.controller.fallback), on the local
cluster with the real API server and scheduler: the servers are held unschedulable (a CPU request
no node has), so vLLM, which with the cache needs a server of its id on its node, would stay
Pending forever. After the bound (15 s here, 300 s by default) it is rolled without the cache,
becomes Ready, and the resource says why; once the servers run (the real lmcache server and agent
under hack/kubelet_runner.py) and stay healthy (3 s here), vLLM gets the cache back.

vLLM's pods are simulated by the runner (Ready once scheduled, no model here); what is shown is
the operator's side: what it renders, when, and what status and events say."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, kvpersist_env, manifest

pytestmark = [pytest.mark.e2e, pytest.mark.datapath]

FALLBACK_S, RECOVER_S = 15, 3  # long enough to see the Deployment with the cache first, on a loaded machine


def test_vllm_serves_without_the_cache_while_its_servers_cannot_run_and_gets_it_back(
        kubectl: Kubectl, crd: None, tmp_path: Path, fault_log) -> None:
    env_vars = {"KVPERSIST_CACHE_FALLBACK_S": str(FALLBACK_S), "KVPERSIST_CACHE_RECOVER_S": str(RECOVER_S)}
    with kvpersist_env(kubectl, tmp_path, operator_env=env_vars) as env:
        ns = env.ns
        obj = manifest(ns)
        obj["spec"].setdefault("lmcacheServer", {})["resources"] = {"requests": {"cpu": "5000"}}  # no node has it: Pending
        kubectl.apply(obj)
        applied = time.monotonic()

        def status() -> dict:
            return kubectl.get("kvns", NAME, ns).get("status") or {}

        def cond(kind: str) -> dict:
            return next((c for c in status().get("conditions") or [] if c["type"] == kind), {})

        def vllm_args() -> list[str]:
            """The Deployment's vLLM args; none before the operator has applied it."""
            got = kubectl.run("get", "deployment", f"{NAME}-vllm", "-n", ns, "-o", "json", check=False)
            if got.returncode != 0:
                return []
            return json.loads(got.stdout)["spec"]["template"]["spec"]["containers"][0]["args"]

        def vllm_ready() -> bool:
            pods = kubectl.get("pods", namespace=ns)["items"]
            return any(p["metadata"]["labels"].get("app.kubernetes.io/component") == "vllm"
                       and not p["metadata"].get("deletionTimestamp")
                       and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
                       and ("--kv-transfer-config" in p["spec"]["containers"][0]["args"]) == want_cache
                       for p in pods)

        wait_for("the Deployment rendered with the cache", lambda: "--kv-transfer-config" in vllm_args(), timeout=60)
        want_cache = False
        wait_for("CacheBypassed", lambda: cond("CacheBypassed").get("status") == "True", timeout=90)
        bypassed_after = time.monotonic() - applied
        assert "lmcache servers stayed unavailable" in cond("CacheBypassed")["message"], cond("CacheBypassed")
        assert cond("LMCacheReady")["status"] != "True"
        wait_for("the Deployment rendered without the cache", lambda: "--kv-transfer-config" not in vllm_args(), timeout=30)
        wait_for("a vLLM pod without the cache Ready", vllm_ready, timeout=120)
        serving_after = time.monotonic() - applied
        server = kubectl.get("pod", f"{NAME}-lmcache-0", ns)
        assert server["status"]["phase"] == "Pending"  # the servers were never touched: still as declared
        events = kubectl.get("events", namespace=ns)["items"]
        assert any(e["reason"] == "CacheBypassed" and e["type"] == "Warning" for e in events)

        # The servers can run now: real lmcache and agent on the real node.
        kubectl.run("patch", "kvns", NAME, "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"lmcacheServer": {
            "resources": None}}}))
        released = time.monotonic()
        wait_for("LMCacheReady", lambda: cond("LMCacheReady").get("status") == "True", timeout=240)
        healthy_after = time.monotonic() - released
        want_cache = True
        wait_for("the Deployment with the cache again", lambda: "--kv-transfer-config" in vllm_args(), timeout=60)
        restored_after = time.monotonic() - released
        assert not cond("CacheBypassed")
        wait_for("a vLLM pod with the cache Ready", vllm_ready, timeout=120)
        events = kubectl.get("events", namespace=ns)["items"]
        assert any(e["reason"] == "CacheRestored" for e in events)
    fault_log(f"lmcache server pods held unschedulable (a CPU request no node has); fallback bound {FALLBACK_S} s, "
              f"recovery {RECOVER_S} s (defaults 300 s and 30 s)",
              f"CacheBypassed after {bypassed_after:.1f}s, vLLM without the cache Ready after {serving_after:.1f}s (with "
              f"the cache it stayed Pending); servers released: healthy after {healthy_after:.1f}s, vLLM rendered with the "
              f"cache again after {restored_after:.1f}s, CacheRestored event")
