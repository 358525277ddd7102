"""The local Service and ZMQ NetworkPolicy of a namespace id the resource no longer serves.

After a pin change they must outlive the old id's pods (old vLLM pods still resolve their
Service, old servers still need their policy) and no longer: once no pod of the resource
carries the old id, they are deleted. Pure decisions here; kvpersist.controller.handlers lists and deletes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvpersist.builders.target import NAMESPACE_ID_LABEL, Target

ROUTE_KINDS = (("v1", "Service"), ("networking.k8s.io/v1", "NetworkPolicy"))


def ids_in_use(pods: Iterable[Mapping[str, Any]]) -> set[str]:
    """Namespace ids some pod of the resource (terminating ones too) still carries."""
    return {i for p in pods if (i := (p["metadata"].get("labels") or {}).get(NAMESPACE_ID_LABEL))}


def stale(target: Target, objs: Iterable[Mapping[str, Any]], in_use: set[str]) -> list[str]:
    """Names among the resource's Services or NetworkPolicies that route to an id that is neither
    the current one nor carried by any pod. Only per-id names (<name>-lmcache-<8 hex>) are ever
    candidates: the resource's other objects keep their names across pin changes."""
    out = []
    for obj in objs:
        meta = obj.get("metadata") or {}
        nsid = (meta.get("labels") or {}).get(NAMESPACE_ID_LABEL)
        if not nsid or nsid == target.namespace_id or nsid in in_use:
            continue
        if meta.get("name") == target.per_id_name(nsid):
            out.append(meta["name"])
    return sorted(out)
