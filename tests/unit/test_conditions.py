"""Phase and conditions from observations: a table of situations a user would meet."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from kvpersist.status.conditions import HITS_WRITE_INTERVAL_S, Observation, compute_status, merge_conditions, status_patch
from kvpersist.status.usage import ServerReport

NID = "kvp-" + "0" * 32


def rollout(ready: int, desired: int, generation: int = 1, observed: int = 1) -> dict:
    return {"metadata": {"generation": generation},
            "status": {"observedGeneration": observed, "readyReplicas": ready, "updatedReplicas": desired, "replicas": desired}}


def pod(name: str, ready: bool) -> dict:
    return {"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def bound(name: str, phase: str = "Bound") -> dict:
    return {"metadata": {"name": name}, "status": {"phase": phase}}


def obs(**kw) -> Observation:
    base = dict(generation=3, namespace_id=NID, identity_reason="", l2_kind="nvme", server_desired=1, vllm_desired=1,
                statefulset=rollout(1, 1), deployment=rollout(1, 1), server_pods=[pod("s-0", True)],
                claims=[bound("l2-s-0")], reports=[ServerReport("s-0", True, l1_used=1, l1_capacity=2, l2_healthy=True)])
    base.update(kw)
    return Observation(**base)


def scan(used: int, objects: int) -> dict:
    """status.inventory as the agents' scan writes it: the served namespace's share on one volume."""
    return {"volumes": [{"location": "pvc/l2-s-0", "namespaces": [{"namespaceId": NID, "bytes": used, "objects": objects}]}]}


def used_of(o: Observation) -> int:
    """The namespace's L2 bytes as status.usage shows them: the figure the budget counts."""
    from kvpersist.inventory.volume import served_of
    from kvpersist.status.conditions import budget_floor
    from kvpersist.status.usage import summarize

    usage = summarize(o.reports, "2026-01-01T00:00:00Z", o.shared, served_of(o.inventory, o.namespace_id), budget_floor(o))
    return usage["l2UsedBytes"]


def conds_of(o: Observation) -> tuple[str, dict]:
    fields, conds = compute_status(o)
    return fields["phase"], {c["type"]: (c["status"], c["reason"]) for c in conds}


def test_all_good_is_ready() -> None:
    phase, c = conds_of(obs())
    assert phase == "Ready" and all(s == "True" for s, _ in c.values())


def test_a_pin_check_that_cannot_answer_is_reported_and_leaves_ready_alone() -> None:
    """PinsVerified Unknown (Hub unreachable, a gated model, the check off) is only reported: the
    cache follows the declared pins (kvpersist.controller.pincheck)."""
    for verdict in ((None, "HubUnreachable", "cannot reach the Hub"), (True, "PinsMatch", "match")):
        phase, c = conds_of(obs(pins=verdict))
        assert phase == "Ready" and c["PinsVerified"] == ({None: "Unknown", True: "True"}[verdict[0]], verdict[1])
    assert "PinsVerified" not in conds_of(obs())[1]  # no revision to check: no condition


def test_nothing_running_yet_is_pending() -> None:
    phase, c = conds_of(obs(statefulset=rollout(0, 1), deployment=rollout(0, 1), server_pods=[pod("s-0", False)],
                            reports=[ServerReport("s-0", False, "unreachable")]))
    assert phase == "Pending" and c["LMCacheReady"] == ("False", "ServersStarting")


def test_rollout_in_progress_is_progressing() -> None:
    phase, c = conds_of(obs(deployment=rollout(1, 1, generation=4, observed=3)))
    assert phase == "Progressing" and c["VLLMReady"] == ("False", "RollingOut")


def test_ready_pod_with_unreachable_status_is_degraded() -> None:
    phase, c = conds_of(obs(reports=[ServerReport("s-0", False, "/status unreachable")]))
    assert phase == "Degraded" and c["LMCacheReady"] == ("False", "ServerUnhealthy") and c["Ready"][0] == "False"


def test_claim_pending_names_the_fix() -> None:
    _fields, conds = compute_status(obs(claims=[bound("l2-s-0", "Pending")]))
    l2 = next(c for c in conds if c["type"] == "L2Ready")
    assert l2["reason"] == "ClaimPending" and "storageClassName" in l2["message"]


def test_missing_pin_is_cache_disabled() -> None:
    fields, conds = compute_status(obs(namespace_id=None, identity_reason="missing pins: head_size", server_desired=0,
                                       statefulset=rollout(0, 0), server_pods=[], claims=[], reports=[]))
    assert fields["phase"] == "CacheDisabled" and fields["namespaceId"] is None
    ident = next(c for c in conds if c["type"] == "IdentityResolved")
    assert ident["status"] == "False" and "head_size" in ident["message"]
    assert ident["reason"] == "IdentityIncomplete"


def test_unpinned_image_is_cache_disabled_with_its_own_reason() -> None:
    fields, conds = compute_status(obs(namespace_id=None, identity_code="ImageNotPinned",
                                       identity_reason="spec.image is not pinned by digest", server_desired=0,
                                       statefulset=rollout(0, 0), server_pods=[], claims=[], reports=[]))
    by_type = {c["type"]: c for c in conds}
    assert fields["phase"] == "CacheDisabled"
    assert by_type["IdentityResolved"]["reason"] == "ImageNotPinned"
    assert "spec.image" in by_type["Ready"]["message"]


def test_status_written_only_on_change() -> None:
    o = obs()
    fields, conds = compute_status(o)
    first = status_patch({}, fields, conds, o.reports)
    assert first and first["phase"] == "Ready" and first["usage"]["l1UsedBytes"] == 1
    # Same observation again, later: nothing to write (timestamps alone never cause a write).
    assert status_patch(first, fields, conds, o.reports) is None
    more = [ServerReport("s-0", True, l1_used=2, l1_capacity=2, l2_healthy=True)]
    assert status_patch(first, fields, conds, more)["usage"]["l1UsedBytes"] == 2


def test_transition_time_kept_while_status_holds() -> None:
    old = [{"type": "Ready", "status": "True", "reason": "A", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    same = merge_conditions(old, [{"type": "Ready", "status": "True", "reason": "B", "message": "x"}])
    assert same[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    flipped = merge_conditions(old, [{"type": "Ready", "status": "False", "reason": "B", "message": "x"}])
    assert flipped[0]["lastTransitionTime"] != "2026-01-01T00:00:00Z"


def test_missing_existing_claim_names_it() -> None:
    _, conds = compute_status(obs(claims=[], existing_claim="kv-data"))
    l2 = next(c for c in conds if c["type"] == "L2Ready")
    assert l2["reason"] == "ClaimNotFound" and "kv-data" in l2["message"]


def test_failing_l2_writes_degrade_with_the_fix() -> None:
    rep = ServerReport("s-0", True, l1_used=1, l1_capacity=2, l2_healthy=True, l2_writes_failed=24, l2_writes_submitted=32)
    fields, conds = compute_status(obs(reports=[rep], writes_failing=["s-0"]))
    l2 = next(c for c in conds if c["type"] == "L2Ready")
    assert fields["phase"] == "Degraded"
    assert l2["reason"] == "L2WritesFailing" and "24 of 32" in l2["message"] and "full" in l2["message"]


def test_budget_exhausted_is_said_and_serving_stays_ready() -> None:
    full = ServerReport("s-0", True, l1_used=1, l1_capacity=2, l2_healthy=True, l2_used=2 * 2**20, l2_objects=4,
                        l2_writes_failed=12, l2_writes_submitted=16)
    fields, conds = compute_status(obs(reports=[full], writes_failing=["s-0"], budget_bytes=2 * 2**20))
    by = {c["type"]: c for c in conds}
    assert fields["phase"] == "Ready" and by["Ready"]["status"] == "True"
    assert by["WithinBudget"]["reason"] == "BudgetExhausted" and "stored KV keeps hitting" in by["WithinBudget"]["message"]
    assert by["L2Ready"]["status"] == "True"  # refusals at the cap are not a failing volume
    assert fields["budget"] == {"bytes": 2 * 2**20, "state": "Exhausted"}
    assert "2Mi/2Mi" in by["WithinBudget"]["message"]


def test_budget_counts_the_volume_when_the_server_forgot() -> None:
    """After a restart lmcache's count starts at zero; the files on the volume still count."""
    fresh = ServerReport("s-0", True, l1_used=1, l1_capacity=2, l2_healthy=True, l2_used=0, l2_objects=0)
    o = obs(reports=[fresh], budget_bytes=2**21, inventory=scan(2**21, 4))
    fields, _ = compute_status(o)
    assert fields["budget"]["state"] == "Exhausted" and used_of(o) == 2**21


def test_budget_does_not_shrink_when_the_server_restarts_before_the_next_scan() -> None:
    """A restarted server counts from zero and the agent's scan may predate the last writes: the
    budget stays as last written for the namespace (with a budget nothing is evicted)."""
    fresh = ServerReport("s-0", True, l1_used=1, l1_capacity=2, l2_healthy=True, l2_used=0, l2_objects=0)
    stale_scan = scan(0, 0)
    o = obs(reports=[fresh], budget_bytes=2**21, inventory=stale_scan, budget_floor=2**21)
    fields, _ = compute_status(o)
    assert fields["budget"]["state"] == "Exhausted" and used_of(o) == 2**21
    fields, _ = compute_status(obs(reports=[fresh], budget_bytes=2**21, inventory=None, budget_floor=2**21))
    assert fields["budget"]["state"] == "Exhausted"
    fields, _ = compute_status(obs(reports=[fresh], budget_bytes=2**21, inventory=stale_scan))
    assert fields["budget"]["state"] == "Available"  # no floor (a new namespace id): what is seen


def test_a_full_budget_of_padded_files_stays_exhausted_across_a_restart() -> None:
    """Encrypted chunks take 528,384 bytes on disk: three fill a 2 MiB budget at 1.5 MiB. After a
    restart (count zero, the scan not yet redone) the floor's verdict stands; a scan that counts
    the objects judges again."""
    padded = 3 * 528_384
    fresh = ServerReport("s-0", True, l1_used=1, l1_capacity=2, l2_healthy=True, l2_used=0, l2_objects=0)
    stale_scan = scan(0, 0)
    o = obs(reports=[fresh], budget_bytes=2**21, inventory=stale_scan, budget_floor=padded, budget_floor_exhausted=True)
    fields, _ = compute_status(o)
    assert fields["budget"]["state"] == "Exhausted" and used_of(o) == padded
    fields, _ = compute_status(obs(reports=[fresh], budget_bytes=2**21, inventory=stale_scan, budget_floor=padded))
    assert fields["budget"]["state"] == "Available"  # it was not full before either
    fields, _ = compute_status(obs(reports=[fresh], budget_bytes=2**21, inventory=scan(padded, 3), budget_floor=padded))
    assert fields["budget"]["state"] == "Exhausted"  # a fourth would not fit


def test_budget_with_room_and_failing_writes_is_still_a_failure() -> None:
    half = ServerReport("s-0", True, l1_used=1, l1_capacity=2, l2_healthy=True, l2_used=2**20, l2_objects=2,
                        l2_writes_failed=3, l2_writes_submitted=5)
    phase, c = conds_of(obs(reports=[half], writes_failing=["s-0"], budget_bytes=2**30))
    assert c["WithinBudget"] == ("True", "UnderBudget") and c["L2Ready"] == ("False", "L2WritesFailing") and phase == "Degraded"


def test_no_budget_no_budget_condition() -> None:
    fields, conds = compute_status(obs())
    assert "budget" not in fields and "WithinBudget" not in {c["type"] for c in conds}


def test_budget_taken_off_the_spec_leaves_status() -> None:
    fields, conds = compute_status(obs())
    assert status_patch({"budget": {"bytes": 1, "state": "Available"}}, fields, conds, [])["budget"] is None


def _hits(lookup: int, hit: int, window: dict | None = None) -> dict:
    return {"lookupTokens": lookup, "hitTokens": hit, "hitTokensL1": hit, "hitTokensL2": 0,
            "hitRate": round(hit / lookup, 4) if lookup else None, "hitRateL1": None, "hitRateL2": None,
            "window": window, "summary": None, "since": "2026-01-01T00:00:00Z", "servers": []}


def test_hit_figures_write_once_then_only_when_changed_and_at_most_once_a_minute() -> None:
    o = obs()
    fields, conds = compute_status(o)
    t0 = datetime(2026, 1, 1, 0, 0, 0, tzinfo=UTC)
    base = status_patch({}, fields, conds, o.reports, at=t0)
    first = status_patch(base, fields, conds, o.reports, hits=_hits(1000, 400), at=t0)
    assert first == {"hits": {**_hits(1000, 400), "measuredAt": "2026-01-01T00:00:00Z"}}  # the first figures: at once
    stored = {**base, "hits": {k: v for k, v in first["hits"].items() if v is not None}}  # a merge patch drops the Nones
    # Nothing changed, at every later tick: no write, however long.
    for minutes in (0, 1, 60):
        assert status_patch(stored, fields, conds, o.reports, hits=_hits(1000, 400), at=t0 + timedelta(minutes=minutes)) is None
    # Figures moved: not within HITS_WRITE_INTERVAL_S of the last write, then once.
    moved = _hits(2000, 1400, window={"seconds": 10, "lookupTokens": 1000, "hitTokens": 1000})
    assert status_patch(stored, fields, conds, o.reports, hits=moved, at=t0 + timedelta(seconds=30)) is None
    late = status_patch(stored, fields, conds, o.reports, hits=moved, at=t0 + timedelta(seconds=HITS_WRITE_INTERVAL_S))
    assert late == {"hits": {**moved, "measuredAt": "2026-01-01T00:01:00Z"}}
    # With another change written anyway, they ride along at once.
    more = [ServerReport("s-0", True, l1_used=2, l1_capacity=2, l2_healthy=True)]
    riding = status_patch(stored, fields, conds, more, hits=moved, at=t0 + timedelta(seconds=1))
    assert riding is not None and riding["hits"]["lookupTokens"] == 2000 and "usage" in riding
    # A window that became unknown (operator restart) is removed with an explicit null.
    stored_w = {**stored, "hits": {**{k: v for k, v in moved.items() if v is not None}, "measuredAt": "2026-01-01T00:00:00Z"}}
    gone = status_patch(stored_w, fields, conds, o.reports, hits=_hits(2000, 1400), at=t0 + timedelta(minutes=5))
    assert gone is not None and "window" in gone["hits"] and gone["hits"]["window"] is None
    # No hit figures (never counted): nothing written about them.
    assert status_patch(base, fields, conds, o.reports, hits=None, at=t0) is None


def test_unusable_key_secret_is_named_in_l2_ready() -> None:
    fields, conds = compute_status(obs(key_problem=("KeySecretNotFound", "spec.l2.encryption.keySecretRef: Secret k "
                                                                          "key master-key not found")))
    l2 = next(c for c in conds if c["type"] == "L2Ready")
    assert (l2["status"], l2["reason"]) == ("False", "KeySecretNotFound") and "keySecretRef" in l2["message"]
    assert fields["phase"] != "Ready"


# Pods the API server refuses to create (PodSecurity admission): said in LMCacheReady/VLLMReady.
PSS = ('pods "llama31-8b-lmcache-0" is forbidden: violates PodSecurity "restricted:latest": runAsNonRoot != true '
       '(pod or container "lmcache-server" must set securityContext.runAsNonRoot=true)')


def _event(reason: str, at: str, message: str = "") -> dict:
    return {"reason": reason, "lastTimestamp": at, "message": message}


def test_pods_refused_by_pod_security_say_so_with_the_fix() -> None:
    from kvpersist.status.workloads import slim

    none_created = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": 0}}
    deployment = {"metadata": {"name": "x-vllm", "generation": 1}, "status": {
        "observedGeneration": 1, "conditions": [
            {"type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable", "message": "m"},
            {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
             "message": PSS.replace("llama31-8b-lmcache-0", "x-vllm-5d9f-abcde")}]}}
    kept = slim(deployment)  # what the watch cache holds: the failure, in the API server's words
    assert kept["status"]["conditions"] == [deployment["status"]["conditions"][1]]
    fields, conds = compute_status(obs(statefulset=none_created, deployment=kept, server_pods=[], reports=[],
                                       claims=[bound("l2-s-0", "Pending")], server_create_failure=PSS))
    by_type = {c["type"]: c for c in conds}
    for type_ in ("LMCacheReady", "VLLMReady"):
        c = by_type[type_]
        assert (c["status"], c["reason"]) == ("False", "PodsForbidden"), c
        assert 'violates PodSecurity "restricted:latest"' in c["message"] and "runAsNonRoot" in c["message"]
        assert "meet the restricted Pod Security level" in c["message"] and "docs/security.md" in c["message"]
        assert "privileged" not in c["message"] and "hostIPC" not in c["message"]
    # The root cause leads Ready, not the claim that waits for a pod to be scheduled.
    assert by_type["L2Ready"]["reason"] == "ClaimPending"
    assert by_type["Ready"]["reason"] == "PodsForbidden" and fields["phase"] == "Pending"


def test_pods_refused_for_another_reason_are_not_created_in_the_api_servers_words() -> None:
    quota = 'pods "s-0" is forbidden: exceeded quota: gpu, requested: nvidia.com/gpu=1'
    _, c = conds_of(obs(statefulset={"metadata": {"generation": 1}, "status": {"observedGeneration": 1}},
                        server_pods=[], reports=[], server_create_failure=quota))
    assert c["LMCacheReady"] == ("False", "PodsNotCreated")
    _, conds = compute_status(obs(statefulset={"metadata": {"generation": 1}, "status": {"observedGeneration": 1}},
                                  server_pods=[], reports=[], server_create_failure=quota))
    assert quota in next(x for x in conds if x["type"] == "LMCacheReady")["message"]


def test_a_create_failure_does_not_hide_a_finished_rollout_or_a_ready_deployment() -> None:
    """A ReplicaFailure left on a Deployment whose pods all run, or a stale event beside a full
    StatefulSet, is not reported."""
    stale = {**rollout(1, 1), "status": {**rollout(1, 1)["status"], "conditions": [
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": PSS}]}}
    assert conds_of(obs(deployment=stale, server_create_failure=PSS))[1]["LMCacheReady"] == ("True", "ServersHealthy")
    assert conds_of(obs(deployment=stale))[1]["VLLMReady"] == ("True", "PodsReady")


def test_failed_create_is_the_latest_failure_unless_a_pod_was_created_since() -> None:
    from kvpersist.status.conditions import failed_create

    older = _event("FailedCreate", "2026-11-30T10:00:00Z", "old")
    newer = _event("FailedCreate", "2026-11-30T10:05:00Z", PSS)
    assert failed_create([]) is None and failed_create([_event("SuccessfulCreate", "2026-11-30T10:00:00Z")]) is None
    assert failed_create([newer, older]) == PSS
    assert failed_create([older, newer, _event("SuccessfulCreate", "2026-11-30T10:01:00Z")]) == PSS
    assert failed_create([older, newer, _event("SuccessfulCreate", "2026-11-30T10:06:00Z")]) is None
    micro = {"reason": "FailedCreate", "eventTime": "2026-11-30T10:07:00.123456Z", "message": "new style"}
    assert failed_create([newer, micro]) == "new style"
    assert len(failed_create([_event("FailedCreate", "2026-11-30T10:00:00Z", "x" * 10_000)]) or "") <= 1024


def test_events_are_read_only_after_the_grace_and_at_most_once_a_minute() -> None:
    from kvpersist.status.conditions import FAILED_CREATE_RECHECK_S, PODS_MISSING_GRACE_S, FailedCreateCheck, pods_missing

    assert pods_missing({"status": {"replicas": 0}}, 1) and not pods_missing({"status": {"replicas": 1}}, 1)
    assert not pods_missing(None, 1) and not pods_missing({"status": {}}, 0)
    calls: list[float] = []

    def lookup() -> str:
        calls.append(1)
        return PSS

    check, key = FailedCreateCheck(), ("ns", "x-lmcache")
    assert check.failure(key, False, 0.0, lookup) is None and calls == []  # all pods exist: no request
    assert check.failure(key, True, 100.0, lookup) is None and calls == []  # missing only just now
    assert check.failure(key, True, 100.0 + PODS_MISSING_GRACE_S, lookup) == PSS and len(calls) == 1
    for t in range(0, int(FAILED_CREATE_RECHECK_S) - 1, 5):  # refreshes every few seconds: one read
        assert check.failure(key, True, 100.0 + PODS_MISSING_GRACE_S + t, lookup) == PSS
    assert len(calls) == 1
    assert check.failure(key, True, 100.0 + PODS_MISSING_GRACE_S + FAILED_CREATE_RECHECK_S, lookup) == PSS
    assert len(calls) == 2
    assert check.failure(key, False, 500.0, lookup) is None  # the namespace was labelled: pods exist
    assert check.failure(key, True, 501.0, lookup) is None and len(calls) == 2  # a new grace starts


def l2_of(o: Observation) -> tuple[str, dict]:
    fields, conds = compute_status(o)
    return fields["phase"], next(c for c in conds if c["type"] == "L2Ready")


def test_claims_bound_is_l2_ready() -> None:
    phase, l2 = l2_of(obs(server_desired=2, claims=[bound("l2-s-0"), bound("l2-s-1")],
                          statefulset=rollout(2, 2), server_pods=[pod("s-0", True), pod("s-1", True)],
                          reports=[ServerReport(p, True, l2_healthy=True) for p in ("s-0", "s-1")]))
    assert (l2["status"], l2["reason"], l2["message"]) == ("True", "ClaimsBound", "2 claim(s) bound") and phase == "Ready"


def test_a_claim_the_statefulset_has_not_made_yet_is_missing() -> None:
    phase, l2 = l2_of(obs(server_desired=2, claims=[bound("l2-s-0")]))
    assert (l2["status"], l2["reason"]) == ("False", "ClaimMissing") and "1/2 claims exist" in l2["message"]
    assert phase != "Ready"


def test_an_unhealthy_adapter_degrades_and_names_the_pod() -> None:
    phase, l2 = l2_of(obs(reports=[ServerReport("s-0", True, l2_healthy=False)]))
    assert (l2["status"], l2["reason"]) == ("False", "AdapterUnhealthy") and l2["message"] == "nvme L2 adapter unhealthy on s-0"
    assert phase == "Degraded"


def test_a_healthy_bucket_adapter_is_l2_ready_with_the_preflight_said() -> None:
    bucket = dict(l2_kind="hfBucket", claims=[], bucket_check=(True, "BucketReachable", "bucket acme/kv reachable"))
    phase, l2 = l2_of(obs(**bucket, reports=[ServerReport("s-0", True, l2_healthy=True)]))
    assert (l2["status"], l2["reason"]) == ("True", "AdapterHealthy") and phase == "Ready"
    assert l2["message"] == "hfbucket adapter healthy; bucket acme/kv reachable"
    # The same preflight before any server said how its adapter is: not yet known.
    _phase, unknown = l2_of(obs(**bucket, reports=[ServerReport("s-0", True)]))
    assert (unknown["status"], unknown["reason"]) == ("Unknown", "BucketReachable")


def test_scale_status_counts_the_vllm_pods_there_are_and_names_their_selector() -> None:
    """status.vllmReplicas and status.vllmSelector back the scale subresource (kubectl scale, an
    HPA): the pods the Deployment has, ready or not; and the selector as a string, as HPA reads it."""
    deployment = {"metadata": {"generation": 2},
                  "status": {"observedGeneration": 2, "replicas": 3, "readyReplicas": 1, "updatedReplicas": 3}}
    fields, _ = compute_status(obs(vllm_desired=3, deployment=deployment, vllm_selector="app.kubernetes.io/name=kvpersist"))
    assert (fields["vllmReplicas"], fields["readyReplicas"], fields["replicas"]) == (3, 1, "1/3")
    assert fields["vllmSelector"] == "app.kubernetes.io/name=kvpersist"
    fields, _ = compute_status(obs(deployment=None))  # not made yet: none there
    assert fields["vllmReplicas"] == 0 and "vllmSelector" not in fields
