"""A server that refuses to start on another key than its namespace's (kvpersist.inserver.serve
exits 78, its termination message naming both fingerprints and the namespace): the pod statuses
the watch cache keeps, L2Ready False L2KeyMismatch, and one Warning event. The pure parts over pod
statuses as the API server returns them, and whole refresh rounds (tests/unit/test_status_patch.py's
FakeApi: every status write checked against the models)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from kvpersist.builders.target import NAMESPACE_ID_LABEL, SERVER, VLLM
from kvpersist.controller import kube, reading, refresh
from kvpersist.identity import key_fingerprint
from kvpersist.inserver.serve import KEY_MISMATCH_FORMAT
from kvpersist.status import keymismatch
from kvpersist.status.conditions import compute_status
from kvpersist.status.workloads import COMPONENT_LABEL, INSTANCE_LABEL, Seen, index_entry
from tests.cases.invalid_manifests import sample
from tests.unit.test_status_patch import KEY, FakeApi, _obs, _report, _rollout

LOG = logging.getLogger("test")
OLD_FP, NEW_FP = key_fingerprint(KEY), key_fingerprint(b"n" * 32)
NSID = "kvp-" + "4" * 32
REASON = "L2KeyMismatch"


def refusal(found: str = NEW_FP, namespace: str = NSID, expected: str = OLD_FP) -> str:
    """The server's termination message, rendered by the server module's own format."""
    return KEY_MISMATCH_FORMAT.format(found=found, namespace=namespace, expected=expected) + "\n"


def test_what_the_server_writes_is_what_the_operator_reads() -> None:
    """One format: the server's KEY_MISMATCH_FORMAT, parsed by keymismatch.MESSAGE."""
    match = keymismatch.MESSAGE.match(refusal())
    assert match and match.group("found", "namespace", "expected") == (NEW_FP, NSID, OLD_FP)
    assert keymismatch.EXIT_CODE == 78


def terminated(message: str, code: int = 78) -> dict[str, Any]:
    return {"terminated": {"exitCode": code, "reason": "Error", "message": message,
                           "startedAt": "2026-01-01T00:00:00Z", "finishedAt": "2026-01-01T00:00:01Z"}}


def server_pod(name: str, state: dict[str, Any], last: dict[str, Any] | None = None, component: str = SERVER,
               namespace_id: str = NSID, instance: str = "llama31-8b") -> dict[str, Any]:
    """A pod as the API server returns it (spec and all): a refusing lmcache-server container
    beside a running agent."""
    return {"metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "resourceVersion": "9",
                         "labels": {INSTANCE_LABEL: instance, COMPONENT_LABEL: component, NAMESPACE_ID_LABEL: namespace_id},
                         "annotations": {"kubectl.kubernetes.io/restartedAt": "x"}},
            "spec": {"nodeName": "node-1", "containers": [{"name": "lmcache-server", "image": "img"},
                                                         {"name": "inventory-agent", "image": "agent"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                       "conditions": [{"type": "Ready", "status": "False"}],
                       "containerStatuses": [
                           {"name": "lmcache-server", "ready": False, "restartCount": 4, "image": "img", "state": state,
                            "lastState": last or {}},
                           {"name": "inventory-agent", "ready": True, "restartCount": 0, "image": "agent",
                            "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}, "lastState": {}}]}}


CRASHLOOP = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}}
RUNNING = {"running": {"startedAt": "2026-01-01T00:01:00Z"}}


# ---------------------------------------------------------------- the watch cache keeps the refusal


def test_the_watch_cache_keeps_a_key_refusal_while_it_lasts() -> None:
    """The slim pod (what every status round reads) keeps a refusing container's termination, in
    CrashLoopBackOff too; not once the container runs again (the old bytes put back), though its
    lastState still holds the refusal. Today's slim dropped it: status could never tell."""
    for state, last in ((terminated(refusal()), None), (CRASHLOOP, terminated(refusal()))):
        slim = index_entry(server_pod("s-0", state, last))[("ml", "llama31-8b")]
        assert slim["status"]["containerStatuses"] == [
            {"name": "lmcache-server", "lastState": {"terminated": {"exitCode": 78, "message": refusal()}}}], slim
    slim = index_entry(server_pod("s-0", RUNNING, terminated(refusal())))[("ml", "llama31-8b")]
    assert "containerStatuses" not in slim["status"]
    for other in (terminated(refusal(), code=1), terminated("something else entirely")):  # not the server's refusal
        assert "containerStatuses" not in index_entry(server_pod("s-0", other))[("ml", "llama31-8b")]["status"]


# ---------------------------------------------------------------- the pure judgement


def test_refusals_are_read_from_pod_statuses_with_both_fingerprints() -> None:
    from kvpersist.status import keymismatch

    pods = [server_pod("s-1", CRASHLOOP, terminated(refusal())), server_pod("s-0", terminated(refusal())),
            server_pod("s-2", RUNNING, terminated(refusal())),  # running again: not refusing
            {**server_pod("s-3", terminated(refusal())), "metadata": {
                **server_pod("s-3", {})["metadata"], "deletionTimestamp": "2026-01-01T00:02:00Z"}},  # going away
            server_pod("s-4", terminated("kvpersist-build mismatch: lmcache 0.5.5, declared 0.5.6"))]  # the build check's
    found = keymismatch.refusals(pods)
    assert [(r.pod, r.found, r.namespace, r.expected) for r in found] == [("s-0", NEW_FP, NSID, OLD_FP),
                                                                          ("s-1", NEW_FP, NSID, OLD_FP)]
    message = keymismatch.condition_message(found, ("llama31-8b-l2-key", "master-key"), True)
    for part in ("the generated Secret llama31-8b-l2-key key master-key", f"fingerprint {NEW_FP}", f"fingerprint {OLD_FP}",
                 f"namespace {NSID}", "s-0, s-1", "nothing was read or deleted", "put the old bytes",
                 "back in the Secret"):
        assert part in message, (part, message)
    users = keymismatch.condition_message(found, ("mine", "k"), False)
    assert "Secret mine key k (spec.l2.encryption.keySecretRef)" in users
    # A message in another format (a newer server) still counts, in its own words.
    odd = keymismatch.refusals([server_pod("s-0", terminated("kvpersist-aesgcm key mismatch: something new"))])
    assert odd[0].found is None and odd[0].namespace == NSID
    assert "something new" in keymismatch.condition_message(odd, ("s", "k"), False)
    # The event's key ignores which pods refuse (they come and go), not the fingerprints.
    assert keymismatch.event_key(message) == keymismatch.event_key(
        keymismatch.condition_message(found[:1], ("llama31-8b-l2-key", "master-key"), True))
    assert keymismatch.event_key(message) != keymismatch.event_key(
        keymismatch.condition_message(keymismatch.refusals([server_pod("s-0", terminated(refusal(found="0" * 16)))]),
                                      ("llama31-8b-l2-key", "master-key"), True))


def test_a_key_mismatch_is_l2ready_false_and_degraded() -> None:
    fields, conds = compute_status(_obs(key_mismatch="Secret x holds another key", reports=[]))
    by = {c["type"]: c for c in conds}
    assert (by["L2Ready"]["status"], by["L2Ready"]["reason"]) == ("False", REASON)
    assert fields["phase"] == "Degraded" and by["Ready"]["reason"] == REASON


# ---------------------------------------------------------------- whole refresh rounds


def test_a_refresh_round_says_l2keymismatch_once_naming_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key Secret's bytes rotated, a server container restarted before the operator read them
    (its pod still of the old namespace): the round writes L2Ready False L2KeyMismatch naming the
    Secret, both fingerprints, the namespace and the way back, with one Warning event, not another
    when a second pod refuses too; the vLLM pods' statuses play no part; once the server runs
    again (the old bytes back) L2Ready is True again. Today's round said ServersStarting at most."""
    api = FakeApi(monkeypatch, [_report("s-0", 2048)])
    events: list[tuple[str, str, str]] = []
    monkeypatch.setattr(kube, "post_event", lambda body, t, reason, message: events.append((t, reason, message)))
    body = copy.deepcopy(sample("nvme-minimal"))
    body["metadata"].update(namespace="ml", uid="u1", generation=1, annotations={})
    target, _ = reading.target_of(body, OLD_FP)
    nsid = target.namespace_id
    assert nsid is not None

    def seen(*pods: dict[str, Any]) -> Seen:
        return Seen(statefulsets=[{**_rollout(1, 1), "metadata": {"name": target.server_name, "generation": 1}}],
                    deployments=[{**_rollout(1, 1), "metadata": {"name": target.vllm_name, "generation": 1}}],
                    pods=[index_entry(p)[("ml", "llama31-8b")] for p in pods],  # through the watch cache's slim
                    claims=[{"metadata": {"name": "l2", "labels": {COMPONENT_LABEL: SERVER}}, "status": {"phase": "Bound"}}],
                    live_ids=frozenset({nsid}))

    def l2ready() -> dict[str, Any]:
        return next(c for c in body["status"]["conditions"] if c["type"] == "L2Ready")

    def round_(*pods: dict[str, Any]) -> None:
        refresh.refresh_status(body, seen(*pods), LOG)
        if api.patches:
            body["status"] = {**(body.get("status") or {}), **api.patches[-1]}

    vllm = server_pod(f"{target.vllm_name}-x", terminated(refusal(namespace=nsid)), component=VLLM)
    healthy = server_pod(f"{target.server_name}-1", RUNNING)
    round_(server_pod(f"{target.server_name}-0", CRASHLOOP, terminated(refusal(namespace=nsid))), healthy, vllm)
    cond = l2ready()
    assert (cond["status"], cond["reason"]) == ("False", REASON), cond
    for part in ("the generated Secret llama31-8b-l2-key key master-key", NEW_FP, OLD_FP, nsid,
                 f"{target.server_name}-0", "put the old bytes"):
        assert part in cond["message"], (part, cond["message"])
    assert f"{target.server_name}-1" not in cond["message"] and f"{target.vllm_name}-x" not in cond["message"]
    assert [(t, r) for t, r, _ in events if r == REASON] == [("Warning", REASON)]
    assert body["status"]["phase"] == "Degraded"

    round_(server_pod(f"{target.server_name}-0", CRASHLOOP, terminated(refusal(namespace=nsid))),
           server_pod(f"{target.server_name}-1", terminated(refusal(namespace=nsid))))
    assert f"{target.server_name}-1" in l2ready()["message"]
    assert len([r for _, r, _ in events if r == REASON]) == 1  # the same mismatch: no second event

    round_(server_pod(f"{target.server_name}-0", RUNNING, terminated(refusal(namespace=nsid))), healthy)
    assert (l2ready()["status"], l2ready()["reason"]) == ("True", "ClaimsBound")
