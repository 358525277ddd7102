"""What the builders need to know about one KVCacheNamespace, and the names and labels they share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpersist.api.identity import NAMESPACE_ID_LABEL
from kvpersist.api.spec import KVCacheNamespaceSpec

L2_MOUNT_PATH = "/var/lib/kvpersist/l2"
L2_VOLUME = "l2"
HF_TOKEN_ENV = "KVPERSIST_HF_TOKEN"
# L2's master key: a Secret volume, read by lmcache's aesgcm serde from this file.
L2_KEY_VOLUME = "l2-key"
L2_KEY_MOUNT_PATH = "/etc/kvpersist/l2-key"
L2_KEY_FILE = "master.key"
L2_KEY_BYTES = 32
# The inventory agent's bearer token: a Secret the resource owns, mounted into the agent only.
AGENT_TOKEN_VOLUME = "agent-token"
AGENT_TOKEN_MOUNT_PATH = "/etc/kvpersist/agent-token"
AGENT_TOKEN_KEY = "token"
MANAGED_BY = "kvpersist"
# On vLLM pods launched without the cache while it is on (Target.cache_bypassed), saying why.
BYPASS_ANNOTATION = "kvpersist.dev/cache-bypassed"
SERVER = "lmcache-server"
VLLM = "vllm"
SHARED_CLAIM_SUFFIX = "shared"  # l2-<name>-lmcache-shared: the one claim of spec.l2.nvme.shared with size
MODEL_CACHE = "model-cache"  # the component of the weights claim the operator makes (spec.vllm.modelCache.size)


def manifest(api_version: str, kind: str, metadata: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, "spec": spec}


@dataclass(frozen=True)
class Target:
    """One KVCacheNamespace as the builders see it. namespace_id None means the cache is off."""

    name: str
    namespace: str
    spec: KVCacheNamespaceSpec
    namespace_id: str | None
    # The servers have been unavailable too long: vLLM runs without the cache (controller.fallback).
    cache_bypassed: bool = False
    # Why, for the vLLM pods' annotation: the servers' absence (the default) or a refused build.
    bypass_reason: str = "the lmcache servers are unavailable"
    # False: another id's objects hold this id's route names (8 hex of the id): no local Service or
    # per-id policy is built, so none is re-pointed; vLLM goes without the cache (controller.stale_routes).
    routes: bool = True
    # The agent's image (the chart's, or an older one while servers roll: controller.agentroll);
    # None: builders.lmcache.DEFAULT_AGENT_IMAGE.
    agent_image: str | None = None
    # Shared on a user's claim that is not ReadWriteMany: one server, not one per node that could
    # never mount it (ClaimNotShared); None: as many as the spec says.
    max_servers: int | None = None
    # Encrypted L2: the fingerprint (never the key) the id was computed with; servers refuse a key
    # file of another (inserver.serve check_key); None renders a serde no server starts with.
    key_fingerprint: str | None = None
    # The API server serves InferencePool (controller.inferencepool asks discovery); a pure build says False.
    inference_pool_served: bool = False
    # The cluster's DNS domain (controller.policy.read_cluster_domain), for the server's absolute name.
    cluster_domain: str = "cluster.local"
    # Server pods that found no node for long (more servers than eligible nodes): the PDB does not count them.
    unplaced_servers: int = 0

    @property
    def cache_enabled(self) -> bool:
        return self.namespace_id is not None

    @property
    def vllm_uses_cache(self) -> bool:
        return self.cache_enabled and not self.cache_bypassed and self.routes

    # ---- names
    @property
    def server_name(self) -> str:
        """StatefulSet of the lmcache servers; its pods are <name>-lmcache-<ordinal>."""
        return f"{self.name}-lmcache"

    @property
    def local_service_name(self) -> str:
        """The node-local Service vLLM connects through, one per namespace id (builders.lmcache)."""
        return self.per_id_name(self.namespace_id)

    def per_id_name(self, namespace_id: str | None) -> str:
        """<name>-lmcache-<8 hex of the id> (at most 57 characters), or <name>-lmcache."""
        return f"{self.name}-lmcache-{namespace_id[len('kvp-'):][:8]}" if namespace_id else f"{self.name}-lmcache"

    @property
    def governing_service_name(self) -> str:
        """The StatefulSet's serviceName, as earlier versions set it (it cannot change on a StatefulSet).
        No Service of that name is made: nothing resolves the servers by name, the agents are reached by
        pod IP and Prometheus scrapes the pods (the chart's PodMonitor)."""
        return f"{self.name}-lmcache-metrics"

    @property
    def key_secret(self) -> tuple[str, str] | None:
        """(Secret, key) of L2's master key when L2 is encrypted: the user's, or <name>-l2-key."""
        enc = self.spec.l2.encryption
        if not enc.enabled:
            return None
        if enc.key_secret_ref is not None:
            return enc.key_secret_ref.name, enc.key_secret_ref.key
        return f"{self.name}-l2-key", "master-key"

    @property
    def agent_token_secret(self) -> str:
        return f"{self.name}-agent-token"

    @property
    def key_secret_generated(self) -> bool:
        """The operator makes (once) and never deletes the key Secret: no key, no data."""
        return self.spec.l2.encryption.enabled and self.spec.l2.encryption.key_secret_ref is None

    @property
    def vllm_name(self) -> str:
        return f"{self.name}-vllm"

    @property
    def shared(self) -> bool:
        """spec.l2.nvme.shared: every server on one ReadWriteMany claim, in one folder."""
        return self.spec.l2.nvme is not None and self.spec.l2.nvme.shared

    @property
    def shared_claim(self) -> str | None:
        """With spec.l2.nvme.shared, the one claim all servers mount: the user's, or
        `l2-<name>-lmcache-shared` the operator makes; None when not shared."""
        nvme = self.spec.l2.nvme
        if nvme is None or not nvme.shared:
            return None
        return nvme.existing_claim_name or f"{L2_VOLUME}-{self.server_name}-{SHARED_CLAIM_SUFFIX}"

    @property
    def model_cache_claim(self) -> str | None:
        """The weights' claim: the user's, or `<name>-model-cache` the operator makes; None without one."""
        cache = self.spec.vllm.model_cache
        if cache is None:
            return None
        return cache.existing_claim_name or f"{self.name}-model-cache"

    # ---- labels
    def selector(self, component: str) -> dict[str, str]:
        """Labels that select one component's pods; never change, so selectors stay valid."""
        return {"app.kubernetes.io/name": "kvpersist", "app.kubernetes.io/instance": self.name,
                "app.kubernetes.io/component": component}

    def id_selector(self, component: str) -> dict[str, str]:
        """One component's pods of the current namespace id (all with the cache off): pairs vLLM with servers."""
        return {**self.selector(component), **({NAMESPACE_ID_LABEL: self.namespace_id} if self.namespace_id else {})}

    def labels(self, component: str, per_id: bool = True) -> dict[str, str]:
        """per_id False: an object that serves every namespace id (the weights' claim, the agents' token)."""
        return {**self.selector(component), "app.kubernetes.io/managed-by": MANAGED_BY,
                **(self.id_selector(component) if per_id else {})}

    def metadata(self, name: str, component: str, per_id: bool = True) -> dict:
        return {"name": name, "namespace": self.namespace, "labels": self.labels(component, per_id)}
