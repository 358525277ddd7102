"""kopf handlers: read a KVCacheNamespace, resolve its identity, and write what was found to status.

Thin on purpose: parsing lives in kvpersist.api, hashing in kvpersist.identity, status shapes in
kvpersist.conditions. Handlers only order those and talk to the API server.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from pydantic import ValidationError

from kvpersist.api import v1alpha1 as api
from kvpersist.conditions import condition, merge_conditions, same_conditions
from kvpersist.identity import resolve

PREFIX = "kvpersist.dev"


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's bookkeeping in our own annotations and out of status, which our schema owns."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30


def desired_status(body: kopf.Body) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    """The status for this object, and the events worth telling the user (type, reason, message)."""
    generation = body.get("metadata", {}).get("generation")
    old = body.get("status") or {}
    events: list[tuple[str, str, str]] = []
    try:
        obj = api.KVCacheNamespace.model_validate({"spec": body.get("spec"), "metadata": dict(body.get("metadata", {}))})
    except ValidationError as exc:
        message = api.validation_message(exc)
        conds = [condition("Ready", False, "InvalidSpec", message, generation)]
        status = {"observedGeneration": generation, "phase": "Failed", "conditions": conds}
        if old.get("phase") != "Failed":
            events.append(("Warning", "InvalidSpec", message))
        return status, events

    res = resolve(obj.spec.identity.model_dump())
    if res.namespace_id is None:
        ident = condition("IdentityResolved", False, "IdentityIncomplete",
                          f"cache disabled, vLLM runs without it: {res.reason}; set them in spec.identity", generation)
        phase = "CacheDisabled"
    else:
        ident = condition("IdentityResolved", True, "PinsComplete", f"compatibility namespace {res.namespace_id}", generation)
        phase = "Pending"
    ready = condition("Ready", False, "WorkloadsPending" if res.namespace_id else "CacheDisabled",
                      "waiting for the lmcache server and vLLM workloads", generation)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "phase": phase,
        "l2Kind": obj.spec.l2.kind,
        "conditions": [ident, ready],
    }
    if res.namespace_id:
        status["namespaceId"] = res.namespace_id
    if res.namespace_id and old.get("namespaceId") != res.namespace_id:
        previous = old.get("namespaceId")
        events.append(("Normal", "NamespaceResolved", f"identity pins resolve to {res.namespace_id}"
                       + (f" (was {previous}; its data is kept, unreachable from these pins)" if previous else "")))
    if phase == "CacheDisabled" and old.get("phase") != "CacheDisabled":
        events.append(("Warning", "IdentityIncomplete", ident["message"]))
    return status, events


def status_changed(old: dict[str, Any], new: dict[str, Any]) -> bool:
    keys = set(new) - {"conditions"}
    return any(old.get(k) != new[k] for k in keys) or not same_conditions(old.get("conditions", []), new["conditions"]) \
        or ("namespaceId" in old and "namespaceId" not in new)


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL)
def reconcile(body: kopf.Body, patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
    old = dict(body.get("status") or {})
    new, events = desired_status(body)
    if status_changed(old, new):
        new["conditions"] = merge_conditions(old.get("conditions", []), new["conditions"])
        if "namespaceId" in old and "namespaceId" not in new:
            new["namespaceId"] = None
        patch.status.update(new)
    for type_, reason, message in events:
        kopf.event(body, type=type_, reason=reason, message=message)
        logger.info("%s: %s", reason, message)
