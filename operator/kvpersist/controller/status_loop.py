"""The status loop: every tick, the resources due refreshed (those whose children drifted applied first)
by the active replica only; its liveness probe, and its start and stop with the operator."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from kvpersist.api import v1alpha1 as api
from kvpersist.controller import admissioncheck, kube, metrics, runtime, watchcache
from kvpersist.controller.apply import apply_workloads
from kvpersist.controller.indexes import fleet_now, live_now, seen_of, stores_now
from kvpersist.controller.refresh import refresh_status
from kvpersist.controller.retention import orphan_claims, protect_claims
from kvpersist.controller.runtime import STATUS_INTERVAL_S, active
from kvpersist.controller.state import ResourceState
from kvpersist.controller.tracking import forget, sweep_if_forgotten
from kvpersist.status.workloads import Seen

TICK_S = 1.0
CACHES = ("secret_cache", "claim_cache", "configmap_cache", "attached_cache")  # the watch caches on runtime.CONTROLLER


def _active_keys(keys: list[tuple[str, str]], now: float) -> list[tuple[str, str]]:
    """The keys this replica may refresh. Every peering scope is checked each tick, keys or not, so a
    standby knows (and says) it is one before it has seen any resource."""
    for scope in runtime.CONTROLLER.peering["namespaces"] or (None,):
        active(now, scope)
    mine = [k for k in keys if active(now, k[0])]
    for key in set(keys).difference(mine):  # a replica that stood down: its view of these is no longer current
        metrics.standby(*key)
    return mine


# The periodic rounds of all resources together, at most this many a second (past 200 resources each
# comes round every count / this s), so an idle operator's CPU stops growing with them (issue 46). A
# change the watches show is refreshed at once whatever the count: only the usage polls slow down.
MAX_ROUNDS_ENV = "KVPERSIST_MAX_ROUNDS_PER_S"
MAX_ROUNDS_PER_S = float(os.environ.get(MAX_ROUNDS_ENV) or 20)


def interval(resources: int) -> float:
    """Seconds between two periodic rounds of one resource, with this many resources known."""
    return max(STATUS_INTERVAL_S, resources / MAX_ROUNDS_PER_S) if MAX_ROUNDS_PER_S > 0 else STATUS_INTERVAL_S


def due(now: float) -> list[tuple[str, str]]:
    """Resources to refresh now: those marked dirty, and those not refreshed for interval()."""
    known = runtime.CONTROLLER.known()
    every = interval(len(known))
    return [key for key, st in known.items() if st.dirty or now - st.last_refresh >= every]


async def _refresh_one(key: tuple[str, str], body: Mapping[str, Any], seen: Seen, restore: bool,
                       logger: logging.Logger) -> None:
    """One resource's round under its lock: its drifted children applied again, then its status."""
    loop = asyncio.get_running_loop()
    async with runtime.CONTROLLER.held(key).lock:
        try:
            if restore:
                logger.info("%s/%s: an owned object was deleted or edited; applying again", key[0], key[1])
                await loop.run_in_executor(runtime.CONTROLLER.refresh_pool, apply_workloads, body, logger, seen)
                seen = seen_of(key, seen.live_ids, stores=stores_now())  # what the apply changed, as the watch caches have it now
            await loop.run_in_executor(runtime.CONTROLLER.refresh_pool, refresh_status, body, seen, logger)
        except Exception as exc:  # one object's failure must not stop the others' status
            logger.warning("status refresh of %s/%s failed: %s", key[0], key[1], exc)
            gone = isinstance(exc, ApiException) and exc.status == 404
        else:
            return
        finally:
            sweep_if_forgotten(key)
    # Deleted while this operator missed its DELETED event (a watch outage)? A ghost would be
    # refreshed, and fail, forever: asked once, and forgotten when the API server says it is gone.
    if gone and await loop.run_in_executor(runtime.CONTROLLER.refresh_pool, _read, key) is None:
        logger.info("%s/%s no longer exists; forgetting it", key[0], key[1])
        forget(key)


def _read(key: tuple[str, str]) -> dict[str, Any] | None:
    """The resource as the API server has it now, or None when it is gone. Blocking."""
    return kube.get(api.API_VERSION, api.KIND, key[1], key[0])


# The liveness probe fails when the loop has not ticked for this long: a status loop that stopped
# (died, or the event loop is blocked) is an operator that must be restarted.
LOOP_STALL_S = 60.0


@kopf.on.probe(id="statusLoopSecondsSinceTick")
def status_loop_alive(**_: Any) -> float:
    """Seconds since the status loop last ticked; raises (kopf's /healthz answers 500) when stalled."""
    if runtime.CONTROLLER.loop_task is not None and runtime.CONTROLLER.loop_task.done():
        raise kopf.PermanentError("the status loop has stopped")
    if runtime.CONTROLLER.last_tick is None:
        return 0.0
    age = time.monotonic() - runtime.CONTROLLER.last_tick
    if age > LOOP_STALL_S:
        raise kopf.PermanentError(f"the status loop last ticked {age:.0f}s ago")
    return round(age, 1)


async def _status_loop(logger: logging.Logger) -> None:
    """Ticks until cancelled. A failed tick (e.g. urllib3's errors, no ApiException) is logged once per
    streak and retried: the loop ending would fail the liveness probe, restarting the operator all outage."""
    failing: str | None = None
    while True:
        await asyncio.sleep(TICK_S)
        tick = runtime.CONTROLLER.last_tick = time.monotonic()
        try:
            await _tick(tick, logger)
            # What the last second's refreshes and watch events freed, handed back (watchcache.trim).
            await asyncio.get_running_loop().run_in_executor(runtime.CONTROLLER.tick_pool, watchcache.trim)
        except Exception as exc:
            if failing is None:
                logger.warning("status loop: a tick failed (%s: %s); trying again every %.0f s", type(exc).__name__, exc, TICK_S)
            failing = type(exc).__name__
        else:
            if failing is not None:
                logger.info("status loop: ticks succeed again (after %s)", failing)
            failing = None


def may_apply(key: tuple[str, str], state: ResourceState, tick: float) -> bool:
    """Whether a drifted resource is applied on this tick: not while a failed apply waits for its
    backoff, nor while a name it needs is taken before its next look (kvpersist.controller.ownership)."""
    return (state.drifted and runtime.CONTROLLER.apply_backoff.due(key, tick)
            and (state.name_taken is None or tick >= state.name_taken_retry_at))


async def _tick(tick: float, logger: logging.Logger) -> None:
    """One round: the resources due (and those whose children drifted) refreshed, each in a task."""
    loop = asyncio.get_running_loop()
    # A snapshot first (worker threads mark resources drifted); an apply that failed waits for its backoff.
    restore = {key for key, st in runtime.CONTROLLER.known().items() if may_apply(key, st, tick)}
    keys = sorted(set(due(time.monotonic())) | restore)
    # Where a peer is active, its status, not ours from caches kopf has paused.
    keys = await loop.run_in_executor(runtime.CONTROLLER.tick_pool, _active_keys, keys, tick)
    live = live_now() if keys else frozenset()
    agents = fleet_now() if keys else {}  # once a tick, as live: every refresh plans from the same view
    # Every resource's store, for the rounds that decide StorageInUse (an apply, or a refused resource's recheck).
    stores = stores_now(pods=any(k in restore or ((st := runtime.CONTROLLER.get(k)) is not None and st.storage_refused)
                                 for k in keys)) if keys else None
    if tick - runtime.CONTROLLER.orphan_sweep_at >= STATUS_INTERVAL_S:
        runtime.CONTROLLER.orphan_sweep_at = tick
        orphans = orphan_claims()
        if orphans:  # by the active replica only, as every other write
            loop.run_in_executor(runtime.CONTROLLER.refresh_pool, lambda o=orphans: protect_claims(
                [c for c in o if active(time.monotonic(), c[0]["metadata"].get("namespace"))], None, logger))
    for key in keys:
        state = runtime.CONTROLLER.get(key)
        if state is None or state.body is None or state.lock.locked():
            continue  # deleted meanwhile, or its last round (or a reconcile) still runs: next tick
        if key in restore:
            state.drifted = False
        task = asyncio.create_task(_refresh_one(key, state.body, seen_of(key, live, agents, stores), key in restore, logger))
        runtime.CONTROLLER.refresh_tasks.add(task)
        task.add_done_callback(runtime.CONTROLLER.refresh_tasks.discard)


@kopf.on.startup()
async def start_status_loop(logger: logging.Logger, kvp_statefulsets: Mapping[Any, Any], kvp_deployments: Mapping[Any, Any],
                            kvp_pods: Mapping[Any, Any], kvp_claims: Mapping[Any, Any],
                            kvp_replicasets: Mapping[Any, Any], **_: Any) -> None:
    runtime.CONTROLLER.indices.update(kvp_statefulsets=kvp_statefulsets, kvp_deployments=kvp_deployments, kvp_pods=kvp_pods,
                                      kvp_claims=kvp_claims, kvp_replicasets=kvp_replicasets)
    start_watch_caches()
    runtime.CONTROLLER.creator_rights_stop = admissioncheck.start(os.environ)
    runtime.CONTROLLER.loop_task = asyncio.create_task(_status_loop(logger))


def start_watch_caches() -> None:
    """The named Secrets', ConfigMaps' and claims' watch caches, and those of the names an apply
    takes, in kopf's namespaces (none with a glob among them: no list per namespace to make, so
    reads go by request)."""
    scope = runtime.named_namespaces()  # None: cluster-wide, unless a pattern is among the names
    if scope is None and runtime.CONTROLLER.peering["namespaces"]:
        logging.getLogger("kvpersist").info("a glob among the watched namespaces: named Secrets, claims and names are read by request")
        return
    label = runtime.CONTROLLER.policy.secret_label
    secrets = functools.partial(watchcache.secrets, label_keys=(label[0],) if label else ())
    for name, make in zip(CACHES, (secrets, watchcache.claims, watchcache.configmaps, watchcache.attached_pods), strict=True):
        cache = make(scope)  # type: ignore[operator]
        setattr(runtime.CONTROLLER, name, cache)
        cache.start()
    for api_version, kind in watchcache.NAMED_KINDS:
        runtime.CONTROLLER.name_caches[kind] = watchcache.names(api_version, kind, scope)
        runtime.CONTROLLER.name_caches[kind].start()


@kopf.on.cleanup()
async def stop_status_loop(**_: Any) -> None:
    for name in CACHES:
        if (cache := getattr(runtime.CONTROLLER, name)) is not None:
            cache.stop()
    for cache in runtime.CONTROLLER.name_caches.values():
        cache.stop()
    if runtime.CONTROLLER.creator_rights_stop is not None:
        runtime.CONTROLLER.creator_rights_stop.set()
    if runtime.CONTROLLER.loop_task is not None:
        runtime.CONTROLLER.loop_task.cancel()
