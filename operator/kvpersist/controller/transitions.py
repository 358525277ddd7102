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


def _of(conds: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((c for c in conds if c.get("type") == kind), None)


def _news(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether a condition says something new: events go once per distinct reason and message."""
    return (old.get("reason"), old.get("message")) != (new["reason"], new["message"])


def _failing(old: Mapping[str, Any], new: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """A Warning per distinct failure of a True/False condition, and a Normal once it holds again."""
    if new is not None and new["status"] == "False" and _news(old, new):
        return [("Warning", new["reason"], new["message"])]
    if new is not None and new["status"] == "True" and old.get("status") == "False":
        return [("Normal", new["reason"], new["message"])]
    return []


def events_for(old: dict[str, Any], new: dict[str, Any], conds: list[dict[str, Any]],
               annotations: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """The transitions a user cares about, as (type, reason, message)."""
    was = old.get("conditions") or []

    def pair(kind: str) -> tuple[dict[str, Any], dict[str, Any] | None]:  # before ({} for none), now (None for none)
        return _of(was, kind) or {}, _of(conds, kind)

    events = []
    old_id, new_id = old.get("namespaceId"), new.get("namespaceId")
    if new_id and old_id and new_id != old_id:  # the first id is in status alone: no Event for every new resource
        events.append(("Normal", "NamespaceResolved", f"identity pins resolve to {new_id} (was {old_id}; its data "
                       "is kept, unreachable from these pins)"))
    # Another L2 key: another namespace, the old one's data unreadable with it (kvpersist.controller.l2key).
    events += l2key.events(old, new, annotations)
    # The key cannot be used (lost, missing, too short, ...): the cache is off; said once per distinct message.
    old_ident, ident = pair("IdentityResolved")
    key_off = ident is not None and ident["status"] == "False" and ident["reason"] in l2key.KEY_REASONS
    if key_off and ident["reason"] != l2key.KEY_PENDING and _news(old_ident, ident):
        events.append(("Warning", ident["reason"], ident["message"]))
    old_bypass, bypass = pair(fallback.CONDITION)
    if bypass is not None and not old_bypass:
        events.append(("Warning", fallback.CONDITION, bypass["message"]))
    elif bypass is None and old_bypass and new.get("namespaceId"):
        over = old_bypass.get("reason")
        events.append(("Normal", "CacheRestored", f"a new namespace id ({new['namespaceId']}: the image or connectorBuild "
                       "changed): vLLM runs with the cache again, checking its build" if over == buildstatus.MISMATCH else
                       "the namespace id's route names are free again: vLLM runs with the cache" if over == ROUTE_TAKEN else
                       "the hit that changed the canary's answer was acknowledged, or the namespace id changed: vLLM "
                       "runs with the cache again, and the canary checks it" if over == judge_canary.MISMATCH else
                       "the lmcache servers are healthy again: vLLM runs with the cache"))
    # A server refusing the key file it mounts (kvpersist.status.keymismatch): once per mismatch.
    old_l2, l2 = pair("L2Ready")
    if l2 is not None and l2["reason"] == keymismatch.KEY_MISMATCH and (
            old_l2.get("reason") != l2["reason"] or keymismatch.event_key(old_l2.get("message")) != keymismatch.event_key(
                l2["message"])):
        events.append(("Warning", l2["reason"], l2["message"]))
    # The correctness canary (kvpersist.status.canary): a hit that changed an answer, once per
    # mismatch; output found not deterministic, once on the way in.
    old_hit, hit = pair(judge_canary.CONDITION)
    if hit is not None and ((hit["reason"] == judge_canary.MISMATCH and _news(old_hit, hit)) or (
            hit["reason"] == judge_canary.NONDETERMINISTIC and old_hit.get("reason") != hit["reason"])):
        events.append(("Warning", hit["reason"], hit["message"]))
    # The pods' build check (kvpersist.status.build): once per distinct mismatch, and when it is over.
    events += _failing(*pair(buildstatus.CONDITION))
    phase = new.get("phase")
    # Refused by the operator's policy (ImageNotAllowed, SecretNotAllowed): a Warning of that reason
    # whenever the refusal is new or says something new, in place of the generic Failed one.
    # So is a store another resource holds (StorageInUse: kvpersist.controller.sharing), and its end.
    old_ready, ready = pair("Ready")
    refused = ready is not None and ready["reason"] in (*REFUSAL_REASONS, sharing.STORAGE_IN_USE, ownership.NAME_TAKEN,
                                                        ownership.CLAIM_NOT_OWNED)
    if refused and _news(old_ready, ready):
        events.append(("Warning", ready["reason"], ready["message"]))
    elif old_ready.get("reason") == sharing.STORAGE_IN_USE and ready is not None and ready["reason"] != sharing.STORAGE_IN_USE:
        events.append(("Normal", sharing.RELEASED, "the L2 store is no longer held by another resource: the lmcache "
                       "servers start on it"))
    if phase and phase != old.get("phase"):
        detail = ready["message"] if ready else ""
        if phase == "CacheDisabled" and not key_off and not refused:
            events.append(("Warning", ident["reason"], ident["message"]))
        elif phase in ("Degraded", "Failed") and not refused:
            events.append(("Warning", phase, detail))
        elif phase == "Ready":
            events.append(("Normal", "Ready", detail))
    # The claim nearly full (kvpersist.inventory.space), and room again: once per transition.
    old_space, space = pair(SPACE_CONDITION)
    if space is not None and space["status"] != old_space.get("status"):
        if space["status"] == "False":
            events.append(("Warning", space["reason"], space["message"]))
        elif old_space.get("status") == "False":
            events.append(("Normal", space["reason"], space["message"]))
    # spec.prewarm (kvpersist.controller.prewarm): warm again, and a prompt the operator cannot warm (once per message).
    old_warm, warm = pair(WARM_CONDITION)
    if warm is not None and warm["status"] == "True" and old_warm.get("status") != "True":
        events.append(("Normal", "Warmed", warm["message"]))
    elif warm is not None and warm["status"] == "False" and warm["reason"] != "Warming" and _news(old_warm, warm):
        events.append(("Warning", warm["reason"], warm["message"]))
    # A Secret or ConfigMap the spec names that does not exist (kvpersist.status.references): once per
    # message, and once when all exist again.
    events += _failing(*pair(references.CONDITION))
    old_budget, new_budget = (old.get("budget") or {}).get("state"), (new.get("budget") or {}).get("state")
    if new_budget != old_budget and new_budget is not None:
        cond = _of(conds, "WithinBudget")
        if new_budget == "Exhausted":
            events.append(("Warning", "BudgetExhausted", cond["message"] if cond else "L2 budget exhausted"))
        elif old_budget == "Exhausted":
            events.append(("Normal", "BudgetAvailable", cond["message"] if cond else "L2 budget has room again"))
    return events


def cache_fallback(key: tuple[str, str], body: Mapping[str, Any], conds: list[dict[str, Any]], generation: int | None,
                   logger: logging.Logger) -> list[dict[str, Any]]:
    """Feeds LMCacheReady to kvpersist.controller.fallback, marking the resource for an apply when vLLM
    goes without the cache or back; the conditions, with CacheBypassed while it lasts."""
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
    """The pods' runtime build check (kvpersist.status.build) from their cached container
    statuses: a vLLM pod's refusal sends vLLM without the cache for this id (applied next tick)."""
    bypass = runtime.CONTROLLER.build_bypass
    bypass.seed(key, body)
    found = buildstatus.refusals(seen.pods, target.namespace_id)
    if bypass.observe(key, target.namespace_id, found):
        runtime.CONTROLLER.held(key).drifted = True
        logger.warning("%s/%s: a vLLM pod refused to start over its versions: rolling vLLM without the cache (%s)",
                       key[0], key[1], bypass.detail(key, target.namespace_id))
    return buildstatus.BuildVerdict(target.spec.identity.connector_build, tuple(found), bypass.detail(key, target.namespace_id))


def bypassed(key: tuple[str, str], body: Mapping[str, Any], target: Target, conds: list[dict[str, Any]],
             generation: int | None) -> list[dict[str, Any]]:
    """CacheBypassed while vLLM runs without the cache over its versions (BuildMismatch, until the
    namespace id changes) or over a hit that changed the canary's answer (HitMismatch, until
    acknowledged): each says more than the one before it, the servers' fallback first."""
    build = runtime.CONTROLLER.build_bypass.detail(key, target.namespace_id)
    if build is not None:
        conds = bypassed_for(conds, buildstatus.MISMATCH, buildstatus.bypass_message(build), generation)
    hit = runtime.CONTROLLER.canary.standing(key, body, target.namespace_id)
    if hit is not None:
        conds = bypassed_for(conds, judge_canary.MISMATCH, judge_canary.bypass_message(hit, target.name, target.namespace),
                             generation)
    return conds


def bypassed_for(conds: list[dict[str, Any]], reason: str, message: str, generation: int | None) -> list[dict[str, Any]]:
    """The conditions with CacheBypassed for this reason in place of any other's."""
    return [*(c for c in conds if c["type"] != fallback.CONDITION), condition(fallback.CONDITION, True, reason, message, generation)]
