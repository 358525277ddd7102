"""The watch caches (kopf indexes) of the operator's workloads and of claims, and one resource's view
of them (Seen); a workload that changes marks its owner for a status refresh.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from kvpersist.api import v1alpha1 as api
from kvpersist.api.attachpolicy import LABEL as ATTACH_LABEL
from kvpersist.builders.target import NAMESPACE_ID_LABEL, SERVER
from kvpersist.builders.vllm import ATTACHED
from kvpersist.controller import runtime, sharing
from kvpersist.controller.ownership import MANAGED, is_own_child
from kvpersist.status.agentroll import AgentSet
from kvpersist.status.workloads import COMPONENT_LABEL, Seen, fleet, index_entry, live_ids, owner_key

# kopf runs no handler until every index has its initial listing, so the first refresh after a
# restart never sees a half-filled cache.


@kopf.index("apps", "v1", "statefulsets", labels=MANAGED)
async def kvp_statefulsets(body: kopf.Body, **_: Any) -> Any:
    _mark_dirty(body)
    fleet_now.cache_clear()  # made again from the index on its next read
    return index_entry(body)


@kopf.index("apps", "v1", "deployments", labels=MANAGED)
async def kvp_deployments(body: kopf.Body, **_: Any) -> Any:
    _mark_dirty(body)
    return index_entry(body)


# Indexed only: a change marks no resource. A Deployment's ReplicaSets carry its pod template's labels: the
# middle link of a vLLM pod's ownerReference chain, which decides whether it gets credentials (trusted_pods).
@kopf.index("", "v1", "pods", labels=MANAGED, id="kvp_pods")
@kopf.index("apps", "v1", "replicasets", labels=MANAGED, id="kvp_replicasets")
@kopf.index("", "v1", "persistentvolumeclaims", id="kvp_claims")
async def entry(body: kopf.Body, **_: Any) -> Any:
    return index_entry(body)


@kopf.index(api.GROUP, api.VERSION, api.PLURAL)
async def kvp_stores(body: kopf.Body, **_: Any) -> Any:
    """Each resource's L2 store (sharing.User), into Controller.store_users: an apply decides StorageInUse
    from here (a LIST of every resource per apply made converging quadratic), never from a partial view."""
    meta = body["metadata"]
    runtime.CONTROLLER.note_store((meta["namespace"], meta["name"]), sharing.user_of(body))
    return None  # read from Controller.store_users (versioned); the index is here for kopf's start gate


Stores = tuple[tuple[sharing.User, ...], tuple[dict[str, Any], ...]]


def stores_now(pods: bool = True) -> Stores:
    """(every store user, every server pod when asked), from the indexes; event loop only."""
    users = runtime.CONTROLLER.stores()
    servers = tuple(p for store in runtime.CONTROLLER.indices.get("kvp_pods", {}).values() for p in store
                    if (p["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == SERVER) if pods else ()
    return users, servers


def _mark_dirty(body: Mapping[str, Any]) -> None:
    """A workload changed: refresh its owner on the next tick, so phase follows pod readiness."""
    owner = owner_key(body)
    state = runtime.CONTROLLER.get(owner) if owner is not None else None
    if state is not None and state.known:
        state.dirty = True


# Which pods get the operator's credentials (the agent token, the vLLM API key). Labels are anyone's to
# copy, so a pod is trusted only when its controller ownerReference chain ends, by uid, at this very
# resource's own workload (pod -> StatefulSet, or pod -> ReplicaSet -> Deployment); any other is sent
# nothing. Forging the chain takes the right to create pods there, which already mounts the token's Secret.
STATEFULSET, DEPLOYMENT, REPLICASET = "StatefulSet", "Deployment", "ReplicaSet"


def controller_of(meta: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """(kind, uid) of an object's controller ownerReference (apps/v1 kinds and the like), or None."""
    for ref in (meta or {}).get("ownerReferences") or []:
        if ref.get("controller") is True and ref.get("uid"):
            return str(ref.get("kind")), str(ref["uid"])
    return None


def _uids(objs: Iterable[Mapping[str, Any]], kind: str, owner_uid: str | None) -> set[str]:
    """The uids of the objects of this kind that the resource (owner_uid) controls."""
    return {str(o["metadata"]["uid"]) for o in objs
            if o.get("kind", kind) == kind and (o.get("metadata") or {}).get("uid")
            and is_own_child(o.get("metadata"), owner_uid)}


def trusted_pods(pods: Iterable[dict[str, Any]], replicasets: Iterable[Mapping[str, Any]],
                 statefulsets: Iterable[Mapping[str, Any]], deployments: Iterable[Mapping[str, Any]],
                 owner_uid: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(trusted, untrusted) pods: trusted when controlled by one of the resource's own StatefulSets, or by a
    ReplicaSet of one of its own Deployments (an old one mid-rollout too). owner_uid None trusts nothing."""
    own_deployments = {(DEPLOYMENT, uid) for uid in _uids(deployments, DEPLOYMENT, owner_uid)}
    controllers = {(STATEFULSET, uid) for uid in _uids(statefulsets, STATEFULSET, owner_uid)} | {
        (REPLICASET, str(r["metadata"]["uid"])) for r in replicasets
        if (r.get("metadata") or {}).get("uid") and controller_of(r.get("metadata")) in own_deployments}
    pods = list(pods)
    return ([p for p in pods if controller_of(p.get("metadata")) in controllers],
            [p for p in pods if controller_of(p.get("metadata")) not in controllers])


def untrusted_message(pod: Mapping[str, Any], resource: str) -> str:
    """The log line for a pod left out: which pod, what controls it, and why nothing is sent to it."""
    meta = pod.get("metadata") or {}
    ref = controller_of(meta)
    held = f"{ref[0]} uid {ref[1]}" if ref else "none (no controller ownerReference)"
    return (f"pod {meta.get('namespace')}/{meta.get('name')} carries the labels of KVCacheNamespace {resource}'s pods, "
            f"but its controller is {held}, not that resource's own StatefulSet or Deployment: it is sent no agent token "
            "or API key and counts for nothing in its status. Remove those labels from it if it is not the operator's")


def seen_of(key: tuple[str, str], live: frozenset[str] | None = None,
            agents: Mapping[tuple[str, str], AgentSet] | None = None,
            stores: Stores | None = None, owner_uid: str | None = None) -> Seen:
    """Copies of one resource's objects from the indexes (and every store when given: stores_now); owner_uid:
    the resource's uid when its body is at hand (else the one last tracked). Event loop only."""
    def values(name: str) -> list[dict[str, Any]]:
        return list(runtime.CONTROLLER.indices.get(name, {}).get(key) or [])
    statefulsets, deployments, replicasets = values("kvp_statefulsets"), values("kvp_deployments"), values("kvp_replicasets")
    state = runtime.CONTROLLER.get(key)
    body = (state.body if state is not None else None) or {}  # as last tracked
    if owner_uid is None:
        owner_uid = (body.get("metadata") or {}).get("uid")
    # Only pods its own workloads made: labels are anyone's to copy, and these pods get the credentials.
    pods, untrusted = trusted_pods(values("kvp_pods"), replicasets, statefulsets, deployments, owner_uid)
    _note_untrusted(key, untrusted, {str(o["metadata"].get("uid")) for o in statefulsets + replicasets})
    # Users' own vLLM pods attached to it (spec.vllm.mode Attached, as last seen: only such a resource looks through
    # them): the attach policies admitted each with its namespace id label; counted and checked by the canary like its own.
    labelled = [p for p in _attached(key[0]) if p["metadata"]["labels"].get(ATTACH_LABEL) == key[1]] \
        if ((body.get("spec") or {}).get("vllm") or {}).get("mode") == ATTACHED else []
    pods += [p for p in labelled if p["metadata"]["labels"].get(NAMESPACE_ID_LABEL)]
    # Labelled, yet no id label: admitted while the attach policies were not installed (they refuse that).
    unadmitted = sorted(p["metadata"]["name"] for p in labelled if not p["metadata"]["labels"].get(NAMESPACE_ID_LABEL))
    users, servers = stores if stores is not None else (None, ())
    return Seen(statefulsets=statefulsets, deployments=deployments, pods=pods, untrusted_pods=untrusted,
                unadmitted_pods=unadmitted, claims=values("kvp_claims"), live_ids=live_now() if live is None else live,
                fleet=fleet_now() if agents is None else agents, stores=users, all_server_pods=servers)


# Pods already logged as untrusted (by uid), so each is named once, not every status round.
_UNTRUSTED_LOGGED: set[str] = set()


def _note_untrusted(key: tuple[str, str], pods: list[dict[str, Any]], known: set[str]) -> None:
    """One warning per pod left out of a resource's view; none yet for a pod whose controller the caches
    have not delivered (a new ReplicaSet's pod may come first)."""
    for pod in pods:
        uid = str(pod["metadata"].get("uid"))
        ref = controller_of(pod["metadata"])
        if uid not in _UNTRUSTED_LOGGED and (ref is None or ref[1] in known):
            if len(_UNTRUSTED_LOGGED) >= 10_000:
                _UNTRUSTED_LOGGED.clear()
            _UNTRUSTED_LOGGED.add(uid)
            logging.getLogger("kvpersist").warning("%s", untrusted_message(pod, f"{key[0]}/{key[1]}"))


def _attached(namespace: str | None) -> list[dict[str, Any]]:
    """Attached pods of one namespace, or of all (None); none while unsynced."""
    cache = runtime.CONTROLLER.attached_cache
    if cache is None:
        return []
    return cache.everything() if namespace is None else cache.in_namespace(namespace)[1]


def live_now() -> frozenset[str]:
    """Every namespace id in use, from the caches (attached pods' too); call in the event loop only."""
    pods = [p for store in runtime.CONTROLLER.indices.get("kvp_pods", {}).values() for p in store] + _attached(None)
    known = runtime.CONTROLLER.known().values()
    return live_ids([st.body for st in known if st.body is not None], [st.namespace_id for st in known], pods)


# Kept until a StatefulSet event (every tick made it again: 500 StatefulSets viewed each second at 500 resources).
@functools.cache
def fleet_now() -> dict[tuple[str, str], AgentSet]:
    """Every resource's lmcache StatefulSet as the agent roll sees it; call in the event loop only."""
    return fleet(runtime.CONTROLLER.indices.get("kvp_statefulsets", {}))
