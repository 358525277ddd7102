"""One resource's status refresh: observe its workloads, agents and L2 (Hub calls off the refresh
path, in the bucket pool), judge it (kvpersist.status.conditions), write status only when
something a user can see changed, and post the Events of its transitions. Blocking: worker threads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kvpersist.api import v1alpha1 as api
from kvpersist.api.status import checked_patch
from kvpersist.builders.retained import protect_patch
from kvpersist.builders.target import AGENT_TOKEN_KEY, L2_VOLUME, SERVER, VLLM, Target
from kvpersist.controller import agentroll, fallback, inuse, kube, l2key, metrics, ownership, pincheck, prewarm, runtime, sharing
from kvpersist.controller.apply import _exclusive_recheck, _taken_recheck, clean_stale_routes
from kvpersist.controller.policy import REASONS as REFUSAL_REASONS
from kvpersist.controller.policy import SECRET_NOT_ALLOWED, refused_status
from kvpersist.controller.reading import (
    _judge_key,
    _named_secret_refusal,
    _read_key,
    _refusal,
    _target,
    claim_not_shareable,
    named_claim,
    secret_version,
)
from kvpersist.controller.stale_routes import ROUTE_TAKEN
from kvpersist.httpclient import in_parallel
from kvpersist.identity import Resolution
from kvpersist.inventory.agentclient import fetch_inventory, request_expire
from kvpersist.inventory.bucket import BucketInventoryError, scan_bucket
from kvpersist.inventory.hfbucket import preflight_bucket
from kvpersist.inventory.space import claim_space_summary, judge_expiry
from kvpersist.inventory.volume import Inventory, iso, one_per_location, status_summary
from kvpersist.status import build as buildstatus
from kvpersist.status import canary as judge_canary
from kvpersist.status.conditions import (
    SPACE_CONDITION,
    WARM_CONDITION,
    Observation,
    compute_status,
    condition,
    failed_create,
    failed_status,
    pods_missing,
    shareable,
    status_patch,
)
from kvpersist.status.conditions import now as condition_now
from kvpersist.status.usage import collect_usage
from kvpersist.status.workloads import COMPONENT_LABEL, Seen

PREFLIGHT_TTL_S = 300.0

# A bucket listing is a paged walk of the Hub's tree: at most once per this many seconds.
BUCKET_INVENTORY_TTL_S = 300.0
BUCKET_INVENTORY_RETRY_S = 30.0  # after a failed listing (no token yet, Hub refused or down)


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
        claim = named_claim(spec.l2.nvme.existing_claim_name, ns)
        claims = [claim] if claim else []
    elif spec.l2.nvme is not None:
        claims = [c for c in seen.server_claims() if target.shared_claim in (None, c["metadata"]["name"])]
    running = [(p["metadata"]["name"], (p.get("status") or {}).get("podIP"))
               for p in pods if (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    server_desired = spec.lmcache_server.replicas if target.cache_enabled else 0
    if target.shared and spec.l2.nvme is not None and spec.l2.nvme.existing_claim_name and claims \
            and not shareable(claims[0]):
        server_desired = min(server_desired, 1)  # as applied (apply._one_server_unless_shareable): ClaimNotShared
    token = _agent_token(target) if target.cache_enabled else None
    reports = collect_usage(sorted(running), spec.lmcache_server.agent_port, token=token) if target.cache_enabled else []
    now = time.monotonic()
    state = runtime.CONTROLLER.held((target.namespace, target.name))
    if target.cache_enabled and token is None and now - state.token_missing_at > TOKEN_REAPPLY_S:
        state.token_missing_at = now  # its Secret is gone (or was a deleted namesake's): make it again
        state.drifted = True
    failing = [r.pod for r in reports if state.write_failures.failing(f"{ns}/{r.pod}", r.l2_writes_failed, now)]
    inventory = space = None
    secret = _SecretOnce(target)  # the preflight and the bucket listing share one read
    if spec.l2.nvme is not None and target.cache_enabled:
        volumes = []
        agents = sorted(running)
        for (pod, _ip), inv in zip(agents, _inventories(agents, spec.lmcache_server.agent_port, token), strict=True):
            if inv is None:  # a partial inventory would make totals flap: keep the last whole one
                volumes = []
                break
            volumes.append((f"pvc/{target.shared_claim or spec.l2.nvme.existing_claim_name or f'{L2_VOLUME}-{pod}'}", pod,
                            inv))
        volumes = one_per_location(volumes)  # a shared claim's folder counted once, not once per server
        removed = (_expire_orphans(body, target, volumes, [a for a in agents if a[1]][:1] if target.shared else agents,
                                   token, seen)
                   if volumes and spec.l2.orphan_retention is not None else [])
        space = claim_space_summary(volumes, target.namespace_id, seen.live_ids, time.time(),
                                    (body.get("status") or {}).get("l2"), removed) if volumes else None
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
        vllm_selector=",".join(f"{k}={v}" for k, v in target.selector(VLLM).items()),
        statefulset=statefulset,
        deployment=seen.deployment(target),
        server_create_failure=create_failure,
        server_pods=pods,
        claims=claims,
        existing_claim=spec.l2.nvme.existing_claim_name if spec.l2.nvme is not None else None,
        shared=target.shared,
        writes_failing=failing,
        reports=reports,
        inventory=inventory,
        l2_space=space,
        budget_bytes=spec.l2.nvme.budget_bytes if spec.l2.nvme is not None else None,
    )


def _mark_dirty(key: tuple[str, str]) -> None:
    runtime.CONTROLLER.held(key).dirty = True


def _warm(key: tuple[str, str], target: Target, seen: Seen, state: Any) -> tuple[bool | None, str, str] | None:
    """spec.prewarm's Warm condition (kvpersist.controller.prewarm), starting the passes that are
    due off the refresh path; None when nothing is declared. vLLM without the cache (the servers'
    fallback, a refused build, a taken route) registers no layout: nothing is warmed meanwhile."""
    if target.spec.prewarm is None:
        runtime.CONTROLLER.prewarm.forget(key)
        return None
    bypassed = (runtime.CONTROLLER.fallback.bypassed(key) or state.route_taken is not None
                or runtime.CONTROLLER.build_bypass.detail(key, target.namespace_id) is not None)
    token = _agent_token(target) if target.cache_enabled else None
    return runtime.CONTROLLER.prewarm.observe(key, dataclasses.replace(target, cache_bypassed=bypassed), seen.pods, token,
                                              lambda: prewarm.read_api_key(target, _named_secret_refusal),
                                              lambda: _mark_dirty(key))


EXPIRE_PERIOD_S = 600.0  # an age-limit pass at most this often per resource: it lists the cluster per candidate
EXPIRE_MAX_PER_PASS = 16  # candidates judged (and listed for) in one pass; the rest wait for the next


def _expire_orphans(body: Mapping[str, Any], target: Target, volumes: list[tuple[str, str | None, Inventory]],
                    agents: list[tuple[str, str | None]], token: str | None, seen: Seen) -> list[dict[str, Any]]:
    """spec.l2.orphanRetention: asks each agent to remove the folders of other namespaces unwritten
    for maxAgeDays. Candidates come from the scans just read; each is checked against a fresh
    listing of every resource and pod right before (kvpersist.controller.inuse.in_use_now: a failed
    listing refuses), and the agent is sent every id in use (protected) and refuses without them.
    Each removal: a Normal OrphanExpired Event; returned, to be counted in status.l2. Blocking; at
    most every EXPIRE_PERIOD_S."""
    state = runtime.CONTROLLER.held((target.namespace, target.name))
    now = time.monotonic()
    if now - state.expired_at < EXPIRE_PERIOD_S or token is None or target.namespace_id is None:
        return []
    state.expired_at = now
    retention = target.spec.l2.orphan_retention
    assert retention is not None
    protected = set(seen.live_ids) | {target.namespace_id}
    namespaces = {n.namespace_id: n for _loc, _pod, inv in volumes for n in inv.namespaces}
    verdicts = judge_expiry(namespaces.values(), target.namespace_id, frozenset(protected), retention.max_age_days,
                            time.time())
    candidates = [v.namespace.namespace_id for v in verdicts if v.removable][:EXPIRE_MAX_PER_PASS]
    remove = []
    for nsid in candidates:
        if inuse.in_use_now(nsid, target.namespace_id) is None:
            remove.append(nsid)
        else:
            protected.add(nsid)
    if not remove:
        return []
    removed: list[dict[str, Any]] = []
    for pod, ip in agents:
        if not ip:
            continue
        code, answer = request_expire(ip, target.spec.lmcache_server.agent_port, retention.max_age_days, sorted(protected),
                                      remove, token=token)
        if code != 200:
            logging.getLogger("kvpersist").warning("%s/%s: the agent of %s refused the age-limit pass (HTTP %s): %s",
                                                   target.namespace, target.name, pod, code, answer.error)
            continue
        for n in answer.removed:
            removed.append({"namespaceId": n.namespace_id, "bytes": n.bytes or 0, "objects": n.objects or 0})
            kube.post_event(body, "Normal", "OrphanExpired",
                            f"removed namespace folder {n.namespace_id} from the claim of {pod}: {n.bytes or 0} bytes in "
                            f"{n.objects or 0} files, none written for over {retention.max_age_days} days "
                            "(spec.l2.orphanRetention.maxAgeDays); no live resource or server used it")
            metrics.inc("kvpersist_events_total")
    if removed:
        state.dirty = True  # the next refresh's scans show the freed space
    return removed


def _inventories(pods: list[tuple[str, str | None]], port: int, token: str | None) -> list[Inventory | None]:
    """Every agent's inventory, asked in parallel: each call is bounded (kvpersist.httpclient), so
    the round costs one deadline however many agents are slow."""
    return in_parallel(lambda pi: fetch_inventory(pi[1], port, token=token) if pi[1] else None, pods, limit=16)


AGENT_TOKEN_TTL_S = 300.0
TOKEN_REAPPLY_S = 15.0  # a missing token Secret is applied again at most this often


def _agent_token(target: Target) -> str | None:
    """The resource's agent token, from its Secret, read at most every AGENT_TOKEN_TTL_S (and again
    after a failed read). Never logged."""
    state = runtime.CONTROLLER.held((target.namespace, target.name))
    cached = state.agent_token
    now = time.monotonic()
    synced, version = secret_version(target.namespace, target.agent_token_secret)
    if synced and version is None:  # the cache has listed and there is no such Secret: nothing to read
        state.agent_token, state.agent_token_version = (now, None), None
        return None
    if cached and cached[1] and (state.agent_token_version == version if synced else now - cached[0] < AGENT_TOKEN_TTL_S):
        return cached[1]
    try:
        secret = kube.get("v1", "Secret", target.agent_token_secret, target.namespace)
    except ApiException:
        secret = None
    owner_uid = ((state.body or {}).get("metadata") or {}).get("uid")
    if secret is not None and not ownership.is_own_child(secret.get("metadata"), owner_uid):
        # Someone else's Secret under the token's name: never sent to the agents; the apply says NameTaken.
        runtime.CONTROLLER.child_owners.pop(("Secret", target.namespace, target.agent_token_secret), None)
        secret = None
    raw = kube.secret_value(secret, AGENT_TOKEN_KEY)
    token = raw.decode().strip() if raw else None
    state.agent_token = (now, token)
    state.agent_token_version = ((secret or {}).get("metadata") or {}).get("resourceVersion")
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


def _bucket_check(target: Target, secrets: _SecretOnce) -> tuple[bool, str, str] | None:
    """The hfBucket preflight, at most once per PREFLIGHT_TTL_S per resource and bucket settings,
    off the refresh path: None (unknown) until the first one for these settings has answered. A
    passing check is reused without reading the Secret again; a failing one re-reads it on every
    refresh, so a Secret created or fixed shows within one status interval."""
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
    state = runtime.CONTROLLER.held(key)
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
        over_hit = any(c.get("type") == fallback.CONDITION and c.get("reason") == judge_canary.MISMATCH
                       for c in old.get("conditions") or [])
        events.append(("Normal", "CacheRestored", f"a new namespace id ({new['namespaceId']}: the image or connectorBuild "
                       "changed): vLLM runs with the cache again, checking its build" if over_build else
                       "the namespace id's route names are free again: vLLM runs with the cache" if over_route else
                       "the hit that changed the canary's answer was acknowledged, or the namespace id changed: vLLM "
                       "runs with the cache again, and the canary checks it" if over_hit else
                       "the lmcache servers are healthy again: vLLM runs with the cache"))
    # The correctness canary (kvpersist.status.canary): a hit that changed an answer, once per
    # mismatch; output found not deterministic, once on the way in.
    old_hit = next((c for c in old.get("conditions") or [] if c.get("type") == judge_canary.CONDITION), {})
    hit = next((c for c in conds if c["type"] == judge_canary.CONDITION), None)
    if hit is not None and hit["reason"] == judge_canary.MISMATCH and (
            (old_hit.get("reason"), old_hit.get("message")) != (hit["reason"], hit["message"])):
        events.append(("Warning", judge_canary.MISMATCH, hit["message"]))
    elif hit is not None and hit["reason"] == judge_canary.NONDETERMINISTIC and old_hit.get("reason") != hit["reason"]:
        events.append(("Warning", judge_canary.NONDETERMINISTIC, hit["message"]))
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
    refused = ready is not None and ready["reason"] in (*REFUSAL_REASONS, sharing.STORAGE_IN_USE, ownership.NAME_TAKEN)
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
    # The claim nearly full (kvpersist.inventory.space), and room again: once per transition.
    old_space = next((c for c in old.get("conditions") or [] if c.get("type") == SPACE_CONDITION), {})
    space = next((c for c in conds if c["type"] == SPACE_CONDITION), None)
    if space is not None and space["status"] != old_space.get("status"):
        if space["status"] == "False":
            events.append(("Warning", space["reason"], space["message"]))
        elif old_space.get("status") == "False":
            events.append(("Normal", space["reason"], space["message"]))
    # spec.prewarm (kvpersist.status.prewarm): warm again, and a prompt the operator cannot warm (once per message).
    old_warm = next((c for c in old.get("conditions") or [] if c.get("type") == WARM_CONDITION), {})
    warm = next((c for c in conds if c["type"] == WARM_CONDITION), None)
    if warm is not None and warm["status"] == "True" and old_warm.get("status") != "True":
        events.append(("Normal", "Warmed", warm["message"]))
    elif warm is not None and warm["status"] == "False" and warm["reason"] != "Warming" and (
            (old_warm.get("reason"), old_warm.get("message")) != (warm["reason"], warm["message"])):
        events.append(("Warning", warm["reason"], warm["message"]))
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
    tracker = runtime.CONTROLLER.fallback
    tracker.seed(key, fallback.bypassed_in(body))
    change = tracker.observe(key, lmcache.get("status") == "True", time.monotonic())
    if change is not None:
        runtime.CONTROLLER.held(key).drifted = True  # the status loop applies the vLLM Deployment with (or without) the cache
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
    bypass = runtime.CONTROLLER.build_bypass
    bypass.seed(key, body)
    found = buildstatus.refusals(seen.pods, target.namespace_id)
    if bypass.observe(key, target.namespace_id, found):
        runtime.CONTROLLER.held(key).drifted = True
        logger.warning("%s/%s: a vLLM pod refused to start over its versions: rolling vLLM without the cache (%s)",
                       key[0], key[1], bypass.detail(key, target.namespace_id))
    return buildstatus.BuildVerdict(target.spec.identity.connector_build, tuple(found), bypass.detail(key, target.namespace_id))


def _build_bypassed(key: tuple[str, str], target: Target, conds: list[dict[str, Any]],
                    generation: int | None) -> list[dict[str, Any]]:
    """CacheBypassed (reason BuildMismatch) while vLLM runs without the cache over its versions:
    it says more than the servers' fallback, and lasts until the namespace id changes."""
    detail = runtime.CONTROLLER.build_bypass.detail(key, target.namespace_id)
    if detail is None:
        return conds
    return [*(c for c in conds if c["type"] != fallback.CONDITION),
            condition(fallback.CONDITION, True, buildstatus.MISMATCH, buildstatus.bypass_message(detail), generation)]


def _canary_done(key: tuple[str, str], drift: bool) -> None:
    """A canary job ended: refresh the resource (status.canary, HitCorrectness); on a HitMismatch
    also apply it (vLLM without the cache)."""
    state = runtime.CONTROLLER.held(key)
    state.dirty = True
    if drift:
        state.drifted = True


def _canary_bypassed(key: tuple[str, str], body: Mapping[str, Any], target: Target, conds: list[dict[str, Any]],
                     generation: int | None) -> list[dict[str, Any]]:
    """CacheBypassed (reason HitMismatch) while a hit that changed the canary's answer stands: it
    says more than the others, and lasts until acknowledged or the namespace id changes."""
    found = runtime.CONTROLLER.canary.standing(key, body, target.namespace_id)
    if found is None:
        return conds
    return [*(c for c in conds if c["type"] != fallback.CONDITION),
            condition(fallback.CONDITION, True, judge_canary.MISMATCH,
                      judge_canary.bypass_message(found, target.name, target.namespace), generation)]


def _protect_retained(target: Target, read: l2key.KeyRead | None, seen: Seen, logger: logging.Logger) -> None:
    """What outlives the resource, kept out of GitOps prunes (kvpersist.builders.retained): the
    generated key Secret (made before this version, or restored from a backup with its old labels)
    and the claims the StatefulSet made (they get its selector's tracking label whatever the
    template says), each patched once, metadata only; the claims also record the key fingerprint
    their data needs. A failure is logged and tried again on a later refresh. Blocking."""
    state = runtime.CONTROLLER.held((target.namespace, target.name))
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


def _model_cache_missing(target: Target, seen: Seen) -> bool:
    """Whether the claim the operator makes for the weights (spec.vllm.modelCache.size) is not in
    the claims' watch cache: deleted (no drift watch on claims: L2's change status all the time)."""
    cache = target.spec.vllm.model_cache
    if cache is None or cache.size is None:
        return False
    return not any(c["metadata"]["name"] == target.model_cache_claim for c in seen.claims)


def _servers_on_unshared_claim(target: Target, seen: Seen) -> bool:
    """spec.l2.nvme.shared on a user's claim found not ReadWriteMany after the StatefulSet was
    applied with several servers: apply again, with one (apply._one_server_unless_shareable)."""
    statefulset = seen.statefulset(target)
    if statefulset is None or int((statefulset.get("spec") or {}).get("replicas") or 0) <= 1:
        return False
    return claim_not_shareable(target)


def _shared_claim_missing(target: Target, seen: Seen) -> bool:
    """Whether the one claim the operator makes for spec.l2.nvme.shared (with size) is not in the
    claims' watch cache: deleted by hand, it is made again (empty) by the next apply, as a
    StatefulSet makes a deleted claim of its own again."""
    nvme = target.spec.l2.nvme
    if nvme is None or not nvme.shared or nvme.size is None or not target.cache_enabled:
        return False
    return not any(c["metadata"]["name"] == target.shared_claim for c in seen.claims)


def _protect_claims(claims: list[tuple[Mapping[str, Any], str]], fingerprint: str | None, logger: logging.Logger) -> None:
    """Patches each (claim, owner name) that needs it, at most once per resourceVersion. Blocking."""
    for claim, owner in claims:
        meta = claim.get("metadata") or {}
        where = (meta.get("namespace", ""), meta.get("name", ""))
        patch = protect_patch(meta, owner, fingerprint)
        if patch is None or runtime.CONTROLLER.claims_protected.get(where) == (meta.get("resourceVersion"), fingerprint):
            continue
        try:
            kube.patch_metadata("v1", "PersistentVolumeClaim", where[1], where[0], patch)
        except ApiException as exc:
            logger.warning("claim %s/%s not protected from prunes (%s); retrying", where[0], where[1], exc.status)
            continue
        runtime.CONTROLLER.claims_protected[where] = (meta.get("resourceVersion"), fingerprint)
        logger.info("claim %s/%s kept out of GitOps prunes%s", where[0], where[1],
                    f" (its data needs L2 key {fingerprint})" if fingerprint else "")


def _orphan_claims() -> list[tuple[Mapping[str, Any], str]]:
    """Claims of the operator's StatefulSets whose resource is gone (or not seen yet) and that are
    not protected from prunes yet: a claim retained from before this version. Event loop only."""
    known = runtime.CONTROLLER.known()
    out = []
    for key, store in list(runtime.CONTROLLER.indices.get("kvp_claims", {}).items()):
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
    state = runtime.CONTROLLER.held(key)
    state.dirty = False
    state.last_refresh = time.monotonic()
    old = dict(body.get("status") or {})
    generation = meta.get("generation")
    try:
        target, resolution = _target(body)
    except ValidationError as exc:  # the models refuse what the schema let in: Failed, InvalidSpec
        fields, conds = failed_status(generation, api.validation_message(exc))
        reports, inventory, shared = [], None, False
    else:
        refused = _refusal(target)
        if refused is None and state.refused is not None:
            state.drifted = True  # refused when last applied, allowed now (e.g. the Secret was labelled): apply
        secrets_usable = refused is None or refused[0] != SECRET_NOT_ALLOWED
        read, _lost = _judge_key(body, _read_key(target) if secrets_usable else None, seen.server_claims())
        target, resolution = _target(body, read.fingerprint if read is not None else None)
        pins_on = pincheck.enabled()
        if pins_on:  # off the refresh path; its end refreshes this resource again (and the verdict applies)
            runtime.CONTROLLER.pin_files.request(target.spec.identity, lambda: _mark_dirty(key))
        if read is not None and read.problem is not None and read.problem[0] == l2key.KEY_PENDING:
            state.drifted = True  # the generated key is to be made (or made again: nothing is sealed with the last one)
        if state.applied_id is not None and state.applied_id[0] != target.namespace_id:
            state.drifted = True  # the key changed, went or came back: another namespace id to apply
            if refused is None and runtime.CONTROLLER.apply_backoff.pending(key) is None and state.apply_error is None:
                return  # status follows the apply (next tick): never the new id beside the old id's servers
        _protect_retained(target, read, seen, logger)
        if (_model_cache_missing(target, seen) or _shared_claim_missing(target, seen)
                or _servers_on_unshared_claim(target, seen)) and state.name_taken is None:
            state.drifted = True  # its weights claim, or its shared L2 claim, was deleted: made again by the next apply
        resolved_id = target.namespace_id
        target = _exclusive_recheck(target, body)  # as last applied: the cache off while its store is held
        if state.routes_pending and clean_stale_routes(target, seen, logger):
            state.routes_pending = False
        observation = _observe(body, target, resolution, seen, secrets_usable=secrets_usable, key=read)
        if target.cache_enabled:
            observation.build = _build_check(key, body, target, seen, logger)
        observation.pins = pincheck.condition_of(runtime.CONTROLLER.pin_files.verdict(target.spec.identity),
                                                 target.spec.identity, pins_on)
        if target.cache_enabled:  # the correctness canary: its jobs run off this path, its verdict is read here
            observation.canary, released = runtime.CONTROLLER.canary.refresh(
                key, body, target, seen.pods, lambda drift: _canary_done(key, drift),
                allowed=refused is None and state.name_taken is None)
            if released:
                state.drifted = True  # acknowledged: vLLM is applied with the cache again
        observation.warm = _warm(key, target, seen, state)
        if old.get("namespaceId") == target.namespace_id:
            observation.budget_floor = int((old.get("budget") or {}).get("usedBytes") or 0)
            observation.budget_floor_exhausted = (old.get("budget") or {}).get("state") == "Exhausted"
        fields, conds = compute_status(observation)
        canary_record = judge_canary.field_patch(old.get("canary"), runtime.CONTROLLER.canary.record(key))
        if canary_record is not None:
            fields["canary"] = canary_record
        if target.key_secret is None:
            fields["l2Key"] = None  # not encrypted: no key (a record left from before goes)
        elif read is not None and read.fingerprint is not None and target.namespace_id is not None:
            fields["l2Key"] = {"secret": read.secret, "generated": read.generated, "fingerprint": read.fingerprint,
                               "namespaceId": target.namespace_id}
        # Otherwise the last record stays as it is: the data stored under that key needs it back.
        reports = observation.reports
        inventory = observation.inventory
        shared = target.shared
        if target.cache_enabled:
            conds = _cache_fallback(key, body, conds, generation, logger)
            conds = _build_bypassed(key, target, conds, generation)
            conds = _canary_bypassed(key, body, target, conds, generation)
        if state.storage_refused is not None and resolved_id:
            fields, conds = sharing.refused_status(fields, conds, resolved_id, state.storage_refused, generation)
        elif state.route_taken is not None and target.cache_enabled:
            conds = [*(c for c in conds if c["type"] != fallback.CONDITION),
                     condition(fallback.CONDITION, True, ROUTE_TAKEN, state.route_taken, generation)]
        error = state.apply_error
        retrying = runtime.CONTROLLER.apply_backoff.pending(key)
        if error and error[0] == generation:
            fields = {**fields, "phase": "Failed"}
            conds = [c for c in conds if c["type"] != "Ready"] + [condition("Ready", False, "ApplyFailed", error[1], generation)]
        elif retrying is not None:
            message = (f"applying the workloads failed {retrying.attempts} time(s), last: {retrying.message}; next try "
                       f"at {iso(retrying.due_wall)} (the workloads may not match the spec meanwhile)")
            fields = {**fields, "phase": "Degraded" if fields.get("phase") in ("Ready", "Degraded") else fields.get("phase")}
            conds = [c for c in conds if c["type"] != "Ready"] + [condition("Ready", False, "ApplyRetrying", message, generation)]
        taken = _taken_recheck(key)  # objects it did not make under its names: nothing applied (NameTaken)
        if refused is None and taken is None and agentroll.ROLLER.may_go(key, seen.fleet):
            state.drifted = True  # its turn for the new agent image (or scaled to zero): apply it
        shown = refused if refused is not None else taken
        if shown is not None:
            fields, conds = refused_status(fields, conds, shown, generation)
    metrics.refreshed(meta["namespace"], meta["name"], fields.get("phase"))
    hits = runtime.CONTROLLER.hits.observe(key, meta.get("uid"), old.get("hits"), reports, time.monotonic(), condition_now())
    new_status = status_patch(old, fields, conds, reports, inventory, hits, shared=shared)
    if new_status is not None:
        new_status = _write_status(meta, new_status, logger)  # raises when the API server refuses it
    # Reached only when the status now stands in the API server: the resource's series, and its
    # last-refresh time, which an alert watches for an operator that stopped refreshing it.
    metrics.observed(meta["namespace"], meta["name"], {**old, **(new_status or {})}, hits, reports)
    if new_status is None:
        return
    metrics.inc("kvpersist_status_writes_total")
    for type_, reason_, message in _events_for(old, {**old, **new_status}, conds, meta.get("annotations")):
        kube.post_event(body, type_, reason_, message)
        metrics.inc("kvpersist_events_total")
        logger.info("%s/%s %s: %s", meta["namespace"], meta["name"], reason_, message)
