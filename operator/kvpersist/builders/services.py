"""The two Services in front of the lmcache servers, and the optional one in front of vLLM."""

from __future__ import annotations

from typing import Any

from kvpersist.builders.target import SERVER, VLLM, Target


def _service(target: Target, name: str, component: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": target.metadata(name, component), "spec": spec}


def build_local_service(target: Target) -> dict[str, Any]:
    """vLLM's way to its cache server: internalTrafficPolicy Local keeps every connection on the
    node, where the server can open vLLM's KV on the node's GPUs (CUDA IPC works within one node
    only); the namespace id in its name and selector keeps it to servers of the identity its
    clients were launched with."""
    return _service(target, target.local_service_name, SERVER, {
        "type": "ClusterIP",
        "internalTrafficPolicy": "Local",
        "selector": target.id_selector(SERVER),
        "ports": [{"name": "zmq", "port": target.spec.lmcache_server.port, "targetPort": "zmq", "protocol": "TCP"}],
    })


def build_metrics_service(target: Target) -> dict[str, Any]:
    """Headless: governs the StatefulSet (stable pod DNS) and exposes the agents' port, where
    lmcache's /metrics is forwarded as /server/metrics for scraping (the admin API is loopback)."""
    return _service(target, target.metrics_service_name, SERVER, {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": target.selector(SERVER),
        "ports": [{"name": "http-metrics", "port": target.spec.lmcache_server.agent_port, "targetPort": "agent",
                   "protocol": "TCP"}],
    })


def build_vllm_service(target: Target) -> dict[str, Any] | None:
    """spec.vllm.service: the OpenAI-compatible API of this resource's vLLM pods, by the pods'
    selector (name, instance, component): never another resource's pods, and every namespace id's,
    so it keeps serving across a pin change. None unless enabled."""
    svc = target.spec.vllm.service
    if not svc.enabled:
        return None
    return _service(target, target.vllm_name, VLLM, {
        "type": svc.type,
        "selector": target.selector(VLLM),
        "ports": [{"name": "http", "port": svc.port, "targetPort": "http", "protocol": "TCP"}],
    })
