"""One L2 store, one KVCacheNamespace: a second user of a claim or of a bucket prefix is refused.

Nothing in the schema stops two resources from naming the same store, and then each inventory agent
trims it to its own capacity, deleting the other's live chunks, and with two keys each reads the
other's objects as misses. So a store has one user: the oldest resource naming it (creationTimestamp,
then namespace and name: the same answer from every replica, never flapping); every other one is
refused (StorageInUse), its servers at zero and its data untouched, until the holder goes and no other
resource's server pod mounts the claim. Pure decisions; kvpersist.controller.apply acts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.builders.target import L2_VOLUME, SERVER, SHARED_CLAIM_SUFFIX
from kvpersist.l2backends import backend_of, stored_backend
from kvpersist.status.conditions import condition
from kvpersist.status.workloads import COMPONENT_LABEL, INSTANCE_LABEL

STORAGE_IN_USE = "StorageInUse"
RELEASED = "StorageReleased"  # the Normal event once the refusal is gone


@dataclass(frozen=True)
class User:
    """One KVCacheNamespace as far as its L2 store goes: plain fields, read from a stored object
    without parsing its spec (the status loop looks at every known resource each round)."""

    namespace: str
    name: str
    created: str  # metadata.creationTimestamp (RFC 3339 in UTC: sorts as text); "" when unknown
    claim: str | None = None  # spec.l2.nvme.existingClaimName
    generated: bool = False  # spec.l2.nvme with size: l2-<name>-lmcache-<n> (or -shared) made for it
    prefix: tuple[str, ...] | None = None  # a remote store's prefix as path segments, its root first (l2backends)
    field: str = ""  # the spec field naming the store, for StorageInUse's message
    namespace_id: str | None = None  # the id it serves (its status, for others: their keys are theirs to read)

    @property
    def order(self) -> tuple[str, str, str]:
        """Who came first. An unknown creation time sorts last (it cannot claim to be older)."""
        return (self.created or "~", self.namespace, self.name)

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def user(namespace: str, name: str, created: str, spec: KVCacheNamespaceSpec, namespace_id: str | None) -> User:
    """This resource, from its parsed spec: read as the stored spec is (user_of), so both say the same."""
    backend = backend_of(spec.l2)
    return User(namespace, name, created, namespace_id=namespace_id,
                **backend.store(backend.settings(spec.l2).model_dump(by_alias=True)))


def user_of(body: Mapping[str, Any]) -> User | None:
    """Another stored KVCacheNamespace as a User; None for one being deleted (while its pods last,
    they still hold a claim: mounted_elsewhere) or naming no L2."""
    meta = body.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None
    found = stored_backend((body.get("spec") or {}).get("l2") or {})
    if found is None:
        return None
    nsid = (body.get("status") or {}).get("namespaceId")
    return User(str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("creationTimestamp") or ""),
                namespace_id=nsid if isinstance(nsid, str) and nsid else None, **found[0].store(found[1]))


def generated_claim(name: str) -> re.Pattern[str]:
    """The claims a resource's StatefulSet makes, one per ordinal: <volume>-<name>-lmcache-<n>,
    or with spec.l2.nvme.shared the one the operator makes for all its servers, ...-lmcache-shared.
    Its own servers sharing that claim is the point; another resource naming it is refused."""
    return re.compile(rf"{re.escape(L2_VOLUME)}-{re.escape(name)}-lmcache-(0|[1-9][0-9]*|{SHARED_CLAIM_SUFFIX})")


def _bucket_path(u: User) -> tuple[str, ...] | None:
    """The bucket prefix the servers write under, as path segments (the store's, then the id)."""
    if u.prefix is None or not u.namespace_id:
        return None
    return (*u.prefix, u.namespace_id)


def shared(a: User, b: User) -> str | None:
    """What two resources' servers would both write into, for people; None when nothing."""
    if (a.claim or a.generated) and (b.claim or b.generated):
        if a.namespace != b.namespace:
            return None  # claims are namespaced
        if a.claim is not None and a.claim == b.claim:
            return f"claim {a.claim}"
        for claim, other in ((a.claim, b), (b.claim, a)):
            if claim is not None and other.generated and generated_claim(other.name).fullmatch(claim):
                return f"claim {claim} (made by {other.ref}'s StatefulSet)"
        return None
    pa, pb = _bucket_path(a), _bucket_path(b)
    if pa is None or pb is None:
        return None
    short, long_ = sorted((pa, pb), key=len)
    if long_[:len(short)] == short:
        return "bucket prefix " + "/".join(long_)
    return None


def holder(me: User, others: Iterable[User]) -> tuple[User, str] | None:
    """The resource that keeps what me would share with it (the first by User.order), and what that
    is; None when me is the first, or shares nothing."""
    older = [(other, what) for other in others if other.order < me.order
             and (other.namespace, other.name) != (me.namespace, me.name) and (what := shared(me, other))]
    return min(older, key=lambda ow: ow[0].order) if older else None


def mounted_elsewhere(me: User, pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """Server pods of other resources (listed from the API server in me's namespace) that mount one
    of me's claims, as `pod P of K`: while one lasts, me does not start on the claim."""
    exact, pattern = me.claim, generated_claim(me.name) if me.generated else None
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if meta.get("namespace", me.namespace) != me.namespace or labels.get(INSTANCE_LABEL) == me.name \
                or labels.get(COMPONENT_LABEL) != SERVER:
            continue
        for volume in (pod.get("spec") or {}).get("volumes") or []:
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and (claim == exact or (pattern is not None and pattern.fullmatch(claim))):
                out.append(f"pod {meta.get('name')} of {me.namespace}/{labels.get(INSTANCE_LABEL) or '?'} (claim {claim})")
    return sorted(out)


def refusal(me: User, others: Iterable[User], pods: Iterable[Mapping[str, Any]] = ()) -> str | None:
    """Why me may not use its L2 store now (StorageInUse's message), or None."""
    first = holder(me, others)
    consequence = ("this resource's lmcache servers are scaled to zero and vLLM runs without the cache, its data "
                   "untouched, until then")
    if first is not None:
        other, what = first
        return (f"{me.field}: {what} is already used by KVCacheNamespace {other.ref} (created "
                f"{other.created or 'earlier'}; the oldest keeps it): two resources on one store delete each other's KV "
                f"(each inventory agent or bucket eviction holds it to its own capacity) and read each other's objects as "
                f"misses. Point this resource at another store, or remove {other.ref} or its claim on it; {consequence}")
    busy = mounted_elsewhere(me, pods)
    if busy:
        return (f"{me.field}: still mounted by {', '.join(busy[:3])}{' ...' if len(busy) > 3 else ''}: another "
                f"resource's lmcache server still runs on it; {consequence} (when that pod is gone)")
    return None


def refused_status(fields: Mapping[str, Any], conds: list[dict[str, Any]], namespace_id: str | None, message: str,
                   generation: int | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Status of a refused resource, from the status of the same resource with the cache off: its
    namespace id (the pins resolve), phase CacheDisabled, L2Ready and Ready False StorageInUse."""
    by_type = {c["type"]: c for c in conds}
    out = []
    for c in conds:
        if c["type"] == "IdentityResolved" and namespace_id:
            c = condition("IdentityResolved", True, "PinsComplete", f"compatibility namespace {namespace_id}", generation)
        elif c["type"] in ("L2Ready", "Ready"):
            c = condition(c["type"], False, STORAGE_IN_USE, message, generation)
        elif c["type"] == "LMCacheReady":
            c = condition("LMCacheReady", None, STORAGE_IN_USE, "lmcache servers scaled to zero: their L2 store is in use "
                          "by another resource (L2Ready)", generation)
        out.append(c)
    for missing in ("L2Ready", "Ready"):
        if missing not in by_type:
            out.append(condition(missing, False, STORAGE_IN_USE, message, generation))
    return {**fields, "phase": "CacheDisabled", "namespaceId": namespace_id}, out
