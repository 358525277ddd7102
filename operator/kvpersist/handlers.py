"""kopf handlers: apply what a KVCacheNamespace becomes, and keep its status true.

Thin on purpose: parsing lives in kvpersist.api, hashing in kvpersist.identity, manifests in
kvpersist.builders, status judgement in kvpersist.conditions. Handlers order those and talk to
the API server.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kvpersist import kube, metrics
from kvpersist.api import v1alpha1 as api
from kvpersist.builders.all import build_all
from kvpersist.builders.target import SERVER, Target
from kvpersist.conditions import Observation, compute_status, condition, failed_status, status_patch
from kvpersist.hfbucket import preflight_bucket
from kvpersist.identity import resolve
from kvpersist.usage import WriteFailureTracker, collect_usage

PREFIX = "kvpersist.dev"
STATUS_INTERVAL_S = 10.0

# Apply failures the API server gave for a generation (e.g. an immutable field changed), kept so
# the periodic status refresh reports them instead of overwriting them. Keyed by (namespace, name).
_apply_errors: dict[tuple[str, str], tuple[int | None, str]] = {}
_write_failures = WriteFailureTracker()
PREFLIGHT_TTL_S = 300.0
# Resources whose workloads changed since their last refresh (a StatefulSet or Deployment event):
# refreshed on the status loop's next tick, so phase follows pod readiness within a second or
# so, without polling every resource that often; and when each was last refreshed.
_dirty: set[tuple[str, str]] = set()
_last_refresh: dict[tuple[str, str], float] = {}
_preflights: dict[tuple[str, str], tuple[tuple, float, tuple[bool, str, str]]] = {}
# Usage and health change without any event on the resource, so status is polled. Not with a
# kopf timer: timers put a finalizer on every object, and then nothing can be deleted while the
# operator is down. Instead, watch events keep a snapshot of each object and one loop polls them.
_known: dict[tuple[str, str], dict[str, Any]] = {}
TICK_S = 1.0


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's bookkeeping in our own annotations and out of status, which our schema owns."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    kube.load_config()


def _target(body: Mapping[str, Any]) -> tuple[Target, str]:
    """The builders' view of the object and the reason its identity is incomplete (if it is).
    Raises ValidationError for a spec the operator cannot read."""
    meta = body["metadata"]
    obj = api.KVCacheNamespace.model_validate({"spec": body.get("spec"), "metadata": {"name": meta["name"]}})
    res = resolve(obj.spec.identity.model_dump())
    return Target(meta["name"], meta["namespace"], obj.spec, res.namespace_id), res.reason


def _observe(body: Mapping[str, Any], target: Target, reason: str) -> Observation:
    ns = target.namespace
    spec = target.spec
    sts = kube.get("apps/v1", "StatefulSet", target.server_name, ns)
    pods = kube.list_objects("v1", "Pod", ns, target.selector(SERVER))
    claims: list[dict[str, Any]] = []
    if spec.l2.nvme is not None and spec.l2.nvme.existing_claim_name:
        claim = kube.get("v1", "PersistentVolumeClaim", spec.l2.nvme.existing_claim_name, ns)
        claims = [claim] if claim else []
    elif spec.l2.nvme is not None:
        claims = kube.list_objects("v1", "PersistentVolumeClaim", ns, target.selector(SERVER))
    running = [(p["metadata"]["name"], (p.get("status") or {}).get("podIP"))
               for p in pods if (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    server_desired = spec.lmcache_server.replicas if target.cache_enabled else 0
    reports = collect_usage(sorted(running), spec.lmcache_server.http_port) if target.cache_enabled else []
    now = time.monotonic()
    failing = [r.pod for r in reports if _write_failures.failing(f"{ns}/{r.pod}", r.l2_writes_failed, now)]
    return Observation(
        bucket_check=_bucket_check(target) if spec.l2.hf_bucket is not None and target.cache_enabled else None,
        generation=body["metadata"].get("generation"),
        namespace_id=target.namespace_id,
        identity_reason=reason,
        l2_kind=spec.l2.kind,
        server_desired=server_desired,
        vllm_desired=spec.vllm.replicas,
        statefulset=sts,
        deployment=kube.get("apps/v1", "Deployment", target.vllm_name, ns),
        server_pods=pods,
        claims=claims,
        existing_claim=spec.l2.nvme.existing_claim_name if spec.l2.nvme is not None else None,
        writes_failing=failing,
        reports=reports,
    )


def _bucket_check(target: Target) -> tuple[bool, str, str]:
    """The hfBucket preflight, at most once per PREFLIGHT_TTL_S per resource and Secret version."""
    bucket = target.spec.l2.hf_bucket
    assert bucket is not None
    ref = f"Secret {bucket.token_secret_ref.name} key {bucket.token_secret_ref.key}"
    secret = kube.get("v1", "Secret", bucket.token_secret_ref.name, target.namespace)
    if secret is None:
        return (False, "SecretNotFound", f"{ref} not found in namespace {target.namespace}: create it, e.g. kubectl create "
                f"secret generic {bucket.token_secret_ref.name} --from-literal={bucket.token_secret_ref.key}=hf_...")
    raw = (secret.get("data") or {}).get(bucket.token_secret_ref.key)
    if not raw:
        return (False, "SecretKeyMissing", f"{ref}: the Secret has no such key; set spec.l2.hfBucket.tokenSecretRef.key")
    key = (target.namespace, target.name, bucket.bucket_handle, bucket.create_bucket_if_missing,
           secret["metadata"].get("resourceVersion"))
    cached = _preflights.get((target.namespace, target.name))
    now = time.monotonic()
    if cached and cached[0] == key and now - cached[1] < PREFLIGHT_TTL_S:
        return cached[2]
    result = preflight_bucket(bucket.bucket_handle, base64.b64decode(raw).decode().strip(), bucket.create_bucket_if_missing,
                              ref, endpoint=os.environ.get("HF_ENDPOINT"))
    _preflights[(target.namespace, target.name)] = (key, now, (result.ok, result.reason, result.message))
    return result.ok, result.reason, result.message


def _events_for(old: dict[str, Any], new: dict[str, Any], conds: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The transitions a user cares about, as (type, reason, message)."""
    events = []
    old_id, new_id = old.get("namespaceId"), new.get("namespaceId")
    if new_id and new_id != old_id:
        events.append(("Normal", "NamespaceResolved", f"identity pins resolve to {new_id}"
                       + (f" (was {old_id}; its data is kept, unreachable from these pins)" if old_id else "")))
    phase = new.get("phase")
    if phase and phase != old.get("phase"):
        ready = next((c for c in conds if c["type"] == "Ready"), None)
        detail = ready["message"] if ready else ""
        if phase == "CacheDisabled":
            ident = next(c for c in conds if c["type"] == "IdentityResolved")
            events.append(("Warning", "IdentityIncomplete", ident["message"]))
        elif phase in ("Degraded", "Failed"):
            events.append(("Warning", phase, detail))
        elif phase == "Ready":
            events.append(("Normal", "Ready", detail))
    return events


def refresh_status(body: Mapping[str, Any], logger: logging.Logger) -> None:
    """Observe, judge, and write status only when something a user can see changed."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    _dirty.discard(key)
    _last_refresh[key] = time.monotonic()
    old = dict(body.get("status") or {})
    generation = meta.get("generation")
    try:
        target, reason = _target(body)
    except ValidationError as exc:
        fields, conds = failed_status(generation, api.validation_message(exc))
        reports = []
    else:
        observation = _observe(body, target, reason)
        fields, conds = compute_status(observation)
        reports = observation.reports
        error = _apply_errors.get((target.namespace, target.name))
        if error and error[0] == generation:
            fields = {**fields, "phase": "Failed"}
            conds = [c for c in conds if c["type"] != "Ready"] + [condition("Ready", False, "ApplyFailed", error[1], generation)]
    metrics.inc("kvpersist_status_refreshes_total")
    metrics.set_phase(meta["namespace"], meta["name"], fields.get("phase"))
    new_status = status_patch(old, fields, conds, reports)
    if new_status is None:
        return
    kube.patch_status(api.API_VERSION, api.KIND, meta["name"], meta["namespace"], new_status)
    metrics.inc("kvpersist_status_writes_total")
    for type_, reason_, message in _events_for(old, {**old, **new_status}, conds):
        kube.post_event(body, type_, reason_, message)
        metrics.inc("kvpersist_events_total")
        logger.info("%s/%s %s: %s", meta["namespace"], meta["name"], reason_, message)


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL, field="spec")
def reconcile(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """Apply every object this resource becomes (server-side, idempotent), then refresh status."""
    try:
        target, _reason = _target(body)
    except ValidationError:
        refresh_status(body, logger)
        return
    key = (target.namespace, target.name)
    metrics.inc("kvpersist_reconciles_total")
    try:
        for manifest in build_all(target):
            kopf.append_owner_reference(manifest, owner=body)
            kube.apply(manifest)
            metrics.inc("kvpersist_applies_total")
    except ApiException as exc:
        metrics.inc("kvpersist_apply_errors_total")
        if exc.status in (400, 403, 404, 409, 422):
            _apply_errors[key] = (body["metadata"].get("generation"), f"the API server refused an object: {_api_message(exc)}")
            logger.error("apply failed: %s", _apply_errors[key][1])
        else:
            raise kopf.TemporaryError(f"applying workloads failed ({exc.status}); retrying", delay=15) from exc
    else:
        _apply_errors.pop(key, None)
    refresh_status(body, logger)


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body).get("message", str(exc))
    except (TypeError, ValueError):
        return str(exc.reason)


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)
def track(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    if event.get("type") == "DELETED" or body["metadata"].get("deletionTimestamp"):
        _known.pop(key, None)
        _apply_errors.pop(key, None)
        _last_refresh.pop(key, None)
        _dirty.discard(key)
        metrics.set_phase(key[0], key[1], None)
    else:
        _known[key] = {"apiVersion": body.get("apiVersion", api.API_VERSION), "kind": body.get("kind", api.KIND),
                       "metadata": dict(body["metadata"]), "spec": dict(body.get("spec") or {}),
                       "status": dict(body.get("status") or {})}


@kopf.on.event("apps", "v1", "statefulsets", labels={"app.kubernetes.io/managed-by": "kvpersist"})
@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": "kvpersist"})
def workload_changed(body: kopf.Body, **_: Any) -> None:
    owner = (body["metadata"]["namespace"], body["metadata"].get("labels", {}).get("app.kubernetes.io/instance", ""))
    if owner in _known:
        _dirty.add(owner)


def due(now: float) -> list[tuple[str, str]]:
    """Resources to refresh now: those marked dirty, and those not refreshed for STATUS_INTERVAL_S."""
    return [key for key in list(_known) if key in _dirty or now - _last_refresh.get(key, float("-inf")) >= STATUS_INTERVAL_S]


async def _status_loop(logger: logging.Logger) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(TICK_S)
        for key in due(time.monotonic()):
            body = _known.get(key)
            if body is None:
                continue  # deleted meanwhile
            try:
                await loop.run_in_executor(None, refresh_status, body, logger)
            except Exception as exc:  # one object's failure must not stop the others' status
                logger.warning("status refresh of %s/%s failed: %s", key[0], key[1], exc)


_loop_task: asyncio.Task | None = None


@kopf.on.startup()
async def start_status_loop(logger: logging.Logger, **_: Any) -> None:
    global _loop_task
    _loop_task = asyncio.create_task(_status_loop(logger))


@kopf.on.cleanup()
async def stop_status_loop(**_: Any) -> None:
    if _loop_task is not None:
        _loop_task.cancel()
