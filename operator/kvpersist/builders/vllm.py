"""The vLLM Deployment, launched with exactly the pinned identity."""

from __future__ import annotations

from typing import Any

from kvpersist.builders import buildcheck
from kvpersist.builders.connection import kv_transfer_config_json
from kvpersist.builders.security import container_security_context, pod_security
from kvpersist.builders.target import SERVER, VLLM, Target

# (pin attribute, vLLM flag) in the order they appear on the command line.
PIN_FLAGS = (
    ("model_revision", "--revision"),
    ("tokenizer", "--tokenizer"),
    ("tokenizer_revision", "--tokenizer-revision"),
    ("kv_cache_dtype", "--kv-cache-dtype"),
    ("block_size", "--block-size"),
    ("tensor_parallel_size", "--tensor-parallel-size"),
    ("max_model_len", "--max-model-len"),
)


def vllm_args(target: Target) -> list[str]:
    """`vllm serve` arguments: the model, every pin that is set, the connector when the cache is
    on, then the user's extra arguments (which the API refuses when they touch a pinned flag)."""
    ident = target.spec.identity
    vllm = target.spec.vllm
    args = ["serve", ident.model_id]
    for attr, flag in PIN_FLAGS:
        value = getattr(ident, attr)
        if value is not None:
            args += [flag, str(value)]
    args += ["--served-model-name", vllm.served_model_name or ident.model_id, "--host", "0.0.0.0", "--port", str(vllm.port)]
    if target.vllm_uses_cache:
        args += ["--kv-transfer-config", kv_transfer_config_json(target)]
    return args + list(vllm.extra_args)


def gpus(target: Target) -> int:
    return target.spec.vllm.gpus_per_replica or target.spec.identity.tensor_parallel_size or 1


def vllm_resources(target: Target) -> dict[str, dict[str, str]]:
    extra = target.spec.vllm.resources
    requests = {k: str(v) for k, v in ((extra.requests if extra else None) or {}).items()}
    limits = {k: str(v) for k, v in ((extra.limits if extra else None) or {}).items()}
    requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(gpus(target))
    return {"requests": requests, "limits": limits}


def build_vllm_deployment(target: Target) -> dict[str, Any]:
    """With the cache on, each pod must land on a node that runs one of this resource's lmcache
    servers of its own namespace id (required pod affinity); vLLM and the server stay separate
    processes, so a vLLM restart never touches the cache. While the cache is bypassed (servers
    unavailable too long, kvpersist.controller.fallback) no affinity: vLLM serves without it."""
    spec = target.spec
    container: dict[str, Any] = {
        "name": "vllm",
        "image": spec.vllm.image,
        "command": ["vllm"],
        "args": vllm_args(target),
        # Python's hash seed feeds vLLM's prefix hashes; fixed, so chunk keys match across restarts.
        # The KV lives in vLLM's engine process, a child of the container's PID 1 with V1
        # multiprocessing on (vLLM's default, pinned here). The server is PID 1 in its own
        # container, and CUDA IPC between two processes of the same PID fails even across PID
        # namespaces (measured on an H200, both IPC modes: hack/gpu_ipc_check.py "both_pid_1";
        # lmcache's timeline_semaphore_event_ipc.py: "only the PID values ... must differ").
        "env": [{"name": "PYTHONHASHSEED", "value": "0"}, {"name": "VLLM_ENABLE_V1_MULTIPROCESSING", "value": "1"}],
        "ports": [{"name": "http", "containerPort": spec.vllm.port, "protocol": "TCP"}],
        "resources": vllm_resources(target),
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 3},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        # No capabilities, no privilege escalation. The root filesystem stays writable: vLLM
        # downloads the model into its Hugging Face cache and compiles kernels (torch.compile,
        # Triton, FlashInfer) into caches under $HOME and /tmp, whose paths vary with the image and
        # the version; an image may also ship the model in that cache (docs/security.md).
        "securityContext": container_security_context(read_only_root=False),
    }
    # With the cache, its vLLM and lmcache must be the declared build: checked before vLLM starts.
    container = buildcheck.wrap(container, target, VLLM)
    pod_spec: dict[str, Any] = pod_security({
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    })
    if spec.vllm.runtime_class_name:
        pod_spec["runtimeClassName"] = spec.vllm.runtime_class_name
    if target.vllm_uses_cache:
        # Its own /dev/shm (above) and no host namespace: the isolated CUDA IPC the connector is
        # set to (builders/connection.py) needs neither (builders/lmcache.server_args).
        pod_spec["affinity"] = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": target.id_selector(SERVER)}, "topologyKey": "kubernetes.io/hostname"}]}}
    if spec.vllm.node_selector:
        pod_spec["nodeSelector"] = dict(spec.vllm.node_selector)
    if spec.vllm.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.vllm.tolerations]
    annotations = {}
    if target.cache_bypassed and target.cache_enabled:  # on the pods too: `kubectl get pod -o yaml` says why
        annotations["kvpersist.dev/cache-bypassed"] = f"{target.bypass_reason}; see the CacheBypassed condition"
    if spec.identity.chat_template_digest:
        annotations["kvpersist.dev/chat-template-digest"] = spec.identity.chat_template_digest
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": target.metadata(target.vllm_name, VLLM),
        "spec": {
            "replicas": spec.vllm.replicas,
            "selector": {"matchLabels": target.selector(VLLM)},
            "template": {"metadata": {"labels": target.labels(VLLM), "annotations": annotations}, "spec": pod_spec},
        },
    }
