"""The NetworkPolicies of the lmcache server pods: the agent's port to the operator alone, ZMQ to
vLLM pods of the same namespace id alone.

lmcache's HTTP admin API (no authentication; /env holds the Hugging Face token) binds the pod's
loopback and needs no policy. The inventory agent beside it forwards the operator's reads and can
delete an orphaned namespace's data; it checks the resource's token itself, and this policy is
the second line where the CNI enforces it."""

from __future__ import annotations

import os
from typing import Any

from kvpersist.builders.target import SERVER, VLLM, Target

# Where the operator runs, so the policy can admit it. Set by the Helm chart.
OPERATOR_NAMESPACE_ENV = "KVPERSIST_OPERATOR_NAMESPACE"
OPERATOR_LABELS = {"app.kubernetes.io/name": "kvpersist-operator"}


def operator_namespace() -> str | None:
    return os.environ.get(OPERATOR_NAMESPACE_ENV) or None


def build_network_policy(target: Target, operator_ns: str | None) -> dict[str, Any]:
    """Every server of the resource: the agent's port from the operator's pods only (when the operator's
    namespace is known; else from nowhere in the cluster, which kubelet probes from the node are
    not subject to on common CNIs). No ZMQ here: see build_zmq_policy."""
    spec = target.spec
    rules: list[dict[str, Any]] = []
    if operator_ns:
        rules.append({
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_ns}},
                      "podSelector": {"matchLabels": OPERATOR_LABELS}}],
            "ports": [{"protocol": "TCP", "port": spec.lmcache_server.agent_port}],
        })
    spec_out: dict[str, Any] = {"podSelector": {"matchLabels": target.selector(SERVER)}, "policyTypes": ["Ingress"]}
    if rules:  # no rules: no key (the same deny-all); an applied `ingress: []` is stored as absent,
        spec_out["ingress"] = rules  # so every apply would count as a change and bump the generation
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": target.metadata(f"{target.name}-lmcache", SERVER),
        "spec": spec_out,
    }


def build_zmq_policy(target: Target) -> dict[str, Any]:
    """ZMQ to the servers of one namespace id from the vLLM pods of the same id only: during a pin
    change old vLLM pods may still run beside new servers, and must not store into them (one
    policy per id, named like the id's Service)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": target.metadata(target.local_service_name, SERVER),
        "spec": {"podSelector": {"matchLabels": target.id_selector(SERVER)}, "policyTypes": ["Ingress"], "ingress": [{
            "from": [{"podSelector": {"matchLabels": target.id_selector(VLLM)}}],
            "ports": [{"protocol": "TCP", "port": target.spec.lmcache_server.port}],
        }]},
    }
