"""kopf handlers: apply what a KVCacheNamespace becomes, and keep its status true.

Thin on purpose: parsing lives in kvpersist.api, hashing in kvpersist.identity, manifests in
kvpersist.builders, status judgement in kvpersist.status.conditions. Handlers order those and talk to
the API server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kvpersist.api import v1alpha1 as api
from kvpersist.api.status import checked_patch
from kvpersist.builders.all import build_all
from kvpersist.builders.keysecret import build_agent_token_secret, build_key_secret
from kvpersist.builders.retained import protect_patch
from kvpersist.builders.target import AGENT_TOKEN_KEY, L2_KEY_BYTES, L2_VOLUME, NAMESPACE_ID_LABEL, SERVER, Target
from kvpersist.controller import fallback, kube, l2key, leadership, metrics, retry, sharing
from kvpersist.controller.policy import REASONS as REFUSAL_REASONS
from kvpersist.controller.policy import (
    SECRET_NOT_ALLOWED,
    Policy,
    Refusal,
    image_refusal,
    named_secrets,
    refused_status,
    secret_refusal,
)
from kvpersist.controller.stale_routes import ROUTE_KINDS, ROUTE_TAKEN, ids_in_use, route_conflicts, route_taken_message, stale
from kvpersist.controller.state import Controller
from kvpersist.httpclient import in_parallel
from kvpersist.identity import Resolution, key_fingerprint, resolve
from kvpersist.inventory.agentclient import fetch_inventory
from kvpersist.inventory.bucket import BucketInventoryError, remove_bucket_namespace, scan_bucket
from kvpersist.inventory.cleanup import GC_ANNOTATION, bucket_refusal, gc_bucket, gc_volumes, parse_request, refusal, refusal_now
from kvpersist.inventory.cleanup import result as gc_result
from kvpersist.inventory.hfbucket import preflight_bucket
from kvpersist.inventory.volume import Inventory, iso, status_summary
from kvpersist.status import build as buildstatus
from kvpersist.status.conditions import (
    Observation,
    compute_status,
    condition,
    failed_create,
    failed_status,
    pods_missing,
    status_patch,
)
from kvpersist.status.conditions import now as condition_now
from kvpersist.status.usage import collect_usage
from kvpersist.status.workloads import COMPONENT_LABEL, INSTANCE_LABEL, WATCH_SELECTOR, WATCHED, Seen, index_entry, live_ids, owner_key

PREFIX = "kvpersist.dev"
STATUS_INTERVAL_S = 10.0

PREFLIGHT_TTL_S = 300.0
TICK_S = 1.0
# A bucket listing is a paged walk of the Hub's tree: at most once per this many seconds.
BUCKET_INVENTORY_TTL_S = 300.0
BUCKET_INVENTORY_RETRY_S = 30.0  # after a failed listing (no token yet, Hub refused or down)
# Everything the operator remembers, per resource and across them (kvpersist.controller.state).
CONTROLLER = Controller()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's bookkeeping in our own annotations and out of status, which our schema owns."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    for group, version, plural in WATCHED:
        settings.watching.label_selectors[group, version, plural] = WATCH_SELECTOR
    # Peering (several replicas): a priority of our own and a short lifetime (kvpersist.controller.leadership).
    settings.peering.priority = CONTROLLER.peering["priority"]
    settings.peering.lifetime = leadership.PEERING_LIFETIME_S
    # Namespaces named (the chart's watchNamespaces): kopf would list the cluster's namespaces to
    # match them, which the chart does not grant, and hold every watch back through 9 refused tries
    # (about a minute, measured in tests/e2e/test_helm_ha.py) before assuming they exist. Exact names
    # need no scan; CRDs are then read once at start (the chart installs them before the operator).
    named = CONTROLLER.peering["namespaces"]
    if named and not any(c in ns for ns in named for c in "*?[!"):
        settings.scanning.disabled = True
    kube.load_config()


PEERING_CHECK_S = 2.0


def set_peering(name: str | None, identity: str, priority: int, namespaces: tuple[str, ...] = ()) -> None:
    CONTROLLER.peering.update(name=name, identity=identity, priority=priority, namespaces=tuple(namespaces))
    CONTROLLER.active_seen.clear()


def active(now: float, namespace: str | None) -> bool:
    """Whether this replica may write status for a resource in namespace: always when standalone;
    with peering, when the peering object kopf uses there says so (read at most every
    PEERING_CHECK_S per object). Blocking."""
    peering, seen_by_scope = CONTROLLER.peering, CONTROLLER.active_seen
    if not peering["name"]:
        return True
    scope = namespace if peering["namespaces"] else None
    seen = seen_by_scope.get(scope)
    if seen is not None and now - seen[0] < PEERING_CHECK_S:
        return seen[1]
    try:
        if scope is None:
            record = kube.get_cluster("kopf.dev/v1", "ClusterKopfPeering", peering["name"])
        else:
            record = kube.get("kopf.dev/v1", "KopfPeering", peering["name"], scope)
    except ApiException:
        record = None
    verdict = leadership.is_active(record, peering["identity"], peering["priority"])
    if seen is None or verdict != seen[1]:
        logging.getLogger("kvpersist").info("this replica is %s%s", "active" if verdict else "standing by (a peer is active)",
                                            f" in {scope}" if scope else "")
    seen_by_scope[scope] = (now, verdict)
    return verdict


def _active_keys(keys: list[tuple[str, str]], now: float) -> list[tuple[str, str]]:
    """The keys this replica may refresh. Each peering scope is checked every tick, keys or not,
    so a standby knows (and says) it is one even before it has seen any resource."""
    for scope in CONTROLLER.peering["namespaces"] or (None,):
        active(now, scope)
    return [k for k in keys if active(now, k[0])]


def _target(body: Mapping[str, Any], fingerprint: str | None = None) -> tuple[Target, Resolution]:
    """The builders' view of the object and the reason its identity is incomplete (if it is).
    fingerprint: of the L2 key its servers mount (kvpersist.controller.l2key); without it an
    encrypted resource has no namespace id, so a Target for names and policy only. Raises
    ValidationError for a spec the operator cannot read."""
    meta = body["metadata"]
    obj = api.KVCacheNamespace.model_validate({"spec": body.get("spec"), "metadata": {"name": meta["name"]}})
    res = resolve(obj.spec.pins(fingerprint))
    return Target(meta["name"], meta["namespace"], obj.spec, res.namespace_id), res


KEY_READ_TTL_S = STATUS_INTERVAL_S  # the key Secret is read at most this often per resource (a rotation shows within it)


def _read_key(target: Target, fresh: bool = False) -> l2key.KeyRead | None:
    """The key Secret the servers mount, judged (kvpersist.controller.l2key), or None when L2 is not
    encrypted; read at most every KEY_READ_TTL_S unless fresh. A failed read keeps the last
    fingerprint read from the same Secret (the Secret is there, the API server did not answer):
    a blip must not turn the cache off. The key's bytes are hashed here and kept nowhere. Blocking."""
    if target.key_secret is None:
        return None
    name, item = target.key_secret
    state = CONTROLLER.held((target.namespace, target.name))
    now = time.monotonic()
    cached = state.key_read
    if (not fresh and cached is not None and now - cached[0] < KEY_READ_TTL_S and (cached[1].secret, cached[1].item)
            == (name, item)):
        return cached[1]
    try:
        secret = kube.get("v1", "Secret", name, target.namespace)
    except ApiException as exc:
        if cached is not None and cached[1].fingerprint and (cached[1].secret, cached[1].item) == (name, item):
            return cached[1]
        return l2key.unreadable(name, item, target.key_secret_generated, exc.status)
    key = l2key.read(secret, name, item, target.namespace, target.key_secret_generated, kube.secret_value(secret, item))
    state.key_read = (now, key)
    return key


def _known_fingerprint(body: Mapping[str, Any]) -> str | None:
    """The key fingerprint without reading the Secret (in the event loop, for gc): the last read,
    else what status records for the same Secret."""
    meta = body["metadata"]
    state = CONTROLLER.get((meta["namespace"], meta["name"]))
    try:
        base, _ = _target(body)
    except ValidationError:
        return None
    if base.key_secret is None:
        return None
    if state is not None and state.key_read is not None and state.key_read[1].secret == base.key_secret[0]:
        return state.key_read[1].fingerprint
    return l2key.fingerprint_in_status(body.get("status"), base.key_secret[0])


def set_policy(new: Policy) -> None:
    CONTROLLER.policy = new


def _refusal(target: Target) -> Refusal | None:
    """Why this resource may not be applied under the operator's policy (an image outside
    allowedImages, a named Secret without secretLabel), or None. Only the named Secrets'
    metadata is read for it, never their data. Blocking."""
    refused = image_refusal(target.spec, CONTROLLER.policy.allowed_images)
    for field, name in named_secrets(target.spec):
        refused = refused or _named_secret_refusal(field, name, target.namespace)
    return refused


def _named_secret_refusal(field: str, name: str, namespace: str) -> Refusal | None:
    """SecretNotAllowed when secretLabel is set and the Secret a user named lacks it, or None.
    Reads the Secret's metadata only. Blocking."""
    policy = CONTROLLER.policy
    if policy.secret_label is None:
        return None
    try:
        metadata = kube.get_metadata("v1", "Secret", name, namespace)
    except ApiException as exc:
        return SECRET_NOT_ALLOWED, (f"{field}: Secret {name}: its labels could not be read (the API server answered "
                                    f"{exc.status}), so it is not used; retrying")
    return secret_refusal(field, name, namespace, metadata, policy.secret_label)


def _observe(body: Mapping[str, Any], target: Target, resolution: Resolution, seen: Seen,
             secrets_usable: bool = True, key: l2key.KeyRead | None = None) -> Observation:
    """Workload objects come from the watch caches (seen); only a claim the user named is read,
    since it carries none of the operator's labels. secrets_usable False: the Secrets the user
    named are refused (policy), so neither is read. key: the L2 key as read (_read_key)."""
    ns = target.namespace
    spec = target.spec
    pods = seen.server_pods()
    claims: list[dict[str, Any]] = []
    if spec.l2.nvme is not None and spec.l2.nvme.existing_claim_name:
        claim = kube.get("v1", "PersistentVolumeClaim", spec.l2.nvme.existing_claim_name, ns)
        claims = [claim] if claim else []
    elif spec.l2.nvme is not None:
        claims = seen.server_claims()
    running = [(p["metadata"]["name"], (p.get("status") or {}).get("podIP"))
               for p in pods if (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    server_desired = spec.lmcache_server.replicas if target.cache_enabled else 0
    token = _agent_token(target) if target.cache_enabled else None
    reports = collect_usage(sorted(running), spec.lmcache_server.agent_port, token=token) if target.cache_enabled else []
    now = time.monotonic()
    state = CONTROLLER.held((target.namespace, target.name))
    if target.cache_enabled and token is None and now - state.token_missing_at > TOKEN_REAPPLY_S:
        state.token_missing_at = now  # its Secret is gone (or was a deleted namesake's): make it again
        state.drifted = True
    failing = [r.pod for r in reports if state.write_failures.failing(f"{ns}/{r.pod}", r.l2_writes_failed, now)]
    inventory = None
    secret = _SecretOnce(target)  # the preflight and the bucket listing share one read
    if spec.l2.nvme is not None and target.cache_enabled:
        volumes = []
        agents = sorted(running)
        for (pod, _ip), inv in zip(agents, _inventories(agents, spec.lmcache_server.agent_port, token), strict=True):
            if inv is None:  # a partial inventory would make totals flap: keep the last whole one
                volumes = []
                break
            volumes.append((f"pvc/{spec.l2.nvme.existing_claim_name or f'{L2_VOLUME}-{pod}'}", pod, inv))
        inventory = status_summary(volumes, target.namespace_id, set(seen.live_ids)) if volumes else None
    elif spec.l2.hf_bucket is not None and target.cache_enabled and secrets_usable:
        inv = _bucket_inventory_of(target, secret)
        inventory = status_summary([(inv.location, None, inv)], target.namespace_id, set(seen.live_ids)) if inv else None
    statefulset = seen.statefulset(target)

    def statefulset_failure() -> str | None:
        """The StatefulSet's own Events (one LIST, field-selected): the API server's reason."""
        selector = f"involvedObject.kind=StatefulSet,involvedObject.name={target.server_name}"
        try:
            events = kube.client().resources.get(api_version="v1", kind="Event").get(
                namespace=ns, field_selector=selector, _request_timeout=kube.REQUEST_TIMEOUT_S)
        except ApiException:  # e.g. no right to list events: LMCacheReady then says ServersStarting
            return None
        return failed_create([e.to_dict() for e in events.items])

    create_failure = state.failed_creates.failure((ns, target.server_name), pods_missing(statefulset, server_desired), now,
                                             statefulset_failure)
    key_problem = key.problem if key is not None and secrets_usable and key.fingerprint is None else None
    return Observation(
        key_problem=key_problem,
        bucket_check=(_bucket_check(target, secret) if spec.l2.hf_bucket is not None and target.cache_enabled
                      and secrets_usable else None),
        generation=body["metadata"].get("generation"),
        namespace_id=target.namespace_id,
        identity_reason=key_problem[1] if key_problem and resolution.code == "L2KeyNotRead" else resolution.reason,
        identity_code=key_problem[0] if key_problem and resolution.code == "L2KeyNotRead" else resolution.code,
        l2_kind=spec.l2.kind,
        server_desired=server_desired,
        vllm_desired=spec.vllm.replicas,
        statefulset=statefulset,
        deployment=seen.deployment(target),
        server_create_failure=create_failure,
        server_pods=pods,
        claims=claims,
        existing_claim=spec.l2.nvme.existing_claim_name if spec.l2.nvme is not None else None,
        writes_failing=failing,
        reports=reports,
        inventory=inventory,
        budget_bytes=spec.l2.nvme.budget_bytes if spec.l2.nvme is not None else None,
    )


def _inventories(pods: list[tuple[str, str | None]], port: int, token: str | None) -> list[Inventory | None]:
    """Every agent's inventory, asked in parallel: each call is bounded (kvpersist.httpclient), so
    the round costs one deadline however many agents are slow."""
    return in_parallel(lambda pi: fetch_inventory(pi[1], port, token=token) if pi[1] else None, pods, limit=16)


AGENT_TOKEN_TTL_S = 300.0
TOKEN_REAPPLY_S = 15.0  # a missing token Secret is applied again at most this often


def _agent_token(target: Target) -> str | None:
    """The resource's agent token, from its Secret, read at most every AGENT_TOKEN_TTL_S (and again
    after a failed read). Never logged."""
    state = CONTROLLER.held((target.namespace, target.name))
    cached = state.agent_token
    now = time.monotonic()
    if cached and cached[1] and now - cached[0] < AGENT_TOKEN_TTL_S:
        return cached[1]
    try:
        secret = kube.get("v1", "Secret", target.agent_token_secret, target.namespace)
    except ApiException:
        secret = None
    raw = kube.secret_value(secret, AGENT_TOKEN_KEY)
    token = raw.decode().strip() if raw else None
    state.agent_token = (now, token)
    return token


class _SecretOnce:
    """The bucket token's Secret, read at most once per refresh and only if someone asks."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._read = False
        self._secret: dict[str, Any] | None = None
        self.problem: str | None = None  # why the Secret is not used (secretLabel), when it is not

    def get(self) -> dict[str, Any] | None:
        if not self._read:
            ref = self.target.spec.l2.hf_bucket.token_secret_ref  # type: ignore[union-attr]
            self._read = True
            refused = _named_secret_refusal("spec.l2.hfBucket.tokenSecretRef", ref.name, self.target.namespace)
            if refused is not None:  # not read at all: neither the preflight nor a listing nor gc uses it
                self.problem = refused[1]
            else:
                self._secret = kube.get("v1", "Secret", ref.name, self.target.namespace)
        return self._secret

    def token(self) -> str | None:
        ref = self.target.spec.l2.hf_bucket.token_secret_ref  # type: ignore[union-attr]
        raw = kube.secret_value(self.get(), ref.key)
        return raw.decode().strip() if raw else None


# Hub calls (preflight, listing) may take minutes for a slow Hub or a huge bucket: they run in the
# controller's bucket pool, never on the refresh path; a refresh reads their last result, and the
# resource is refreshed again when one finishes.
def _off_path(key: tuple[str, str], what: str, job: Callable[[], None]) -> bool:
    """Starts job in the bucket pool unless this resource's job of that kind still runs; True if
    started. Whatever it raises is logged, and the resource is marked for a refresh when it ends."""
    state = CONTROLLER.held(key)

    def run() -> None:
        try:
            job()
        except Exception:  # a failed job must not go unnoticed, nor kill the pool's thread
            logging.getLogger("kvpersist").exception("bucket %s of %s/%s failed", what, key[0], key[1])
        finally:
            state.dirty = True

    with CONTROLLER.bucket_jobs_lock:
        running = state.bucket_jobs.get(what)
        if running is not None and not running.done():
            return False
        state.bucket_jobs[what] = CONTROLLER.bucket_pool.submit(run)
        return True


def _bucket_check(target: Target, secrets: _SecretOnce) -> tuple[bool, str, str] | None:
    """The hfBucket preflight, at most once per PREFLIGHT_TTL_S per resource and bucket settings,
    off the refresh path: None (unknown) until the first one for these settings has answered. A
    passing check is reused without reading the Secret again; a failing one re-reads it on every
    refresh, so a Secret created or fixed shows within one status interval."""
    bucket = target.spec.l2.hf_bucket
    assert bucket is not None
    ref = f"Secret {bucket.token_secret_ref.name} key {bucket.token_secret_ref.key}"
    settings = (bucket.bucket_handle, bucket.create_bucket_if_missing, bucket.token_secret_ref.name, bucket.token_secret_ref.key)
    state = CONTROLLER.held((target.namespace, target.name))
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
    resource = (target.namespace, target.name)

    def check() -> None:
        result = preflight_bucket(bucket.bucket_handle, token, bucket.create_bucket_if_missing,
                                  ref, endpoint=os.environ.get("HF_ENDPOINT"))
        state.preflight = (key, time.monotonic(), (result.ok, result.reason, result.message))

    _off_path(resource, "preflight", check)
    return cached[2] if cached and cached[0][:len(settings)] == settings else None  # the last verdict meanwhile


def _bucket_inventory_of(target: Target, secrets: _SecretOnce) -> Inventory | None:
    """The bucket prefix's listing, at most once per BUCKET_INVENTORY_TTL_S (BUCKET_INVENTORY_RETRY_S
    after a failure), listed off the refresh path; the last good one meanwhile (L2Ready reports the
    Hub's problems)."""
    bucket = target.spec.l2.hf_bucket
    assert bucket is not None
    key = (target.namespace, target.name)
    state = CONTROLLER.held(key)
    when, last = state.bucket_inventory or (float("-inf"), None)
    if last is not None and last.location != bucket.bucket_handle:
        when, last = float("-inf"), None
    now = time.monotonic()
    if now - when < (BUCKET_INVENTORY_RETRY_S if state.bucket_inventory_failed else BUCKET_INVENTORY_TTL_S):
        return last
    token = secrets.token()
    previous = last

    def listing() -> None:
        try:
            if token is None:
                raise BucketInventoryError("SecretNotFound", "no token")
            listed = scan_bucket(bucket.bucket_handle, token, endpoint=os.environ.get("HF_ENDPOINT"))
            state.bucket_inventory_failed = False
        except BucketInventoryError:
            listed = previous
            state.bucket_inventory_failed = True
        state.bucket_inventory = (time.monotonic(), listed)

    _off_path(key, "listing", listing)
    return last


def _events_for(old: dict[str, Any], new: dict[str, Any], conds: list[dict[str, Any]],
                annotations: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """The transitions a user cares about, as (type, reason, message)."""
    events = []
    old_id, new_id = old.get("namespaceId"), new.get("namespaceId")
    if new_id and new_id != old_id:
        events.append(("Normal", "NamespaceResolved", f"identity pins resolve to {new_id}"
                       + (f" (was {old_id}; its data is kept, unreachable from these pins)" if old_id else "")))
    # Another L2 key: another namespace, the old one's data unreadable with it (kvpersist.controller.l2key).
    events += l2key.events(old, new, annotations)
    # The key cannot be used (lost, missing, too short, ...): the cache is off; said once per distinct message.
    ident = next((c for c in conds if c["type"] == "IdentityResolved"), None)
    old_ident = next((c for c in old.get("conditions") or [] if c.get("type") == "IdentityResolved"), {})
    key_off = ident is not None and ident["status"] == "False" and ident["reason"] in l2key.KEY_REASONS
    if key_off and ident["reason"] != l2key.KEY_PENDING and (
            (old_ident.get("reason"), old_ident.get("message")) != (ident["reason"], ident["message"])):
        events.append(("Warning", ident["reason"], ident["message"]))
    was_bypassed = any(c.get("type") == fallback.CONDITION for c in old.get("conditions") or [])
    bypass = next((c for c in conds if c["type"] == fallback.CONDITION), None)
    if bypass is not None and not was_bypassed:
        events.append(("Warning", fallback.CONDITION, bypass["message"]))
    elif bypass is None and was_bypassed and new.get("namespaceId"):
        over_build = any(c.get("type") == fallback.CONDITION and c.get("reason") == buildstatus.MISMATCH
                         for c in old.get("conditions") or [])
        over_route = any(c.get("type") == fallback.CONDITION and c.get("reason") == ROUTE_TAKEN
                         for c in old.get("conditions") or [])
        events.append(("Normal", "CacheRestored", f"a new namespace id ({new['namespaceId']}: the image or connectorBuild "
                       "changed): vLLM runs with the cache again, checking its build" if over_build else
                       "the namespace id's route names are free again: vLLM runs with the cache" if over_route else
                       "the lmcache servers are healthy again: vLLM runs with the cache"))
    # The pods' build check (kvpersist.controller.buildcheck): once per distinct mismatch, and when it is over.
    old_build = next((c for c in old.get("conditions") or [] if c.get("type") == buildstatus.CONDITION), {})
    build = next((c for c in conds if c["type"] == buildstatus.CONDITION), None)
    if build is not None and build["status"] == "False":
        if (old_build.get("reason"), old_build.get("message")) != (build["reason"], build["message"]):
            events.append(("Warning", build["reason"], build["message"]))
    elif build is not None and build["status"] == "True" and old_build.get("status") == "False":
        events.append(("Normal", build["reason"], build["message"]))
    phase = new.get("phase")
    # Refused by the operator's policy (ImageNotAllowed, SecretNotAllowed): a Warning of that reason
    # whenever the refusal is new or says something new, in place of the generic Failed one.
    ready = next((c for c in conds if c["type"] == "Ready"), None)
    old_ready = next((c for c in old.get("conditions") or [] if c.get("type") == "Ready"), {})
    # So is a store another resource holds (StorageInUse: kvpersist.controller.sharing), and its end.
    refused = ready is not None and ready["reason"] in (*REFUSAL_REASONS, sharing.STORAGE_IN_USE)
    if refused and (old_ready.get("reason"), old_ready.get("message")) != (ready["reason"], ready["message"]):
        events.append(("Warning", ready["reason"], ready["message"]))
    elif old_ready.get("reason") == sharing.STORAGE_IN_USE and ready is not None:
        events.append(("Normal", sharing.RELEASED, "the L2 store is no longer held by another resource: the lmcache "
                       "servers start on it"))
    if phase and phase != old.get("phase"):
        detail = ready["message"] if ready else ""
        if phase == "CacheDisabled" and not key_off and not refused:
            ident = next(c for c in conds if c["type"] == "IdentityResolved")
            events.append(("Warning", ident["reason"], ident["message"]))
        elif phase in ("Degraded", "Failed") and not refused:
            events.append(("Warning", phase, detail))
        elif phase == "Ready":
            events.append(("Normal", "Ready", detail))
    old_budget, new_budget = (old.get("budget") or {}).get("state"), (new.get("budget") or {}).get("state")
    if new_budget != old_budget and new_budget is not None:
        cond = next((c for c in conds if c["type"] == "WithinBudget"), None)
        if new_budget == "Exhausted":
            events.append(("Warning", "BudgetExhausted", cond["message"] if cond else "L2 budget exhausted"))
        elif old_budget == "Exhausted":
            events.append(("Normal", "BudgetAvailable", cond["message"] if cond else "L2 budget has room again"))
    return events


def _write_status(meta: Mapping[str, Any], patch: Mapping[str, Any], logger: logging.Logger) -> dict[str, Any] | None:
    """Every status write of the operator: checked against the status models first, since the API
    server would prune a key the CRD lacks without a word (kvpersist.api.status: in tests a bad
    key raises; in production its field is left out and logged). What was sent, or None. Blocking."""
    sent = checked_patch(patch, logger, f"{meta['namespace']}/{meta['name']}")
    if sent is not None:
        kube.patch_status(api.API_VERSION, api.KIND, meta["name"], meta["namespace"], sent)
    return sent


def _cache_fallback(key: tuple[str, str], body: Mapping[str, Any], conds: list[dict[str, Any]], generation: int | None,
                    logger: logging.Logger) -> list[dict[str, Any]]:
    """Feeds LMCacheReady to kvpersist.controller.fallback; when vLLM is to go without the cache, or back
    with it, marks the resource for an apply. The conditions, with CacheBypassed while it lasts."""
    lmcache = next((c for c in conds if c["type"] == "LMCacheReady"), {})
    tracker = CONTROLLER.fallback
    tracker.seed(key, fallback.bypassed_in(body))
    change = tracker.observe(key, lmcache.get("status") == "True", time.monotonic())
    if change is not None:
        CONTROLLER.held(key).drifted = True  # the status loop applies the vLLM Deployment with (or without) the cache
        logger.warning("%s/%s: %s", key[0], key[1], "the lmcache servers are unavailable: rolling vLLM without the cache"
                       if change else "the lmcache servers are healthy again: rolling vLLM with the cache")
    if not tracker.bypassed(key):
        return conds
    why = f"{lmcache.get('reason', 'Unknown')}: {lmcache.get('message', '')}"[:600]
    message = (f"the lmcache servers stayed unavailable for over {tracker.after_s:.0f} s ({why}): vLLM runs without the "
               f"cache (no --kv-transfer-config) and gets it back once they are healthy for {tracker.recover_s:.0f} s")
    return [*conds, condition(fallback.CONDITION, True, "ServersUnavailable", message, generation)]


def _build_check(key: tuple[str, str], body: Mapping[str, Any], target: Target, seen: Seen,
                 logger: logging.Logger) -> buildstatus.BuildVerdict:
    """The pods' runtime build check (kvpersist.controller.buildcheck), read from their container statuses
    in the watch cache. A vLLM pod that refused its versions sends vLLM without the cache for this
    namespace id (applied on the next tick); a server that refuses is simply not ready, and
    kvpersist.controller.fallback does the rest."""
    bypass = CONTROLLER.build_bypass
    bypass.seed(key, body)
    found = buildstatus.refusals(seen.pods, target.namespace_id)
    if bypass.observe(key, target.namespace_id, found):
        CONTROLLER.held(key).drifted = True
        logger.warning("%s/%s: a vLLM pod refused to start over its versions: rolling vLLM without the cache (%s)",
                       key[0], key[1], bypass.detail(key, target.namespace_id))
    return buildstatus.BuildVerdict(target.spec.identity.connector_build, tuple(found), bypass.detail(key, target.namespace_id))


def _build_bypassed(key: tuple[str, str], target: Target, conds: list[dict[str, Any]],
                    generation: int | None) -> list[dict[str, Any]]:
    """CacheBypassed (reason BuildMismatch) while vLLM runs without the cache over its versions:
    it says more than the servers' fallback, and lasts until the namespace id changes."""
    detail = CONTROLLER.build_bypass.detail(key, target.namespace_id)
    if detail is None:
        return conds
    return [*(c for c in conds if c["type"] != fallback.CONDITION),
            condition(fallback.CONDITION, True, buildstatus.MISMATCH, buildstatus.bypass_message(detail), generation)]


def _protect_retained(target: Target, read: l2key.KeyRead | None, seen: Seen, logger: logging.Logger) -> None:
    """What outlives the resource, kept out of GitOps prunes (kvpersist.builders.retained): the
    generated key Secret (made before this version, or restored from a backup with its old labels)
    and the claims the StatefulSet made (they get its selector's tracking label whatever the
    template says), each patched once, metadata only; the claims also record the key fingerprint
    their data needs. A failure is logged and tried again on a later refresh. Blocking."""
    state = CONTROLLER.held((target.namespace, target.name))
    if read is not None and read.generated and read.metadata is not None:
        patch = protect_patch(read.metadata, target.name)
        if patch is not None:
            try:
                kube.patch_metadata("v1", "Secret", read.secret, target.namespace, patch)
                logger.info("%s/%s: Secret %s kept out of GitOps prunes (labels and annotations)", target.namespace,
                            target.name, read.secret)
            except ApiException as exc:
                logger.warning("%s/%s: Secret %s not protected from prunes (%s); retrying", target.namespace,
                               target.name, read.secret, exc.status)
        if state.key_read is not None and state.key_read[1] == read:  # judged: not again until the next read
            state.key_read = (state.key_read[0], dataclasses.replace(read, metadata=None))
    fingerprint = read.fingerprint if read is not None and target.namespace_id is not None else None
    _protect_claims([(c, target.name) for c in seen.server_claims()], fingerprint, logger)


def _protect_claims(claims: list[tuple[Mapping[str, Any], str]], fingerprint: str | None, logger: logging.Logger) -> None:
    """Patches each (claim, owner name) that needs it, at most once per resourceVersion. Blocking."""
    for claim, owner in claims:
        meta = claim.get("metadata") or {}
        where = (meta.get("namespace", ""), meta.get("name", ""))
        patch = protect_patch(meta, owner, fingerprint)
        if patch is None or CONTROLLER.claims_protected.get(where) == (meta.get("resourceVersion"), fingerprint):
            continue
        try:
            kube.patch_metadata("v1", "PersistentVolumeClaim", where[1], where[0], patch)
        except ApiException as exc:
            logger.warning("claim %s/%s not protected from prunes (%s); retrying", where[0], where[1], exc.status)
            continue
        CONTROLLER.claims_protected[where] = (meta.get("resourceVersion"), fingerprint)
        logger.info("claim %s/%s kept out of GitOps prunes%s", where[0], where[1],
                    f" (its data needs L2 key {fingerprint})" if fingerprint else "")


def _orphan_claims() -> list[tuple[Mapping[str, Any], str]]:
    """Claims of the operator's StatefulSets whose resource is gone (or not seen yet) and that are
    not protected from prunes yet: a claim retained from before this version. Event loop only."""
    known = CONTROLLER.known()
    out = []
    for key, store in list(CONTROLLER.indices.get("kvp_claims", {}).items()):
        if key in known:
            continue
        for claim in list(store):
            if claim["metadata"]["labels"].get(COMPONENT_LABEL) == SERVER and protect_patch(claim["metadata"], key[1]):
                out.append((claim, key[1]))
    return out


def refresh_status(body: Mapping[str, Any], seen: Seen, logger: logging.Logger) -> None:
    """Observe, judge, and write status only when something a user can see changed. Blocking
    (HTTP to the servers, the status patch): runs in a worker thread."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    state = CONTROLLER.held(key)
    state.dirty = False
    state.last_refresh = time.monotonic()
    old = dict(body.get("status") or {})
    generation = meta.get("generation")
    try:
        target, resolution = _target(body)
    except ValidationError as exc:
        fields, conds = failed_status(generation, api.validation_message(exc))
        reports, inventory = [], None
    else:
        refused = _refusal(target)
        if refused is None and state.refused is not None:
            state.drifted = True  # refused when last applied, allowed now (e.g. the Secret was labelled): apply
        secrets_usable = refused is None or refused[0] != SECRET_NOT_ALLOWED
        read, _lost = _judge_key(body, _read_key(target) if secrets_usable else None, seen.server_claims())
        target, resolution = _target(body, read.fingerprint if read is not None else None)
        if read is not None and read.problem is not None and read.problem[0] == l2key.KEY_PENDING:
            state.drifted = True  # the generated key is to be made (or made again: nothing is sealed with the last one)
        if state.applied_id is not None and state.applied_id[0] != target.namespace_id:
            state.drifted = True  # the key changed, went or came back: another namespace id to apply
            if refused is None and CONTROLLER.apply_backoff.pending(key) is None and state.apply_error is None:
                return  # status follows the apply (next tick): never the new id beside the old id's servers
        _protect_retained(target, read, seen, logger)
        resolved_id = target.namespace_id
        target = _exclusive_recheck(target, body)  # as last applied: the cache off while its store is held
        if state.routes_pending and clean_stale_routes(target, seen, logger):
            state.routes_pending = False
        observation = _observe(body, target, resolution, seen, secrets_usable=secrets_usable, key=read)
        if target.cache_enabled:
            observation.build = _build_check(key, body, target, seen, logger)
        if old.get("namespaceId") == target.namespace_id:
            observation.budget_floor = int((old.get("budget") or {}).get("usedBytes") or 0)
            observation.budget_floor_exhausted = (old.get("budget") or {}).get("state") == "Exhausted"
        fields, conds = compute_status(observation)
        if target.key_secret is None:
            fields["l2Key"] = None  # not encrypted: no key (a record left from before goes)
        elif read is not None and read.fingerprint is not None and target.namespace_id is not None:
            fields["l2Key"] = {"secret": read.secret, "generated": read.generated, "fingerprint": read.fingerprint,
                               "namespaceId": target.namespace_id}
        # Otherwise the last record stays as it is: the data stored under that key needs it back.
        reports = observation.reports
        inventory = observation.inventory
        if target.cache_enabled:
            conds = _cache_fallback(key, body, conds, generation, logger)
            conds = _build_bypassed(key, target, conds, generation)
        if state.storage_refused is not None and resolved_id:
            fields, conds = sharing.refused_status(fields, conds, resolved_id, state.storage_refused, generation)
        elif state.route_taken is not None and target.cache_enabled:
            conds = [*(c for c in conds if c["type"] != fallback.CONDITION),
                     condition(fallback.CONDITION, True, ROUTE_TAKEN, state.route_taken, generation)]
        error = state.apply_error
        retrying = CONTROLLER.apply_backoff.pending(key)
        if error and error[0] == generation:
            fields = {**fields, "phase": "Failed"}
            conds = [c for c in conds if c["type"] != "Ready"] + [condition("Ready", False, "ApplyFailed", error[1], generation)]
        elif retrying is not None:
            message = (f"applying the workloads failed {retrying.attempts} time(s), last: {retrying.message}; next try "
                       f"at {iso(retrying.due_wall)} (the workloads may not match the spec meanwhile)")
            fields = {**fields, "phase": "Degraded" if fields.get("phase") in ("Ready", "Degraded") else fields.get("phase")}
            conds = [c for c in conds if c["type"] != "Ready"] + [condition("Ready", False, "ApplyRetrying", message, generation)]
        if refused is not None:
            fields, conds = refused_status(fields, conds, refused, generation)
    metrics.refreshed(meta["namespace"], meta["name"], fields.get("phase"))
    hits = CONTROLLER.hits.observe(key, meta.get("uid"), old.get("hits"), reports, time.monotonic(), condition_now())
    new_status = status_patch(old, fields, conds, reports, inventory, hits)
    if new_status is None:
        return
    new_status = _write_status(meta, new_status, logger)
    if new_status is None:
        return
    metrics.inc("kvpersist_status_writes_total")
    for type_, reason_, message in _events_for(old, {**old, **new_status}, conds, meta.get("annotations")):
        kube.post_event(body, type_, reason_, message)
        metrics.inc("kvpersist_events_total")
        logger.info("%s/%s %s: %s", meta["namespace"], meta["name"], reason_, message)


def _judge_key(body: Mapping[str, Any], key: l2key.KeyRead | None,
               claims: list[dict[str, Any]] | None) -> tuple[l2key.KeyRead | None, l2key.Loss | None]:
    """The key as read, with L2KeyLost in place of L2KeyPending when the generated Secret is gone
    over data sealed with it (kvpersist.controller.l2key.loss): then it is not made again."""
    if key is None or not key.absent or not key.generated:
        return key, None
    meta = body["metadata"]
    found = l2key.loss(body.get("status"), key, meta.get("annotations"), claims)
    if found is None:
        return key, None
    return dataclasses.replace(key, problem=(l2key.KEY_LOST, l2key.loss_message(found, meta["name"], meta["namespace"]))), found


def apply_workloads(body: Mapping[str, Any], logger: logging.Logger, seen: Seen | None = None) -> bool:
    """Apply every object this resource becomes (server-side, idempotent). False when the spec
    cannot be read (status says why). The L2 key is read first (its fingerprint is in the
    namespace id, so in every per-id name); a generated one is made when absent, unless data
    sealed with the last one exists (_judge_key). Blocking: runs in a worker thread."""
    try:
        target, _reason = _target(body)
    except ValidationError:
        return False
    key = (target.namespace, target.name)
    state = CONTROLLER.held(key)
    metrics.inc("kvpersist_reconciles_total")
    CONTROLLER.fallback.seed(key, fallback.bypassed_in(body))
    CONTROLLER.build_bypass.seed(key, body)
    refused = _refusal(target)
    if refused is not None:  # nothing rendered and nothing deleted: the children stay as they are
        if state.refused != refused:
            logger.warning("%s/%s: not applied: %s", target.namespace, target.name, refused[1])
        state.refused = refused
        return True
    state.refused = None
    try:
        read, lost = _judge_key(body, _read_key(target, fresh=True), seen.server_claims() if seen is not None else None)
        key_secret = None
        if read is not None and read.absent and read.generated and lost is None:
            raw = secrets.token_bytes(L2_KEY_BYTES)  # its fingerprint names the namespace before the Secret exists
            key_secret = build_key_secret(target, key=raw)
            read = dataclasses.replace(read, fingerprint=key_fingerprint(raw), problem=None, absent=False)
            del raw
        if key_secret is not None:  # the operator's own Secrets carry secretLabel: usable under that rule
            key_secret["metadata"]["labels"].update(CONTROLLER.policy.generated_secret_labels())
        target, _reason = _target(body, read.fingerprint if read is not None else None)
        key_id = target.namespace_id  # what the spec and the key resolve to (refresh_status compares it)
        build_refused = CONTROLLER.build_bypass.detail(key, target.namespace_id) is not None
        target = dataclasses.replace(target, cache_bypassed=CONTROLLER.fallback.bypassed(key) or build_refused)
        if build_refused:
            target = dataclasses.replace(target, bypass_reason="a vLLM pod refused its lmcache/vLLM build")
        if lost is not None and read is not None and read.problem is not None:
            logger.warning("%s/%s: %s", target.namespace, target.name, read.problem[1])
        if read is not None:
            state.key_read = (time.monotonic(), read)
        target = _exclusive(target, body, logger)  # a store or route names another resource or id holds
        token_secret = build_agent_token_secret(target)  # before the agents, which read it at start
        token_secret["metadata"]["labels"].update(CONTROLLER.policy.generated_secret_labels())
        kopf.append_owner_reference(token_secret, owner=body)
        manifests = build_all(target)
        for manifest in manifests:
            kopf.append_owner_reference(manifest, owner=body)
        # What the server pods need before they exist: the L2 key (created once and never owned, see
        # keysecret), the agent token, and the policies that close their ports. Side by side, one
        # round trip instead of four: the StatefulSet, next, is what a user waits for.
        policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
        jobs = [CONTROLLER.apply_pool.submit(_apply_owned, m) for m in policies]
        # The token Secret is never applied over, never adopted: one a deleted namesake owned is the
        # garbage collector's, and once it is gone the next refresh finds no token and creates it
        # again. Adopting it would need `patch` on every Secret the operator can see.
        jobs.append(CONTROLLER.apply_pool.submit(lambda: kube.create_if_absent(token_secret)))
        key_job = CONTROLLER.apply_pool.submit(lambda: kube.create_if_absent(key_secret)) if key_secret is not None else None
        if key_job is not None:
            jobs.append(key_job)
        concurrent.futures.wait(jobs)
        for job in jobs:
            job.result()  # the first failure, raised here (every job has ended)
        if key_job is not None and not key_job.result():
            # Made by someone else between the read and the create: the manifests name a key it does
            # not hold. Nothing server-side was applied yet; read it and apply again.
            state.key_read = None
            raise RuntimeError(f"Secret {key_secret['metadata']['name']} appeared while applying; applying again with its key")
        if key_job is not None:
            logger.info("%s/%s: generated L2 master key Secret %s (fingerprint %s)", target.namespace, target.name,
                        key_secret["metadata"]["name"], read.fingerprint if read else None)
            kube.post_event(body, "Normal", l2key.KEY_GENERATED, f"generated Secret {key_secret['metadata']['name']} with "
                            f"L2's master key (fingerprint {read.fingerprint if read else None}); it is kept when this "
                            "resource is deleted (the data needs it)")
        for manifest in manifests:
            if manifest["kind"] != "NetworkPolicy":
                _apply_owned(manifest)
    except Exception as exc:  # any failure: the status loop tries again (retry.Backoff), status says why
        metrics.inc("kvpersist_apply_errors_total")
        generation = body["metadata"].get("generation")
        if isinstance(exc, ApiException) and retry.is_permanent(exc.status):
            state.apply_error = (generation, f"the API server refused an object: {_api_message(exc)}")
            CONTROLLER.apply_backoff.succeeded(key)  # not retried: only a changed spec can pass
            logger.error("apply failed: %s", state.apply_error[1])
        else:
            why = (f"HTTP {exc.status}: {_api_message(exc)}" if isinstance(exc, ApiException)
                   else f"{type(exc).__name__}: {exc}")[:1024]
            pending = CONTROLLER.apply_backoff.failed(key, generation, why, time.monotonic())
            state.drifted = True  # the status loop applies again once pending.due_at has passed
            logger.warning("%s/%s: applying the workloads failed (attempt %d: %s); trying again in %.0f s",
                           target.namespace, target.name, pending.attempts, why, retry.delay(pending.attempts))
    else:
        state.apply_error = None
        CONTROLLER.apply_backoff.succeeded(key)
        state.routes_pending = True  # an old id's Service and policy may now be stale (see clean_stale_routes)
        state.applied_id = (key_id,)
    return True


def _apply_owned(manifest: dict[str, Any]) -> None:
    applied = kube.apply(manifest)
    _note_own_write(applied)
    metrics.inc("kvpersist_applies_total")


def clean_stale_routes(target: Target, seen: Seen, logger: logging.Logger) -> bool:
    """Deletes the per-id Services and ZMQ policies of ids no pod of the resource carries any
    more; True once no pod of another id is left to wait for. Blocking: a worker thread."""
    in_use = ids_in_use(seen.pods)
    selector = f"{INSTANCE_LABEL}={target.name},{COMPONENT_LABEL}={SERVER}"
    try:
        for api_version, kind in ROUTE_KINDS:
            for name in stale(target, kube.list_all(api_version, kind, target.namespace, selector), in_use):
                kube.delete(api_version, kind, name, target.namespace)
                logger.info("%s/%s: deleted %s %s: no pod of its namespace id is left", target.namespace, target.name,
                            kind, name)
    except ApiException as exc:
        logger.warning("%s/%s: stale Services and policies not cleaned (%s); retrying", target.namespace, target.name,
                       exc.status)
        return False
    return not (in_use - {target.namespace_id})


def _store_user(target: Target, body: Mapping[str, Any]) -> sharing.User:
    return sharing.user(target.namespace, target.name, str(body["metadata"].get("creationTimestamp") or ""), target.spec,
                        target.namespace_id)


def _storage_refusal(target: Target, body: Mapping[str, Any]) -> str | None:
    """StorageInUse's message when another resource holds this one's claim or bucket prefix
    (kvpersist.controller.sharing), else None. Read from the API server, never the watch caches: a
    restarted operator may not have seen every resource yet. Raises ApiException. Blocking."""
    me = _store_user(target, body)
    if target.spec.l2.nvme is not None:  # claims are namespaced: that namespace's resources and servers
        bodies = kube.list_all(api.API_VERSION, api.KIND, target.namespace)
        pods = kube.list_all("v1", "Pod", target.namespace, f"{WATCH_SELECTOR},{COMPONENT_LABEL}={SERVER}")
    elif target.namespace_id:  # a bucket prefix is global: every namespace's resources
        bodies, pods = kube.list_all(api.API_VERSION, api.KIND), []
    else:
        return None
    return sharing.refusal(me, [u for b in bodies if (u := sharing.user_of(b)) is not None], pods)


def _route_conflicts(target: Target) -> list[str]:
    """The objects already under this id's route names that route elsewhere (stale_routes
    .route_conflicts): a LIST by name of each kind (list is what the operator may do on them).
    Raises ApiException. Blocking."""
    name = target.per_id_name(target.namespace_id)
    found = [(kind, obj) for api_version, kind in ROUTE_KINDS
             for obj in kube.list_all(api_version, kind, target.namespace, field_selector=f"metadata.name={name}")]
    return route_conflicts(target, found)


def _exclusive(target: Target, body: Mapping[str, Any], logger: logging.Logger) -> Target:
    """Before an apply: the target as it may run alone. A claim or bucket prefix an older resource
    holds: the cache off (servers at zero, vLLM without it; StorageInUse). Route names another
    id's objects hold: no routes, vLLM without the cache (CacheBypassed, RouteNameTaken). Both
    recorded in the resource's state for status. Raises ApiException (the apply is retried)."""
    state = CONTROLLER.held((target.namespace, target.name))
    storage = _storage_refusal(target, body) if target.cache_enabled else None
    if storage != state.storage_refused and (storage or state.storage_refused):
        logger.warning("%s/%s: %s", target.namespace, target.name, storage or "its L2 store is free again: the cache is on")
    state.storage_refused = storage
    if storage is not None:
        return dataclasses.replace(target, namespace_id=None)
    conflicts = _route_conflicts(target) if target.cache_enabled else []
    taken = route_taken_message(target, conflicts) if conflicts else None
    if taken != state.route_taken and taken:
        logger.warning("%s/%s: %s", target.namespace, target.name, taken)
    state.route_taken = taken
    if taken is not None:
        return dataclasses.replace(target, routes=False, cache_bypassed=True,
                                   bypass_reason=f"route name {target.per_id_name(target.namespace_id)} is taken")
    return target


def _exclusive_recheck(target: Target, body: Mapping[str, Any]) -> Target:
    """In a status refresh: applies again when what _exclusive decided may have changed (the
    holder went, or an older resource now names the same store, or the route names are free),
    and returns the target as last applied. While refused, the API server is asked (a rare
    state); otherwise only the watch caches are looked at, so an idle refresh makes no request."""
    state = CONTROLLER.held((target.namespace, target.name))
    if not target.cache_enabled:
        return target
    try:
        if state.storage_refused is not None:
            changed = _storage_refusal(target, body) != state.storage_refused
        else:
            known = [u for st in CONTROLLER.known().values() if st.body is not None and (u := sharing.user_of(st.body))]
            changed = (sharing.holder(_store_user(target, body), known) is not None
                       or (state.route_taken is not None and not _route_conflicts(target)))
        if changed:
            state.drifted = True
    except ApiException:
        pass  # asked again on the next refresh
    if state.storage_refused is not None:
        return dataclasses.replace(target, namespace_id=None)
    if state.route_taken is not None:
        return dataclasses.replace(target, routes=False, cache_bypassed=True)
    return target


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL, field="spec")
async def reconcile(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """Apply the workloads, then refresh status. The blocking parts run in worker threads; the
    watch caches are read here, in the event loop."""
    loop = asyncio.get_running_loop()
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    state = CONTROLLER.state(key)
    async with state.lock:
        state.drifted = False
        try:
            await loop.run_in_executor(CONTROLLER.refresh_pool, apply_workloads, body, logger, _seen(key))
            await loop.run_in_executor(CONTROLLER.refresh_pool, refresh_status, body, _seen(key), logger)
        finally:
            _sweep_if_forgotten(key)


def run_gc(body: Mapping[str, Any], request: dict[str, str], seen: Seen, logger: logging.Logger) -> None:
    """Carry out one gc request: refuse a live namespace, else delete through the agents or from
    the bucket; record the outcome in status.gc and an Event, then clear the request. Blocking:
    runs in a worker thread."""
    meta = body["metadata"]
    target: Target | None = None
    try:
        target, _reason = _target(body, _known_fingerprint(body))
    except ValidationError as exc:
        outcome = gc_result(request, "Failed", f"the spec cannot be read: {api.validation_message(exc)}")
    if target is not None:
        bucket = target.spec.l2.hf_bucket
        # The watch caches first (cheap, and they see this resource's own pods); then, right before
        # each deletion, the API server itself (recheck): the caches may lag, and cover only the
        # watched namespaces.
        why = (request.get("error") or refusal(request["namespaceId"], target.namespace_id, seen.live_ids)
               or (bucket_refusal(bucket.bucket_handle, bucket.exclusive_to_this_cluster) if bucket is not None else None))
        recheck = functools.partial(in_use_now, request["namespaceId"], target.namespace_id)
        if why:
            outcome = gc_result(request, "Refused", f"refused: {why}; nothing was deleted")
        elif target.spec.l2.nvme is not None:
            servers = [(p["metadata"]["name"], p["status"]["podIP"]) for p in seen.server_pods()
                       if p["status"].get("phase") == "Running" and p["status"].get("podIP")
                       and not p["metadata"].get("deletionTimestamp")]
            outcome = gc_volumes(request, servers, target.spec.lmcache_server.agent_port, _agent_token(target), recheck)
        else:
            assert bucket is not None
            token_secret = _SecretOnce(target)  # refused unread without secretLabel, when that is set
            token = token_secret.token()
            if token is None:
                outcome = gc_result(request, "Failed", token_secret.problem or f"Secret {bucket.token_secret_ref.name} "
                                    f"has no key {bucket.token_secret_ref.key}: the bucket cannot be reached")
            else:
                outcome = gc_bucket(request, lambda nsid, before: remove_bucket_namespace(
                    bucket.bucket_handle, token, nsid, endpoint=os.environ.get("HF_ENDPOINT"), dry_run=False,
                    before_delete=before), bucket.bucket_handle, recheck)
                CONTROLLER.held((meta["namespace"], meta["name"])).bucket_inventory = None
    outcome["completedAt"] = condition_now()
    _write_status(meta, {"gc": outcome}, logger)
    ok = outcome["outcome"] in ("Deleted", "NotFound")
    reasons = {"Deleted": "NamespaceDeleted", "NotFound": "NamespaceNotFound", "Refused": "GCRefused"}
    reason = reasons.get(outcome["outcome"], "GCFailed")
    kube.post_event(body, "Normal" if ok else "Warning", reason, outcome["message"])
    metrics.inc("kvpersist_gc_total")
    logger.warning("%s/%s gc %s: %s", meta["namespace"], meta["name"], outcome["outcome"], outcome["message"])
    kube.patch_annotations(api.API_VERSION, api.KIND, meta["name"], meta["namespace"], {GC_ANNOTATION: None})


def in_use_now(namespace_id: str, current: str | None) -> str | None:
    """Why namespace_id may not be deleted, from a LIST of every KVCacheNamespace and every pod
    carrying a namespace id in all namespaces, made now (never the watch caches): gc calls it right
    before each agent's /gc and each bucket batch. A failed read refuses too. Blocking."""
    try:
        resources = kube.list_all(api.API_VERSION, api.KIND)
        pods = kube.list_all("v1", "Pod", None, NAMESPACE_ID_LABEL)
    except ApiException as exc:
        return (f"could not check again who uses {namespace_id} (listing KVCacheNamespaces and pods in all namespaces, the "
                f"API server answered {exc.status}); the operator needs list on both cluster-wide")
    try:
        return refusal_now(namespace_id, current, resources, pods, fingerprint=_fingerprint_now)
    except ApiException as exc:
        return (f"could not check again who uses {namespace_id}: an L2 key Secret could not be read (the API server "
                f"answered {exc.status}), and a resource's namespace id needs its key")


def _fingerprint_now(resource: Mapping[str, Any]) -> str | None:
    """The fingerprint of the key a resource's servers would mount, read now from its Secret (for
    one whose status records none: another namespace, not yet served). None when the Secret or
    key is absent or short: then it can use no namespace. Raises ApiException when unreadable."""
    meta = resource["metadata"]
    try:
        spec = api.KVCacheNamespaceSpec.model_validate(resource.get("spec") or {})
    except ValidationError:
        return None
    target = Target(meta["name"], meta["namespace"], spec, None)
    if target.key_secret is None:
        return None
    name, item = target.key_secret
    secret = kube.get("v1", "Secret", name, meta["namespace"])
    return l2key.read(secret, name, item, meta["namespace"], target.key_secret_generated,
                      kube.secret_value(secret, item)).fingerprint


async def _gc(key: tuple[str, str], request: dict[str, str], logger: logging.Logger) -> None:
    try:
        state = CONTROLLER.get(key)
        if state is not None and state.body is not None:
            await asyncio.get_running_loop().run_in_executor(None, run_gc, state.body, request, _seen(key), logger)
            state.dirty = True  # the inventory changed: show it
    except Exception as exc:  # reported, and retried on the next event while the annotation stays
        logger.error("gc of %s on %s/%s failed: %s", request.get("namespaceId"), key[0], key[1], exc)
    finally:
        CONTROLLER.gc_inflight.discard(request["requestId"])


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body).get("message", str(exc))
    except (TypeError, ValueError):
        return str(exc.reason)


def _forget(key: tuple[str, str]) -> None:
    """Everything the operator holds about one resource, dropped: it was deleted (its DELETED
    event, or a 404 from the API server for one whose event a watch outage lost)."""
    CONTROLLER.forget(key)
    metrics.set_phase(key[0], key[1], None)


def _sweep_if_forgotten(key: tuple[str, str]) -> None:
    """After a round of worker threads: when the resource was forgotten while they ran (deleted
    meanwhile), forget it again, so what they wrote into the trackers (hits, backoff, the phase
    metric) goes too. In the event loop, like track(): nothing can bring the key back in between."""
    if CONTROLLER.get(key) is None:
        _forget(key)


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)
async def track(event: Mapping[str, Any], body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    if event.get("type") == "DELETED" or body["metadata"].get("deletionTimestamp"):
        _forget(key)
    else:
        state = CONTROLLER.state(key)
        state.body = {"apiVersion": body.get("apiVersion", api.API_VERSION), "kind": body.get("kind", api.KIND),
                       "metadata": dict(body["metadata"]), "spec": dict(body.get("spec") or {}),
                       "status": dict(body.get("status") or {})}
        try:  # the key's fingerprint as last read (or recorded): nothing blocks the event loop
            state.namespace_id = _target(body, _known_fingerprint(body))[0].namespace_id
        except ValidationError:
            state.namespace_id = None
        request = parse_request(body["metadata"].get("annotations"))
        done = ((body.get("status") or {}).get("gc") or {}).get("requestId")
        if request and request["requestId"] != done and request["requestId"] not in CONTROLLER.gc_inflight:
            CONTROLLER.gc_inflight.add(request["requestId"])
            task = asyncio.create_task(_gc(key, request, logger))
            CONTROLLER.gc_tasks.add(task)
            task.add_done_callback(CONTROLLER.gc_tasks.discard)


# The watch caches. kopf runs no handler until every index has its initial listing, so the first
# refresh after a restart never sees a half-filled cache. Only the kinds the builders make carry
# WATCH_SELECTOR's label, which kopf sends as the watches' labelSelector (see configure).
_MANAGED = {"app.kubernetes.io/managed-by": "kvpersist"}


@kopf.index("apps", "v1", "statefulsets", labels=_MANAGED)
async def kvp_statefulsets(body: kopf.Body, **_: Any) -> Any:
    _mark_dirty(body)
    return index_entry(body)


@kopf.index("apps", "v1", "deployments", labels=_MANAGED)
async def kvp_deployments(body: kopf.Body, **_: Any) -> Any:
    _mark_dirty(body)
    return index_entry(body)


@kopf.index("", "v1", "pods", labels=_MANAGED)
async def kvp_pods(body: kopf.Body, **_: Any) -> Any:
    return index_entry(body)


@kopf.index("", "v1", "persistentvolumeclaims")
async def kvp_claims(body: kopf.Body, **_: Any) -> Any:
    return index_entry(body)


def _note_own_write(obj: Mapping[str, Any]) -> None:
    """The generation the operator's own apply left a child at: its watch event is no drift. (If an
    apply changes something every time, e.g. a field the API server stores otherwise than sent,
    the child would otherwise look edited after every apply and be applied again each tick.)"""
    meta = obj.get("metadata") or {}
    if meta.get("generation") is not None:
        CONTROLLER.child_generations[(obj.get("kind", ""), meta.get("namespace", ""), meta.get("name", ""))] = meta["generation"]


def _note_drift(event: Mapping[str, Any], body: Mapping[str, Any], kind: str) -> None:
    """A child of a known resource was deleted, or changed (a new generation, or any change of a
    kind without one): apply the resource again on the next tick. Status updates keep the
    generation, so a StatefulSet's or Deployment's rollout is no drift; the operator's own writes
    are noted by _note_own_write. The initial listing (event type None) is not drift: resume
    applies everything then anyway."""
    owner = owner_key(body)
    meta = body.get("metadata") or {}
    child = (kind, meta.get("namespace", ""), meta.get("name", ""))
    kind_of_event = event.get("type")
    generations = CONTROLLER.child_generations
    if kind_of_event == "DELETED":
        generations.pop(child, None)
    state = CONTROLLER.get(owner) if owner is not None else None
    if state is None or not state.known or kind_of_event is None:
        if kind_of_event is None and meta.get("generation") is not None:
            generations[child] = meta["generation"]
        return
    generation = meta.get("generation")
    if kind_of_event == "DELETED" or meta.get("deletionTimestamp"):
        state.drifted = True
        return
    if generation is None or generations.get(child) != generation:
        state.drifted = True
    if generation is not None:
        generations[child] = generation


@kopf.on.event("", "v1", "services", labels=_MANAGED)
async def drift_services(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
    _note_drift(event, body, "Service")


@kopf.on.event("", "v1", "configmaps", labels=_MANAGED)
async def drift_configmaps(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
    _note_drift(event, body, "ConfigMap")


@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=_MANAGED)
async def drift_networkpolicies(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
    _note_drift(event, body, "NetworkPolicy")


@kopf.on.event("apps", "v1", "statefulsets", labels=_MANAGED)
async def drift_statefulsets(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
    _note_drift(event, body, "StatefulSet")


@kopf.on.event("apps", "v1", "deployments", labels=_MANAGED)
async def drift_deployments(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
    _note_drift(event, body, "Deployment")


def _mark_dirty(body: Mapping[str, Any]) -> None:
    """A workload changed: refresh its owner on the next tick, so phase follows pod readiness."""
    owner = owner_key(body)
    state = CONTROLLER.get(owner) if owner is not None else None
    if state is not None and state.known:
        state.dirty = True


def _seen(key: tuple[str, str], live: frozenset[str] | None = None) -> Seen:
    """Copies of one resource's objects from the indexes; call in the event loop only."""
    def values(name: str) -> list[dict[str, Any]]:
        store = CONTROLLER.indices.get(name, {}).get(key)
        return list(store) if store is not None else []
    return Seen(statefulsets=values("kvp_statefulsets"), deployments=values("kvp_deployments"),
                pods=values("kvp_pods"), claims=values("kvp_claims"), live_ids=_live() if live is None else live)


def _live() -> frozenset[str]:
    """Every namespace id in use, from the caches; call in the event loop only."""
    pods = [p for store in CONTROLLER.indices.get("kvp_pods", {}).values() for p in store]
    known = CONTROLLER.known().values()
    return live_ids([st.body for st in known if st.body is not None], [st.namespace_id for st in known], pods)


def due(now: float) -> list[tuple[str, str]]:
    """Resources to refresh now: those marked dirty, and those not refreshed for STATUS_INTERVAL_S."""
    return [key for key, st in CONTROLLER.known().items() if st.dirty or now - st.last_refresh >= STATUS_INTERVAL_S]


async def _refresh_one(key: tuple[str, str], body: Mapping[str, Any], seen: Seen, restore: bool,
                       logger: logging.Logger) -> None:
    """One resource's round under its lock: its drifted children applied again, then its status."""
    loop = asyncio.get_running_loop()
    async with CONTROLLER.lock(key):
        try:
            if restore:
                logger.info("%s/%s: an owned object was deleted or edited; applying again", key[0], key[1])
                await loop.run_in_executor(CONTROLLER.refresh_pool, apply_workloads, body, logger, seen)
                seen = _seen(key, seen.live_ids)  # what the apply changed, as the watch caches have it now
            await loop.run_in_executor(CONTROLLER.refresh_pool, refresh_status, body, seen, logger)
        except Exception as exc:  # one object's failure must not stop the others' status
            logger.warning("status refresh of %s/%s failed: %s", key[0], key[1], exc)
            gone = isinstance(exc, ApiException) and exc.status == 404
        else:
            return
        finally:
            _sweep_if_forgotten(key)
    # Deleted while this operator missed its DELETED event (a watch outage)? A ghost would be
    # refreshed, and fail, forever: asked once, and forgotten when the API server says it is gone.
    if gone and not await loop.run_in_executor(CONTROLLER.refresh_pool, _exists, key):
        logger.info("%s/%s no longer exists; forgetting it", key[0], key[1])
        _forget(key)


def _exists(key: tuple[str, str]) -> bool:
    """Whether the API server still has this resource. Blocking."""
    return kube.get(api.API_VERSION, api.KIND, key[1], key[0]) is not None


# The liveness probe fails when the loop has not ticked for this long: a status loop that stopped
# (died, or the event loop is blocked) is an operator that must be restarted.
LOOP_STALL_S = 60.0


@kopf.on.probe(id="statusLoopSecondsSinceTick")
def status_loop_alive(**_: Any) -> float:
    """Seconds since the status loop last ticked; raises (kopf's /healthz answers 500) when stalled."""
    if CONTROLLER.loop_task is not None and CONTROLLER.loop_task.done():
        raise kopf.PermanentError("the status loop has stopped")
    if CONTROLLER.last_tick is None:
        return 0.0
    age = time.monotonic() - CONTROLLER.last_tick
    if age > LOOP_STALL_S:
        raise kopf.PermanentError(f"the status loop last ticked {age:.0f}s ago")
    return round(age, 1)


async def _status_loop(logger: logging.Logger) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(TICK_S)
        tick = CONTROLLER.last_tick = time.monotonic()
        # A snapshot first (worker threads mark resources drifted); an apply that failed waits for its backoff.
        restore = {key for key, st in CONTROLLER.known().items() if st.drifted and CONTROLLER.apply_backoff.due(key, tick)}
        keys = sorted(set(due(time.monotonic())) | restore)
        # Where a peer is active, its status, not ours from caches kopf has paused.
        keys = await loop.run_in_executor(CONTROLLER.tick_pool, _active_keys, keys, tick)
        live = _live() if keys else frozenset()
        if tick - CONTROLLER.orphan_sweep_at >= STATUS_INTERVAL_S:
            CONTROLLER.orphan_sweep_at = tick
            orphans = _orphan_claims()
            if orphans:  # by the active replica only, as every other write
                loop.run_in_executor(CONTROLLER.refresh_pool, lambda o=orphans: _protect_claims(
                    [c for c in o if active(time.monotonic(), c[0]["metadata"].get("namespace"))], None, logger))
        for key in keys:
            state = CONTROLLER.get(key)
            if state is None or state.body is None or state.lock.locked():
                continue  # deleted meanwhile, or its last round (or a reconcile) still runs: next tick
            if key in restore:
                state.drifted = False
            task = asyncio.create_task(_refresh_one(key, state.body, _seen(key, live), key in restore, logger))
            CONTROLLER.refresh_tasks.add(task)
            task.add_done_callback(CONTROLLER.refresh_tasks.discard)


@kopf.on.startup()
async def start_status_loop(logger: logging.Logger, kvp_statefulsets: Mapping[Any, Any], kvp_deployments: Mapping[Any, Any],
                            kvp_pods: Mapping[Any, Any], kvp_claims: Mapping[Any, Any], **_: Any) -> None:
    CONTROLLER.indices.update(kvp_statefulsets=kvp_statefulsets, kvp_deployments=kvp_deployments, kvp_pods=kvp_pods,
                              kvp_claims=kvp_claims)
    CONTROLLER.loop_task = asyncio.create_task(_status_loop(logger))


@kopf.on.cleanup()
async def stop_status_loop(**_: Any) -> None:
    if CONTROLLER.loop_task is not None:
        CONTROLLER.loop_task.cancel()
