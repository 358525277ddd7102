"""kopf's create, update (of spec) and resume handler: apply the workloads, then refresh status,
under the resource's lock, so never beside a round of the status loop for the same resource.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from kvpersist.api import v1alpha1 as api
from kvpersist.controller import runtime
from kvpersist.controller.apply import apply_workloads
from kvpersist.controller.indexes import seen_of, stores_now
from kvpersist.controller.refresh import refresh_status
from kvpersist.controller.tracking import sweep_if_forgotten


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL, field="spec")
async def reconcile(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """Apply the workloads, then refresh status. The blocking parts run in worker threads; the
    watch caches are read here, in the event loop."""
    loop = asyncio.get_running_loop()
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    state = runtime.CONTROLLER.state(key)
    async with state.lock:
        state.drifted = False
        try:
            await loop.run_in_executor(runtime.CONTROLLER.refresh_pool, apply_workloads, body, logger,
                                       seen_of(key, stores=stores_now(), owner_uid=body["metadata"].get("uid")))
            await loop.run_in_executor(runtime.CONTROLLER.refresh_pool, refresh_status, body,
                                       seen_of(key, stores=stores_now(), owner_uid=body["metadata"].get("uid")),
                                       logger)
        finally:
            sweep_if_forgotten(key)
