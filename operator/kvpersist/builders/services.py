"""The Service in front of the lmcache servers of one namespace id, and the optional one in front of vLLM."""

from __future__ import annotations

from typing import Any

from kvpersist.builders.target import SERVER, VLLM, Target, manifest


def build_local_service(target: Target) -> dict[str, Any]:
    """vLLM's way to its cache server: Local keeps connections on the node (CUDA IPC works within a
    node only); the namespace id in name and selector keeps it to servers of its clients' identity."""
    return manifest("v1", "Service", target.metadata(target.local_service_name, SERVER), {
        "type": "ClusterIP",
        "internalTrafficPolicy": "Local",
        "selector": target.id_selector(SERVER),
        "ports": [{"name": "zmq", "port": target.spec.lmcache_server.port, "targetPort": "zmq", "protocol": "TCP"}],
    })


def build_vllm_service(target: Target) -> dict[str, Any] | None:
    """spec.vllm.service: the OpenAI API of this resource's vLLM pods of every namespace id (it keeps
    serving across a pin change); None unless enabled."""
    svc = target.spec.vllm.service
    if not svc.enabled:
        return None
    return manifest("v1", "Service", target.metadata(target.vllm_name, VLLM), {
        "type": svc.type,
        "selector": target.selector(VLLM),
        "ports": [{"name": "http", "port": svc.port, "targetPort": "http", "protocol": "TCP"}],
    })
