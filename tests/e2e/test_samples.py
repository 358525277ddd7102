"""Each file of config/samples/, applied as shipped with the operator running, turns the cache on
(IdentityResolved True, a namespace id kvp-<32 hex>, never CacheDisabled), and what it renders
runs the sample's one image in both containers, on GPU nodes as the sample places it.

The Hub the hf-bucket sample's preflight asks is tests/integration/hub_stub.py (a local stand-in:
no Hugging Face endpoint is reachable here), given to the operator as HF_ENDPOINT. The images are
the samples' placeholder: kwok runs no container, so nothing pulls them."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
import yaml

from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.identity import key_fingerprint, resolve
from tests.cases.invalid_manifests import SAMPLES
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import start_operator, stop
from tests.integration.hub_stub import GOOD_TOKEN, HubStub

pytestmark = pytest.mark.e2e
SAMPLE_FILES = sorted(SAMPLES.glob("*.yaml"))


def _secrets_named(obj: dict) -> list[tuple[str, str]]:
    """(name, key) of the Secrets a sample names and expects to exist (the user makes them)."""
    bucket = obj["spec"]["l2"].get("hfBucket")
    named = [(bucket["tokenSecretRef"]["name"], bucket["tokenSecretRef"].get("key", "token"))] if bucket else []
    for ref, key in (("hfTokenSecretRef", "token"), ("apiKeySecretRef", "api-key")):  # a gated model's token, the API key
        if ref in obj["spec"].get("vllm", {}):
            named.append((obj["spec"]["vllm"][ref]["name"], obj["spec"]["vllm"][ref].get("key", key)))
    return named


def _resolved(kubectl: Kubectl, name: str, ns: str) -> dict | None:
    status = kubectl.get("kvns", name, ns).get("status") or {}
    cond = next((c for c in status.get("conditions", []) if c["type"] == "IdentityResolved"), None)
    return status if cond and cond["status"] == "True" and status.get("namespaceId") else None


def _container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def _cache_on_as_the_sample_says(kubectl: Kubectl, ns: str, path: Path, obj: dict) -> None:
    """The cache is on with the id of the sample's pins, and both workloads run its one image,
    with the connector wired in, on the GPUs and nodes it names."""
    name = obj["metadata"]["name"]
    status = wait_for(f"{path.name}: IdentityResolved True with a namespace id", lambda: _resolved(kubectl, name, ns),
                      timeout=120, explain=lambda: str(kubectl.get("kvns", name, ns).get("status")))
    assert re.fullmatch(r"kvp-[0-9a-f]{32}", status["namespaceId"]), status["namespaceId"]
    assert status.get("phase") != "CacheDisabled", status
    key = base64.b64decode(kubectl.get("secret", f"{name}-l2-key", ns)["data"]["master-key"])
    spec = KVCacheNamespace.model_validate(obj).spec
    assert status["namespaceId"] == resolve(spec.pins(key_fingerprint(key))).namespace_id, path.name

    image = obj["spec"]["image"]
    server_pod = kubectl.get("statefulset", f"{name}-lmcache", ns)["spec"]["template"]["spec"]
    vllm_pod = kubectl.get("deployment", f"{name}-vllm", ns)["spec"]["template"]["spec"]
    assert _container(server_pod, "lmcache-server")["image"] == image
    vllm = _container(vllm_pod, "vllm")
    assert vllm["image"] == image
    assert "--kv-transfer-config" in vllm["args"], vllm["args"]  # the cache is wired in
    gpus = str(obj["spec"]["vllm"].get("gpusPerReplica") or obj["spec"]["identity"]["tensorParallelSize"])
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == vllm["resources"]["requests"]["nvidia.com/gpu"] == gpus
    for pod in (server_pod, vllm_pod):
        assert pod["nodeSelector"] == obj["spec"]["vllm"]["nodeSelector"], path.name
        assert pod["tolerations"] == obj["spec"]["vllm"]["tolerations"], path.name


def _placed(kubectl: Kubectl, ns: str, name: str) -> set[str] | None:
    """The nodes of a resource's pods once its server and its vLLM pod are both scheduled."""
    pods = [p for p in kubectl.get("pods", namespace=ns)["items"]
            if p["metadata"]["labels"].get("app.kubernetes.io/instance") == name]
    nodes = {p["spec"].get("nodeName") for p in pods}
    kinds = {p["metadata"]["labels"].get("app.kubernetes.io/component") for p in pods}
    return nodes if len(kinds) == 2 and None not in nodes else None


def test_every_sample_as_shipped_turns_the_cache_on(kubectl: Kubectl, crd: None, namespace: str, tmp_path: Path) -> None:
    # The three the README lists (NVMe, bucket, tensor-parallel fp8), each one: a sample added or lost fails here.
    assert [p.name for p in SAMPLE_FILES] == ["hf-bucket.yaml", "nvme-minimal.yaml", "tp2-fp8.yaml"], SAMPLE_FILES
    samples = {path: yaml.safe_load(path.read_text()) for path in SAMPLE_FILES}
    buckets = {m.group(1) for obj in samples.values() if obj["spec"]["l2"].get("hfBucket")
               for m in [re.match(r"hf://buckets/([^/]+/[^/]+)", obj["spec"]["l2"]["hfBucket"]["bucketHandle"])]}
    with HubStub(existing=buckets) as hub:
        operator = start_operator(kubectl.kubeconfig, namespace, tmp_path / "operator.log", {"HF_ENDPOINT": hub.url})
        try:
            for obj in samples.values():
                for secret, key in _secrets_named(obj):
                    kubectl.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": namespace},
                                   "type": "Opaque", "data": {key: base64.b64encode(GOOD_TOKEN.encode()).decode()}})
            for path in SAMPLE_FILES:
                kubectl.run("apply", "-n", namespace, "-f", str(path))  # the file itself, as a user would
            for path, obj in samples.items():
                _cache_on_as_the_sample_says(kubectl, namespace, path, obj)

            # Placement on a real scheduler: a sample without a claim to bind (the bucket's) gets its
            # server and its vLLM pod onto a GPU node (the local cluster's kwok-gpu-0).
            bucket_samples = [obj["metadata"]["name"] for obj in samples.values() if obj["spec"]["l2"].get("hfBucket")]
            assert bucket_samples
            for name in bucket_samples:
                nodes = wait_for(f"{name}: its server and vLLM pods scheduled", lambda n=name: _placed(kubectl, namespace, n),
                                 timeout=120)
                for node in nodes:
                    assert kubectl.get("node", node)["metadata"]["labels"].get("nvidia.com/gpu.present") == "true", node
        finally:
            stop(operator)
