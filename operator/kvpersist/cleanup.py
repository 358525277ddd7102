"""Explicit deletion of one orphaned namespace's data, as an admin asked (`kvpersist gc`).

Never automatic: it runs only for a request on the resource (annotation kvpersist.dev/gc-request,
set by the CLI), and refuses any namespace some resource or server still uses, whatever the
request says. The agents (volumes) refuse their own server's namespace a second time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from kvpersist.agentclient import request_gc
from kvpersist.inventory import NAMESPACE_ID_RE, NamespaceUsage
from kvpersist.usage import human_bytes

GC_ANNOTATION = "kvpersist.dev/gc-request"


def parse_request(annotations: Mapping[str, str] | None) -> dict[str, str] | None:
    """The request on a resource, or None. A malformed one is returned with an error, so the
    status can say what is wrong with it instead of ignoring it."""
    raw = (annotations or {}).get(GC_ANNOTATION)
    if not raw:
        return None
    try:
        data = json.loads(raw)
        return {"requestId": str(data["requestId"])[:64], "namespaceId": str(data["namespaceId"])[:64]}
    except (ValueError, KeyError, TypeError):
        return {"requestId": "malformed", "namespaceId": "", "error": f"annotation {GC_ANNOTATION} is not "
                '{"requestId": ..., "namespaceId": ...}: use `kvpersist gc`'}


def refusal(namespace_id: str, current: str | None, live: frozenset[str]) -> str | None:
    """Why this namespace may not be deleted, or None when it may."""
    if not NAMESPACE_ID_RE.fullmatch(namespace_id):
        return f"{namespace_id!r} is not a namespace id (kvp-<32 hex>)"
    if namespace_id == current:
        return f"{namespace_id} is the namespace this resource serves"
    if namespace_id in live:
        return f"{namespace_id} is still used by another KVCacheNamespace or a running lmcache server"
    return None


def result(request: Mapping[str, str], outcome: str, message: str, held: NamespaceUsage | None = None,
           completed_at: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"requestId": request["requestId"], "namespaceId": request["namespaceId"], "outcome": outcome,
                           "message": message[:4096], "bytes": held.bytes if held else 0, "objects": held.objects if held else 0}
    if completed_at:
        out["completedAt"] = completed_at
    return out


def gc_volumes(request: Mapping[str, str], servers: list[tuple[str, str]], agent_port: int,
               token: str | None = None) -> dict[str, Any]:
    """Ask every server pod's agent (pod, ip) to delete the namespace from its volume (with the
    resource's agent token: an agent refuses /gc without it)."""
    nsid = request["namespaceId"]
    deleted = NamespaceUsage(nsid)
    notes, failures = [], []
    for pod, ip in servers:
        code, body = request_gc(ip, agent_port, nsid, dry_run=False, token=token)
        if code == 200 and body.get("deleted"):
            deleted.bytes += int(body.get("bytes") or 0)
            deleted.objects += int(body.get("objects") or 0)
            notes.append(f"{pod}: {human_bytes(int(body.get('bytes') or 0)) or '0B'} in {body.get('objects', 0)} objects")
        elif code == 404:
            continue
        else:
            failures.append(f"{pod}: {body.get('error', code)}")
    if failures:
        return result(request, "Failed", "; ".join(failures + notes), deleted)
    if not notes:
        where = "volume" if len(servers) == 1 else f"any of {len(servers)} volumes"
        return result(request, "NotFound", f"{nsid} has no data on {where}" if servers else "no lmcache server is running to "
                      "reach the volume: start one (scale the resource up) and ask again")
    return result(request, "Deleted", f"deleted {nsid}: " + "; ".join(notes), deleted)


def gc_bucket(request: Mapping[str, str], remove: Callable[[str], NamespaceUsage], handle: str) -> dict[str, Any]:
    """Delete the namespace's objects under the bucket prefix (remove: namespace id -> what it held)."""
    nsid = request["namespaceId"]
    try:
        held = remove(nsid)
    except Exception as exc:  # the Hub's errors, already scrubbed of the token by inventory_bucket
        return result(request, "Failed", f"{handle}/{nsid}: {exc}")
    if held.objects == 0:
        return result(request, "NotFound", f"{nsid} has no objects under {handle}")
    return result(request, "Deleted", f"deleted {nsid} from {handle}: {human_bytes(held.bytes) or '0B'} in {held.objects} objects",
                  held)
