"""The optional InferencePool (Gateway API Inference Extension, inference.networking.k8s.io/v1) over
this resource's vLLM pods: a gateway asks the endpoint picker it names which pod takes a request,
and a KV-aware picker knows each pod's blocks from the KV events the pods publish under the
namespace id (spec.vllm.kvEvents). Made only where the API server serves the API
(kvpersist.controller.inferencepool); build_all leaves it out otherwise."""

from __future__ import annotations

from typing import Any

from kvpersist.builders.attach import attached
from kvpersist.builders.target import VLLM, Target

API_GROUP = "inference.networking.k8s.io"
API_VERSION = f"{API_GROUP}/v1"
KIND = "InferencePool"


def build_inference_pool(target: Target) -> dict[str, Any] | None:
    """spec.vllm.inferencePool: every namespace id's vLLM pods of this resource, by the pods'
    selector (as the vLLM Service): a pin change keeps the pool serving while old and new pods
    overlap. None when unset, and with mode Attached (the user's pods: their KServe or llm-d
    pools them)."""
    pool = target.spec.vllm.inference_pool
    if pool is None or attached(target):
        return None
    picker = pool.endpoint_picker
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": target.metadata(target.vllm_name, VLLM),
        "spec": {
            "selector": {"matchLabels": target.selector(VLLM)},
            "targetPorts": [{"number": target.spec.vllm.port}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": picker.name,
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }
