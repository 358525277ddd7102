"""Which pods get the operator's credentials (the agent token, the vLLM API key). Labels are anyone's to
copy, so a pod is trusted only when its controller ownerReference chain ends, by uid, at this very
KVCacheNamespace's own workload (pod -> StatefulSet, or pod -> ReplicaSet -> Deployment); any other is
sent nothing. Forging the chain takes the right to create pods there, which already mounts the token's Secret.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvpersist.controller.ownership import is_own_child

STATEFULSET, DEPLOYMENT, REPLICASET = "StatefulSet", "Deployment", "ReplicaSet"


def controller_of(meta: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """(kind, uid) of an object's controller ownerReference (apps/v1 kinds and the like), or None."""
    for ref in (meta or {}).get("ownerReferences") or []:
        if ref.get("controller") is True and ref.get("uid"):
            return str(ref.get("kind")), str(ref["uid"])
    return None


def _uids(objs: Iterable[Mapping[str, Any]], kind: str, owner_uid: str | None) -> set[str]:
    """The uids of the objects of this kind that the resource (owner_uid) controls."""
    return {str(o["metadata"]["uid"]) for o in objs
            if o.get("kind", kind) == kind and (o.get("metadata") or {}).get("uid")
            and is_own_child(o.get("metadata"), owner_uid)}


def trusted_pods(pods: Iterable[dict[str, Any]], replicasets: Iterable[Mapping[str, Any]],
                 statefulsets: Iterable[Mapping[str, Any]], deployments: Iterable[Mapping[str, Any]],
                 owner_uid: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(trusted, untrusted) pods: trusted when controlled by one of the resource's own StatefulSets, or by a
    ReplicaSet of one of its own Deployments (an old one mid-rollout too). owner_uid None trusts nothing."""
    own_deployments = {(DEPLOYMENT, uid) for uid in _uids(deployments, DEPLOYMENT, owner_uid)}
    controllers = {(STATEFULSET, uid) for uid in _uids(statefulsets, STATEFULSET, owner_uid)} | {
        (REPLICASET, str(r["metadata"]["uid"])) for r in replicasets
        if (r.get("metadata") or {}).get("uid") and controller_of(r.get("metadata")) in own_deployments}
    pods = list(pods)
    return ([p for p in pods if controller_of(p.get("metadata")) in controllers],
            [p for p in pods if controller_of(p.get("metadata")) not in controllers])


def untrusted_message(pod: Mapping[str, Any], resource: str) -> str:
    """The log line for a pod left out: which pod, what controls it, and why nothing is sent to it."""
    meta = pod.get("metadata") or {}
    ref = controller_of(meta)
    held = f"{ref[0]} uid {ref[1]}" if ref else "none (no controller ownerReference)"
    return (f"pod {meta.get('namespace')}/{meta.get('name')} carries the labels of KVCacheNamespace {resource}'s pods, "
            f"but its controller is {held}, not that resource's own StatefulSet or Deployment: it is sent no agent token "
            "or API key and counts for nothing in its status. Remove those labels from it if it is not the operator's")
