"""The vLLM Deployment, launched with exactly the pinned identity, the optional Service in front of it, the
claim the operator makes for the model's weights (spec.vllm.modelCache.size), attach mode's status.attach (what
kvpersist.api.attachpolicy's policies check a user's own vLLM pod against and add to it, from the functions that
launch managed pods, so both run with the same flags), and the optional InferencePool (Gateway API Inference
Extension) over the vLLM pods: a gateway asks its endpoint picker which pod takes a request (a KV-aware one
reads spec.vllm.kvEvents)."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from kvpersist.api.attachpolicy import LABEL as ATTACH_LABEL
from kvpersist.api.identity import CONNECTOR, pin_field
from kvpersist.api.quantity import parse_quantity
from kvpersist.api.spec import ENV_ALLOW_LISTED, ENV_REFUSED, ENV_REFUSED_PREFIXES, MODEL_CACHE_PATH, KVCacheNamespaceSpec
from kvpersist.api.vllmpod import beside_servers, server_term, shm_mount, shm_volume
from kvpersist.builders import buildcheck
from kvpersist.builders.security import DATA_GROUP, DATA_PLANE_USER, HOME_ENV, data_plane_volumes, pod_security, security_context
from kvpersist.builders.target import BYPASS_ANNOTATION, MODEL_CACHE, NAMESPACE_ID_LABEL, SERVER, VLLM, Target, manifest
from kvpersist.identity import image_digest

# (pin attribute, vLLM flag) in the order they appear on the command line.
PIN_FLAGS = (("model_revision", "--revision"), ("tokenizer", "--tokenizer"), ("tokenizer_revision", "--tokenizer-revision"),
             ("kv_cache_dtype", "--kv-cache-dtype"), ("block_size", "--block-size"),
             ("tensor_parallel_size", "--tensor-parallel-size"), ("max_model_len", "--max-model-len"))


def vllm_args(target: Target) -> list[str]:
    """`vllm serve` arguments: the model, every pin that is set, the connector when the cache is
    on, then the user's extra arguments (which the API refuses when they touch a pinned flag)."""
    ident = target.spec.identity
    pins = ident.resolved()
    vllm = target.spec.vllm
    args = ["serve", ident.model_id]
    for attr, flag in PIN_FLAGS:
        if pins[attr] is not None:
            args += [flag, str(pins[attr])]
    args += ["--served-model-name", vllm.served_model_name or ident.model_id, "--host", "0.0.0.0", "--port", str(vllm.port)]
    if target.vllm_uses_cache:
        args += ["--kv-transfer-config", kv_transfer_config_json(target)]
    return args + kv_events_args(target) + list(vllm.extra_args)


# The kv-transfer-config is published nowhere: a client with it could write KV under other flags that
# the pinned pods then hit (docs/design.md, "Who may write into a namespace").
HEARTBEAT_INTERVAL_S = 2.0
CONNECTOR_MODULES = {"LMCacheMPConnector": "lmcache.integration.vllm.lmcache_mp_connector"}


def server_host(target: Target) -> str:
    """The node-local Service's absolute DNS name, which no search list can capture."""
    return f"{target.local_service_name}.{target.namespace}.svc.{target.cluster_domain}."


def kv_transfer_config(target: Target) -> dict[str, Any]:
    """The connector is pinned by module path, so vLLM cannot pick up another implementation."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULES[CONNECTOR],
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            # Absolute (the trailing dot): a relative name is tried against the search list first, where
            # <route>.<ns>.svc.svc.<domain> belongs to whoever owns a namespace named svc.
            "lmcache.mp.host": f"tcp://{server_host(target)}",
            "lmcache.mp.port": target.spec.lmcache_server.port,
            # vLLM notices a restarted server only by a failed heartbeat: a restart shorter than the
            # default 10 s goes unseen and the next cached request hangs 300 s and kills the engine
            # (seen with lmcache 0.5.6). A server takes several seconds to start: 2 s cannot miss one.
            "lmcache.mp.heartbeat_interval": HEARTBEAT_INTERVAL_S,
            # Must match the server's --isolated-ipc (builders/lmcache.server_args says why).
            "lmcache.mp.isolated_ipc": True,
        },
    }


def kv_transfer_config_json(target: Target) -> str:
    return json.dumps(kv_transfer_config(target), separators=(",", ":"), sort_keys=True)


KV_EVENTS_TOPIC_ANNOTATION = "kvpersist.dev/kv-events-topic"
KV_EVENTS_PORT_NAME = "kv-events"
KV_EVENTS_REPLAY_PORT_NAME = "kv-replay"  # a port name has at most 15 characters


def kv_events_config(target: Target) -> dict[str, Any] | None:
    """vLLM's --kv-events-config: a ZMQ PUB socket on every interface, its topic the namespace id, so a
    KV-aware router can tell each block's namespace; None while off or without a namespace id. The id
    stays the topic while the cache is bypassed: vLLM's blocks are still computed under the same pins."""
    events = target.spec.vllm.kv_events
    if not events.enabled or target.namespace_id is None:
        return None
    topic = target.namespace_id
    if events.topic_format == "LLMD":  # the kubelet expands the pod's IP (kv_events_env) in the argument
        vllm = target.spec.vllm
        topic = f"kv@$({POD_IP_ENV}):{vllm.port}@{vllm.served_model_name or target.spec.identity.model_id}"
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events.port}", "topic": topic,
            **({"replay_endpoint": f"tcp://*:{events.replay_port}"} if events.replay_port is not None else {})}


def kv_events_args(target: Target) -> list[str]:
    """--kv-events-config as vLLM's command line carries it (nothing while events are off)."""
    events = kv_events_config(target)
    return [] if events is None else ["--kv-events-config", json.dumps(events, separators=(",", ":"), sort_keys=True)]


# llm-d's scorer reads a pod's `IP:port` from the topic (kv@<pod>@<model>): the downward API's pod IP.
POD_IP_ENV = "KVPERSIST_POD_IP"
POD_IP_FIELD = "status.podIP"


def kv_events_env(target: Target) -> list[tuple[str, str]]:
    """(name, downward API field) of the variables the events' topic names: the pod IP for LLMD."""
    llmd = target.spec.vllm.kv_events.topic_format == "LLMD" and kv_events_config(target) is not None
    return [(POD_IP_ENV, POD_IP_FIELD)] if llmd else []


def kv_events_ports(target: Target) -> list[dict[str, Any]]:
    """The named container ports a router finds the sockets by (none while events are off)."""
    if kv_events_config(target) is None:
        return []
    events = target.spec.vllm.kv_events
    ports = ((KV_EVENTS_PORT_NAME, events.port), (KV_EVENTS_REPLAY_PORT_NAME, events.replay_port))
    return [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports if port is not None]


def quantities(resources: Any, kind: str) -> dict[str, str]:
    """The requests or limits (kind) of a spec's Resources (or None), as strings."""
    return {k: str(v) for k, v in (getattr(resources, kind, None) or {}).items()}


def vllm_resources(target: Target) -> dict[str, dict[str, str]]:
    gpus = {"nvidia.com/gpu": str(target.spec.vllm.gpus_per_replica or target.spec.identity.tensor_parallel_size or 1)}
    return {kind: {**quantities(target.spec.vllm.resources, kind), **gpus} for kind in ("requests", "limits")}


MODEL_CACHE_VOLUME = "model-cache"
SHM_VOLUME = "dshm"  # an attached pod's is kvpersist.api.attachpolicy's
HF_TOKEN = "HF_TOKEN"  # huggingface_hub's token variable, which vLLM's downloads use
API_KEY = "VLLM_API_KEY"  # vLLM's OpenAI server requires it as a bearer token when set (vllm.envs)


# Fixed for every vLLM container of a namespace, the operator's and attached ones (attach_status).
FIXED_ENV = (("PYTHONHASHSEED", "0"), ("VLLM_ENABLE_V1_MULTIPROCESSING", "1"))


def operator_env(target: Target) -> list[dict[str, Any]]:
    """The vLLM container's variables the operator sets: fixed, or from the fields that own them.
    Listed in `env`, they win over any envFrom key of the same name (Kubernetes' rule)."""
    vllm = target.spec.vllm
    # PYTHONHASHSEED feeds vLLM's prefix hashes: fixed, so chunk keys match across restarts. V1
    # multiprocessing keeps the KV in a child of PID 1: the server is PID 1 in its own container, and
    # CUDA IPC between two PID 1s fails even across PID namespaces (measured: gpu_ipc_check.py "both_pid_1").
    env: list[dict[str, Any]] = [{"name": name, "value": value} for name, value in FIXED_ENV]
    # Secrets only by reference: the kubelet reads them; they are in no arg, spec value or ConfigMap.
    env += [{"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
            for name, ref in ((HF_TOKEN, vllm.hf_token_secret_ref), (API_KEY, vllm.api_key_secret_ref)) if ref is not None]
    # Always the same place: with HF_HUB_OFFLINE vLLM names the model by its snapshot path, which keys
    # every chunk, so a cache that moved (modelCache turned on, another HOME) makes every chunk a miss.
    env.append({"name": "HF_HOME", "value": MODEL_CACHE_PATH})
    env += [{"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}
            for name, path in kv_events_env(target)]
    return env


# envFrom's keys are unknown at apply time, so the kubelet sets each under ENV_FROM_PREFIX, where no
# loader (LD_PRELOAD in the start script's shell), Python or runtime (NVIDIA_*) reads it, and the start
# script copies back only what api.spec's env tables allow; the image's own variables stay as the image set them.
ENV_FROM_PREFIX = "KVPERSIST_ENVFROM_"  # KVPERSIST_* is refused in env, so no user's name is mistaken for one
# Refused in env only because a literal would put a secret in the spec: from a Secret they are fine.
ENV_FROM_ALLOWED = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", API_KEY)


def env_filter(set_in_env: list[str]) -> str:
    """The start script's first part: for each `ENV_FROM_PREFIX<key>` set, export `<key>` unless refused
    (said on stderr) or named in `env` (which wins), then unset the prefixed copy. Backquotes, never
    `$(` (the kubelet would expand it); a name from a value's own lines that is not set is skipped;
    `eval` sees only a C identifier, never a value."""
    refused = [*sorted(set(ENV_REFUSED) - set(ENV_FROM_ALLOWED)), *(f"{p}*" for p in [*ENV_REFUSED_PREFIXES, *ENV_ALLOW_LISTED])]
    allowed = [*(n for names, _ in ENV_ALLOW_LISTED.values() for n in names), *ENV_FROM_ALLOWED]
    prefix = ENV_FROM_PREFIX
    export = rf'eval "export $kvp_n=\"\${prefix}$kvp_n\""'
    return (rf"for kvp_n in `env | sed -n 's/^{prefix}\([A-Za-z_][A-Za-z0-9_]*\)=.*/\1/p'`; do "
            rf'eval "kvp_set=\${{{prefix}$kvp_n+1}}"; [ "$kvp_set" = 1 ] || continue; case "$kvp_n" in '
            + (f"{'|'.join(set_in_env)}) ;; " if set_in_env else "")
            + f"{'|'.join(allowed)}) {export};; {'|'.join(refused)}) "
            + 'echo "kvpersist: $kvp_n from spec.vllm.envFrom is a refused name (docs/api.md): not set" >&2;; '
            + f'*) {export};; esac; unset "{prefix}$kvp_n"; done; ')


def placement(pod_spec: dict[str, Any], spec: KVCacheNamespaceSpec, runtime_class: str | None,
              affinity: dict[str, Any] | None = None) -> None:
    """Pull secrets, runtime class, affinity, and vLLM's nodes (the servers follow them); each only when set."""
    placed = {"imagePullSecrets": [{"name": s.name} for s in spec.image_pull_secrets], "runtimeClassName": runtime_class,
              "affinity": affinity, "nodeSelector": dict(spec.vllm.node_selector or {}),
              "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in spec.vllm.tolerations or []]}
    pod_spec.update({key: value for key, value in placed.items() if value})


def build_vllm_deployment(target: Target) -> dict[str, Any]:
    """With the cache on, each pod lands beside a server of its own namespace id (required pod
    affinity), a separate process, so a vLLM restart never touches the cache. Bypassed
    (kvpersist.controller.fallback): no affinity, vLLM serves without it."""
    spec = target.spec
    container: dict[str, Any] = {
        "name": "vllm",
        "image": spec.image,
        "command": ["vllm"],
        "args": vllm_args(target),
        "env": [HOME_ENV, *operator_env(target), *({"name": e.name, "value": e.value} for e in spec.vllm.env)],
        "ports": [{"name": "http", "containerPort": spec.vllm.port, "protocol": "TCP"}, *kv_events_ports(target)],
        "resources": vllm_resources(target),
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 3},
        "volumeMounts": [shm_mount(SHM_VOLUME), *data_plane_volumes()[1],
                         {"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_PATH}],
        # Non-root (the server's uid), no capabilities, a read-only root: the model and the kernel caches
        # go to HF_HOME, HOME and /tmp (docs/security.md).
        "securityContext": security_context(DATA_PLANE_USER, DATA_PLANE_USER),
    }
    if spec.vllm.env_from:
        container["envFrom"] = [{"prefix": ENV_FROM_PREFIX, **({"secretRef": {"name": e.secret_ref.name}} if e.secret_ref
                                 else {"configMapRef": {"name": e.config_map_ref.name}})}  # type: ignore[union-attr]
                                for e in spec.vllm.env_from]
        container["command"] = ["sh", "-c", env_filter([e["name"] for e in container["env"]]) + buildcheck.EXEC, "vllm"]
    # With the cache, its vLLM and lmcache must be the declared build: checked before vLLM starts.
    container = buildcheck.wrap(container, target, VLLM)
    # The user's claim or the operator's (build_model_cache_claim), or downloaded at each start to the same path (operator_env).
    weights = {"persistentVolumeClaim": {"claimName": target.model_cache_claim}} if target.model_cache_claim else {"emptyDir": {}}
    volumes = [shm_volume(SHM_VOLUME), *data_plane_volumes()[0], {"name": MODEL_CACHE_VOLUME, **weights}]
    # The non-root vLLM writes the operator's model cache through the pod's group; a user's claim is never re-owned.
    made = spec.vllm.model_cache is not None and not spec.vllm.model_cache.existing_claim_name
    pod_spec: dict[str, Any] = pod_security({"containers": [container], "volumes": volumes},
                                            fs_group=DATA_GROUP if made else None)
    # Its own /dev/shm and no host namespace: isolated CUDA IPC needs neither (builders/lmcache.server_args).
    beside_server = beside_servers(server_term(target.id_selector(SERVER)))
    placement(pod_spec, spec, spec.vllm.runtime_class_name, beside_server if target.vllm_uses_cache else None)
    annotations = {}
    if target.cache_bypassed and target.cache_enabled:  # on the pods too: `kubectl get pod -o yaml` says why
        annotations[BYPASS_ANNOTATION] = f"{target.bypass_reason}; see the CacheBypassed condition"
    if spec.identity.chat_template_digest:
        annotations["kvpersist.dev/chat-template-digest"] = spec.identity.chat_template_digest
    events = kv_events_config(target)
    if events is not None and not kv_events_env(target):  # the topic to subscribe to, for a router that watches pods
        annotations[KV_EVENTS_TOPIC_ANNOTATION] = events["topic"]
    return manifest("apps/v1", "Deployment", target.metadata(target.vllm_name, VLLM), {
        "replicas": spec.vllm.replicas,
        "selector": {"matchLabels": target.selector(VLLM)},
        "template": {"metadata": {"labels": target.labels(VLLM), "annotations": annotations}, "spec": pod_spec},
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


DEFAULT_ACCESS_MODES = ("ReadWriteOnce",)


def build_model_cache_claim(target: Target) -> dict[str, Any] | None:
    """PersistentVolumeClaim `<name>-model-cache`, or None when the user names their own claim (or there is
    no model cache). Owned by the resource, so deleted with it: weights can be downloaded again, unlike L2's
    KV. No namespace id label: the weights serve every id. Made once and never patched
    (kvpersist.controller.apply): most of a claim's spec is immutable, so a later change is reported, not applied."""
    cache = target.spec.vllm.model_cache
    if cache is None or cache.size is None:
        return None
    return manifest("v1", "PersistentVolumeClaim", target.metadata(target.model_cache_claim, MODEL_CACHE, per_id=False),
                    claim_spec(list(cache.access_modes or DEFAULT_ACCESS_MODES), cache.size, cache.storage_class_name))


def claim_spec(access_modes: list[str], size: Any, storage_class: str | None) -> dict[str, Any]:
    """A claim's spec; without storage_class, the cluster's default StorageClass (no key)."""
    spec: dict[str, Any] = {"accessModes": access_modes, "resources": {"requests": {"storage": str(size)}}}
    if storage_class is not None:
        spec["storageClassName"] = storage_class
    return spec


def claim_differences(manifest: dict[str, Any], existing: dict[str, Any]) -> list[str]:
    """What spec.vllm.modelCache declares that the existing claim (made once, kept as is) lacks, by field."""
    want, have = manifest["spec"], existing.get("spec") or {}
    out = []
    wanted_size = want["resources"]["requests"]["storage"]
    had_size = ((have.get("resources") or {}).get("requests") or {}).get("storage")
    if _quantity(wanted_size) != _quantity(had_size):
        out.append(f"spec.vllm.modelCache.size is {wanted_size}, the claim's {had_size}")
    if "storageClassName" in want and want["storageClassName"] != have.get("storageClassName"):
        out.append(f"spec.vllm.modelCache.storageClassName is {want['storageClassName']}, the claim's "
                   f"{have.get('storageClassName')}")
    if sorted(want["accessModes"]) != sorted(have.get("accessModes") or []):
        out.append(f"spec.vllm.modelCache.accessModes is {want['accessModes']}, the claim's {have.get('accessModes')}")
    return out


def _quantity(value: Any) -> Decimal | None:
    try:
        return parse_quantity(value) if value is not None else None
    except ValueError:
        return None


ATTACHED = "Attached"


def attached(target: Target) -> bool:
    return target.spec.vllm.mode == ATTACHED


def attach_status(target: Target, bypassed: str | None = None) -> dict[str, Any] | None:
    """status.attach (camelCase), or None (a pod labelled for the resource is then refused): not
    Attached, no namespace id, an unpinned image, or the id's route names held by another id.
    bypassed: why the cache is off for vLLM now; the policies then admit new pods without the
    connection; running pods are the user's to restart (the CacheBypassed condition says)."""
    digest = image_digest(target.spec.image)
    if not attached(target) or target.namespace_id is None or digest is None or not target.routes:
        return None
    pins = target.spec.identity.resolved()
    return {
        "namespaceId": target.namespace_id,
        "model": target.spec.identity.model_id,
        "imageDigest": digest,
        "pins": [{"flag": flag, "value": str(pins[attr]), "field": pin_field(attr)}
                 for attr, flag in PIN_FLAGS if pins[attr] is not None],
        "args": ["--kv-transfer-config", kv_transfer_config_json(target), *kv_events_args(target)],
        "env": [*({"name": name, "value": value} for name, value in FIXED_ENV),
                *({"name": name, "fieldPath": path} for name, path in kv_events_env(target))],
        "serverSelector": target.id_selector(SERVER),
        **({"bypassed": bypassed} if bypassed is not None else {}),
    }


def attached_peer(target: Target) -> dict[str, Any]:
    """The policy's ZMQ peer for attached pods: only pods the policies admitted for this resource and
    id carry both labels (checked on every change)."""
    return {"podSelector": {"matchLabels": {ATTACH_LABEL: target.name, NAMESPACE_ID_LABEL: str(target.namespace_id)}}}


POOL_API_GROUP = "inference.networking.k8s.io"
POOL_API_VERSION = f"{POOL_API_GROUP}/v1"
POOL_KIND = "InferencePool"


def build_inference_pool(target: Target) -> dict[str, Any] | None:
    """spec.vllm.inferencePool: every namespace id's vLLM pods (serving across a pin change). None when
    unset, and when Attached (the user's KServe or llm-d pools their pods)."""
    pool = target.spec.vllm.inference_pool
    if pool is None or attached(target):
        return None
    picker = pool.endpoint_picker
    return manifest(POOL_API_VERSION, POOL_KIND, target.metadata(target.vllm_name, VLLM), {
        "selector": {"matchLabels": target.selector(VLLM)},
        "targetPorts": [{"number": target.spec.vllm.port}],
        "endpointPickerRef": {"group": "", "kind": "Service", "name": picker.name, "port": {"number": picker.port},
                              "failureMode": picker.failure_mode},
    })
