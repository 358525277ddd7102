"""The securityContext every pod and container the operator makes gets (docs/security.md)."""

from __future__ import annotations

from typing import Any

# Least privilege (docs/security.md): every container of every pod the operator makes gets these,
# and every pod a RuntimeDefault seccomp profile and no ServiceAccount token (none of them calls
# the API server). The images run as root; neither lmcache nor vLLM is known to work as another
# user, so only the operator's own pod is non-root.
SECCOMP_PROFILE = "RuntimeDefault"


def container_security_context(read_only_root: bool = True) -> dict[str, Any]:
    """No privilege escalation (setuid binaries, no_new_privs), no Linux capabilities at all, and
    a read-only root filesystem unless the program must write under it."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": read_only_root,
            "capabilities": {"drop": ["ALL"]}}


def pod_security(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """The pod-level controls, added to a pod spec: seccomp, and no ServiceAccount token."""
    pod_spec["securityContext"] = {"seccompProfile": {"type": SECCOMP_PROFILE}}
    pod_spec["automountServiceAccountToken"] = False
    return pod_spec
