"""The operator and the kwok lmcache runner as processes, and manifests sized for this machine."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvpersist.api.spec import LMCacheServer
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.target import L2_KEY_BYTES, Target
from kvpersist.controller.runtime import STATUS_INTERVAL_S
from kvpersist.identity import key_fingerprint, resolve
from tests.cases.invalid_manifests import sample
from tests.e2e.kube import REPO, Kubectl, wait_for
from tests.integration.kvdriver import SHAPE_PINS

sys.path.insert(0, str(REPO / "hack"))
from kubelet_runner import CLUSTER_DOMAIN, REAL_NODE, SECOND_NODE, Runner, pod_loopback  # noqa: F401  (CLUSTER_DOMAIN: for conftest)

# lmcache's admin port as the operator renders it for the default spec.lmcacheServer.port.
ADMIN_PORT = LMCacheServer().http_port


def in_pod(pod_ip: str, port: int = ADMIN_PORT) -> str:
    """lmcache's admin API as a process inside the server pod sees it (`kubectl exec ... curl
    127.0.0.1:5556`): it listens on the pod's loopback only. Here that is the runner's stand-in
    for the pod's loopback (hack/kubelet_runner.py, pod_loopback), not the pod IP."""
    return f"http://{pod_loopback(pod_ip)}:{port}"

NAME = "llama31-8b"
REAL_NODE_TAINT = "kvpersist.dev/real-kubelet"  # and a label of both real nodes
SECOND_NODE_TAINT = "kvpersist.dev/second-real-node"  # real-gpu-1 only: tests across nodes tolerate it


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_operator(kubeconfig: Path, namespace: str, log: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """`kvpersist run` on one namespace, its metrics on a loopback port of its own (the process's
    `metrics_url`, for refreshes())."""
    # Strict status: a patch key the status models lack raises (kvpersist.api.status), so a
    # misspelled key fails the e2e test instead of being left out with a log line.
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KVPERSIST_STRICT_STATUS": "1", **(extra_env or {})}
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpersist.cli", "run", "--standalone", "--namespace", namespace,
                                 "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
                                 # kopf's own debug lines (each event, each handling cycle): to see a stuck run
                                 *(["--verbose"] if os.environ.get("KVPERSIST_E2E_OPERATOR_VERBOSE") else [])],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    proc.metrics_url = f"http://127.0.0.1:{port}/metrics"  # type: ignore[attr-defined]
    return proc


def operator_series(proc: subprocess.Popen) -> list[tuple[str, dict[str, str], float]]:
    """The operator's /metrics parsed (prometheus_client's parser): (name, labels, value) of each
    sample; empty while it is not serving."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(proc.metrics_url, timeout=5) as r:  # type: ignore[attr-defined]
            text = r.read().decode()
    except OSError:
        return []
    return [(s.name, dict(s.labels), float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples]


def operator_metrics(proc: subprocess.Popen) -> dict[str, float]:
    """The operator's unlabelled series by name (counters and gauges of the whole operator)."""
    return {name: value for name, labels, value in operator_series(proc) if not labels}


def resource_series(proc: subprocess.Popen, namespace: str, name: str) -> list[tuple[str, dict[str, str], float]]:
    """One resource's series: those labelled with its namespace and name."""
    return [s for s in operator_series(proc) if s[1].get("namespace") == namespace and s[1].get("name") == name]


def refreshes(proc: subprocess.Popen, namespace: str, name: str) -> int:
    """How many status rounds the operator has run for one resource (each after its applies)."""
    return int(next((v for n, _, v in resource_series(proc, namespace, name) if n == "kvpersist_resource_refreshes_total"), 0))


def more_rounds(proc: subprocess.Popen, namespace: str, *names: str, rounds: int = 2) -> None:
    """Waits until the operator has run `rounds` more status rounds for each named resource (a
    round's drift applies, if any, go first): what a "nothing happened" check waits for, instead
    of a sleep. Two by default: the first may be one already under way when this is called."""
    start = {name: refreshes(proc, namespace, name) for name in names}
    wait_for(f"{rounds} more status rounds of {', '.join(names)} in {namespace}",
             lambda: all(refreshes(proc, namespace, name) >= start[name] + rounds for name in names),
             timeout=rounds * STATUS_INTERVAL_S + 30, interval=0.5)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


class RunnerThread:
    """Syncs the runner every second in the background, like a kubelet's loop."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.halt.is_set():
            with contextlib.suppress(subprocess.SubprocessError, KeyError):
                self.runner.sync()
            self.halt.wait(1.0)

    def __enter__(self) -> RunnerThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.thread.join(timeout=30)
        self.runner.stop_all()


def storage(ns: str) -> dict:
    """A StorageClass and a static local PV on the real GPU node (its pods run for real, under
    hack/kubelet_runner.py), private to this test's namespace."""
    return {"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": f"{ns}-nvme"},
         "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "WaitForFirstConsumer"},
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-pv"},
         "spec": {"capacity": {"storage": "20Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": f"{ns}-nvme",
                  "persistentVolumeReclaimPolicy": "Retain", "local": {"path": f"/mnt/{ns}"},
                  "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                      {"key": "kubernetes.io/hostname", "operator": "In", "values": [REAL_NODE]}]}]}}}},
    ]}


def second_node_storage(ns: str) -> dict:
    """For tests across the two real nodes: a local PV on real-gpu-1 in the test's `<ns>-nvme`
    class (a ReadWriteOnce claim per node), and a class `<ns>-shared` with one ReadWriteMany PV
    any node mounts. That PV names an NFS export on loopback that nothing serves: a STAND-IN, never
    mounted; the runners map the claim to one folder both see (Runner.shared_dir), a shared
    filesystem's view (the same files on every node), not its consistency or speed."""
    return {"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-pv-1"},
         "spec": {"capacity": {"storage": "20Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": f"{ns}-nvme",
                  "persistentVolumeReclaimPolicy": "Retain", "local": {"path": f"/mnt/{ns}"},
                  "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                      {"key": "kubernetes.io/hostname", "operator": "In", "values": [SECOND_NODE]}]}]}}}},
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": f"{ns}-shared"},
         "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"},
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-pv-shared"},
         "spec": {"capacity": {"storage": "20Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": f"{ns}-shared",
                  "persistentVolumeReclaimPolicy": "Retain", "nfs": {"server": "127.0.0.1", "path": f"/{ns}"}}},
    ]}


def manifest(ns: str, **identity_changes: object) -> dict:
    """The sample with the KV geometry of what the tests drive (tests/integration/kvdriver.SHAPE):
    a server's L1 page, and so its file sizes, follow these pins (kvpersist.api l1_page_bytes)."""
    obj = sample()
    obj["metadata"]["namespace"] = ns
    obj["spec"]["identity"].update({**SHAPE_PINS, **identity_changes})
    obj["spec"]["l1"]["size"] = "256Mi"
    obj["spec"]["l2"]["nvme"].update(storageClassName=f"{ns}-nvme", size="10Gi", maxCapacity="1Gi")
    return on_real_node(obj)


def on_real_node(obj: dict) -> dict:
    """Pins a resource's pods to the real node (the runner is their kubelet)."""
    vllm = obj["spec"].setdefault("vllm", {})
    vllm["nodeSelector"] = {"kubernetes.io/hostname": REAL_NODE}
    vllm["tolerations"] = [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}]
    return obj


def on_real_nodes(obj: dict) -> dict:
    """Lets a resource's pods (vLLM and servers) onto both real nodes, real-gpu-0 and real-gpu-1
    (one runner each), and no other: by the label both carry and a toleration of both taints."""
    vllm = obj["spec"].setdefault("vllm", {})
    vllm["nodeSelector"] = {REAL_NODE_TAINT: "true"}
    vllm["tolerations"] = [{"key": key, "operator": "Exists", "effect": "NoSchedule"}
                           for key in (REAL_NODE_TAINT, SECOND_NODE_TAINT)]
    return obj


# Renders a Target without reading a key: for a manifest to create by hand (benchmarks), never an
# id to compare with status (that needs the key the servers mount: pass kubectl).
UNREAD_KEY_FINGERPRINT = key_fingerprint(b"\0" * L2_KEY_BYTES)


def key_of(kubectl: Kubectl, obj: dict, timeout: float = 120) -> bytes | None:
    """The L2 key the resource's servers mount, from its Secret (the user's, or the generated one,
    waited for: the operator makes it on its first apply); None when L2 is not encrypted."""
    spec = KVCacheNamespace.model_validate(obj).spec
    secret = Target(obj["metadata"]["name"], obj["metadata"]["namespace"], spec, None).key_secret
    if secret is None:
        return None
    name, item = secret

    def read() -> bytes | None:
        out = kubectl.run("get", "secret", name, "-n", obj["metadata"]["namespace"], "-o", "json", check=False)
        data = (json.loads(out.stdout).get("data") or {}) if out.returncode == 0 else {}
        return base64.b64decode(data[item]) if data.get(item) else None

    return wait_for(f"the L2 key Secret {name}", read, timeout=timeout)


def target_of(obj: dict, kubectl: Kubectl | None = None) -> Target:
    """The Target the operator renders for obj. With L2 encrypted its id follows the key: read with
    kubectl (key_of); without kubectl, UNREAD_KEY_FINGERPRINT (renderable, not the operator's id)."""
    spec = KVCacheNamespace.model_validate(obj).spec
    key = key_of(kubectl, obj) if kubectl is not None else None
    fingerprint = key_fingerprint(key) if key is not None else UNREAD_KEY_FINGERPRINT
    return Target(obj["metadata"]["name"], obj["metadata"]["namespace"], spec, resolve(spec.pins(fingerprint)).namespace_id,
                  key_fingerprint=fingerprint if spec.l2.encryption.enabled else None)


def lmcache() -> str:
    """The lmcache CLI: on PATH, else beside this Python (the venv hack/venv.sh makes)."""
    return shutil.which("lmcache") or str(Path(sys.executable).parent / "lmcache")


@dataclass
class Env:
    """One test namespace with its storage, an operator watching it, and the runner's pods."""

    ns: str
    work: Path
    runner: Runner
    operator: subprocess.Popen
    log: Path
    second: Runner | None = None  # real-gpu-1's runner, with two_nodes

    def volume(self, claim: str = f"l2-{NAME}-lmcache-0") -> Path:
        return self.runner.volume_dir(claim)


@contextlib.contextmanager
def kvpersist_env(kubectl: Kubectl, work: Path, operator_env: dict[str, str] | None = None, vllm: str | None = None,
                  hf_home: Path | None = None, two_nodes: bool = False) -> Iterator[Env]:
    """Namespace, StorageClass + PV, operator and runner; all stopped and deleted afterwards.
    With `vllm` (the CPU build) and `hf_home` (its models), vLLM pods run for real. With
    `two_nodes`, a second runner plays real-gpu-1 (second_node_storage: a PV there, and a
    ReadWriteMany one both runners map to one folder, work/shared)."""
    ns = f"e2e-{uuid.uuid4().hex[:8]}"
    kubectl.run("create", "namespace", ns)
    kubectl.apply(storage(ns))
    if two_nodes:
        nodes = {n["metadata"]["name"] for n in kubectl.get("nodes")["items"]}
        assert SECOND_NODE in nodes, (f"the local cluster has no {SECOND_NODE}: it predates the second real node; "
                                      "run `python3 hack/localcluster.py down` and the tests again")
        kubectl.apply(second_node_storage(ns))
    log = work / "operator.log"
    shared = work / "shared" if two_nodes else None
    runner = Runner(kubectl.kubeconfig, ns, work / "pods", kubectl=str(kubectl.binary), lmcache=lmcache(), vllm=vllm,
                    hf_home=hf_home, shared_dir=shared)
    second = Runner(kubectl.kubeconfig, ns, work / f"pods-{SECOND_NODE}", kubectl=str(kubectl.binary), lmcache=lmcache(),
                    vllm=vllm, hf_home=hf_home, node=SECOND_NODE, shared_dir=shared) if two_nodes else None
    env = Env(ns, work, runner, start_operator(kubectl.kubeconfig, ns, log, operator_env), log, second)
    try:
        with RunnerThread(env.runner), (RunnerThread(second) if second else contextlib.nullcontext()):
            yield env
    finally:
        stop(env.operator)
        kubectl.run("delete", "namespace", ns, "--wait=false", check=False)
        for pv in (f"{ns}-pv", *((f"{ns}-pv-1", f"{ns}-pv-shared") if two_nodes else ())):
            kubectl.run("delete", "pv", pv, "--wait=false", check=False)
        for sc in (f"{ns}-nvme", *((f"{ns}-shared",) if two_nodes else ())):
            kubectl.run("delete", "storageclass", sc, check=False)


def bench_store(ip: str, start: int, end: int) -> None:
    """Real KV into a pod's lmcache server with lmcache's own bench client (sequences start..end)."""
    bench = subprocess.run([lmcache(), "bench", "server", "--rpc-url", f"tcp://{ip}:5555", "--url", in_pod(ip),
                            "--mode", "cpu", "--transfer-mode", "lmcache_driven", "--num-tokens", "512",
                            "--kvcache-shape-spec", "(2,64,16,2,64):float16:4", "--num-blocks", "64", "--start", str(start),
                            "--end", str(end), "--interval", "0.1", "--format", "json"],
                           capture_output=True, text=True, timeout=180, env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
    assert bench.returncode == 0, bench.stderr[-2000:]
