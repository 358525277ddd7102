"""spec.prewarm without a cluster: the API, the namespace id it leaves alone, the declared list
(the spec's prompts and a ConfigMap's), which server is warmed through which vLLM pod and when, a
pass against stand-in peers (no network: each stand-in answers as the agent, vLLM's /tokenize and
/v1/completions would, and is named as one), the scheduling of passes, and the Warm condition's
texts. The agent's route against a stand-in lmcache is tests/unit/test_prewarm_agent.py; the real
data path tests/integration/test_prewarm.py and tests/e2e/test_prewarm.py."""

from __future__ import annotations

import copy
import threading
import time
from typing import Annotated, Any

import pytest
from pydantic import Field, TypeAdapter, ValidationError

from kvpersist.api.spec import Prewarm
from kvpersist.api.text import PROMPT_PATTERN, SURROGATES, refuse_control_in_prompt
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.target import NAMESPACE_ID_LABEL, Target
from kvpersist.controller import prewarm as runner
from kvpersist.controller.prewarm import UNREAD, Pair, Pass, Prompt, PromptResult, ServerWarmth
from kvpersist.httpclient import PeerError
from kvpersist.identity import resolve
from kvpersist.inventory.prefetch import Answer
from kvpersist.status.conditions import Observation, compute_status
from kvpersist.status.workloads import Pod
from tests.cases.invalid_manifests import sample
from tests.cases.oracles import PROMPT_ALLOWED, forbidden

NSID = "kvp-" + "a" * 32


def spec_with(prewarm: dict[str, Any] | None) -> dict[str, Any]:
    obj = copy.deepcopy(sample())
    if prewarm is not None:
        obj["spec"]["prewarm"] = prewarm
    return obj


# ---------------------------------------------------------------- the API


def test_prewarm_takes_prompts_with_their_line_breaks_and_refuses_other_controls_naming_the_field() -> None:
    spec = KVCacheNamespace.model_validate(spec_with({"prompts": ["Q:\n\tA\r\n"], "systemPrompts": ["You are terse."],
                                                      "configMapRef": {"name": "warm-list"}})).spec
    assert spec.prewarm is not None and spec.prewarm.prompts == ["Q:\n\tA\r\n"] and spec.prewarm.declared
    for bad, char in (("a\x1bb", "U+001B"), ("a\u202eb", "U+202E"), ("a\x00", "U+0000")):
        with pytest.raises(ValidationError) as info:
            KVCacheNamespace.model_validate(spec_with({"systemPrompts": [bad]}))
        assert "spec.prewarm.systemPrompts.0" in str(info.value) and char in str(info.value)
    with pytest.raises(ValidationError, match="at most 16"):
        KVCacheNamespace.model_validate(spec_with({"prompts": [f"p{i}" for i in range(17)]}))
    with pytest.raises(ValidationError):
        KVCacheNamespace.model_validate(spec_with({"prompts": [""]}))
    with pytest.raises(ValidationError):
        KVCacheNamespace.model_validate(spec_with({"prompts": ["x" * 32769]}))
    assert not Prewarm().declared


def test_the_prompt_pattern_and_the_models_refuse_the_same_characters() -> None:
    """The CRD's pattern (as pydantic-core's Rust regex reads RE2's \\x{..}) and the models' check
    agree on every code point between two letters: TAB, LF and CR pass, every other refused one not."""
    pattern = TypeAdapter(Annotated[str, Field(pattern=PROMPT_PATTERN)])
    differ = []
    for c in range(0x110000):
        if SURROGATES[0] <= c <= SURROGATES[1]:
            continue
        value = f"a{chr(c)}b"
        try:
            pattern.validate_python(value)
            matched = True
        except ValidationError:
            matched = False
        try:
            refuse_control_in_prompt(value)
            accepted = True
        except ValueError:
            accepted = False
        if matched != accepted or accepted != (chr(c) in PROMPT_ALLOWED or not forbidden(chr(c))):
            differ.append(f"U+{c:04X}")
    assert differ == []


def test_prewarm_is_not_part_of_the_namespace_id() -> None:
    bare = KVCacheNamespace.model_validate(spec_with(None)).spec
    warm = KVCacheNamespace.model_validate(spec_with({"prompts": ["p"], "systemPrompts": ["s"],
                                                     "configMapRef": {"name": "w"}})).spec
    assert bare.pins("f" * 16) == warm.pins("f" * 16)
    assert resolve(bare.pins("f" * 16)).namespace_id == resolve(warm.pins("f" * 16)).namespace_id is not None


# ---------------------------------------------------------------- the declared list


def prewarm(**fields: Any) -> Prewarm:
    return Prewarm.model_validate(fields)


def test_the_list_is_the_specs_then_the_configmaps_by_key_without_duplicates() -> None:
    pw = prewarm(prompts=["a", "b"], systemPrompts=["You are terse."], configMapRef={"name": "w"})
    cm = {"data": {"system-b": "Be brief.", "prompt-a": "c", "prompt-dup": "a", "notes": "x", "system-a": "You are terse."}}
    listed = runner.declared(pw, "ml", cm)
    assert [(p.source, p.system) for p in listed.prompts] == [
        ("spec.prewarm.prompts[0]", False), ("spec.prewarm.prompts[1]", False), ("spec.prewarm.systemPrompts[0]", True),
        ("ConfigMap w key prompt-a", False), ("ConfigMap w key system-b", True)]
    assert listed.problem is None and "keys ignored (not prompt-* or system-*): notes" in listed.note
    # A system prompt and a raw prompt of the same text are other token ids: both kept.
    both = runner.declared(prewarm(prompts=["x"], systemPrompts=["x"]), "ml")
    assert len(both.prompts) == 2 and both.prompts[0].digest != both.prompts[1].digest


def test_the_list_digest_follows_every_change_of_the_list() -> None:
    base = runner.declared(prewarm(prompts=["a", "b"]), "ml")
    assert base.digest == runner.declared(prewarm(prompts=["a", "b"]), "ml").digest
    for other in (prewarm(prompts=["b", "a"]), prewarm(prompts=["a", "b "]), prewarm(prompts=["a"]),
                  prewarm(prompts=["a"], systemPrompts=["b"])):
        assert runner.declared(other, "ml").digest != base.digest


@pytest.mark.parametrize(("configmap", "reason"), [
    (UNREAD, "ConfigMapNotRead"), (None, "ConfigMapNotFound"), ("the API server answered 403", "ConfigMapUnreadable"),
    ({"data": {"readme": "x"}}, "ConfigMapEmpty"), ({}, "ConfigMapEmpty")])
def test_a_configmap_that_gives_no_prompt_is_a_problem_naming_the_field(configmap: Any, reason: str) -> None:
    listed = runner.declared(prewarm(prompts=["a"], configMapRef={"name": "w"}), "ml", configmap)
    assert [p.source for p in listed.prompts] == ["spec.prewarm.prompts[0]"]
    assert listed.problem is not None and listed.problem[0] == reason
    assert "spec.prewarm.configMapRef: ConfigMap w" in listed.problem[1]


def test_over_the_cap_the_first_prompts_are_kept_and_the_rest_is_a_problem() -> None:
    cm = {"data": {f"prompt-{i:03d}": f"text {i}" for i in range(runner.MAX_PROMPTS + 5)}}
    listed = runner.declared(prewarm(prompts=["first"], configMapRef={"name": "w"}), "ml", cm)
    assert len(listed.prompts) == runner.MAX_PROMPTS and listed.prompts[0].source == "spec.prewarm.prompts[0]"
    assert listed.problem is not None and listed.problem[0] == "TooManyPrompts" and "declares 70 prompts" in listed.problem[1]


# ---------------------------------------------------------------- which server through which vLLM pod, and when


def pod(name: str, component: str, node: str = "gpu-0", nsid: str = NSID, ready: bool = True, uid: str | None = None,
        restarts: int = 0, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": uid or f"uid-{name}",
                            "labels": {"app.kubernetes.io/component": component, NAMESPACE_ID_LABEL: nsid}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node},
            "status": {"podIP": f"127.0.0.{len(name)}", "restarts": restarts,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_each_ready_server_is_paired_with_a_ready_vllm_pod_of_its_id_on_its_node() -> None:
    pods = [pod("r-lmcache-0", "lmcache-server"), pod("r-lmcache-1", "lmcache-server", node="gpu-1"),
            pod("r-lmcache-2", "lmcache-server", ready=False), pod("r-vllm-b", "vllm"), pod("r-vllm-a", "vllm"),
            pod("r-vllm-old", "vllm", node="gpu-1", nsid="kvp-" + "b" * 32),  # another id: never its KV
            pod("r-vllm-going", "vllm", node="gpu-1", deleting=True)]
    got = runner.pairs(pods, NSID)
    assert [(p.server.name, p.vllm.name if p.vllm else None) for p in got] == [("r-lmcache-0", "r-vllm-a"),
                                                                                ("r-lmcache-1", None)]


def test_a_restart_of_either_pod_or_another_list_is_a_new_pass() -> None:
    listed = runner.declared(prewarm(prompts=["a"]), "ml")
    base = runner.pairs([pod("s", "lmcache-server"), pod("v", "vllm")], NSID)[0].fingerprint(listed)
    for changed in ([pod("s", "lmcache-server", restarts=1), pod("v", "vllm")],
                    [pod("s", "lmcache-server", uid="new"), pod("v", "vllm")],
                    [pod("s", "lmcache-server"), pod("v", "vllm", restarts=2)],
                    [pod("s", "lmcache-server"), pod("v2", "vllm")]):
        assert runner.pairs(changed, NSID)[0].fingerprint(listed) != base
    other = runner.declared(prewarm(prompts=["b"]), "ml")
    assert runner.pairs([pod("s", "lmcache-server"), pod("v", "vllm")], NSID)[0].fingerprint(other) != base


def test_when_a_server_is_due() -> None:
    fp = ("uid", 0, "v", 0, "d")
    ok = Pass(fp, 1000.0, (PromptResult("p", True, 3),))
    cold = Pass(fp, 1000.0, (PromptResult("p", False, why="x"),))
    failed = Pass(fp, 1000.0, (), ("NoLayout", "x"))
    assert runner.due(fp, None, 1000.0)
    assert runner.due(("uid", 1, "v", 0, "d"), ok, 1000.1)  # the server restarted: at once
    assert not runner.due(fp, ok, 1000.0 + runner.REWARM_PERIOD_S - 1) and runner.due(fp, ok, 1000.0 + runner.REWARM_PERIOD_S)
    assert not runner.due(fp, cold, 1000.0 + runner.NOT_WARM_RETRY_S - 1) and runner.due(fp, cold, 1000.0 + runner.NOT_WARM_RETRY_S)
    assert not runner.due(fp, failed, 1000.0 + runner.FAILED_RETRY_S - 1) and runner.due(fp, failed, 1000.0 + runner.FAILED_RETRY_S)


# ---------------------------------------------------------------- a pass, against stand-in peers


class StandInPeers:
    """STAND-IN for the agent (prefetch), vLLM's /tokenize and /v1/completions: answers from a
    dict of what "L2" and "L1" hold, so a pass's decisions can be checked without a cluster."""

    def __init__(self, l2: dict[tuple[int, ...], bool] | None = None, registered: bool = True,
                 max_model_len: int | None = None) -> None:
        self.l2 = l2 or {}
        self.l1: set[tuple[int, ...]] = set()
        self.registered, self.max_model_len = registered, max_model_len
        self.calls: list[str] = []
        self.prefetch_codes: list[int] = []  # answered before any real one (e.g. 503 while no layout)
        self.tokenize_error: PeerError | None = None
        self.complete_error: PeerError | None = None
        self.stores = True

    def tokenize(self, prompt: Prompt) -> list[int]:
        self.calls.append(f"tokenize {prompt.source}")
        if self.tokenize_error:
            raise self.tokenize_error
        return [ord(c) for c in prompt.text]

    def prefetch(self, ids: list[int]) -> tuple[int, Answer]:
        self.calls.append("prefetch")
        if self.prefetch_codes:
            code = self.prefetch_codes.pop(0)
            return code, Answer(error=f"stand-in {code}")
        if not self.registered:
            return 503, Answer(error="no vLLM has registered its KV layout with this lmcache server yet")
        chunks = len(ids) // 4  # a chunk of 4 "tokens" here
        if chunks == 0:
            return 200, Answer(status="noop")
        key = tuple(ids)
        found = chunks if key in self.l1 or self.l2.get(key) else 0
        if found:
            self.l1.add(key)
        return 200, Answer(status="completed", chunks=chunks, found_keys=found, total_keys=chunks)

    def complete(self, ids: list[int]) -> None:
        self.calls.append("complete")
        if self.complete_error:
            raise self.complete_error
        if self.stores:
            self.l1.add(tuple(ids))
            self.l2[tuple(ids)] = True


def run(peers: StandInPeers, *prompts: Prompt, deadline: float = 60.0) -> Pass:
    seen: list[tuple[int, int]] = []
    done = runner.run_pass(("fp",), prompts, peers, peers.tokenize, lambda k, n: seen.append((k, n)),
                           time.monotonic() + deadline, sleep=lambda s: None)
    assert seen[-1] == (len(prompts), len(prompts)) or done.failure is not None
    return done


P = Prompt("spec.prewarm.prompts[0]", False, "abcdefgh")  # two stand-in chunks
S = Prompt("spec.prewarm.systemPrompts[0]", True, "sys-prompt!!")


def test_a_prompt_l2_holds_is_loaded_and_never_computed() -> None:
    peers = StandInPeers(l2={tuple(map(ord, P.text)): True})
    done = run(peers, P)
    assert done.failure is None and done.results == (PromptResult(P.source, True, 2),)
    assert "complete" not in peers.calls


def test_a_prompt_never_asked_is_computed_once_through_vllm_and_then_seen_in_l1() -> None:
    peers = StandInPeers()
    done = run(peers, P, S)
    assert [r.warm and r.computed for r in done.results] == [True, True]
    assert peers.calls.count("complete") == 2
    again = run(peers, P, S)  # L1 holds them now: nothing computed
    assert [r.warm and not r.computed for r in again.results] == [True, True] and peers.calls.count("complete") == 2


def test_a_prompt_vllm_cannot_compute_or_that_is_not_stored_stays_cold_with_the_reason() -> None:
    long = StandInPeers(max_model_len=8)
    done = run(long, P)
    assert not done.results[0].warm and "not under spec.identity.maxModelLen 8" in done.results[0].why
    assert "complete" not in long.calls
    refused = StandInPeers()
    refused.complete_error = PeerError("/v1/completions answered HTTP 400: too long")
    assert "vLLM refused to compute it" in run(refused, P).results[0].why
    lost = StandInPeers()
    lost.stores = False  # computed, yet never in L1 (stores failing)
    cold = run(lost, P).results[0]
    assert not cold.warm and "computed through vLLM, yet the server holds 0 of its 2" in cold.why


def test_under_one_chunk_is_warm_with_nothing_to_keep() -> None:
    done = run(StandInPeers(), Prompt("spec.prewarm.prompts[0]", False, "ab"))
    assert done.results[0].warm and done.results[0].chunks == 0 and "under one chunk" in done.results[0].why


def test_no_layout_yet_is_waited_for_then_a_failure_that_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "LAYOUT_WAIT_S", 30.0)
    peers = StandInPeers(l2={tuple(map(ord, P.text)): True})
    peers.prefetch_codes = [503, 503]  # vLLM registers with the restarted server a moment later
    assert run(peers, P).warm == 1
    monkeypatch.setattr(runner, "LAYOUT_WAIT_S", 0.0)
    never = StandInPeers(registered=False)
    done = run(never, P)
    assert done.failure is not None and done.failure[0] == "NoLayout" and "no vLLM has registered" in done.failure[1]


@pytest.mark.parametrize(("code", "reason"), [(0, "AgentUnreachable"), (404, "AgentOutdated"), (502, "ServerUnreachable")])
def test_an_agent_that_cannot_be_asked_stops_the_pass(code: int, reason: str) -> None:
    peers = StandInPeers()
    peers.prefetch_codes = [code]
    done = run(peers, P, S)
    assert done.failure is not None and done.failure[0] == reason and done.results == ()


def test_tokenize_refused_is_that_prompt_cold_and_tokenize_unreachable_stops_the_pass() -> None:
    refused = StandInPeers()
    refused.tokenize_error = PeerError("/tokenize answered HTTP 400: no chat template")
    done = run(refused, S)
    assert done.failure is None and not done.results[0].warm and "vLLM's /tokenize refused it" in done.results[0].why
    down = StandInPeers()
    down.tokenize_error = PeerError("connection refused")
    assert run(down, S).failure == ("VLLMUnreachable", "vLLM's /tokenize failed: connection refused")


def test_a_pass_past_its_deadline_leaves_the_rest_cold() -> None:
    done = run(StandInPeers(), P, S, deadline=-1.0)
    assert [r.warm for r in done.results] == [False, False] and "ran past" in done.results[0].why


def test_the_token_cache_keeps_a_budget() -> None:
    cache = runner.TokenCache(budget=10)
    cache.put(("n", "a"), [1, 2, 3, 4, 5, 6])
    cache.put(("n", "b"), [7, 8, 9])
    assert cache.get(("n", "a")) == [1, 2, 3, 4, 5, 6]
    cache.put(("n", "c"), [1, 2, 3])  # 12 > 10: the least recently used (b) goes
    assert cache.get(("n", "b")) is None and cache.get(("n", "a")) is not None and cache.get(("n", "c")) == [1, 2, 3]
    cache.put(("n", "huge"), list(range(11)))  # larger than the budget: not kept
    assert cache.get(("n", "huge")) is None


# ---------------------------------------------------------------- the condition


def view(name: str, vllm: str | None = "v", current: Pass | None = None, running: tuple[int, int] | None = None,
         ) -> ServerWarmth:
    server = Pod(name, "127.0.0.1", "u", 0, "gpu-0", True, True)
    return ServerWarmth(Pair(server, Pod(vllm, "127.0.0.2", "uv", 0, "gpu-0", True, True) if vllm else None), current, running)


PW = prewarm(prompts=["a", "b"])
LISTED = runner.declared(PW, "ml")


def passed(*results: PromptResult, failure: tuple[str, str] | None = None) -> Pass:
    return Pass(("fp",), 0.0, results, failure)


def test_no_condition_without_a_declared_list() -> None:
    warmer = runner.Prewarmer()
    for prewarm_spec in (None, {}):
        assert warmer.observe(("ml", "r"), target(prewarm_spec), [], "tok", lambda: None, lambda: None) is None


@pytest.mark.parametrize(("servers", "cache", "expected"), [
    ([], (False, False), (None, "CacheDisabled", "the cache is off")),
    ([], (True, False), (None, "CacheBypassed", "vLLM runs without the cache")),
    ([], (True, True), (None, "NoServerReady", "no lmcache server of this namespace id is Ready: 2 prompt(s)")),
    ([view("s-0", vllm=None)], (True, True), (None, "WaitingForVLLM", "no Ready vLLM pod of this namespace id runs beside")),
    ([view("s-0", running=(1, 2))], (True, True), (False, "Warming", "1 of 2 prompts on s-0")),
    ([view("s-0")], (True, True), (False, "Warming", "0 of 2 prompts on s-0")),
    ([view("s-0", current=passed(failure=("NoLayout", "no layout registered")))], (True, True),
     (None, "NoLayout", "s-0: no layout registered; trying again every 15 s")),
    ([view("s-0", current=passed(PromptResult("spec.prewarm.prompts[0]", True, 3),
                                 PromptResult("spec.prewarm.prompts[1]", False, why="vLLM refused it")))], (True, True),
     (False, "PromptsNotWarm", "1 of 2 prompts warm on s-0, not warm: spec.prewarm.prompts[1]: vLLM refused it")),
    ([view("s-0", current=passed(PromptResult("p0", True, 3), PromptResult("p1", True, 2, computed=True))),
      view("s-1", vllm=None)], (True, True),
     (True, "Warm", "2 of 2 prompts warm on every server (1 server(s), 5 chunks in L1); 1 computed through vLLM, L2 "
                    "lacking them; not warmed: s-1 (no Ready vLLM pod")),
])
def test_the_warm_condition_says_where_it_stands(servers: list[ServerWarmth], cache: tuple[bool, bool],
                                                 expected: tuple[bool | None, str, str]) -> None:
    got = runner.warm_condition(LISTED, servers, *cache)
    assert got is not None and got[:2] == expected[:2] and expected[2] in got[2], got


def test_a_configmap_problem_is_shown_before_warming_progress() -> None:
    pw = prewarm(prompts=["a"], configMapRef={"name": "w"})
    missing = runner.declared(pw, "ml", None)
    got = runner.warm_condition(missing, [view("s-0", current=passed(PromptResult("a", True, 1)))], True, True)
    assert got is not None and got[:2] == (False, "ConfigMapNotFound") and "1 of 1 (prompt, server) pairs warm" in got[2]
    only = runner.declared(prewarm(configMapRef={"name": "w"}), "ml", UNREAD)
    assert runner.warm_condition(only, [], True, True)[:2] == (None, "ConfigMapNotRead")


def test_warm_never_holds_ready_back() -> None:
    obs = Observation(generation=1, namespace_id=NSID, identity_reason="", l2_kind="nvme", server_desired=0, vllm_desired=0,
                      warm=(False, "PromptsNotWarm", "0 of 1 prompts warm"))
    _, conds = compute_status(obs)
    by = {c["type"]: c for c in conds}
    assert by["Warm"]["status"] == "False" and by["Ready"]["status"] == "True"


# ---------------------------------------------------------------- the schedule (observe), with stand-in passes


class Done:
    """Records the refreshes a finished job asks for."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self) -> None:
        self.event.set()

    def wait(self) -> None:
        assert self.event.wait(10), "no job ended"
        self.event.clear()


def target(prewarm_spec: dict[str, Any]) -> Target:
    spec = KVCacheNamespace.model_validate(spec_with(prewarm_spec)).spec
    return Target("r", "ml", spec, NSID)


def test_observe_starts_a_pass_per_due_server_and_again_after_a_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scheduling only: each pass is a STAND-IN (run_pass replaced by one that marks every prompt
    warm), so what is checked is when passes start and what the condition says meanwhile."""
    ran: list[tuple[str, int]] = []

    def fake_run_pass(fingerprint: tuple[Any, ...], prompts: tuple[Prompt, ...], peers: Any, token_ids: Any,
                      progress: Any, deadline: float, sleep: Any = None) -> Pass:
        ran.append((peers.agent_ip, fingerprint[1]))
        return Pass(fingerprint, time.monotonic(), tuple(PromptResult(p.source, True, 2) for p in prompts))

    monkeypatch.setattr(runner, "run_pass", fake_run_pass)
    reads: list[str] = []
    warmer = runner.Prewarmer(configmap_reader=lambda name, ns: reads.append(name) or {"data": {"system-a": "Be brief."}})
    done = Done()
    t = target({"prompts": ["hello"], "configMapRef": {"name": "w"}})
    pods = [pod("r-lmcache-0", "lmcache-server"), pod("r-vllm-a", "vllm")]
    first = warmer.observe(("ml", "r"), t, pods, "tok", lambda: None, done)
    assert first is not None and first[1] == "Warming" and "ConfigMap w has not been read yet" in first[2]
    done.wait()
    assert reads == ["w"] and ran == []  # no pass before the list is known
    warming = warmer.observe(("ml", "r"), t, pods, "tok", lambda: None, done)
    assert warming is not None and warming[1] == "Warming"
    done.wait()
    warm = warmer.observe(("ml", "r"), t, pods, "tok", lambda: None, done)
    assert warm is not None and warm[:2] == (True, "Warm") and "2 of 2 prompts" in warm[2] and len(ran) == 1
    assert warmer.observe(("ml", "r"), t, pods, "tok", lambda: None, done)[:2] == (True, "Warm") and len(ran) == 1
    restarted = [pod("r-lmcache-0", "lmcache-server", restarts=1), pod("r-vllm-a", "vllm")]
    assert warmer.observe(("ml", "r"), t, restarted, "tok", lambda: None, done)[1] == "Warming"
    done.wait()
    assert warmer.observe(("ml", "r"), t, restarted, "tok", lambda: None, done)[:2] == (True, "Warm")
    assert [r[1] for r in ran] == [0, 1]
    warmer.forget(("ml", "r"))
    assert warmer.observe(("ml", "r"), target({}), pods, "tok", lambda: None, done) is None
