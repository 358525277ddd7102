"""What the builders need to know about one KVCacheNamespace, and the names and labels they share."""

from __future__ import annotations

from dataclasses import dataclass

from kvpersist.api.v1alpha1 import NAMESPACE_ID_LABEL, KVCacheNamespaceSpec

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


@dataclass(frozen=True)
class Target:
    """One KVCacheNamespace as the builders see it. namespace_id None means the cache is off."""

    name: str
    namespace: str
    spec: KVCacheNamespaceSpec
    namespace_id: str | None
    # The servers have been unavailable too long: vLLM runs without the cache meanwhile
    # (kvpersist.controller.fallback); the servers themselves stay as declared.
    cache_bypassed: bool = False
    # Why, for the vLLM pods' annotation: the servers' absence (the default) or a refused build.
    bypass_reason: str = "the lmcache servers are unavailable"
    # False: an object of another namespace id holds this id's route names (per_id_name keeps 8
    # hex of the id): no local Service or ZMQ policy is built, so none is re-pointed, and vLLM
    # goes without the cache meanwhile (kvpersist.controller.stale_routes.route_conflicts).
    routes: bool = True
    # The inventory agent's image for the server pods (the snapshot's: the chart's, or an older one
    # kept while other servers roll, controller.agentroll); None: builders.lmcache.DEFAULT_AGENT_IMAGE.
    agent_image: str | None = None
    # spec.l2.nvme.shared on a user's claim that is not ReadWriteMany: one server only, not one per
    # node that could never mount it (status says ClaimNotShared); None: as many as the spec says.
    max_servers: int | None = None
    # With L2 encrypted: the fingerprint of the key the namespace id was computed with (the pin
    # l2_key_fingerprint, never the key). The servers refuse to start on a key file of another
    # (kvpersist.inserver.serve check_key); None renders a serde no server starts with.
    key_fingerprint: str | None = None
    # The API server serves InferencePool (inference.networking.k8s.io/v1): spec.vllm.inferencePool
    # is made only then (kvpersist.controller.inferencepool asks discovery); a pure build says False.
    inference_pool_served: bool = False
    # The cluster's DNS domain (the operator reads it: controller.policy.read_cluster_domain); the
    # connection names the server absolutely, <service>.<namespace>.svc.<domain>. (connection.py).
    cluster_domain: str = "cluster.local"
    # Server pods that have found no node for long (status.workloads.unplaced_servers): more
    # servers than eligible nodes. The PodDisruptionBudget does not count them (disruption.py).
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
        """Node-local Service vLLM connects through. With the cache on it is one per namespace id
        and selects only servers of that id: a vLLM pod of another identity (an old one, during
        a pin change) cannot reach them by name, nor they it."""
        return self.per_id_name(self.namespace_id)

    def per_id_name(self, namespace_id: str | None) -> str:
        """<name>-lmcache-<8 hex of the id> (at most 57 characters), or <name>-lmcache."""
        return f"{self.name}-lmcache-{namespace_id[len('kvp-'):][:8]}" if namespace_id else f"{self.name}-lmcache"

    @property
    def metrics_service_name(self) -> str:
        """Headless Service: governs the StatefulSet and exposes the HTTP admin/metrics port."""
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
    def connection_name(self) -> str:
        return f"{self.name}-connection"

    @property
    def vllm_name(self) -> str:
        return f"{self.name}-vllm"

    @property
    def shared(self) -> bool:
        """spec.l2.nvme.shared: every server on one ReadWriteMany claim, in one folder."""
        return self.spec.l2.nvme is not None and self.spec.l2.nvme.shared

    @property
    def shared_claim(self) -> str | None:
        """The one claim all servers mount with spec.l2.nvme.shared: the user's (existingClaimName),
        or `l2-<name>-lmcache-shared`, which the operator makes (size); None when not shared."""
        nvme = self.spec.l2.nvme
        if nvme is None or not nvme.shared:
            return None
        return nvme.existing_claim_name or f"{L2_VOLUME}-{self.server_name}-{SHARED_CLAIM_SUFFIX}"

    @property
    def model_cache_claim(self) -> str | None:
        """The claim the vLLM pods keep the weights on: the user's, or `<name>-model-cache` the
        operator makes (spec.vllm.modelCache.size); None without a model cache."""
        cache = self.spec.vllm.model_cache
        if cache is None:
            return None
        return cache.existing_claim_name or f"{self.name}-model-cache"

    # ---- labels
    def selector(self, component: str) -> dict[str, str]:
        """Labels that select one component's pods; never change, so selectors stay valid."""
        return {
            "app.kubernetes.io/name": "kvpersist",
            "app.kubernetes.io/instance": self.name,
            "app.kubernetes.io/component": component,
        }

    def id_selector(self, component: str) -> dict[str, str]:
        """One component's pods of this resource's current namespace id (all of them with the
        cache off): what pairs vLLM pods with servers."""
        out = self.selector(component)
        if self.namespace_id:
            out[NAMESPACE_ID_LABEL] = self.namespace_id
        return out

    def labels(self, component: str) -> dict[str, str]:
        out = {**self.selector(component), "app.kubernetes.io/managed-by": MANAGED_BY}
        if self.namespace_id:
            out[NAMESPACE_ID_LABEL] = self.namespace_id
        return out

    def metadata(self, name: str, component: str) -> dict:
        return {"name": name, "namespace": self.namespace, "labels": self.labels(component)}
