"""One resource's status refresh, the round itself: observe its workloads, agents and L2, judge it
(kvpersist.status.conditions), write status only when something a user can see changed, and post
the Events of its transitions (docs/design.md names the modules of its parts). Blocking: worker threads.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kvpersist.api import v1alpha1 as api
from kvpersist.api.status import checked_patch, field_patch, merge_patch
from kvpersist.builders.target import VLLM, Target
from kvpersist.builders.vllm import attach_status, attached
from kvpersist.controller import (
    agentroll,
    agents,
    kube,
    l2key,
    metrics,
    pincheck,
    prewarm,
    retention,
    runtime,
    sharing,
    transitions,
)
from kvpersist.controller.apply import clean_stale_routes, taken_recheck
from kvpersist.controller.decision import Decision, Snapshot, decide, policy_refusal
from kvpersist.controller.l2runtime import OBSERVE
from kvpersist.controller.policy import SECRET_NOT_ALLOWED, refused_status
from kvpersist.controller.reading import (
    hub_token,
    named_secret_refusal,
    parsed_model,
    read_key,
    references_found,
    target_of,
)
from kvpersist.controller.snapshot import policy_read, refreshed
from kvpersist.controller.stale_routes import ROUTE_TAKEN
from kvpersist.identity import Resolution
from kvpersist.inventory.volume import iso, served_of
from kvpersist.l2backends import backend_of
from kvpersist.status import keymismatch
from kvpersist.status.conditions import (
    Observation,
    budget_floor,
    compute_status,
    condition,
    failed_create,
    failed_status,
    pods_missing,
    status_patch,
)
from kvpersist.status.conditions import now as condition_now
from kvpersist.status.usage import collect_usage
from kvpersist.status.workloads import Seen, attached_counts


def _observe(body: Mapping[str, Any], target: Target, resolution: Resolution, seen: Seen, token: str | None,
             secrets_usable: bool, key: l2key.KeyRead | None, max_servers: int | None) -> Observation:
    """Workload objects come from the watch caches (seen); the store is its backend's to observe
    (controller.l2runtime). secrets_usable False: the Secrets the user named are refused (policy),
    so neither is read. key: the L2 key as judged; max_servers: as decided (ClaimNotShared: one)."""
    ns = target.namespace
    spec = target.spec
    pods = seen.server_pods()
    running = seen.running_servers()
    server_desired = min(spec.lmcache_server.replicas, max_servers or spec.lmcache_server.replicas) if target.cache_enabled else 0
    reports = collect_usage(running, spec.lmcache_server.agent_port, token=token) if target.cache_enabled else []
    now = time.monotonic()
    state = runtime.CONTROLLER.held((target.namespace, target.name))
    if target.cache_enabled and token is None and now - state.token_missing_at > agents.TOKEN_REAPPLY_S:
        state.token_missing_at = now  # its Secret is gone (or was a deleted namesake's): make it again
        state.drifted = True
    failing = [r.pod for r in reports if state.write_failures.failing(f"{ns}/{r.pod}", r.l2_writes_failed, now)]
    store = OBSERVE[backend_of(spec.l2).field](body, target, seen, running, token, secrets_usable)
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
    refusing_key = keymismatch.refusals(pods)  # servers of any namespace id of this resource: an old one restarted
    return Observation(
        key_problem=key_problem,
        key_mismatch=(keymismatch.condition_message(refusing_key, target.key_secret, target.key_secret_generated)
                      if refusing_key else None),
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
        shared=target.shared,
        writes_failing=failing,
        reports=reports,
        **store,
    )


def _mark_dirty(key: tuple[str, str], drift: bool = False) -> None:
    """Refresh the resource next tick; drift: apply it too (a canary's HitMismatch: vLLM without the cache)."""
    state = runtime.CONTROLLER.held(key)
    state.dirty = True
    if drift:
        state.drifted = True


def _redecide(state: Any, policy: Snapshot, key: l2key.KeyRead | None, seen: Seen) -> Decision:
    """decide on the last apply's snapshot as the watch caches show it now (snapshot.refreshed);
    an idle round, whose snapshot is the last round's, reuses that decision. Blocking (the route
    names' LIST while another id holds one)."""
    snap = refreshed(state.applied[0] if state.applied is not None else policy, policy, key, seen)
    if state.redecided is not None and state.redecided[0] == snap:
        return state.redecided[1]
    decision = decide(snap).kept()
    state.redecided = (snap, decision)
    return decision


def write_status(meta: Mapping[str, Any], patch: Mapping[str, Any], logger: logging.Logger) -> dict[str, Any] | None:
    """Every status write of the operator, checked against the status models first (checked_patch): the API
    server would prune a key the CRD lacks without a word. What was sent, or None. Blocking."""
    sent = checked_patch(patch, logger, f"{meta['namespace']}/{meta['name']}")
    if sent is not None:
        kube.patch_status(api.API_VERSION, api.KIND, meta["name"], meta["namespace"], sent)
    return sent


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
        target, resolution = target_of(body)
    except ValidationError as exc:  # the models refuse what the schema let in: Failed, InvalidSpec
        fields, conds = failed_status(generation, api.validation_message(exc))
        reports, inventory, shared, volume, floor = [], None, False, None, 0
    else:
        policy = policy_read(body, target.spec)
        refused = policy_refusal(policy)  # decide's first rule: a Secret it refuses is not read
        secrets_usable = refused is None or refused[0] != SECRET_NOT_ALLOWED
        decision = _redecide(state, policy, read_key(target) if secrets_usable else None, seen)
        read = decision.key
        target, resolution = target_of(body, read.fingerprint if read is not None else None)
        pins_on = pincheck.enabled()
        declared = parsed_model(meta["name"], body.get("spec")).spec
        if pins_on:  # off the refresh path; its end refreshes this resource again (and the verdict applies)
            runtime.CONTROLLER.pin_files.request(declared.identity, lambda: _mark_dirty(key),
                                                 hub_token(declared, key[0]) if secrets_usable else None)
        last, applied = state.applied or (None, None)
        if (applied is not None and applied.applied_view() != decision.applied_view()
                and last.body["metadata"].get("generation") == generation):  # a new one: its own apply is on its way
            state.drifted = True  # the same decide on what is seen now differs from the applied decision: apply
            if (applied.key_id != decision.key_id and refused is None and state.apply_error is None
                    and runtime.CONTROLLER.apply_backoff.pending(key) is None):
                return  # status follows the apply (next tick): never the new id beside the old id's servers
        retention.protect_retained(target, read, seen, logger)
        if retention.made_claim_missing(target, seen) and state.name_taken is None:
            state.drifted = True  # its weights claim, or its shared L2 claim, was deleted: made again by the next apply
        resolved_id = target.namespace_id
        if target.cache_enabled and state.storage_refused is not None:  # as last applied: the cache off
            target = dataclasses.replace(target, namespace_id=None)
        elif target.cache_enabled and state.route_taken is not None:
            target = dataclasses.replace(target, routes=False, cache_bypassed=True)
        if state.routes_pending and clean_stale_routes(target, seen, logger):
            state.routes_pending = False
        token = agents.agent_token(target) if target.cache_enabled else None  # read once for the round
        observation = _observe(body, target, resolution, seen, token, secrets_usable=secrets_usable, key=read,
                               max_servers=decision.target.max_servers)
        observation.pins = runtime.CONTROLLER.pin_files.verdict(declared.identity, pincheck.scope_of(declared, key[0]),
                                                                pins_on)
        if target.cache_enabled:  # the build check, and the correctness canary (its jobs run off this path, its verdict here)
            observation.build = transitions.build_check(key, body, target, seen, logger)
            observation.canary, released = runtime.CONTROLLER.canary.refresh(
                key, body, target, seen.pods, lambda drift: _mark_dirty(key, drift),
                allowed=refused is None and state.name_taken is None, agent_token=token)
            if released:
                _mark_dirty(key)  # acknowledged: the next round decides vLLM with the cache again
        if target.spec.prewarm is None:
            runtime.CONTROLLER.prewarm.forget(key)
        else:  # Warm, its due passes started off this path; vLLM without the cache (as decided) warms nothing
            observation.warm = runtime.CONTROLLER.prewarm.observe(
                key, dataclasses.replace(target, cache_bypassed=decision.target.cache_bypassed), seen.pods, token,
                lambda: prewarm.read_api_key(target, named_secret_refusal),
                lambda: _mark_dirty(key))
        observation.references = references_found(target)  # ReferencesFound: the named objects exist
        observation.creator_rights = runtime.CONTROLLER.creator_rights  # CreatorRightsEnforced (admissioncheck)
        if old.get("namespaceId") == target.namespace_id and observation.budget_bytes is not None:
            observation.budget_floor = int((old.get("usage") or {}).get("l2UsedBytes") or 0)
            observation.budget_floor_exhausted = (old.get("budget") or {}).get("state") == "Exhausted"
        attach = None  # None removes it: pods labelled for this resource are then refused
        if attached(target):
            bypass = decision.target  # why new pods go without the cache, as the operator's own vLLM does
            attach = attach_status(target, f"{bypass.bypass_reason}; see the CacheBypassed condition"
                                   if bypass.cache_bypassed else None)
            count, ready = attached_counts(seen.pods, target.namespace_id)
            observation.attached, observation.unadmitted = (count, ready, target.name), seen.unadmitted_pods
            if attach is not None:
                attach.update(pods=count, readyPods=ready)
        fields, conds = compute_status(observation)
        fields["attach"] = merge_patch(old.get("attach"), attach) if attach is not None else None
        shown = pincheck.status_of(declared.identity, target.spec.identity,  # the pins as target_of filled them
                                   runtime.CONTROLLER.pin_files.facts(declared, key[0], old, pins_on))
        for name, record in (("identity", shown), ("canary", runtime.CONTROLLER.canary.record(key))):
            patch = field_patch(old.get(name), record)
            if patch is not None:
                fields[name] = patch
        if target.key_secret is None:
            fields["l2Key"] = None  # not encrypted: no key (a record left from before goes)
        elif read is not None and read.fingerprint is not None and target.namespace_id is not None:
            fields["l2Key"] = {"secret": read.secret, "generated": read.generated, "fingerprint": read.fingerprint,
                               "namespaceId": target.namespace_id}
            # Every namespace sealed with a key, not only the one served now: a lost key makes them all unreadable.
            fields["sealedNamespaces"] = l2key.sealed_after(old, l2key.recorded(old), fields["l2Key"])
        # Otherwise the last record stays as it is: the data stored under that key needs it back.
        reports = observation.reports
        inventory = observation.inventory
        shared = target.shared
        # The served namespace on the volume: this round's inventory, else the last one written.
        volume = served_of(inventory if inventory is not None else (
            old.get("inventory") if old.get("namespaceId") == target.namespace_id else None), target.namespace_id)
        floor = budget_floor(observation)
        if target.cache_enabled:
            conds = transitions.cache_fallback(key, body, conds, generation, logger)
            conds = transitions.bypassed(key, body, target, conds, generation)
        if state.storage_refused is not None and resolved_id:
            fields, conds = sharing.refused_status(fields, conds, resolved_id, state.storage_refused, generation)
        elif state.route_taken is not None and target.cache_enabled:
            conds = transitions.bypassed_for(conds, ROUTE_TAKEN, state.route_taken, generation)
        error = state.apply_error
        retrying = runtime.CONTROLLER.apply_backoff.pending(key)
        if error and error[0] == generation:  # the API server refused an object: Failed as for the policy's refusals
            fields, conds = refused_status(fields, conds, ("ApplyFailed", error[1]), generation)
        elif retrying is not None:
            message = (f"applying the workloads failed {retrying.attempts} time(s), last: {retrying.message}; next try "
                       f"at {iso(retrying.due_wall)} (the workloads may not match the spec meanwhile)")
            fields = {**fields, "phase": "Degraded" if fields.get("phase") in ("Ready", "Degraded") else fields.get("phase")}
            conds = [c for c in conds if c["type"] != "Ready"] + [condition("Ready", False, "ApplyRetrying", message, generation)]
        taken = taken_recheck(key)  # objects it did not make under its names: nothing applied (NameTaken)
        if refused is None and taken is None and agentroll.ROLLER.may_go(key, seen.fleet):
            state.drifted = True  # its turn for the new agent image (or scaled to zero): apply it
        shown = refused if refused is not None else taken
        if shown is not None:
            fields, conds = refused_status(fields, conds, shown, generation)
            fields = {**fields, "attach": None}  # nothing applied: no server to attach new pods to
    metrics.refreshed(meta["namespace"], meta["name"], fields.get("phase"))
    hits = runtime.CONTROLLER.hits.observe(key, meta.get("uid"), old.get("hits"), reports, time.monotonic(), condition_now())
    new_status = status_patch(old, fields, conds, reports, inventory, hits, shared=shared, volume=volume, floor=floor)
    if new_status is not None:
        new_status = write_status(meta, new_status, logger)  # raises when the API server refuses it
    # Reached only when the status now stands in the API server: the resource's series, and its
    # last-refresh time, which an alert watches for an operator that stopped refreshing it.
    metrics.observed(meta["namespace"], meta["name"], {**old, **(new_status or {})}, hits, reports)
    if new_status is None:
        return
    metrics.inc("kvpersist_status_writes_total")
    for type_, reason_, message in transitions.events_for(old, {**old, **new_status}, conds, meta.get("annotations")):
        kube.post_event(body, type_, reason_, message)
        metrics.inc("kvpersist_events_total")
        logger.info("%s/%s %s: %s", meta["namespace"], meta["name"], reason_, message)
