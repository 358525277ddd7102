"""The correctness canary, run (kvpersist.status.canary judges): per resource, the reference and the checks
as one job at a time in a shared pool, never on the status refresh (a busy vLLM may answer slowly). The
record is seeded from status.canary, so a restarted operator keeps the cache off over a HitMismatch it
found before (until kvpersist.dev/hit-correctness-ack names it).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from kvpersist import httpclient, vllmclient
from kvpersist.builders.target import VLLM, Target
from kvpersist.controller import kube
from kvpersist.httpclient import PeerError
from kvpersist.status import canary as judge
from kvpersist.status import usage
from kvpersist.status.conditions import now as iso_now
from kvpersist.status.workloads import pod_views

WORKERS = 4
CALL_TIMEOUT_S = 60.0  # one greedy answer of at most 64 tokens; a job makes at most four calls per pod
CALL_TIMEOUT_ENV = "KVPERSIST_CANARY_CALL_TIMEOUT_S"  # a slower model may need longer; tests shorten it
# lmcache counts a lookup on its event bus's thread (drained every 0.1 s): counters are read this long after.
LOOKUP_SETTLE_S = 0.5

logger = logging.getLogger("kvpersist")

Asker = Callable[..., vllmclient.Completion]  # vllmclient.complete's signature
# (vLLM pod IP, its port, its API key, the node's servers as (name, IP), the agents' port and token)
CounterReader = Callable[[str, int, str | None, tuple[tuple[str, str], ...], int, str | None], judge.Counters]


@dataclass
class _Resource:
    record: dict[str, Any] | None = None  # status.canary as it is to be
    pods: dict[str, judge.PodMemory] = field(default_factory=dict)
    outcome: tuple[str, str, judge.Verdict] | None = None  # (namespace id, digest, verdict) of the last job, unless a match
    reference_failed_at: float = float("-inf")
    recompute_at: float | None = None  # the recorded reference was contradicted: computed again from then on
    job: concurrent.futures.Future[None] | None = None


@dataclass(frozen=True)
class Plan:
    """One job: the reference to compute first on reference_pod when there is none, then the checks due."""

    key: Hashable
    target: Target
    namespace_id: str
    digest: str
    reference_pod: judge.Pod | None
    checks: tuple[tuple[judge.Pod, judge.CheckKey], ...]
    servers: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)  # a checked pod's node's (name, IP)
    agent_token: str | None = None


class Canary:
    """Every resource's canary. Used from refresh threads and its own pool, hence the lock."""

    def __init__(self, asker: Asker | None = None, read_api_key: Callable[[str, str, str], str | None] | None = None,
                 workers: int = WORKERS, read_counters: CounterReader | None = None,
                 settle_s: float = LOOKUP_SETTLE_S, job_budget_s: float | None = None) -> None:
        self._ask = asker or vllmclient.complete
        self._read_api_key = read_api_key or _api_key
        self._read_counters = read_counters or read_counters_of
        self._settle_s = settle_s
        self._call_timeout_s = float(os.environ.get(CALL_TIMEOUT_ENV) or CALL_TIMEOUT_S)
        if self._call_timeout_s <= 0:
            raise ValueError(f"{CALL_TIMEOUT_ENV}={self._call_timeout_s}: must be more than 0 seconds")
        # A job starts no check after its budget (the rest stay due): pods that answer nothing hold a worker
        # about one call's timeout plus one check, not one call each (50 such pods were 50 minutes of the pool).
        # Pods that failed least recently go first, so those that answer are not starved behind those that hang.
        self._budget_s = self._call_timeout_s if job_budget_s is None else job_budget_s
        self._lock = threading.Lock()
        self._by: dict[Hashable, _Resource] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvp-canary")

    def _held(self, key: Hashable, body: Mapping[str, Any]) -> _Resource:
        """The resource's entry, seeded once from its stored status (a restart). Under the lock."""
        found = self._by.get(key)
        if found is None:
            stored = (body.get("status") or {}).get("canary")
            found = self._by[key] = _Resource(record=dict(stored) if stored else None)
        return found

    def standing(self, key: Hashable, body: Mapping[str, Any], namespace_id: str | None) -> dict[str, Any] | None:
        """The mismatch that keeps vLLM without the cache for this namespace id, if one stands."""
        with self._lock:
            return judge.standing(self._held(key, body).record, namespace_id)

    def record(self, key: Hashable) -> dict[str, Any] | None:
        with self._lock:
            found = self._by.get(key)
            return dict(found.record) if found is not None and found.record else None

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._by.pop(key, None)

    def refresh(self, key: Hashable, body: Mapping[str, Any], target: Target, pods: list[dict[str, Any]],
                on_done: Callable[[bool], None], allowed: bool = True,
                agent_token: str | None = None) -> tuple[judge.Verdict | None, bool]:
        """One status round: an acknowledgement taken, a job started when due (not while one runs). Returns
        (HitCorrectness's verdict or None, whether an acknowledgement released the cache). allowed False:
        a refused resource, so no job and no Secret read. No I/O."""
        spec, namespace_id = target.spec, target.namespace_id
        digest = judge.digest(spec)
        released = False
        now = time.monotonic()
        with self._lock:
            held = self._held(key, body)
            acked = judge.acknowledged(held.record, namespace_id, (body.get("metadata") or {}).get("annotations"))
            if acked is not None:
                logger.warning("%s/%s: HitMismatch %s acknowledged (%s): vLLM gets the cache back", target.namespace,
                               target.name, (held.record or {}).get("mismatch", {}).get("id"), judge.ACK_ANNOTATION)
                held.record, held.outcome, held.pods, released = acked, None, {}, True
            due = spec.canary.enabled and namespace_id is not None and allowed and judge.standing(held.record, namespace_id) is None
            plan = self._plan(key, held, target, digest, pods, now, agent_token) if due else None
            if plan is not None and (held.job is None or held.job.done()):
                held.job = self._pool.submit(self._run, plan, on_done)
            outcome = held.outcome[2] if held.outcome is not None and held.outcome[:2] == (namespace_id, digest) else None
            verdict = judge.condition_of(held.record, namespace_id, digest, outcome, spec.canary.enabled,
                                         spec.canary.max_tokens, target.name, target.namespace)
        return verdict, released

    def _plan(self, key: Hashable, held: _Resource, target: Target, digest: str, pods: list[dict[str, Any]],
              now: float, agent_token: str | None = None) -> Plan | None:
        """What is due now, if anything. Under the lock."""
        namespace_id = str(target.namespace_id)
        views = pod_views(pods, namespace_id, VLLM)  # an old id's pods mid-rollout run other pins
        held.pods = {v.name: held.pods.get(v.name) or judge.PodMemory() for v in views}
        recorded = judge.reference_for(held.record, namespace_id, digest)
        # A contradicted reference: no check against it; computed again at recompute_at, then every pod checked at once.
        recompute = recorded is not None and held.recompute_at is not None
        recompute_now = recompute and now >= (held.recompute_at or 0.0) and now - held.reference_failed_at >= judge.RETRY_S
        if recompute_now:
            for memory in held.pods.values():
                memory.checked = None
        checks = []
        for view in views:
            servers = judge.servers_of(pods, namespace_id, view.node)
            memory = held.pods[view.name]
            judge.observe(memory, view, servers, now)
            if judge.due(view, servers, memory, target.spec.canary.interval_seconds, now):
                checks.append((view, judge.check_key(view, servers)))
        checks.sort(key=lambda check: held.pods[check[0].name].failed_at)  # never failed, then failed longest ago
        if recompute and not recompute_now:
            return None
        reference_pod = None
        if recorded is None or recompute:
            if now - held.reference_failed_at < judge.RETRY_S:
                return None
            # Any Ready pod serves the (salted, uncached) reference: one using the cache first, so its check follows at once.
            reference_pod = min((v for v in views if v.ready and v.ip), key=lambda v: not v.uses_cache, default=None)
            if reference_pod is None:
                return None
        elif not checks:
            return None
        return Plan(key, target, namespace_id, digest, reference_pod, tuple(checks),
                    {view.name: judge.server_addresses(pods, namespace_id, view.node) for view, _ in checks}, agent_token)

    # ---- the job (the canary's pool)

    def _run(self, plan: Plan, on_done: Callable[[bool], None]) -> None:
        drift = False
        try:
            drift = self._job(plan)
        except Exception:  # a failed job must not go unnoticed, nor kill the pool's thread
            logger.exception("canary job of %s failed", plan.key)
        finally:
            on_done(drift)

    def _job(self, plan: Plan) -> bool:
        """The reference (if due) and the checks; True on a mismatch (vLLM goes without the cache). Blocking."""
        api_key = None
        ref = plan.target.spec.vllm.api_key_secret_ref
        if ref is not None:
            try:
                api_key = self._read_api_key(plan.target.namespace, ref.name, ref.key)
            except ApiException as exc:
                api_key, why = None, f"could not be read (the API server answered {exc.status})"
            else:
                why = "does not exist or has no such key"
            if api_key is None:
                self._failed(plan, (None, judge.API_KEY_UNAVAILABLE, f"spec.vllm.apiKeySecretRef: Secret {ref.name} key {ref.key} "
                                    f"{why}; the canary cannot ask vLLM, which requires it; retrying in {judge.RETRY_S:.0f}s"))
                return False
        started = time.monotonic()
        if plan.reference_pod is not None:
            reference = self._reference(plan, plan.reference_pod, api_key)
        else:
            with self._lock:
                held = self._by.get(plan.key)
                reference = judge.reference_for(held.record if held else None, plan.namespace_id, plan.digest)
        if reference is None:
            return False
        # In order, stopping at the first mismatch (the cache goes off for the whole id) or the job's budget.
        for i, (pod, key) in enumerate(plan.checks):
            if time.monotonic() - started >= self._budget_s:
                logger.info("%s: the canary's job reached its %.0f s budget; %d of its pods wait for the next round",
                            plan.key, self._budget_s, len(plan.checks) - i)
                return False
            if self._check(plan, pod, key, reference, api_key):
                return True
        return False

    def _ask_pod(self, plan: Plan, pod: judge.Pod, api_key: str | None, salted: bool) -> vllmclient.Completion:
        # A salted answer's KV is never read again: LMCache stores none of it. The salt is short hex: vLLM and
        # lmcache refuse '@', '/', '\\', and lmcache puts it in a file name beside the model's (under 255 bytes).
        spec = plan.target.spec
        return self._ask(str(pod.ip), spec.vllm.port, spec.vllm.served_model_name or spec.identity.model_id,
                         spec.canary.effective_prompt, max_tokens=spec.canary.max_tokens,
                         cache_salt="kvp-canary-" + secrets.token_hex(8) if salted else None,
                         store=not (salted and pod.uses_cache), api_key=api_key, timeout=self._call_timeout_s)

    def _counters(self, plan: Plan, pod: judge.Pod, api_key: str | None) -> judge.Counters:
        try:
            return self._read_counters(str(pod.ip), plan.target.spec.vllm.port, api_key, tuple(plan.servers.get(pod.name, ())),
                                       plan.target.spec.lmcache_server.agent_port, plan.agent_token)
        except Exception:  # what served a check is a detail: never the reason a check fails
            logger.exception("%s: the canary could not read the counters around its check of %s", plan.key, pod.name)
            return judge.Counters(None, {})

    def _ask_cached(self, plan: Plan, pod: judge.Pod, api_key: str | None) -> tuple[tuple[int, ...], str]:
        """One cached answer and what served it (judge.served_by), from the counters before and after it."""
        before = self._counters(plan, pod, api_key)
        answer = self._ask_pod(plan, pod, api_key, salted=False)
        time.sleep(self._settle_s)
        after = self._counters(plan, pod, api_key)
        return tuple(answer.token_ids), judge.served_by(answer.prompt_tokens, before, after)

    def _failed(self, plan: Plan, verdict: judge.Verdict, pod: str | None = None) -> None:
        with self._lock:
            held = self._by.get(plan.key)
            if held is None:
                return
            if pod is None:
                held.reference_failed_at = time.monotonic()
                for memory in held.pods.values():
                    memory.failed_at = time.monotonic()
            elif pod in held.pods:
                held.pods[pod].failed_at = time.monotonic()
            held.outcome = (plan.namespace_id, plan.digest, verdict)

    def _reference(self, plan: Plan, pod: judge.Pod, api_key: str | None) -> tuple[int, ...] | None:
        try:
            answer = self._ask_pod(plan, pod, api_key, salted=True)
        except PeerError as exc:
            self._failed(plan, _unanswered(pod.name, exc))
            logger.info("%s: the canary's reference on %s: %s", plan.key, pod.name, exc)
            return None
        with self._lock:
            held = self._by.get(plan.key)
            if held is None:
                return None
            tokens = tuple(answer.token_ids)
            held.record = judge.with_reference(held.record, plan.namespace_id, plan.digest, tokens, pod.name, iso_now(),
                                               answer.prompt_tokens)
            held.outcome = held.recompute_at = None
        logger.info("%s: the canary's reference for %s recorded on %s (computed without the cache): %s", plan.key,
                    plan.namespace_id, pod.name, list(tokens))
        return tokens

    def _check(self, plan: Plan, pod: judge.Pod, key: judge.CheckKey, reference: tuple[int, ...],
               api_key: str | None) -> bool:
        """One pod's check; True on a HitMismatch."""
        try:
            cached, tier = self._ask_cached(plan, pod, api_key)
            answers, tiers = judge.Answers(cached), (tier,)
            verdict = judge.judge(reference, answers)
            if verdict is None:  # it differs: once more without the cache, and once with it
                cache_free = tuple(self._ask_pod(plan, pod, api_key, salted=True).token_ids)
                cached_again, tier_again = self._ask_cached(plan, pod, api_key)
                answers, tiers = judge.Answers(cached, cache_free, cached_again), (tier, tier_again)
                verdict = judge.judge(reference, answers)
        except PeerError as exc:
            self._failed(plan, _unanswered(pod.name, exc), pod.name)
            logger.info("%s: the canary's check of %s: %s", plan.key, pod.name, exc)
            return False
        at = iso_now()
        with self._lock:
            held = self._by.get(plan.key)
            if held is None or judge.reference_for(held.record, plan.namespace_id, plan.digest) != reference:
                return False  # acknowledged, or another reference meanwhile: this answer is for another round
            if (memory := held.pods.get(pod.name)) is not None:
                memory.checked, memory.checked_at = key, time.monotonic()
            held.record = judge.with_check(held.record or {}, pod.name, at, verdict == judge.MATCH, tier)
            held.outcome = None
            if verdict == judge.NONDETERMINISTIC:
                recompute_in = None
                if judge.reference_contradicted(reference, answers):
                    recomputes = judge.recomputes(held.record)
                    if recomputes < judge.MAX_RECOMPUTES:
                        recompute_in = judge.RETRY_S * 2**recomputes
                        held.recompute_at = time.monotonic() + recompute_in
                held.outcome = (plan.namespace_id, plan.digest, (None, judge.NONDETERMINISTIC,
                                judge.nondeterministic_message(pod.name, reference, answers, recompute_in)))
            elif verdict == judge.MISMATCH:
                assert answers.cached_again is not None
                held.record = judge.with_mismatch(held.record, secrets.token_hex(6), pod.name, at, reference,
                                                  answers.cached_again, tiers)
        logger.info("%s: the canary's check of %s: %s, served by %s", plan.key, pod.name, verdict, "/".join(tiers))
        if verdict == judge.MISMATCH:
            logger.warning("%s: HitMismatch on %s: served with the cache %s, computed without it %s: vLLM goes without "
                           "the cache", plan.key, pod.name, list(answers.cached_again or ()), list(reference))
        elif verdict == judge.NONDETERMINISTIC:
            logger.warning("%s: the canary's answers on %s are not deterministic: %s", plan.key, pod.name, answers)
        return verdict == judge.MISMATCH


COUNTERS_TIMEOUT_S = 2.0  # each /metrics read around a check, all of them at once


def read_counters_of(ip: str, port: int, api_key: str | None, servers: tuple[tuple[str, str], ...], agent_port: int,
                     agent_token: str | None, timeout: float = COUNTERS_TIMEOUT_S) -> judge.Counters:
    """The pod's prompt-token counters and its node's servers' lookup counters (via their agents), at once; None if unread."""
    def vllm() -> judge.PromptTokenSources | None:
        try:
            return judge.prompt_token_sources(vllmclient.metrics(ip, port, api_key=api_key, timeout=timeout))
        except PeerError:
            return None

    reads: list[Callable[[], Any]] = [vllm] + [
        functools.partial(usage.fetch_lookup_counters, server_ip, agent_port, timeout, agent_token)
        for _, server_ip in servers]
    sources, *lookups = httpclient.in_parallel(lambda read: read(), reads)
    return judge.Counters(sources, {name: c for (name, _), c in zip(servers, lookups, strict=True)})


def _unanswered(pod: str, exc: PeerError) -> judge.Verdict:
    """HitCorrectness Unknown for a vLLM that did not answer (VLLMUnreachable) or answered an error (VLLMError)."""
    if isinstance(exc, vllmclient.VLLMAnswerError):
        return (None, judge.VLLM_ERROR, f"vLLM pod {pod} answered the canary with an error: {exc}; retrying in "
                f"{judge.RETRY_S:.0f}s (a prompt too long for maxModelLen: shorten spec.canary.prompt)")
    return (None, judge.UNREACHABLE, f"the operator got no answer from vLLM pod {pod} for the canary: {exc}; retrying "
            f"in {judge.RETRY_S:.0f}s")


def _api_key(namespace: str, name: str, item: str) -> str | None:
    """spec.vllm.apiKeySecretRef's key, read when a job needs it. Never logged. Blocking."""
    raw = kube.secret_value(kube.get("v1", "Secret", name, namespace), item)
    return raw.decode().strip() if raw else None
