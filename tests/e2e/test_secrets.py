"""A known token planted in the Secret of an hfBucket resource must appear nowhere else: not in
any object of the cluster (args, env values, ConfigMaps, status, events), not in the operator's
log. And the lmcache servers' dangerous admin routes stay shut: /run_script is off, and the
admin port is open to the operator alone (NetworkPolicy)."""

from __future__ import annotations

import base64
import os
import secrets
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.cases.invalid_manifests import sample
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import ADMIN_PORT, NAME, Runner, RunnerThread, in_pod, manifest, stop, storage
from tests.integration.hub_stub import HubStub

pytestmark = [pytest.mark.e2e, pytest.mark.datapath]


def lmcache_admin_is_closed(kubectl: Kubectl, namespace: str, server_ip: str) -> str:
    """lmcache's admin API serves /env (the whole environment: a bucket's HF token) and
    /cache/clear without authentication. From another pod's IP its port on the server's pod IP is
    closed, and the agent (the pod's one HTTP port) forwards none of it; inside the pod (the
    runner's stand-in for its loopback) it answers, so this is what the loopback bind keeps in."""
    others = [p["status"]["podIP"] for p in kubectl.get("pods", namespace=namespace)["items"]
              if p.get("status", {}).get("podIP") not in (None, server_ip)]
    assert others, "no other pod IP in the namespace to try from"
    source = others[0]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((server_ip, ADMIN_PORT), timeout=5, source_address=(source, 0)).close()
    with socket.create_connection((server_ip, 8090), timeout=5, source_address=(source, 0)):
        pass  # the agent's port is open to that pod (no CNI here): it must refuse the rest itself
    refused = {}
    for path in ("/env", "/server/env", "/server/../env", "/cache/clear", "/server/cache/clear", "/server/quota"):
        try:
            with urllib.request.urlopen(f"http://{server_ip}:8090{path}", timeout=10) as resp:
                refused[path] = resp.status
        except urllib.error.HTTPError as exc:
            refused[path] = exc.code
    assert set(refused.values()) == {404}, refused
    with urllib.request.urlopen(f"{in_pod(server_ip)}/env", timeout=10) as resp:  # control: inside the pod it answers
        assert resp.status == 200 and b"NUMBA_CACHE_DIR" in resp.read()
    return (f"lmcache's admin port {server_ip}:{ADMIN_PORT} refused a connection from pod IP {source}; the agent's port "
            f"answered 404 to {', '.join(refused)}; inside the pod /env answered 200")


def test_planted_token_leaks_nowhere(kubectl: Kubectl, crd: None, tmp_path: Path, fault_log) -> None:
    token = "hf_" + secrets.token_hex(16)
    encoded = base64.b64encode(token.encode()).decode()
    bucket_ns, nvme_ns, operator_ns = (f"e2e-{uuid.uuid4().hex[:8]}" for _ in range(3))
    for ns in (bucket_ns, nvme_ns, operator_ns):
        kubectl.run("create", "namespace", ns)
    kubectl.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-kv-writer", "namespace": bucket_ns},
                   "type": "Opaque", "data": {"token": encoded}})
    kubectl.apply(storage(nvme_ns))
    log = tmp_path / "operator.log"
    runner = Runner(kubectl.kubeconfig, nvme_ns, tmp_path / "pods", kubectl=str(kubectl.binary),
                    lmcache=str(Path(sys.executable).parent / "lmcache"))
    with HubStub(existing={"acme-ml/kv-cache"}, token=token) as hub:
        env = {"KUBECONFIG": str(kubectl.kubeconfig), "HF_ENDPOINT": hub.url, "KVPERSIST_OPERATOR_NAMESPACE": operator_ns}
        with log.open("ab") as out:  # cluster-wide, as the chart runs it
            operator = subprocess.Popen([sys.executable, "-m", "kvpersist.cli", "run", "--standalone", "--verbose"],
                                        stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                        start_new_session=True)
        try:
            with RunnerThread(runner):
                bucket = sample("hf-bucket")
                bucket["metadata"]["namespace"] = bucket_ns
                kubectl.apply(bucket)
                kubectl.apply(manifest(nvme_ns))
                wait_for("the bucket preflight to pass", lambda: any(
                    c["type"] == "L2Ready" and c["reason"] == "BucketReachable"
                    for c in (kubectl.get("kvns", "qwen25-7b-bucket", bucket_ns).get("status") or {}).get("conditions", [])),
                    timeout=90)
                wait_for("the NVMe resource Ready", lambda: (kubectl.get("kvns", NAME, nvme_ns).get("status") or {}).get(
                    "phase") == "Ready", timeout=180)
                assert token in hub.seen_tokens  # it did reach the Hub, from the Secret

                ip = kubectl.get("pod", f"{NAME}-lmcache-0", nvme_ns)["status"]["podIP"]
                admin = lmcache_admin_is_closed(kubectl, nvme_ns, ip)
                # ... and the operator still reads health and usage, through the agent with its token.
                wait_for("usage in status", lambda: ((kubectl.get("kvns", NAME, nvme_ns).get("status") or {}).get(
                    "usage") or {}).get("l1CapacityBytes", 0) > 0, timeout=60)
                request = urllib.request.Request(f"{in_pod(ip)}/run_script", data=b'{"script": "print(1)"}',
                                                 method="POST", headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=10) as resp:
                        run_script = resp.status
                except urllib.error.HTTPError as exc:
                    run_script = exc.code
                assert run_script in (403, 404, 405), f"/run_script answered {run_script}"

                resources = kubectl.run("api-resources", "--verbs=list", "-o", "name").stdout.split()
                resources = [r for r in resources if r not in ("secrets",)]
                dump = kubectl.run("get", ",".join(resources), "-A", "-o", "json", timeout=120).stdout
                hits = [t for t in (token, encoded) if t in dump]
                log_hits = [t for t in (token, encoded) if t in log.read_text()]
                assert hits == [] and log_hits == []

                [pol] = [p for p in kubectl.get("networkpolicies", namespace=nvme_ns)["items"]  # the id's, one
                         if p["metadata"]["labels"].get("app.kubernetes.io/instance") == NAME]
                # The inventory agent (it can delete an orphaned namespace): the operator only. lmcache's
                # admin API needs no rule: it is on the pod's loopback.
                agent = [r for r in pol["spec"]["ingress"] if r["ports"] == [{"protocol": "TCP", "port": 8090}]]
                assert agent and agent[0]["from"] == [{
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_ns}},
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvpersist-operator"}}}]
        finally:
            stop(operator)
            for ns in (bucket_ns, nvme_ns, operator_ns):
                kubectl.run("delete", "namespace", ns, "--wait=false", check=False)
            kubectl.run("delete", "pv", f"{nvme_ns}-pv", "--wait=false", check=False)
            kubectl.run("delete", "storageclass", f"{nvme_ns}-nvme", check=False)
    fault_log("a known Hugging Face token planted in a Secret, full flow run (preflight, real server, verbose log)",
              f"0 hits for the token or its base64 in {len(resources)} listable resource types across all namespaces "
              f"(Secrets aside) and in the operator's verbose log; the Hub got it; /run_script answered {run_script}; "
              f"{admin}; the inventory agent's port admits only the operator's namespace and pods")


def _condition(kubectl: Kubectl, namespace: str, name: str, type_: str) -> dict | None:
    status = kubectl.get("kvcachenamespaces", name, namespace).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


def test_a_missing_secret_or_configmap_is_named_in_a_condition(kubectl: Kubectl, operator: Path, namespace: str) -> None:
    """Issue 42 item 7: an envFrom ConfigMap, an API-key Secret and a pull Secret that do not exist
    leave pods that never start and, before, a status that said only "0/1 pods ready". Now
    ReferencesFound names each one, Ready's reason points at it, a Warning Event says so once, and
    creating them turns the condition True (the caches see them within a round)."""
    obj = sample()
    obj["metadata"]["namespace"] = namespace
    obj["spec"]["vllm"]["envFrom"] = [{"configMapRef": {"name": "vllm-env"}}]
    obj["spec"]["vllm"]["apiKeySecretRef"] = {"name": "vllm-api-key"}
    obj["spec"]["imagePullSecrets"] = [{"name": "registry-creds"}]
    kubectl.apply(obj)
    name = obj["metadata"]["name"]
    missing = wait_for("ReferencesFound False", lambda: (c := _condition(kubectl, namespace, name, "ReferencesFound"))
                       and c["status"] == "False" and c, 90,
                       explain=lambda: str(kubectl.get("kvcachenamespaces", name, namespace).get("status")))
    assert missing["reason"] == "ReferenceMissing"
    for field, kind, ref in (("spec.vllm.envFrom[0].configMapRef", "ConfigMap", "vllm-env"),
                             ("spec.vllm.apiKeySecretRef", "Secret", "vllm-api-key"),
                             ("spec.imagePullSecrets[0]", "Secret", "registry-creds")):
        assert f"{field} names {kind} {ref}, which does not exist in {namespace}" in missing["message"], missing
    ready = _condition(kubectl, namespace, name, "Ready")
    assert ready is not None and ready["reason"] == "ReferenceMissing", ready
    # Posted right after the status write that carries the condition: a moment later, not with it.
    wait_for("the ReferenceMissing Warning event", lambda: [
        e for e in kubectl.get("events", namespace=namespace)["items"]
        if e.get("reason") == "ReferenceMissing" and "vllm-api-key" in e.get("message", "")], 30,
        explain=lambda: str(kubectl.get("events", namespace=namespace)["items"])[-2000:])
    # The objects appear: the condition follows (the watch caches, no read per round).
    kubectl.run("create", "configmap", "vllm-env", "--from-literal=VLLM_LOGGING_LEVEL=INFO", "-n", namespace)
    kubectl.run("create", "secret", "generic", "vllm-api-key", "--from-literal=api-key=k", "-n", namespace)
    kubectl.run("create", "secret", "docker-registry", "registry-creds", "--docker-server=registry.example.com",
                "--docker-username=u", "--docker-password=p", "-n", namespace)
    found = wait_for("ReferencesFound True", lambda: (c := _condition(kubectl, namespace, name, "ReferencesFound"))
                     and c["status"] == "True" and c, 90)
    assert found["reason"] == "AllFound"
