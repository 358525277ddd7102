"""The runtime half of each L2 backend, keyed like kvpersist.l2backends.BACKENDS (the spec half): what a
status refresh observes of its store, and how `kvpersist gc` deletes a namespace from it. Both call the
agents, the Hub or the API server, so they sit in the controller's layer."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from kvpersist.builders.target import L2_VOLUME, Target
from kvpersist.controller import agents, bucketcheck, retention, runtime
from kvpersist.controller.reading import named_claim
from kvpersist.inventory.bucket import remove_bucket_namespace
from kvpersist.inventory.cleanup import Recheck, bucket_refusal, gc_bucket, gc_volumes
from kvpersist.inventory.cleanup import result as gc_result
from kvpersist.inventory.space import claim_space_summary
from kvpersist.inventory.volume import one_per_location, status_summary
from kvpersist.status.workloads import Seen

Servers = list[tuple[str, str | None]]  # the running server pods, (name, IP), sorted by name


def observe_claims(body: Mapping[str, Any], target: Target, seen: Seen, running: Servers, token: str | None,
                   _secrets_usable: bool) -> dict[str, Any]:
    """NVMe: the claims from the watch cache, but a claim the user named, which carries none of the
    operator's labels, is read; and the agents' inventory of the volumes."""
    nvme = target.spec.l2.nvme
    assert nvme is not None
    if nvme.existing_claim_name:
        claim = named_claim(nvme.existing_claim_name, target.namespace)
        claims = [claim] if claim else []
    else:
        claims = [c for c in seen.server_claims() if target.shared_claim in (None, c["metadata"]["name"])]
    observed: dict[str, Any] = {"claims": claims, "existing_claim": nvme.existing_claim_name,
                                "budget_bytes": nvme.budget_bytes}
    if not target.cache_enabled:
        return observed
    volumes = []
    for (pod, _ip), inv in zip(running, agents.inventories(running, target.spec.lmcache_server.agent_port, token), strict=True):
        if inv is None:  # a partial inventory would make totals flap: keep the last whole one
            volumes = []
            break
        volumes.append((f"pvc/{target.shared_claim or nvme.existing_claim_name or f'{L2_VOLUME}-{pod}'}", pod, inv))
    volumes = one_per_location(volumes)  # a shared claim's folder counted once, not once per server
    removed = (retention.expire_orphans(body, target, volumes, [a for a in running if a[1]][:1] if target.shared else running,
                                        token, seen)
               if volumes and target.spec.l2.orphan_retention is not None else [])
    if volumes:
        observed["l2_space"] = claim_space_summary(volumes, target.namespace_id, seen.live_ids, time.time(),
                                                   (body.get("status") or {}).get("l2"), removed)
        observed["inventory"] = status_summary(volumes, target.namespace_id, set(seen.live_ids))
    return observed


def observe_bucket(body: Mapping[str, Any], target: Target, seen: Seen, running: Servers, token: str | None,
                   secrets_usable: bool) -> dict[str, Any]:
    """hfBucket: the prefix's listing and the preflight, each its off-path job's last answer, the token's
    Secret read at most once for both; neither while the Secrets the spec names are refused."""
    if not target.cache_enabled or not secrets_usable:
        return {}
    secret = bucketcheck.SecretOnce(target)
    inv = bucketcheck.bucket_inventory_of(target, secret)
    return {"inventory": status_summary([(inv.location, None, inv)], target.namespace_id, set(seen.live_ids)) if inv else None,
            "bucket_check": bucketcheck.bucket_check(target, secret)}


def remove_from_volumes(request: Mapping[str, str], target: Target, seen: Seen, recheck: Recheck) -> dict[str, Any]:
    """Through every running server's agent; one folder for all the servers (spec.l2.nvme.shared): one agent."""
    servers = [(pod, ip) for pod, ip in seen.running_servers() if ip]
    servers = servers[:1] if target.shared else servers
    return gc_volumes(request, servers, target.spec.lmcache_server.agent_port, agents.agent_token(target), recheck)


def remove_from_bucket(request: Mapping[str, str], target: Target, seen: Seen, recheck: Recheck) -> dict[str, Any]:
    """From the Hub, only from a bucket exclusive to this cluster, with the token (refused unread without
    secretLabel, when that is set)."""
    bucket = target.spec.l2.hf_bucket
    assert bucket is not None
    why = bucket_refusal(bucket.bucket_handle, bucket.exclusive_to_this_cluster)
    if why:
        return gc_result(request, "Refused", f"refused: {why}; nothing was deleted")
    token_secret = bucketcheck.SecretOnce(target)
    token = token_secret.token()
    if token is None:
        return gc_result(request, "Failed", token_secret.problem or f"Secret {bucket.token_secret_ref.name} "
                         f"has no key {bucket.token_secret_ref.key}: the bucket cannot be reached")
    outcome = gc_bucket(request, lambda nsid, before: remove_bucket_namespace(
        bucket.bucket_handle, token, nsid, endpoint=os.environ.get("HF_ENDPOINT"), dry_run=False,
        before_delete=before), bucket.bucket_handle, recheck)
    runtime.CONTROLLER.held((target.namespace, target.name)).bucket_inventory = None
    return outcome


# The Observation fields of the store (status.conditions), from what a refresh holds: its body, target,
# seen, running servers, the agents' token and whether the Secrets the spec names may be read (policy).
OBSERVE = {"nvme": observe_claims, "hfBucket": observe_bucket}
# A gc request's outcome (status.gc), the namespace id already judged unused; the recheck before each deletion.
CLEANUP = {"nvme": remove_from_volumes, "hfBucket": remove_from_bucket}
