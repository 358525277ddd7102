"""The running operator's reads for one apply, into a Snapshot (kvpersist.controller.decision, whose
staged orders them): the watch caches first, the API server where they have not listed. Functions and
closures that call the API directly, which tests/rbac_needs.py follows to the kinds they reach.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import secrets
from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from kvpersist.api import v1alpha1 as api
from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.builders.lmcache import agent_image
from kvpersist.builders.target import L2_KEY_BYTES, SERVER, Target
from kvpersist.builders.vllm import POOL_KIND
from kvpersist.controller import agentroll, fallback, inferencepool, kube, l2key, pincheck, runtime, sharing
from kvpersist.controller.decision import (
    Meta,
    Reads,
    Snapshot,
    child_key,
    key_target,
    names_to_read,
    route_keys,
    staged,
    written_target,
)
from kvpersist.controller.policy import named_secrets
from kvpersist.controller.reading import cached_name, hub_token, l2_claims, named_claim, parsed_model, read_key, watched_metadata
from kvpersist.controller.stale_routes import ROUTE_KINDS
from kvpersist.identity import key_fingerprint
from kvpersist.l2backends import backend_of
from kvpersist.status.workloads import COMPONENT_LABEL, WATCH_SELECTOR, Seen, unplaced_servers


def stores_from_api(target: Target) -> tuple[tuple[sharing.User, ...], tuple[Meta, ...]]:
    """Every resource's L2 store and the server pods, by LIST: a claim's namespace, or for a bucket
    every namespace the operator lists (runtime.listing_scopes). Raises ApiException."""
    if backend_of(target.spec.l2).namespaced:
        bodies = kube.list_all(api.API_VERSION, api.KIND, target.namespace)
        pods = kube.list_all("v1", "Pod", target.namespace, f"{WATCH_SELECTOR},{COMPONENT_LABEL}={SERVER}")
    else:
        bodies = [b for ns in runtime.listing_scopes() for b in kube.list_all(api.API_VERSION, api.KIND, ns)]
        pods = []
    return tuple(u for b in bodies if (u := sharing.user_of(b)) is not None), tuple(pods)


def _held(api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    """The metadata of the object under a name, or None: a Secret or ConfigMap by watched_metadata;
    else from the kind's metadata-only watch cache where it has listed (a route kind's keeps the labels
    route_conflicts reads), else by a metadata-only LIST of that name (the operator may list, not get, these kinds)."""
    if kind in ("Secret", "ConfigMap"):
        return watched_metadata(kind, name, namespace)
    synced, found = cached_name(kind, name, namespace)
    if synced:
        return found
    return kube.named_metadata(api_version, kind, name, namespace)


def _names(snap: Snapshot, again: bool = True) -> Snapshot:
    """Every name the apply writes that is not known as its own, the id's route names and the
    weights claim, and a user's shared claim: side by side on the apply pool (one after the other,
    they were a round trip each). Once more (again) where the routes show another id holding a route
    name: decide then writes other names in their place (names_to_read). Raises ApiException."""
    target = written_target(snap)
    manifests, token_secret = names_to_read(snap)
    pool = runtime.CONTROLLER.apply_pool
    known = snap.own | set(route_keys(target))  # the route names are listed below, own or not
    unknown = [m for m in manifests if child_key(m) not in known]
    if child_key(token_secret) not in known:
        unknown.append(token_secret)
    routes = []  # first: with more lookups than the pool has threads, the routes are not the ones to wait
    if target.cache_enabled:
        name = target.per_id_name(target.namespace_id)
        routes = [pool.submit(lambda api_version=api_version, kind=kind: _held(api_version, kind, name, target.namespace))
                  for api_version, kind in ROUTE_KINDS]
    lookups = [pool.submit(lambda m=manifest: _held(m["apiVersion"], m["kind"], m["metadata"]["name"], m["metadata"]["namespace"]))
               for manifest in unknown]
    cache_claim = target.model_cache_claim if any(m["kind"] == "PersistentVolumeClaim" for m in manifests) else None
    weights = pool.submit(lambda: kube.get("v1", "PersistentVolumeClaim", cache_claim, target.namespace)) if cache_claim else None
    shared = target.spec.l2.nvme.existing_claim_name if target.shared else None  # type: ignore[union-attr]
    user_claim = pool.submit(lambda: named_claim(shared, target.namespace)) if shared else None
    concurrent.futures.wait([*lookups, *routes, *(j for j in (weights, user_claim) if j is not None)])
    found: dict[tuple[str, str, str], Meta | None] = {}
    for obj, job in zip(unknown, lookups, strict=True):
        found[child_key(obj)] = job.result()
    for key, job in zip(route_keys(target), routes, strict=True):
        found[key] = job.result()
    whole = weights.result() if weights is not None else None
    if cache_claim:
        found["PersistentVolumeClaim", target.namespace, cache_claim] = dict((whole or {}).get("metadata") or {}) \
            if whole is not None else None
    read = dataclasses.replace(snap, names=found, model_cache_claim=whole,
                               named_claim=user_claim.result() if user_claim is not None else None)
    in_their_place, _token = names_to_read(read)
    unread = [m for m in in_their_place if child_key(m) not in found and child_key(m) not in known]
    return _names(read, again=False) if again and unread else read


def _pool_served(spec: KVCacheNamespaceSpec, own: frozenset[tuple[str, str, str]], namespace: str, name: str) -> bool:
    """Whether InferencePool is served (cached discovery), asked only for a resource that wants a pool
    or whose pool is known (to delete it once turned off): the others never pay a discovery."""
    if spec.vllm.inference_pool is None and (POOL_KIND, namespace, f"{name}-vllm") not in own:
        return False
    return inferencepool.served()


def policy_read(body: Mapping[str, Any], spec: KVCacheNamespaceSpec) -> Snapshot:
    """What decision.policy_refusal looks at, the first read of an apply and of a status round: the
    operator's policy and, with a secretLabel, the labels of the Secrets the spec names (the watch
    cache, else a request; never their data). Blocking."""
    snap = Snapshot(body=body, spec=spec, policy=runtime.CONTROLLER.policy)
    if snap.policy.secret_label is None:
        return snap
    labels: dict[str, Meta | None] = {}
    failed: dict[str, int | None] = {}
    for _field, name in named_secrets(spec):
        try:
            labels[name] = watched_metadata("Secret", name, body["metadata"]["namespace"])
        except ApiException as exc:
            failed[name] = exc.status
    return dataclasses.replace(snap, named_secrets=labels, unreadable_secrets=failed)


def read_snapshot(body: Mapping[str, Any], seen: Seen | None) -> tuple[Snapshot, bytes | None]:
    """The snapshot one apply of the running operator decides on, and a fresh key's bytes when the
    generated Secret is absent (the snapshot holds only their fingerprint; the apply creates the
    Secret from them, if decide makes it). Raises pydantic.ValidationError for a spec it cannot
    read, ApiException from a read. Blocking."""
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    spec = parsed_model(meta["name"], body.get("spec")).spec
    uid = meta.get("uid")
    own = frozenset(k for k, owner in list(runtime.CONTROLLER.child_owners.items()) if uid and owner == uid and k[1] == key[0])
    raw: list[bytes] = []  # a fresh key's bytes, drawn only when the generated Secret is absent

    def pins(snap: Snapshot) -> Snapshot:
        checking, files = pincheck.enabled(), runtime.CONTROLLER.pin_files
        facts = files.facts(spec, key[0], body.get("status"), checking)
        if checking and facts is not None and facts.values is None and pincheck.unset(spec.identity):  # briefly, first
            files.wait(spec.identity, lambda: setattr(runtime.CONTROLLER.held(key), "dirty", True), token=hub_token(spec, key[0]))
            facts = files.facts(spec, key[0], body.get("status"), checking)
        return dataclasses.replace(snap, pins=facts)

    def key_read(snap: Snapshot, base: Target) -> Snapshot:
        read = read_key(base, fresh=True)
        if read is not None and read.absent and read.generated:
            raw.append(secrets.token_bytes(L2_KEY_BYTES))
        return dataclasses.replace(snap, key=read, proposed_key=key_fingerprint(raw[0]) if raw else None)

    def stores(target: Target) -> tuple[tuple[sharing.User, ...], tuple[Meta, ...]]:
        if seen is not None and seen.stores is not None:  # the watch caches, else the API server
            return tuple(seen.stores), tuple(seen.all_server_pods)
        return stores_from_api(target)

    def names(snap: Snapshot) -> Snapshot:  # and what the operator holds for the id, the agent image the roll allows
        snap = _held_for(_names(snap), key_target(snap).namespace_id)
        return dataclasses.replace(snap, agent_image=agentroll.ROLLER.image_for(key, seen.fleet, body) if seen is not None
                                   else agent_image())

    snap = dataclasses.replace(policy_read(body, spec), own=own,
                    server_claims=tuple(seen.server_claims()) if seen is not None else None,
                    fallback_bypassed=runtime.CONTROLLER.fallback.bypassed(key),
                    inference_pool_served=_pool_served(spec, own, key[0], key[1]),
                    unplaced_servers=unplaced_servers(seen.pods, after_s=fallback.unplaced_after_s()) if seen is not None else 0,
                    agent_token=secrets.token_hex(32))  # used only if the token Secret is absent
    snap = staged(snap, Reads(l2_claims, key_read, stores, names, pins))
    return snap, raw[0] if raw else None


def _held_for(snap: Snapshot, nid: str | None) -> Snapshot:
    """What the running operator holds for the id the key names: a vLLM pod that refused its build
    (buildcheck), a cache hit that changed the canary's answer (canary)."""
    key = (snap.namespace, snap.name)
    build = runtime.CONTROLLER.build_bypass.detail(key, nid) if nid else None
    hit = runtime.CONTROLLER.canary.standing(key, snap.body, nid) if nid else None
    return dataclasses.replace(snap, build_refused={nid: build} if nid and build is not None else {},
                               hit_mismatch={nid: str(hit.get("id"))} if nid and hit is not None else {})


def refreshed(last: Snapshot, policy: Snapshot, key: l2key.KeyRead | None, seen: Seen) -> Snapshot:
    """The last apply's snapshot with what the status refresh sees now, for decide to judge again
    (docs/design.md): what only a request shows stays as that apply read it, but for the route names
    while another id holds one. No fresh key is offered: an absent one leaves no id. Blocking."""
    key_ = (policy.namespace, policy.name)
    spec = policy.spec
    try:
        served = _pool_served(spec, last.own, key_[0], key_[1])
    except Exception:  # refused, or no answer: as last read, asked again next refresh
        served = last.inference_pool_served
    nvme = spec.l2.nvme
    shared = nvme.existing_claim_name if nvme is not None and nvme.shared else None
    snap = dataclasses.replace(
        last, body=policy.body, spec=spec, policy=policy.policy, named_secrets=policy.named_secrets,
        unreadable_secrets=policy.unreadable_secrets, key=key, proposed_key=None,
        pins=runtime.CONTROLLER.pin_files.facts(spec, key_[0], policy.body.get("status"), pincheck.enabled()),
        server_claims=tuple(seen.server_claims()), named_claim=named_claim(shared, key_[0]) if shared else None,
        fallback_bypassed=runtime.CONTROLLER.fallback.bypassed(key_), inference_pool_served=served,
        unplaced_servers=unplaced_servers(seen.pods, after_s=fallback.unplaced_after_s()))
    if seen.stores is not None:
        snap = dataclasses.replace(snap, stores=tuple(seen.stores), server_pods=tuple(seen.all_server_pods))
    target = key_target(snap)
    nid = target.namespace_id
    if target.cache_enabled and runtime.CONTROLLER.held(key_).route_taken is not None:
        name = target.per_id_name(nid)
        try:
            routes = {(kind, target.namespace, name): _held(api_version, kind, name, target.namespace)
                      for api_version, kind in ROUTE_KINDS}
        except ApiException:  # as that apply read them: asked again next refresh
            routes = {}
        snap = dataclasses.replace(snap, names={**snap.names, **routes})
    return _held_for(snap, nid)
