"""Per-namespace inventory and explicit cleanup of a Hugging Face bucket used as L2: lmcache's
hfbucket adapter writes each namespace under `<bucketHandle>/<kvp-id>`, so a listing of the handle's
prefix says what each holds, and deleting one deletes exactly the objects under `<prefix>/<kvp-id>/`.

Every request goes through hfbucket's bounded client, and the whole scan or removal ends within
BUCKET_DEADLINE_S. The token is sent only to the Hub; no message or exception built here holds it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import quote

from kvpersist import httptransport
from kvpersist.inventory import hfbucket
from kvpersist.inventory.volume import NAMESPACE_ID_RE, Inventory, NamespaceUsage, group

BUCKET_DEADLINE_S = 120.0  # the whole scan or removal: no new request starts after it
DELETE_CHUNK = 1000  # paths per batch request (huggingface_hub's own chunk size)

T = TypeVar("T")


class DeletionRefused(RuntimeError):
    """A removal stopped before a batch because before_delete gave a reason; says what was already deleted."""

    def __init__(self, reason: str, deleted: NamespaceUsage, total_objects: int) -> None:
        super().__init__(reason)
        self.deleted, self.total_objects = deleted, total_objects


class BucketInventoryError(RuntimeError):
    """A listing or deletion the Hub refused or did not answer in time: `reason` (CamelCase) for status
    conditions, and a text naming the bucket and the fix."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class _Object:
    path: str  # full path in the bucket
    rel: str  # path relative to the handle's prefix
    size: int
    mtime: float | None


def scan_bucket(bucket_handle: str, token: str, endpoint: str | None = None) -> Inventory:
    """Every namespace folder under the handle's prefix with its bytes, objects and newest write;
    objects outside any namespace folder count as other_bytes (never deleted by gc)."""
    bid, prefix = hfbucket.split_handle(bucket_handle)
    deadline = time.monotonic() + BUCKET_DEADLINE_S
    # Streamed: folded into per-namespace sums page by page, never held whole (a million objects).
    return _guarded(bid, "list", token, lambda: group(((o.rel, o.size, o.mtime)
                                                       for o in _list(bid, prefix, token, endpoint, deadline)), bucket_handle))


def remove_bucket_namespace(bucket_handle: str, token: str, namespace_id: str, endpoint: str | None = None,
                            dry_run: bool = True, before_delete: Callable[[], str | None] | None = None) -> NamespaceUsage:
    """What one namespace holds in the bucket; unless dry_run, deletes exactly its objects (under
    `<prefix>/<namespace_id>/`). before_delete is asked again right before each batch (the listing alone
    can take a while); a reason from it stops the removal with DeletionRefused."""
    if not NAMESPACE_ID_RE.fullmatch(namespace_id):
        raise ValueError(f"{namespace_id!r} is not a namespace id (kvp-<32 hex>)")
    bid, prefix = hfbucket.split_handle(bucket_handle)
    deadline = time.monotonic() + BUCKET_DEADLINE_S
    folder = f"{prefix}/{namespace_id}" if prefix else namespace_id
    objects = _guarded(bid, "list", token, lambda: list(_list(bid, folder, token, endpoint, deadline)))
    held = _usage(namespace_id, objects)
    if dry_run:
        return held
    paths = [o.path for o in objects]
    for start in range(0, len(paths), DELETE_CHUNK):
        chunk = paths[start:start + DELETE_CHUNK]
        why = before_delete() if before_delete is not None else None
        if why:
            raise DeletionRefused(why, _usage(namespace_id, objects[:start]), len(paths))
        try:
            _guarded(bid, "delete from", token, lambda c=chunk: _delete_chunk(bid, c, token, endpoint, deadline))
        except BucketInventoryError as exc:
            raise BucketInventoryError(exc.reason, f"{exc}; {start} of {len(paths)} objects of {namespace_id} were deleted "
                                       "before this batch: run the removal again") from exc
    return held


def _usage(namespace_id: str, objects: list[_Object]) -> NamespaceUsage:
    held = NamespaceUsage(namespace_id)
    for o in objects:
        held.add(o.size, o.mtime)
    return held


def _list(bid: str, prefix: str, token: str, endpoint: str | None, deadline: float) -> Iterator[_Object]:
    """Files strictly below `prefix/`: HfApi.list_bucket_tree's route, params and paging, with the
    listing's deadline on each page (list_bucket_tree can pass none). The Hub matches the prefix as a
    raw string ("p" also lists "p2/..."), so entries outside the folder are dropped here."""
    from huggingface_hub import BucketFile, HfApi
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    hfbucket.bound_hub_client()
    api = HfApi(endpoint=endpoint)
    base = f"{prefix}/" if prefix else ""
    url: str | None = f"{api.endpoint}/api/buckets/{bid}/tree" + (f"/{quote(prefix, safe='')}" if prefix else "")
    params: dict[str, str] | None = {"recursive": "true"}
    headers = build_hf_headers(token=token)
    while url is not None:
        _check_deadline(bid, deadline)
        resp = get_session().get(url, params=params, headers=headers, extensions={httptransport.DEADLINE: deadline})
        if resp.status_code == 404 and resp.headers.get("X-Error-Code") == "EntryNotFound":
            return  # the bucket exists, nothing under the prefix (lmcache reads it as empty too)
        hf_raise_for_status(resp)
        for item in resp.json():
            if item.get("type") != "file" or not item["path"].startswith(base):
                continue
            f = BucketFile(**item)
            when = f.mtime or f.uploaded_at
            yield _Object(f.path, f.path[len(base):], int(f.size), when.timestamp() if when else None)
        url, params = resp.links.get("next", {}).get("url"), None  # the next link carries the query


def _delete_chunk(bid: str, paths: list[str], token: str, endpoint: str | None, deadline: float) -> None:
    """One /batch request of deleteFile operations (huggingface_hub retries it, each try bounded)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import BucketBatchError

    _check_deadline(bid, deadline)
    hfbucket.bound_hub_client()
    try:
        with hfbucket.hub_deadline(deadline):
            HfApi(endpoint=endpoint, token=token).batch_bucket_files(bid, delete=paths)
    except BucketBatchError as exc:
        failed = getattr(exc, "failures", None) or []
        first = f" (first: {failed[0].get('path')}: {failed[0].get('error')})" if failed else ""
        raise BucketInventoryError("DeleteIncomplete", f"the Hub refused {len(failed)} of {len(paths)} deletions in bucket "
                                   f"{bid}{first}") from exc


def _check_deadline(bid: str, deadline: float) -> None:
    if time.monotonic() > deadline:
        raise BucketInventoryError("HubTimeout", f"bucket {bid}: the Hub did not finish within {BUCKET_DEADLINE_S:g}s")


def _guarded(bid: str, action: str, token: str, fn: Callable[[], T]) -> T:
    """Runs fn, turning the Hub's errors into BucketInventoryError naming the fix; the token is scrubbed
    from the message should a server ever echo it."""
    import httpx2
    from huggingface_hub.errors import BucketNotFoundError, HfHubHTTPError

    try:
        return fn()
    except BucketInventoryError as exc:
        raise BucketInventoryError(exc.reason, _scrub(str(exc), token)) from exc
    except HfHubHTTPError as exc:
        code = exc.response.status_code if exc.response is not None else None
        if code == 404 or isinstance(exc, BucketNotFoundError):
            raise BucketInventoryError("BucketNotFound", f"bucket {bid} does not exist (or the token cannot see it)") from exc
        if code == 401:
            msg = f"the Hub rejected the token (401) when asked to {action} bucket {bid}: put a valid token in the Secret"
            raise BucketInventoryError("TokenRejected", msg) from exc
        if code == 403:
            msg = f"the token may not {action} bucket {bid} (403): grant it write access to the bucket's namespace"
            raise BucketInventoryError("TokenForbidden", msg) from exc
        raise BucketInventoryError("HubError", f"the Hub answered {code} when asked to {action} bucket {bid}") from exc
    except (httpx2.TransportError, OSError) as exc:  # refused, DNS, TLS, timeout, deadline, answer too large
        msg = f"cannot reach the Hugging Face Hub to {action} bucket {bid}: {_scrub(hfbucket.transport_error_text(exc), token)}"
        reason = "HubTimeout" if isinstance(exc, hfbucket.HubDeadlineExceeded) else "HubUnreachable"
        raise BucketInventoryError(reason, msg) from exc


def _scrub(text: str, token: str) -> str:
    return text.replace(token, "<token>") if token else text
