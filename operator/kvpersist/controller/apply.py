"""Applying what a KVCacheNamespace becomes: the L2 key and agent token Secrets and the network
policies first, then the workloads (server-side apply, idempotent). Before an apply, a claim,
bucket prefix or route name another resource holds keeps the cache off (_exclusive), and an
object the operator did not make under one of its names keeps everything from being applied
(_names_taken; kvpersist.controller.ownership); after one, an old namespace id's Services and
policies go once no pod carries that id (clean_stale_routes).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kvpersist.api import v1alpha1 as api
from kvpersist.builders import modelcache
from kvpersist.builders.all import build_all
from kvpersist.builders.keysecret import build_agent_token_secret, build_key_secret
from kvpersist.builders.lmcache import build_shared_claim
from kvpersist.builders.target import L2_KEY_BYTES, SERVER, Target
from kvpersist.controller import agentroll, fallback, kube, l2key, metrics, ownership, retry, runtime, sharing
from kvpersist.controller.drift import _note_own_write, child_key, own_apply
from kvpersist.controller.policy import Refusal
from kvpersist.controller.reading import _judge_key, _read_key, _refusal, _target, claim_not_shareable, l2_claims
from kvpersist.controller.stale_routes import ROUTE_KINDS, ids_in_use, route_conflicts, route_taken_message, stale
from kvpersist.identity import key_fingerprint
from kvpersist.status.workloads import COMPONENT_LABEL, INSTANCE_LABEL, WATCH_SELECTOR, Seen


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
    state = runtime.CONTROLLER.held(key)
    metrics.inc("kvpersist_reconciles_total")
    runtime.CONTROLLER.fallback.seed(key, fallback.bypassed_in(body))
    runtime.CONTROLLER.build_bypass.seed(key, body)
    refused = _refusal(target)
    if refused is not None:  # nothing rendered and nothing deleted: the children stay as they are
        if state.refused != refused:
            logger.warning("%s/%s: not applied: %s", target.namespace, target.name, refused[1])
        state.refused = refused
        return True
    state.refused = None
    try:
        # An L2 claim the servers would mount that the operator did not make (ownership.claim_refusal):
        # nothing applied, as for NameTaken, and before a key is generated (no key made for nothing).
        claim_refused = ownership.claim_refusal(target, l2_claims(target))
        if claim_refused is not None:
            if state.name_taken != claim_refused:
                logger.warning("%s/%s: not applied: %s", target.namespace, target.name, claim_refused[1])
            state.name_taken, state.name_taken_retry_at = claim_refused, time.monotonic() + ownership.RETRY_S
            return True
        read, lost = _judge_key(body, _read_key(target, fresh=True), seen.server_claims() if seen is not None else None)
        key_secret = None
        if read is not None and read.absent and read.generated and lost is None:
            raw = secrets.token_bytes(L2_KEY_BYTES)  # its fingerprint names the namespace before the Secret exists
            key_secret = build_key_secret(target, key=raw)
            read = dataclasses.replace(read, fingerprint=key_fingerprint(raw), problem=None, absent=False)
            del raw
        if key_secret is not None:  # the operator's own Secrets carry secretLabel: usable under that rule
            key_secret["metadata"]["labels"].update(runtime.CONTROLLER.policy.generated_secret_labels())
        target, _reason = _target(body, read.fingerprint if read is not None else None)
        key_id = target.namespace_id  # what the spec and the key resolve to (refresh_status compares it)
        build_refused = runtime.CONTROLLER.build_bypass.detail(key, target.namespace_id) is not None
        # A cache hit changed the canary's answer: no cache for this id until acknowledged (status.canary).
        hit_mismatch = runtime.CONTROLLER.canary.standing(key, body, target.namespace_id)
        target = dataclasses.replace(target, cache_bypassed=runtime.CONTROLLER.fallback.bypassed(key) or build_refused
                                     or hit_mismatch is not None)
        if build_refused:
            target = dataclasses.replace(target, bypass_reason="a vLLM pod refused its lmcache/vLLM build")
        if hit_mismatch is not None:
            target = dataclasses.replace(target, bypass_reason=f"a cache hit changed the canary's answer (HitMismatch "
                                         f"{hit_mismatch['id']})")
        if lost is not None and read is not None and read.problem is not None:
            logger.warning("%s/%s: %s", target.namespace, target.name, read.problem[1])
        # The key as read stays cached (_read_key); only a key made here replaces it, so the next
        # refresh names the new fingerprint before the Secret watch shows it. A read judged lost is
        # never cached as such: with the Secret still absent, the cache would keep serving it, and
        # the refresh would judge it lost again even once the user accepted the loss.
        if read is not None and key_secret is not None:
            state.key_read = (time.monotonic(), read)
        # What the route lookups found under the id's route names: _names_taken does not ask again.
        looked: dict[tuple[str, str, str], dict[str, Any] | None] = {}
        target = _exclusive(target, body, logger, seen, looked)  # a store or route names another resource or id holds
        target = _one_server_unless_shareable(target)
        token_secret = build_agent_token_secret(target)  # before the agents, which read it at start
        token_secret["metadata"]["labels"].update(runtime.CONTROLLER.policy.generated_secret_labels())
        kopf.append_owner_reference(token_secret, owner=body)
        if seen is not None:  # a new agent image rolls a few servers at a time (controller.agentroll)
            target = dataclasses.replace(target, agent_image=agentroll.ROLLER.image_for(key, seen.fleet, body))
        manifests = build_all(target)
        for manifest in manifests:
            kopf.append_owner_reference(manifest, owner=body)
        # An object the operator did not make under any of these names: nothing at all is applied
        # (kvpersist.controller.ownership), and Ready says which (NameTaken).
        taken = _names_taken(body, token_secret, manifests, looked)
        if taken:
            refusal = (ownership.NAME_TAKEN, ownership.taken_message(target.name, target.namespace, taken))
            if state.name_taken != refusal:
                logger.warning("%s/%s: not applied: %s", target.namespace, target.name, refusal[1])
            state.name_taken = refusal
            state.name_taken_retry_at = time.monotonic() + ownership.RETRY_S
            return True
        state.name_taken, state.name_taken_retry_at = None, float("inf")
        token_key = child_key(token_secret)
        token_known = runtime.CONTROLLER.child_owners.get(token_key) == body["metadata"].get("uid")
        # What the server pods need before they exist: the L2 key (created once and never owned, see
        # keysecret), the agent token, and the policies that close their ports. Side by side, one
        # round trip instead of four: the StatefulSet, next, is what a user waits for.
        policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
        jobs = [runtime.CONTROLLER.apply_pool.submit(_apply_owned, m) for m in policies]
        # The token Secret is never applied over, never adopted: one a deleted namesake owned is the
        # garbage collector's, and once it is gone the next refresh finds no token and creates it
        # again. Adopting it would need `patch` on every Secret the operator can see.
        token_job = runtime.CONTROLLER.apply_pool.submit(lambda: kube.create_if_absent(token_secret))
        jobs.append(token_job)
        key_job = runtime.CONTROLLER.apply_pool.submit(lambda: kube.create_if_absent(key_secret)) if key_secret is not None else None
        if key_job is not None:
            jobs.append(key_job)
        concurrent.futures.wait(jobs)
        for job in jobs:
            job.result()  # the first failure, raised here (every job has ended)
        if token_job.result():
            runtime.CONTROLLER.child_owners[token_key] = body["metadata"].get("uid")
        elif not token_known:  # absent when looked up, someone else's now: judged on the next try
            raise RuntimeError(f"Secret {target.agent_token_secret} appeared while applying; looking at it again")
        if key_job is not None and not key_job.result():
            # Made by someone else between the read and the create: the manifests name a key it does
            # not hold. Nothing server-side was applied yet; read it and apply again.
            state.key_read = None
            raise RuntimeError(f"Secret {key_secret['metadata']['name']} appeared while applying; applying again with its key")
        key_event = None
        if key_job is not None:
            logger.info("%s/%s: generated L2 master key Secret %s (fingerprint %s)", target.namespace, target.name,
                        key_secret["metadata"]["name"], read.fingerprint if read else None)
            key_event = (f"generated Secret {key_secret['metadata']['name']} with L2's master key (fingerprint "
                         f"{read.fingerprint if read else None}); it is kept when this resource is deleted (the data needs it)")
        try:
            _shared_claim(target, body, logger)  # before the StatefulSet whose pods mount it
            for manifest in manifests:
                if manifest["kind"] == "PersistentVolumeClaim":
                    _model_cache_claim(manifest, body, logger)
                elif manifest["kind"] != "NetworkPolicy":
                    _apply_owned(manifest)
            _drop_disabled_vllm_service(target, body, logger)
        finally:
            # Once the workloads are applied (or failed): posted before them, it was one more round
            # trip between apply and the StatefulSet (benchmarks/reconcile_bench.py latency).
            if key_event is not None:
                kube.post_event(body, "Normal", l2key.KEY_GENERATED, key_event)
    except Exception as exc:  # any failure: the status loop tries again (retry.Backoff), status says why
        metrics.inc("kvpersist_apply_errors_total")
        generation = body["metadata"].get("generation")
        if isinstance(exc, ApiException) and retry.is_permanent(exc.status):
            state.apply_error = (generation, f"the API server refused an object: {_api_message(exc)}")
            runtime.CONTROLLER.apply_backoff.succeeded(key)  # not retried: only a changed spec can pass
            logger.error("apply failed: %s", state.apply_error[1])
        else:
            why = (f"HTTP {exc.status}: {_api_message(exc)}" if isinstance(exc, ApiException)
                   else f"{type(exc).__name__}: {exc}")[:1024]
            pending = runtime.CONTROLLER.apply_backoff.failed(key, generation, why, time.monotonic())
            state.drifted = True  # the status loop applies again once pending.due_at has passed
            logger.warning("%s/%s: applying the workloads failed (attempt %d: %s); trying again in %.0f s",
                           target.namespace, target.name, pending.attempts, why, retry.delay(pending.attempts))
    else:
        state.apply_error = None
        runtime.CONTROLLER.apply_backoff.succeeded(key)
        state.routes_pending = True  # an old id's Service and policy may now be stale (see clean_stale_routes)
        state.applied_id = (key_id,)
    return True


def _names_taken(body: Mapping[str, Any], token_secret: dict[str, Any], manifests: list[dict[str, Any]],
                 looked: Mapping[tuple[str, str, str], dict[str, Any] | None] | None = None) -> list[tuple[str, str]]:
    """(kind, name) of each object under the names of this apply (the agent token Secret and the
    manifests) that is not this resource's own (kvpersist.controller.ownership.is_own_child). Names
    known as its own (drift watch events, its own applies and creates) are not looked up again, so
    a steady state reads nothing; the others are, side by side, metadata only, except those this
    apply's route lookups just found (looked, by drift.child_key: metadata or None). Raises
    ApiException. Blocking."""
    uid = body["metadata"].get("uid")
    owners = runtime.CONTROLLER.child_owners
    looked = looked or {}
    unknown = [m for m in manifests if uid is None or owners.get(child_key(m)) != uid]
    if uid is None or owners.get(child_key(token_secret)) != uid:
        unknown.append(token_secret)
    lookups = []
    for manifest in unknown:  # side by side
        lookups.append(None if child_key(manifest) in looked
                       else runtime.CONTROLLER.apply_pool.submit(lambda m=manifest: _existing_metadata(m)))
    found = [looked[child_key(obj)] if job is None else job.result() for obj, job in zip(unknown, lookups, strict=True)]
    taken = []
    for manifest, meta in zip(unknown, found, strict=True):
        if meta is None:
            continue  # free: the apply creates it
        if ownership.is_own_child(meta, uid):
            owners[child_key(manifest)] = uid
        else:
            taken.append((manifest["kind"], manifest["metadata"]["name"]))
    return taken


def _drop_disabled_vllm_service(target: Target, body: Mapping[str, Any], logger: logging.Logger) -> None:
    """spec.vllm.service turned off: its Service goes, if it is this resource's own (known to be, from
    the drift watch or an apply of this run: a user's Service under the name is never touched). No
    read when off and never made, the steady state. Raises ApiException."""
    if target.spec.vllm.service.enabled:
        return
    key = ("Service", target.namespace, target.vllm_name)
    uid = body["metadata"].get("uid")
    if uid is None or runtime.CONTROLLER.child_owners.get(key) != uid:
        return
    kube.delete("v1", "Service", target.vllm_name, target.namespace)
    runtime.CONTROLLER.child_owners.pop(key, None)
    logger.info("%s/%s: deleted Service %s: spec.vllm.service is off", target.namespace, target.name, target.vllm_name)


def _one_server_unless_shareable(target: Target) -> Target:
    """spec.l2.nvme.shared on the user's claim: one server while the claim is known not to be
    ReadWriteMany (L2Ready says ClaimNotShared: reading.claim_not_shareable). Blocking."""
    return dataclasses.replace(target, max_servers=1) if claim_not_shareable(target) else target


def _shared_claim(target: Target, body: Mapping[str, Any], logger: logging.Logger) -> None:
    """spec.l2.nvme.shared with size: the one ReadWriteMany claim, created when absent and never
    applied over (kvpersist.builders.lmcache.build_shared_claim). Owned by the resource only with
    reclaimPolicy Delete, so the garbage collector removes it with the resource; with Retain it
    outlives it, as a StatefulSet's claims do (the policy is fixed while shared: api NVMe).
    Skipped with the cache off (its servers at zero, like a StatefulSet that makes no claim)."""
    manifest = build_shared_claim(target)
    if manifest is None or not target.cache_enabled:
        return
    assert target.spec.l2.nvme is not None
    if target.spec.l2.nvme.reclaim_policy == "Delete":
        kopf.append_owner_reference(manifest, owner=body)
    if kube.create_if_absent(manifest):
        logger.info("%s/%s: created the shared L2 claim %s (ReadWriteMany, %s)", target.namespace, target.name,
                    manifest["metadata"]["name"], target.spec.l2.nvme.size)


MODEL_CACHE_DIFFERS = "ModelCacheDiffers"  # the Warning event's reason: the claim is kept as it was made


def _model_cache_claim(manifest: dict[str, Any], body: Mapping[str, Any], logger: logging.Logger) -> None:
    """spec.vllm.modelCache.size: its claim created when absent, never applied over (a claim's spec
    is mostly immutable; a larger size only where the StorageClass expands: refused otherwise,
    which would stop every apply). An existing one is this resource's own (_names_taken looked);
    what the spec declares that it does not have is a Warning event, once per difference. Raises
    (the apply is retried) when a claim appears between the look and the create. Blocking."""
    meta, key, uid = manifest["metadata"], child_key(manifest), body["metadata"].get("uid")
    state = runtime.CONTROLLER.held((meta["namespace"], body["metadata"]["name"]))
    owners = runtime.CONTROLLER.child_owners
    existing = kube.get("v1", "PersistentVolumeClaim", meta["name"], meta["namespace"]) if owners.get(key) == uid else None
    if existing is None or not ownership.is_own_child(existing.get("metadata"), uid):
        owners.pop(key, None)  # gone (or not its own after all): looked up again if the create finds one
        if not kube.create_if_absent(manifest):
            raise RuntimeError(f"PersistentVolumeClaim {meta['name']} appeared while applying; looking at it again")
        owners[key] = uid
        state.model_cache_differs = None
        logger.info("%s/%s: created PersistentVolumeClaim %s for the model's weights", meta["namespace"],
                    body["metadata"]["name"], meta["name"])
        return
    differs = "; ".join(modelcache.claim_differences(manifest, existing)) or None
    if differs is not None and differs != state.model_cache_differs:
        message = (f"PersistentVolumeClaim {meta['name']} is kept as it was made: {differs}. A claim's spec is not "
                   "changed in place; to have it made anew (the weights are downloaded again): set spec.vllm.replicas to "
                   "0, delete the claim, then set the replicas back")
        logger.warning("%s/%s: %s", meta["namespace"], body["metadata"]["name"], message)
        kube.post_event(body, "Warning", MODEL_CACHE_DIFFERS, message)
    state.model_cache_differs = differs


def _existing_metadata(manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """The metadata of what holds a manifest's name now, or None: a Secret by GET (metadata only,
    never its data), any other kind by a LIST of that name (what the operator may do on them)."""
    meta = manifest["metadata"]
    if manifest["kind"] == "Secret":
        return kube.get_metadata("v1", "Secret", meta["name"], meta["namespace"])
    return kube.named_metadata(manifest["apiVersion"], manifest["kind"], meta["name"], meta["namespace"])


def _taken_recheck(key: tuple[str, str]) -> Refusal | None:
    """In a status refresh: NameTaken's (reason, message) while objects the operator did not make
    hold its names, and an apply (which looks them up again) once ownership.RETRY_S has passed:
    their holders carry none of the labels the drift watch selects, so nothing else says they went.
    Any other reason to apply meanwhile (a key still to make, a token missing: nothing was made)
    waits for the same moment (status_loop.may_apply), so a taken name costs no reads per tick."""
    state = runtime.CONTROLLER.held(key)
    if state.name_taken is not None and time.monotonic() >= state.name_taken_retry_at:
        state.drifted = True
    return state.name_taken


def _apply_owned(manifest: dict[str, Any]) -> None:
    with own_apply(manifest):
        applied = kube.apply(manifest)
        _note_own_write(applied)
    metrics.inc("kvpersist_applies_total")


def clean_stale_routes(target: Target, seen: Seen, logger: logging.Logger) -> bool:
    """Deletes the per-id Services and ZMQ policies of ids no pod of the resource carries any
    more; True once no pod of another id is left to wait for. Blocking: a worker thread."""
    in_use = ids_in_use([*seen.pods, *seen.untrusted_pods])  # a route outlives every pod that may use it
    selector = f"{INSTANCE_LABEL}={target.name},{COMPONENT_LABEL}={SERVER}"
    uid = ((runtime.CONTROLLER.held((target.namespace, target.name)).body or {}).get("metadata") or {}).get("uid")
    try:
        for api_version, kind in ROUTE_KINDS:
            # Only its own (a controller reference to it): labels alone are anyone's to copy.
            own = [o for o in kube.list_all(api_version, kind, target.namespace, selector)
                   if ownership.is_own_child(o.get("metadata"), uid)]
            for name in stale(target, own, in_use):
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


def _storage_refusal(target: Target, body: Mapping[str, Any], seen: Seen | None) -> str | None:
    """StorageInUse's message when another resource holds this one's claim or bucket prefix
    (kvpersist.controller.sharing), else None. From the watch caches (seen.stores: the kvp_stores
    index, complete before any handler runs); without them (seen None or not copied), from the
    API server (raises ApiException). Blocking."""
    me = _store_user(target, body)
    nvme = target.spec.l2.nvme is not None
    if not nvme and not target.namespace_id:
        return None
    if seen is not None and seen.stores is not None:
        # claims are namespaced: that namespace's resources and servers; a bucket prefix is global
        users = [u for u in seen.stores if not nvme or u.namespace == target.namespace]
        pods = [p for p in seen.all_server_pods if p["metadata"].get("namespace") == target.namespace] if nvme else []
        return sharing.refusal(me, users, pods)
    if nvme:
        bodies = kube.list_all(api.API_VERSION, api.KIND, target.namespace)
        pods = kube.list_all("v1", "Pod", target.namespace, f"{WATCH_SELECTOR},{COMPONENT_LABEL}={SERVER}")
    else:
        bodies = [b for ns in runtime.listing_scopes() for b in kube.list_all(api.API_VERSION, api.KIND, ns)]
        pods = []
    return sharing.refusal(me, [u for b in bodies if (u := sharing.user_of(b)) is not None], pods)


def _route_conflicts(target: Target, looked: dict[tuple[str, str, str], dict[str, Any] | None] | None = None) -> list[str]:
    """The objects already under this id's route names that route elsewhere (stale_routes
    .route_conflicts): a LIST by name of each kind (list is what the operator may do on them),
    side by side (one after the other, they were two round trips before the StatefulSet).
    looked: what each found, recorded by drift.child_key (its metadata, or None), for
    _names_taken. Not from an apply_pool job (it waits on that pool). Raises ApiException. Blocking."""
    name = target.per_id_name(target.namespace_id)
    jobs = [(kind, runtime.CONTROLLER.apply_pool.submit(
        lambda api_version=api_version, kind=kind: kube.list_all(api_version, kind, target.namespace,
                                                                 field_selector=f"metadata.name={name}")))
        for api_version, kind in ROUTE_KINDS]
    found = [(listed, obj) for listed, job in jobs for obj in job.result()]
    if looked is not None:
        for listed, _job in jobs:
            same = [obj for k, obj in found if k == listed and (obj.get("metadata") or {}).get("name") == name]
            looked[listed, target.namespace, name] = dict(same[0].get("metadata") or {}) if same else None
    return route_conflicts(target, found)


def _exclusive(target: Target, body: Mapping[str, Any], logger: logging.Logger, seen: Seen | None = None,
               looked: dict[tuple[str, str, str], dict[str, Any] | None] | None = None) -> Target:
    """Before an apply: the target as it may run alone. A claim or bucket prefix an older resource
    holds: the cache off (servers at zero, vLLM without it; StorageInUse). Route names another
    id's objects hold: no routes, vLLM without the cache (CacheBypassed, RouteNameTaken). Both
    recorded in the resource's state for status; what the route lookups found into looked
    (_route_conflicts). Raises ApiException (the apply is retried)."""
    state = runtime.CONTROLLER.held((target.namespace, target.name))
    storage = _storage_refusal(target, body, seen) if target.cache_enabled else None
    if storage != state.storage_refused and (storage or state.storage_refused):
        logger.warning("%s/%s: %s", target.namespace, target.name, storage or "its L2 store is free again: the cache is on")
    state.storage_refused = storage
    if storage is not None:
        return dataclasses.replace(target, namespace_id=None)
    conflicts = _route_conflicts(target, looked) if target.cache_enabled else []
    taken = route_taken_message(target, conflicts) if conflicts else None
    if taken != state.route_taken and taken:
        logger.warning("%s/%s: %s", target.namespace, target.name, taken)
    state.route_taken = taken
    if taken is not None:
        return dataclasses.replace(target, routes=False, cache_bypassed=True,
                                   bypass_reason=f"route name {target.per_id_name(target.namespace_id)} is taken")
    return target


def _exclusive_recheck(target: Target, body: Mapping[str, Any], seen: Seen | None = None) -> Target:
    """In a status refresh: applies again when what _exclusive decided may have changed (the
    holder went, or an older resource now names the same store, or the route names are free),
    and returns the target as last applied. From the watch caches the status loop hands over
    (seen.stores), looked at again only once a store changed, so an idle refresh makes no request
    and no walk of the others."""
    state = runtime.CONTROLLER.held((target.namespace, target.name))
    if not target.cache_enabled:
        return target
    try:
        if state.storage_refused is not None:
            changed = _storage_refusal(target, body, seen) != state.storage_refused
        else:
            me = _store_user(target, body)
            mark = (seen.stores_version, me) if seen is not None and seen.stores is not None else None
            if mark is not None and state.stores_checked == mark:
                held = False  # neither its store nor any other changed since it was last looked at
            else:
                known = seen.stores if mark is not None else [
                    u for st in runtime.CONTROLLER.known().values() if st.body is not None and (u := sharing.user_of(st.body))]
                held = sharing.holder(me, known) is not None
                state.stores_checked = None if held else mark
            changed = held or (state.route_taken is not None and not _route_conflicts(target))
        if changed:
            state.drifted = True
    except ApiException:
        pass  # asked again on the next refresh
    if state.storage_refused is not None:
        return dataclasses.replace(target, namespace_id=None)
    if state.route_taken is not None:
        return dataclasses.replace(target, routes=False, cache_bypassed=True)
    return target


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body).get("message", str(exc))
    except (TypeError, ValueError):
        return str(exc.reason)
