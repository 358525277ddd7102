"""What one apply of a KVCacheNamespace decides: decide(Snapshot), pure (no I/O, state, environment
or chance: a fresh token, the agent image and the chart's settings come in the snapshot), so the
operator and `kvpersist plan` act on the same verdict (docs/design.md).

The rules, in the order a user would fix them, each stopping what follows:
1. the operator's policy (ImageNotAllowed, SecretNotAllowed): nothing else is read, the key's data included;
2. an L2 claim under a derived name that is not the operator's (ClaimNotOwned): no key made for nothing;
3. the L2 key (l2key): a generated one is made when absent unless data sealed with the last one exists
   (L2KeyLost); its fingerprint is in the namespace id; a fresh key's bytes never enter the snapshot;
4. an L2 store an older resource holds (StorageInUse: sharing): applied with the cache off; else the
   id's route names another id's objects hold (RouteNameTaken: stale_routes): applied without those
   routes, vLLM without the cache;
5. a name held by an object the operator did not make (NameTaken: ownership): nothing applied.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.builders import vllm
from kvpersist.builders.all import build_all
from kvpersist.builders.lmcache import build_shared_claim
from kvpersist.builders.retained import build_agent_token_secret
from kvpersist.builders.target import Target
from kvpersist.controller import fallback, l2key, ownership, pincheck, sharing
from kvpersist.controller.policy import (
    SECRET_NOT_ALLOWED,
    Policy,
    Refusal,
    image_refusal,
    named_secrets,
    refused_status,
    secret_refusal,
)
from kvpersist.controller.stale_routes import ROUTE_KINDS, ROUTE_TAKEN, route_conflicts, route_taken_message
from kvpersist.identity import L2_KEY_PIN, Resolution, resolve
from kvpersist.l2backends import backend_of
from kvpersist.status.conditions import condition, shareable

ChildKey = tuple[str, str, str]  # (kind, namespace, name): child_key
Meta = Mapping[str, Any]

# (apiVersion, kind, suffix to the resource's name, why) of names an apply may not write: its own
# object under one it does not write is deleted (dropped), a user's never. A literal table:
# tests/rbac_needs.py derives the delete grants from it (kvpersist.controller.apply).
SWITCHED_OFF = (("v1", "Service", "-vllm", "spec.vllm.service is off"),  # Target.vllm_name
                (vllm.POOL_API_VERSION, vllm.POOL_KIND, "-vllm", "spec.vllm.inferencePool is off"),
                ("policy/v1", "PodDisruptionBudget", "-lmcache", "one lmcache server: a budget of one "
                 "disruption limits nothing (builders.lmcache.build_server_pdb)"))
# Names earlier versions made and this one writes no more. <name>-lmcache (Target.server_name) is still
# the policy of every server with the cache off or the route name taken (builders.lmcache.build_network_policy).
RETIRED = (("networking.k8s.io/v1", "NetworkPolicy", "-lmcache", "one NetworkPolicy per namespace id replaced it"),
           ("v1", "ConfigMap", "-connection", "no longer made: status.namespaceId shows the namespace id"),
           ("v1", "Service", "-lmcache-metrics", "no longer made: nothing resolved the servers by it, and "
            "Prometheus scrapes their pods (the chart's PodMonitor)"))
DROPPABLE = SWITCHED_OFF + RETIRED

# Decision.stage when refused: what was decided before the refusal.
POLICY, CLAIMS, NAMES = "policy", "claims", "names"


def child_key(obj: Mapping[str, Any]) -> ChildKey:
    meta = obj.get("metadata") or {}
    return obj.get("kind", ""), meta.get("namespace", ""), meta.get("name", "")


@dataclass(frozen=True)
class Snapshot:
    """Everything one apply looks at, read before anything is decided. A field left None was not
    read: the rules before it refused (nothing past the policy is read for a refused resource)."""

    body: Mapping[str, Any]  # the KVCacheNamespace as stored (metadata.uid, creationTimestamp, status)
    spec: KVCacheNamespaceSpec  # its spec, parsed
    policy: Policy = field(default_factory=Policy)
    pins: pincheck.Facts | None = None  # what the model's files say of its pins (None: no revision to read them at)
    # The Secrets the spec names (policy.named_secrets), read only with a secretLabel: each one's
    # metadata or None (absent); the API server's status code for one that could not be read.
    named_secrets: Mapping[str, Meta | None] = field(default_factory=dict)
    unreadable_secrets: Mapping[str, int | None] = field(default_factory=dict)
    l2_claims: Mapping[str, Meta | None] | None = None  # ownership.l2_claim_names, each as it exists or None
    key: l2key.KeyRead | None = None  # the L2 key Secret as read (None: not encrypted, or not read)
    proposed_key: str | None = None  # the fingerprint of a fresh key, offered when the generated Secret is absent
    server_claims: tuple[Meta, ...] | None = None  # the resource's own L2 claims (a lost key's evidence); None: unknown
    named_claim: Meta | None = None  # spec.l2.nvme.existingClaimName's claim with shared (one server unless RWX)
    stores: tuple[sharing.User, ...] | None = None  # every other resource's L2 store; None: not read
    server_pods: tuple[Meta, ...] = ()  # lmcache server pods (any resource's): who still mounts a claim
    names: Mapping[ChildKey, Meta | None] = field(default_factory=dict)  # what holds each name looked up (None: free)
    own: frozenset[ChildKey] = frozenset()  # names known to hold this resource's own objects: not looked up
    model_cache_claim: Meta | None = None  # the existing weights claim, whole (its spec is compared)
    fallback_bypassed: bool = False  # vLLM runs without the cache: its servers are away (controller.fallback)
    build_refused: Mapping[str, str] = field(default_factory=dict)  # namespace id -> what a refusing vLLM said
    hit_mismatch: Mapping[str, str] = field(default_factory=dict)  # namespace id -> the canary's HitMismatch id
    agent_image: str | None = None  # the agent image the roll allows this apply (controller.agentroll)
    agent_token: str = ""  # a fresh token, minted by the reader, for the agent token Secret if absent (none: plan)
    inference_pool_served: bool = False  # the API server serves InferencePool (controller.inferencepool)
    unplaced_servers: int = 0  # its server pods no node can take (status.workloads.unplaced_servers)

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.body["metadata"]["namespace"])

    @property
    def uid(self) -> str | None:
        return self.body["metadata"].get("uid")


@dataclass(frozen=True)
class Decision:
    """The verdict on one snapshot. refusal set: nothing is applied (stage says at which rule);
    else the objects, in order, and what the apply records."""

    target: Target  # as applied (the cache off for StorageInUse, no routes for RouteNameTaken)
    refusal: Refusal | None = None
    stage: str = ""
    phase: str | None = None  # status.phase a refusal or StorageInUse writes
    conditions: tuple[dict[str, Any], ...] = ()  # what status shows for a refusal or a store/route held
    key: l2key.KeyRead | None = None  # the key as judged (L2KeyLost in place of L2KeyPending)
    key_lost: l2key.Loss | None = None
    generated_key: str | None = None  # the fresh key's fingerprint: its Secret is created by this apply
    key_id: str | None = None  # what the spec and the key resolve to (before StorageInUse turns it off)
    storage_refused: str | None = None  # StorageInUse's message
    route_taken: str | None = None  # RouteNameTaken's message
    token_secret: dict[str, Any] | None = None  # created when absent, never applied over
    manifests: tuple[dict[str, Any], ...] = ()  # build_all's order: policies, StatefulSet, ..., vLLM
    shared_claim: dict[str, Any] | None = None  # created when absent (spec.l2.nvme.shared with size)
    model_cache_create: bool = False  # the weights claim is absent: created (a manifest of its own kind in manifests)
    model_cache_differs: str | None = None  # what its spec declares that the existing claim lacks
    drops: tuple[ChildKey, ...] = ()  # its own objects under DROPPABLE names this apply does not write: deleted
    pool_api_missing: bool = False  # spec.vllm.inferencePool set, the API not served: a Warning event says so
    owned: tuple[ChildKey, ...] = ()  # names looked up and found its own: not looked up again
    unchecked: tuple[ChildKey, ...] = ()  # names the snapshot lacks: judged free, said by the plan
    view: str = ""  # applied_view's digest, kept when the manifests are dropped (kept)

    @property
    def applies(self) -> bool:
        return self.refusal is None

    def applied_view(self) -> str:
        """A digest of what acting on it would write or keep from writing: two decisions with the
        same view apply the same (the status refresh applies again when its own differs from the
        last apply's)."""
        if self.view:
            return self.view
        # A key to make that this decision, applying, does not make (the refresh offers no fresh key).
        pending = self.applies and self.generated_key is None and self.key is not None and self.key.problem is not None \
            and self.key.problem[0] == l2key.KEY_PENDING
        view = (self.stage, self.refusal, self.key_id, pending, self.storage_refused, self.route_taken, self.manifests,
                self.shared_claim, self.drops, self.pool_api_missing)
        return hashlib.sha256(json.dumps(view, sort_keys=True, default=str).encode()).hexdigest()

    def kept(self) -> Decision:
        """What the operator keeps of it between rounds: its view's digest, not the manifests (80 KB
        of JSON, the server's program text most of it: two kept a resource cost ~100 MiB at 500),
        nor the agent token."""
        return dataclasses.replace(self, view=self.applied_view(), manifests=(), token_secret=None, shared_claim=None)


def target_for(name: str, namespace: str, spec: KVCacheNamespaceSpec, fingerprint: str | None,
               pins: pincheck.Facts | None = None) -> tuple[Target, Resolution]:
    """The builders' view, its unset pins filled from the model's files (pincheck.filled), and the
    reason its identity is incomplete (if it is), with the key's fingerprint (without it an
    encrypted resource has no namespace id) and the pin check's verdict."""
    spec, unresolved = pincheck.filled(spec, pins)
    res = resolve(spec.pins(fingerprint))
    if pins is not None and pins.mismatch is not None and res.namespace_id is not None:
        res = dataclasses.replace(res, namespace_id=None, blocked=(pincheck.MISMATCH, pins.mismatch))
    elif unresolved is not None and res.namespace_id is None:
        rest = Resolution(None, tuple(p for p in res.missing if p not in pincheck.FILLED), res.invalid)
        res = dataclasses.replace(res, blocked=(pincheck.UNRESOLVED, "; ".join(filter(None, (unresolved, rest.reason)))))
    fingerprint = (res.canonical or {}).get(L2_KEY_PIN) if res.namespace_id else None
    return Target(name, namespace, spec, res.namespace_id, key_fingerprint=fingerprint), res


def _target(snap: Snapshot, fingerprint: str | None) -> Target:
    target = target_for(snap.name, snap.namespace, snap.spec, fingerprint, snap.pins)[0]
    return dataclasses.replace(target, inference_pool_served=snap.inference_pool_served, unplaced_servers=snap.unplaced_servers,
                               cluster_domain=snap.policy.cluster_domain or target.cluster_domain)


def unreadable_secret(field_: str, name: str, status: int | None) -> Refusal:
    """SecretNotAllowed while a named Secret's labels cannot be read: it is not used meanwhile."""
    return SECRET_NOT_ALLOWED, (f"{field_}: Secret {name}: its labels could not be read (the API server answered "
                                f"{status}), so it is not used; retrying")


def policy_refusal(snap: Snapshot) -> Refusal | None:
    """ImageNotAllowed or SecretNotAllowed (kvpersist.controller.policy), or None."""
    refused = image_refusal(snap.spec, snap.policy.allowed_images)
    if refused is not None or snap.policy.secret_label is None:
        return refused
    for field_, name in named_secrets(snap.spec):
        if name in snap.unreadable_secrets:
            return unreadable_secret(field_, name, snap.unreadable_secrets[name])
        refused = secret_refusal(field_, name, snap.namespace, snap.named_secrets.get(name), snap.policy.secret_label)
        if refused is not None:
            return refused
    return None


def used_key(snap: Snapshot) -> tuple[l2key.KeyRead | None, l2key.Loss | None, str | None]:
    """The key the apply would use, judged: L2KeyLost in place of L2KeyPending when the generated
    Secret is gone over data sealed with it (l2key.loss), then not made again; else, the generated
    Secret absent, a fresh key whose fingerprint is the third item."""
    key = snap.key
    if key is None or not key.absent or not key.generated:
        return key, None, None
    meta = snap.body["metadata"]
    claims = list(snap.server_claims) if snap.server_claims is not None else None
    lost = l2key.loss(snap.body.get("status"), key, meta.get("annotations"), claims)
    if lost is not None:
        problem = (l2key.KEY_LOST, l2key.loss_message(lost, meta["name"], meta["namespace"]))
        return dataclasses.replace(key, problem=problem), lost, None
    if snap.proposed_key is not None:
        return dataclasses.replace(key, fingerprint=snap.proposed_key, problem=None, absent=False), None, snap.proposed_key
    return key, None, None


def storage_refusal(target: Target, created: str, stores: tuple[sharing.User, ...],
                    pods: tuple[Meta, ...] | list[Meta]) -> str | None:
    """StorageInUse's message when another resource holds this one's claim or bucket prefix
    (kvpersist.controller.sharing), else None. stores: every resource's store; pods: server pods.
    Claims are namespaced (that namespace's resources and servers); a bucket prefix is global."""
    me = sharing.user(target.namespace, target.name, created, target.spec, target.namespace_id)
    namespaced = backend_of(target.spec.l2).namespaced
    if not namespaced and not target.namespace_id:
        return None
    users = [u for u in stores if not namespaced or u.namespace == target.namespace]
    mounted = [p for p in pods if (p.get("metadata") or {}).get("namespace") == target.namespace] if namespaced else []
    return sharing.refusal(me, users, mounted)


def route_keys(target: Target) -> list[ChildKey]:
    """The id's route names (a Service and a NetworkPolicy), looked up at every apply, own or not:
    an object of another id of this very resource may hold one (8 hex of the id)."""
    if not target.cache_enabled:
        return []
    name = target.per_id_name(target.namespace_id)
    return [(kind, target.namespace, name) for _, kind in ROUTE_KINDS]


def dropped(target: Target, manifests: list[dict[str, Any]], own: frozenset[ChildKey], pool_served: bool) -> tuple[ChildKey, ...]:
    """Its own objects (known as such: watch events, an apply) under DROPPABLE names this apply does
    not write: spec.vllm.service or spec.vllm.inferencePool (where served: else there is none) turned
    off, and earlier versions' (RETIRED). A user's object under the name is never touched."""
    written = {child_key(m) for m in manifests}
    keys = [(kind, target.namespace, target.name + suffix) for _api_version, kind, suffix, _why in DROPPABLE
            if pool_served or kind != vllm.POOL_KIND]
    return tuple(key for key in keys if key in own and key not in written)


def _token_secret(target: Target, snap: Snapshot) -> dict[str, Any]:
    secret = build_agent_token_secret(target, snap.agent_token)  # before the agents, which read it at start
    secret["metadata"]["labels"].update(snap.policy.generated_secret_labels())
    return ownership.owned_by(secret, snap.body)


def key_target(snap: Snapshot) -> Target:
    """The target with the key the apply would use (its fingerprint names the id)."""
    key, _lost, _made = used_key(snap)
    return _target(snap, key.fingerprint if key is not None else None)


def written_target(snap: Snapshot) -> Target:
    """The target whose names the apply writes, once the key and the stores are read (and the route
    names, where snap.names holds them): decide's, as _exclusive leaves it."""
    return _exclusive(key_target(snap), snap, [])[0]


def names_to_read(snap: Snapshot) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The manifests and the agent token Secret whose names the snapshot must hold (written_target's;
    snapshot._names says how each is read). Where snap.names shows another id holding a route name
    (so read the routes first), also the policy of every server decide builds in their place."""
    target = written_target(snap)
    return build_all(target, operator_ns=""), _token_secret(target, snap)


def _exclusive(target: Target, snap: Snapshot, unchecked: list[ChildKey]) -> tuple[Target, str | None, str | None]:
    """The target as it may run alone: a store an older resource holds turns the cache off
    (StorageInUse); route names another id's objects hold leave the routes out (RouteNameTaken)."""
    if not target.cache_enabled:
        return target, None, None
    created = str(snap.body["metadata"].get("creationTimestamp") or "")
    storage = storage_refusal(target, created, snap.stores or (), snap.server_pods)
    if snap.stores is None:
        unchecked.append(("KVCacheNamespace", target.namespace, "*"))
    if storage is not None:
        return dataclasses.replace(target, namespace_id=None), storage, None
    found = []
    for kind, ns, name in route_keys(target):
        if (kind, ns, name) not in snap.names:
            unchecked.append((kind, ns, name))
        elif (meta := snap.names[kind, ns, name]) is not None:
            found.append((kind, {"metadata": dict(meta)}))
    conflicts = route_conflicts(target, found)
    if not conflicts:
        return target, None, None
    taken = route_taken_message(target, conflicts)
    return dataclasses.replace(target, routes=False, cache_bypassed=True,
                               bypass_reason=f"route name {target.per_id_name(target.namespace_id)} is taken"), None, taken


def _names(manifests: list[dict[str, Any]], snap: Snapshot) -> tuple[list[tuple[str, str]], list[ChildKey], list[ChildKey]]:
    """(kind, name) of each object under the apply's names that is not this resource's own; the
    names found its own; the names the snapshot lacks."""
    taken, owned, unchecked = [], [], []
    for manifest in manifests:
        key = child_key(manifest)
        if snap.uid is not None and key in snap.own:
            continue
        if key not in snap.names:
            unchecked.append(key)
            continue
        meta = snap.names[key]
        if meta is None:
            continue  # free: the apply creates it
        if ownership.is_own_child(meta, snap.uid):
            owned.append(key)
        else:
            taken.append((manifest["kind"], manifest["metadata"]["name"]))
    return taken, owned, unchecked


def refusal_conditions(refusal: Refusal, namespace_id: str | None, generation: int | None,
                       storage: bool = False) -> tuple[str, tuple[dict[str, Any], ...]]:
    """(phase, conditions) status writes for a refusal, by the same functions the status refresh
    uses (policy.refused_status, sharing.refused_status): what `kvpersist plan` shows."""
    placeholders = [condition(t, None, "") for t in ("L2Ready", "Ready", "LMCacheReady")]
    if storage:
        fields, conds = sharing.refused_status({}, placeholders, namespace_id, refusal[1], generation)
    else:
        fields, conds = refused_status({}, placeholders, refusal, generation)
    return str(fields.get("phase")), tuple(c for c in conds if c.get("reason") == refusal[0])


@dataclass(frozen=True)
class Reads:
    """Where a snapshot's reads come from, each step of staged: the running operator's watch caches
    and ServiceAccount (read_snapshot), or the user's credentials (`kvpersist plan`, kvpersist.plancmd)."""

    claims: Callable[[Target], Mapping[str, Meta | None]]  # the L2 claims under derived names, each or None
    key: Callable[[Snapshot, Target], Snapshot]  # the key as read, a fresh one's fingerprint offered if absent
    stores: Callable[[Target], tuple[tuple[sharing.User, ...], tuple[Meta, ...]]]  # every resource's store, server pods
    names: Callable[[Snapshot], Snapshot]  # what holds each name the apply writes, the weights and shared claims
    pins: Callable[[Snapshot], Snapshot] = lambda snap: snap  # what the model's files say (read_snapshot: the Hub)


def staged(snap: Snapshot, reads: Reads) -> Snapshot:
    """snap, its policy read (snapshot.policy_read), with what the later rules look at, in decide's order
    and each only as far as the rules before it let it (the module's list). Raises ApiException. Blocking."""
    if policy_refusal(snap) is not None:
        return snap
    snap = reads.pins(snap)
    base = Target(snap.name, snap.namespace, snap.spec, None)
    snap = dataclasses.replace(snap, l2_claims=dict(reads.claims(base)))
    if ownership.claim_refusal(base, snap.l2_claims or {}) is not None:
        return snap
    snap = reads.key(snap, base)
    target = key_target(snap)
    if target.cache_enabled:
        users, pods = reads.stores(target)
        snap = dataclasses.replace(snap, stores=users, server_pods=pods)
    return reads.names(snap)


def decide(snap: Snapshot) -> Decision:
    """The whole verdict on one snapshot (see the module's docstring for the order of the rules)."""
    generation = snap.body["metadata"].get("generation")
    base = _target(snap, None)
    key, lost, made = used_key(snap)  # judged before the refusals too: the status refresh shows it
    for stage, rule in ((POLICY, policy_refusal), (CLAIMS, lambda s: ownership.claim_refusal(base, s.l2_claims or {}))):
        refused = rule(snap)
        if refused is not None:
            phase, conds = refusal_conditions(refused, None, generation)
            return Decision(base, refused, stage, phase, conds, key=key, key_lost=lost)
    unchecked: list[ChildKey] = [("PersistentVolumeClaim", snap.namespace, n) for n in ownership.l2_claim_names(base)
                                 if snap.l2_claims is None]
    target = _target(snap, key.fingerprint if key is not None else None)
    key_id = target.namespace_id
    # vLLM without the cache: its servers away, a vLLM pod that refused its build for this id, or a
    # cache hit that changed the canary's answer (status.canary) until acknowledged.
    build = snap.build_refused.get(key_id) if key_id else None
    hit = snap.hit_mismatch.get(key_id) if key_id else None
    target = dataclasses.replace(target, cache_bypassed=snap.fallback_bypassed or build is not None or hit is not None)
    if build is not None:
        target = dataclasses.replace(target, bypass_reason="a vLLM pod refused its lmcache/vLLM build")
    if hit is not None:
        target = dataclasses.replace(target, bypass_reason=f"a cache hit changed the canary's answer (HitMismatch {hit})")
    target, storage, route = _exclusive(target, snap, unchecked)
    conds: tuple[dict[str, Any], ...] = ()
    phase = None
    if storage is not None:
        phase, conds = refusal_conditions((sharing.STORAGE_IN_USE, storage), key_id, generation, storage=True)
    elif route is not None:
        conds = (condition(fallback.CONDITION, True, ROUTE_TAKEN, route, generation),)
    elif key is not None and key.problem is not None and key.fingerprint is None:
        conds = (condition("L2Ready", False, key.problem[0], key.problem[1], generation),)
    # spec.l2.nvme.shared on a user's claim known not to be ReadWriteMany (ClaimNotShared): one server
    # only, since the others, on other nodes, could never mount it. Not found: the spec stands.
    nvme = target.spec.l2.nvme
    if (nvme is not None and nvme.shared and nvme.existing_claim_name and target.cache_enabled
            and snap.named_claim is not None and not shareable(snap.named_claim)):
        target = dataclasses.replace(target, max_servers=1)
    token_secret = _token_secret(target, snap)
    if snap.agent_image is not None:
        target = dataclasses.replace(target, agent_image=snap.agent_image)
    manifests = build_all(target, snap.policy.operator_namespace, snap.policy.metrics_scraper)
    for manifest in manifests:
        ownership.owned_by(manifest, snap.body)
    taken, owned, missing = _names([*manifests, token_secret], snap)
    unchecked += missing
    common = {"key": key, "key_lost": lost, "generated_key": made, "key_id": key_id, "storage_refused": storage,
              "route_taken": route, "owned": tuple(owned), "unchecked": tuple(unchecked)}
    if taken:
        refusal = (ownership.NAME_TAKEN, ownership.taken_message(target.name, target.namespace, taken))
        phase, conds = refusal_conditions(refusal, None, generation)
        return Decision(target, refusal, NAMES, phase, conds, **common)
    shared = build_shared_claim(target) if target.cache_enabled else None
    if shared is not None and target.spec.l2.nvme is not None and target.spec.l2.nvme.reclaim_policy == "Delete":
        ownership.owned_by(shared, snap.body)
    create_cache, differs = False, None
    cache_manifest = next((m for m in manifests if m["kind"] == "PersistentVolumeClaim"), None)
    if cache_manifest is not None:
        existing = snap.model_cache_claim
        if existing is None or not ownership.is_own_child(existing.get("metadata"), snap.uid):
            create_cache = True
        else:
            differs = "; ".join(vllm.claim_differences(cache_manifest, dict(existing))) or None
    wants_pool = vllm.build_inference_pool(target) is not None
    return Decision(target, None, "", phase, conds, token_secret=token_secret, manifests=tuple(manifests),
                    shared_claim=shared, model_cache_create=create_cache, model_cache_differs=differs,
                    drops=dropped(target, manifests, snap.own, snap.inference_pool_served),
                    pool_api_missing=wants_pool and not snap.inference_pool_served, **common)

