"""Drift: a child of a known resource deleted, or edited by someone else, marks the resource for an
apply on the status loop's next tick; the generations the operator's own applies leave are noted
first, so they are no drift. Each event also notes which resource controls the child, so an apply
need not look up names it already knows as its own (kvpersist.controller.ownership).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import kopf

from kvpersist.api.identity import NAMESPACE_ID_LABEL
from kvpersist.controller import runtime
from kvpersist.controller.decision import RETIRED, child_key
from kvpersist.controller.ownership import MANAGED, controller_uid
from kvpersist.controller.state import ResourceState
from kvpersist.status.workloads import owner_key

DROPPED = ("deleted", "by the operator")  # child_generations' mark of a child the operator deleted itself


@contextlib.contextmanager
def own_apply(manifest: Mapping[str, Any]) -> Iterator[None]:
    """Marks a child as being applied: its watch event may come before note_own_write records its
    generation, and is no drift (someone else's edit then is overwritten by the forced apply)."""
    key = child_key(manifest)
    applying = runtime.CONTROLLER.child_applying
    applying[key] = applying.get(key, 0) + 1
    try:
        yield
    finally:
        left = applying.get(key, 1) - 1
        if left > 0:
            applying[key] = left
        else:
            applying.pop(key, None)


def note_own_write(obj: Mapping[str, Any]) -> None:
    """The generation the operator's own apply left a child at: its watch event is no drift (else a
    field the API server stores otherwise than sent would make every apply look like an edit)."""
    mark = _mark(obj.get("metadata"))
    if mark is not None:
        runtime.CONTROLLER.child_generations[child_key(obj)] = mark
    runtime.CONTROLLER.child_owners[child_key(obj)] = controller_uid(obj.get("metadata"))


def note_own_delete(child: tuple[str, str, str]) -> None:
    """A child the operator deleted itself (decision.DROPPABLE): its DELETED event is no drift (else
    every object dropped cost one more whole apply)."""
    runtime.CONTROLLER.child_owners.pop(child, None)
    runtime.CONTROLLER.child_generations[child] = DROPPED


def _mark(meta: Mapping[str, Any] | None) -> int | tuple[str, str] | None:
    """What a child's event is compared with: its generation, else (a Service, a ConfigMap) the
    resourceVersion the operator's write left, so the ADDED event of a child it just created is no
    drift (each create used to cost a second whole apply)."""
    meta = meta or {}
    if meta.get("generation") is not None:
        return meta["generation"]
    version = meta.get("resourceVersion")
    return ("resourceVersion", version) if version else None


def _note_drift(event: Mapping[str, Any], body: Mapping[str, Any], kind: str) -> None:
    """A child of a known resource deleted or changed (_mark): apply the resource on the next tick.
    Status updates keep the generation (a rollout is no drift); the initial listing (event type None)
    is none either: resume applies everything then anyway."""
    owner = owner_key(body)
    meta = body.get("metadata") or {}
    child = (kind, meta.get("namespace", ""), meta.get("name", ""))
    kind_of_event = event.get("type")
    generations = runtime.CONTROLLER.child_generations
    if kind_of_event == "DELETED":  # (or no longer labelled as the operator's: the watch selects by label)
        runtime.CONTROLLER.child_owners.pop(child, None)
        if generations.pop(child, None) == DROPPED:
            return
    else:
        runtime.CONTROLLER.child_owners[child] = controller_uid(meta)
    state = runtime.CONTROLLER.get(owner) if owner is not None else None
    mark = _mark(meta)
    if state is None or not state.known or kind_of_event is None:
        if kind_of_event is None and mark is not None:
            generations[child] = mark
        if kind_of_event is None and _earlier_versions_own(child, meta, state):
            state.drifted = True  # its first apply may have looked before this listing: the next deletes it
        return
    if kind_of_event == "DELETED" or meta.get("deletionTimestamp"):
        state.drifted = True
        return
    if child in runtime.CONTROLLER.child_applying:
        pass  # the operator's own apply, still in flight: no drift
    elif mark is None or generations.get(child) != mark:
        state.drifted = True
    if mark is not None:
        generations[child] = mark


def _earlier_versions_own(child: tuple[str, str, str], meta: Mapping[str, Any], state: ResourceState | None) -> bool:
    """A known resource's own object under a name an earlier version made with the cache on
    (decision.RETIRED; a namespace id label, which this version's <name>-lmcache never carries)."""
    if state is None or state.body is None:
        return False
    owner = state.body.get("metadata") or {}
    ours = owner.get("uid") is not None and controller_uid(meta) == owner.get("uid")
    retired = {(kind, owner.get("name", "") + suffix) for _, kind, suffix, _ in RETIRED}
    return ours and NAMESPACE_ID_LABEL in (meta.get("labels") or {}) and (child[0], child[2]) in retired


# Every kind the operator applies, by its managed-by label: one handler, registered for each.
@kopf.on.event("", "v1", "services", labels=MANAGED)
@kopf.on.event("", "v1", "configmaps", labels=MANAGED)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=MANAGED)
@kopf.on.event("apps", "v1", "statefulsets", labels=MANAGED)
@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
async def drift(event: Mapping[str, Any], body: kopf.Body, **_: Any) -> None:
    _note_drift(event, body, body["kind"])  # kopf gives each listed item its kind too
