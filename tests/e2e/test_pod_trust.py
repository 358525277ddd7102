"""Credentials go only to the operator's own pods (issue 42, item 3), on the real API server with a
real lmcache server and inventory agent under hack/kubelet_runner.py.

Status, gc and orphan expiry send the resource's agent token to the pods they find, and the canary
and prewarm send the vLLM API key: they used to find them by labels alone, which anyone who may
create a pod can copy. Here a tenant's pod carries the servers' labels (kwok runs it, with a
loopback pod IP of its own on a kwok node), and a small HTTP server in this test process listens
on that IP and the agent port, recording every request and its Authorization header: across
several status rounds and an explicit `kvpersist gc` of an orphaned namespace it is sent nothing,
while the real agent keeps answering with the token (status.inventory and status.usage come from
it, and it deletes the orphan gc names), and the operator's log names the pod it left out. The
canary and prewarm (the vLLM API key, sent to vLLM pods) are not run here: they need vLLM pods
serving (tests/e2e/test_canary.py, test_prewarm.py).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvpersist.api.v1alpha1 import KVCacheNamespace
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, kvpersist_env, manifest, more_rounds

pytestmark = pytest.mark.e2e

KWOK_NODE = "kwok-cpu-0"  # kwok marks its pods Running with a loopback IP and runs nothing: this test listens there
TENANT_POD = "tenant-lookalike"  # not `<statefulset>-<n>`: the StatefulSet controller never adopts it


@contextmanager
def recorder(ip: str, port: int) -> Iterator[list[tuple[str, str, str | None]]]:
    """An HTTP server on the tenant pod's IP and the agent port: every request's (method, path,
    Authorization header), answered 404."""
    seen: list[tuple[str, str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def _record(self) -> None:
            seen.append((self.command, self.path, self.headers.get("Authorization")))
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = _record

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer((ip, port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _pod(kubectl: Kubectl, ns: str, name: str) -> dict[str, Any] | None:
    out = kubectl.run("get", "pod", name, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def _running_ip(kubectl: Kubectl, ns: str, name: str) -> str | None:
    pod = _pod(kubectl, ns, name) or {}
    status = pod.get("status") or {}
    return status.get("podIP") if status.get("phase") == "Running" else None


def test_a_tenant_pod_with_the_servers_labels_is_sent_no_token(kubectl: Kubectl, crd: None, tmp_path: Path) -> None:
    with kvpersist_env(kubectl, tmp_path) as env:
        ns = env.ns
        obj = manifest(ns)
        agent_port = KVCacheNamespace.model_validate(obj).spec.lmcache_server.agent_port
        kubectl.apply(obj)
        status = lambda: kubectl.get("kvns", NAME, ns).get("status") or {}  # noqa: E731
        wait_for("Ready, with the real agent's inventory", lambda: status().get("phase") == "Ready"
                 and status().get("inventory"), timeout=240, interval=1)
        server = _pod(kubectl, ns, f"{NAME}-lmcache-0")
        assert server is not None
        token = base64.b64decode(kubectl.get("secret", f"{NAME}-agent-token", ns)["data"]["token"]).decode().strip()

        # The tenant's pod: every kvpersist label of the real server (not the StatefulSet's own).
        labels = {k: v for k, v in server["metadata"]["labels"].items()
                  if k.startswith(("app.kubernetes.io/", "kvpersist.dev/"))}
        kubectl.run("create", "-f", "-", stdin=json.dumps({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": TENANT_POD, "namespace": ns, "labels": labels},
            "spec": {"nodeName": KWOK_NODE, "automountServiceAccountToken": False,
                     "containers": [{"name": "agent", "image": "registry.example/tenant:1",
                                     "ports": [{"containerPort": agent_port}]}]}}))
        ip = wait_for(f"{TENANT_POD} Running with a pod IP", lambda: _running_ip(kubectl, ns, TENANT_POD), timeout=120)
        # An orphaned namespace on the real server's volume, for gc to delete while the look-alike is there.
        orphan = "kvp-" + uuid.uuid4().hex
        (env.volume() / orphan).mkdir()
        (env.volume() / orphan / "chunk").write_bytes(b"\0" * 4096)
        with recorder(ip, agent_port) as requests:
            more_rounds(env.operator, ns, NAME, rounds=4)  # the first may have begun before the recorder listened
            # gc sends the token to the resource's agents: only the real one is asked, and it answers.
            gc = subprocess.run([sys.executable, "-m", "kvpersist.cli", "gc", orphan, "-n", ns, "--no-dry-run",
                                 "--kubeconfig", str(kubectl.kubeconfig)], capture_output=True, text=True, timeout=240)
            assert gc.returncode == 0, gc.stdout + gc.stderr
            assert not (env.volume() / orphan).exists(), gc.stdout  # deleted by the real agent, during the window
            more_rounds(env.operator, ns, NAME, rounds=1)
            sent = list(requests)
        assert not any(token in (auth or "") for _, _, auth in sent), sent
        assert sent == [], sent  # nothing at all: it is not one of the resource's servers

        # The real agent is still asked, with the token: status is fresh, and counts only its own pod.
        before = kubectl.get("kvns", NAME, ns)["status"]
        assert before.get("phase") == "Ready" and before.get("inventory"), before
        assert (before.get("usage") or {}).get("l1CapacityBytes"), before.get("usage")  # the real server's /status
        assert TENANT_POD in env.log.read_text()  # the operator says which pod it left out, and why
