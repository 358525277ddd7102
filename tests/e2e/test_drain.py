"""Issue 58 item 3 on the real API server: more lmcache servers than eligible nodes leave one
Pending for good; its PodDisruptionBudget must still let `kubectl drain` evict a Ready server
(the budget exists to take servers one at a time, never to block a drain). The nodes are kwok's
(fake kubelets that run nothing: the servers are Running and Ready by kwok's word); the eviction,
the budget and the scheduler are the real API server's and kube-scheduler's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cases.invalid_manifests import sample
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import start_operator, stop

pytestmark = pytest.mark.e2e
CAPACITY = {"cpu": "64", "memory": "512Gi", "pods": "50", "ephemeral-storage": "1Ti", "nvidia.com/gpu": "8"}


def node(name: str, group: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                         "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "type": "kwok",
                                    "kvpersist.dev/e2e-drain": group}},
            "status": {"capacity": CAPACITY, "allocatable": CAPACITY}}


def test_a_server_no_node_can_take_does_not_block_draining_the_others(kubectl: Kubectl, crd: None, namespace: str,
                                                                        tmp_path: Path) -> None:
    ns = namespace
    nodes = [f"{ns}-drain-{i}" for i in range(2)]
    for name in nodes:
        kubectl.apply(node(name, ns))
    operator = start_operator(kubectl.kubeconfig, ns, tmp_path / "operator.log", {"KVPERSIST_UNPLACED_AFTER_S": "5"})
    try:
        obj = sample("hf-bucket")  # no claim to bind on nodes that have no storage
        obj["metadata"]["namespace"] = ns
        obj["spec"]["lmcacheServer"] = {"replicas": 3}  # one per node (required anti-affinity): two nodes
        obj["spec"]["vllm"].update(replicas=0, nodeSelector={"kvpersist.dev/e2e-drain": ns})
        kubectl.apply(obj)
        name = obj["metadata"]["name"]

        def servers() -> list[dict]:
            out = kubectl.run("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/instance={name},"
                              "app.kubernetes.io/component=lmcache-server", "-o", "json").stdout
            return json.loads(out)["items"]

        def placed() -> list[dict] | None:
            pods = servers()
            ready = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                            for c in p["status"].get("conditions") or [])]
            pending = [p for p in pods if not p["spec"].get("nodeName")]
            return ready if len(ready) == 2 and len(pending) == 1 else None

        ready = wait_for("two servers Ready and one unplaceable", placed, timeout=180)
        # Once the third has found no node for 5 s (KVPERSIST_UNPLACED_AFTER_S), the budget leaves it out.
        pdb = wait_for("the budget to leave the unplaced server out", lambda: (lambda p: p if p["spec"].get(
            "maxUnavailable") == 2 else None)(kubectl.get("poddisruptionbudget", f"{name}-lmcache", ns)), timeout=120)
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        target = ready[0]["spec"]["nodeName"]
        drained = kubectl.run("drain", target, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=90s",
                              check=False, timeout=150)
        assert drained.returncode == 0, drained.stderr
        assert not [p for p in servers() if p["spec"].get("nodeName") == target and not p["metadata"].get("deletionTimestamp")]
    finally:
        stop(operator)
        kubectl.run("delete", "kvcachenamespaces", "--all", "-n", ns, "--wait=false", check=False)
        for name in nodes:
            kubectl.run("delete", "node", name, "--wait=false", check=False)
