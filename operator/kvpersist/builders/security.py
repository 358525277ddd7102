"""The securityContext every pod and container the operator makes gets (docs/security.md)."""

from __future__ import annotations

from typing import Any

# Least privilege (docs/security.md): every container of every pod the operator makes gets these,
# and every pod a RuntimeDefault seccomp profile and no ServiceAccount token (none of them calls
# the API server). lmcache and vLLM run as their images' user (root, without capabilities); the
# inventory agent and the operator are non-root.
SECCOMP_PROFILE = "RuntimeDefault"
# The lmcache server pod's L2 data group: the pod's fsGroup, so the kubelet gives the claim (and
# the agent's token file) to it, and the non-root agent, in that group, may list and delete what
# the root server writes there (the server writes group-writable: umask 0002).
DATA_GROUP = 2000
AGENT_USER = 65532  # the conventional "nonroot" uid of distroless images


def container_security_context(read_only_root: bool = True) -> dict[str, Any]:
    """No privilege escalation (setuid binaries, no_new_privs), no Linux capabilities at all, and
    a read-only root filesystem unless the program must write under it."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": read_only_root,
            "capabilities": {"drop": ["ALL"]}}


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
