"""The optional InferencePool (Gateway API Inference Extension) over this resource's vLLM pods: a
gateway asks its endpoint picker which pod takes a request (a KV-aware one reads spec.vllm.kvEvents).
Made only where the API server serves the API (kvpersist.controller.inferencepool)."""

from __future__ import annotations

from typing import Any

from kvpersist.builders.attach import attached
from kvpersist.builders.target import VLLM, Target, manifest

API_GROUP = "inference.networking.k8s.io"
API_VERSION = f"{API_GROUP}/v1"
KIND = "InferencePool"


def build_inference_pool(target: Target) -> dict[str, Any] | None:
    """spec.vllm.inferencePool: every namespace id's vLLM pods (serving across a pin change). None when
    unset, and when Attached (the user's KServe or llm-d pools their pods)."""
    pool = target.spec.vllm.inference_pool
    if pool is None or attached(target):
        return None
    picker = pool.endpoint_picker
    return manifest(API_VERSION, KIND, target.metadata(target.vllm_name, VLLM), {
        "selector": {"matchLabels": target.selector(VLLM)},
        "targetPorts": [{"number": target.spec.vllm.port}],
        "endpointPickerRef": {"group": "", "kind": "Service", "name": picker.name, "port": {"number": picker.port},
                              "failureMode": picker.failure_mode},
    })
