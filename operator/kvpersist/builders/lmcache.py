"""The lmcache server: its command line, its L2 adapter JSON, and the StatefulSet that runs it."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from kvpersist import __version__
from kvpersist.api.v1alpha1 import GIB, KVCacheNamespaceSpec, chunk_layer_bytes, l1_page_bytes, parse_quantity
from kvpersist.builders import buildcheck
from kvpersist.builders.retained import retained_annotations, retained_labels
from kvpersist.builders.security import (
    AGENT_USER,
    DATA_GROUP,
    HOME_ENV,
    TMP_PATH,
    container_security_context,
    data_plane_security_context,
    data_plane_volumes,
    pod_security,
)
from kvpersist.builders.target import (
    AGENT_TOKEN_KEY,
    AGENT_TOKEN_MOUNT_PATH,
    AGENT_TOKEN_VOLUME,
    HF_TOKEN_ENV,
    L2_KEY_FILE,
    L2_KEY_MOUNT_PATH,
    L2_KEY_VOLUME,
    L2_MOUNT_PATH,
    L2_VOLUME,
    SERVER,
    Target,
)
from kvpersist.inserver import program_source
from kvpersist.inserver.serve import CHECKED_TYPE, SERDE_TYPE

# The inventory agent runs from the operator's own image; the Helm chart sets this to it.
AGENT_IMAGE_ENV = "KVPERSIST_AGENT_IMAGE"
DEFAULT_AGENT_IMAGE = f"ghcr.io/kvpersist/kvpersist-operator:{__version__}"
AGENT_CONTAINER = "inventory-agent"

# The lmcache server's root filesystem is read-only; /tmp and HOME are emptyDirs
# (security.data_plane_volumes). numba caches lmcache's kernels at import next to their source or in ~/.cache:
# without a writable NUMBA_CACHE_DIR lmcache 0.5.6 falls back to its CLI-only mode and
# `lmcache server` exits ("unrecognized arguments"; measured with a read-only root).
# nixl_store_dynamic's one NIXL backend the operator runs (files on the mounted claim): not a field.
NIXL_BACKEND = "POSIX"
NUMBA_CACHE_DIR = f"{TMP_PATH}/numba"
TMP_SIZE_LIMIT = "1Gi"  # measured: a few hundred KB of numba cache


# lmcache's HTTP admin API (/env, /cache/clear, DELETE /cache/objects, /quota, /reconfigure) binds
# the pod's loopback: nothing outside the pod reaches it, whatever the CNI enforces. The kubelet's
# probes run inside the container (exec), and the agent forwards the operator's two reads.
ADMIN_HOST = "127.0.0.1"
# An exec probe: the image's python3 (lmcache's image is a Python one) asks /healthcheck on loopback.
HEALTH_SCRIPT = ("import sys, urllib.request; "
                 "sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)")
# The server writes L2 group-writable (its folders 2775 in the fsGroup, files 0664), so the
# non-root agent in that group can delete them. Measured with lmcache 0.5.6 (docs/security.md):
# with the default umask 0022 the agent's delete fails with EACCES. `$0` is the program: the
# image's python3 running kvpersist.inserver.serve (its source in SERVE_ENV), which registers
# kvpersist's L2 serde and then runs lmcache's own `lmcache` entry point with these args.
SERVE_ENV = "KVPERSIST_LMCACHE_SERVE"
SERVER_COMMAND = ["sh", "-c", f'umask 0002 && exec "$0" -c "${SERVE_ENV}" "$@"', "python3"]


def serve_source() -> str:
    """kvpersist.inserver.serve as the server container runs it (python3 -c), with the module
    beside it that it imports (kvpersist.inserver.program_source)."""
    return program_source()


# The server requests no GPU (that would take one from vLLM) yet opens vLLM's KV on the node's
# GPUs by CUDA IPC, finding each by UUID (lmcache's DeviceIPCWrapper._get_device_index_from_uuid).
# The NVIDIA runtime (the pod's runtimeClassName) mounts every GPU for this variable; a server that
# sees none fails to open the KV ("No CUDA GPUs are available", measured: gpu_ipc_check.py).
GPU_VISIBILITY_ENV = ({"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                      {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"})


# lmcache 0.5.6 sends anonymous usage telemetry to its stats server unless told not to
# (lmcache/usage_telemetry/identity.py), and at start probes the CPU in a subprocess (py-cpuinfo):
# measured here at about 2 CPU-seconds during the first L2 reads after a restart. Off in every server.
TELEMETRY_OFF_ENV = ({"name": "LMCACHE_TRACK_USAGE", "value": "false"}, {"name": "DO_NOT_TRACK", "value": "1"})


# Headroom on top of L1 for the server's own memory (torch, buffers), as LMCache's operator does.
MEMORY_OVERHEAD_GIB = 5
MEMORY_LIMIT_FACTOR = 1.5


def l2_path(target: Target) -> str:
    """Where this namespace's files live on the claim: one folder per namespace id, so two
    KVCacheNamespaces on one volume never read each other's files."""
    return f"{L2_MOUNT_PATH}/{target.namespace_id}"


# lmcache counts an object at its framed size (encrypted or checked) (its chunk and a frame of a few bytes),
# while a file takes whole pages on disk (fs: the filesystem's 4 KiB; nixl_store_dynamic: L1's page,
# so one page more than the chunk). The adapter is given that share of the declared capacity, so
# the disk stays within what was declared (the agent trims to it) without trimming what lmcache
# still counts as stored. 63/64: chunks of 252 KiB or more on 4 KiB pages.
FOUR_KIB_DISK_SHARE = 63 / 64


def framed_disk_share(spec: KVCacheNamespaceSpec) -> float:
    """The share of the capacity lmcache may count: a chunk over its file. For nixl_store_dynamic the
    smallest chunk (one layer) over one layer and a page: at most a seventeenth lost, since the page is at
    most a sixteenth of a layer (api l1_page_bytes)."""
    layer = chunk_layer_bytes(spec)
    page = l1_page_bytes(spec)
    if spec.l2.nvme is None or spec.l2.nvme.adapter != "nixl_store_dynamic" or layer is None or layer % page:
        return FOUR_KIB_DISK_SHARE
    return layer / (layer + page)


# Threads that seal and open the chunks of a batch side by side (kvpersist.inserver.serve): one per
# core the server pod requests, at most this many.
MAX_SERDE_WORKERS = 64
DEFAULT_SERVER_CPU = "2"


def serde_workers(target: Target) -> int:
    """The serde's threads, one per whole core of the server container's CPU request. Why: AES-GCM
    runs at a few GB/s a core (benchmarks/RESULTS.md), so a GPU node's L2 reads outrun the serde
    unless the work spreads over the cores the pod was given; more threads than cores only
    contend for them."""
    return min(MAX_SERDE_WORKERS, server_cores(target))


def server_cores(target: Target) -> int:
    """Whole cores of the server container's CPU request (at least 1)."""
    cpu = server_resources(target)["requests"].get("cpu", DEFAULT_SERVER_CPU)
    return max(1, math.ceil(parse_quantity(cpu)))  # exact (a Decimal): 2 is 2, not 2.0000000001


# fs_native's C++ I/O threads: each reads or writes one whole chunk file at a time (a blocking
# read() of megabytes, which the kernel splits into many device requests), so they are the reads in
# flight and cost no CPU while they wait. IO_WORKERS_PER_CORE per core of the server's CPU request.
IO_WORKERS_PER_CORE, MIN_IO_WORKERS, MAX_IO_WORKERS = 4, 4, 128


def io_workers(target: Target) -> int:
    """fs_native's I/O threads (num_workers), following the server pod's CPU request as the serde's
    workers do. Why: a GPU node's L2 must keep many reads in flight to reach its drives' rate
    (LMCache's own note: 48-50 GB/s from 8 NVMe drives once enough reads were in flight); each
    thread holds one. On this project's RAM-backed bench the count did not matter (one loop device
    thread was the limit: benchmarks/RESULTS.md)."""
    return max(MIN_IO_WORKERS, min(MAX_IO_WORKERS, IO_WORKERS_PER_CORE * server_cores(target)))


def l2_serde(target: Target) -> dict[str, Any]:
    """kvpersist's serde around the adapter, in every mode: each object framed as version, key
    fingerprint, IV, then segments bound to the object's name and the namespace id, so a changed
    byte or another name is a miss, never wrong bytes (kvpersist.inserver.serve). Encrypted
    (spec.l2.encryption, the default): AES-GCM under lmcache's keys, the master key a file from a
    Secret volume, never an argument or a variable; the settings carry its expected fingerprint
    (the one the id was computed with) and the server refuses to start on a key file of another,
    before it reads or removes anything. Off: kvpersist-checked, the same frames sealed under a
    public key (a checksum, not a secret: lmcache keeps none, and served damaged files as hits)."""
    if target.key_secret is None:
        return {"type": CHECKED_TYPE, "max_workers": serde_workers(target), "namespace_id": target.namespace_id}
    return {"type": SERDE_TYPE, "aes_bits": 256, "max_workers": serde_workers(target),
            "master_key_path": f"{L2_KEY_MOUNT_PATH}/{L2_KEY_FILE}",
            "key_fingerprint": target.key_fingerprint, "namespace_id": target.namespace_id}


def l2_adapter_config(target: Target) -> dict[str, Any]:
    """The --l2-adapter JSON. Carries its own eviction and capacity so L2 stays under maxCapacity,
    or under the budget (a hard cap, no eviction) when one is set, and the serde."""
    spec = target.spec
    eviction: dict[str, Any] = {"eviction_policy": spec.eviction.policy, "trigger_watermark": spec.eviction.trigger_watermark,
                                "eviction_ratio": spec.eviction.eviction_ratio}
    nvme = spec.l2.nvme
    if nvme is None:
        bucket = spec.l2.hf_bucket
        assert bucket is not None
        return {
            "type": "hfbucket",
            "bucket_handle": f"{bucket.bucket_handle.rstrip('/')}/{target.namespace_id}",
            "token_env": HF_TOKEN_ENV,
            # Never lmcache: its create_bucket sets no visibility, so the bucket would be public unless the
            # org defaults to private. The operator's preflight creates it private (createBucketIfMissing);
            # a write before that is a failed store, counted in L2Ready, never a public bucket.
            "create_bucket_if_missing": False,
            "num_workers": bucket.num_workers,
            "metadata_cache_ttl_secs": bucket.metadata_cache_ttl_seconds,
            "max_capacity_gb": bucket.max_capacity_gb,
            "shared": True,
            "eviction": eviction,
            "serde": l2_serde(target),
        }
    capacity_gb = nvme.max_capacity_gb
    if nvme.budget_bytes is not None:
        # A budget is a hard cap: the adapter's capacity, and no eviction to make room under it,
        # so at the cap stores are refused and what is stored stays (lmcache 0.5.6 measured).
        capacity_gb = nvme.budget_bytes / GIB
        eviction["eviction_policy"] = "noop"
    capacity_gb *= framed_disk_share(spec)
    if nvme.adapter == "fs_native":
        adapter = {"type": "fs_native", "base_path": l2_path(target), "num_workers": io_workers(target),
                   "use_odirect": nvme.direct_io, "max_capacity_gb": capacity_gb}
    elif nvme.adapter == "fs":
        adapter = {"type": "fs", "base_path": l2_path(target), "use_odirect": nvme.direct_io}
    else:
        adapter = {
            "type": "nixl_store_dynamic",
            "backend": NIXL_BACKEND,
            # nixl_store_dynamic takes string values in backend_params.
            "backend_params": {
                "file_path": l2_path(target),
                "use_direct_io": "true" if nvme.direct_io else "false",
                "max_capacity_gb": _number(capacity_gb),
            },
        }
    return {**adapter, "persist_enabled": True, "eviction": eviction, "serde": l2_serde(target)}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def worker_sourced_kv_events(target: Target) -> bool:
    """Whether the servers keep no KV event log, so that the connector in vLLM announces its own
    stores (spec.vllm.kvEvents on a build that moves KV engine-driven). lmcache 0.5.6's server log
    announces a stored chunk only with its tokens, which only the lmcache-driven transfer reports
    (lmcache/v1/multiprocess/modules/kv_events.py, lmcache_driven_transfer.py); vLLM's CPU build
    moves KV engine-driven (lmcache's CPU device default), so with the log every store is
    "unbound" and nothing reaches vLLM's stream. Without the log (--kv-event-log-size 0) the
    connector falls back to its own store events: stores, no evictions. A CUDA vLLM moves KV
    lmcache-driven, and the log announces stores and L1 evictions: kept (docs/datapath.md, "KV events")."""
    return target.spec.vllm.kv_events.enabled and buildcheck.declared_vllm_variant(target.spec.identity.connector_build) == "cpu"


def server_args(target: Target) -> list[str]:
    """`lmcache server` arguments. The ZMQ port binds all interfaces (vLLM pods on the node reach
    it); the admin API binds loopback only, and /run_script stays off."""
    spec = target.spec
    events = ["--kv-event-log-size", "0"] if worker_sourced_kv_events(target) else []
    return [
        "server",
        "--host", "0.0.0.0",
        "--port", str(spec.lmcache_server.port),
        "--http-host", ADMIN_HOST,
        "--http-port", str(spec.lmcache_server.http_port),
        "--l1-size-gb", _number(spec.l1.size_gb),
        # L1's page, which nixl_store_dynamic also moves and sizes files in (api l1_page_bytes).
        "--l1-align-bytes", str(l1_page_bytes(spec)),
        "--eviction-policy", spec.eviction.policy,
        "--eviction-trigger-watermark", _number(spec.eviction.trigger_watermark),
        "--eviction-ratio", _number(spec.eviction.eviction_ratio),
        "--l2-adapter", json.dumps(l2_adapter_config(target), separators=(",", ":"), sort_keys=True),
        # An L2 hit stays in L1 for the next request. lmcache 0.5.6's default policy drops every
        # chunk it loaded from L2 once the engine has it, so after a server restart each repeat of
        # a prefix read L2 again, while a prefix recomputed (before vLLM re-registered) came from
        # L1: the "server restarted, vLLM kept" TTFT of benchmarks/RESULTS.md (docs/datapath.md).
        "--l2-prefetch-policy", "retain",
        "--no-run-script-api-enabled",
        # Both transfer paths: lmcache-driven (CUDA IPC, vLLM on GPUs) and engine-driven (what
        # vLLM's CPU build uses); each engine picks its own, the KV bytes are the same.
        "--supported-transfer-mode", "auto",
        # vLLM's pods and these share no /dev/shm, IPC or PID namespace. lmcache's default CUDA IPC
        # (torch storage IPC, whose reference counter is a /dev/shm file, and CUDA interprocess
        # events) cannot open vLLM's KV then: "mapping of buffer object failed", measured on an
        # H200 with lmcache 0.5.6's own wrappers (hack/gpu_ipc_check.py,
        # docs/measurements/gpu-ipc-h200.json). Isolated IPC (cudaIpc memory handles, events on
        # timeline semaphores: lmcache/v1/platform/devices/cuda/ipc_wrapper.py RawCudaIPCWrapper,
        # timeline_semaphore_event_ipc.py) worked there in every pod layout. The connector sets
        # lmcache.mp.isolated_ipc to match (builders/connection.py).
        "--isolated-ipc",
        *events,
    ]


def server_resources(target: Target) -> dict[str, dict[str, str]]:
    """Memory from L1 (L1 + 5Gi requested, 1.5x that as the limit) unless the spec overrides it."""
    request_mi = math.ceil((target.spec.l1.size_gb + MEMORY_OVERHEAD_GIB) * 1024)
    limit_mi = math.ceil(request_mi * MEMORY_LIMIT_FACTOR)
    requests: dict[str, str] = {"memory": f"{request_mi}Mi", "cpu": DEFAULT_SERVER_CPU}
    limits: dict[str, str] = {"memory": f"{limit_mi}Mi"}
    override = target.spec.lmcache_server.resources
    if override is not None:
        requests.update({k: str(v) for k, v in (override.requests or {}).items()})
        limits.update({k: str(v) for k, v in (override.limits or {}).items()})
    return {"requests": requests, "limits": limits}


def admin_url(target: Target) -> str:
    """lmcache's admin API as seen from inside its pod."""
    return f"http://{ADMIN_HOST}:{target.spec.lmcache_server.http_port}"


def _probe(target: Target, period: int, failures: int) -> dict[str, Any]:
    """Inside the container: the kubelet's httpGet would go to the pod IP, where nothing listens."""
    return {"exec": {"command": ["python3", "-c", HEALTH_SCRIPT, admin_url(target) + "/healthcheck"]},
            "periodSeconds": period, "timeoutSeconds": 3, "failureThreshold": failures}


def server_container(target: Target) -> dict[str, Any]:
    srv = target.spec.lmcache_server
    env: list[dict[str, Any]] = [{"name": SERVE_ENV, "value": serve_source()}, {"name": "LMCACHE_DISABLE_BANNER", "value": "1"},
                                 HOME_ENV,
                                 {"name": "NUMBA_CACHE_DIR", "value": NUMBA_CACHE_DIR}, *GPU_VISIBILITY_ENV,
                                 *TELEMETRY_OFF_ENV]
    bucket = target.spec.l2.hf_bucket
    if bucket is not None:
        # The token reaches the server only through the environment, from the Secret.
        env.append({"name": HF_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
            "name": bucket.token_secret_ref.name, "key": bucket.token_secret_ref.key}}})
    container: dict[str, Any] = {
        "name": "lmcache-server",
        "image": target.spec.image,
        "command": SERVER_COMMAND,
        "args": server_args(target),
        "env": env,
        "ports": [{"name": "zmq", "containerPort": srv.port, "protocol": "TCP"}],  # the admin API: loopback
        "resources": server_resources(target),
        # Loading torch and allocating L1 takes a while; the startup probe covers it (10 minutes),
        # checked every second so the pod turns Ready as soon as the server is healthy.
        "startupProbe": _probe(target, 1, 600),
        "readinessProbe": _probe(target, 5, 3),
        "livenessProbe": _probe(target, 10, 6),
        # vLLM's uid (security.DATA_PLANE_USER: it must open vLLM's 0600 shared-memory KV), in the
        # pod's data group, which owns the L2 folder (fsGroup, or the owner of a user's claim gave it).
        "securityContext": data_plane_security_context(DATA_GROUP),
    }
    mounts = []
    if target.spec.l2.nvme is not None:
        mounts.append({"name": L2_VOLUME, "mountPath": L2_MOUNT_PATH})
    if target.key_secret is not None:
        mounts.append({"name": L2_KEY_VOLUME, "mountPath": L2_KEY_MOUNT_PATH, "readOnly": True})
    container["volumeMounts"] = [*mounts, *data_plane_volumes()[1]]
    # Its lmcache must be the declared build: checked before `lmcache server` starts.
    return buildcheck.wrap(container, target, SERVER)


def _secret_volume(volume: str, secret: str, key: str, path: str, users_claim: str | None) -> dict[str, Any]:
    """One key of a Secret as one read-only file, mounted into one container only: read by its
    non-root user as a member of the pod's fsGroup, or, on a user's claim (no fsGroup: the file
    stays root's), as anyone in that container."""
    return {"name": volume, "secret": {"secretName": secret, "items": [{"key": key, "path": path}],
                                       "defaultMode": 0o444 if users_claim else 0o440}}


def agent_image() -> str:
    return os.environ.get(AGENT_IMAGE_ENV) or DEFAULT_AGENT_IMAGE


def agent_container(target: Target, image: str) -> dict[str, Any]:
    """The inventory agent (kvpersist.inventory.agent) beside the server, in every server pod: the one door
    into it. It forwards the operator's reads of lmcache's loopback-only admin API (/status with
    the resource's token, /metrics). With NVMe it is also the only thing that can read the volume
    for per-namespace reports and delete an orphaned namespace when an admin asks, and with
    fs_native or nixl_store_dynamic it holds the served folder to the adapter's capacity (the
    budget, else maxCapacity), which lmcache 0.5.6 loses track of after a restart; fs declares no
    capacity."""
    port = target.spec.lmcache_server.agent_port
    nvme = target.spec.l2.nvme
    args = ["agent", *(["--root", L2_MOUNT_PATH] if nvme is not None else []), "--host", "0.0.0.0", "--port", str(port),
            "--server-url", admin_url(target), "--token-file", f"{AGENT_TOKEN_MOUNT_PATH}/{AGENT_TOKEN_KEY}"]
    if target.namespace_id and nvme is not None:
        args += ["--serving", target.namespace_id]
        if nvme.adapter in ("nixl_store_dynamic", "fs_native"):  # the agent's (inventory.volume.TRIMMED_ADAPTERS)
            capacity = nvme.budget_bytes if nvme.budget_bytes is not None else int(nvme.max_capacity_gb * GIB)
            args += ["--capacity-bytes", str(capacity), "--adapter", nvme.adapter]
        if nvme.shared:
            # One folder, several servers: only ordinal 0's agent trims it, sparing what is younger
            # than the grace (kvpersist.inventory.agent.trimmer_of; docs/design.md).
            args += ["--shared-folder", "--trim-grace", str(SHARED_TRIM_GRACE_S)]
    probe = {"httpGet": {"path": "/healthz", "port": "agent"}, "periodSeconds": 10, "timeoutSeconds": 3, "failureThreshold": 3}
    mounts = [{"name": AGENT_TOKEN_VOLUME, "mountPath": AGENT_TOKEN_MOUNT_PATH, "readOnly": True}]
    # Non-root, no capability: it reads and deletes what the server wrote through the pod's
    # fsGroup (DATA_GROUP; the server writes group-writable), and reads its token file the same way.
    # On a user's claim (no fsGroup) only where its owner gave the volume's root that group, setgid.
    if nvme is not None:
        mounts.insert(0, {"name": L2_VOLUME, "mountPath": L2_MOUNT_PATH})
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
        "volumeMounts": mounts,
        "securityContext": {**container_security_context(), "runAsUser": AGENT_USER, "runAsGroup": DATA_GROUP,
                            "runAsNonRoot": True},
    }


# With spec.l2.nvme.shared the agents learn their pod's name (its StatefulSet ordinal) from the
# downward API: ordinal 0's agent is the folder's one trimmer (kvpersist.inventory.agent).
POD_NAME_ENV = "KVPERSIST_POD_NAME"
POD_NAME_ENV_VAR = {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
# A shared folder's trimmer never deletes a file younger than this: another server may have just
# written it, or found it and be about to read it (docs/design.md, "Several writers on one folder").
SHARED_TRIM_GRACE_S = 120


def build_shared_claim(target: Target) -> dict[str, Any] | None:
    """spec.l2.nvme.shared with size: the one ReadWriteMany claim all the servers mount,
    `l2-<name>-lmcache-shared` (the StatefulSet then has no volumeClaimTemplate). Like the
    StatefulSet's claims it outlives the resource unless reclaimPolicy is Delete (then the
    controller gives it an owner reference), and carries no tracking label (builders.retained)."""
    nvme = target.spec.l2.nvme
    if nvme is None or not nvme.shared or nvme.size is None or target.shared_claim is None:
        return None
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": str(nvme.size)}}}
    if nvme.storage_class_name:
        spec["storageClassName"] = nvme.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": target.shared_claim, "namespace": target.namespace,
                     "labels": retained_labels(target.name, SERVER), "annotations": retained_annotations()},
        "spec": spec,
    }


def build_lmcache_statefulset(target: Target, image_of_agent: str | None = None) -> dict[str, Any]:
    """One lmcache server per GPU node of this resource (required anti-affinity), on the same
    nodes vLLM may use. With NVMe, each replica gets its own claim, kept when pods or the set go
    (persistentVolumeClaimRetentionPolicy follows reclaimPolicy), or with shared all mount one
    (build_shared_claim, or the user's). Scaled to zero, never deleted, while the cache is
    disabled, so no claim is lost over a missing pin."""
    spec = target.spec
    selector = target.selector(SERVER)
    containers = [server_container(target), agent_container(target, image_of_agent or target.agent_image or DEFAULT_AGENT_IMAGE)]
    nvme = spec.l2.nvme
    # spec.l2.nvme.existingClaimName: a claim the operator did not make. Its server pod gets no
    # fsGroup, so the kubelet never re-owns the user's volume (chgrp and g+rwX over every file, which
    # Postgres and others refuse on their data); what the volume must then allow is the user's to
    # set (docs/api.md). The claims of volumeClaimTemplates are the operator's and keep DATA_GROUP.
    users_claim = nvme.existing_claim_name if nvme is not None else None
    pod_spec: dict[str, Any] = pod_security(fs_group=None if users_claim else DATA_GROUP, pod_spec={
        "containers": containers,
        # No host namespace: isolated CUDA IPC (server_args) needs none, so the baseline Pod
        # Security level admits these pods (docs/security.md).
        "terminationGracePeriodSeconds": 60,
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": selector}, "topologyKey": "kubernetes.io/hostname"}]}},
    })
    if spec.image_pull_secrets:  # the server's image and the agent's (the operator's), in the user's namespace
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in spec.image_pull_secrets]
    if spec.lmcache_server.runtime_class_name:
        pod_spec["runtimeClassName"] = spec.lmcache_server.runtime_class_name
    if spec.vllm.node_selector:
        pod_spec["nodeSelector"] = dict(spec.vllm.node_selector)
    if spec.vllm.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.vllm.tolerations]
    sts_spec: dict[str, Any] = {
        "serviceName": target.metrics_service_name,
        "replicas": min(spec.lmcache_server.replicas, target.max_servers if target.max_servers is not None
                        else spec.lmcache_server.replicas) if target.cache_enabled else 0,
        "podManagementPolicy": "Parallel",
        "selector": {"matchLabels": selector},
        "template": {"metadata": {"labels": target.labels(SERVER)}, "spec": pod_spec},
    }
    volumes = []
    if target.key_secret is not None:  # the server's; it fails to start (and says so) without the key
        volumes.append(_secret_volume(L2_KEY_VOLUME, *target.key_secret, L2_KEY_FILE, users_claim))
    volumes.append(_secret_volume(AGENT_TOKEN_VOLUME, target.agent_token_secret, AGENT_TOKEN_KEY, AGENT_TOKEN_KEY, users_claim))
    one_claim = target.shared_claim or users_claim
    if one_claim:
        volumes.append({"name": L2_VOLUME, "persistentVolumeClaim": {"claimName": one_claim}})
    volumes += data_plane_volumes(TMP_SIZE_LIMIT)[0]
    pod_spec["volumes"] = volumes
    if nvme is not None and not one_claim:
        claim_spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": str(nvme.size)}}}
        if nvme.storage_class_name:
            claim_spec["storageClassName"] = nvme.storage_class_name
        sts_spec["volumeClaimTemplates"] = [{"metadata": {"name": L2_VOLUME, "labels": target.selector(SERVER)},
                                             "spec": claim_spec}]
        sts_spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": nvme.reclaim_policy, "whenScaled": "Retain"}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": target.metadata(target.server_name, SERVER),
        "spec": sts_spec,
    }
