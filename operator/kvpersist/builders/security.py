"""The securityContext every pod and container the operator makes gets (docs/security.md)."""

from __future__ import annotations

from typing import Any

# Least privilege (docs/security.md): every pod gets RuntimeDefault seccomp and no ServiceAccount
# token (none calls the API server); every container runs non-root with a read-only root.
SECCOMP_PROFILE = "RuntimeDefault"
# The server pod's fsGroup: the kubelet gives the claim and the token file to it, so the non-root
# agent in it may list and delete what the server writes (group-writable: umask 0002).
DATA_GROUP = 2000
AGENT_USER = 65532  # the conventional "nonroot" uid of distroless images
# vLLM and the server (one image: its USER) both run as this uid: vLLM registers its KV in 0600
# shared memory a server of another uid cannot open (measured: REGISTER_KV_CACHE, EACCES). An attached
# pod (KServe: runAsNonRoot, no uid) runs as the image's USER, so as this one too.
DATA_PLANE_USER = 10001
# Their HOME and /tmp (vLLM's, torch's and Triton's caches): emptyDirs, the only places besides claims they write.
DATA_PLANE_HOME = "/home/kvpersist"
HOME_VOLUME = "home"
TMP_VOLUME = "tmp"
TMP_PATH = "/tmp"


def security_context(user: int, group: int) -> dict[str, Any]:
    """Every container's: runAsUser set too, for older images whose user was root."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
            "runAsUser": user, "runAsGroup": group, "runAsNonRoot": True}


def data_plane_volumes(tmp_size_limit: str | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): HOME and /tmp as emptyDirs, writable under a read-only root."""
    tmp: dict[str, Any] = {"sizeLimit": tmp_size_limit} if tmp_size_limit else {}
    return ([{"name": HOME_VOLUME, "emptyDir": {}}, {"name": TMP_VOLUME, "emptyDir": tmp}],
            [{"name": HOME_VOLUME, "mountPath": DATA_PLANE_HOME}, {"name": TMP_VOLUME, "mountPath": TMP_PATH}])


HOME_ENV = {"name": "HOME", "value": DATA_PLANE_HOME}


def pod_security(pod_spec: dict[str, Any], fs_group: int | None = None) -> dict[str, Any]:
    """The pod-level controls: seccomp, no ServiceAccount token, and with fs_group the volumes' group.
    OnRootMismatch: the recursive chgrp of a large L2 volume happens once, not at every start."""
    context: dict[str, Any] = {"seccompProfile": {"type": SECCOMP_PROFILE}}
    if fs_group is not None:
        context.update(fsGroup=fs_group, fsGroupChangePolicy="OnRootMismatch")
    pod_spec["securityContext"] = context
    pod_spec["automountServiceAccountToken"] = False
    return pod_spec
