"""The lmcache server: its command line, its L2 adapter JSON, the StatefulSet that runs it, the node-local
Service in front of it, the PodDisruptionBudget that takes node drains one server at a time, and the
NetworkPolicy: lmcache's admin API (no authentication) binds loopback, the agent checks the resource's token
itself, and the policy is the second line where the CNI enforces it."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

from kvpersist import __version__
from kvpersist.api.quantity import parse_quantity
from kvpersist.api.spec import LABEL_VALUE, l1_page_bytes
from kvpersist.api.vllmpod import REQUIRED, server_term
from kvpersist.builders import buildcheck
from kvpersist.builders.retained import retained_annotations, retained_labels
from kvpersist.builders.security import (
    AGENT_USER,
    DATA_GROUP,
    DATA_PLANE_USER,
    HOME_ENV,
    TMP_PATH,
    data_plane_volumes,
    pod_security,
    security_context,
)
from kvpersist.builders.target import (
    AGENT_TOKEN_KEY,
    AGENT_TOKEN_MOUNT_PATH,
    AGENT_TOKEN_VOLUME,
    L2_KEY_FILE,
    L2_KEY_MOUNT_PATH,
    L2_KEY_VOLUME,
    L2_MOUNT_PATH,
    L2_VOLUME,
    SERVER,
    VLLM,
    Target,
    manifest,
)
from kvpersist.builders.vllm import attached, attached_peer, claim_spec, placement, quantities
from kvpersist.inserver import program_source
from kvpersist.inserver.serve import CHECKED_TYPE, SERDE_TYPE
from kvpersist.l2backends import backend_of
from kvpersist.l2backends.backend import lmcache_number

# The inventory agent runs from the operator's own image; the Helm chart sets this to it.
AGENT_IMAGE_ENV = "KVPERSIST_AGENT_IMAGE"
DEFAULT_AGENT_IMAGE = f"ghcr.io/kvpersist/kvpersist-operator:{__version__}"
AGENT_CONTAINER = "inventory-agent"

# numba caches lmcache's kernels at import; under the read-only root, without a writable
# NUMBA_CACHE_DIR lmcache 0.5.6 falls back to its CLI-only mode and `lmcache server` exits (measured).
NUMBA_CACHE_DIR = f"{TMP_PATH}/numba"
TMP_SIZE_LIMIT = "1Gi"  # measured: a few hundred KB of numba cache

# lmcache's HTTP admin API (/env, /cache/clear, ...) binds loopback: nothing outside the pod reaches
# it, whatever the CNI enforces. The probes run inside the container; the agent forwards the operator's reads.
ADMIN_HOST = "127.0.0.1"
HEALTH_SCRIPT = ("import sys, urllib.request; "
                 "sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)")
# umask 0002: L2 group-writable, so the non-root agent in the fsGroup can delete it (with 0022 its
# delete fails with EACCES: docs/security.md). `$0`: python3 running kvpersist.inserver.serve (source in
# SERVE_ENV), which registers kvpersist's L2 serde, then runs lmcache's `lmcache` entry point with the args.
SERVE_ENV = "KVPERSIST_LMCACHE_SERVE"
SERVER_COMMAND = ["sh", "-c", f'umask 0002 && exec "$0" -c "${SERVE_ENV}" "$@"', "python3"]


# The server requests no GPU (that would take vLLM's) yet opens vLLM's KV by CUDA IPC, finding each GPU
# by UUID; the NVIDIA runtime mounts every GPU for this variable, and a server that sees none fails to
# open the KV ("No CUDA GPUs are available", measured: gpu_ipc_check.py).
GPU_VISIBILITY_ENV = ({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                      {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"})

# lmcache 0.5.6 sends usage telemetry unless told not to, and probes the CPU at start (py-cpuinfo):
# about 2 CPU-seconds during the first L2 reads after a restart (measured). Off in every server.
TELEMETRY_OFF_ENV = ({"name": "LMCACHE_TRACK_USAGE", "value": "false"}, {"name": "DO_NOT_TRACK", "value": "1"})

# Headroom on top of L1 for the server's own memory (torch, buffers), as LMCache's operator does.
MEMORY_OVERHEAD_GIB = 5
MEMORY_LIMIT_FACTOR = 1.5


# The serde's threads (kvpersist.inserver.serve): one per core the server requests, at most this many.
MAX_SERDE_WORKERS = 64
DEFAULT_SERVER_CPU = "2"


def serde_workers(target: Target) -> int:
    """One per whole core requested: AES-GCM runs at a few GB/s a core (benchmarks/RESULTS.md), so L2
    reads outrun the serde unless it spreads over the pod's cores; more threads only contend."""
    return min(MAX_SERDE_WORKERS, server_cores(target))


def server_cores(target: Target) -> int:
    cpu = server_resources(target)["requests"].get("cpu", DEFAULT_SERVER_CPU)
    return max(1, math.ceil(parse_quantity(cpu)))  # exact (a Decimal): 2 is 2, not 2.0000000001


# fs_native's I/O threads each move one whole chunk file at a time (a blocking read() of megabytes):
# they are the reads in flight and cost no CPU while they wait. IO_WORKERS_PER_CORE per requested core.
IO_WORKERS_PER_CORE, MIN_IO_WORKERS, MAX_IO_WORKERS = 4, 4, 128


def io_workers(target: Target) -> int:
    """fs_native's num_workers, following the CPU request: L2 needs many reads in flight to reach its
    drives' rate (LMCache: 48-50 GB/s from 8 NVMe drives), one per thread (benchmarks/RESULTS.md)."""
    return max(MIN_IO_WORKERS, min(MAX_IO_WORKERS, IO_WORKERS_PER_CORE * server_cores(target)))


def l2_serde(target: Target) -> dict[str, Any]:
    """kvpersist's serde around the adapter (kvpersist.inserver.serve: what its frames guard). Encrypted (the
    default): AES-GCM, the master key a file from a Secret volume (never an argument or a variable). Off:
    kvpersist-checked, the same frames under a public key (a checksum: lmcache served damaged files as hits)."""
    if target.key_secret is None:
        return {"type": CHECKED_TYPE, "max_workers": serde_workers(target), "namespace_id": target.namespace_id}
    return {"type": SERDE_TYPE, "aes_bits": 256, "max_workers": serde_workers(target),
            "master_key_path": f"{L2_KEY_MOUNT_PATH}/{L2_KEY_FILE}",
            "key_fingerprint": target.key_fingerprint, "namespace_id": target.namespace_id}


def l2_adapter_config(target: Target) -> dict[str, Any]:
    """The --l2-adapter JSON: the backend's adapter with its own eviction and capacity, and the serde."""
    spec = target.spec
    eviction: dict[str, Any] = {"eviction_policy": spec.eviction.policy, "trigger_watermark": spec.eviction.trigger_watermark,
                                "eviction_ratio": spec.eviction.eviction_ratio}
    return {**backend_of(spec.l2).adapter_config(target, eviction, io_workers(target)), "serde": l2_serde(target)}


def worker_sourced_kv_events(target: Target) -> bool:
    """Whether the servers keep no KV event log, so the connector announces its own stores (stores, no
    evictions). lmcache 0.5.6's log announces a chunk only with its tokens, which only lmcache-driven
    transfer reports; vLLM's CPU build moves KV engine-driven, so every store would be "unbound". A CUDA
    vLLM moves KV lmcache-driven: the log is kept (docs/datapath.md, "KV events")."""
    return target.spec.vllm.kv_events.enabled and buildcheck.declared_vllm_variant(target.spec.identity.connector_build) == "cpu"


def server_args(target: Target) -> list[str]:
    """`lmcache server` arguments: ZMQ on all interfaces (vLLM pods on the node reach it), the admin
    API on loopback only, /run_script off."""
    spec = target.spec
    return [
        "server",
        "--host", "0.0.0.0",
        "--port", str(spec.lmcache_server.port),
        "--http-host", ADMIN_HOST,
        "--http-port", str(spec.lmcache_server.http_port),
        "--l1-size-gb", lmcache_number(spec.l1.size_gb),
        # L1's page, which nixl_store_dynamic also moves and sizes files in (api l1_page_bytes).
        "--l1-align-bytes", str(l1_page_bytes(spec)),
        "--eviction-policy", spec.eviction.policy,
        "--eviction-trigger-watermark", lmcache_number(spec.eviction.trigger_watermark),
        "--eviction-ratio", lmcache_number(spec.eviction.eviction_ratio),
        "--l2-adapter", json.dumps(l2_adapter_config(target), separators=(",", ":"), sort_keys=True),
        # An L2 hit stays in L1 for the next request: lmcache 0.5.6's default drops it once the engine
        # has it, so after a server restart every repeat of a prefix read L2 again (docs/datapath.md).
        "--l2-prefetch-policy", "retain",
        "--no-run-script-api-enabled",
        # lmcache-driven (CUDA IPC, vLLM on GPUs) and engine-driven (vLLM's CPU build): each engine picks.
        "--supported-transfer-mode", "auto",
        # vLLM's pods and these share no /dev/shm, IPC or PID namespace: lmcache's default CUDA IPC (a
        # /dev/shm reference counter) then fails ("mapping of buffer object failed", measured on an H200:
        # hack/gpu_ipc_check.py, docs/measurements/gpu-ipc-h200.json); isolated IPC (cudaIpc handles,
        # timeline semaphores) worked in every pod layout. The connector matches (builders/vllm.py).
        "--isolated-ipc",
        *(["--kv-event-log-size", "0"] if worker_sourced_kv_events(target) else []),
    ]


def server_resources(target: Target) -> dict[str, dict[str, str]]:
    """Memory from L1 (L1 + 5Gi requested, 1.5x that as the limit) unless the spec overrides it."""
    request_mi = math.ceil((target.spec.l1.size_gb + MEMORY_OVERHEAD_GIB) * 1024)
    defaults = {"requests": {"memory": f"{request_mi}Mi", "cpu": DEFAULT_SERVER_CPU},
                "limits": {"memory": f"{math.ceil(request_mi * MEMORY_LIMIT_FACTOR)}Mi"}}
    return {kind: {**default, **quantities(target.spec.lmcache_server.resources, kind)} for kind, default in defaults.items()}


def admin_url(target: Target) -> str:
    """lmcache's admin API as seen from inside its pod."""
    return f"http://{ADMIN_HOST}:{target.spec.lmcache_server.http_port}"


def _probe(target: Target, period: int, failures: int) -> dict[str, Any]:
    """exec, with the image's python3: an httpGet would go to the pod IP, where nothing listens."""
    return {"exec": {"command": ["python3", "-c", HEALTH_SCRIPT, admin_url(target) + "/healthcheck"]},
            "periodSeconds": period, "timeoutSeconds": 3, "failureThreshold": failures}


def server_container(target: Target) -> dict[str, Any]:
    backend = backend_of(target.spec.l2)
    l2 = [{"name": L2_VOLUME, "mountPath": L2_MOUNT_PATH}] if backend.mounts_volume else []
    key = [{"name": L2_KEY_VOLUME, "mountPath": L2_KEY_MOUNT_PATH, "readOnly": True}] if target.key_secret is not None else []
    # Its lmcache must be the declared build: checked before `lmcache server` starts.
    return buildcheck.wrap({
        "name": "lmcache-server",
        "image": target.spec.image,
        "command": SERVER_COMMAND,
        "args": server_args(target),
        "env": [{"name": SERVE_ENV, "value": program_source()}, {"name": "LMCACHE_DISABLE_BANNER", "value": "1"}, HOME_ENV,
                {"name": "NUMBA_CACHE_DIR", "value": NUMBA_CACHE_DIR}, *GPU_VISIBILITY_ENV, *TELEMETRY_OFF_ENV,
                *backend.server_env(target)],
        "ports": [{"name": "zmq", "containerPort": target.spec.lmcache_server.port, "protocol": "TCP"}],  # the admin API: loopback
        "resources": server_resources(target),
        # Loading torch and allocating L1 takes a while (10 minutes allowed), checked every second.
        "startupProbe": _probe(target, 1, 600),
        "readinessProbe": _probe(target, 5, 3),
        "livenessProbe": _probe(target, 10, 6),
        # vLLM's uid (it must open vLLM's 0600 shared-memory KV), in the data group that owns the L2 folder.
        "securityContext": security_context(DATA_PLANE_USER, DATA_GROUP),
        "volumeMounts": [*l2, *key, *data_plane_volumes()[1]],
    }, target, SERVER)


def _secret_volume(volume: str, secret: str, key: str, path: str, users_claim: str | None) -> dict[str, Any]:
    """One key of a Secret as a read-only file for one container: read through the pod's fsGroup, or
    on a user's claim (no fsGroup: the file stays root's) by anyone in that container."""
    return {"name": volume, "secret": {"secretName": secret, "items": [{"key": key, "path": path}],
                                       "defaultMode": 0o444 if users_claim else 0o440}}


def agent_image() -> str:
    return os.environ.get(AGENT_IMAGE_ENV) or DEFAULT_AGENT_IMAGE


def agent_container(target: Target, image: str) -> dict[str, Any]:
    """The inventory agent (kvpersist.inventory.agent), the one door into every server pod: it forwards
    the operator's reads of the loopback-only admin API; what it does with the store is the backend's
    (L2Backend.agent_args): with NVMe it reads, trims and (when an admin asks) deletes on the volume."""
    port = target.spec.lmcache_server.agent_port
    backend = backend_of(target.spec.l2)
    args = ["agent", *(["--root", L2_MOUNT_PATH] if backend.mounts_volume else []), "--host", "0.0.0.0", "--port", str(port),
            "--server-url", admin_url(target), "--token-file", f"{AGENT_TOKEN_MOUNT_PATH}/{AGENT_TOKEN_KEY}",
            *backend.agent_args(target)]
    probe = {"httpGet": {"path": "/healthz", "port": "agent"}, "periodSeconds": 10, "timeoutSeconds": 3, "failureThreshold": 3}
    l2 = [{"name": L2_VOLUME, "mountPath": L2_MOUNT_PATH}] if backend.mounts_volume else []
    # Non-root, no capability: it reads and deletes L2, and reads its token, through the fsGroup
    # (DATA_GROUP); on a user's claim only where its owner gave the volume's root that group, setgid.
    return {
        "name": AGENT_CONTAINER,
        **({"env": [POD_NAME_ENV_VAR]} if target.shared else {}),
        "image": image,
        "command": ["kvpersist"],
        "args": args,
        "ports": [{"name": "agent", "containerPort": port, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "readinessProbe": probe,
        "livenessProbe": probe,
        "volumeMounts": [*l2, {"name": AGENT_TOKEN_VOLUME, "mountPath": AGENT_TOKEN_MOUNT_PATH, "readOnly": True}],
        "securityContext": security_context(AGENT_USER, DATA_GROUP),
    }


# With spec.l2.nvme.shared ordinal 0's agent is the folder's one trimmer: its pod name from the downward API.
POD_NAME_ENV = "KVPERSIST_POD_NAME"
POD_NAME_ENV_VAR = {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}


def build_shared_claim(target: Target) -> dict[str, Any] | None:
    """spec.l2.nvme.shared with size: the ReadWriteMany claim all servers mount. Like the StatefulSet's
    claims it outlives the resource unless reclaimPolicy is Delete, with no tracking label (builders.retained)."""
    nvme = target.spec.l2.nvme
    if nvme is None or not nvme.shared or nvme.size is None or target.shared_claim is None:
        return None
    metadata = {"name": target.shared_claim, "namespace": target.namespace, "labels": retained_labels(target.name, SERVER),
                "annotations": retained_annotations()}
    return manifest("v1", "PersistentVolumeClaim", metadata, claim_spec(["ReadWriteMany"], nvme.size, nvme.storage_class_name))


def build_lmcache_statefulset(target: Target) -> dict[str, Any]:
    """One lmcache server per GPU node (required anti-affinity), where vLLM may run. With NVMe each
    replica has its own claim (retention follows reclaimPolicy), or with shared all mount one. Scaled
    to zero, never deleted, while the cache is disabled, so no claim is lost over a missing pin."""
    spec = target.spec
    selector = target.selector(SERVER)
    nvme = spec.l2.nvme
    # A user's claim (existingClaimName): no fsGroup, so the kubelet never re-owns their volume (chgrp
    # and g+rwX over every file); what it must allow is the user's to set (docs/api.md).
    users_claim = nvme.existing_claim_name if nvme is not None else None
    pod_spec: dict[str, Any] = pod_security(fs_group=None if users_claim else DATA_GROUP, pod_spec={
        "containers": [server_container(target), agent_container(target, target.agent_image or DEFAULT_AGENT_IMAGE)],
        # No host namespace: isolated CUDA IPC (server_args) needs none (baseline Pod Security admits them).
        "terminationGracePeriodSeconds": 60,
        "affinity": {"podAntiAffinity": {REQUIRED: [server_term(selector)]}},
    })
    placement(pod_spec, spec, spec.lmcache_server.runtime_class_name)  # pull secrets: the agent's image too
    sts_spec: dict[str, Any] = {
        "serviceName": target.governing_service_name,
        "replicas": min(spec.lmcache_server.replicas, target.max_servers if target.max_servers is not None
                        else spec.lmcache_server.replicas) if target.cache_enabled else 0,
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": selector},
        "template": {"metadata": {"labels": target.labels(SERVER)}, "spec": pod_spec},
    }
    one_claim = target.shared_claim or users_claim
    pod_spec["volumes"] = [  # the key: the server's; it fails to start (and says so) without it
        *([_secret_volume(L2_KEY_VOLUME, *target.key_secret, L2_KEY_FILE, users_claim)] if target.key_secret is not None else []),
        _secret_volume(AGENT_TOKEN_VOLUME, target.agent_token_secret, AGENT_TOKEN_KEY, AGENT_TOKEN_KEY, users_claim),
        *([{"name": L2_VOLUME, "persistentVolumeClaim": {"claimName": one_claim}}] if one_claim else []),
        *data_plane_volumes(TMP_SIZE_LIMIT)[0]]
    if nvme is not None and not one_claim:
        sts_spec["volumeClaimTemplates"] = [{"metadata": {"name": L2_VOLUME, "labels": target.selector(SERVER)},
                                             "spec": claim_spec(["ReadWriteOnce"], nvme.size, nvme.storage_class_name)}]
        sts_spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": nvme.reclaim_policy, "whenScaled": "Retain"}
    return manifest("apps/v1", "StatefulSet", target.metadata(target.server_name, SERVER), sts_spec)


def build_local_service(target: Target) -> dict[str, Any]:
    """vLLM's way to its cache server: Local keeps connections on the node (CUDA IPC works within a
    node only); the namespace id in name and selector keeps it to servers of its clients' identity."""
    return manifest("v1", "Service", target.metadata(target.local_service_name, SERVER), {
        "type": "ClusterIP",
        "internalTrafficPolicy": "Local",
        "selector": target.id_selector(SERVER),
        "ports": [{"name": "zmq", "port": target.spec.lmcache_server.port, "targetPort": "zmq", "protocol": "TCP"}],
    })


def build_server_pdb(target: Target) -> dict[str, Any] | None:
    """An evicted server loses its node's L1 (its L2 is read again once it is back): a drain of many
    nodes at once would otherwise take every vLLM pod's cache server together. maxUnavailable 1, not
    minAvailable: it follows replicas without a rewrite and blocks nothing with the cache off.
    AlwaysAllow: a server that is not Ready serves nothing, so a drain need not wait for it. Servers the
    scheduler has found no node for for UNPLACED_AFTER_S are not counted: they would use up the one disruption for good.
    None with lmcacheServer.replicas 1: one disruption at a time over one server allows every eviction (one
    write less a new resource); one made for more servers is deleted (controller.decision.SWITCHED_OFF)."""
    if target.spec.lmcache_server.replicas <= 1:
        return None
    return manifest("policy/v1", "PodDisruptionBudget", target.metadata(target.server_name, SERVER), {
        "maxUnavailable": 1 + target.unplaced_servers,
        "selector": {"matchLabels": target.selector(SERVER)},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    })


# Where the operator runs, so the policy can admit it. Set by the Helm chart.
OPERATOR_NAMESPACE_ENV = "KVPERSIST_OPERATOR_NAMESPACE"
OPERATOR_LABELS = {"app.kubernetes.io/name": "kvpersist-operator"}

# A scraper admitted to the agent's port (the servers' /metrics): {"namespaceSelector": <LabelSelector>,
# "podSelector": <LabelSelector>?} as JSON, from the chart's metrics.scraper.
SCRAPER_ENV = "KVPERSIST_METRICS_SCRAPER"
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_OPERATORS = {"In", "NotIn", "Exists", "DoesNotExist"}


def _selector_problems(where: str, sel: Any) -> list[str]:
    """What is wrong with a LabelSelector (matchLabels, matchExpressions), each naming its place."""
    if not isinstance(sel, dict) or set(sel) - {"matchLabels", "matchExpressions"}:
        return [f"{where}: a label selector has matchLabels and/or matchExpressions only"]
    out = []
    for k, v in (sel.get("matchLabels") or {}).items() if isinstance(sel.get("matchLabels") or {}, dict) else [(None, None)]:
        if k is None or not _LABEL_KEY.fullmatch(str(k)) or len(str(k)) > 316 or not isinstance(v, str) \
                or not re.fullmatch(LABEL_VALUE, v):
            out.append(f"{where}.matchLabels: {k!r}: {v!r} is not a label key and value")
    exprs = sel.get("matchExpressions") or []
    for i, e in enumerate(exprs if isinstance(exprs, list) else [None]):
        ok = (isinstance(e, dict) and set(e) <= {"key", "operator", "values"} and isinstance(e.get("key"), str)
              and _LABEL_KEY.fullmatch(e["key"]) is not None and e.get("operator") in _OPERATORS
              and isinstance(e.get("values", []), list) and all(isinstance(x, str) for x in e.get("values", [])))
        if not ok:
            out.append(f"{where}.matchExpressions[{i}]: write {{key, operator: In|NotIn|Exists|DoesNotExist, values}}")
    return out


def parse_scraper(raw: str) -> dict[str, Any] | None:
    """The scraper's peer from SCRAPER_ENV's JSON; None when unset or empty. ValueError naming the
    field and the fix: a wrong selector must stop the operator, never admit more than was meant."""
    if not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        raise ValueError(f"{SCRAPER_ENV}: not JSON; the chart writes it from metrics.scraper") from None
    if not isinstance(value, dict) or set(value) - {"namespaceSelector", "podSelector"}:
        raise ValueError(f"{SCRAPER_ENV}: an object of namespaceSelector and podSelector (metrics.scraper)")
    if not value.get("namespaceSelector"):
        if value.get("podSelector"):
            raise ValueError("metrics.scraper.podSelector needs metrics.scraper.namespaceSelector: alone it selects pods "
                             "of each policy's own namespace; set namespaceSelector: {matchLabels: "
                             "{kubernetes.io/metadata.name: <the scraper's namespace>}}")
        return None
    problems = [p for k in ("namespaceSelector", "podSelector") if value.get(k)
                for p in _selector_problems(f"metrics.scraper.{k}", value[k])]
    if problems:
        raise ValueError("; ".join(problems))
    return {k: value[k] for k in ("namespaceSelector", "podSelector") if value.get(k)}


def build_network_policy(target: Target, operator_ns: str | None, scraper: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One per namespace id, named like its Service: the agent's port from the operator's pods only (none
    when its namespace is unknown) and the scraper when named (the servers' only metrics port); ZMQ
    from the id's vLLM pods only, so old pods never store into new servers during a pin change, whose
    old servers keep their own until none is left (controller.stale_routes). Attached: ZMQ from pods
    the attach policies admitted (attached_peer), not any pod wearing managed pods' labels. Cache off,
    or another id holding the name (target.routes False): every server under <name>-lmcache, no ZMQ,
    so none is ever without the agent's rule. No rule without peers: the kubelet probes from the node."""
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_ns}},
                "podSelector": {"matchLabels": OPERATOR_LABELS}}
    peers = [*([operator] if operator_ns else []), *([dict(scraper)] if scraper else [])]
    rules = [{"from": [peer], "ports": [{"protocol": "TCP", "port": target.spec.lmcache_server.agent_port}]} for peer in peers]
    if not target.routes:
        return _policy(target, target.per_id_name(None), target.selector(SERVER), rules, per_id=False)
    if target.cache_enabled:
        rules.append({
            "from": [attached_peer(target) if attached(target) else {"podSelector": {"matchLabels": target.id_selector(VLLM)}}],
            "ports": [{"protocol": "TCP", "port": target.spec.lmcache_server.port}],
        })
    return _policy(target, target.local_service_name, target.id_selector(SERVER), rules)


def _policy(target: Target, name: str, servers: dict[str, str], rules: list[dict[str, Any]],
            per_id: bool = True) -> dict[str, Any]:
    """Ingress to the servers `servers` selects by `rules` only; per_id False: labelled with no id."""
    spec: dict[str, Any] = {"podSelector": {"matchLabels": servers}, "policyTypes": ["Ingress"]}
    if rules:  # no rules: no key (the same deny-all); an applied `ingress: []` is stored as absent,
        spec["ingress"] = rules  # so every apply would count as a change and bump the generation
    return manifest("networking.k8s.io/v1", "NetworkPolicy", target.metadata(name, SERVER, per_id), spec)
