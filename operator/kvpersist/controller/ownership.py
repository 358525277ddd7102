"""Whose object a derived name holds: the operator's own, or someone else's it must never take over.

Server-side apply with forced conflicts writes over whatever holds a name: a user's `<name>-agent-token`
or `<name>-l2-key` Secret would be trusted as the operator's credential, a user's Service rewritten and
garbage-collected with the resource. So a name not yet seen as the operator's own is looked up before
an apply, and one held by another object stops it (NameTaken); so does an L2 claim under a derived name
(ClaimNotOwned: a pre-made claim would receive this resource's KV, and the StatefulSet's controller
adopts whatever holds its claims' names). A generated key not its own is never used (KeySecretNotOwned).

Its own: a controller ownerReference to this very KVCacheNamespace by uid (a deleted namesake's
differs); the L2 claims and generated key, ownerless on purpose (kvpersist.builders.retained), by their
component and instance labels. Every such mark is writable by whoever may write the object, so nothing
is taken over that its creator could not already write or read. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvpersist.api import v1alpha1 as api
from kvpersist.builders.retained import INSTANCE_LABEL, L2_KEY_COMPONENT, TRACKING_LABEL
from kvpersist.builders.target import L2_VOLUME, MANAGED_BY, SERVER, Target
from kvpersist.controller import l2key
from kvpersist.controller.kube import secret_value

NAME_TAKEN = "NameTaken"  # Ready's reason while an object the operator did not make holds a derived name
CLAIM_NOT_OWNED = "ClaimNotOwned"  # Ready's reason while a claim the servers would mount is not the operator's
RETRY_S = 30.0  # how often a taken name is looked at again (its holder has none of the watched labels)
MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}  # the label every watch of the operator's own objects selects


def owned_by(obj: dict[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    """obj with the controller reference to owner (the one kopf.append_owner_reference adds), once."""
    meta = owner.get("metadata") or {}
    ref = {"controller": True, "blockOwnerDeletion": True, "apiVersion": owner.get("apiVersion"), "kind": owner.get("kind"),
           "name": meta.get("name"), "uid": meta.get("uid")}
    refs = obj.setdefault("metadata", {}).setdefault("ownerReferences", [])
    if not any(r.get("uid") == ref["uid"] for r in refs):
        refs.append({k: v for k, v in ref.items() if v is not None})
    return obj


def controller_uid(meta: Mapping[str, Any] | None) -> str | None:
    """The uid of the KVCacheNamespace that controls an object (its controller ownerReference), or None."""
    for ref in (meta or {}).get("ownerReferences") or []:
        if (ref.get("controller") is True and ref.get("kind") == api.KIND
                and str(ref.get("apiVersion", "")).split("/")[0] == api.GROUP):
            return ref.get("uid")
    return None


def is_own_child(meta: Mapping[str, Any] | None, owner_uid: str | None) -> bool:
    """Whether an existing object is this resource's own child (owner_uid: the resource's uid)."""
    return bool(owner_uid) and controller_uid(meta) == owner_uid


def is_own_key_secret(meta: Mapping[str, Any] | None, name: str) -> bool:
    """Whether a `<name>-l2-key` Secret carries the labels every version gave the key it generates."""
    managed = ((meta or {}).get("labels") or {}).get("app.kubernetes.io/managed-by") == MANAGED_BY
    return managed and _marked(meta, name, L2_KEY_COMPONENT)


def _marked(meta: Mapping[str, Any] | None, name: str, component: str) -> bool:
    """Whether an object's labels name this component and the resource (under either instance label:
    retention moved it to kvpersist.dev/instance), as the claim watch cache keeps them."""
    labels = (meta or {}).get("labels") or {}
    return labels.get("app.kubernetes.io/component") == component and name in (labels.get(INSTANCE_LABEL),
                                                                               labels.get(TRACKING_LABEL))


def taken_message(name: str, namespace: str, taken: Iterable[tuple[str, str]]) -> str:
    """Ready's message (and the Warning event's) while objects it did not make hold derived names."""
    held = sorted(taken)
    listed = ", ".join(f"{kind} {obj}" for kind, obj in held)
    kind, obj = held[0]
    return (f"{listed} already exists in namespace {namespace} and was not made by the operator for KVCacheNamespace "
            f"{name} (no controller ownerReference to it): nothing is applied over it, nor any other object of this "
            f"resource. Delete or rename that object if it is not needed (kubectl delete {kind.lower()} {obj} -n "
            f"{namespace}), or give the KVCacheNamespace another name; the operator looks again every {RETRY_S:.0f} s")


def l2_claim_names(target: Target) -> list[str]:
    """The derived claim names the servers would mount: the shared one, or one per server ordinal (both
    need nvme.size); none with the user's own claim (existingClaimName) or a bucket."""
    nvme = target.spec.l2.nvme
    if nvme is None or nvme.size is None:
        return []
    if nvme.shared:
        return [target.shared_claim] if target.shared_claim else []
    return [f"{L2_VOLUME}-{target.server_name}-{i}" for i in range(target.spec.lmcache_server.replicas)]


def claim_refusal(target: Target, existing: Mapping[str, Mapping[str, Any] | None]) -> tuple[str, str] | None:
    """ClaimNotOwned's (reason, message) when an L2 claim the servers would mount (existing: by
    name, None for absent) is not the operator's, else None."""
    foreign = sorted(n for n, claim in existing.items() if claim is not None
                     and not _marked(claim.get("metadata"), target.name, SERVER))
    if not foreign:
        return None
    ns, first = target.namespace, foreign[0]
    return CLAIM_NOT_OWNED, (
        f"PersistentVolumeClaim {', '.join(foreign)} already exists in namespace {ns} without the labels the operator "
        f"puts on the L2 claims it makes (app.kubernetes.io/component={SERVER}, {INSTANCE_LABEL}={target.name}): the "
        "lmcache servers would mount it and write this resource's KV to it, so nothing of this resource is applied. "
        f"Delete it if it is not needed (kubectl delete pvc {first} -n {ns}), or give the KVCacheNamespace another name; "
        f"if it truly is this resource's own L2 claim (made by the operator for a deleted KVCacheNamespace {target.name}), "
        f"label it: kubectl label pvc {first} -n {ns} app.kubernetes.io/component={SERVER} {INSTANCE_LABEL}={target.name}. "
        f"The operator looks again every {RETRY_S:.0f} s")


def judged_key(target: Target, secret: Mapping[str, Any] | None) -> l2key.KeyRead:
    """The key Secret as fetched (None: absent), judged (l2key.read) for reading.read_key and `kvpersist
    plan`: under the generated name, one the operator did not make is KeySecretNotOwned, its bytes unread."""
    assert target.key_secret is not None
    name, item = target.key_secret
    foreign = target.key_secret_generated and secret is not None and not is_own_key_secret(secret.get("metadata"), target.name)
    not_owned = (f"the generated Secret {name} exists but was not made by the operator (it lacks the labels "
                 f"app.kubernetes.io/managed-by={MANAGED_BY}, app.kubernetes.io/component={L2_KEY_COMPONENT}, "
                 f"{INSTANCE_LABEL}={target.name}): its key is not used, and the cache stays off. Delete or rename that "
                 "Secret (the operator then generates the key), or name it in spec.l2.encryption.keySecretRef if it is "
                 "meant as this resource's key; a key restored from a backup keeps its labels")
    return l2key.read(secret, name, item, target.namespace, target.key_secret_generated,
                      None if foreign else secret_value(secret, item),
                      not_owned if foreign else None)
