"""The correctness canary: when a vLLM pod is due a check, what a check's answers mean, the
HitCorrectness condition and its texts, status.canary (against the status models), the namespace
id untouched by spec.canary, and the cache off over a HitMismatch: seeded from status, released by
the acknowledgement, and not carried to a new namespace id. What served a check (vLLM's own prefix
cache, lmcache's L1 or L2) from counters fed as values, and a verdict resting only on checks lmcache
served. A contradicted reference computed again, a bounded number of times. The jobs run here
against a fake vLLM (a function answering token ids and counting them, named as such);
tests/unit/test_vllmclient.py checks the client against a stand-in server and
tests/e2e/test_canary.py the whole with real vLLM."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from kvpersist import vllmclient
from kvpersist.api.spec import DEFAULT_CANARY_PROMPT
from kvpersist.api.status import field_patch, validate_patch
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.target import BYPASS_ANNOTATION, NAMESPACE_ID_LABEL, SERVER, VLLM, Target
from kvpersist.builders.vllm import build_vllm_deployment
from kvpersist.controller import canary as runner
from kvpersist.controller.fallback import bypassed_in
from kvpersist.httpclient import PeerError
from kvpersist.identity import resolve
from kvpersist.status import canary as c
from kvpersist.status.conditions import compute_status
from kvpersist.status.usage import LookupCounters
from kvpersist.status.workloads import pod_views, slim
from tests.cases.invalid_manifests import sample
from tests.unit.test_builders import target
from tests.unit.test_conditions import obs

REF = (5, 6, 7, 8)
WRONG = (5, 6, 9, 9)

# ---------------------------------------------------------------- the API


def spec_of(**canary: Any) -> Any:
    obj = sample()
    obj["spec"]["canary"] = canary
    return KVCacheNamespace.model_validate(obj).spec


def test_the_canary_is_not_part_of_the_namespace_id() -> None:
    plain = spec_of()
    assert plain.canary.enabled is False and plain.canary.max_tokens == 16 and plain.canary.interval_seconds == 600
    on = spec_of(enabled=True, prompt="Say something.", maxTokens=64, intervalSeconds=60)
    assert resolve(on.pins("0" * 16)).namespace_id == resolve(plain.pins("0" * 16)).namespace_id is not None
    assert "canary" not in plain.pins("0" * 16)


@pytest.mark.parametrize(("field", "value"), [("maxTokens", 0), ("maxTokens", 65), ("intervalSeconds", 59),
                                              ("prompt", ""), ("prompt", "two\nlines")])
def test_out_of_range_canary_settings_are_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValidationError, match=field):
        spec_of(**{field: value})


def test_the_default_prompt_spans_several_chunks_in_one_line() -> None:
    assert spec_of().canary.effective_prompt == DEFAULT_CANARY_PROMPT
    assert spec_of(prompt="hello").canary.effective_prompt == "hello"
    assert "\n" not in DEFAULT_CANARY_PROMPT and spec_of(prompt=DEFAULT_CANARY_PROMPT).canary.prompt  # the API takes it
    # 100 records of 12 to 17 tokens with common tokenizers: five chunks of 256 tokens or more.
    assert DEFAULT_CANARY_PROMPT.count("Record ") == 101 and len(DEFAULT_CANARY_PROMPT) > 4500


def test_the_digest_follows_what_decides_the_answer_besides_the_id() -> None:
    base = spec_of(enabled=True)
    same = {c.digest(base), c.digest(spec_of(enabled=False, intervalSeconds=60))}
    assert len(same) == 1 and next(iter(same)).startswith("sha256:")
    others = [spec_of(prompt="other"), spec_of(maxTokens=8)]
    obj = sample()
    obj["spec"]["vllm"]["extraArgs"] = ["--max-num-seqs", "8"]
    others.append(KVCacheNamespace.model_validate(obj).spec)
    obj = sample()
    obj["spec"]["vllm"]["env"] = [{"name": "OMP_NUM_THREADS", "value": "4"}]
    others.append(KVCacheNamespace.model_validate(obj).spec)
    assert len({c.digest(s) for s in others} | same) == len(others) + 1


# ---------------------------------------------------------------- when a pod is due

NID = "kvp-" + "c" * 32
OTHER_ID = "kvp-" + "d" * 32


def a_pod(name: str, component: str, uid: str, restarts: int = 0, ready: bool = True, node: str = "n1",
          namespace_id: str = NID, bypassed: bool = False) -> dict[str, Any]:
    """A pod as the API server returns it, slimmed as the watch cache keeps it."""
    return slim({"kind": "Pod", "metadata": {
        "name": name, "namespace": "ml", "uid": uid,
        "labels": {"app.kubernetes.io/instance": "r", "app.kubernetes.io/component": component,
                   NAMESPACE_ID_LABEL: namespace_id},
        "annotations": {BYPASS_ANNOTATION: "why"} if bypassed else {"other": "x"}},
        "spec": {"nodeName": node, "containers": [{"name": component}]},
        "status": {"phase": "Running", "podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": str(ready)}],
                   "containerStatuses": [{"name": component, "restartCount": restarts, "ready": ready}]}})


def test_the_watch_cache_keeps_what_the_canary_reads() -> None:
    kept = a_pod("r-vllm-a", VLLM, "u1", restarts=2, bypassed=True)
    assert kept["metadata"]["uid"] == "u1" and kept["spec"] == {"nodeName": "n1"} and kept["status"]["restarts"] == 2
    assert kept["metadata"]["annotations"] == {BYPASS_ANNOTATION: "why"}
    (view,) = pod_views([kept, a_pod("r-vllm-b", VLLM, "u2", namespace_id=OTHER_ID), a_pod("r-lmcache-0", SERVER, "s")],
                        NID, VLLM)
    assert view == c.Pod("r-vllm-a", "10.0.0.9", "u1", 2, "n1", True, False)


def servers(*pods: dict[str, Any], node: str = "n1") -> tuple[tuple[str, int, bool], ...]:
    return c.servers_of(list(pods), NID, node)


def test_a_new_pod_is_due_at_once_then_only_after_the_interval() -> None:
    vllm = pod_views([a_pod("r-vllm-a", VLLM, "u1")], NID, VLLM)[0]
    srv = servers(a_pod("r-lmcache-0", SERVER, "s1"), a_pod("r-lmcache-1", SERVER, "s9", node="n2"))
    assert srv == (("s1", 0, True),)  # only the server on the pod's node
    memory = c.PodMemory()
    c.observe(memory, vllm, srv, 100.0)
    assert c.due(vllm, srv, memory, 600, 100.0)
    memory.checked, memory.checked_at = c.check_key(vllm, srv), 100.0
    assert not c.due(vllm, srv, memory, 600, 699.0)
    assert c.due(vllm, srv, memory, 600, 700.0)


def test_a_pod_restart_is_due_at_once_a_server_restart_once_it_settled() -> None:
    vllm = pod_views([a_pod("r-vllm-a", VLLM, "u1")], NID, VLLM)[0]
    srv = servers(a_pod("r-lmcache-0", SERVER, "s1"))
    memory = c.PodMemory()
    c.observe(memory, vllm, srv, 0.0)
    memory.checked, memory.checked_at = c.check_key(vllm, srv), 0.0
    restarted = dataclasses.replace(vllm, restarts=1)
    c.observe(memory, restarted, srv, 10.0)
    assert c.due(restarted, srv, memory, 600, 10.0)  # its KV is gone: check at once
    memory.checked, memory.checked_at = c.check_key(restarted, srv), 10.0
    # The server restarts: not Ready yet, then Ready; checked once it has been Ready for SETTLE_S
    # (vLLM finds a new server by its heartbeat).
    starting = servers(a_pod("r-lmcache-0", SERVER, "s2", ready=False))
    c.observe(memory, restarted, starting, 20.0)
    assert not c.due(restarted, starting, memory, 600, 20.0)
    new = servers(a_pod("r-lmcache-0", SERVER, "s2"))
    c.observe(memory, restarted, new, 40.0)
    assert not c.due(restarted, new, memory, 600, 40.0 + c.SETTLE_S - 1)
    c.observe(memory, restarted, new, 40.0 + c.SETTLE_S)
    assert c.due(restarted, new, memory, 600, 40.0 + c.SETTLE_S)


@pytest.mark.parametrize("why", ["not ready", "bypassed", "no server", "server not ready", "failed lately"])
def test_a_pod_that_cannot_show_a_hit_is_not_due(why: str) -> None:
    vllm = pod_views([a_pod("r-vllm-a", VLLM, "u1", ready=why != "not ready", bypassed=why == "bypassed")], NID, VLLM)[0]
    srv = () if why == "no server" else servers(a_pod("r-lmcache-0", SERVER, "s1", ready=why != "server not ready"))
    memory = c.PodMemory(failed_at=95.0 if why == "failed lately" else float("-inf"))
    c.observe(memory, vllm, srv, 100.0)
    assert not c.due(vllm, srv, memory, 600, 100.0)
    if why == "failed lately":
        assert c.due(vllm, srv, memory, 600, 95.0 + c.RETRY_S)


# ---------------------------------------------------------------- verdicts


@pytest.mark.parametrize(("answers", "verdict"), [
    (c.Answers(REF), c.MATCH),
    (c.Answers(WRONG), None),  # ask again
    (c.Answers(WRONG, REF, WRONG), c.MISMATCH),  # cache-free twice the reference, cached twice not
    (c.Answers(WRONG, REF, (1, 1, 1, 1)), c.MISMATCH),  # cached differs again (otherwise)
    (c.Answers(WRONG, WRONG, WRONG), c.NONDETERMINISTIC),  # the cache-free answer is not the reference
    (c.Answers(WRONG, (0, 0, 0, 0), REF), c.NONDETERMINISTIC),
    (c.Answers(WRONG, REF, REF), c.NONDETERMINISTIC),  # the cached answers disagree with each other
])
def test_the_verdict_from_the_answers(answers: c.Answers, verdict: str | None) -> None:
    assert c.judge(REF, answers) == verdict


# ---------------------------------------------------------------- what served a check

P = 3947  # the built-in prompt's tokens in the test tokenizer: 15 whole chunks before its last token
C = 15 * 256


def sources(computed: int = 0, local: int = 0, external: int = 0, started: float | None = 1.0) -> c.PromptTokenSources:
    return c.PromptTokenSources(computed, local, external, started)


def lookups(hit_l1: int = 0, hit_l2: int = 0, started: str | None = "2026-01-01T00:00:00Z", queued: int | None = 0,
            dropped: int | None = 3) -> LookupCounters:
    return LookupCounters(requested=hit_l1 + hit_l2, hit=hit_l1 + hit_l2, hit_l1=hit_l1, hit_l2=hit_l2, started=started,
                          events_queued=queued, events_dropped=dropped)


BASE = c.Counters(sources(1000, 2000, 3000), {"r-lmcache-0": lookups(5000, 7000)})


def after(computed: int = 0, local: int = 0, external: int = 0, l1: int | None = 0, l2: int = 0,
          started: float | None = 1.0, server_started: str | None = "2026-01-01T00:00:00Z", queued: int | None = 0,
          dropped: int | None = 3) -> c.Counters:
    """BASE plus what the counters grew by across the request (l1 None: the server's unread)."""
    b = BASE.vllm
    assert b is not None
    return c.Counters(sources(b.computed + computed, b.local_cache_hit + local, b.external + external, started),
                      {"r-lmcache-0": None if l1 is None else lookups(5000 + l1, 7000 + l2, server_started, queued,
                                                                      dropped)})


@pytest.mark.parametrize(("grew", "tier"), [
    # Nothing else ran: each source is this request's.
    (after(computed=11, local=3936), c.GPU),  # vLLM's own prefix cache held it (16-token blocks): lmcache not asked
    (after(computed=P - C, external=C, l2=C), c.L2),  # after a server restart: L2, its L1 empty
    (after(computed=P - C, external=C, l1=C), c.L1),
    (after(computed=P - C, external=C, l1=None), c.LMCACHE),  # the servers' counters unread: lmcache, tier unknown
    (after(computed=P - C, external=C), c.LMCACHE),  # its lookup not counted yet (lmcache's event bus lags)
    (after(computed=P - C, external=C, l2=C, server_started="2026-01-02T00:00:00Z"), c.LMCACHE),  # server restarted
    (after(computed=P - C, external=C, l2=C, queued=2), c.LMCACHE),  # lookups still queued on its event bus
    (after(computed=P - C, external=C, l2=C, dropped=4), c.LMCACHE),  # a lookup dropped from its full event bus
    (after(computed=P - C, external=C, l2=C, queued=None, dropped=None), c.L2),  # a server without those gauges
    (after(computed=P), c.COMPUTED),  # neither cache held it (the first check after the reference)
    # Other requests moved the counters: never credited to the check.
    (after(computed=11 + P - C, local=3936, external=C, l1=C), c.UNKNOWN),  # vLLM's cache served it, another lmcache
    (after(computed=P - C + 5000, external=C, l2=C), c.UNKNOWN),  # served by lmcache, but 5000 others computed too
    (after(computed=P - C, external=2 * C, l1=C, l2=C), c.LMCACHE),  # another's L1 hit beside its L2 hit: no tier
    (after(computed=P - C, local=1024, external=C - 1024, l2=C), c.UNKNOWN),  # mixed: not all of it from lmcache
    (after(), c.UNKNOWN),  # not counted at all yet
    (after(computed=P - C, external=C, l2=C, started=2.0), c.UNKNOWN),  # vLLM restarted between the readings
])
def test_what_served_a_check_from_the_counters_around_it(grew: c.Counters, tier: str) -> None:
    assert c.served_by(P, BASE, grew) == tier


def test_what_served_a_check_is_unknown_without_counters_a_count_or_a_chunk() -> None:
    served = after(computed=P - C, external=C, l2=C)
    assert c.served_by(P, BASE, served) == c.L2
    assert c.served_by(None, BASE, served) == c.UNKNOWN  # vLLM gave no usage.prompt_tokens
    assert c.served_by(P, c.Counters(None, {}), served) == c.UNKNOWN
    assert c.served_by(P, BASE, c.Counters(None, served.servers)) == c.UNKNOWN
    assert c.served_by(P, served, BASE) == c.UNKNOWN  # counters that went down: a restart
    assert c.served_by(P, BASE, c.Counters(served.vllm, {})) == c.LMCACHE  # no server listed on its node
    assert c.cacheable_tokens(257) == 256 and c.cacheable_tokens(256) == 0 and c.cacheable_tokens(0) == 0
    assert c.served_by(200, BASE, after(local=200)) == c.UNKNOWN  # under a chunk: lmcache never serves it


VLLM_METRICS = """# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="/models/m",source="local_compute"} 4058.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="/models/m",source="local_cache_hit"} 3936.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="/models/m",source="external_kv_transfer"} 3840.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="/models/m",source="local_compute"} 2.0
vllm:prompt_tokens_by_source_created{engine="0",model_name="/models/m",source="local_compute"} 1.7e+09
vllm:external_prefix_cache_hits_total{engine="0",model_name="/models/m"} 3840.0
process_start_time_seconds 1.76e+09
"""


def test_the_pods_prompt_token_counters_from_its_metrics() -> None:
    assert c.prompt_token_sources(VLLM_METRICS) == c.PromptTokenSources(4060, 3936, 3840, 1.76e9)  # summed over engines
    no_source = VLLM_METRICS.replace('source="local_cache_hit"', 'source="elsewhere"')
    for garbled in ("", "<html>", no_source, VLLM_METRICS.replace("3936.0", "NaN"), VLLM_METRICS.replace("3936.0", "-1"),
                    VLLM_METRICS.replace("3936.0", "1e300"), VLLM_METRICS + "not a sample\n"):
        assert c.prompt_token_sources(garbled) is None, garbled[-40:]


# ---------------------------------------------------------------- status.canary


def test_the_record_fits_the_status_models_and_patches_only_changes() -> None:
    rec = c.with_reference(None, NID, "sha256:" + "a" * 64, REF, "r-vllm-a", "2026-01-01T00:00:00Z", 3947)
    rec = c.with_check(rec, "r-vllm-a", "2026-01-01T00:00:05Z", True, c.L2)
    assert rec["lastServedCheck"] == rec["lastCheck"] == {"at": "2026-01-01T00:00:05Z", "pod": "r-vllm-a", "match": True,
                                                          "tier": c.L2}
    assert rec["matches"] == {"gpu": 0, "l1": 0, "l2": 1, "lmcache": 0, "computed": 0, "unknown": 0}
    rec = c.with_check(rec, "r-vllm-b", "2026-01-01T00:01:00Z", True, c.GPU)
    assert rec["lastServedCheck"]["pod"] == "r-vllm-a" and rec["matches"]["gpu"] == 1  # not evidence: kept apart
    validate_patch({"canary": rec})
    assert field_patch(rec, dict(rec)) is None
    found = c.with_mismatch(rec, "0123456789ab", "r-vllm-a", "2026-01-01T00:10:00Z", REF, WRONG, (c.L2, c.L1))
    validate_patch({"canary": found})
    with pytest.raises(Exception, match="tier"):
        validate_patch({"canary": {**rec, "lastCheck": {**rec["lastCheck"], "tier": "disk"}}})
    released = c.acknowledged(found, NID, {c.ACK_ANNOTATION: "0123456789ab"})
    assert released == rec
    patch = field_patch(found, released)
    assert patch == {**rec, "mismatch": None}  # a merge patch would keep the old key
    validate_patch({"canary": patch})
    again = c.with_reference(found, NID, "sha256:" + "a" * 64, (1, 2), "r-vllm-c", "2026-01-01T00:20:00Z", 3947)
    assert again["referenceRecomputes"] == 1 and "matches" not in again and "lastServedCheck" not in again
    assert field_patch(found, again)["lastServedCheck"] is None  # evidence against the old reference goes
    validate_patch({"canary": again})
    with pytest.raises(Exception, match="referenceTokenIds"):
        validate_patch({"canary": {**rec, "referenceTokenIds": list(range(65))}})


def test_a_mismatch_stands_for_its_namespace_id_across_a_new_reference_and_not_beyond() -> None:
    rec = c.with_mismatch(c.with_reference(None, NID, "sha256:" + "a" * 64, REF, "p", "t"), "0123456789ab", "p", "t",
                          REF, WRONG)
    assert c.standing(rec, NID)["id"] == "0123456789ab" and c.standing(rec, OTHER_ID) is None
    assert c.standing(rec, None) is None
    renewed = c.with_reference(rec, NID, "sha256:" + "b" * 64, (1,), "q", "t2")  # another prompt: still the same data
    assert c.standing(renewed, NID) == rec["mismatch"]
    moved = c.with_reference(rec, OTHER_ID, "sha256:" + "a" * 64, REF, "q", "t2")  # a new id starts clean
    assert "mismatch" not in moved and c.standing(moved, OTHER_ID) is None
    assert c.reference_for(rec, NID, "sha256:" + "a" * 64) == REF and c.reference_for(rec, NID, "sha256:" + "b" * 64) is None
    assert c.acknowledged(rec, NID, {c.ACK_ANNOTATION: "ffffffffffff"}) is None  # names another mismatch
    assert c.acknowledged(rec, NID, None) is None


# ---------------------------------------------------------------- the condition and its texts


def test_only_a_check_lmcache_served_verifies_the_cache() -> None:
    digest = "sha256:" + "a" * 64
    rec = c.with_reference(None, NID, digest, REF, "r-vllm-a", "t0", P)
    for at in ("t1", "t2"):  # vLLM's own prefix cache answers the periodic checks
        rec = c.with_check(rec, "r-vllm-b", at, True, c.GPU)
    rec = c.with_check(rec, "r-vllm-b", "t3", True, c.COMPUTED)
    status, reason, message = c.condition_of(rec, NID, digest, None, True, 16, "r", "ml")
    assert (status, reason) == (None, c.NOT_REACHED)
    assert "not verified" in message and "of 3 matching checks, 2 answered from vLLM's own prefix cache, 1 computed" in message
    served = c.with_check(rec, "r-vllm-c", "t4", True, c.L2)
    status, reason, message = c.condition_of(served, NID, digest, None, True, 16, "r", "ml")
    assert (status, reason) == (True, c.MATCH)
    assert "1 matching check(s) served by lmcache (L1 0, L2 1, tier not known 0), the last on pod r-vllm-c at t4" in message
    assert "2 answered from vLLM's own prefix cache" in message and "no evidence" in message
    later = c.with_check(served, "r-vllm-b", "t5", True, c.GPU)  # a later check from vLLM's cache: the evidence stands
    assert c.condition_of(later, NID, digest, None, True, 16, "r", "ml")[:2] == (True, c.MATCH)
    recomputed = c.with_reference(later, NID, digest, REF, "r-vllm-a", "t6", P)  # evidence is against one reference
    assert c.condition_of(c.with_check(recomputed, "r-vllm-b", "t7", True, c.GPU), NID, digest, None, True, 16, "r",
                          "ml")[1] == c.NOT_REACHED
    short = c.with_check(c.with_reference(None, NID, digest, REF, "r-vllm-a", "t0", 200), "r-vllm-b", "t1", True,
                         c.UNKNOWN)
    message = c.condition_of(short, NID, digest, None, True, 16, "r", "ml")[2]
    assert "200 tokens, under one lmcache chunk" in message and "spec.canary.prompt" in message


def test_the_condition_and_its_texts() -> None:
    digest = "sha256:" + "a" * 64
    rec = c.with_check(c.with_reference(None, NID, digest, REF, "r-vllm-a", "t"), "r-vllm-b", "t", True, c.L1)
    assert c.condition_of(rec, NID, digest, None, False, 4, "r", "ml") is None  # off: no condition
    assert c.condition_of(None, NID, digest, None, True, 4, "r", "ml")[:2] == (None, c.CHECKING)
    ok = c.condition_of(rec, NID, digest, None, True, 4, "r", "ml")
    assert ok[:2] == (True, c.MATCH) and "r-vllm-b" in ok[2]
    assert c.condition_of(rec, NID, "sha256:" + "b" * 64, None, True, 4, "r", "ml")[1] == c.CHECKING  # another prompt
    unreachable = (None, c.UNREACHABLE, "no answer")
    assert c.condition_of(rec, NID, digest, unreachable, True, 4, "r", "ml") == unreachable
    found = c.with_mismatch(rec, "0123456789ab", "r-vllm-b", "t", REF, WRONG)
    for enabled in (True, False):  # the cache stays off with the canary turned off
        status, reason, message = c.condition_of(found, NID, digest, unreachable, enabled, 4, "r", "ml")
        assert (status, reason) == (False, c.MISMATCH)
    assert "[..., 9, 9]" in message and "[..., 7, 8]" in message and "from token 2" in message
    assert "kubectl annotate kvcachenamespace r -n ml kvpersist.dev/hit-correctness-ack=0123456789ab --overwrite" in message
    assert NID in message and f"kvpersist gc {NID}" in message and "r-vllm-b" in message
    assert "acknowledge" in c.bypass_message(found["mismatch"], "r", "ml")
    # An Event keeps 1024 characters: the longest names and answers still carry the acknowledgement.
    longest = {"id": "0123456789ab", "pod": "p" * 63, "expected": [2**31 - 1] * 64, "got": [0] + [2**31 - 1] * 63}
    message = c.mismatch_message(longest, NID, "r" * 40, "n" * 63)
    assert len(message) <= 1024 and c.ack_command("r" * 40, "n" * 63, "0123456789ab") in message, len(message)
    nondet = c.nondeterministic_message("p", REF, c.Answers(WRONG, WRONG, WRONG))
    assert "not deterministic" in nondet and "cache stays on" in nondet
    assert "computed again in 60s" in c.nondeterministic_message("p", REF, c.Answers(WRONG, WRONG, WRONG), 60.0)
    assert "computed again" not in c.nondeterministic_message("p", REF, c.Answers(WRONG, REF, REF), 60.0)
    for recompute_in in (240.0, None):
        nondet = c.nondeterministic_message("p" * 63, (2**31 - 1,) * 64, c.Answers((0,) * 64, (1,) * 64, (0,) * 64),
                                            recompute_in)
        assert len(nondet) <= 1024 and nondet.endswith("answers it can compare"), len(nondet)
    assert "computed again 3 times" in nondet and "kept until spec.canary or the namespace id changes" in nondet


def test_ready_holds_back_on_a_mismatch_only() -> None:
    fields, conds = compute_status(obs(canary=(False, c.MISMATCH, "a hit changed an answer")))
    by = {x["type"]: x for x in conds}
    assert fields["phase"] == "Degraded" and (by["Ready"]["status"], by["Ready"]["reason"]) == ("False", c.MISMATCH)
    assert by["Ready"]["message"].startswith("HitCorrectness: ")
    for unknown in ((None, c.UNREACHABLE, "x"), (None, c.NONDETERMINISTIC, "x"), (None, c.NOT_REACHED, "x"),
                    (True, c.MATCH, "x")):
        fields, conds = compute_status(obs(canary=unknown))
        assert fields["phase"] == "Ready", unknown
    _, conds = compute_status(obs(canary=(False, c.MISMATCH, "x"), namespace_id=None))
    assert c.CONDITION not in {x["type"] for x in conds}  # no id, no cache, no canary


def test_a_hit_mismatch_bypass_is_not_taken_for_the_servers_fallback() -> None:
    body = {"status": {"conditions": [{"type": "CacheBypassed", "status": "True", "reason": c.MISMATCH}]}}
    assert not bypassed_in(body)


# ---------------------------------------------------------------- the jobs, against a fake vLLM


class FakeVLLM:
    """STANDS IN for vLLM's answers (kvpersist.vllmclient.complete's signature): the cache-free
    (salted) answer and the cached one, each a function of how often it was asked; and for the
    counters read around them (runner.CounterReader's signature): each answer adds P prompt tokens
    to the pod's counters, computed when salted, else as `serving` says (gpu, l1, l2, computed),
    and an lmcache hit to the servers' lookup counters."""

    def __init__(self, cache_free: Callable[[int], tuple[int, ...]], cached: Callable[[int], tuple[int, ...]],
                 serving: str = c.L1) -> None:
        self.cache_free, self.cached, self.serving = cache_free, cached, serving
        self.asked: list[tuple[str, bool, str | None]] = []
        self.sources = c.PromptTokenSources(0, 0, 0, 1.0)
        self.lookups = LookupCounters(started="2026-01-01T00:00:00Z")

    def count(self, how: str) -> None:
        s, lk = self.sources, self.lookups
        if how == c.GPU:
            self.sources = dataclasses.replace(s, computed=s.computed + P - C, local_cache_hit=s.local_cache_hit + C)
        elif how in (c.L1, c.L2):
            self.sources = dataclasses.replace(s, computed=s.computed + P - C, external=s.external + C)
            self.lookups = dataclasses.replace(lk, requested=lk.requested + C, hit=lk.hit + C,
                                               hit_l1=lk.hit_l1 + (C if how == c.L1 else 0),
                                               hit_l2=lk.hit_l2 + (C if how == c.L2 else 0))
        else:
            self.sources = dataclasses.replace(s, computed=s.computed + P)

    def counters(self, ip: str, port: int, api_key: str | None, servers: tuple[tuple[str, str], ...], agent_port: int,
                 agent_token: str | None) -> c.Counters:
        assert agent_port == 8090 and servers, servers
        return c.Counters(self.sources, {name: self.lookups for name, _ in servers})

    def __call__(self, host: str, port: int, model: str, prompt: str, *, max_tokens: int, cache_salt: str | None,
                 store: bool, api_key: str | None, timeout: float) -> vllmclient.Completion:
        salted = cache_salt is not None
        if salted:
            assert cache_salt.startswith("kvp-canary-") and len(cache_salt) <= 32 and "/" not in cache_salt
        assert store is not salted  # a salted answer's KV is never read again: not stored (these pods use the cache)
        n = sum(1 for _, s, _ in self.asked if s == salted)
        self.asked.append((host, salted, api_key))
        self.count(c.COMPUTED if salted else self.serving)
        return vllmclient.Completion((self.cache_free if salted else self.cached)(n), "", P)


def canary_of(fake: FakeVLLM, **kw: Any) -> runner.Canary:
    """The runner against the fake: its answers and its counters, no pause before reading them."""
    return runner.Canary(asker=fake, read_counters=fake.counters, settle_s=0, **kw)


def no_counters(*args: Any) -> c.Counters:
    return c.Counters(None, {})


def canary_target(**canary: Any) -> Target:
    def on(obj: dict) -> None:
        obj["spec"]["canary"] = {"enabled": True, **canary}
    return target(mutate=on)


def body_of(t: Target, status: dict | None = None, annotations: dict | None = None) -> dict[str, Any]:
    return {"metadata": {"name": t.name, "namespace": t.namespace, "annotations": annotations or {}},
            "status": status or {}}


def pods_of(t: Target, vllm_uid: str = "u1") -> list[dict[str, Any]]:
    return [a_pod("r-vllm-a", VLLM, vllm_uid, namespace_id=t.namespace_id), a_pod("r-lmcache-0", SERVER, "s1",
                                                                                   namespace_id=t.namespace_id)]


def run_round(can: runner.Canary, t: Target, body: dict, pods: list[dict], allowed: bool = True) -> tuple[Any, bool, bool]:
    """One refresh's call and the job it started, waited for: (verdict, released, drift)."""
    done = threading.Event()
    drift: list[bool] = []
    before = getattr(can._by.get(("ml", t.name)), "job", None)
    verdict, released = can.refresh(("ml", t.name), body, t, pods, lambda d: (drift.append(d), done.set()), allowed)
    if can._by[("ml", t.name)].job is not before:  # a job started: its end, then the round after it
        assert done.wait(5)
        verdict, _ = can.refresh(("ml", t.name), body, t, pods, lambda d: None, allowed)
    return verdict, released, bool(drift and drift[0])


def test_a_reference_then_a_match_then_nothing_until_the_pod_restarts() -> None:
    t = canary_target()
    fake = FakeVLLM(lambda n: REF, lambda n: REF)
    can = canary_of(fake)
    verdict, _, drift = run_round(can, t, body_of(t), pods_of(t))
    assert verdict[:2] == (True, c.MATCH) and not drift
    assert [s for _, s, _ in fake.asked] == [True, False]  # the reference (salted), then the check
    rec = can.record(("ml", t.name))
    assert rec["referenceTokenIds"] == list(REF) and rec["lastCheck"]["match"] is True
    assert rec["namespaceId"] == t.namespace_id and rec["promptDigest"] == c.digest(t.spec)
    validate_patch({"canary": rec})
    run_round(can, t, body_of(t), pods_of(t))
    assert len(fake.asked) == 2  # nothing due
    run_round(can, t, body_of(t), pods_of(t, vllm_uid="u2"))
    assert [s for _, s, _ in fake.asked] == [True, False, False]  # a new pod: checked, the reference kept


def test_a_mismatch_turns_the_cache_off_until_acknowledged_and_survives_a_restart() -> None:
    t = canary_target()
    key = ("ml", t.name)
    can = canary_of(FakeVLLM(lambda n: REF, lambda n: WRONG))
    verdict, _, drift = run_round(can, t, body_of(t), pods_of(t))
    assert verdict[:2] == (False, c.MISMATCH) and drift
    rec = can.record(key)
    assert rec["mismatch"]["expected"] == list(REF) and rec["mismatch"]["got"] == list(WRONG)
    assert rec["mismatch"]["tiers"] == [c.L1, c.L1]  # both differing answers served by lmcache
    assert can.standing(key, body_of(t), t.namespace_id) is not None
    validate_patch({"canary": rec})
    # What apply renders meanwhile: vLLM without the connector.
    args = build_vllm_deployment(dataclasses.replace(t, cache_bypassed=True))["spec"]["template"]["spec"]["containers"][0]
    assert "--kv-transfer-config" not in str(args)
    # A restarted operator: the standing mismatch comes from status.
    again = canary_of(FakeVLLM(lambda n: REF, lambda n: REF))
    stored = body_of(t, {"canary": rec})
    assert again.standing(key, stored, t.namespace_id) == rec["mismatch"]
    verdict, _, _ = run_round(again, t, stored, pods_of(t))
    assert verdict[:2] == (False, c.MISMATCH)  # no job runs over it
    # Another namespace id starts clean.
    assert again.standing(key, stored, OTHER_ID) is None
    # The acknowledgement naming it releases it.
    wrong_ack = body_of(t, {"canary": rec}, {c.ACK_ANNOTATION: "ffffffffffff"})
    assert run_round(again, t, wrong_ack, pods_of(t))[1] is False
    acked = body_of(t, {"canary": rec}, {c.ACK_ANNOTATION: rec["mismatch"]["id"]})
    verdict, released, _ = run_round(again, t, acked, pods_of(t))
    assert released and again.standing(key, acked, t.namespace_id) is None
    assert verdict[:2] == (True, c.MATCH)  # checked again at once, with the cache back
    assert field_patch(rec, again.record(key))["mismatch"] is None


def test_checks_from_vllms_own_cache_verify_nothing_until_lmcache_serves_one() -> None:
    """vLLM's prefix cache is on by default and asks lmcache only for what it does not hold: the
    checks it answers match, but say nothing about lmcache."""
    t = canary_target()
    key = ("ml", t.name)
    fake = FakeVLLM(lambda n: REF, lambda n: REF, serving=c.GPU)
    can = canary_of(fake)
    verdict, _, _ = run_round(can, t, body_of(t), pods_of(t))
    assert verdict[:2] == (None, c.NOT_REACHED) and "not verified" in verdict[2]
    rec = can.record(key)
    assert rec["lastCheck"]["match"] is True and rec["lastCheck"]["tier"] == c.GPU and rec["matches"][c.GPU] == 1
    assert "lastServedCheck" not in rec and rec["promptTokens"] == P
    validate_patch({"canary": rec})
    fake.serving = c.L2  # the pod restarted: its prefix cache is empty, lmcache (L2 here) serves it
    verdict, _, _ = run_round(can, t, body_of(t), pods_of(t, vllm_uid="u2"))
    assert verdict[:2] == (True, c.MATCH) and "1 matching check(s) served by lmcache (L1 0, L2 1" in verdict[2]
    rec = can.record(key)
    assert rec["lastServedCheck"]["tier"] == c.L2 and rec["matches"] == {**rec["matches"], c.GPU: 1, c.L2: 1}
    # A restarted operator: the verdict from the stored record, evidence and all.
    again = canary_of(FakeVLLM(lambda n: REF, lambda n: REF, serving=c.GPU))
    assert again.refresh(key, body_of(t, {"canary": rec}), t, [], lambda d: None)[0][:2] == (True, c.MATCH)


def test_a_contradicted_reference_is_computed_again_with_a_backoff_and_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cache-free answer differs from every other one: each check contradicts the reference.
    It is computed again 60, 120 and 240 s later, then no more: Unknown, saying so."""
    clock = [1000.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: clock[0])
    t = canary_target()
    key = ("ml", t.name)
    fake = FakeVLLM(lambda n: (n,) * 4, lambda n: WRONG)
    can = canary_of(fake)
    verdict, _, drift = run_round(can, t, body_of(t), pods_of(t))
    assert verdict[:2] == (None, c.NONDETERMINISTIC) and not drift and "computed again in 60s" in verdict[2]
    assert can.record(key)["referenceTokenIds"] == [0] * 4
    for waited, recomputes, then in ((60, 1, "computed again in 120s"), (120, 2, "computed again in 240s"),
                                     (240, 3, "computed again 3 times")):
        clock[0] += waited - 1
        asked = len(fake.asked)
        assert run_round(can, t, body_of(t), pods_of(t))[0][1] == c.NONDETERMINISTIC and len(fake.asked) == asked
        clock[0] += 1
        verdict, _, _ = run_round(can, t, body_of(t), pods_of(t))
        rec = can.record(key)
        assert rec["referenceRecomputes"] == recomputes and rec["referenceTokenIds"] != [0] * 4
        assert verdict[1] == c.NONDETERMINISTIC and then in verdict[2], verdict
        assert [s for _, s, _ in fake.asked[asked:]] == [True, False, True, False]  # the reference, then a check
        validate_patch({"canary": rec})
    reference = rec["referenceTokenIds"]
    clock[0] += 3600  # the checks go on at their interval, against the last reference: kept now
    verdict, _, _ = run_round(can, t, body_of(t), pods_of(t))
    rec = can.record(key)
    assert rec["referenceRecomputes"] == 3 and rec["referenceTokenIds"] == reference
    assert verdict[1] == c.NONDETERMINISTIC and "kept until spec.canary or the namespace id changes" in verdict[2]


def test_answers_that_disagree_without_the_cache_are_unknown_and_keep_the_cache() -> None:
    t = canary_target()
    can = canary_of(FakeVLLM(lambda n: REF if n == 0 else (1, 2, 3, 4), lambda n: WRONG))
    verdict, _, drift = run_round(can, t, body_of(t), pods_of(t))
    assert verdict[:2] == (None, c.NONDETERMINISTIC) and not drift
    assert can.standing(("ml", t.name), body_of(t), t.namespace_id) is None
    assert can.record(("ml", t.name))["lastCheck"]["match"] is False


def test_an_unreachable_vllm_or_a_missing_api_key_is_unknown_and_retried_later() -> None:
    t = canary_target()

    def unreachable(*args: Any, **kw: Any) -> vllmclient.Completion:
        raise PeerError("connection refused")

    can = runner.Canary(asker=unreachable, read_counters=no_counters, settle_s=0)
    verdict, _, drift = run_round(can, t, body_of(t), pods_of(t))
    assert verdict[:2] == (None, c.UNREACHABLE) and "connection refused" in verdict[2] and not drift

    def refused(*args: Any, **kw: Any) -> vllmclient.Completion:
        raise vllmclient.VLLMAnswerError("/v1/completions answered HTTP 400: too long")

    can = runner.Canary(asker=refused, read_counters=no_counters, settle_s=0)
    assert run_round(can, t, body_of(t), pods_of(t))[0][:2] == (None, c.VLLM_ERROR)

    def with_key(obj: dict) -> None:
        obj["spec"]["canary"] = {"enabled": True}
        obj["spec"]["vllm"]["apiKeySecretRef"] = {"name": "vllm-key"}

    keyed = target(mutate=with_key)
    fake = FakeVLLM(lambda n: REF, lambda n: REF)
    can = canary_of(fake, read_api_key=lambda ns, name, item: None)
    verdict, _, _ = run_round(can, keyed, body_of(keyed), pods_of(keyed))
    assert verdict[:2] == (None, c.API_KEY_UNAVAILABLE) and "spec.vllm.apiKeySecretRef" in verdict[2] and not fake.asked
    can = canary_of(fake, read_api_key=lambda ns, name, item: "sk-1")
    assert run_round(can, keyed, body_of(keyed), pods_of(keyed))[0][:2] == (True, c.MATCH)
    assert {k for _, _, k in fake.asked} == {"sk-1"}


def test_no_job_for_a_refused_resource_or_with_the_canary_off() -> None:
    fake = FakeVLLM(lambda n: REF, lambda n: REF)
    can = canary_of(fake)
    t = canary_target()
    verdict, _, _ = run_round(can, t, body_of(t), pods_of(t), allowed=False)
    assert verdict[:2] == (None, c.CHECKING) and not fake.asked
    off = target()
    assert run_round(can, off, body_of(off), pods_of(off))[0] is None and not fake.asked


# ---------------------------------------------------------------- what the refresh makes of it


def test_the_refresh_says_it_once_keeps_the_cache_off_and_says_when_it_is_back(controller: Any) -> None:
    from kvpersist.controller import transitions

    t = canary_target()
    key = (t.namespace, t.name)
    rec = c.with_mismatch(c.with_reference(None, t.namespace_id, c.digest(t.spec), REF, "r-vllm-a", "t"),
                          "0123456789ab", "r-vllm-a", "t", REF, WRONG)
    body = body_of(t, {"canary": rec, "namespaceId": t.namespace_id})
    conds = transitions.bypassed(key, body, t, [{"type": "CacheBypassed", "status": "True",
                                                         "reason": "ServersUnavailable", "message": "x"}], 3)
    assert [(x["type"], x["reason"]) for x in conds] == [("CacheBypassed", c.MISMATCH)]
    verdict, _ = controller.canary.refresh(key, body, t, [], lambda d: None)
    hit = {"type": c.CONDITION, "status": "False", "reason": verdict[1], "message": verdict[2]}
    old = {"phase": "Ready", "namespaceId": t.namespace_id, "conditions": []}
    events = transitions.events_for(old, {**old, "phase": "Degraded"}, [hit, *conds])
    assert ("Warning", c.MISMATCH, verdict[2]) in events and ("Warning", "CacheBypassed", conds[0]["message"]) in events
    stored = {**old, "conditions": [hit, *conds]}
    assert not [e for e in transitions.events_for(stored, stored, [hit, *conds]) if e[1] == c.MISMATCH]  # once
    nondet = {**hit, "status": "Unknown", "reason": c.NONDETERMINISTIC, "message": "m"}
    assert [e[:2] for e in transitions.events_for(old, old, [nondet]) if e[1] == c.NONDETERMINISTIC] == [
        ("Warning", c.NONDETERMINISTIC)]
    assert not [e for e in transitions.events_for({**old, "conditions": [nondet]}, old, [nondet]) if e[1] == c.NONDETERMINISTIC]
    back = [e for e in transitions.events_for(stored, {**stored, "conditions": []}, []) if e[1] == "CacheRestored"]
    assert back and "acknowledged" in back[0][2]


def test_a_reference_on_a_pod_without_the_cache_sends_no_store_setting() -> None:
    """Any Ready pod of the id may compute the reference (salted, it misses every cache); one rolled
    without LMCache's connector is not sent kv_transfer_params (vLLM warns of each)."""
    t = canary_target()
    seen: list[tuple[bool, bool]] = []

    def asker(host: str, port: int, model: str, prompt: str, *, max_tokens: int, cache_salt: str | None, store: bool,
              api_key: str | None, timeout: float) -> vllmclient.Completion:
        seen.append((cache_salt is not None, store))
        return vllmclient.Completion(REF, "")

    can = runner.Canary(asker=asker, read_counters=no_counters, settle_s=0)
    bypassed = [a_pod("r-vllm-a", VLLM, "u1", namespace_id=t.namespace_id, bypassed=True),
                a_pod("r-lmcache-0", SERVER, "s1", namespace_id=t.namespace_id)]
    verdict, _, _ = run_round(can, t, body_of(t), bypassed)
    assert seen == [(True, True)] and verdict[:2] == (None, c.CHECKING)  # a reference, no check: no pod uses the cache


def test_one_resources_hanging_pods_hold_the_shared_pool_for_one_budget_not_one_call_each() -> None:
    """Issue 58 item 2: resource A's 50 vLLM pods accept the canary's call and never answer (each
    costs the call's whole bound), resource B's answer. With one worker for both (the pool is
    shared), A's job starts no check past its budget, so B's verdict comes after at most two of A's
    hanging calls, not fifty; and A's next job asks other pods than the ones that just hung."""
    call_s = 0.05
    hung: list[str] = []

    def asker(host: str, port: int, model: str, prompt: str, *, max_tokens: int, cache_salt: str | None,
              store: bool, api_key: str | None, timeout: float) -> vllmclient.Completion:
        if port == 8000 and cache_salt is None:  # A's checks (its reference, salted, answers)
            hung.append(host)
            threading.Event().wait(call_s)  # the call's bound, reached
            raise PeerError("timed out")
        return vllmclient.Completion(REF, "", P)

    def port(n: int) -> Callable[[dict], None]:
        def on(obj: dict) -> None:
            obj["spec"]["canary"] = {"enabled": True}
            obj["spec"]["vllm"]["port"] = n
        return on

    a, b = target(mutate=port(8000)), target(mutate=port(8001))
    server = a_pod("r-lmcache-0", SERVER, "s1", namespace_id=a.namespace_id)
    pods_a = [{**p, "status": {**p["status"], "podIP": f"10.0.1.{i}"}}
              for i, p in enumerate(a_pod(f"r-vllm-{i:02d}", VLLM, f"u{i}", namespace_id=a.namespace_id) for i in range(50))]
    can = runner.Canary(asker=asker, read_counters=no_counters, settle_s=0, workers=1, job_budget_s=1.5 * call_s)
    a_done, b_done = threading.Event(), threading.Event()
    can.refresh(("ml", "a"), body_of(a), a, [*pods_a, server], lambda _d: a_done.set())
    can.refresh(("ml", "b"), body_of(b), b, pods_of(b), lambda _d: b_done.set())  # queued behind A's job
    assert b_done.wait(30) and a_done.is_set()
    first = list(hung)
    assert 1 <= len(first) <= 2, first  # A's job stopped at its budget: 48 or more of its pods wait
    assert can.record(("ml", "b"))["lastCheck"]["match"] is True  # B's pod was checked, and matched
    # A's next round: the pods that just hung are not due (RETRY_S); the ones never asked go first.
    a_done.clear()
    can.refresh(("ml", "a"), body_of(a), a, [*pods_a, server], lambda _d: a_done.set())
    assert a_done.wait(30)
    assert hung[len(first):] and not set(hung[len(first):]) & set(first), hung


def test_the_calls_bound_comes_from_the_environment_and_must_be_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    t = canary_target()
    timeouts: list[float] = []

    def asker(*args: Any, timeout: float, **kw: Any) -> vllmclient.Completion:
        timeouts.append(timeout)
        return vllmclient.Completion(REF, "", P)

    monkeypatch.setenv(runner.CALL_TIMEOUT_ENV, "7.5")
    run_round(runner.Canary(asker=asker, read_counters=no_counters, settle_s=0), t, body_of(t), pods_of(t))
    assert timeouts and set(timeouts) == {7.5}
    monkeypatch.setenv(runner.CALL_TIMEOUT_ENV, "-1")
    with pytest.raises(ValueError, match=runner.CALL_TIMEOUT_ENV):
        runner.Canary()
