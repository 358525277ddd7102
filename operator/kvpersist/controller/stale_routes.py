"""The local Service and ZMQ NetworkPolicy of a namespace id the resource no longer serves, and
route names another id already holds.

After a pin change they must outlive the old id's pods (old vLLM pods still resolve their
Service, old servers still need their policy) and no longer: once no pod of the resource
carries the old id, they are deleted. Their names keep 8 hex of the id (a Service name is a
63-character DNS label, a resource name up to 40), so two ids of one resource may share a name:
applying the new id's route over the old one would re-point old vLLM pods to servers of another
identity. So an existing route of another id under the name is never applied over
(route_conflicts): the new id goes without its route, and vLLM without the cache, until the old
one is gone. Pure decisions here; kvpersist.controller.apply lists, deletes and applies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvpersist.builders.target import NAMESPACE_ID_LABEL, Target
from kvpersist.status.workloads import INSTANCE_LABEL

ROUTE_TAKEN = "RouteNameTaken"  # the CacheBypassed reason while route_conflicts finds one

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


def route_conflicts(target: Target, objs: Iterable[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """(kind, object) pairs found under the current id's route name that route elsewhere: another
    namespace id, another resource, or nothing the operator labelled (a user's own object). Each as
    `Kind name (its id)`; empty when the names are free or already this id's own."""
    if not target.namespace_id:
        return []
    name = target.per_id_name(target.namespace_id)
    out = []
    for kind, obj in objs:
        meta = obj.get("metadata") or {}
        if meta.get("name") != name:
            continue
        labels = meta.get("labels") or {}
        if labels.get(NAMESPACE_ID_LABEL) == target.namespace_id and labels.get(INSTANCE_LABEL) == target.name:
            continue
        whose = "" if labels.get(INSTANCE_LABEL) == target.name else ", not this resource's"
        out.append(f"{kind} {name} (namespace id {labels.get(NAMESPACE_ID_LABEL) or 'none'}{whose})")
    return sorted(out)


def route_taken_message(target: Target, conflicts: list[str]) -> str:
    """CacheBypassed's message while the id's route names are held."""
    return (f"namespace id {target.namespace_id} shares its route name {target.per_id_name(target.namespace_id)} "
            f"(8 hex of the id) with {', '.join(conflicts)}: it is not applied over (that would re-point that id's "
            "vLLM pods to servers of another identity), so vLLM runs without the cache until that object is gone "
            "(the operator deletes its own once no pod of that id is left; delete any other by hand)")
