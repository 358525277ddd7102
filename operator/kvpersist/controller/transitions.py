"""A status refresh's transitions: the Events a user cares about, and whether vLLM runs without the
cache (CacheBypassed: the servers unavailable, a pod refusing its build, a hit that changed the
canary's answer), each decision marking the resource for an apply when it changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from kvpersist.builders.target import Target
from kvpersist.controller import fallback, l2key, ownership, runtime, sharing
from kvpersist.controller.policy import REASONS as REFUSAL_REASONS
from kvpersist.controller.stale_routes import ROUTE_TAKEN
from kvpersist.status import build as buildstatus
from kvpersist.status import canary as judge_canary
from kvpersist.status import keymismatch, references
from kvpersist.status.conditions import SPACE_CONDITION, WARM_CONDITION, condition
from kvpersist.status.workloads import Seen


def events_for(old: dict[str, Any], new: dict[str, Any], conds: list[dict[str, Any]],
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
    # A server refusing the key file it mounts (kvpersist.status.keymismatch): once per mismatch.
    old_l2 = next((c for c in old.get("conditions") or [] if c.get("type") == "L2Ready"), {})
    l2 = next((c for c in conds if c["type"] == "L2Ready"), None)
    if l2 is not None and l2["reason"] == keymismatch.KEY_MISMATCH and (
            old_l2.get("reason") != l2["reason"] or keymismatch.event_key(old_l2.get("message")) != keymismatch.event_key(
                l2["message"])):
        events.append(("Warning", keymismatch.KEY_MISMATCH, l2["message"]))
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
    refused = ready is not None and ready["reason"] in (*REFUSAL_REASONS, sharing.STORAGE_IN_USE, ownership.NAME_TAKEN,
                                                        ownership.CLAIM_NOT_OWNED)
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
    # A Secret or ConfigMap the spec names that does not exist (kvpersist.status.references): once per
    # message, and once when all exist again.
    old_refs = next((c for c in old.get("conditions") or [] if c.get("type") == references.CONDITION), {})
    refs = next((c for c in conds if c["type"] == references.CONDITION), None)
    if refs is not None and refs["status"] == "False" and (
            (old_refs.get("reason"), old_refs.get("message")) != (refs["reason"], refs["message"])):
        events.append(("Warning", refs["reason"], refs["message"]))
    elif refs is not None and refs["status"] == "True" and old_refs.get("status") == "False":
        events.append(("Normal", refs["reason"], refs["message"]))
    old_budget, new_budget = (old.get("budget") or {}).get("state"), (new.get("budget") or {}).get("state")
    if new_budget != old_budget and new_budget is not None:
        cond = next((c for c in conds if c["type"] == "WithinBudget"), None)
        if new_budget == "Exhausted":
            events.append(("Warning", "BudgetExhausted", cond["message"] if cond else "L2 budget exhausted"))
        elif old_budget == "Exhausted":
            events.append(("Normal", "BudgetAvailable", cond["message"] if cond else "L2 budget has room again"))
    return events



def cache_fallback(key: tuple[str, str], body: Mapping[str, Any], conds: list[dict[str, Any]], generation: int | None,
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


def build_check(key: tuple[str, str], body: Mapping[str, Any], target: Target, seen: Seen,
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


def build_bypassed(key: tuple[str, str], target: Target, conds: list[dict[str, Any]],
                   generation: int | None) -> list[dict[str, Any]]:
    """CacheBypassed (reason BuildMismatch) while vLLM runs without the cache over its versions:
    it says more than the servers' fallback, and lasts until the namespace id changes."""
    detail = runtime.CONTROLLER.build_bypass.detail(key, target.namespace_id)
    if detail is None:
        return conds
    return [*(c for c in conds if c["type"] != fallback.CONDITION),
            condition(fallback.CONDITION, True, buildstatus.MISMATCH, buildstatus.bypass_message(detail), generation)]


def canary_done(key: tuple[str, str], drift: bool) -> None:
    """A canary job ended: refresh the resource (status.canary, HitCorrectness); on a HitMismatch
    also apply it (vLLM without the cache)."""
    state = runtime.CONTROLLER.held(key)
    state.dirty = True
    if drift:
        state.drifted = True


def canary_bypassed(key: tuple[str, str], body: Mapping[str, Any], target: Target, conds: list[dict[str, Any]],
                    generation: int | None) -> list[dict[str, Any]]:
    """CacheBypassed (reason HitMismatch) while a hit that changed the canary's answer stands: it
    says more than the others, and lasts until acknowledged or the namespace id changes."""
    found = runtime.CONTROLLER.canary.standing(key, body, target.namespace_id)
    if found is None:
        return conds
    return [*(c for c in conds if c["type"] != fallback.CONDITION),
            condition(fallback.CONDITION, True, judge_canary.MISMATCH,
                      judge_canary.bypass_message(found, target.name, target.namespace), generation)]

