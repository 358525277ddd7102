"""Explicit deletion of one orphaned namespace's data, as an admin asked (`kvpersist gc`).

Never automatic: it runs only for a request on the resource (annotation kvpersist.dev/gc-request,
set by the CLI; config/gc's ValidatingAdmissionPolicy limits who may set it), and refuses any
namespace still in use, judged from the watch caches and again from a fresh listing right before
each deletion (recheck). A bucket namespace is deleted only from a bucket exclusive to this
cluster; the agents refuse their own server's namespace a second time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from kvpersist.inventory.agentclient import request_gc
from kvpersist.inventory.bucket import DeletionRefused
from kvpersist.inventory.volume import NAMESPACE_ID_RE, NamespaceUsage, human_bytes

GC_ANNOTATION = "kvpersist.dev/gc-request"
# Asked right before each deletion: why the namespace may not be deleted now, or None.
Recheck = Callable[[], str | None]


def parse_request(annotations: Mapping[str, str] | None) -> dict[str, str] | None:
    """The request on a resource, or None; a malformed one comes with an error for the status to show."""
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


def bucket_refusal(bucket_handle: str, exclusive: bool) -> str | None:
    """Why no namespace may be deleted from this bucket: one shared with other clusters may look orphaned
    here while in use there."""
    if exclusive:
        return None
    return (f"spec.l2.hfBucket.exclusiveToThisCluster is not true: {bucket_handle} may be shared with another cluster, "
            "whose resources and servers this cluster cannot see, so a namespace orphaned here may be in use there; "
            "set it to true only if no other cluster reads or writes that bucket prefix, then ask again")


def result(request: Mapping[str, str], outcome: str, message: str, held: NamespaceUsage | None = None,
           completed_at: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"requestId": request["requestId"], "namespaceId": request["namespaceId"], "outcome": outcome,
                           "message": message[:4096], "bytes": held.bytes if held else 0, "objects": held.objects if held else 0}
    return {**out, "completedAt": completed_at} if completed_at else out


def gc_volumes(request: Mapping[str, str], servers: list[tuple[str, str]], agent_port: int,
               token: str | None = None, recheck: Recheck | None = None) -> dict[str, Any]:
    """Ask every server pod's agent (pod, ip) to delete the namespace from its volume, with the agent token.
    recheck runs right before each agent's /gc; a reason from it stops there."""
    nsid = request["namespaceId"]
    deleted = NamespaceUsage(nsid)
    notes: list[str] = []
    failures: list[str] = []
    for pod, ip in servers:
        why = recheck() if recheck is not None else None
        if why:
            so_far = f"; already deleted: {'; '.join(notes)}" if notes else ""
            return result(request, "Refused", f"refused before asking {pod}: {why}; nothing more was deleted{so_far}", deleted)
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


def gc_bucket(request: Mapping[str, str], remove: Callable[..., NamespaceUsage], handle: str,
              recheck: Recheck | None = None) -> dict[str, Any]:
    """Delete the namespace's objects under the bucket prefix with remove(namespace id[, recheck]), which
    returns what it held (and asks recheck right before each batch)."""
    nsid = request["namespaceId"]
    try:
        held = remove(nsid) if recheck is None else remove(nsid, recheck)
    except DeletionRefused as exc:
        done = exc.deleted
        so_far = f"; {done.objects} of {exc.total_objects} objects ({human_bytes(done.bytes) or '0B'}) were deleted before" \
            if done.objects else ""
        return result(request, "Refused", f"refused: {exc}; nothing more was deleted from {handle}{so_far}", done)
    except Exception as exc:  # the Hub's errors, already scrubbed of the token by kvpersist.inventory.bucket
        return result(request, "Failed", f"{handle}/{nsid}: {exc}")
    if held.objects == 0:
        return result(request, "NotFound", f"{nsid} has no objects under {handle}")
    return result(request, "Deleted", f"deleted {nsid} from {handle}: {human_bytes(held.bytes) or '0B'} in {held.objects} objects",
                  held)
