"""Acting on what one apply decided (kvpersist.controller.decision, on a snapshot read first:
kvpersist.controller.snapshot), and an old namespace id's Services and policies, once no pod
carries that id (clean_stale_routes).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kvpersist.builders.retained import build_key_secret
from kvpersist.builders.target import SERVER, Target
from kvpersist.controller import fallback, inferencepool, kube, metrics, ownership, retry, runtime
from kvpersist.controller.agents import remember_token
from kvpersist.controller.decision import CLAIMS, DROPPABLE, NAMES, POLICY, Decision, child_key, decide
from kvpersist.controller.drift import note_own_delete, note_own_write, own_apply
from kvpersist.controller.policy import Refusal
from kvpersist.controller.reading import target_of
from kvpersist.controller.snapshot import read_snapshot
from kvpersist.controller.stale_routes import ROUTE_KINDS, ids_in_use, stale
from kvpersist.status.workloads import COMPONENT_LABEL, INSTANCE_LABEL, Seen


def apply_workloads(body: Mapping[str, Any], logger: logging.Logger, seen: Seen | None = None) -> bool:
    """Read (snapshot), decide (decision), act: no request between the decisions. False when the
    spec cannot be read (status says why). Blocking: runs in a worker thread."""
    try:
        target, _reason = target_of(body)
    except ValidationError:
        return False
    key = (target.namespace, target.name)
    state = runtime.CONTROLLER.held(key)
    metrics.inc("kvpersist_reconciles_total")
    runtime.CONTROLLER.fallback.seed(key, fallback.bypassed_in(body))
    runtime.CONTROLLER.build_bypass.seed(key, body)
    try:
        snap, raw_key = read_snapshot(body, seen)
        decision = decide(snap)
        last = state.applied
        _act(decision, raw_key, body, state, logger)
        # What the status refresh decides again on, and compares with: no token, no manifests kept.
        state.applied = (dataclasses.replace(snap, agent_token=""), decision.kept())
    except Exception as exc:  # any failure: the status loop tries again (retry.Backoff), status says why
        metrics.inc("kvpersist_apply_errors_total")
        generation = body["metadata"].get("generation")
        if isinstance(exc, ApiException) and exc.status in retry.INVALID:
            state.apply_error = (generation, f"the API server refused an object: {_api_message(exc)}")
            runtime.CONTROLLER.apply_backoff.succeeded(key)  # not retried: only a changed spec can pass
            logger.error("apply failed: %s", state.apply_error[1])
        else:
            why = (f"HTTP {exc.status}: {_api_message(exc)}" if isinstance(exc, ApiException)
                   else f"{type(exc).__name__}: {exc}")[:1024]
            pending = runtime.CONTROLLER.apply_backoff.failed(key, generation, why, time.monotonic())
            state.drifted = True  # the status loop applies again once pending.due_at has passed
            logger.warning("%s/%s: applying the workloads failed (attempt %d: %s); trying again in %.0f s",
                           target.namespace, target.name, pending.attempts, why, retry.delay(pending.attempts))
    else:
        if decision.applies:
            state.apply_error = None
            runtime.CONTROLLER.apply_backoff.succeeded(key)
            # An old id's Service and policy may now be stale (see clean_stale_routes); a resource that never
            # had an id (nothing applied before, no status.namespaceId) has none to look for.
            if last is not None or (body.get("status") or {}).get("namespaceId"):
                state.routes_pending = True
    return True


def _refused_names(decision: Decision, state: Any, logger: logging.Logger) -> None:
    """ClaimNotOwned or NameTaken: nothing applied, looked at again after ownership.RETRY_S."""
    assert decision.refusal is not None
    target = decision.target
    if state.name_taken != decision.refusal:
        logger.warning("%s/%s: not applied: %s", target.namespace, target.name, decision.refusal[1])
    state.name_taken, state.name_taken_retry_at = decision.refusal, time.monotonic() + ownership.RETRY_S


def _act(decision: Decision, raw_key: bytes | None, body: Mapping[str, Any], state: Any, logger: logging.Logger) -> None:
    """Applies a decision: the L2 key and agent token Secrets and the network policies side by side,
    then the claims and workloads in build_all's order. Raises (the apply is retried) on a failure,
    and when an object appeared under a name between the read and the create."""
    target = decision.target
    if decision.stage == POLICY:  # nothing rendered and nothing deleted: the children stay as they are
        assert decision.refusal is not None
        if state.applied is None or state.applied[1].refusal != decision.refusal:
            logger.warning("%s/%s: not applied: %s", target.namespace, target.name, decision.refusal[1])
        return
    if decision.stage == CLAIMS:
        _refused_names(decision, state, logger)
        return
    if decision.unchecked:  # read_snapshot reads every name decide judges: a bug, never applied over
        raise RuntimeError(f"not read before the decision: {', '.join('/'.join(k) for k in decision.unchecked)}")
    read = decision.key
    if decision.key_lost is not None and read is not None and read.problem is not None:
        logger.warning("%s/%s: %s", target.namespace, target.name, read.problem[1])
    key_secret = None
    if decision.generated_key is not None and read is not None:
        assert raw_key is not None
        key_secret = build_key_secret(target, key=raw_key)
        assert key_secret is not None
        # The operator's own Secrets carry secretLabel: usable under that rule.
        key_secret["metadata"]["labels"].update(runtime.CONTROLLER.policy.generated_secret_labels())
        # Only a key made here replaces the cached read, so the next refresh names it before the Secret
        # watch shows it; a read judged lost never is (the refresh would judge it lost again even once
        # the user accepted the loss).
        state.key_read = (time.monotonic(), read)
    storage = decision.storage_refused  # state's: the last apply's, until this one is stored
    if storage != state.storage_refused and (storage or state.storage_refused):
        logger.warning("%s/%s: %s", target.namespace, target.name, storage or "its L2 store is free again: the cache is on")
    if decision.route_taken != state.route_taken and decision.route_taken:
        logger.warning("%s/%s: %s", target.namespace, target.name, decision.route_taken)
    uid = body["metadata"].get("uid")
    owners = runtime.CONTROLLER.child_owners
    for found in decision.owned:
        owners[found] = uid
    if decision.stage == NAMES:  # an object the operator did not make under one of its names (ownership)
        _refused_names(decision, state, logger)
        return
    state.name_taken, state.name_taken_retry_at = None, float("inf")
    token_secret = decision.token_secret
    assert token_secret is not None
    token_key = child_key(token_secret)
    token_known = owners.get(token_key) == uid
    if not all(token_secret["data"].values()):  # read_snapshot mints one: never an empty credential
        raise RuntimeError(f"no agent token minted for Secret {target.agent_token_secret}")
    # What the server pods need before they exist: the L2 key (created once and never owned, see
    # builders.retained), the agent token, and the policies that close their ports. Side by side, one
    # round trip instead of four: the StatefulSet, next, is what a user waits for.
    policies = [m for m in decision.manifests if m["kind"] == "NetworkPolicy"]
    jobs = [runtime.CONTROLLER.apply_pool.submit(_apply_owned, m) for m in policies]
    # The token Secret is never applied over, never adopted: one a deleted namesake owned is the
    # garbage collector's, and once it is gone the next refresh finds no token and creates it
    # again. Adopting it would need `patch` on every Secret the operator can see.
    token_job = runtime.CONTROLLER.apply_pool.submit(lambda: kube.create_if_absent(token_secret))
    jobs.append(token_job)
    key_job = runtime.CONTROLLER.apply_pool.submit(lambda: kube.create_if_absent(key_secret)) if key_secret is not None else None
    if key_job is not None:
        jobs.append(key_job)
    concurrent.futures.wait(jobs)
    for job in jobs:
        job.result()  # the first failure, raised here (every job has ended)
    # What the operator created is known as created (never someone else's: the create fails on any
    # object under the name), not read back while the Secret watch cache shows that version.
    if (made_token := token_job.result()) is not None:
        owners[token_key] = uid
        remember_token(target, made_token, uid)
    elif not token_known:  # absent when looked up, someone else's now: judged on the next try
        raise RuntimeError(f"Secret {target.agent_token_secret} appeared while applying; looking at it again")
    if key_job is not None and key_job.result() is None:
        # Made by someone else between the read and the create: the manifests name a key it does
        # not hold. Nothing server-side was applied yet; read it and apply again.
        state.key_read = None
        raise RuntimeError(f"Secret {key_secret['metadata']['name']} appeared while applying; applying again with its key")
    if key_job is not None:
        # The key made (state.key_read above) stands, unread, while the Secret watch cache shows this version.
        # No Event: status.l2Key names it by fingerprint, and a key that replaces another is an Event of the
        # status's own (L2KeyChanged, L2KeyReplaced: kvpersist.controller.l2key.events).
        state.key_read_version = (key_job.result().get("metadata") or {}).get("resourceVersion")
        logger.info("%s/%s: generated L2 master key Secret %s (fingerprint %s)", target.namespace, target.name,
                    key_secret["metadata"]["name"], decision.generated_key)
    # spec.l2.nvme.shared with size: its one claim, before the StatefulSet whose pods mount it; created
    # when absent, never applied over (builders.lmcache.build_shared_claim). None with the cache off.
    if decision.shared_claim is not None and kube.create_if_absent(decision.shared_claim):
        logger.info("%s/%s: created the shared L2 claim %s (ReadWriteMany, %s)", target.namespace, target.name,
                    decision.shared_claim["metadata"]["name"], target.spec.l2.nvme.size)  # type: ignore[union-attr]
    for manifest in decision.manifests:
        if manifest["kind"] == "PersistentVolumeClaim":
            _model_cache_claim(manifest, decision, body, state, logger)
        elif manifest["kind"] != "NetworkPolicy":
            _apply_owned(manifest)
    for api_version, kind, suffix, why in DROPPABLE:  # its own, under a name this apply does not write
        name = target.name + suffix
        if (kind, target.namespace, name) in decision.drops:
            kube.delete(api_version, kind, name, target.namespace)
            note_own_delete((kind, target.namespace, name))
            logger.info("%s/%s: deleted %s %s: %s", target.namespace, target.name, kind, name, why)
    _pool_api_missing(decision, body, state, logger)


def _pool_api_missing(decision: Decision, body: Mapping[str, Any], state: Any, logger: logging.Logger) -> None:
    """spec.vllm.inferencePool where the API server does not serve InferencePool: nothing else changes,
    and a Warning event says why there is no pool, once per generation."""
    generation = body["metadata"].get("generation")
    if not decision.pool_api_missing:
        state.pool_api_missing_warned = None  # served now (or no pool asked)
        return
    if state.pool_api_missing_warned == generation:
        return
    target = decision.target
    message = inferencepool.missing_message(target.vllm_name)
    logger.warning("%s/%s: %s", target.namespace, target.name, message)
    kube.post_event(body, "Warning", inferencepool.API_MISSING, message)
    state.pool_api_missing_warned = generation


MODEL_CACHE_DIFFERS = "ModelCacheDiffers"  # the Warning event's reason: the claim is kept as it was made


def _model_cache_claim(manifest: dict[str, Any], decision: Decision, body: Mapping[str, Any], state: Any,
                      logger: logging.Logger) -> None:
    """spec.vllm.modelCache.size: its claim created when absent, never applied over (a claim's spec
    is mostly immutable; a larger size only where the StorageClass expands: refused otherwise,
    which would stop every apply). What the spec declares that an existing one does not have
    (decision.model_cache_differs) is a Warning event, once per difference. Raises (the apply is
    retried) when a claim appears between the read and the create. Blocking."""
    meta, key, uid = manifest["metadata"], child_key(manifest), body["metadata"].get("uid")
    owners = runtime.CONTROLLER.child_owners
    if decision.model_cache_create:
        owners.pop(key, None)  # gone (or not its own after all): looked up again if the create finds one
        if not kube.create_if_absent(manifest):
            raise RuntimeError(f"PersistentVolumeClaim {meta['name']} appeared while applying; looking at it again")
        owners[key] = uid
        state.model_cache_differs = None
        logger.info("%s/%s: created PersistentVolumeClaim %s for the model's weights", meta["namespace"],
                    body["metadata"]["name"], meta["name"])
        return
    differs = decision.model_cache_differs
    if differs is not None and differs != state.model_cache_differs:
        message = (f"PersistentVolumeClaim {meta['name']} is kept as it was made: {differs}. A claim's spec is not "
                   "changed in place; to have it made anew (the weights are downloaded again): set spec.vllm.replicas to "
                   "0, delete the claim, then set the replicas back")
        logger.warning("%s/%s: %s", meta["namespace"], body["metadata"]["name"], message)
        kube.post_event(body, "Warning", MODEL_CACHE_DIFFERS, message)
    state.model_cache_differs = differs


def taken_recheck(key: tuple[str, str]) -> Refusal | None:
    """In a status refresh: NameTaken's (reason, message) while objects the operator did not make
    hold its names, and an apply (which looks them up again) once ownership.RETRY_S has passed:
    their holders carry none of the labels the drift watch selects, so nothing else says they went.
    Any other reason to apply meanwhile waits for the same moment (status_loop.may_apply), so a
    taken name costs no reads per tick."""
    state = runtime.CONTROLLER.held(key)
    if state.name_taken is not None and time.monotonic() >= state.name_taken_retry_at:
        state.drifted = True
    return state.name_taken


def _apply_owned(manifest: dict[str, Any]) -> None:
    with own_apply(manifest):
        applied = kube.apply(manifest)
        note_own_write(applied)
    metrics.inc("kvpersist_applies_total")


def clean_stale_routes(target: Target, seen: Seen, logger: logging.Logger) -> bool:
    """Deletes the per-id Services and policies of ids no pod of the resource carries any
    more; True once no pod of another id is left to wait for. Blocking: a worker thread."""
    in_use = ids_in_use([*seen.pods, *seen.untrusted_pods])  # a route outlives every pod that may use it
    selector = f"{INSTANCE_LABEL}={target.name},{COMPONENT_LABEL}={SERVER}"
    uid = ((runtime.CONTROLLER.held((target.namespace, target.name)).body or {}).get("metadata") or {}).get("uid")
    try:
        for api_version, kind in ROUTE_KINDS:
            # Only its own (a controller reference to it): labels alone are anyone's to copy.
            own = [o for o in kube.list_all(api_version, kind, target.namespace, selector)
                   if ownership.is_own_child(o.get("metadata"), uid)]
            for name in stale(target, own, in_use):
                kube.delete(api_version, kind, name, target.namespace)
                logger.info("%s/%s: deleted %s %s: no pod of its namespace id is left", target.namespace, target.name,
                            kind, name)
    except ApiException as exc:
        logger.warning("%s/%s: stale Services and policies not cleaned (%s); retrying", target.namespace, target.name,
                       exc.status)
        return False
    return not (in_use - {target.namespace_id})


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body).get("message", str(exc))
    except (TypeError, ValueError):
        return str(exc.reason)
