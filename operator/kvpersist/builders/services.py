"""The two Services in front of the lmcache servers."""

from __future__ import annotations

from typing import Any

from kvpersist.builders.target import SERVER, Target


def build_local_service(target: Target) -> dict[str, Any]:
    """vLLM's way to its cache server: internalTrafficPolicy Local keeps every connection on the
    node, where the server can open vLLM's KV on the node's GPUs (CUDA IPC works within one node
    only); the namespace id in its name and
    selector keeps it to servers of the identity its clients were launched with."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": target.metadata(target.local_service_name, SERVER),
        "spec": {
            "type": "ClusterIP",
            "internalTrafficPolicy": "Local",
            "selector": target.id_selector(SERVER),
            "ports": [{"name": "zmq", "port": target.spec.lmcache_server.port, "targetPort": "zmq", "protocol": "TCP"}],
        },
    }


def build_metrics_service(target: Target) -> dict[str, Any]:
    """Headless: governs the StatefulSet (stable pod DNS) and exposes the agents' port, where
    lmcache's /metrics is forwarded as /server/metrics for scraping (the admin API is loopback)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": target.metadata(target.metrics_service_name, SERVER),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": target.selector(SERVER),
            "ports": [{"name": "http-metrics", "port": target.spec.lmcache_server.agent_port, "targetPort": "agent",
                       "protocol": "TCP"}],
        },
    }
