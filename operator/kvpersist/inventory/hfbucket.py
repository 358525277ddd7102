"""Operator-side preflight of a Hugging Face bucket L2: does the bucket exist (or may we create
it), and does the token work? Checked with huggingface_hub before the lmcache servers find out
the hard way, and reported as L2Ready with a reason that names the fix.

The token is read from the Secret by the caller and passed in; it is never logged, and no
message built here contains it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

PREFLIGHT_TIMEOUT_S = 10.0
_client_lock = threading.Lock()
_client_bounded = False


@dataclass(frozen=True)
class Preflight:
    ok: bool
    reason: str
    message: str


def bucket_id(handle: str) -> str:
    """hf://buckets/<ns>/<bucket>[/<prefix>] -> <ns>/<bucket>."""
    rest = handle.removeprefix("hf://buckets/")
    parts = [p for p in rest.split("/") if p]
    if not handle.startswith("hf://buckets/") or len(parts) < 2:
        raise ValueError(f"not a bucket handle: {handle!r}")
    return f"{parts[0]}/{parts[1]}"


def _bound_hub_client() -> None:
    """huggingface_hub's shared HTTP client has no timeout by default; the operator's must."""
    global _client_bounded
    with _client_lock:
        if _client_bounded:
            return
        import httpx2
        from huggingface_hub import close_session, set_client_factory
        from huggingface_hub.utils._http import default_client_factory

        def factory() -> httpx2.Client:
            client = default_client_factory()
            client.timeout = httpx2.Timeout(PREFLIGHT_TIMEOUT_S)
            return client

        set_client_factory(factory)
        close_session()
        _client_bounded = True


def preflight_bucket(handle: str, token: str, create_if_missing: bool, secret_ref: str,
                     endpoint: str | None = None) -> Preflight:
    """One round of checks: bucket_info, then create_bucket when missing and allowed."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    _bound_hub_client()
    bid = bucket_id(handle)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.bucket_info(bid)
        return Preflight(True, "BucketReachable", f"bucket {bid} exists and the token from {secret_ref} can read it")
    except HfHubHTTPError as exc:
        code = exc.response.status_code if exc.response is not None else None
        if code == 404 and create_if_missing:
            try:
                api.create_bucket(bid, private=True, exist_ok=True)
                return Preflight(True, "BucketCreated", f"bucket {bid} did not exist and was created (createBucketIfMissing)")
            except HfHubHTTPError as create_exc:
                ccode = create_exc.response.status_code if create_exc.response is not None else None
                return _refused(bid, ccode, secret_ref, creating=True)
        if code == 404:
            return Preflight(False, "BucketNotFound", f"bucket {bid} does not exist (or the token from {secret_ref} cannot "
                             "see it): create it, or set spec.l2.hfBucket.createBucketIfMissing: true")
        return _refused(bid, code, secret_ref, creating=False)
    except (httpx2.TransportError, OSError) as exc:  # refused, DNS, TLS, timeout
        return Preflight(False, "HubUnreachable", f"cannot reach the Hugging Face Hub to check bucket {bid}: {type(exc).__name__}")


def _refused(bid: str, code: int | None, secret_ref: str, creating: bool) -> Preflight:
    action = "create" if creating else "read"
    if code == 401:
        return Preflight(False, "TokenRejected", f"the Hub rejected the token from {secret_ref} (401): put a valid token "
                         "with write access to the bucket in that Secret")
    if code == 403:
        return Preflight(False, "TokenForbidden", f"the token from {secret_ref} may not {action} bucket {bid} (403): grant "
                         "it write access to the bucket's namespace")
    return Preflight(False, "HubError", f"the Hub answered {code} when asked to {action} bucket {bid}; retrying")
