"""The securityContext every pod and container the operator makes gets (docs/security.md)."""

from __future__ import annotations

from typing import Any

# Least privilege (docs/security.md): every container of every pod the operator makes gets these,
# and every pod a RuntimeDefault seccomp profile and no ServiceAccount token (none of them calls
# the API server). Every container is non-root with a read-only root filesystem: what it writes
# goes to its volumes (data_plane_volumes).
SECCOMP_PROFILE = "RuntimeDefault"
# The lmcache server pod's L2 data group: the pod's fsGroup, so the kubelet gives the claim (and
# the agent's token file) to it, and the non-root agent, in that group, may list and delete what
# the server writes there (group-writable: umask 0002).
DATA_GROUP = 2000
AGENT_USER = 65532  # the conventional "nonroot" uid of distroless images
# vLLM and the lmcache server (one image, images/vllm-lmcache: its USER) run as this uid, both: vLLM's
# connector registers its KV in shared memory segments of mode 0600 of its own uid, which a server
# of another uid cannot open (measured with lmcache 0.5.6: REGISTER_KV_CACHE, EACCES). An attached
# pod (KServe sets runAsNonRoot and no uid) runs as the image's USER, so as this one too.
DATA_PLANE_USER = 10001
# Their HOME (vLLM's, torch's and Triton's caches) and /tmp:
# emptyDirs, the only places besides the claims they write.
DATA_PLANE_HOME = "/home/kvpersist"
HOME_VOLUME = "home"
TMP_VOLUME = "tmp"
TMP_PATH = "/tmp"


def container_security_context() -> dict[str, Any]:
    """No privilege escalation (setuid binaries, no_new_privs), no Linux capabilities at all, and
    a read-only root filesystem."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def data_plane_security_context(group: int = DATA_PLANE_USER) -> dict[str, Any]:
    """vLLM's and the lmcache server's: non-root as DATA_PLANE_USER (set here too, so an image of an
    older build, whose user was root, runs as it), read-only root."""
    return {**container_security_context(), "runAsUser": DATA_PLANE_USER, "runAsGroup": group, "runAsNonRoot": True}


def data_plane_volumes(tmp_size_limit: str | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): HOME and /tmp as emptyDirs, what a data-plane container writes besides its
    claims under a read-only root (vLLM's, torch's and Triton's caches)."""
    tmp: dict[str, Any] = {"sizeLimit": tmp_size_limit} if tmp_size_limit else {}
    return ([{"name": HOME_VOLUME, "emptyDir": {}}, {"name": TMP_VOLUME, "emptyDir": tmp}],
            [{"name": HOME_VOLUME, "mountPath": DATA_PLANE_HOME}, {"name": TMP_VOLUME, "mountPath": TMP_PATH}])


HOME_ENV = {"name": "HOME", "value": DATA_PLANE_HOME}


def pod_security(pod_spec: dict[str, Any], fs_group: int | None = None) -> dict[str, Any]:
    """The pod-level controls, added to a pod spec: seccomp, no ServiceAccount token, and with
    fs_group the volumes' group. OnRootMismatch: the recursive change of group over a large L2
    volume happens once (its root already in the group), not at every start."""
    context: dict[str, Any] = {"seccompProfile": {"type": SECCOMP_PROFILE}}
    if fs_group is not None:
        context.update(fsGroup=fs_group, fsGroupChangePolicy="OnRootMismatch")
    pod_spec["securityContext"] = context
    pod_spec["automountServiceAccountToken"] = False
    return pod_spec
