"""The local cluster is real: nodes go Ready, a Deployment gets Ready pods, a PVC binds, and
`down` leaves no process behind. Runs its own cluster on other ports so it can tear it down."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.kube import LOCALCLUSTER, Kubectl, bin_dir, wait_for

pytestmark = pytest.mark.e2e

COMPONENTS = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"]


def _cluster_pids(state: Path) -> list[int]:
    """Processes whose command line names this cluster's state folder: all of its components do."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(state) in cmdline and "localcluster.py" not in cmdline:
                pids.append(int(proc.name))
    return pids


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Path]]:
    state = tmp_path_factory.mktemp("smoke-cluster")
    # 1000 ports above the shared cluster's, so a second suite on its own ports never collides.
    port_base = int(os.environ.get("KVPERSIST_CLUSTER_PORT_BASE", "26400")) + 1000
    env = {**os.environ, "KVPERSIST_CLUSTER_DIR": str(state), "KVPERSIST_CLUSTER_PORT_BASE": str(port_base)}
    up = subprocess.run([*LOCALCLUSTER, "up"], env=env, capture_output=True, text=True,
                        timeout=300)
    assert up.returncode == 0, up.stderr
    assert up.stdout.strip() == str(state / "kubeconfig")
    try:
        yield env, state
    finally:
        subprocess.run([*LOCALCLUSTER, "down"], env=env, timeout=120)


def test_status_reports_running(own_cluster: tuple[dict[str, str], Path]) -> None:
    env, _state = own_cluster
    out = subprocess.run([*LOCALCLUSTER, "status"], env=env, stdout=subprocess.PIPE, text=True, timeout=30)
    assert out.returncode == 0
    for name in COMPONENTS:
        assert f"{name}" in out.stdout and "running pid" in out.stdout.split(name, 1)[1].splitlines()[0]


def test_nodes_ready_with_gpu_node(own_cluster: tuple[dict[str, str], Path]) -> None:
    _, state = own_cluster
    k = Kubectl(state / "kubeconfig", bin_dir() / "kubectl")
    nodes = {n["metadata"]["name"]: n for n in k.get("nodes")["items"]}
    assert set(nodes) >= {"kwok-cpu-0", "kwok-gpu-0"}
    for node in nodes.values():
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", node["metadata"]["name"]
    gpu = nodes["kwok-gpu-0"]
    assert gpu["status"]["capacity"]["nvidia.com/gpu"] == "8"
    assert gpu["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"


def test_deployment_gets_ready_pods(own_cluster: tuple[dict[str, str], Path]) -> None:
    """controller-manager makes the ReplicaSet and pods, the scheduler binds them, kwok runs them."""
    _, state = own_cluster
    k = Kubectl(state / "kubeconfig", bin_dir() / "kubectl")
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "smoke", "namespace": "default"},
        "spec": {
            "replicas": 2, "selector": {"matchLabels": {"app": "smoke"}},
            "template": {"metadata": {"labels": {"app": "smoke"}},
                         "spec": {"containers": [{"name": "c", "image": "registry.invalid/smoke:1",
                                                  "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}},
        },
    }
    k.apply(deployment)
    wait_for("2 ready replicas", lambda: k.get("deployment", "smoke", "default").get("status", {}).get("readyReplicas") == 2)
    pods = k.get("pods", namespace="default")["items"]
    assert {p["spec"]["nodeName"] for p in pods if p["metadata"]["labels"].get("app") == "smoke"} == {"kwok-gpu-0"}


def test_pvc_binds_to_static_pv(own_cluster: tuple[dict[str, str], Path]) -> None:
    _, state = own_cluster
    k = Kubectl(state / "kubeconfig", bin_dir() / "kubectl")
    objs = [
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "smoke-local"},
         "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"},
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "smoke-pv"},
         "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "smoke-local",
                  "persistentVolumeReclaimPolicy": "Retain", "local": {"path": "/mnt/smoke"},
                  "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                      {"key": "kubernetes.io/hostname", "operator": "In", "values": ["kwok-cpu-0"]}]}]}}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "smoke-pvc", "namespace": "default"},
         "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "smoke-local",
                  "resources": {"requests": {"storage": "5Gi"}}}},
    ]
    k.apply({"apiVersion": "v1", "kind": "List", "items": objs})
    pvc = wait_for("the claim to bind", lambda: (lambda c: c if c.get("status", {}).get("phase") == "Bound" else None)(
        k.get("pvc", "smoke-pvc", "default")))
    assert pvc["spec"]["volumeName"] == "smoke-pv"


def test_port_in_use_is_a_one_line_error(own_cluster: tuple[dict[str, str], Path], tmp_path: Path) -> None:
    env, _ = own_cluster
    other = {**env, "KVPERSIST_CLUSTER_DIR": str(tmp_path / "other")}
    out = subprocess.run([*LOCALCLUSTER, "up"], env=other, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "in use" in lines[0] and "KVPERSIST_CLUSTER_PORT_BASE" in lines[0], out.stderr


def test_down_leaves_nothing_running(own_cluster: tuple[dict[str, str], Path]) -> None:
    env, state = own_cluster
    assert _cluster_pids(state), "the cluster should be running before down"
    subprocess.run([*LOCALCLUSTER, "down"], env=env, check=True, timeout=120)
    assert _cluster_pids(state) == []
    status = subprocess.run([*LOCALCLUSTER, "status"], env=env, stdout=subprocess.PIPE, text=True, timeout=30)
    assert status.returncode != 0
    assert status.stdout.count("stopped") == len(COMPONENTS)
