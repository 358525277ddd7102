"""What outlives a resource, as each status refresh keeps it: its generated key Secret and its
claims kept out of GitOps prunes, a claim it needs made again when deleted, and the age limit on
other namespaces' folders on its claims (spec.l2.orphanRetention).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from kvpersist.builders.retained import protect_patch
from kvpersist.builders.target import SERVER, Target
from kvpersist.controller import inuse, kube, l2key, metrics, runtime
from kvpersist.inventory.agentclient import request_expire
from kvpersist.inventory.space import judge_expiry
from kvpersist.inventory.volume import Inventory
from kvpersist.status.workloads import COMPONENT_LABEL, Seen

EXPIRE_PERIOD_S = 600.0  # an age-limit pass at most this often per resource: it lists the cluster per removal
EXPIRE_MAX_PER_PASS = 16  # folder removals asked (each listed for right before) in one pass; the rest wait for the next


def expire_orphans(body: Mapping[str, Any], target: Target, volumes: list[tuple[str, str | None, Inventory]],
                   agents: list[tuple[str, str | None]], token: str | None, seen: Seen) -> list[dict[str, Any]]:
    """spec.l2.orphanRetention: other namespaces' folders unwritten for maxAgeDays removed, one per request,
    each by the agent whose scan holds it, which judges the age again itself. Who uses it is listed right
    before each request (inuse.in_use_now; a failed listing refuses): one check before all the passes let
    a later agent remove a namespace in use by then (issue 39). Blocking; rate- and count-limited."""
    state = runtime.CONTROLLER.held((target.namespace, target.name))
    now = time.monotonic()
    if now - state.expired_at < EXPIRE_PERIOD_S or token is None or target.namespace_id is None:
        return []
    state.expired_at = now
    retention = target.spec.l2.orphan_retention
    assert retention is not None
    protected = set(seen.live_ids) | {target.namespace_id}
    ips = {pod: ip for pod, ip in agents if ip}
    asks = [(pod, v.namespace.namespace_id) for _loc, pod, inv in volumes if pod in ips
            for v in judge_expiry(sorted(inv.namespaces, key=lambda n: n.namespace_id), target.namespace_id,
                                  frozenset(protected), retention.max_age_days, time.time()) if v.removable]
    removed: list[dict[str, Any]] = []
    failed: set[str] = set()  # an agent that refused or did not answer is not asked again this pass
    for pod, nsid in asks[:EXPIRE_MAX_PER_PASS]:
        if nsid in protected or pod in failed:
            continue
        if inuse.in_use_now(nsid, target.namespace_id) is not None:
            protected.add(nsid)
            continue
        code, answer = request_expire(ips[pod], target.spec.lmcache_server.agent_port, retention.max_age_days,
                                      sorted(protected), [nsid], token=token)
        if code != 200:
            failed.add(pod)
            logging.getLogger("kvpersist").warning("%s/%s: the agent of %s refused the age-limit pass (HTTP %s): %s",
                                                   target.namespace, target.name, pod, code, answer.error)
            continue
        for n in answer.removed:
            removed.append({"namespaceId": n.namespace_id, "bytes": n.bytes or 0, "objects": n.objects or 0})
            kube.post_event(body, "Normal", "OrphanExpired",
                            f"removed namespace folder {n.namespace_id} from the claim of {pod}: {n.bytes or 0} bytes in "
                            f"{n.objects or 0} files, none written for over {retention.max_age_days} days "
                            "(spec.l2.orphanRetention.maxAgeDays); no live resource or server used it")
            metrics.inc("kvpersist_events_total")
    if removed:
        state.dirty = True  # the next refresh's scans show the freed space
    return removed


def protect_retained(target: Target, read: l2key.KeyRead | None, seen: Seen, logger: logging.Logger) -> None:
    """Keeps what outlives the resource out of GitOps prunes (kvpersist.builders.retained): the generated
    key Secret and the StatefulSet's claims, each patched once, metadata only; the claims also record
    the key fingerprint their data needs. A failure is logged and tried again later. Blocking."""
    state = runtime.CONTROLLER.held((target.namespace, target.name))
    if read is not None and read.generated and read.metadata is not None:
        patch = protect_patch(read.metadata, target.name)
        if patch is not None:
            try:
                kube.patch_metadata("v1", "Secret", read.secret, target.namespace, patch)
                logger.info("%s/%s: Secret %s kept out of GitOps prunes (labels and annotations)", target.namespace,
                            target.name, read.secret)
            except ApiException as exc:
                logger.warning("%s/%s: Secret %s not protected from prunes (%s); retrying", target.namespace,
                               target.name, read.secret, exc.status)
        if state.key_read is not None and state.key_read[1] == read:  # judged: not again until the next read
            state.key_read = (state.key_read[0], dataclasses.replace(read, metadata=None))
    fingerprint = read.fingerprint if read is not None and target.namespace_id is not None else None
    protect_claims([(c, target.name) for c in seen.server_claims()], fingerprint, logger)


def made_claim_missing(target: Target, seen: Seen) -> bool:
    """Whether a claim the operator makes (the weights' for spec.vllm.modelCache.size, the one of
    spec.l2.nvme.shared with a size) is not in the claims' watch cache: deleted (no drift watch on claims:
    L2's change status all the time), the next apply makes it again (empty), as a StatefulSet would."""
    cache, nvme = target.spec.vllm.model_cache, target.spec.l2.nvme
    made = [target.model_cache_claim] if cache is not None and cache.size is not None else []
    if nvme is not None and nvme.shared and nvme.size is not None and target.cache_enabled:
        made.append(target.shared_claim)
    held = {c["metadata"]["name"] for c in seen.claims}
    return any(name not in held for name in made)


def protect_claims(claims: list[tuple[Mapping[str, Any], str]], fingerprint: str | None, logger: logging.Logger) -> None:
    """Patches each (claim, owner name) that needs it, at most once per resourceVersion. Blocking."""
    for claim, owner in claims:
        meta = claim.get("metadata") or {}
        where = (meta.get("namespace", ""), meta.get("name", ""))
        patch = protect_patch(meta, owner, fingerprint)
        if patch is None or runtime.CONTROLLER.claims_protected.get(where) == (meta.get("resourceVersion"), fingerprint):
            continue
        try:
            kube.patch_metadata("v1", "PersistentVolumeClaim", where[1], where[0], patch)
        except ApiException as exc:
            logger.warning("claim %s/%s not protected from prunes (%s); retrying", where[0], where[1], exc.status)
            continue
        runtime.CONTROLLER.claims_protected[where] = (meta.get("resourceVersion"), fingerprint)
        logger.info("claim %s/%s kept out of GitOps prunes%s", where[0], where[1],
                    f" (its data needs L2 key {fingerprint})" if fingerprint else "")


def orphan_claims() -> list[tuple[Mapping[str, Any], str]]:
    """Claims of the operator's StatefulSets whose resource is gone (or not seen yet) and that are
    not protected from prunes yet: a claim retained from before this version. Event loop only."""
    known = runtime.CONTROLLER.known()
    return [(claim, key[1]) for key, store in list(runtime.CONTROLLER.indices.get("kvp_claims", {}).items())
            if key not in known for claim in list(store)
            if claim["metadata"]["labels"].get(COMPONENT_LABEL) == SERVER and protect_patch(claim["metadata"], key[1])]

