"""Who uses a namespace id: the resources whose spec, status or awaited L2 key resolves to it, and
the lmcache pods labelled with it. Read from what the API server stores (the key's fingerprint, not
the key), so the admin CLI, the event loop and a gc's last check before deleting judge it alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.builders.target import NAMESPACE_ID_LABEL, Target
from kvpersist.identity import resolve


def recorded(status: Mapping[str, Any] | None) -> dict[str, Any]:
    """status.l2Key as stored: the key the servers last used, by fingerprint, and its namespace."""
    return dict((status or {}).get("l2Key") or {})


def fingerprint_in_status(status: Mapping[str, Any] | None, secret: str | None) -> str | None:
    """The fingerprint status records for this Secret (None for another Secret, or none recorded):
    what a reader without the key (kubectl users, the event loop) resolves the id with."""
    key = recorded(status)
    return key.get("fingerprint") if secret is not None and key.get("secret") == secret else None


def resolved_id(obj: Mapping[str, Any], fingerprint: Callable[[Target], str | None] | None = None) -> str | None:
    """The id the spec resolves to now, with the L2 key fingerprint status records for the Secret
    the spec names (the key itself is not read here); fingerprint, when given, reads the key of a
    resource whose status records none (the operator's check right before a gc deletes)."""
    try:
        spec = KVCacheNamespaceSpec.model_validate(obj.get("spec") or {})
    except ValueError:
        return None
    meta = obj.get("metadata") or {}
    target = Target(meta.get("name", ""), meta.get("namespace", ""), spec, None)
    key_secret = target.key_secret
    found = fingerprint_in_status(obj.get("status"), key_secret[0] if key_secret else None)
    if key_secret is not None and found is None and fingerprint is not None:
        found = fingerprint(target)
    return resolve(spec.pins(found)).namespace_id


def ref(obj: Mapping[str, Any]) -> str:
    return f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"


def users_of(namespace_id: str, resources: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]],
             fingerprint: Callable[[Target], str | None] | None = None) -> list[str]:
    """Who still uses a namespace: resources (by status, by spec, or waiting for the L2 key whose
    data it holds) and lmcache pods."""
    out = []
    for r in resources:
        status = r.get("status") or {}
        if status.get("namespaceId") == namespace_id:
            out.append(f"KVCacheNamespace {ref(r)}")
        elif (status.get("l2Key") or {}).get("namespaceId") == namespace_id or _awaits_lost_key(status, namespace_id):
            out.append(f"KVCacheNamespace {ref(r)} (waiting for the L2 key its data needs)")
        elif resolved_id(r, fingerprint) == namespace_id:
            out.append(f"KVCacheNamespace {ref(r)}")
    return out + [f"pod {ref(p)}" for p in pods if (p["metadata"].get("labels") or {}).get(NAMESPACE_ID_LABEL) == namespace_id]


KEY_LOST = "L2KeyLost"  # IdentityResolved's reason while the generated key is gone over data (controller.l2key)


def _awaits_lost_key(status: Mapping[str, Any], namespace_id: str) -> bool:
    """Whether the resource waits for its lost key (IdentityResolved L2KeyLost) and sealed namespace_id
    with it (status.sealedNamespaces): a restored key makes it readable again, so gc and the age
    limit leave it."""
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    if (conditions.get("IdentityResolved") or {}).get("reason") != KEY_LOST:
        return False
    lost = recorded(status).get("fingerprint")
    return bool(lost) and any(n.get("namespaceId") == namespace_id and n.get("fingerprint") == lost
                              for n in status.get("sealedNamespaces") or [])
