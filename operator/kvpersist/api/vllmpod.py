"""What every vLLM pod of a namespace id gets besides its container's args and env, the operator's own
(kvpersist.builders.vllm) and attached ones (kvpersist.api.attachpolicy adds it as CEL): /dev/shm in memory,
and a required place on the node of one of its lmcache servers. Written once, so both follow a change."""

from __future__ import annotations

from typing import Any

SHM_PATH = "/dev/shm"
POD_AFFINITY = "podAffinity"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def shm_volume(name: str) -> dict[str, Any]:
    return {"name": name, "emptyDir": {"medium": "Memory"}}


def shm_mount(name: str) -> dict[str, Any]:
    return {"name": name, "mountPath": SHM_PATH}


def server_term(selector: Any) -> dict[str, Any]:
    """The affinity term to the node of a pod these labels select (selector: the server's labels, or the CEL reading them)."""
    return {"labelSelector": {"matchLabels": selector}, "topologyKey": "kubernetes.io/hostname"}


def beside_servers(term: Any) -> dict[str, Any]:
    """A pod's affinity that requires the term."""
    return {POD_AFFINITY: {REQUIRED: [term]}}
