"""Invalid KVCacheNamespace manifests, each a different mistake, with the field its error must name.

Shared by the unit tests (pydantic refuses them) and the e2e tests (`kubectl apply` refuses them),
so the operator and the API server are held to the same table.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SAMPLES = Path(__file__).resolve().parents[2] / "config" / "samples"


def sample(name: str = "nvme-minimal", as_shipped: bool = False) -> dict[str, Any]:
    """A sample as the base of a test. Unless as_shipped, without the gated model's HF token Secret
    (spec.vllm.hfTokenSecretRef) the Llama samples name: a test namespace has no such Secret, and
    the tests of the token add it themselves (tests/e2e/test_samples.py applies the files as shipped)."""
    obj = yaml.safe_load((SAMPLES / f"{name}.yaml").read_text())
    if not as_shipped:
        obj["spec"].get("vllm", {}).pop("hfTokenSecretRef", None)
    return obj


def upstream_images(name: str = "nvme-minimal") -> dict[str, Any]:
    """A sample running an upstream image by digest (vLLM's), a repository an image allow-list can
    tell from the samples' placeholder registry."""
    obj = sample(name)
    obj["spec"]["image"] = "vllm/vllm-openai:v0.33.0@sha256:" + "d7" * 32
    return obj


@dataclass(frozen=True)
class Case:
    id: str
    field: str  # the path the error message must name
    mutate: Callable[[dict[str, Any]], None]
    base: str = "nvme-minimal"

    def manifest(self) -> dict[str, Any]:
        obj = copy.deepcopy(sample(self.base))
        obj["metadata"]["name"] = "bad-" + self.id
        self.mutate(obj)
        return obj


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = obj
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    return mutate


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = obj
        for p in parents:
            node = node[p]
        del node[leaf]

    return mutate


def _both(*mutations: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        for m in mutations:
            m(obj)

    return mutate


def _long_name(obj: dict[str, Any]) -> None:
    obj["metadata"]["name"] = "a" * 41


CASES = [
    Case("revision-branch", "spec.identity.modelRevision", _set("spec.identity.modelRevision", "main")),
    Case("dtype-auto", "spec.identity.kvCacheDtype", _set("spec.identity.kvCacheDtype", "auto")),
    Case("dtype-fp8-unresolved", "spec.identity.kvCacheDtype", _set("spec.identity.kvCacheDtype", "fp8")),
    Case("block-size-zero", "spec.identity.blockSize", _set("spec.identity.blockSize", 0)),
    Case("tp-zero", "spec.identity.tensorParallelSize", _set("spec.identity.tensorParallelSize", 0)),
    Case("template-digest-bare", "spec.identity.chatTemplateDigest",
         _set("spec.identity.chatTemplateDigest", "5b2f3ccbd3a4f1b0c2a7e7c0a0c14ec8")),
    Case("model-id-missing", "spec.identity.modelId", _delete("spec.identity.modelId")),
    Case("unknown-pin", "spec.identity.modelRev", _set("spec.identity.modelRev", "x")),
    Case("l1-zero", "spec.l1.size", _set("spec.l1.size", "0")),
    Case("l2-both", "spec.l2", _set("spec.l2.hfBucket", {
        "bucketHandle": "hf://buckets/acme/kv", "tokenSecretRef": {"name": "hf"}, "maxCapacity": "10Gi"})),
    Case("l2-none", "spec.l2", _set("spec.l2", {})),
    Case("nvme-size-and-claim", "spec.l2.nvme", _set("spec.l2.nvme.existingClaimName", "kv-data")),
    Case("nvme-size-garbage", "spec.l2.nvme.size", _set("spec.l2.nvme.size", "lots")),
    # A float overflow (an OverflowError in the models until issue 29), and a negative size.
    Case("nvme-size-overflow", "spec.l2.nvme.size", _set("spec.l2.nvme.size", "1e309")),
    Case("nvme-size-negative", "spec.l2.nvme.size", _set("spec.l2.nvme.size", "-500Gi")),
    Case("budget-negative", "spec.l2.nvme.budget", _set("spec.l2.nvme.budget", "-1Gi")),
    Case("memory-request-negative", "spec.lmcacheServer.resources.requests.memory",
         _set("spec.lmcacheServer.resources", {"requests": {"memory": "-8Gi"}})),
    Case("nvme-capacity-over-size", "spec.l2.nvme.maxCapacity", _set("spec.l2.nvme.maxCapacity", "600Gi")),
    Case("budget-over-capacity", "spec.l2.nvme.budget", _set("spec.l2.nvme.budget", "600Gi")),
    Case("budget-below-1Mi", "spec.l2.nvme.budget", _set("spec.l2.nvme.budget", "4Ki")),
    Case("orphan-retention-on-a-bucket", "spec.l2.orphanRetention",
         _set("spec.l2.orphanRetention", {"maxAgeDays": 30}), base="hf-bucket"),
    Case("orphan-retention-zero-days", "spec.l2.orphanRetention.maxAgeDays",
         _set("spec.l2.orphanRetention", {"maxAgeDays": 0})),
    Case("budget-on-fs-adapter", "spec.l2.nvme.budget", lambda o: (_set("spec.l2.nvme.budget", "1Gi")(o),
                                                                    _set("spec.l2.nvme.adapter", "fs")(o))),
    Case("nvme-adapter-unknown", "spec.l2.nvme.adapter", _set("spec.l2.nvme.adapter", "s3")),
    Case("nvme-storage-class-with-claim", "spec.l2.nvme.storageClassName",
         _both(_delete("spec.l2.nvme.size"), _set("spec.l2.nvme.existingClaimName", "kv-data"))),
    Case("nvme-delete-existing-claim", "spec.l2.nvme.reclaimPolicy", _set("spec.l2.nvme", {
        "existingClaimName": "kv-data", "maxCapacity": "100Gi", "reclaimPolicy": "Delete"})),
    Case("existing-claim-two-servers", "spec.lmcacheServer.replicas", _both(
        _set("spec.l2.nvme", {"existingClaimName": "kv-data", "maxCapacity": "100Gi"}), _set("spec.lmcacheServer.replicas", 2))),
    Case("shared-with-fs", "spec.l2.nvme.shared", _both(_set("spec.l2.nvme.shared", True), _set("spec.l2.nvme.adapter", "fs"))),
    Case("bucket-handle-s3", "spec.l2.hfBucket.bucketHandle",
         _set("spec.l2.hfBucket.bucketHandle", "s3://acme/kv"), base="hf-bucket"),
    Case("bucket-prefix-dotdot", "spec.l2.hfBucket.bucketHandle",
         _set("spec.l2.hfBucket.bucketHandle", "hf://buckets/acme/kv/../other"), base="hf-bucket"),
    Case("bucket-prefix-empty-segment", "spec.l2.hfBucket.bucketHandle",
         _set("spec.l2.hfBucket.bucketHandle", "hf://buckets/acme/kv//x"), base="hf-bucket"),
    Case("bucket-token-missing", "spec.l2.hfBucket.tokenSecretRef",
         _delete("spec.l2.hfBucket.tokenSecretRef"), base="hf-bucket"),
    Case("eviction-policy-fifo", "spec.eviction.policy", _set("spec.eviction.policy", "FIFO")),
    # Not a policy any more (lmcache 0.5.6 wipes every salt without a quota within a second).
    Case("eviction-isolated-lru", "spec.eviction.policy", _set("spec.eviction.policy", "IsolatedLRU")),
    Case("eviction-watermark-over-1", "spec.eviction.triggerWatermark", _set("spec.eviction.triggerWatermark", 1.5)),
    Case("eviction-ratio-zero", "spec.eviction.evictionRatio", _set("spec.eviction.evictionRatio", 0)),
    Case("extra-args-pinned-flag", "spec.vllm.extraArgs", _set("spec.vllm.extraArgs", ["--kv-cache-dtype=fp8"])),
    Case("extra-args-pinned-underscore", "spec.vllm.extraArgs", _set("spec.vllm.extraArgs", ["--max_model_len", "9"])),
    # vLLM's parser takes abbreviations, dotted JSON keys and short options: only the allow-list passes.
    Case("extra-args-abbreviation", "spec.vllm.extraArgs", _set("spec.vllm.extraArgs", ["--max-model-le=9"])),
    Case("extra-args-dotted-override", "spec.vllm.extraArgs", _set("spec.vllm.extraArgs", ["--hf-overrides.rope_theta=1"])),
    Case("extra-args-short-option", "spec.vllm.extraArgs", _set("spec.vllm.extraArgs", ["-O3"])),
    Case("extra-args-kv-changing", "spec.vllm.extraArgs", _set("spec.vllm.extraArgs", ["--trust-remote-code"])),
    Case("gpus-below-tp", "spec.vllm.gpusPerReplica", _set("spec.vllm.gpusPerReplica", 1), base="tp2-fp8"),
    Case("ports-clash", "spec.lmcacheServer.agentPort", _set("spec.lmcacheServer", {"port": 8090})),
    # operator Exists without a key tolerates every taint: control-plane, reserved GPU nodes, NoExecute.
    Case("toleration-catch-all", "spec.vllm.tolerations", _set("spec.vllm.tolerations", [{"operator": "Exists"}])),
    Case("toleration-catch-all-empty-key", "spec.vllm.tolerations",
         _set("spec.vllm.tolerations", [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                        {"key": "", "operator": "Exists", "effect": "NoExecute"}])),
    Case("name-too-long", "metadata.name", _long_name),
    # Issue 42 item 6: names the API server would take for the resource but refuse, later, for an
    # object derived from it (a Service's name is an RFC 1035 label: no '.', a letter first).
    Case("name-dotted", "metadata.name", _set("metadata.name", "bad.dotted")),
    Case("name-leading-digit", "metadata.name", _set("metadata.name", "1bad")),
    # Control and format characters in free strings (issue 29): a bidi override that makes the
    # served name read backwards, a NUL and a line break that cut argv and log lines, a zero-width
    # space that makes two images look alike, a tab in a node label, a bidi mark in a map key.
    Case("served-name-bidi-override", "spec.vllm.servedModelName", _set("spec.vllm.servedModelName", "qwen\u202egnp.exe")),
    Case("image-nul", "spec.image", _set("spec.image", "vllm/vllm-openai:v0.33.0\x00evil")),
    Case("extra-args-newline", "spec.vllm.extraArgs",
         _set("spec.vllm.extraArgs", ["--root-path", "/v1\nINFO: all requests authorised"])),
    Case("image-zero-width", "spec.image", _set("spec.image", "lmcache/vllm\u200b-openai:v0.5.6")),
    Case("node-selector-tab", "spec.vllm.nodeSelector", _set("spec.vllm.nodeSelector", {"pool": "gpu\tcpu"})),
    Case("node-selector-key-bidi", "spec.vllm.nodeSelector", _set("spec.vllm.nodeSelector", {"pool\u2067": "gpu"})),
    Case("toleration-value-bom", "spec.vllm.tolerations",
         _set("spec.vllm.tolerations", [{"key": "nvidia.com/gpu", "value": "\ufeffpresent", "effect": "NoSchedule"}])),
    Case("resource-name-line-separator", "spec.lmcacheServer.resources.requests",
         _set("spec.lmcacheServer.resources", {"requests": {"memory\u2028": "8Gi"}})),
    # What Kubernetes refuses in a pod template, refused at apply time naming the field rather than
    # as a Deployment the API server refuses later: label syntax, resource names, toleration shape.
    Case("node-selector-value-space", "spec.vllm.nodeSelector", _set("spec.vllm.nodeSelector", {"pool": "gpu nodes"})),
    Case("node-selector-key-two-slashes", "spec.vllm.nodeSelector", _set("spec.vllm.nodeSelector", {"a/b/c": "x"})),
    Case("resource-name-space", "spec.vllm.resources.limits", _set("spec.vllm.resources", {"limits": {"my gpu": 1}})),
    Case("toleration-key-space", "spec.vllm.tolerations",
         _set("spec.vllm.tolerations", [{"key": "nvidia gpu", "operator": "Exists"}])),
    Case("toleration-equal-without-key", "spec.vllm.tolerations",
         _set("spec.vllm.tolerations", [{"operator": "Equal", "value": "present"}])),
    Case("toleration-exists-with-value", "spec.vllm.tolerations",
         _set("spec.vllm.tolerations", [{"key": "nvidia.com/gpu", "operator": "Exists", "value": "present"}])),
    Case("toleration-seconds-without-no-execute", "spec.vllm.tolerations",
         _set("spec.vllm.tolerations", [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule",
                                         "tolerationSeconds": 60}])),
    # spec.vllm's pod fields (issue 30): env names the operator owns or that change the KV are refused.
    Case("env-hash-seed", "spec.vllm.env", _set("spec.vllm.env", [{"name": "PYTHONHASHSEED", "value": "1"}])),
    Case("env-lmcache-prefix", "spec.vllm.env", _set("spec.vllm.env", [{"name": "LMCACHE_CHUNK_SIZE", "value": "16"}])),
    Case("env-vllm-attention", "spec.vllm.env", _set("spec.vllm.env", [{"name": "VLLM_ATTENTION_BACKEND", "value": "X"}])),
    Case("env-cuda-devices", "spec.vllm.env", _set("spec.vllm.env", [{"name": "CUDA_VISIBLE_DEVICES", "value": "1"}])),
    Case("env-literal-hf-token", "spec.vllm.env", _set("spec.vllm.env", [{"name": "HF_TOKEN", "value": "hf_x"}])),
    Case("env-literal-api-key", "spec.vllm.env", _set("spec.vllm.env", [{"name": "VLLM_API_KEY", "value": "k"}])),
    Case("env-hf-home", "spec.vllm.env", _set("spec.vllm.env", [{"name": "HF_HOME", "value": "/x"}])),
    # Issue 42 item 5: variables that load other code while the pins stay the same.
    Case("env-ld-audit", "spec.vllm.env", _set("spec.vllm.env", [{"name": "LD_AUDIT", "value": "/x/audit.so"}])),
    Case("env-python-warnings", "spec.vllm.env",
         _set("spec.vllm.env", [{"name": "PYTHONWARNINGS", "value": "error::evil.Warning"}])),
    Case("env-name-not-identifier", "spec.vllm.env", _set("spec.vllm.env", [{"name": "A-B", "value": "1"}])),
    Case("env-value-from", "spec.vllm.env",
         _set("spec.vllm.env", [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])),
    Case("env-from-both", "spec.vllm.envFrom",
         _set("spec.vllm.envFrom", [{"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}])),
    Case("env-from-neither", "spec.vllm.envFrom", _set("spec.vllm.envFrom", [{}])),
    Case("env-from-prefix", "spec.vllm.envFrom", _set("spec.vllm.envFrom", [{"prefix": "LMCACHE_", "secretRef": {"name": "a"}}])),
    Case("env-from-too-many", "spec.vllm.envFrom", _set("spec.vllm.envFrom", [{"secretRef": {"name": f"s{i}"}} for i in range(5)])),
    Case("hf-token-ref-bad-name", "spec.vllm.hfTokenSecretRef.name", _set("spec.vllm.hfTokenSecretRef", {"name": "Bad_Name"})),
    Case("api-key-ref-no-name", "spec.vllm.apiKeySecretRef.name", _set("spec.vllm.apiKeySecretRef", {"key": "k"})),
    Case("model-cache-neither", "spec.vllm.modelCache", _set("spec.vllm.modelCache", {})),
    Case("model-cache-both", "spec.vllm.modelCache",
         _set("spec.vllm.modelCache", {"existingClaimName": "weights", "size": "100Gi"})),
    Case("model-cache-bad-size", "spec.vllm.modelCache.size", _set("spec.vllm.modelCache", {"size": "100 GB"})),
    Case("model-cache-class-with-claim", "spec.vllm.modelCache.storageClassName",
         _set("spec.vllm.modelCache", {"existingClaimName": "weights", "storageClassName": "fast"})),
    Case("model-cache-access-mode", "spec.vllm.modelCache.accessModes",
         _set("spec.vllm.modelCache", {"size": "100Gi", "accessModes": ["ReadOnlyMany"]})),
    Case("service-type", "spec.vllm.service.type", _set("spec.vllm.service", {"enabled": True, "type": "ExternalName"})),
    Case("service-port-zero", "spec.vllm.service.port", _set("spec.vllm.service", {"enabled": True, "port": 0})),
    Case("pull-secret-bad-name", "spec.imagePullSecrets", _set("spec.imagePullSecrets", [{"name": "UPPER"}])),
    # KV events (issue 32): the operator owns --kv-events-config (its topic is the namespace id); the
    # sockets' ports must not take vLLM's HTTP port or each other's.
    Case("extra-args-kv-events", "spec.vllm.extraArgs",
         _set("spec.vllm.extraArgs", ['--kv-events-config={"enable_kv_cache_events":true,"topic":"other"}'])),
    Case("extra-args-kv-events-dotted", "spec.vllm.extraArgs", _set("spec.vllm.extraArgs", ["--kv-events-config.topic=other"])),
    Case("kv-events-port-is-http", "spec.vllm.kvEvents.port", _set("spec.vllm.kvEvents", {"enabled": True, "port": 8000})),
    Case("kv-events-replay-is-pub", "spec.vllm.kvEvents.replayPort",
         _set("spec.vllm.kvEvents", {"enabled": True, "port": 5557, "replayPort": 5557})),
    Case("kv-events-port-zero", "spec.vllm.kvEvents.port", _set("spec.vllm.kvEvents", {"enabled": True, "port": 0})),
]
