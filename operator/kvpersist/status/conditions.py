"""Conditions and phase: pure functions from what was observed to the status a user reads."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kvpersist.api.attachpolicy import LABEL as ATTACH_LABEL
from kvpersist.builders import buildcheck
from kvpersist.builders.target import SERVER
from kvpersist.inventory.space import NEARLY_FULL, fraction
from kvpersist.inventory.volume import iso, parse_iso, served_of
from kvpersist.l2backends import BACKENDS
from kvpersist.status import Verdict, build, canary, creatorrights, references
from kvpersist.status.build import BuildVerdict, bypass_message
from kvpersist.status.keymismatch import KEY_MISMATCH
from kvpersist.status.usage import ServerReport, human_bytes, namespace_l2, summarize
from kvpersist.status.workloads import pod_ready

# Hit figures move with every request: alone they cause at most one status write per this many
# seconds (with any other change they ride along at once; the first figures are written at once).
HITS_WRITE_INTERVAL_S = 60.0

SPACE_CONDITION = "L2SpaceAvailable"
WARM_CONDITION = "Warm"  # spec.prewarm (kvpersist.controller.prewarm)
CONDITION_TYPES = ("IdentityResolved", "PinsVerified", "L2Ready", "LMCacheReady", "VLLMReady", build.CONDITION,
                   canary.CONDITION, "WithinBudget", SPACE_CONDITION, WARM_CONDITION, references.CONDITION,
                   creatorrights.CONDITION, "Ready")
# Conditions that inform without holding back Ready: an exhausted budget is the cap doing its job,
# a nearly full claim a warning (writes still succeed), a prompt not warm yet only slower, and
# CreatorRightsEnforced False the cluster's exposure, not this resource's health.
INFORMATIONAL = ("WithinBudget", SPACE_CONDITION, "PinsVerified", WARM_CONDITION,  # PinsVerified False turns the cache off itself
                 creatorrights.CONDITION)
# ReferencesFound False holds Ready back only through what it stops (a missing pull Secret of a
# public image stops nothing), but while Ready is False a missing object is named first.


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, ok: bool | None, reason: str, message: str = "", generation: int | None = None) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return {"type": type_, "status": status, "reason": reason, "message": message,
            **({"observedGeneration": generation} if generation is not None else {})}


def _build_verdict(verdict: BuildVerdict) -> Verdict:
    """BuildVerified: False while a server refuses or vLLM runs without the cache over its versions;
    True while none has refused; Unknown when connectorBuild names no versions."""
    declared = buildcheck.declared_versions(verdict.connector_build)
    server = next((r for r in verdict.refusals if r.component == SERVER), None)
    problems = []
    if server is not None:
        problems.append(f"the lmcache server refuses to start, {server.detail}. vLLM waits for it, and runs without the "
                        "cache once the servers have been unavailable for the fallback bound (CacheBypassed)")
    if verdict.vllm_bypass is not None:
        problems.append(bypass_message(verdict.vllm_bypass))
    if problems:
        return (False, build.MISMATCH, "; ".join(problems))
    if declared is None:
        return (None, "NotComparable", f"spec.identity.connectorBuild {verdict.connector_build!r} names no versions "
                f"(vllm-X+lmcache-Y): nothing is compared; each pod logs the versions it runs ({buildcheck.PREFIX} ...)")
    return (True, "BuildMatches", f"declared vllm {declared['vllm']}, lmcache {declared['lmcache']}: each lmcache server "
            "and each vLLM pod with the cache checks the versions it runs at start and would refuse to start on a "
            "difference; none has refused")


def merge_conditions(old: Iterable[Mapping[str, Any]], new: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """New conditions keep the old lastTransitionTime unless their status changed."""
    previous = {c["type"]: c for c in old}
    merged = []
    for c in new:
        prior = previous.get(c["type"])
        stamp = prior.get("lastTransitionTime") if prior and prior.get("status") == c["status"] else None
        merged.append({**c, "lastTransitionTime": stamp or now()})
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(merged, key=lambda c: order.get(c["type"], len(order)))


@dataclass
class Observation:
    """Everything the status is computed from; gathered by the handlers, judged here."""

    generation: int | None
    namespace_id: str | None
    identity_reason: str
    l2_kind: str
    server_desired: int
    vllm_desired: int
    statefulset: Mapping[str, Any] | None = None
    deployment: Mapping[str, Any] | None = None
    server_pods: list[Mapping[str, Any]] = field(default_factory=list)
    claims: list[Mapping[str, Any]] = field(default_factory=list)
    existing_claim: str | None = None
    shared: bool = False  # spec.l2.nvme.shared: one ReadWriteMany claim for all the servers
    writes_failing: list[str] = field(default_factory=list)  # pods whose L2 writes fail now
    bucket_check: tuple[bool, str, str] | None = None  # hfBucket preflight: (ok, reason, message)
    reports: list[ServerReport] = field(default_factory=list)
    inventory: dict[str, Any] | None = None  # status.inventory, when the volumes or bucket were read
    l2_space: dict[str, Any] | None = None  # status.l2 (kvpersist.inventory.space), when the claims were read
    budget_bytes: int | None = None  # spec.l2.nvme.budget
    budget_floor: int = 0  # status.usage.l2UsedBytes as last written for this namespace id (see budget_status)
    budget_floor_exhausted: bool = False  # and whether that status said Exhausted
    identity_code: str = "IdentityIncomplete"  # the condition reason when namespace_id is None (Resolution.code)
    key_problem: tuple[str, str] | None = None  # (reason, message): the L2 key cannot be used, so no namespace
    key_mismatch: str | None = None  # servers refusing their mounted key (kvpersist.status.keymismatch): L2Ready's message
    server_create_failure: str | None = None  # why the StatefulSet cannot create pods (its FailedCreate event)
    build: BuildVerdict | None = None  # the pods' runtime build check (with the cache on); None: no condition
    pins: tuple[bool | None, str, str] | None = None  # PinsVerified (kvpersist.controller.pincheck); None: none
    warm: tuple[bool | None, str, str] | None = None  # Warm (kvpersist.controller.prewarm); None: nothing declared
    vllm_selector: str | None = None  # the vLLM pods' label selector (status.vllmSelector, for the scale subresource)
    canary: tuple[bool | None, str, str] | None = None  # HitCorrectness (kvpersist.status.canary); None: none
    references: tuple[bool | None, str, str] | None = None  # ReferencesFound (kvpersist.status.references); None: none named
    creator_rights: tuple[bool | None, str, str] | None = None  # CreatorRightsEnforced (kvpersist.status.creatorrights)
    # spec.vllm.mode Attached: (attached pods of the namespace id, those Ready, the resource's name); None: Managed.
    attached: tuple[int, int, str] | None = None
    unadmitted: list[str] = field(default_factory=list)  # labelled pods the attach policies never saw (Seen)


# Pods refused at creation (PodSecurity, a quota, a webhook): a Deployment's ReplicaFailure says so;
# a StatefulSet only FailedCreate Events, read once it lacked pods this long, at most this often.
PODS_MISSING_GRACE_S = 10.0
FAILED_CREATE_RECHECK_S = 60.0
FAILURE_MESSAGE_MAX = 1024
NOT_CREATED_REASONS = ("PodsForbidden", "PodsNotCreated")
# The pods share no host namespace (CUDA IPC through lmcache's isolated IPC: docs/security.md) and
# so pass baseline; restricted refuses them: the lmcache server and vLLM run as root.
POD_SECURITY_FIX = ("kvpersist's pods meet the restricted Pod Security level (non-root, no capability, RuntimeDefault "
                    "seccomp, no host namespace): an older operator made these workloads, or a policy of the cluster's "
                    "own refuses them (see docs/security.md)")


def pods_missing(statefulset: Mapping[str, Any] | None, desired: int) -> bool:
    """Fewer pods exist than the StatefulSet should have (its status counts the pods it created)."""
    return statefulset is not None and desired != 0 and int((statefulset.get("status") or {}).get("replicas") or 0) < desired


def _event_time(event: Mapping[str, Any]) -> float:
    for key in ("lastTimestamp", "eventTime", "firstTimestamp"):
        stamp = event.get(key) or ((event.get("series") or {}).get("lastObservedTime") if key == "eventTime" else None)
        if isinstance(stamp, str):  # the Events are read as JSON (to_dict)
            try:
                return parse_iso(stamp) or 0.0
            except ValueError:
                continue
    return 0.0


def failed_create(events: Iterable[Mapping[str, Any]]) -> str | None:
    """The latest FailedCreate Event's message, unless a pod was created after it (SuccessfulCreate)."""
    latest = max((e for e in events if e.get("reason") == "FailedCreate"), key=_event_time, default=None)
    created = max((_event_time(e) for e in events if e.get("reason") == "SuccessfulCreate"), default=float("-inf"))
    if latest is None or created > _event_time(latest):
        return None
    return str(latest.get("message") or "FailedCreate")[:FAILURE_MESSAGE_MAX]


class FailedCreateCheck:
    """When to read a StatefulSet's Events, and the last answer: after its pods were missing
    PODS_MISSING_GRACE_S, at most once per FAILED_CREATE_RECHECK_S; a healthy resource costs none."""

    def __init__(self) -> None:
        self._missing_since: dict[Any, float] = {}
        self._answers: dict[Any, tuple[float, str | None]] = {}

    def failure(self, key: Any, missing: bool, now: float, lookup: Callable[[], str | None]) -> str | None:
        if not missing:
            self._missing_since.pop(key, None)
            self._answers.pop(key, None)
            return None
        since = self._missing_since.setdefault(key, now)
        if now - since < PODS_MISSING_GRACE_S:
            return None
        answer = self._answers.get(key)
        if answer is None or now - answer[0] >= FAILED_CREATE_RECHECK_S:
            answer = self._answers[key] = (now, lookup())
        return answer[1]


def not_created(what: str, message: str) -> tuple[str, str]:
    """(reason, message) for refused pods: PodsForbidden with the fix for Pod Security, else PodsNotCreated."""
    if "PodSecurity" in message:
        return "PodsForbidden", f"the API server refuses the {what} pods: {message}; {POD_SECURITY_FIX}"
    return "PodsNotCreated", f"the {what} pods cannot be created: {message}"


def _rollout_done(obj: Mapping[str, Any] | None, desired: int) -> tuple[bool, int]:
    """(rolled out and all ready, ready count) for a StatefulSet or Deployment."""
    if obj is None:
        return desired == 0, 0
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    ready, updated, replicas = (int(status.get(k) or 0) for k in ("readyReplicas", "updatedReplicas", "replicas"))
    current = status.get("observedGeneration") == meta.get("generation")
    return current and ready == updated == replicas == desired, ready


def budget_status(obs: Observation) -> dict[str, Any] | None:
    """status.budget. Used: namespace_l2, never less than last written (a budgeted namespace's bytes
    do not shrink, and a restarted server counts from zero). Exhausted once the next object of
    average size would not fit: lmcache refuses it."""
    if obs.budget_bytes is None or obs.namespace_id is None:
        return None
    reported = [r for r in obs.reports if r.l2_used is not None]
    volume = served_of(obs.inventory, obs.namespace_id)
    if not reported and volume is None and not obs.budget_floor:  # nothing measured yet
        return {"bytes": obs.budget_bytes, "state": "Available", "_shown": f"?/{human_bytes(obs.budget_bytes)}"}
    # status.usage.l2UsedBytes is the same figure (refresh passes it the same floor).
    floor = budget_floor(obs)
    used, objects = namespace_l2(reported, obs.shared, volume, floor)
    # With no object count to judge by (a restarted server and no scan this round), the floor's
    # own verdict stands: files padded on disk (encrypted) leave a full budget below its bytes.
    floor_only = objects == 0 and used == floor > 0 and obs.budget_floor_exhausted
    exhausted = used >= obs.budget_bytes or (objects > 0 and used + used / objects > obs.budget_bytes) or floor_only
    # "_shown" is for the WithinBudget message only; compute_status leaves it out of status.budget.
    return {"bytes": obs.budget_bytes, "state": "Exhausted" if exhausted else "Available",
            "_shown": f"{human_bytes(used) or '0B'}/{human_bytes(obs.budget_bytes)}"}


def budget_floor(obs: Observation) -> int:
    """The least a budgeted namespace's L2 bytes may read: the last written, capped at the budget
    (the agent trims the folder back to it); 0 without a budget."""
    return min(obs.budget_floor, obs.budget_bytes) if obs.budget_bytes is not None else 0


def space_condition(l2: Mapping[str, Any] | None, gen: int | None) -> dict[str, Any] | None:
    """L2SpaceAvailable: False once the fullest claim is NEARLY_FULL, naming the other namespaces'
    folders and how to delete them; True otherwise; absent while no claim was read."""
    share = fraction(dict(l2)) if l2 else None
    if l2 is None or share is None:
        return None
    where = (f"{l2['location']} is {min(share, 9.999) * 100:.1f}% full "
             f"({human_bytes(l2['usedBytes']) or '0B'} of {human_bytes(l2.get('capacityBytes') or 0) or '?'})")
    others = l2.get("largestOtherNamespaces") or []
    held = f"; other namespaces' folders hold {human_bytes(l2.get('otherNamespacesBytes') or 0) or '0B'}" if others else ""
    if share < NEARLY_FULL:
        return condition(SPACE_CONDITION, True, "ClaimHasRoom", where + held, gen)
    if others:
        names = ", ".join(f"{o['namespaceId']} ({human_bytes(o['bytes']) or '0B'}, "
                          f"{'orphan' if o.get('orphan') else 'in use'}"
                          + (f", unwritten {o['ageDays']} days" if o.get("ageDays") is not None else "") + ")"
                          for o in others)
        orphan = next((o for o in others if o.get("orphan")), None)
        how = (f"`kvpersist report` lists them, `kvpersist gc {orphan['namespaceId']} --no-dry-run` deletes one; or let the "
               "agent remove those unwritten for N days with spec.l2.orphanRetention.maxAgeDays") if orphan else (
               "each is in use by a live resource or server, so none may be deleted: raise the claim or lower "
               "spec.l2.nvme.maxCapacity")
        fix = f"; folders of other namespaces: {names}. Deletion is explicit: {how}"
    else:
        fix = "; the served namespace alone fills it: lower spec.l2.nvme.maxCapacity (or budget) below the claim's size"
    return condition(SPACE_CONDITION, False, "ClaimNearlyFull",
                     f"{where}, at or past {NEARLY_FULL:.0%}: the served namespace is trimmed to make room and writes "
                     f"fail once it is full{fix}", gen)


def access_modes(claim: Mapping[str, Any]) -> list[str]:
    """What a claim may do: its bound volume's modes (status), else what it asked for (spec)."""
    return list((claim.get("status") or {}).get("accessModes") or (claim.get("spec") or {}).get("accessModes") or [])


def shareable(claim: Mapping[str, Any]) -> bool:
    """Whether servers on several nodes may mount the claim at once."""
    return "ReadWriteMany" in access_modes(claim)


def _l2_verdict(obs: Observation, budget: Mapping[str, Any] | None) -> Verdict:
    """L2Ready: claims (NVMe) or the bucket preflight (Hugging Face), the adapters' health, and
    L2 writes failing now, which lmcache's /status does not show."""
    if obs.key_problem is not None:  # no key, no namespace (kvpersist.controller.l2key): said here and in IdentityResolved
        return (False, *obs.key_problem)
    if obs.namespace_id is None:
        return (None, "CacheDisabled", "no namespace, no L2 in use")
    if obs.key_mismatch is not None:  # servers that refuse to start on the key file they mount
        return (False, KEY_MISMATCH, obs.key_mismatch)
    bad_adapter = [r.pod for r in obs.reports if r.l2_healthy is False]
    # Writes refused at the budget are the budget doing its job, not a failing volume.
    exhausted = budget is not None and budget["state"] == "Exhausted"
    failing = [] if exhausted else [r for r in obs.reports if r.pod in obs.writes_failing]
    backend = BACKENDS[obs.l2_kind]
    if backend.mounts_volume:
        pending = [c["metadata"]["name"] for c in obs.claims if (c.get("status") or {}).get("phase") != "Bound"]
        if obs.existing_claim and not obs.claims:
            return (False, "ClaimNotFound", f"claim {obs.existing_claim} not found: create it, or fix "
                    "spec.l2.nvme.existingClaimName")
        wanted = min(1, obs.server_desired) if obs.shared else obs.server_desired
        if len(obs.claims) < wanted:
            maker = "the operator creates it" if obs.shared else "the StatefulSet creates them"
            return (False, "ClaimMissing", f"{len(obs.claims)}/{wanted} claims exist; {maker}")
        if (c := next((claim for claim in obs.claims if obs.shared and not shareable(claim)), None)) is not None:
            modes = ", ".join(access_modes(c)) or "of no access mode"
            return (False, "ClaimNotShared",
                    f"spec.l2.nvme.shared: claim {c['metadata']['name']} is {modes}, not ReadWriteMany: the "
                    "servers on other nodes cannot mount it, so they cannot start. Name a ReadWriteMany claim "
                    "of a shared filesystem (NFS, Lustre, EFS, CephFS) in spec.l2.nvme.existingClaimName, or set "
                    "spec.lmcacheServer.replicas to 1")
        if pending:
            return (False, "ClaimPending", f"claims not bound: {', '.join(sorted(pending))}; check "
                    "spec.l2.nvme.storageClassName and that matching PersistentVolumes exist")
    elif obs.bucket_check is not None and not obs.bucket_check[0]:
        return (False, obs.bucket_check[1], obs.bucket_check[2])
    if bad_adapter:
        return (False, "AdapterUnhealthy", f"{obs.l2_kind} L2 adapter unhealthy on {', '.join(bad_adapter)}")
    if failing:
        detail = ", ".join(f"{r.pod} ({r.l2_writes_failed} of {r.l2_writes_submitted} objects not written)" for r in failing)
        return (False, "L2WritesFailing", f"L2 writes failing on {detail}: the volume is full or failing; serving "
                "continues from L1 and recompute. Free space or raise the claim, and keep maxCapacity below the free space")
    if backend.mounts_volume:
        return (True, "ClaimsBound", f"{len(obs.claims)} claim(s) bound")
    check = f"; {obs.bucket_check[2]}" if obs.bucket_check else ""
    if any(r.l2_healthy for r in obs.reports):
        return (True, "AdapterHealthy", f"{backend.adapter} adapter healthy" + check)
    if obs.bucket_check is not None:
        return (None, obs.bucket_check[1], obs.bucket_check[2] + "; no server has reported yet")
    return (None, "NotMeasured", "no lmcache server has reported yet")


def _vllm_verdict(obs: Observation, vllm_done: bool, vllm_ready: int) -> Verdict:
    if obs.attached is not None:
        # The user's own pods: how many there are is theirs to say; none yet holds nothing back.
        count, ready, name = obs.attached
        if obs.unadmitted:
            shown = ", ".join(obs.unadmitted[:5]) + (f" and {len(obs.unadmitted) - 5} more" if len(obs.unadmitted) > 5 else "")
            return (False, "AttachPoliciesMissing",
                    f"pods labelled {ATTACH_LABEL}={name} run without the cache ({shown}): the API server "
                    "admitted them without the attach policies, which add the connection; install them "
                    "(the chart's attach.enabled, Kubernetes 1.36 or later, or config/attach/attach.yaml) "
                    f"and restart those pods; {ready}/{count} attached vLLM pods ready")
        if count == 0:
            return (None, "NoAttachedPods", f"no vLLM pod is attached yet: label your vLLM pods {ATTACH_LABEL}={name} "
                    "(docs/attach.md)")
        return (ready > 0, "AttachedPodsReady" if ready else "AttachedPodsNotReady", f"{ready}/{count} attached vLLM pods ready")
    for c in ((obs.deployment or {}).get("status") or {}).get("conditions") or []:  # its ReplicaSet cannot create pods
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True" and not vllm_done:
            failure = str(c.get("message") or c.get("reason") or "ReplicaFailure")[:FAILURE_MESSAGE_MAX]
            return (False, *not_created("vLLM", failure))
    return (vllm_done, "PodsReady" if vllm_done else "RollingOut", f"{vllm_ready}/{obs.vllm_desired} vLLM pods ready")


def _given(type_: str, verdict: Verdict | None, gen: int | None) -> dict[str, Any] | None:
    return None if verdict is None else condition(type_, *verdict, gen)


def compute_status(obs: Observation) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The status fields (without timestamps) and the conditions for one observation."""
    gen = obs.generation
    cache_on = obs.namespace_id is not None
    identity: Verdict = ((True, "PinsComplete", f"compatibility namespace {obs.namespace_id}") if cache_on else
                         (False, obs.identity_code, f"cache disabled, vLLM runs without it: {obs.identity_reason}"))
    servers_done, servers_ready = _rollout_done(obs.statefulset, obs.server_desired)
    vllm_done, vllm_ready = _rollout_done(obs.deployment, obs.vllm_desired)
    ready_pods = {p["metadata"]["name"] for p in obs.server_pods if pod_ready(p)}
    sick = [r for r in obs.reports if not r.healthy and r.pod in ready_pods]
    budget = budget_status(obs)
    within: Verdict | None = None
    if budget is not None and budget["state"] != "Exhausted":
        within = (True, "UnderBudget", f"L2 budget {budget['_shown']} used")
    elif budget is not None:
        within = (False, "BudgetExhausted", f"L2 holds {budget['_shown']} of this namespace's budget: new KV is not persisted "
                  "(served from L1 and recompute), stored KV keeps hitting. Raise spec.l2.nvme.budget, or free room")

    lmcache: Verdict
    if not cache_on:
        lmcache = (None, "CacheDisabled", "lmcache servers scaled to zero")
    elif sick:
        lmcache = (False, "ServerUnhealthy", "; ".join(f"{r.pod}: {r.message}" for r in sick))
    elif obs.server_create_failure is not None and not servers_done:
        lmcache = (False, *not_created("lmcache server", obs.server_create_failure))
    elif servers_done and len([r for r in obs.reports if r.healthy]) >= obs.server_desired:
        lmcache = (True, "ServersHealthy", f"{servers_ready}/{obs.server_desired} servers healthy")
    else:
        lmcache = (False, "ServersStarting", f"{servers_ready}/{obs.server_desired} servers ready")

    vllm = _vllm_verdict(obs, vllm_done, vllm_ready)
    vllm_desired, vllm_ready = (obs.vllm_desired, vllm_ready) if obs.attached is None else obs.attached[:2]
    conds = [condition(t, *v, gen) for t, v in (("IdentityResolved", identity), ("L2Ready", _l2_verdict(obs, budget)),
                                               ("LMCacheReady", lmcache), ("VLLMReady", vllm))]
    optional = [_given(build.CONDITION, _build_verdict(obs.build) if obs.build is not None and cache_on else None, gen),
                _given("PinsVerified", obs.pins, gen), _given(canary.CONDITION, obs.canary if cache_on else None, gen),
                _given("WithinBudget", within, gen), space_condition(obs.l2_space, gen) if cache_on else None,
                _given(WARM_CONDITION, obs.warm, gen), _given(references.CONDITION, obs.references, gen),
                _given(creatorrights.CONDITION, obs.creator_rights, gen)]
    conds += [c for c in optional if c is not None]

    by_type = {c["type"]: c for c in conds}
    # A build that cannot be compared (connectorBuild names no versions) is only reported; so is a canary
    # without a verdict (vLLM unreachable, its output not deterministic): only a changed answer holds Ready back.
    not_ok = [c for c in conds if c["status"] != "True" and c["type"] not in (*INFORMATIONAL, references.CONDITION)
              and (c["type"], c["status"]) not in ((build.CONDITION, "Unknown"), (canary.CONDITION, "Unknown"),
                                                   ("VLLMReady", "Unknown"))]
    ready: Verdict
    if not cache_on:
        phase, ready = "CacheDisabled", (False, "CacheDisabled", by_type["IdentityResolved"]["message"])
    elif not not_ok:
        phase, ready = "Ready", (True, "AllReady", "cache and vLLM are serving")
    else:
        build_mismatch = by_type.get(build.CONDITION, {}).get("reason") == build.MISMATCH
        hit_mismatch = by_type.get(canary.CONDITION, {}).get("reason") == canary.MISMATCH
        degraded = (bool(sick) or build_mismatch or hit_mismatch
                    or by_type["L2Ready"]["reason"] in ("AdapterUnhealthy", "L2WritesFailing", KEY_MISMATCH))
        started = servers_ready + vllm_ready > 0
        phase = "Degraded" if degraded else ("Progressing" if started else "Pending")
        # A hit that changed an answer comes first: it is why vLLM runs without the cache. Pods the
        # API server refuses explain everything after them (claims wait for a pod); so does a build
        # mismatch (a server that refuses to start is only "starting" to the others).
        rank = {canary.MISMATCH: 0, **dict.fromkeys(NOT_CREATED_REASONS, 1), references.MISSING: 2, build.MISMATCH: 3}
        missing = [c for c in conds if c["type"] == references.CONDITION and c["reason"] == references.MISSING]
        first = min(not_ok + missing, key=lambda c: rank.get(c["reason"], len(rank)))  # the first of the lowest rank
        ready = (False, first["reason"], f"{first['type']}: {first['message']}")
    conds.append(condition("Ready", *ready, gen))

    status: dict[str, Any] = {
        "observedGeneration": gen,
        "phase": phase,
        "namespaceId": obs.namespace_id,
        "l2Kind": obs.l2_kind,
        "readyReplicas": vllm_ready,
        "desiredReplicas": vllm_desired,
        "replicas": f"{vllm_ready}/{vllm_desired}",
        # The scale subresource's status.replicas: the pods there are, ready or not (a Deployment's own).
        "vllmReplicas": int(((obs.deployment or {}).get("status") or {}).get("replicas") or 0),
        "servers": [{"pod": r.pod, "healthy": r.healthy, "message": r.message} for r in obs.reports],
    }
    if obs.vllm_selector is not None:
        status["vllmSelector"] = obs.vllm_selector
    if budget is not None:
        status["budget"] = {k: v for k, v in budget.items() if not k.startswith("_")}
    if obs.l2_space is not None:
        status["l2"] = obs.l2_space
    return status, conds


def failed_status(generation: int | None, message: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """For a spec the operator cannot read (only possible if the CRD was bypassed or is stale)."""
    return {"observedGeneration": generation, "phase": "Failed"}, [condition("Ready", False, "InvalidSpec", message, generation)]


def _strip(conds: Iterable[Mapping[str, Any]]) -> list[tuple]:
    return sorted((c["type"], c["status"], c["reason"], c.get("message", ""), c.get("observedGeneration")) for c in conds)


def _without_stamp(usage: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (usage or {}).items() if k != "measuredAt"}


def _present(value: Any) -> Any:
    """value without None entries at any depth: what a merge patch leaves stored."""
    if isinstance(value, Mapping):
        return {k: _present(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_present(v) for v in value]
    return value


def status_patch(old: Mapping[str, Any], fields: Mapping[str, Any], conds: list[dict[str, Any]],
                 reports: list[ServerReport], inventory: Mapping[str, Any] | None = None,
                 hits: Mapping[str, Any] | None = None, at: datetime | None = None,
                 shared: bool = False, volume: tuple[int, int] | None = None, floor: int = 0) -> dict[str, Any] | None:
    """The status patch to write, or None when nothing a user could see changed: timestamps alone
    never write. Unmeasured usage and hits keep their last value; volume and floor are folded into
    usage.l2UsedBytes (namespace_l2)."""
    patch: dict[str, Any] = {k: v for k, v in fields.items() if old.get(k) != v}
    if old.get("budget") is not None and "budget" not in fields:
        patch["budget"] = None  # the budget was taken off the spec
    if _strip(old.get("conditions") or []) != _strip(conds):
        patch["conditions"] = merge_conditions(old.get("conditions") or [], conds)
    usage = summarize(reports, measured_at=now(), shared=shared, volume=volume, floor=floor)
    if usage and _without_stamp(usage) != _without_stamp(old.get("usage")):
        patch["usage"] = usage
    if inventory is not None and _without_stamp(inventory) != _without_stamp(old.get("inventory")):
        patch["inventory"] = {**inventory, "measuredAt": now()}
    stored = old.get("hits")
    stamp = (stored or {}).get("measuredAt")
    try:
        written = parse_iso(stamp) if isinstance(stamp, str) else None
    except ValueError:
        written = None
    at = at or datetime.now(UTC)
    age_s = at.timestamp() - written if written is not None else float("inf")
    # Changed hits (measuredAt aside) are written at once when there were none or another field is
    # written anyway (they ride along), else once the stored ones are HITS_WRITE_INTERVAL_S old.
    if (hits is not None and _present(_without_stamp(hits)) != _present(_without_stamp(stored))
            and (not stored or patch or age_s >= HITS_WRITE_INTERVAL_S)):
        patch["hits"] = {**hits, "measuredAt": iso(at.timestamp())}
    return patch or None
