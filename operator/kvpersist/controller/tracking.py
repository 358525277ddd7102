"""What the operator knows of each resource: recorded from its watch events (which also start its gc
requests), and forgotten when it is deleted; a spec not reconciled yet (a new resource, a changed
spec, or every resource once after a start) applied, then its status refreshed, under the
resource's lock, so never beside a round of the status loop for the same resource.

A kopf event handler, not kopf's create/update/resume: those keep the handled spec in an annotation,
one more patch of every new resource and one more watch event; the operator's own apply never raises
(it retries with its backoff from the status loop), so kopf's retries were never used.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from pydantic import ValidationError

from kvpersist.api import v1alpha1 as api
from kvpersist.controller import agentroll, metrics, runtime
from kvpersist.controller.apply import apply_workloads
from kvpersist.controller.gc import gc_in_worker
from kvpersist.controller.indexes import seen_of, stores_now
from kvpersist.controller.reading import known_fingerprint, target_of
from kvpersist.controller.refresh import refresh_status
from kvpersist.inventory.cleanup import parse_request


def forget(key: tuple[str, str]) -> None:
    """Drops everything held about a deleted resource (its DELETED event, or a 404 for one whose event a watch outage lost)."""
    runtime.CONTROLLER.forget(key)
    agentroll.ROLLER.forget(key)
    metrics.set_phase(key[0], key[1], None)


def sweep_if_forgotten(key: tuple[str, str]) -> None:
    """A resource forgotten while worker threads ran is forgotten again, so what they wrote (hits, backoff, the
    phase metric) goes too. In the event loop, like track(): nothing races it."""
    if runtime.CONTROLLER.get(key) is None:
        forget(key)


async def track(event: Mapping[str, Any], body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    if event.get("type") == "DELETED" or body["metadata"].get("deletionTimestamp"):
        forget(key)
    else:
        remember(key, body, logger)


def remember(key: tuple[str, str], body: Mapping[str, Any], logger: logging.Logger) -> None:
    """The resource as a watch event shows it, kept for the status loop; a new gc request started. Event loop."""
    state = runtime.CONTROLLER.state(key)
    spec = dict(body.get("spec") or {})
    if state.body is not None and state.body.get("spec") == spec:
        spec = state.body["spec"]  # the same object while unchanged: one copy, and parsed once (reading.target_of)
    state.body = {"apiVersion": body.get("apiVersion", api.API_VERSION), "kind": body.get("kind", api.KIND),
                  # managedFields left out: nothing reads them, and they are most of a stored object's metadata
                  "metadata": {k: v for k, v in body["metadata"].items() if k != "managedFields"}, "spec": spec,
                  "status": dict(body.get("status") or {})}
    try:  # the key as last read (or recorded), from the copy just kept: target_of's memo, no blocking read
        state.namespace_id = target_of(state.body, known_fingerprint(state.body))[0].namespace_id
    except ValidationError:
        state.namespace_id = None
    request = parse_request(body["metadata"].get("annotations"))
    done = ((body.get("status") or {}).get("gc") or {}).get("requestId")
    if request and request["requestId"] != done and request["requestId"] not in runtime.CONTROLLER.gc_inflight:
        runtime.CONTROLLER.gc_inflight.add(request["requestId"])
        task = asyncio.create_task(gc_in_worker(key, request, logger))
        runtime.CONTROLLER.gc_tasks.add(task)
        task.add_done_callback(runtime.CONTROLLER.gc_tasks.discard)


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL, id="track")
async def on_event(event: Mapping[str, Any], body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """Every event is recorded; a spec the operator has not reconciled since it started, reconciled.
    kopf calls this once per object at a time, after its indexes have listed."""
    await track(event=event, body=body, logger=logger)
    state = runtime.CONTROLLER.get((body["metadata"]["namespace"], body["metadata"]["name"]))
    if state is not None and state.body is not None and state.reconciled_spec is not state.body.get("spec"):
        await reconcile(body=body, logger=logger)


async def reconcile(body: Mapping[str, Any], logger: logging.Logger, **_: Any) -> None:
    """Apply the workloads, then refresh status. The blocking parts run in worker threads; the
    watch caches are read here, in the event loop."""
    loop = asyncio.get_running_loop()
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    state = runtime.CONTROLLER.state(key)
    async with state.lock:
        state.drifted = False
        if state.body is not None:
            state.reconciled_spec = state.body.get("spec")  # the same object while the spec is unchanged (tracking.remember)
        try:
            await loop.run_in_executor(runtime.CONTROLLER.refresh_pool, apply_workloads, body, logger,
                                       seen_of(key, stores=stores_now(), owner_uid=body["metadata"].get("uid")))
            await loop.run_in_executor(runtime.CONTROLLER.refresh_pool, refresh_status, body,
                                       seen_of(key, stores=stores_now(), owner_uid=body["metadata"].get("uid")),
                                       logger)
        finally:
            sweep_if_forgotten(key)
