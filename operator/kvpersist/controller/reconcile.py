"""The resource's watch events: recorded (kvpersist.controller.tracking), and a spec not reconciled
yet (a new resource, a changed spec, or every resource once after a start) applied, then its status
refreshed, under the resource's lock, so never beside a round of the status loop for the same resource.

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

from kvpersist.api import v1alpha1 as api
from kvpersist.controller import runtime, tracking
from kvpersist.controller.apply import apply_workloads
from kvpersist.controller.indexes import seen_of, stores_now
from kvpersist.controller.refresh import refresh_status


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL, id="track")
async def on_event(event: Mapping[str, Any], body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """Every event is recorded; a spec the operator has not reconciled since it started, reconciled.
    kopf calls this once per object at a time, after its indexes have listed."""
    await tracking.track(event=event, body=body, logger=logger)
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
            tracking.sweep_if_forgotten(key)
