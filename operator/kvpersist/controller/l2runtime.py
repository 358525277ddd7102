"""The runtime half of each L2 backend, keyed like kvpersist.l2backends.BACKENDS (the spec half): what a
status refresh observes of its store, and how `kvpersist gc` deletes a namespace from it. Both call the
agents, the Hub or the API server, so they sit in the controller's layer. The hfBucket's Hub calls
(preflight, listing) take minutes for a slow Hub or a huge bucket: they run in the controller's bucket
pool and a refresh reads their last result."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvpersist.builders.target import L2_VOLUME, Target
from kvpersist.controller import agents, kube, retention, runtime
from kvpersist.controller.reading import named_claim, named_secret_refusal, secret_version
from kvpersist.inventory.bucket import BucketInventoryError, preflight_bucket, remove_bucket_namespace, scan_bucket
from kvpersist.inventory.cleanup import Recheck, bucket_refusal, gc_bucket, gc_volumes
from kvpersist.inventory.cleanup import result as gc_result
from kvpersist.inventory.space import claim_space_summary
from kvpersist.inventory.volume import Inventory, one_per_location, status_summary
from kvpersist.l2backends.hfbucket import TOKEN_FIELD
from kvpersist.status.workloads import Seen

PREFLIGHT_TTL_S = 300.0
BUCKET_INVENTORY_TTL_S = 300.0  # a listing is a paged walk of the Hub's tree: at most this often
BUCKET_INVENTORY_RETRY_S = 30.0  # after a failed listing (no token yet, Hub refused or down)
Servers = list[tuple[str, str | None]]  # the running server pods, (name, IP), sorted by name


def observe_claims(body: Mapping[str, Any], target: Target, seen: Seen, running: Servers, token: str | None,
                   _secrets_usable: bool) -> dict[str, Any]:
    """NVMe: the claims from the watch cache, but a claim the user named, which carries none of the
    operator's labels, is read; and the agents' inventory of the volumes."""
    nvme = target.spec.l2.nvme
    assert nvme is not None
    if nvme.existing_claim_name:
        claim = named_claim(nvme.existing_claim_name, target.namespace)
        claims = [claim] if claim else []
    else:
        claims = [c for c in seen.server_claims() if target.shared_claim in (None, c["metadata"]["name"])]
    observed: dict[str, Any] = {"claims": claims, "existing_claim": nvme.existing_claim_name,
                                "budget_bytes": nvme.budget_bytes}
    if not target.cache_enabled:
        return observed
    volumes = []
    for (pod, _ip), inv in zip(running, agents.inventories(running, target.spec.lmcache_server.agent_port, token), strict=True):
        if inv is None:  # a partial inventory would make totals flap: keep the last whole one
            volumes = []
            break
        volumes.append((f"pvc/{target.shared_claim or nvme.existing_claim_name or f'{L2_VOLUME}-{pod}'}", pod, inv))
    volumes = one_per_location(volumes)  # a shared claim's folder counted once, not once per server
    removed = (retention.expire_orphans(body, target, volumes, [a for a in running if a[1]][:1] if target.shared else running,
                                        token, seen)
               if volumes and target.spec.l2.orphan_retention is not None else [])
    if volumes:
        observed["l2_space"] = claim_space_summary(volumes, target.namespace_id, seen.live_ids, time.time(),
                                                   (body.get("status") or {}).get("l2"), removed)
        observed["inventory"] = status_summary(volumes, target.namespace_id, set(seen.live_ids))
    return observed


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


def observe_bucket(body: Mapping[str, Any], target: Target, seen: Seen, running: Servers, token: str | None,
                   secrets_usable: bool) -> dict[str, Any]:
    """hfBucket: the prefix's listing and the preflight, each its off-path job's last answer, the token's
    Secret read at most once for both; neither while the Secrets the spec names are refused."""
    if not target.cache_enabled or not secrets_usable:
        return {}
    secret = SecretOnce(target)
    inv = bucket_inventory_of(target, secret)
    return {"inventory": status_summary([(inv.location, None, inv)], target.namespace_id, set(seen.live_ids)) if inv else None,
            "bucket_check": bucket_check(target, secret)}


def remove_from_volumes(request: Mapping[str, str], target: Target, seen: Seen, recheck: Recheck) -> dict[str, Any]:
    """Through every running server's agent; one folder for all the servers (spec.l2.nvme.shared): one agent."""
    servers = [(pod, ip) for pod, ip in seen.running_servers() if ip]
    servers = servers[:1] if target.shared else servers
    return gc_volumes(request, servers, target.spec.lmcache_server.agent_port, agents.agent_token(target), recheck)


def remove_from_bucket(request: Mapping[str, str], target: Target, seen: Seen, recheck: Recheck) -> dict[str, Any]:
    """From the Hub, only from a bucket exclusive to this cluster, with the token (refused unread without
    secretLabel, when that is set)."""
    bucket = target.spec.l2.hf_bucket
    assert bucket is not None
    why = bucket_refusal(bucket.bucket_handle, bucket.exclusive_to_this_cluster)
    if why:
        return gc_result(request, "Refused", f"refused: {why}; nothing was deleted")
    token_secret = SecretOnce(target)
    token = token_secret.token()
    if token is None:
        return gc_result(request, "Failed", token_secret.problem or f"Secret {bucket.token_secret_ref.name} "
                         f"has no key {bucket.token_secret_ref.key}: the bucket cannot be reached")
    outcome = gc_bucket(request, lambda nsid, before: remove_bucket_namespace(
        bucket.bucket_handle, token, nsid, endpoint=os.environ.get("HF_ENDPOINT"), dry_run=False,
        before_delete=before), bucket.bucket_handle, recheck)
    runtime.CONTROLLER.held((target.namespace, target.name)).bucket_inventory = None
    return outcome


# The Observation fields of the store (status.conditions), from what a refresh holds: its body, target,
# seen, running servers, the agents' token and whether the Secrets the spec names may be read (policy).
OBSERVE = {"nvme": observe_claims, "hfBucket": observe_bucket}
# A gc request's outcome (status.gc), the namespace id already judged unused; the recheck before each deletion.
CLEANUP = {"nvme": remove_from_volumes, "hfBucket": remove_from_bucket}
