"""The operator's own workload objects as its watch streams last saw them.

kopf indexes keep them (filtered server-side by one label, slimmed to the fields status reads) so a
status refresh makes no reads of its own: four per resource per round were 10 k a minute at 500
resources. Pure functions here; the kopf wiring is in kvpersist.controller.indexes.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpersist.api.attachpolicy import LABEL as ATTACH_LABEL
from kvpersist.builders.lmcache import AGENT_CONTAINER
from kvpersist.builders.retained import INSTANCE_LABEL as RETAINED_INSTANCE_LABEL
from kvpersist.builders.retained import PROTECTED_ANNOTATIONS
from kvpersist.builders.target import BYPASS_ANNOTATION, NAMESPACE_ID_LABEL, SERVER, VLLM, Target
from kvpersist.status.agentroll import AgentSet, Key, agent_image_of, view
from kvpersist.status.build import refusal_of
from kvpersist.status.keymismatch import MESSAGE_MAX, refused_now

# Every object the builders make carries it (pods and claims included, through the templates'
# selector labels), so one server-side selector per kind keeps everything else off the wire.
WATCH_SELECTOR = "app.kubernetes.io/name=kvpersist"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
WATCHED = (("apps", "v1", "statefulsets"), ("apps", "v1", "deployments"), ("apps", "v1", "replicasets"), ("", "v1", "pods"),
           ("", "v1", "persistentvolumeclaims"), ("", "v1", "services"), ("", "v1", "configmaps"),
           ("networking.k8s.io", "v1", "networkpolicies"), ("policy", "v1", "poddisruptionbudgets"))


def owner_key(body: Mapping[str, Any]) -> Key | None:
    """(namespace, resource name) from the instance label, or the operator's own on a claim that
    outlives its resource (kvpersist.builders.retained)."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    instance = labels.get(INSTANCE_LABEL) or labels.get(RETAINED_INSTANCE_LABEL)
    return (meta.get("namespace", ""), instance) if instance else None


def _pick(mapping: Mapping[str, Any] | None, keys: Iterable[str]) -> dict[str, Any]:
    mapping = mapping or {}
    return {k: mapping[k] for k in keys if k in mapping}


def slim(body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields kvpersist.status.conditions reads, and nothing else (a pod's spec is kilobytes)."""
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    out: dict[str, Any] = {
        "metadata": {**_pick(meta, ("name", "namespace", "uid", "generation", "deletionTimestamp", "resourceVersion")),
                     "labels": _pick(meta.get("labels"), (INSTANCE_LABEL, RETAINED_INSTANCE_LABEL, COMPONENT_LABEL,
                                                          NAMESPACE_ID_LABEL))},
        # A StatefulSet's two revisions: whether a rollout is in progress (status.agentroll).
        "status": _pick(status, ("phase", "podIP", "observedGeneration", "replicas", "readyReplicas", "updatedReplicas",
                                 "currentRevision", "updateRevision")),
    }
    # Its controller reference, by uid: credentials go only to pods whose chain of them ends at the
    # resource's own workload (kvpersist.controller.indexes.trusted_pods); labels are anyone's to copy.
    controller = [_pick(r, ("apiVersion", "kind", "name", "uid", "controller")) for r in meta.get("ownerReferences") or []
                  if r.get("controller") is True][:1]
    if controller:
        out["metadata"]["ownerReferences"] = controller
    # An lmcache StatefulSet's size and agent image: what the agent roll plans from (status.agentroll).
    agent = agent_image_of(body)
    if agent is not None:
        out["spec"] = {"replicas": spec.get("replicas", 1),
                       "template": {"spec": {"containers": [{"name": AGENT_CONTAINER, "image": agent}]}}}
    # A pod's node and restarts: which vLLM pod warms which server and when (a restart empties L1;
    # controller.prewarm), and when the canary checks again (status.canary). Only a pod has spec.containers.
    if "containers" in spec or spec.get("nodeName"):
        out["spec"] = {"nodeName": spec.get("nodeName")}
    if "containers" in spec or status.get("containerStatuses"):
        out["status"]["restarts"] = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or [])
    # A claim's access modes: spec.l2.nvme.shared needs ReadWriteMany (status.conditions ClaimNotShared).
    modes = status.get("accessModes") or spec.get("accessModes")
    if modes:  # only claims have accessModes
        out["status"]["accessModes"] = list(modes)
    # A server pod's claims (controller.sharing): one is taken over only once no other resource's server mounts it.
    claims = [v["persistentVolumeClaim"]["claimName"] for v in spec.get("volumes") or []
              if (v.get("persistentVolumeClaim") or {}).get("claimName")]
    if claims and "containers" in spec:
        out.setdefault("spec", {})["volumes"] = [{"persistentVolumeClaim": {"claimName": c}} for c in claims]
    # What keeps a claim out of GitOps prunes, and the key its data needs (kvpersist.builders.retained);
    # a vLLM pod launched without the cache while it is on.
    protected = _pick(meta.get("annotations"), (*PROTECTED_ANNOTATIONS, BYPASS_ANNOTATION))
    if protected:
        out["metadata"]["annotations"] = protected
    conditions = status.get("conditions") or []
    ready = [_pick(c, ("type", "status")) for c in conditions if c.get("type") == "Ready"][:1]
    # A Deployment whose ReplicaSet cannot create pods (PodSecurity, quota) says why here, in the
    # API server's words: kept so status can name it without another request.
    failure = [_pick(c, ("type", "status", "reason", "message")) for c in conditions
               if c.get("type") == "ReplicaFailure" and c.get("status") == "True"][:1]
    # A pod the scheduler found no node for, and since when: a server that cannot be placed holds no
    # L1 and stops counting against its PodDisruptionBudget (unplaced_servers).
    unplaced = [_pick(c, ("type", "status", "reason", "lastTransitionTime")) for c in conditions
                if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"][:1]
    if ready or failure or unplaced:
        out["status"]["conditions"] = ready + failure + unplaced
    # A container refusing its versions (status.build) or its mounted key (status.keymismatch) says
    # so in its termination message: kept, and nothing else of the container statuses.
    refused = [{"name": c.get("name"), "lastState": {"terminated": {"exitCode": term["exitCode"],
                                                                     "message": str(term["message"])[:MESSAGE_MAX]}}}
               for c in status.get("containerStatuses") or [] for term in (refusal_of(c), refused_now(c)) if term is not None]
    if refused:
        out["status"]["containerStatuses"] = refused
    return out


def attached_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """A user's vLLM pod attached to a resource (kvpersist.dev/attach) as status and the canary read
    the operator's own: slim, labelled with that resource's instance and the vLLM component
    (whatever the pod's own labels of those names say), its attach and namespace id labels kept."""
    out = slim(body)
    labels = (body.get("metadata") or {}).get("labels") or {}
    view = {ATTACH_LABEL: str(labels.get(ATTACH_LABEL) or ""), INSTANCE_LABEL: str(labels.get(ATTACH_LABEL) or ""),
            COMPONENT_LABEL: VLLM}
    if labels.get(NAMESPACE_ID_LABEL):
        view[NAMESPACE_ID_LABEL] = str(labels[NAMESPACE_ID_LABEL])
    out["metadata"]["labels"] = view
    out["metadata"].pop("ownerReferences", None)  # the user's controller: nothing trusted_pods follows
    return out


def pod_ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in (pod.get("status") or {}).get("conditions") or [])


def of_id(pods: Iterable[Mapping[str, Any]], namespace_id: str | None, component: str | None = None) -> list[Mapping[str, Any]]:
    """The pods labelled with a namespace id (and component, when given), none being deleted."""
    return [p for p in pods if (labels := (p.get("metadata") or {}).get("labels") or {}).get(NAMESPACE_ID_LABEL) == namespace_id
            and component in (None, labels.get(COMPONENT_LABEL)) and not p["metadata"].get("deletionTimestamp")]


@dataclass(frozen=True)
class Pod:
    """A pod of the operator's workloads (or attached to them), as the watch cache has it."""

    name: str
    ip: str | None
    uid: str
    restarts: int
    node: str | None
    ready: bool
    uses_cache: bool  # launched with --kv-transfer-config (not rolled without the cache)


def pod_views(pods: Iterable[Mapping[str, Any]], namespace_id: str, component: str) -> list[Pod]:
    """The pods of a namespace id and component (of_id) as Pods, by name."""
    out = []
    for p in of_id(pods, namespace_id, component):
        meta, status = p["metadata"], p.get("status") or {}
        out.append(Pod(meta["name"], status.get("podIP"), str(meta.get("uid") or ""), int(status.get("restarts") or 0),
                       (p.get("spec") or {}).get("nodeName"), pod_ready(p),
                       BYPASS_ANNOTATION not in (meta.get("annotations") or {})))
    return sorted(out, key=lambda q: q.name)


def attached_counts(pods: Iterable[Mapping[str, Any]], namespace_id: str | None) -> tuple[int, int]:
    """(attached pods of the namespace id, those Ready), none being deleted."""
    mine = [p for p in of_id(pods, namespace_id) if ATTACH_LABEL in p["metadata"]["labels"]]
    return len(mine), sum(1 for p in mine if pod_ready(p))


def index_entry(body: Mapping[str, Any]) -> dict[Key, dict[str, Any]] | None:
    """What a kopf index handler returns: the slim object under its owner's key."""
    key = owner_key(body)
    return {key: slim(body)} if key else None


@dataclass
class Seen:
    """One resource's objects from the indexes: copied in the event loop, read in a worker thread."""

    statefulsets: list[dict[str, Any]] = field(default_factory=list)
    deployments: list[dict[str, Any]] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)
    # Pods with the resource's labels that its own workloads did not make (controller.indexes.trusted_pods): no
    # credential, not counted, but their namespace id's route is kept (their controller may not be cached yet).
    untrusted_pods: list[dict[str, Any]] = field(default_factory=list)
    # Pods labelled kvpersist.dev/attach for it without a namespace id label: the attach policies were
    # not installed when they were created (spec.vllm.mode Attached), so they run without the cache.
    unadmitted_pods: list[str] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)
    live_ids: frozenset[str] = frozenset()  # every namespace some resource or server still uses
    fleet: Mapping[Key, AgentSet] = field(default_factory=dict)  # every resource's lmcache StatefulSet
    # Every watched resource's L2 store (controller.sharing.User) and every server pod, for the
    # StorageInUse decision; None: not copied.
    stores: tuple[Any, ...] | None = None
    all_server_pods: tuple[dict[str, Any], ...] = ()

    def statefulset(self, target: Target) -> dict[str, Any] | None:
        return _named(self.statefulsets, target.server_name)

    def deployment(self, target: Target) -> dict[str, Any] | None:
        return _named(self.deployments, target.vllm_name)

    def server_pods(self) -> list[dict[str, Any]]:
        return sorted((p for p in self.pods if p["metadata"]["labels"].get(COMPONENT_LABEL) == SERVER),
                      key=lambda p: p["metadata"]["name"])

    def running_servers(self) -> list[tuple[str, str | None]]:
        """The server pods Running and not being deleted, as (name, IP), by name."""
        return [(p["metadata"]["name"], (p.get("status") or {}).get("podIP")) for p in self.server_pods()
                if (p.get("status") or {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]

    def server_claims(self) -> list[dict[str, Any]]:
        return sorted((c for c in self.claims if c["metadata"]["labels"].get(COMPONENT_LABEL) == SERVER),
                      key=lambda c: c["metadata"]["name"])


UNPLACED_AFTER_S = 600.0  # a server the scheduler has found no node for this long is taken as one that will not run


def unplaced_servers(pods: Iterable[Mapping[str, Any]], now: datetime.datetime | None = None,
                     after_s: float = UNPLACED_AFTER_S) -> int:
    """Server pods the scheduler has found no node for since at least after_s (by now, default the
    clock's): more servers than eligible nodes (required anti-affinity), which no wait will place."""
    now = now or datetime.datetime.now(datetime.UTC)
    since = [c["lastTransitionTime"] for p in pods if (p["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == SERVER
             for c in (p.get("status") or {}).get("conditions") or []
             if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable" and c.get("lastTransitionTime")]
    return sum((now - datetime.datetime.fromisoformat(t.replace("Z", "+00:00"))).total_seconds() >= after_s for t in since)


def _named(objs: Iterable[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((o for o in objs if o["metadata"]["name"] == name), None)


def live_ids(resources: Iterable[Mapping[str, Any]], resolved: Iterable[str | None],
             pods: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """Namespaces in use: each resource's reported and resolved id, the one whose L2 key it waits
    for (status.l2Key, kept while the key cannot be read), and the id every lmcache pod (old ones
    mid-rollout included) still serves. gc refuses all of them."""
    out = {(r.get("status") or {}).get("namespaceId") for r in resources}
    out |= {((r.get("status") or {}).get("l2Key") or {}).get("namespaceId") for r in resources}
    out |= set(resolved)
    out |= {(p["metadata"].get("labels") or {}).get(NAMESPACE_ID_LABEL) for p in pods}
    return frozenset(i for i in out if i)


def fleet(statefulsets: Mapping[Key, Iterable[Mapping[str, Any]]]) -> dict[Key, AgentSet]:
    """Every resource's lmcache StatefulSet, for the agent roll (kvpersist.status.agentroll)."""
    return {key: view(s) for key, store in statefulsets.items() for s in store
            if (s["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == SERVER}
