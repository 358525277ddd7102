"""What the operator knows of each resource: recorded from its watch events (which also start its gc
requests), and forgotten when it is deleted.
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
from kvpersist.controller.gc import gc_in_worker
from kvpersist.controller.reading import known_fingerprint, target_of
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
