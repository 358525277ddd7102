"""The local Service and NetworkPolicy of a namespace id the resource no longer serves, and
route names another id already holds.

After a pin change they outlive the old id's pods (which still resolve that Service and need that
policy), and are deleted once no pod carries the old id. Their names keep 8 hex of the id (a
63-character DNS label), so two ids may share one: the new id's route applied over it would
re-point old vLLM pods to servers of another identity. So it never is (route_conflicts): the new
id goes without its route, vLLM without the cache, until the old one is gone. Pure decisions here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvpersist.builders.target import NAMESPACE_ID_LABEL, Target
from kvpersist.status.workloads import INSTANCE_LABEL

ROUTE_TAKEN = "RouteNameTaken"  # the CacheBypassed reason while route_conflicts finds one

ROUTE_KINDS = (("v1", "Service"), ("networking.k8s.io/v1", "NetworkPolicy"))
ROUTE_LABELS = (NAMESPACE_ID_LABEL, INSTANCE_LABEL)  # what route_conflicts reads of an object under a route name


def ids_in_use(pods: Iterable[Mapping[str, Any]]) -> set[str]:
    """Namespace ids some pod of the resource (terminating ones too) still carries."""
    return {i for p in pods if (i := (p["metadata"].get("labels") or {}).get(NAMESPACE_ID_LABEL))}


def stale(target: Target, objs: Iterable[Mapping[str, Any]], in_use: set[str]) -> list[str]:
    """Per-id names (<name>-lmcache-<8 hex>) among the resource's Services or NetworkPolicies that route
    to an id neither current nor carried by any pod (its other objects keep their names across pins)."""
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
    """`Kind name (its id)` of each (kind, object) under the current id's route name that routes
    elsewhere (another id or resource, or a user's own object); empty when free or this id's own."""
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
