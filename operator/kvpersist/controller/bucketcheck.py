"""The hfBucket's Hub calls of a status refresh (preflight, listing): minutes for a slow Hub or a huge
bucket, so they run in the controller's bucket pool and the refresh reads their last result."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from kvpersist.builders.target import Target
from kvpersist.controller import kube, runtime
from kvpersist.controller.reading import named_secret_refusal, secret_version
from kvpersist.inventory.bucket import BucketInventoryError, preflight_bucket, scan_bucket
from kvpersist.inventory.volume import Inventory
from kvpersist.l2backends.hfbucket import TOKEN_FIELD

PREFLIGHT_TTL_S = 300.0
BUCKET_INVENTORY_TTL_S = 300.0  # a listing is a paged walk of the Hub's tree: at most this often
BUCKET_INVENTORY_RETRY_S = 30.0  # after a failed listing (no token yet, Hub refused or down)


class SecretOnce:
    """The bucket token's Secret, read at most once per refresh and only if someone asks."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.ref = target.spec.l2.hf_bucket.token_secret_ref  # type: ignore[union-attr]
        self._read = False
        self._secret: dict[str, Any] | None = None
        self.problem: str | None = None  # why the Secret is not used (secretLabel), when it is not

    def get(self) -> dict[str, Any] | None:
        if not self._read:
            self._read = True
            refused = named_secret_refusal(TOKEN_FIELD, self.ref.name, self.target.namespace)
            if refused is not None:  # not read at all: neither the preflight nor a listing nor gc uses it
                self.problem = refused[1]
            else:
                self._secret = _token_secret(self.target, self.ref.name, self.ref.key)
        return self._secret

    def token(self) -> str | None:
        raw = kube.secret_value(self.get(), self.ref.key)
        return raw.decode().strip() if raw else None


def _token_secret(target: Target, name: str, item: str) -> dict[str, Any] | None:
    """The token's Secret (metadata and that key), read again only when the watch cache shows it changed (a
    failing Hub's checks cost ~600 reads a minute at 500 resources); without the cache (a glob), each time."""
    state = runtime.CONTROLLER.held((target.namespace, target.name))
    synced, version = secret_version(target.namespace, name)
    if synced and version is None:
        state.token_secret = None
        return None  # the watch shows no such Secret
    held = state.token_secret
    if synced and held is not None and held[0] == (name, item, version):
        return held[1]
    secret = kube.get("v1", "Secret", name, target.namespace)
    kept = None if secret is None else {"metadata": dict(secret.get("metadata") or {}),
                                        "data": {k: v for k, v in (secret.get("data") or {}).items() if k == item}}
    state.token_secret = ((name, item, (kept or {}).get("metadata", {}).get("resourceVersion")), kept) if synced else None
    return kept


def _off_path(key: tuple[str, str], what: str, job: Callable[[], None]) -> bool:
    """Starts job in the bucket pool unless this resource's job of that kind runs; True if started. The
    resource is marked for a refresh when it ends."""
    state = runtime.CONTROLLER.held(key)

    def run() -> None:
        try:
            job()
        except Exception:  # a failed job must not go unnoticed, nor kill the pool's thread
            logging.getLogger("kvpersist").exception("bucket %s of %s/%s failed", what, key[0], key[1])
        finally:
            state.dirty = True

    with runtime.CONTROLLER.bucket_jobs_lock:
        running = state.bucket_jobs.get(what)
        if running is not None and not running.done():
            return False
        state.bucket_jobs[what] = runtime.CONTROLLER.bucket_pool.submit(run)
        return True


def bucket_check(target: Target, secrets: SecretOnce) -> tuple[bool, str, str] | None:
    """The hfBucket preflight, at most once per PREFLIGHT_TTL_S per resource and settings, off the refresh path;
    None until the first answer. A failure re-reads the Secret each refresh: a fix shows within one interval."""
    bucket = target.spec.l2.hf_bucket
    assert bucket is not None
    ref = f"Secret {bucket.token_secret_ref.name} key {bucket.token_secret_ref.key}"
    settings = (bucket.bucket_handle, bucket.create_bucket_if_missing, bucket.token_secret_ref.name, bucket.token_secret_ref.key)
    state = runtime.CONTROLLER.held((target.namespace, target.name))
    cached = state.preflight
    now = time.monotonic()
    if cached and cached[0][:len(settings)] == settings and cached[2][0] and now - cached[1] < PREFLIGHT_TTL_S:
        return cached[2]
    secret = secrets.get()
    if secret is None:
        return (False, "SecretNotFound", f"{ref} not found in namespace {target.namespace}: create it, e.g. kubectl create "
                f"secret generic {bucket.token_secret_ref.name} --from-literal={bucket.token_secret_ref.key}=hf_...")
    token = secrets.token()
    if not token:
        return (False, "SecretKeyMissing", f"{ref}: the Secret has no such key; set spec.l2.hfBucket.tokenSecretRef.key")
    key = (*settings, secret["metadata"].get("resourceVersion"))
    if cached and cached[0] == key and now - cached[1] < PREFLIGHT_TTL_S:
        return cached[2]

    def check() -> None:
        result = preflight_bucket(bucket.bucket_handle, token, bucket.create_bucket_if_missing,
                                  ref, endpoint=os.environ.get("HF_ENDPOINT"))
        state.preflight = (key, time.monotonic(), (result.ok, result.reason, result.message))

    _off_path((target.namespace, target.name), "preflight", check)
    return cached[2] if cached and cached[0][:len(settings)] == settings else None  # the last verdict meanwhile


def bucket_inventory_of(target: Target, secrets: SecretOnce) -> Inventory | None:
    """The bucket prefix's listing, off the refresh path at most once per BUCKET_INVENTORY_TTL_S (RETRY_S after
    a failure); the last good one meanwhile."""
    bucket = target.spec.l2.hf_bucket
    assert bucket is not None
    key = (target.namespace, target.name)
    state = runtime.CONTROLLER.held(key)
    when, last = state.bucket_inventory or (float("-inf"), None)
    if last is not None and last.location != bucket.bucket_handle:
        when, last = float("-inf"), None
    now = time.monotonic()
    if now - when < (BUCKET_INVENTORY_RETRY_S if state.bucket_inventory_failed else BUCKET_INVENTORY_TTL_S):
        return last
    token = secrets.token()

    def listing() -> None:
        try:
            if token is None:
                raise BucketInventoryError("SecretNotFound", "no token")
            listed = scan_bucket(bucket.bucket_handle, token, endpoint=os.environ.get("HF_ENDPOINT"))
            state.bucket_inventory_failed = False
        except BucketInventoryError:
            listed = last
            state.bucket_inventory_failed = True
        state.bucket_inventory = (time.monotonic(), listed)

    _off_path(key, "listing", listing)
    return last

