"""Explicit cleanup (the gc annotation): a namespace id's data deleted through the agents or from the
bucket, refused while anything uses the id (the API server asked again right before each deletion)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kvpersist.api import v1alpha1 as api
from kvpersist.controller import kube, metrics, runtime
from kvpersist.controller.indexes import seen_of
from kvpersist.controller.inuse import in_use_now
from kvpersist.controller.l2runtime import CLEANUP
from kvpersist.controller.reading import known_fingerprint, target_of
from kvpersist.controller.refresh import write_status
from kvpersist.inventory.cleanup import GC_ANNOTATION, refusal
from kvpersist.inventory.cleanup import result as gc_result
from kvpersist.l2backends import backend_of
from kvpersist.status.conditions import now as condition_now
from kvpersist.status.workloads import Seen


def run_gc(body: Mapping[str, Any], request: dict[str, str], seen: Seen, logger: logging.Logger) -> None:
    """Carry out one gc request (refused for a live namespace), record the outcome in status.gc and an
    Event, then clear the request. Blocking: runs in a worker thread."""
    meta = body["metadata"]
    try:
        target, _reason = target_of(body, known_fingerprint(body))
    except ValidationError as exc:
        outcome = gc_result(request, "Failed", f"the spec cannot be read: {api.validation_message(exc)}")
    else:
        # The watch caches first (cheap); then the API server right before each deletion (recheck):
        # the caches may lag, and cover only the watched namespaces.
        why = request.get("error") or refusal(request["namespaceId"], target.namespace_id, seen.live_ids)
        recheck = functools.partial(in_use_now, request["namespaceId"], target.namespace_id)
        if why:
            outcome = gc_result(request, "Refused", f"refused: {why}; nothing was deleted")
        else:
            outcome = CLEANUP[backend_of(target.spec.l2).field](request, target, seen, recheck)
    outcome["completedAt"] = condition_now()
    write_status(meta, {"gc": outcome}, logger)
    done = outcome["outcome"]
    reason = {"Deleted": "NamespaceDeleted", "NotFound": "NamespaceNotFound", "Refused": "GCRefused"}.get(done, "GCFailed")
    kube.post_event(body, "Normal" if done in ("Deleted", "NotFound") else "Warning", reason, outcome["message"])
    metrics.inc("kvpersist_gc_total")
    logger.warning("%s/%s gc %s: %s", meta["namespace"], meta["name"], outcome["outcome"], outcome["message"])
    kube.patch_metadata(api.API_VERSION, api.KIND, meta["name"], meta["namespace"],
                        {"metadata": {"annotations": {GC_ANNOTATION: None}}})


async def gc_in_worker(key: tuple[str, str], request: dict[str, str], logger: logging.Logger) -> None:
    try:
        state = runtime.CONTROLLER.get(key)
        if state is not None and state.body is not None:
            await asyncio.get_running_loop().run_in_executor(None, run_gc, state.body, request, seen_of(key), logger)
            state.dirty = True  # the inventory changed: show it
    except Exception as exc:  # reported, and retried on the next event while the annotation stays
        logger.error("gc of %s on %s/%s failed: %s", request.get("namespaceId"), key[0], key[1], exc)
    finally:
        runtime.CONTROLLER.gc_inflight.discard(request["requestId"])
