"""Operator-side preflight of a Hugging Face bucket L2 (does the bucket exist, or may we create it,
and does the token work?), so that L2Ready names the fix before the lmcache servers find out.

Every Hub call the operator makes (this preflight, inventory.bucket, the pin check's reads) goes
through one client built here on kvpersist.httptransport: one total deadline per request, however
slowly the Hub trickles its answer, and a cap on its size. No message built here holds the token.
"""

from __future__ import annotations

import os
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass

import httpx2

from kvpersist import httptransport

PREFLIGHT_TIMEOUT_S = 10.0  # each connect, socket read or write
HUB_CALL_DEADLINE_S = 30.0  # one whole request: connect, send, headers, body
HUB_MAX_BODY_BYTES = 32 * 1024 * 1024  # one answer; a listing page of 1000 entries is about 200 KB
_client_lock = threading.Lock()
_client_bounded = False

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
        return _refused(bid, exc.response, secret_ref, action)
    except (httpx2.TransportError, OSError) as exc:  # refused, DNS, TLS, timeout, deadline, answer too large
        return Preflight(False, "HubUnreachable",
                         f"cannot reach the Hugging Face Hub to check bucket {bid}: {transport_error_text(exc)}")


def transport_error_text(exc: BaseException) -> str:
    """What a message may say of a failed Hub request: the exception type only, or the transport's own
    refusals, whose text is ours and never holds a URL or the token."""
    return str(exc) if isinstance(exc, httptransport.Refused) else type(exc).__name__


def _refused(bid: str, response: httpx2.Response | None, secret_ref: str, action: str) -> Preflight:
    code = response.status_code if response is not None else None
    if code == 401:
        return Preflight(False, "TokenRejected", f"the Hub rejected the token from {secret_ref} (401): put a valid token "
                         "with write access to the bucket in that Secret")
    if code == 403:
        return Preflight(False, "TokenForbidden", f"the token from {secret_ref} may not {action} bucket {bid} (403): grant "
                         "it write access to the bucket's namespace")
    return Preflight(False, "HubError", f"the Hub answered {code} when asked to {action} bucket {bid}; retrying")
