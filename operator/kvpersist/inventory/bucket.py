"""A Hugging Face bucket as L2, from the operator's side: a preflight, so that L2Ready names the fix
before the lmcache servers find out; each namespace's inventory and cleanup, read from a listing of the
handle's prefix, since lmcache's hfbucket adapter writes each under `<bucketHandle>/<kvp-id>`.

Every Hub call the operator makes (these, the pin check's reads) goes through one client built here on
kvpersist.httptransport: one total deadline per request, however slowly the Hub trickles its answer, and
a cap on its size; a whole scan or removal ends within BUCKET_DEADLINE_S. No message built here holds the token.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import httpx2

from kvpersist import httptransport
from kvpersist.inventory.volume import NAMESPACE_ID_RE, Inventory, NamespaceUsage, group

PREFLIGHT_TIMEOUT_S = 10.0  # each connect, socket read or write
HUB_CALL_DEADLINE_S = 30.0  # one whole request: connect, send, headers, body
HUB_MAX_BODY_BYTES = 32 * 1024 * 1024  # one answer; a listing page of 1000 entries is about 200 KB
BUCKET_DEADLINE_S = 120.0  # the whole scan or removal: no new request starts after it
DELETE_CHUNK = 1000  # paths per batch request (huggingface_hub's own chunk size)
_client_lock = threading.Lock()
_client_bounded = False
T = TypeVar("T")

HubDeadlineExceeded = httptransport.DeadlineExceeded  # a Hub request that did not end within its deadline
# Hub requests this thread makes inside `with hub_deadline(t):` end by t (a time.monotonic()), as if
# each carried DEADLINE_EXTENSION: for calls made through HfApi, which passes no extensions.
hub_deadline = httptransport.ending_by


@dataclass(frozen=True)
class Preflight:
    ok: bool
    reason: str
    message: str


def split_handle(handle: str) -> tuple[str, str]:
    """hf://buckets/<ns>/<bucket>[/<prefix>] -> (<ns>/<bucket>, <prefix>), parsed the way lmcache's
    hfbucket adapter parses it (empty segments dropped), so the paths match its writes."""
    parts = [p for p in handle.removeprefix("hf://buckets/").split("/") if p]
    if not handle.startswith("hf://buckets/") or len(parts) < 2:
        raise ValueError(f"not a bucket handle: {handle!r}")
    return f"{parts[0]}/{parts[1]}", "/".join(parts[2:])


def hub_proxy(endpoint: str | None = None) -> str | None:
    """The proxy for the Hub endpoint (HF_ENDPOINT, else huggingface.co) from HTTPS_PROXY / HTTP_PROXY,
    unless NO_PROXY names its host: httpx ignores these with an explicit transport, as this client has."""
    url = urllib.parse.urlsplit(endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    if not url.hostname or urllib.request.proxy_bypass(url.hostname):
        return None
    return urllib.request.getproxies().get(url.scheme)


def _hub_client() -> httpx2.Client:
    """The operator's Hub client: HUB_CALL_DEADLINE_S and HUB_MAX_BODY_BYTES per request (read on each),
    no keep-alive. Accept-Encoding identity: the body cap then bounds what is decoded, not just sent."""
    transport = httptransport.BoundedTransport("the Hub", lambda: HUB_CALL_DEADLINE_S, lambda: HUB_MAX_BODY_BYTES,
                                               proxy=hub_proxy())
    return httpx2.Client(follow_redirects=True, timeout=httpx2.Timeout(PREFLIGHT_TIMEOUT_S),
                         headers={"Accept-Encoding": "identity"}, transport=transport)


def bound_hub_client() -> None:
    """huggingface_hub's shared HTTP client has no timeout by default; the operator's is _hub_client."""
    global _client_bounded
    with _client_lock:
        if _client_bounded:
            return
        from huggingface_hub import close_session, constants, set_client_factory

        # No telemetry: with it, building a User-Agent makes huggingface_hub fetch
        # {endpoint}/api/agent-harnesses once a day, a call outside any deadline of ours.
        constants.HF_HUB_DISABLE_TELEMETRY = True
        set_client_factory(_hub_client)
        close_session()
        _client_bounded = True


def preflight_bucket(handle: str, token: str, create_if_missing: bool, secret_ref: str,
                     endpoint: str | None = None) -> Preflight:
    """One round of checks: bucket_info, then create_bucket when missing and allowed."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    bound_hub_client()
    bid = split_handle(handle)[0]
    api = HfApi(endpoint=endpoint, token=token)
    action = "read"
    try:
        try:
            api.bucket_info(bid)
            return Preflight(True, "BucketReachable", f"bucket {bid} exists and the token from {secret_ref} can read it")
        except HfHubHTTPError as exc:
            if exc.response is None or exc.response.status_code != 404:
                raise
        if not create_if_missing:
            return Preflight(False, "BucketNotFound", f"bucket {bid} does not exist (or the token from {secret_ref} cannot "
                             "see it): create it, or set spec.l2.hfBucket.createBucketIfMissing: true")
        action = "create"
        api.create_bucket(bid, private=True, exist_ok=True)
        return Preflight(True, "BucketCreated", f"bucket {bid} did not exist and was created (createBucketIfMissing)")
    except HfHubHTTPError as exc:
        code = exc.response.status_code if exc.response is not None else None
        if code == 401:
            return Preflight(False, "TokenRejected", f"the Hub rejected the token from {secret_ref} (401): put a valid token "
                             "with write access to the bucket in that Secret")
        if code == 403:
            return Preflight(False, "TokenForbidden", f"the token from {secret_ref} may not {action} bucket {bid} (403): grant "
                             "it write access to the bucket's namespace")
        return Preflight(False, "HubError", f"the Hub answered {code} when asked to {action} bucket {bid}; retrying")
    except (httpx2.TransportError, OSError) as exc:  # refused, DNS, TLS, timeout, deadline, answer too large
        return Preflight(False, "HubUnreachable",
                         f"cannot reach the Hugging Face Hub to check bucket {bid}: {transport_error_text(exc)}")


def transport_error_text(exc: BaseException) -> str:
    """What a message may say of a failed Hub request: the exception type only, or the transport's own
    refusals, whose text is ours and never holds a URL or the token."""
    return str(exc) if isinstance(exc, httptransport.Refused) else type(exc).__name__


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
    bid, prefix = split_handle(bucket_handle)
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
    bid, prefix = split_handle(bucket_handle)
    deadline = time.monotonic() + BUCKET_DEADLINE_S
    folder = f"{prefix}/{namespace_id}" if prefix else namespace_id
    objects = _guarded(bid, "list", token, lambda: list(_list(bid, folder, token, endpoint, deadline)))
    held = NamespaceUsage(namespace_id).add_all((o.size, o.mtime) for o in objects)
    if dry_run:
        return held
    paths = [o.path for o in objects]
    for start in range(0, len(paths), DELETE_CHUNK):
        chunk = paths[start:start + DELETE_CHUNK]
        why = before_delete() if before_delete is not None else None
        if why:
            raise DeletionRefused(why, NamespaceUsage(namespace_id).add_all((o.size, o.mtime) for o in objects[:start]), len(paths))
        try:
            _guarded(bid, "delete from", token, lambda c=chunk: _delete_chunk(bid, c, token, endpoint, deadline))
        except BucketInventoryError as exc:
            raise BucketInventoryError(exc.reason, f"{exc}; {start} of {len(paths)} objects of {namespace_id} were deleted "
                                       "before this batch: run the removal again") from exc
    return held


def _list(bid: str, prefix: str, token: str, endpoint: str | None, deadline: float) -> Iterator[_Object]:
    """Files strictly below `prefix/`: HfApi.list_bucket_tree's route, params and paging, with the
    listing's deadline on each page (list_bucket_tree can pass none). The Hub matches the prefix as a
    raw string ("p" also lists "p2/..."), so entries outside the folder are dropped here."""
    from huggingface_hub import BucketFile, HfApi
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    bound_hub_client()
    api = HfApi(endpoint=endpoint)
    base = f"{prefix}/" if prefix else ""
    url: str | None = f"{api.endpoint}/api/buckets/{bid}/tree" + (f"/{urllib.parse.quote(prefix, safe='')}" if prefix else "")
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
    bound_hub_client()
    try:
        with hub_deadline(deadline):
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
        msg = f"cannot reach the Hugging Face Hub to {action} bucket {bid}: {_scrub(transport_error_text(exc), token)}"
        reason = "HubTimeout" if isinstance(exc, HubDeadlineExceeded) else "HubUnreachable"
        raise BucketInventoryError(reason, msg) from exc


def _scrub(text: str, token: str) -> str:
    return text.replace(token, "<token>") if token else text
