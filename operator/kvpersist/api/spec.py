"""spec of a KVCacheNamespace (the pins are kvpersist.api.identity's). Cross-field rules are written once, as CEL,
which the API server checks and the models evaluate (kvpersist.api.celrules): both refuse the same, in the same words."""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, Strict, WithJsonSchema, model_validator

from kvpersist.api import celrules
from kvpersist.api.celrules import cel
from kvpersist.api.identity import Identity
from kvpersist.api.models import APIModel, SpecPart, list_field
from kvpersist.api.quantity import MAX_INT64, parse_quantity
from kvpersist.api.structural import LABEL_NAME, QUALIFIED_NAME, schema_of
from kvpersist.api.text import NO_CONTROL_PATTERN, PROMPT_PATTERN, refuse_control, refuse_control_in_prompt
from kvpersist.identity import CHECKED_SERDE, image_digest

L2_KINDS = ("nvme", "hfBucket")  # spec.l2's union, as the API spells its members (status.l2Kind)

# The vLLM flags spec.vllm.extraArgs may set, spelled exactly (flag -> whether it takes a value): none changes the
# KV a prompt produces (scheduling may change a batch's float rounding, not what it computes). Refused: every other
# spelling vLLM's parser accepts (abbreviations, underscores, -O3, --some-config.key=value), the pins, the operator's
# own flags and whatever changes KV bytes, layout or tokens (--hf-overrides, --quantization, --trust-remote-code,
# LoRA, ...). tests/contract/test_extra_args_oracle.py checks this table against vLLM's own parsers.
EXTRA_ARGS: dict[str, bool] = {
    "--gpu-memory-utilization": True, "--max-num-seqs": True, "--max-num-batched-tokens": True,
    "--scheduling-policy": True, "--seed": True, "--max-logprobs": True, "--max-log-len": True,
    "--uvicorn-log-level": True, "--root-path": True, "--response-role": True, "--tool-call-parser": True,
    "--reasoning-parser": True, "--allowed-origins": True, "--allowed-methods": True, "--allowed-headers": True,
    "--enable-prefix-caching": False, "--disable-prefix-caching": False, "--no-enable-prefix-caching": False,
    "--enforce-eager": False, "--no-enforce-eager": False,
    "--enable-chunked-prefill": False, "--disable-chunked-prefill": False, "--no-enable-chunked-prefill": False,
    "--async-scheduling": False, "--no-async-scheduling": False,
    "--enable-auto-tool-choice": False, "--disable-log-stats": False,
    "--enable-log-requests": False, "--disable-log-requests": False,
    "--disable-uvicorn-access-log": False, "--disable-fastapi-docs": False,
    "--return-tokens-as-token-ids": False, "--enable-prompt-tokens-details": False,
}
EXTRA_ARG_REGEX = "^(" + "|".join(sorted(EXTRA_ARGS)) + ")(=.*)?$"  # flags are [a-z-]: nothing to escape
# The flags that take a value as the next item (else written --flag=value): a bare word anywhere else
# would reach vLLM as a positional argument (the model, say).
EXTRA_ARG_VALUE_FLAGS = "[" + ", ".join(f"'{f}'" for f in sorted(f for f, takes in EXTRA_ARGS.items() if takes)) + "]"


# Prefix segments start with a letter, digit, `_` or `-`: no `.` or `..` (the Hub resolves neither; another
# resource's data could be reached through them), no empty segment (`//`, a trailing `/`).
BUCKET_HANDLE = r"^hf://buckets/[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ObjectName = Annotated[str, Field(max_length=253, pattern=DNS_SUBDOMAIN)]  # a Kubernetes object's name
# A quantity that is a size: no sign, an exponent of at most two digits (1e309 overflows a float: refused at
# apply time, not an exception in the operator); QUANTITY_RULE bounds the value.
QUANTITY = r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]{1,2}))?$"
GIB = 1024**3
Port = Annotated[int, Field(ge=1, le=65535)]
# spec.l2.encryption's serde and frame version (kvpersist.inserver.serve), which opens no other version: part of
# the namespace id, so another frame format is another namespace.
L2_SERDE = "kvpersist-aesgcm-256/v3"

# Less than 2^63: the API server caps "99999Ei" at 2^63 - 1 silently and keeps a decimal past 2^63 as is; as a
# float either is 2^63 or more, so one comparison refuses both.
QUANTITY_RULE = cel("quantity(string(self)).asApproximateFloat() < 9223372036854775808.0",
                    "a quantity must be less than 8Ei (2^63): Kubernetes keeps one in an int64")


Quantity = Annotated[
    # Strict int: pydantic's lax int strips whitespace (U+2028 too) and takes True as 1, which the API server refuses.
    Annotated[str, Field(pattern=QUANTITY, max_length=64)] | Annotated[int, Strict(), Field(ge=0, le=MAX_INT64)],
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY, "maxLength": 64,
                    "x-kubernetes-int-or-string": True,
                    "x-kubernetes-validations": [QUANTITY_RULE]}),
]


# A string without a strict pattern of its own: no control or format character (kvpersist.api.text).
FreeText = Annotated[str, BeforeValidator(refuse_control), Field(json_schema_extra={"pattern": NO_CONTROL_PATTERN})]
# Label keys, toleration keys, resource names and label values as Kubernetes checks them in a pod template:
# refused at apply time naming the field, not later as a Deployment the API server refuses. Field before the
# validator: pydantic keeps the pattern in the schema only in that order (the control check still runs first).
LABEL_VALUE = "^(" + LABEL_NAME + ")?$"  # QUALIFIED_NAME: kvpersist.api.structural
QualifiedName = Annotated[str, Field(min_length=1, max_length=317, pattern=QUALIFIED_NAME), BeforeValidator(refuse_control)]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE), BeforeValidator(refuse_control)]


def _cel_rules(*rules: dict[str, str]) -> ConfigDict:
    """A model's own cross-field CEL rules (its object's x-kubernetes-validations)."""
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": list(rules)})


def _section(model: type[APIModel], description: str) -> Any:
    """A section that may be left out, its defaults spelled out in full (not `{}`): the API server checks CEL rules
    against the default as written."""
    default = model().model_dump(by_alias=True, exclude_none=True, mode="json")
    return Field(default_factory=model, description=description, json_schema_extra={"default": default})


def _bytes(field: str) -> str:
    """CEL for a quantity field's bytes, as the API server reads them."""
    return f"quantity(string(self.{field})).asApproximateFloat()"


def _gib(value: Any) -> float:
    """A quantity in GiB, as lmcache's flags and configuration take sizes."""
    return float(parse_quantity(value)) / GIB


class L1(SpecPart):
    """The lmcache server's host-RAM tier."""

    model_config = _cel_rules(
        # has(): a resource stored before l1.size existed has none, and a rule that cannot be
        # evaluated would refuse even its status writes (measured on the API server).
        cel(f"!has(self.size) || ({_bytes('size')} >= 1048576.0 && {_bytes('size')} <= 4398046511104.0)",
            "size must be at least 1Mi and at most 4Ti", field_path=".size"),
    )

    size: Quantity = Field(description="Host RAM for the lmcache server's L1 buffer, e.g. 32Gi (--l1-size-gb).")

    @property
    def size_gb(self) -> float:
        return _gib(self.size)


# spec.l2.nvme.shared: one ReadWriteMany claim and one folder for all the servers (docs/design.md,
# "Several writers on one folder").
SHARED_FIXED = ("shared is fixed once set (switching would strand the stored KV in the other claims): create a new "
                "KVCacheNamespace to change it")


# maxCapacity unset: the share of a new claim's size lmcache may fill (the rest is the filesystem's).
NVME_CAPACITY_SHARE = 0.9


class NVMe(SpecPart):
    """A local NVMe volume as L2: a PersistentVolumeClaim per lmcache server, or an existing claim;
    with shared, one ReadWriteMany claim all the servers use."""

    model_config = _cel_rules(
        cel("has(self.size) != has(self.existingClaimName)",
            "set exactly one of size (a new claim per lmcache server) or existingClaimName", reason="FieldValueInvalid"),
        cel("!has(self.storageClassName) || has(self.size)",
            "storageClassName applies to a new claim: set size with it, or drop it with existingClaimName",
            field_path=".storageClassName"),
        cel(f"!has(self.size) || {_bytes('size')} >= 1048576.0", "size must be at least 1Mi", field_path=".size"),
        cel("has(self.size) || has(self.maxCapacity)",
            "maxCapacity is required with existingClaimName (with size it defaults to 90% of size)",
            field_path=".maxCapacity"),
        cel(f"!has(self.maxCapacity) || ({_bytes('maxCapacity')} >= 1048576.0 && (!has(self.size) || "
            f"{_bytes('size')} >= {_bytes('maxCapacity')}))",
            "maxCapacity must be at least 1Mi and fit in the claim: lower maxCapacity or raise size",
            field_path=".maxCapacity"),
        cel("has(self.size) == has(oldSelf.size) && (!has(self.size) || self.size == oldSelf.size)",
            "size is fixed once set (claims are made from it and keep their data): create a new KVCacheNamespace "
            "for another size", field_path=".size"),
        cel("has(self.storageClassName) == has(oldSelf.storageClassName) && "
            "(!has(self.storageClassName) || self.storageClassName == oldSelf.storageClassName)",
            "storageClassName is fixed once set: create a new KVCacheNamespace for another class",
            field_path=".storageClassName"),
        cel("!has(self.existingClaimName) || self.reclaimPolicy == 'Retain'",
            "an existing claim is not the operator's to delete: use reclaimPolicy Retain", field_path=".reclaimPolicy"),
        cel(f"!has(self.budget) || ({_bytes('budget')} >= 1048576.0 && ((has(self.maxCapacity) && "
            f"{_bytes('budget')} <= {_bytes('maxCapacity')}) || (!has(self.maxCapacity) && has(self.size) && "
            f"{_bytes('budget')} <= {_bytes('size')} * {NVME_CAPACITY_SHARE})))",
            "budget must be at least 1Mi and at most maxCapacity (90% of size when unset)", field_path=".budget"),
        cel("!has(self.budget) || self.adapter == 'nixl_store_dynamic'",
            "budget needs adapter nixl_store_dynamic: it refuses writes past its capacity; fs_native only counts them "
            "(its eviction makes room instead) and fs declares no capacity", field_path=".budget"),
        cel("self.shared == oldSelf.shared", SHARED_FIXED, field_path=".shared"),
        cel("!self.shared || !has(self.size) || self.reclaimPolicy == oldSelf.reclaimPolicy",
            "with shared, reclaimPolicy is fixed once set: the one claim was made with it (owned by the resource "
            "for Delete, not for Retain); create a new KVCacheNamespace to change it", field_path=".reclaimPolicy"),
        cel("!self.shared || self.adapter == 'nixl_store_dynamic'",
            "shared needs adapter nixl_store_dynamic: its writes are a temp file of a name of their own and a rename, "
            "and its lookups find files other servers wrote (measured); fs_native and fs write one temp name per chunk, "
            "which two servers storing the same chunk at once would share", field_path=".shared"),
    )

    storage_class_name: ObjectName | None = Field(None, description="StorageClass of the new claim; the cluster default when unset.")
    size: Quantity | None = Field(None, description="Size of the new claim, e.g. 500Gi.")
    existing_claim_name: ObjectName | None = Field(
        None, description="Use this existing PersistentVolumeClaim instead of creating one (one lmcache server replica).")
    adapter: Literal["fs_native", "nixl_store_dynamic", "fs"] = Field(
        "fs_native",
        description="LMCache L2 adapter, one file per chunk: fs_native (LMCache's C++ adapter: I/O threads following the "
        "server's CPU request, each reading a whole chunk file, the fastest read), nixl_store_dynamic (one event-loop "
        "thread; needed for budget and shared) or fs (Python). Part of the namespace id (each names and sizes its "
        "files otherwise): a change moves to a new namespace and folder, and the old folder's KV stays there as an "
        "orphan (`kvpersist report`, `kvpersist gc`). A resource created before fs_native was the default keeps the "
        "nixl_store_dynamic the API stored then.",
    )
    max_capacity: Quantity | None = Field(
        None,
        description="Capacity LMCache may fill, e.g. 450Gi; the L2 eviction of fs_native and nixl_store_dynamic keeps "
        "usage below it (the fs adapter declares no capacity: there the claim's size is the bound). Unset: 90% of size (the rest is "
        "the filesystem's); required with existingClaimName.",
    )
    budget: Quantity | None = Field(
        None,
        description="Hard cap on this namespace's L2 bytes, e.g. 200Gi. At the cap new L2 writes are refused (nothing "
        "is evicted to make room) while lookups of stored KV go on hitting; status shows it (condition WithinBudget). "
        "After a server restart lmcache counts from zero and accepts writes again; the inventory agent then deletes "
        "the oldest files to keep the folder within the budget. "
        "Unset: maxCapacity with the eviction policy keeps usage under capacity by evicting.",
    )
    direct_io: bool = Field(True, alias="directIO", description="Open L2 files with O_DIRECT (use_odirect / use_direct_io): "
                            "a file is read straight into L1, past the page cache, at the disk's speed "
                            "(benchmarks/RESULTS.md). "
                            "Set false on a filesystem without O_DIRECT (stores then fail, and L2Ready says L2WritesFailing).")
    reclaim_policy: Literal["Retain", "Delete"] = Field(
        "Retain",
        description="What happens to the KV data when the KVCacheNamespace is deleted: Retain keeps the claim and its "
        "data, Delete removes the claims the operator created.",
    )
    shared: bool = Field(
        False,
        description="One ReadWriteMany claim for all the lmcache servers (one per node), in one namespace folder, so a "
        "vLLM pod on any node is served the KV another node stored: existingClaimName then names a shared filesystem's "
        "claim (NFS, Lustre, EFS, CephFS) and lmcacheServer.replicas may be more than 1; with size the operator makes "
        "one claim, l2-<name>-lmcache-shared, ReadWriteMany. maxCapacity and budget are the folder's, trimmed by one "
        "server's agent (docs/design.md). Not part of the namespace id (the KV bytes are the same); fixed once set.",
    )

    @property
    def budget_bytes(self) -> int | None:
        return int(parse_quantity(self.budget)) if self.budget is not None else None

    @property
    def max_capacity_gb(self) -> float:
        """maxCapacity in GiB, or 90% of size: what lmcache may fill."""
        return _gib(self.max_capacity) if self.max_capacity is not None else _gib(self.size) * NVME_CAPACITY_SHARE


SecretKey = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]


class SecretKeyRef(SpecPart):
    """A key of a Secret in the resource's namespace."""

    name: ObjectName = Field(description="Name of the Secret.")
    key: SecretKey = Field("token", description="Key in the Secret.")


class HFBucket(SpecPart):
    """A Hugging Face bucket as L2 (LMCache's hfbucket adapter): remote, durable, shareable."""

    bucket_handle: str = Field(
        max_length=512, pattern=BUCKET_HANDLE,
        description="hf://buckets/<namespace>/<bucket>[/<prefix>]; objects land under the prefix, then the namespace id.",
    )
    token_secret_ref: SecretKeyRef = Field(
        description="Secret key holding a Hugging Face token with write access; it reaches the server only as an "
        "environment variable.",
    )
    create_bucket_if_missing: bool = Field(False, description="Create the bucket when it does not exist.")
    exclusive_to_this_cluster: bool = Field(
        False, description="True only when no other cluster reads or writes this bucket prefix. `kvpersist gc` deletes a "
        "namespace from the bucket only when true: this cluster cannot see another cluster's resources and servers, so "
        "a namespace that looks orphaned here may be in use there. Not part of the namespace id.",
    )
    num_workers: int = Field(4, ge=1, le=256, description="Parallel upload/download workers of the adapter.")
    metadata_cache_ttl_seconds: float = Field(
        30, ge=0, le=86_400, alias="metadataCacheTTLSeconds",
        description="How long the adapter trusts its cached listing of the bucket, in seconds.",
    )
    max_capacity: Quantity = Field(
        description="Capacity LMCache may fill in the bucket, e.g. 2Ti; 0 disables capacity-driven eviction.",
    )

    @property
    def max_capacity_gb(self) -> float:
        return _gib(self.max_capacity)


class KeySecretRef(SecretKeyRef):
    """A Secret key holding L2's master key (its raw bytes, at least 32)."""

    key: SecretKey = Field("master-key", description="Key in the Secret.")


class L2Encryption(SpecPart):
    """Authenticated encryption of L2 (AES-256-GCM, a key per cache salt derived from a master key). On by default:
    lmcache keeps no checksum, so a right-sized file of other bytes (bit rot, tampering) would be a hit; here a miss."""

    enabled: bool = Field(
        True, description="Encrypt and authenticate every L2 object. Turning it off or on is a new namespace (the id "
        "hashes it): plain and encrypted objects never meet.",
    )
    key_secret_ref: KeySecretRef | None = Field(
        None, description="The master key: a Secret key with at least 32 random bytes, mounted into the lmcache server "
        "as a file (never in args or env). Unset: the operator generates Secret <name>-l2-key (key master-key) once "
        "and never deletes it, so the data stays readable after the resource is deleted and re-created. Name the same "
        "Secret in every cluster that shares a bucket. Another key under the same namespace reads as misses, never as "
        "wrong bytes.",
    )


class OrphanRetention(SpecPart):
    """An opt-in age limit on the folders of OTHER namespaces on this resource's claims."""

    max_age_days: int = Field(
        ge=1, le=36500,
        description="Remove a folder of another namespace (one an identity change left behind) once its newest file is "
        "older than this many days. Never the namespace this resource serves, never one any live KVCacheNamespace or "
        "lmcache server uses; each removal is an Event (OrphanExpired) and counted in status.l2.",
    )


class L2(SpecPart):
    """The durable tier: exactly one of nvme or hfBucket."""

    model_config = _cel_rules(
        cel("has(self.nvme) != has(self.hfBucket)", "set exactly one of nvme or hfBucket", reason="FieldValueInvalid"),
        cel("has(self.nvme) == has(oldSelf.nvme)",
            "the L2 kind is fixed once set (the cached data lives there): create a new KVCacheNamespace instead"),
        cel("!has(self.orphanRetention) || has(self.nvme)",
            "orphanRetention applies to NVMe claims: a bucket's orphans are deleted with `kvpersist gc`",
            field_path=".orphanRetention"),
    )

    nvme: NVMe | None = Field(None, description="NVMe PersistentVolumeClaim as L2 (fs_native, nixl_store_dynamic or fs).")
    hf_bucket: HFBucket | None = Field(None, description="Hugging Face bucket as L2 (hfbucket adapter).")
    encryption: L2Encryption = _section(L2Encryption, "Authenticated encryption of L2 objects: corruption is a miss.")
    orphan_retention: OrphanRetention | None = Field(
        None,
        description="Off by default: other namespaces' folders on the claim are kept until `kvpersist gc` deletes them. "
        "Set maxAgeDays to let the inventory agent remove those unwritten for that long. Not part of the namespace id.",
    )

    @property
    def kind(self) -> str:
        return "nvme" if self.nvme is not None else "hfBucket"


class Eviction(SpecPart):
    """How LMCache makes room, in L1 and in the L2 adapter."""

    policy: Literal["LRU", "noop"] = Field("LRU", description="LRU or noop (stores fail when full).")
    # The source setup's values: evict at 90 % of capacity, a tenth at a time. A round frees less
    # than the 0.2 lmcache would pick and starts later, so more of the disk serves hits.
    trigger_watermark: float = Field(0.9, gt=0, le=1, description="Usage fraction of capacity at which eviction starts.")
    eviction_ratio: float = Field(0.1, gt=0, le=1, description="Fraction of capacity freed by each eviction round.")


class Resources(SpecPart):
    """Container resource requests and limits."""

    requests: dict[QualifiedName, Quantity] | None = Field(None, max_length=32,
                                                           description="Requests by resource name, e.g. memory: 80Gi.")
    limits: dict[QualifiedName, Quantity] | None = Field(None, max_length=32, description="Limits by resource name.")


class Toleration(SpecPart):
    """A pod toleration. One naming no key is refused: it would put these GPU-seeing pods on any node."""

    # The last three: what Kubernetes refuses in a pod's tolerations, refused at apply time instead of as a Deployment.
    model_config = _cel_rules(
        cel("self.operator != 'Exists' || (has(self.key) && self.key != '')",
            "operator Exists without a key tolerates every taint (control-plane, GPU nodes reserved for others, "
            "NoExecute evictions): name the taint key, e.g. key: nvidia.com/gpu", field_path=".key", reason="FieldValueForbidden"),
        cel("self.operator == 'Exists' || has(self.key)", "operator Equal matches a taint by key and value: name the taint key",
            field_path=".key"),
        cel("self.operator != 'Exists' || !has(self.value) || self.value == ''",
            "operator Exists matches every value of the key: drop value, or use operator Equal", field_path=".value"),
        cel("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            "applies to NoExecute taints only: set effect NoExecute, or drop tolerationSeconds", field_path=".tolerationSeconds"),
    )

    key: QualifiedName | None = Field(None, description="Taint key, e.g. nvidia.com/gpu. Required: without one a "
                                      "toleration with operator Exists would match every taint, and is refused.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Exists or Equal.")
    value: LabelValue | None = Field(None, description="Taint value for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; all effects when unset.")
    toleration_seconds: int | None = Field(None, ge=0, description="How long a NoExecute taint is tolerated.")


# The NVIDIA GPU Operator's RuntimeClass; "" for none (as storageClassName ""): `kubectl apply` drops a null
# and lets the schema's default back in (seen on the local cluster).
DEFAULT_RUNTIME_CLASS = "nvidia"
RUNTIME_CLASS_PATTERN = "^$|" + DNS_SUBDOMAIN


class LMCacheServer(SpecPart):
    """The lmcache server pods (a StatefulSet, one PersistentVolumeClaim per replica for NVMe)."""

    model_config = _cel_rules(cel("self.agentPort != self.port", "agentPort must differ from port", field_path=".agentPort"))

    replicas: int = Field(1, ge=1, le=256, description="Number of lmcache server pods; each vLLM pod joins one on its node.")
    port: Port = Field(5555, description="ZMQ port that vLLM's LMCacheMPConnector talks to.")
    agent_port: Port = Field(
        8090, description="Port of the agent beside each server: the operator's door to lmcache's /status and /metrics, "
        "and with NVMe L2 per-namespace usage of the volume and deletion of an orphaned namespace on an admin's request.")

    @property
    def http_port(self) -> int:
        """lmcache's HTTP admin port (/healthcheck, /status, /metrics): on the pod's loopback only, so
        not a field; next to port (5556 by default), on whichever side agentPort leaves free."""
        return next(p for p in (self.port + 1, self.port + 2, self.port - 1, self.port - 2)
                    if 1 <= p <= 65535 and p != self.agent_port)
    resources: Resources | None = Field(
        None, description="Overrides; memory is otherwise requested as L1 + 5Gi and limited to 1.5x that.",
    )
    runtime_class_name: str = Field(
        DEFAULT_RUNTIME_CLASS, max_length=253, pattern=RUNTIME_CLASS_PATTERN,
        description="RuntimeClass of the server pods. The server requests no GPU but opens vLLM's KV through CUDA "
        "IPC, so it must see the node's GPUs: the NVIDIA runtime does that from NVIDIA_VISIBLE_DEVICES=all. \"\": "
        "the node's default runtime (where that is NVIDIA's).",
    )


# spec.vllm.env and envFrom names (C identifiers: the start script reads them back), refused as docs/api.md's table
# says why; VLLM_* and PYTHON* are allow-lists (tests/contract checks the VLLM_* ones are read by vLLM). envFrom's keys,
# unknown at apply time, come in under a prefix and the start script sets only the allowed ones (builders/vllm.py).
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
ENV_REFUSED = (
    # The operator's: vLLM's prefix hashes (so the chunk keys) follow PYTHONHASHSEED; the KV must live in a child
    # of PID 1 for CUDA IPC; HOME is an emptyDir, where vLLM writes its caches under a read-only root.
    "PYTHONHASHSEED", "VLLM_ENABLE_V1_MULTIPROCESSING", "HOME",
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "VLLM_API_KEY",  # a Secret key's field, never a literal
    "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE",  # spec.vllm.modelCache
    "HF_ENDPOINT",  # another endpoint may serve other files under the pinned revision
    # The GPUs are the device plugin's (gpusPerReplica): the lmcache server finds vLLM's by them.
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "PATH", "GCONV_PATH",  # other code than the image's (glibc's iconv loads the shared objects GCONV_PATH names)
)
# LMCACHE_*: the connector's configuration is the operator's. LD_*: the dynamic loader's, in every process of the
# container before any code of ours (LD_PRELOAD, LD_AUDIT may redirect every symbol).
ENV_REFUSED_PREFIXES = ("LMCACHE_", "KVPERSIST_", "LD_")
# The VLLM_* and PYTHON* names that may be set; the rest of each family is refused.
VLLM_ENV_ALLOWED = (
    "VLLM_CACHE_ROOT", "VLLM_CONFIGURE_LOGGING", "VLLM_DISABLE_COMPILE_CACHE", "VLLM_DO_NOT_TRACK",
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "VLLM_LOGGING_LEVEL",
    "VLLM_LOGGING_PREFIX", "VLLM_LOG_STATS_INTERVAL", "VLLM_NO_USAGE_STATS",
)  # not VLLM_LOGGING_CONFIG_PATH: logging.config.dictConfig runs any callable its file names ("()")
# Python's variables that change only its output or crash report. The rest of PYTHON* chooses the code (PYTHONPATH,
# PYTHONSTARTUP, ...), imports a module it names (PYTHONBREAKPOINT) or changes what it does (PYTHONOPTIMIZE, ...).
PYTHON_ENV_ALLOWED = ("PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER", "PYTHONIOENCODING", "PYTHONUNBUFFERED")
ENV_ALLOW_LISTED: dict[str, tuple[tuple[str, ...], str]] = {
    "VLLM_": (VLLM_ENV_ALLOWED, "the others may change the KV, the attention backend or the model behind the identity "
              "pins"),
    "PYTHON": (PYTHON_ENV_ALLOWED, "the others load other code than the image's (PYTHONPATH, a PYTHONWARNINGS "
               "category, PYTHONBREAKPOINT, ...) or change what it computes"),
}
ENV_RULE = ("env names refused: " + ", ".join(sorted(ENV_REFUSED)) + ", any " + ", ".join(f"{p}*" for p in ENV_REFUSED_PREFIXES)
            + "; " + "; ".join(f"{p}* other than " + ", ".join(allowed) for p, (allowed, _) in ENV_ALLOW_LISTED.items())
            + " (they are the operator's, have a field of their own, change the KV or the model behind the identity "
            "pins, or load other code than the image's)")


def env_name_rule(name: str = "self", exempt: tuple[str, ...] = ()) -> str:
    """CEL: whether the variable `name` may be set in a vLLM container (spec.vllm.env's rule; the
    attach policy's with `exempt`, the names an attached pod may set itself)."""
    names = ", ".join(f"'{n}'" for n in sorted(set(ENV_REFUSED) - set(exempt)))
    prefixes = " && ".join(f"!{name}.startsWith('{p}')" for p in ENV_REFUSED_PREFIXES)
    families = " && ".join(f"(!{name}.startsWith('{p}') || {name} in [{', '.join(repr(n) for n in allowed)}])"
                           for p, (allowed, _) in ENV_ALLOW_LISTED.items())
    return f"!({name} in [{names}]) && {prefixes} && {families}"


EnvName = Annotated[str, Field(min_length=1, max_length=128, pattern=ENV_NAME,
                               json_schema_extra={"x-kubernetes-validations": [cel(env_name_rule(), ENV_RULE)]})]


class EnvVar(SpecPart):
    """A literal variable of the vLLM container. Secrets go through envFrom secretRef or the fields
    of their own (hfTokenSecretRef, apiKeySecretRef), never a literal value in the spec."""

    name: EnvName = Field(description="Variable name; see the refused names in docs/api.md.")
    value: Annotated[FreeText, Field(max_length=4096)] = Field("", description="Its value.")


class LocalObjectRef(SpecPart):
    """An object of the resource's namespace, by name."""

    name: ObjectName = Field(description="Its name.")


class EnvFromSource(SpecPart):
    """Every key of a Secret or ConfigMap as a variable of the vLLM container. A key that is a refused
    name (env_problem) never reaches vLLM, nor the loader or Python before it, and `env` wins."""

    model_config = _cel_rules(cel("has(self.secretRef) != has(self.configMapRef)", "set exactly one of secretRef or configMapRef",
                                  reason="FieldValueInvalid"))

    secret_ref: LocalObjectRef | None = Field(None, description="A Secret of the resource's namespace.")
    config_map_ref: LocalObjectRef | None = Field(None, description="A ConfigMap of the resource's namespace.")


class HFTokenSecretRef(SecretKeyRef):
    """A Secret key holding a Hugging Face token that may read the model (a gated one)."""


class APIKeySecretRef(SecretKeyRef):
    """A Secret key holding the API key vLLM requires of its clients (VLLM_API_KEY)."""

    key: SecretKey = Field("api-key", description="Key in the Secret.")


MODEL_CACHE_PATH = "/var/lib/kvpersist/hf"


class ModelCache(SpecPart):
    """A claim for the vLLM pods' model weights (HF_HOME): the user's, or `<name>-model-cache` the operator makes,
    owned by the resource: unlike L2's claims it goes with it, as weights can be downloaded again."""

    model_config = _cel_rules(
        cel("has(self.size) != has(self.existingClaimName)",
            "set exactly one of size (a claim the operator makes, <name>-model-cache) or existingClaimName "
            "(a claim of yours)", reason="FieldValueInvalid"),
        cel("!has(self.storageClassName) || has(self.size)",
            "storageClassName applies to the claim the operator makes: set size with it, or drop it with "
            "existingClaimName", field_path=".storageClassName"),
        cel("!has(self.accessModes) || has(self.size)",
            "accessModes applies to the claim the operator makes: set size with it, or drop it with "
            "existingClaimName", field_path=".accessModes"),
    )

    existing_claim_name: ObjectName | None = Field(
        None, description="An existing PersistentVolumeClaim in the resource's namespace, mounted read-write at HF_HOME "
        f"({MODEL_CACHE_PATH}) in every vLLM pod. Never deleted by the operator. With replicas > 1 on several nodes it "
        "must be ReadWriteMany (ReadWriteOnce mounts on one node only: pods elsewhere stay Pending). vLLM runs as uid "
        "10001 and the pod sets no fsGroup (your claim is never re-owned): its root must be writable by that uid.",
    )
    size: Quantity | None = Field(
        None, description="Instead of existingClaimName: the operator makes PersistentVolumeClaim <name>-model-cache of "
        "this size (e.g. 100Gi), owned by this resource (deleted with it). Made once: a later change of size, "
        "storageClassName or accessModes is not applied to the claim (a Warning event ModelCacheDiffers says so).",
    )
    storage_class_name: ObjectName | None = Field(
        None, description="StorageClass of the claim the operator makes; the cluster default when unset.")
    access_modes: list[Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"]] | None = Field(
        None, min_length=1, max_length=3,
        description="Access modes of the claim the operator makes; [ReadWriteOnce] when unset. ReadWriteMany when "
        "vLLM replicas run on several nodes (ReadWriteOnce mounts on one node only: pods elsewhere stay Pending).",
    )


class VLLMService(SpecPart):
    """A Service in front of this resource's vLLM pods (the OpenAI-compatible API)."""

    enabled: bool = Field(False, description="Make Service <name>-vllm.")
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP", description="Service type.")
    port: Port = Field(8000, description="Service port; it forwards to spec.vllm.port.")


KV_EVENTS_PORT = 5557  # vLLM's own default (KVEventsConfig.endpoint tcp://*:5557)


class KVEvents(SpecPart):
    """vLLM's KV events (--kv-events-config): a ZMQ PUB socket per vLLM pod, topic the namespace id (a block's, for a router)."""

    model_config = _cel_rules(cel("!has(self.replayPort) || self.replayPort != self.port", "replayPort must differ from port",
                                  field_path=".replayPort"))

    enabled: bool = Field(
        False, description="Publish KV events from every vLLM pod on port, topic the namespace id (docs/api.md, "
        "\"KV events\"). Only while the resource has a namespace id. Not part of the namespace id.",
    )
    topic_format: Literal["NamespaceId", "LLMD"] = Field(
        "NamespaceId", description="The topic of every message: NamespaceId, the resource's namespace id; LLMD, "
        "kv@<pod IP>:<spec.vllm.port>@<served model name>, the topic llm-d's precise prefix-cache scorer parses "
        "(subscribed to `kv@`; the pod IP from the downward API, KVPERSIST_POD_IP).",
    )
    port: Port = Field(KV_EVENTS_PORT, description="Port of the PUB socket (container port kv-events) a subscriber connects to.")
    replay_port: Port | None = Field(
        None, description="Port of vLLM's replay socket (ROUTER, container port kv-replay): a subscriber that missed "
        "sequence numbers asks it for the batches from one on. Unset: no replay socket.")


INFERENCE_POOL_PICKER_PORT = 9002  # the Gateway API Inference Extension's endpoint picker (EPP) gRPC port


class EndpointPicker(SpecPart):
    """The endpoint picker (EPP) a gateway asks which pod of the pool takes a request: a KV-aware one
    reads the pods' KV events (spec.vllm.kvEvents, topic the namespace id)."""

    name: str = Field(max_length=63, pattern=DNS_LABEL, description="Name of the picker's Service, in this namespace.")
    port: Port = Field(INFERENCE_POOL_PICKER_PORT, description="Port of the picker's Service.")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose", description="What a gateway does when the picker does not answer: FailClose refuses the request, "
        "FailOpen sends it to any pod of the pool.",
    )


class InferencePool(SpecPart):
    """An InferencePool (Gateway API Inference Extension) over this resource's vLLM pods, so a gateway
    routes through a KV-aware endpoint picker. Made only where the API server serves it."""

    endpoint_picker: EndpointPicker = Field(description="The endpoint picker the pool names (endpointPickerRef).")


class VLLM(SpecPart):
    """The vLLM serving pods, launched with exactly the pinned identity."""

    model_config = _cel_rules(
        cel("!self.kvEvents.enabled || (self.kvEvents.port != self.port && (!has(self.kvEvents.replayPort) || "
            "self.kvEvents.replayPort != self.port))", "kvEvents.port and kvEvents.replayPort must differ from port",
            field_path=".kvEvents.port"),
        # Guarded with has(): a stored object from before the field holds no key of it.
        cel("(has(self.mode) ? self.mode : 'Managed') == (has(oldSelf.mode) ? oldSelf.mode : 'Managed')",
            "vllm.mode is fixed at creation: to move between Managed and Attached, delete this resource and create it "
            "again with the same pins (the namespace id, and so the cached KV, is the same)", field_path=".mode"),
        cel("!has(self.mode) || self.mode != 'Attached' || ((!has(self.extraArgs) || size(self.extraArgs) == 0) "
            "&& (!has(self.env) || size(self.env) == 0) && (!has(self.envFrom) || size(self.envFrom) == 0) "
            "&& !has(self.modelCache) && !has(self.hfTokenSecretRef) && (!has(self.service) || "
            "!has(self.service.enabled) || !self.service.enabled))",
            "with vllm.mode Attached your own pods carry their arguments, environment, weights and Service: remove "
            "spec.vllm.extraArgs, env, envFrom, modelCache, hfTokenSecretRef and set service.enabled false "
            "(docs/attach.md)", field_path=".mode"),
        cel("!has(self.mode) || self.mode != 'Attached' || !has(self.inferencePool)",
            "with vllm.mode Attached your own pods are not the operator's to pool: remove spec.vllm.inferencePool "
            "(your KServe or llm-d makes its own InferencePool)", field_path=".inferencePool"),
    )

    mode: Literal["Managed", "Attached"] = Field(
        "Managed",
        description="Managed: the operator runs the vLLM Deployment. Attached: your own vLLM pods (a Deployment, "
        "KServe, llm-d) opt in with the label kvpersist.dev/attach=<this resource's name>; the API server adds the "
        "connection settings and admits a pod only when its image and arguments carry exactly these pins "
        "(docs/attach.md). Fixed at creation.",
    )
    replicas: int = Field(1, ge=0, le=1024, description="Number of vLLM pods.")
    gpus_per_replica: int | None = Field(
        None, ge=1, le=64,
        description="nvidia.com/gpu per pod; defaults to identity.tensorParallelSize (or 1).",
    )
    served_model_name: FreeText | None = Field(
        None, min_length=1, max_length=256, description="Name clients use in requests; defaults to identity.modelId.",
    )
    port: Port = Field(8000, description="OpenAI-compatible HTTP port.")
    extra_args: list[Annotated[FreeText, Field(max_length=1024)]] = list_field(
        64, "More vLLM arguments, from an allow-list of flags that do not change the KV (memory, batching, "
        "scheduling, logging, the HTTP API), spelled in full; everything else, the identity pins included, is refused: "
        "it could change KV under the same namespace.",
        cel(f"self.all(a, !a.startsWith('-') || a.matches('{EXTRA_ARG_REGEX}'))",
            "extraArgs may set only these vLLM flags, spelled in full: " + ", ".join(sorted(EXTRA_ARGS))
            + "; identity pins are set in spec.identity, and flags that change the KV are refused"),
        # By index (CEL has no pairwise walk): maxItems is 64, the list below as long.
        cel(f"[{', '.join(map(str, range(64)))}].all(i, i >= self.size() || (self[i].startsWith('-') ? "
            f"(!(self[i] in {EXTRA_ARG_VALUE_FLAGS}) || (i + 1 < self.size() && !self[i + 1].startsWith('-'))) "
            f": (i > 0 && self[i - 1] in {EXTRA_ARG_VALUE_FLAGS})))",
            "extraArgs: a value is the item right after a flag that takes one (or written --flag=value), and such a "
            "flag is followed by its value: any other word would reach vLLM as a positional argument"),
    )
    resources: Resources | None = Field(None, description="Extra requests/limits; GPUs come from gpusPerReplica.")
    node_selector: dict[QualifiedName, LabelValue] | None = Field(
        None, max_length=64, description="Node labels the vLLM pods (and so their lmcache servers) must run on.",
    )
    tolerations: list[Toleration] | None = Field(None, max_length=32, description="Tolerations of the vLLM pods.")
    runtime_class_name: str = Field(
        DEFAULT_RUNTIME_CLASS, max_length=253, pattern=RUNTIME_CLASS_PATTERN,
        description="RuntimeClass of the vLLM pods (the NVIDIA GPU Operator makes `nvidia`). \"\": the node's "
        "default runtime.",
    )
    env: list[EnvVar] = list_field(
        64, "Literal variables of the vLLM container. Names the operator owns, that have a field of their "
        "own, that would change the KV or the model behind the pins, or that load other code (every LD_*, PYTHON* but "
        "a few) are refused (docs/api.md). Not part of the namespace id.",
    )
    env_from: list[EnvFromSource] = list_field(
        4, "Secrets or ConfigMaps whose keys become variables of the vLLM container; a key that is a refused "
        "name is never set (the start script says so on stderr), and a name in env wins. Not part of the namespace id.",
    )
    hf_token_secret_ref: HFTokenSecretRef | None = Field(
        None,
        description="A Secret key with a Hugging Face token that may read the model (a gated one): HF_TOKEN in the "
        "vLLM container, from the Secret (never in args, the spec or a ConfigMap). Not part of the namespace id.",
    )
    api_key_secret_ref: APIKeySecretRef | None = Field(
        None, description="A Secret key with the API key vLLM requires of its clients: VLLM_API_KEY in the vLLM "
        "container, from the Secret (never in args). Not part of the namespace id.",
    )
    model_cache: ModelCache | None = Field(
        None, description="A claim for the model's weights (HF_HOME), so a restarted vLLM does not download them "
        "again. Not part of the namespace id: the pins name the weights by revision.",
    )
    service: VLLMService = _section(VLLMService, "An optional Service in front of the vLLM pods.")
    kv_events: KVEvents = _section(KVEvents, "KV cache events for a KV-aware router, topic the namespace id.")
    attached_containers: list[Annotated[str, Field(max_length=512, pattern=r"^[a-z0-9][a-z0-9._:/-]*@sha256:[0-9a-f]{64}$")]] = Field(
        default_factory=list, max_length=16,
        description="Attached mode: the images, by digest, that an attached pod's other containers (init containers and "
        "native sidecars included: a service mesh proxy, a log shipper, llm-d's routing sidecar) may run. They share "
        "the pod's network, a peer of the lmcache servers, so any other is refused (docs/attach.md). Not part of the "
        "namespace id.",
    )
    inference_pool: InferencePool | None = Field(
        None, description="An InferencePool <name>-vllm (inference.networking.k8s.io/v1) over the vLLM pods of every "
        "namespace id, where the API server serves that API (else a Warning event InferencePoolAPIMissing). Not with "
        "mode Attached. Not part of the namespace id.",
    )


_CANARY_COLOURS = ("amber", "cobalt", "crimson", "ivory", "jade", "onyx", "scarlet", "silver", "teal", "violet")
_CANARY_ANIMALS = ("falcon", "otter", "heron", "lynx", "badger", "marten", "osprey", "bison", "crane", "wren")
# spec.canary.prompt unset: a hundred records and a request to repeat them, so the answer depends on the first
# chunk's KV and is a confident greedy copy where the cache is right. 4,700 characters: 1,200 to 1,800 tokens with
# common tokenizers (five to seven lmcache chunks; hack/testmodel.py's byte-level one makes nearly a token of each
# character). One line: the spec's free text refuses line breaks.
DEFAULT_CANARY_PROMPT = (
    "The following records give a code for each name. Read them carefully. "
    + "".join(f"Record {i}: the code for {_CANARY_COLOURS[i % 10]} {_CANARY_ANIMALS[(i * 3 + i // 10) % 10]} is "
              f"{(i * 7919) % 9000 + 1000}. " for i in range(1, 101))
    + "Now repeat the records in order, starting from the first. Record 1: the code for")


class Canary(SpecPart):
    """A pinned greedy request answered once per namespace id without the cache, then with it after every (re)start
    and intervalSeconds: another answer turns the cache off until acknowledged (docs/api.md, the correctness canary)."""

    enabled: bool = Field(
        False, description="Send the canary's requests to this resource's vLLM pods (off by default: it is traffic to "
        "your vLLM; recommended on). Not part of the namespace id.",
    )
    prompt: FreeText | None = Field(
        None, min_length=1, max_length=32768,
        description="The prompt asked, as text, in one line. Unset: a built-in text of 4,700 characters (1,200 to 1,800 "
        "tokens with common tokenizers: several lmcache chunks of 256 tokens) whose answer depends on its first chunk. "
        "Its tokens and maxTokens must fit in maxModelLen.",
    )
    max_tokens: int = Field(16, ge=1, le=64, description="Greedy tokens generated and compared.")
    interval_seconds: int = Field(600, ge=60, le=86400, description="How often each vLLM pod is checked again when nothing restarted.")

    @property
    def effective_prompt(self) -> str:
        return self.prompt if self.prompt is not None else DEFAULT_CANARY_PROMPT


# spec.prewarm: prompts kept warm in every lmcache server's L1 (docs/api.md "Warm restarts").
PREWARM_INLINE_MAX = 16  # prompts, and as many system prompts, in the spec itself
PROMPT_MAX_CHARS = 32768  # one prompt in the spec (a ConfigMap holds longer ones: 1 MiB in all)
PromptText = Annotated[str, BeforeValidator(refuse_control_in_prompt),
                       Field(min_length=1, max_length=PROMPT_MAX_CHARS, json_schema_extra={"pattern": PROMPT_PATTERN})]


class Prewarm(SpecPart):
    """Prompts whose KV is loaded from L2 into the server's L1 (or computed once through vLLM) after every server or
    vLLM start and list change, so the first request after a restart is an L1 hit (the Warm condition)."""

    prompts: list[PromptText] = list_field(
        PREWARM_INLINE_MAX, "Raw prompts, tokenized as /v1/completions tokenizes them (special tokens added): each one's "
        "whole-chunk prefix (256 tokens a chunk) is kept warm, so a request that starts with it hits.",
    )
    system_prompts: list[PromptText] = list_field(
        PREWARM_INLINE_MAX, "System prompts, rendered through the model's chat template as the only message (no generation "
        "prompt): the prefix every chat with that system prompt starts with.",
    )
    config_map_ref: LocalObjectRef | None = Field(
        None, description="A ConfigMap of the resource's namespace with more of them: each data key prompt-* holds one "
        "raw prompt, each key system-* one system prompt (other keys are ignored). Read again every minute; its "
        "author must be allowed to get it (creator-rights policy).",
    )

    @property
    def declared(self) -> bool:
        return bool(self.prompts or self.system_prompts or self.config_map_ref)


IMAGE_REQUIRED = ("spec.image is required: the one image of vLLM and the lmcache server, by digest "
                  "(<image>@sha256:<64 hex>); it replaces spec.vllm.image and spec.lmcacheServer.image, which must "
                  "have named the same image (docs/upgrading.md)")


class KVCacheNamespaceSpec(SpecPart):
    """What the user wants: the pins, the tiers, eviction, and the two workloads."""

    model_config = _cel_rules(
        cel("!has(self.vllm.gpusPerReplica) || !has(self.identity.tensorParallelSize) || "
            "self.vllm.gpusPerReplica >= self.identity.tensorParallelSize",
            "vllm.gpusPerReplica must be at least identity.tensorParallelSize", field_path=".vllm.gpusPerReplica"),
        cel("!has(self.l2.nvme) || !has(self.l2.nvme.existingClaimName) || self.l2.nvme.shared || "
            "self.lmcacheServer.replicas == 1",
            "an existing claim serves one lmcache server: set lmcacheServer.replicas to 1, use size for a "
            "claim per server, or set l2.nvme.shared with a ReadWriteMany claim", field_path=".lmcacheServer.replicas"),
    )

    image: FreeText = Field(
        min_length=1, max_length=512,
        description="The one image of the vLLM and lmcache server containers, built from images/vllm-lmcache (the "
        "connector in vLLM and the server must be one lmcache build), by digest: <image>@sha256:<64 hex>. The digest "
        "is part of the namespace id; an image named by tag alone runs, without the cache (IdentityResolved False, "
        "reason ImageNotPinned).",
    )
    identity: Identity = Field(description="Identity pins; their hash is the compatibility namespace.")
    l1: L1 = Field(description="Host-RAM tier of the lmcache server.")
    l2: L2 = Field(description="Durable tier: an NVMe claim or a Hugging Face bucket.")
    eviction: Eviction = _section(Eviction, "Eviction policy of L1 and L2.")
    lmcache_server: LMCacheServer = _section(LMCacheServer, "The lmcache server pods.")
    vllm: VLLM = _section(VLLM, "The vLLM pods.")
    image_pull_secrets: list[LocalObjectRef] = list_field(
        4, "Secrets (docker-registry) of the resource's namespace that every pod the operator makes for it "
        "pulls its images with: vLLM, and the lmcache server with its inventory agent (the operator's image). Not "
        "part of the namespace id.",
    )
    canary: Canary = _section(Canary, "The live correctness canary: a cached answer checked against one computed "
                              "without the cache. Not part of the namespace id.")
    prewarm: Prewarm | None = Field(
        None, description="Prompts kept warm in every lmcache server's L1 after each server or vLLM (re)start, rollout "
        "and change of the list (the Warm condition). Not part of the namespace id.",
    )

    def pins(self, key_fingerprint: str | None = None) -> dict[str, Any]:
        """Everything the namespace id hashes: spec.identity, the image's digest (under both pins it had when vLLM and
        the server named images apart, so ids stay the same), the L2 serde and layout (l2_layout), and with encryption
        on the fingerprint of the servers' key, read from its Secret by the caller: None leaves the id unresolved."""
        digest = image_digest(self.image)
        return {**self.identity.resolved(), "vllm_image_digest": digest, "lmcache_server_image_digest": digest,
                "l2_serde": L2_SERDE if self.l2.encryption.enabled else CHECKED_SERDE,
                "l2_layout": l2_layout(self),
                "l2_key_fingerprint": key_fingerprint if self.l2.encryption.enabled else None}

    @model_validator(mode="before")
    @classmethod
    def _as_stored(cls, data: Any) -> Any:
        """Numbers as the API server reads them (celrules.json_numbers): 2.0 is the integer 2, true no number; the
        models are strict otherwise (SpecPart). Then the image: an object stored before spec.image existed comes back
        without its image fields (the API server prunes them): its workloads are left as they are until the spec
        names the image (docs/upgrading.md)."""
        if not isinstance(data, dict):
            return data
        data = celrules.json_numbers(spec_schema(), data, "spec")
        if "image" not in data:
            raise ValueError(IMAGE_REQUIRED)
        return data

    @model_validator(mode="after")
    def _cel_rules(self) -> KVCacheNamespaceSpec:
        """The CRD's CEL rules, every one under spec, on this spec as the API server would store it
        (kvpersist.api.celrules; transition rules, which need the old object, are left to it)."""
        stored = self.model_dump(by_alias=True, exclude_none=True, mode="json")
        if problems := celrules.violations(spec_schema(), stored, "spec"):
            raise ValueError("; ".join(problems))
        return self


@functools.cache
def spec_schema() -> dict[str, Any]:
    """The CRD's schema of spec, CEL rules included (built once, at the first validation)."""
    return schema_of(KVCacheNamespaceSpec)


def l2_layout(spec: KVCacheNamespaceSpec) -> str:
    """The L2 adapter's file layout, a pin: each adapter of lmcache 0.5.6 names and sizes its files otherwise, none
    reads another's, and the agent trims only the served adapter's, so a switch is a new namespace id and folder.
    The one place this is decided: anything else that changes the files (their page size) belongs here too."""
    if spec.l2.nvme is not None:
        if spec.l2.nvme.adapter == "nixl_store_dynamic":
            # nixl moves and sizes each file in L1 pages: another page size is another file size
            # (a frame takes one page more than its chunk), unreadable by the other.
            return f"nixl_store_dynamic/page={l1_page_bytes(spec)}"
        if spec.l2.nvme.adapter == "fs_native":
            # With direct I/O fs_native writes and reads whole 4 KiB pages (the L1 slot): a file
            # written without it is shorter than such a read, so a switch would strand every file.
            return f"fs_native/direct_io={str(spec.l2.nvme.direct_io).lower()}"
        return spec.l2.nvme.adapter
    return "hfbucket"


CHUNK_TOKENS = 256  # lmcache 0.5.6's server default: the tokens of one stored object (--chunk-size, not rendered)
DEFAULT_L1_PAGE = 4096  # lmcache's --l1-align-bytes default
MAX_L1_PAGE = 2**20
ENCRYPTED_PAGES_PER_LAYER = 16
KV_ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1}


def chunk_layer_bytes(spec: KVCacheNamespaceSpec) -> int | None:
    """One layer of one stored chunk per rank: 256 tokens x K and V x KV heads per rank x head size x
    element bytes. None where the pins do not tell (scaled or packed dtypes, a missing pin)."""
    ident = spec.identity
    element = KV_ELEMENT_BYTES.get(ident.kv_cache_dtype or "")
    if element is None or not (ident.num_kv_heads and ident.head_size and ident.tensor_parallel_size):
        return None
    heads = max(1, ident.num_kv_heads // ident.tensor_parallel_size)  # KV heads are replicated past TP = heads
    return CHUNK_TOKENS * 2 * heads * ident.head_size * element


def l1_page_bytes(spec: KVCacheNamespaceSpec) -> int:
    """The server's L1 page (--l1-align-bytes) for nixl_store_dynamic: the largest power of two up to 1 MiB dividing
    a chunk's layer, so chunks fill whole pages; 4 KiB (lmcache's default) elsewhere or where the pins do not tell.
    Why: nixl moves a file as one Python-built transfer per page, so 4 KiB pages cost a third of an L2 read's time
    (benchmarks/RESULTS.md). At most 1/16 of a layer: a framed object (encrypted or checked) takes one page more than
    its chunk (l2backends.nvme.framed_disk_share follows from it)."""
    nvme = spec.l2.nvme
    layer = chunk_layer_bytes(spec)
    if nvme is None or nvme.adapter != "nixl_store_dynamic" or layer is None:
        return DEFAULT_L1_PAGE
    page = min(MAX_L1_PAGE, layer & -layer)  # its largest power-of-two divisor
    if layer >= ENCRYPTED_PAGES_PER_LAYER:  # every object is framed (encrypted or checked)
        page = min(page, 1 << ((layer // ENCRYPTED_PAGES_PER_LAYER).bit_length() - 1))
    return max(DEFAULT_L1_PAGE, page)
