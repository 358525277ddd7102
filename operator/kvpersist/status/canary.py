"""The correctness canary, judged (pure functions; the calls to vLLM: kvpersist.controller.canary).

A cached answer that differs from the reference (computed without the cache: a fresh cache_salt) is
asked again without and with the cache: the difference reproduced is a HitMismatch, disagreeing
answers nondeterminism. vLLM asks lmcache only for what its own prefix cache lacks, so only a check
lmcache served (served_by) is evidence (docs/design.md, the correctness canary).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpersist.api.spec import CHUNK_TOKENS, KVCacheNamespaceSpec
from kvpersist.builders.target import SERVER
from kvpersist.status import Verdict, usage
from kvpersist.status.usage import LookupCounters
from kvpersist.status.workloads import Pod, pod_views

CONDITION = "HitCorrectness"
MATCH = "HitsMatch"
MISMATCH = "HitMismatch"
CHECKING = "Checking"
NONDETERMINISTIC = "NondeterministicOutput"
UNREACHABLE = "VLLMUnreachable"
VLLM_ERROR = "VLLMError"
API_KEY_UNAVAILABLE = "APIKeyUnavailable"
NOT_REACHED = "LMCacheNotReached"
ACK_ANNOTATION = "kvpersist.dev/hit-correctness-ack"

# After a server restart vLLM finds its new server by its heartbeat (a ping every 10 s, each up to
# 10 s): a check before that is computed. So a pod whose servers changed waits this long.
SETTLE_S = 30.0
# A check or reference that failed (vLLM unreachable, an error) is tried again after this.
RETRY_S = 60.0
# A contradicted reference is computed again after RETRY_S, doubling; after MAX_RECOMPUTES the
# canary gives no verdict for that (id, digest).
MAX_RECOMPUTES = 3

def digest(spec: KVCacheNamespaceSpec) -> str:
    """What decides the canary's answer besides the namespace id (the prompt, maxTokens, and
    extraArgs and env, which may change float rounding): another digest is another reference."""
    canary = spec.canary
    decided = {"prompt": canary.effective_prompt, "maxTokens": canary.max_tokens,
               "extraArgs": list(spec.vllm.extra_args), "env": [[e.name, e.value] for e in spec.vllm.env]}
    return "sha256:" + hashlib.sha256(json.dumps(decided, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------- pods and when they are due


def _servers_on(pods: Iterable[Mapping[str, Any]], namespace_id: str, node: str | None) -> list[Pod]:
    """The lmcache servers of the id on a node: those its vLLM pod reaches (the node-local Service)."""
    return [p for p in pod_views(pods, namespace_id, SERVER) if node is not None and p.node == node]


def server_addresses(pods: Iterable[Mapping[str, Any]], namespace_id: str, node: str | None) -> tuple[tuple[str, str], ...]:
    """(name, IP) of the servers on a node with an IP: their lookup counters tell which tier served a check."""
    return tuple(sorted((p.name, str(p.ip)) for p in _servers_on(pods, namespace_id, node) if p.ip))


def servers_of(pods: Iterable[Mapping[str, Any]], namespace_id: str, node: str | None) -> tuple[tuple[str, int, bool], ...]:
    """(uid, restarts, ready) of the servers on a node, whose restart is a reason to check again."""
    return tuple(sorted((p.uid, p.restarts, p.ready) for p in _servers_on(pods, namespace_id, node)))


CheckKey = tuple[tuple[str, int], tuple[tuple[str, int], ...]]  # the pod's (uid, restarts), its servers' (uid, restarts)


def check_key(pod: Pod, servers: tuple[tuple[str, int, bool], ...]) -> CheckKey:
    return (pod.uid, pod.restarts), tuple((uid, restarts) for uid, restarts, _ in servers)


@dataclass
class PodMemory:
    """One pod's checks as remembered (in memory: a restarted operator checks every pod once)."""

    key: CheckKey | None = None  # as last seen with its servers all Ready (None: they were not), and since when
    seen_at: float = 0.0
    checked: CheckKey | None = None  # the key of the last check that answered, and when
    checked_at: float = float("-inf")
    failed_at: float = float("-inf")  # the last check that did not answer


def observe(memory: PodMemory, pod: Pod, servers: tuple[tuple[str, int, bool], ...], now: float) -> None:
    """One round's view of a pod: the clock of its key starts when its servers are all Ready in it."""
    key = check_key(pod, servers) if servers and all(ready for _, _, ready in servers) else None
    if memory.key != key:
        memory.key, memory.seen_at = key, now


def due(pod: Pod, servers: tuple[tuple[str, int, bool], ...], memory: PodMemory, interval_s: float, now: float) -> bool:
    """Whether a pod (Ready, using the cache, its servers Ready) is to be checked now: never checked
    in this form (a restarted pod at once, restarted servers after SETTLE_S), or not for interval_s;
    never within RETRY_S of a check that did not answer."""
    if not (pod.ready and pod.uses_cache and pod.ip) or not servers or not all(ready for _, _, ready in servers):
        return False
    if now - memory.failed_at < RETRY_S:
        return False
    key = check_key(pod, servers)
    if memory.checked != key:
        pod_changed = memory.checked is None or memory.checked[0] != key[0]
        return pod_changed or (memory.key == key and now - memory.seen_at >= SETTLE_S)
    return now - memory.checked_at >= interval_s


# ---------------------------------------------------------------- what served a check

GPU = "gpu"  # vLLM's own prefix cache (GPU memory): not evidence about lmcache
L1 = "l1"  # lmcache, from its L1 (host memory)
L2 = "l2"  # lmcache, from its L2 (what the servers' lookup counters credit to L2)
LMCACHE = "lmcache"  # lmcache, its tier not attributable
COMPUTED = "computed"  # neither cache served its cacheable tokens: computed on the pod
UNKNOWN = "unknown"  # not attributable: counters unreadable, or other requests moved them
TIERS = (GPU, L1, L2, LMCACHE, COMPUTED, UNKNOWN)
FROM_LMCACHE = (L1, L2, LMCACHE)

# vLLM 0.33.0's prompt tokens by where their KV came from (v1/metrics/loggers.py): computed, its own
# prefix cache, or the KV connector (LMCache). Each request adds its prompt's tokens once, split over
# the three, before its answer returns, so the three bound each other.
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass(frozen=True)
class PromptTokenSources:
    """A vLLM pod's cumulative prompt tokens by source, and its process start."""

    computed: int
    local_cache_hit: int
    external: int
    started: float | None = None


def prompt_token_sources(text: str) -> PromptTokenSources | None:
    """The counters of a vLLM /metrics body; None when unknown (not there, no count). Never raises."""
    by = usage.sum_by_label(text, PROMPT_TOKENS_BY_SOURCE, "source")
    if not by or any(s not in by for s in SOURCES):
        return None
    values = [by[s] for s in SOURCES]
    if not all(usage.is_count(v) for v in values):
        return None
    start = (usage.parse_exposition(text) or {}).get(usage.PROCESS_START)
    return PromptTokenSources(*(int(v) for v in values),
                              started=start if start is not None and math.isfinite(start) and start > 0 else None)


@dataclass(frozen=True)
class Counters:
    """Read on one side of a cached request: the pod's counters and its node's servers' (None: unknown)."""

    vllm: PromptTokenSources | None
    servers: Mapping[str, LookupCounters | None]


def cacheable_tokens(prompt_tokens: int) -> int:
    """The tokens lmcache can serve: whole chunks, the last token left out (vLLM always computes it)."""
    return (prompt_tokens - 1) // CHUNK_TOKENS * CHUNK_TOKENS if prompt_tokens > 0 else 0


def _changed(a: object, b: object) -> bool:
    """Both known and different: a process restarted, events were dropped."""
    return a is not None and b is not None and a != b


def served_by(prompt_tokens: int | None, before: Counters, after: Counters) -> str:
    """Which tier served one cached request of P prompt tokens, from counters read around it. Other
    requests may move them too, so each source gave this request at least P minus the growth of the
    other two; a tier is named only when that bound reaches the cacheable tokens C: external (lmcache,
    _lmcache_tier), local hits (GPU), or computed > P - C. Anything else, counters that grew by less
    than P (not counted yet), a restart between the readings or counters unread: UNKNOWN."""
    if not prompt_tokens or before.vllm is None or after.vllm is None:
        return UNKNOWN
    cacheable = cacheable_tokens(prompt_tokens)
    b, a = before.vllm, after.vllm
    if cacheable <= 0 or _changed(b.started, a.started):
        return UNKNOWN
    computed, local, external = a.computed - b.computed, a.local_cache_hit - b.local_cache_hit, a.external - b.external
    if min(computed, local, external) < 0 or computed + local + external < prompt_tokens:
        return UNKNOWN
    if prompt_tokens - computed - local >= cacheable:
        return _lmcache_tier(prompt_tokens - computed - local, cacheable, before.servers, after.servers)
    if prompt_tokens - computed - external >= cacheable:
        return GPU
    if prompt_tokens - local - external > prompt_tokens - cacheable:
        return COMPUTED
    return UNKNOWN


def _lmcache_tier(external: int, cacheable: int, before: Mapping[str, LookupCounters | None],
                  after: Mapping[str, LookupCounters | None]) -> str:
    """L1, L2 or LMCACHE for a request that loaded at least `external` tokens from lmcache: L2 gave
    at least external minus what hit_l1 grew by (L1 likewise), named when that reaches cacheable.
    LMCACHE when a server's counters are unknown, it restarted, its event bus held or dropped
    events (lookups not counted yet, or never), or they grew by less than external."""
    if not before or set(before) != set(after):
        return LMCACHE
    hit = l1 = l2 = 0
    for pod, old in before.items():
        new = after[pod]
        if (old is None or new is None or _changed(old.started, new.started) or new.events_queued
                or _changed(old.events_dropped, new.events_dropped)):
            return LMCACHE
        grew = (new.hit - old.hit, new.hit_l1 - old.hit_l1, new.hit_l2 - old.hit_l2)
        if min(grew) < 0:
            return LMCACHE
        hit, l1, l2 = hit + grew[0], l1 + grew[1], l2 + grew[2]
    if hit < external:
        return LMCACHE
    if external - l1 >= cacheable:
        return L2
    if external - l2 >= cacheable:
        return L1
    return LMCACHE


# ---------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Answers:
    """One check's answers: the cached one and, when it differs, a second without and with the cache."""

    cached: tuple[int, ...]
    cache_free_again: tuple[int, ...] | None = None
    cached_again: tuple[int, ...] | None = None


def judge(reference: tuple[int, ...], answers: Answers) -> str | None:
    """MATCH, MISMATCH or NONDETERMINISTIC; None: the second pair is still to be asked."""
    if answers.cached == reference:
        return MATCH
    if answers.cache_free_again is None or answers.cached_again is None:
        return None
    if answers.cache_free_again != reference or answers.cached_again == reference:
        return NONDETERMINISTIC  # the cache-free answers disagree, or the cached ones do
    return MISMATCH


def reference_contradicted(reference: tuple[int, ...], answers: Answers) -> bool:
    """A second cache-free answer differs: the reference may be the odd one out, computed again."""
    return answers.cache_free_again is not None and answers.cache_free_again != reference


def first_difference(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ---------------------------------------------------------------- status.canary


def reference_for(record: Mapping[str, Any] | None, namespace_id: str | None, prompt_digest: str) -> tuple[int, ...] | None:
    """The recorded reference, when it is for this namespace id and digest."""
    if not record or record.get("namespaceId") != namespace_id or record.get("promptDigest") != prompt_digest:
        return None
    return tuple(record.get("referenceTokenIds") or ())


def standing(record: Mapping[str, Any] | None, namespace_id: str | None) -> dict[str, Any] | None:
    """The unacknowledged mismatch of this namespace id, which keeps the cache off (another id starts clean)."""
    if not record or namespace_id is None or record.get("namespaceId") != namespace_id:
        return None
    found = record.get("mismatch")
    return dict(found) if found else None


def recomputes(record: Mapping[str, Any] | None) -> int:
    """How often the recorded reference was computed again (reference_contradicted)."""
    value = (record or {}).get("referenceRecomputes")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def with_reference(record: Mapping[str, Any] | None, namespace_id: str, prompt_digest: str, tokens: tuple[int, ...],
                   pod: str, at: str, prompt_tokens: int | None = None) -> dict[str, Any]:
    """A new reference, its checks to come. A mismatch of the same id stays (a new prompt does not
    make the old hit right); a new one for the same id and digest counts as referenceRecomputes."""
    out: dict[str, Any] = {"namespaceId": namespace_id, "promptDigest": prompt_digest,
                           "referenceTokenIds": list(tokens), "referenceAt": at, "referencePod": pod}
    if prompt_tokens is not None:
        out["promptTokens"] = prompt_tokens
    if reference_for(record, namespace_id, prompt_digest) is not None:
        out["referenceRecomputes"] = recomputes(record) + 1
    if (kept := standing(record, namespace_id)) is not None:
        out["mismatch"] = kept
    return out


def with_check(record: Mapping[str, Any], pod: str, at: str, match: bool, tier: str = UNKNOWN) -> dict[str, Any]:
    """The check as lastCheck; a match counted by tier, and kept as lastServedCheck when lmcache served it."""
    check = {"at": at, "pod": pod, "match": match, "tier": tier}
    out = {**record, "lastCheck": check}
    if match:
        counts = _matches(record)
        counts[tier] += 1
        out["matches"] = counts
        if tier in FROM_LMCACHE:
            out["lastServedCheck"] = dict(check)
    return out


def with_mismatch(record: Mapping[str, Any], mismatch_id: str, pod: str, at: str, expected: tuple[int, ...],
                  got: tuple[int, ...], tiers: tuple[str, ...] = ()) -> dict[str, Any]:
    """tiers: what served each of the two differing cached answers."""
    found = {"id": mismatch_id, "at": at, "pod": pod, "expected": list(expected), "got": list(got),
             **({"tiers": list(tiers)} if tiers else {})}
    return {**record, "mismatch": found}


def acknowledged(record: Mapping[str, Any] | None, namespace_id: str | None,
                 annotations: Mapping[str, str] | None) -> dict[str, Any] | None:
    """The record without its mismatch when the annotation names it; else None (nothing to do)."""
    found = standing(record, namespace_id)
    if found is None or (annotations or {}).get(ACK_ANNOTATION, "").strip() != found["id"]:
        return None
    return {k: v for k, v in (record or {}).items() if k != "mismatch"}


# ---------------------------------------------------------------- the condition and its texts


def ack_command(name: str, namespace: str, mismatch_id: str) -> str:
    return f"kubectl annotate kvcachenamespace {name} -n {namespace} {ACK_ANNOTATION}={mismatch_id} --overwrite"


def _window(tokens: list[int], start: int, size: int = 8) -> str:
    """At most size token ids from the first difference: the message fits an Event's 1024 characters."""
    shown = ", ".join(str(t) for t in tokens[start:start + size])
    return f"[{'..., ' if start else ''}{shown}{', ...' if len(tokens) > start + size else ''}]"


def mismatch_message(mismatch: Mapping[str, Any], namespace_id: str, name: str, namespace: str) -> str:
    """What happened, what it did and what to do: the Warning event's and the condition's message."""
    expected, got = list(mismatch.get("expected") or []), list(mismatch.get("got") or [])
    at = first_difference(expected, got)
    return (f"vLLM pod {mismatch.get('pod')} (namespace {namespace_id}) served the canary's greedy answer with the cache "
            f"as {_window(got, at)}, computed without the cache it is {_window(expected, at)} (from token {at}; twice "
            "each, status.canary.mismatch): a cache hit changed the output. vLLM runs without the cache until this is "
            f"acknowledged: {ack_command(name, namespace, str(mismatch.get('id')))}. Before that, find the cause "
            "(docs/runbooks.md#kvpersisthitmismatch); if the stored data is suspect, move to a new namespace id (a "
            f"changed pin: it starts clean), then `kvpersist gc {namespace_id}` deletes it")


def _matches(record: Mapping[str, Any]) -> dict[str, int]:
    found = record.get("matches") or {}
    return {t: int(found.get(t) or 0) for t in TIERS}


def served_matches(record: Mapping[str, Any] | None) -> int:
    """Matching checks lmcache served: the evidence that its hits keep the answer."""
    return sum(_matches(record or {})[t] for t in FROM_LMCACHE)


def _not_evidence(counts: Mapping[str, int]) -> str:
    return (f"{counts[GPU]} answered from vLLM's own prefix cache, {counts[COMPUTED]} computed and {counts[UNKNOWN]} "
            "not attributable are no evidence about lmcache")


def match_message(record: Mapping[str, Any], max_tokens: int) -> str:
    counts, last = _matches(record), record.get("lastServedCheck") or {}
    return (f"the canary's {max_tokens} greedy tokens served by lmcache are those computed without the cache: "
            f"{served_matches(record)} matching check(s) served by lmcache (L1 {counts[L1]}, L2 {counts[L2]}, tier not "
            f"known {counts[LMCACHE]}), the last on pod {last.get('pod')} at {last.get('at')}; {_not_evidence(counts)} "
            f"(reference by pod {record.get('referencePod')}; status.canary.matches, lastServedCheck)")


def not_reached_message(record: Mapping[str, Any]) -> str:
    counts, prompt = _matches(record), record.get("promptTokens")
    if isinstance(prompt, int) and prompt > 0 and cacheable_tokens(prompt) == 0:
        why = (f"the canary's prompt has {prompt} tokens, under one lmcache chunk and the token after it "
               f"({CHUNK_TOKENS + 1}): lmcache never serves it; set a longer spec.canary.prompt (or leave it unset)")
    else:
        why = ("vLLM asks lmcache only for what its own prefix cache does not hold, and keeps the canary's prompt "
               "there until it needs the memory: a check after the vLLM pod restarts reaches lmcache")
    return (f"the canary's answers match the reference, but no check was served by lmcache, so its hits are not "
            f"verified: of {sum(counts.values())} matching checks, {_not_evidence(counts)} (status.canary.matches); "
            f"{why}")


def nondeterministic_message(pod: str, reference: tuple[int, ...], answers: Answers,
                             recompute_in: float | None = None) -> str:
    """recompute_in: when a contradicted reference is computed again (None: no more)."""
    contradicted = reference_contradicted(reference, answers)
    why = ("a second answer without the cache differs from the reference" if contradicted
           else "a second answer with the cache is the reference")
    at = first_difference(reference, answers.cached)
    then = ""
    if contradicted:
        then = (f"; the reference is computed again in {recompute_in:.0f}s" if recompute_in is not None else
                f"; the reference was computed again {MAX_RECOMPUTES} times (the most for one prompt and namespace id): "
                "it is kept until spec.canary or the namespace id changes, and a check that disagrees with it gives no "
                "verdict")
    return (f"vLLM pod {pod} answered the canary {_window(list(answers.cached), at)} with the cache, not the reference "
            f"{_window(list(reference), at)} (from token {at}), but {why}: its greedy output is not deterministic "
            f"(batching on a GPU can change it), so the check cannot tell a wrong hit; the cache stays on{then}. A "
            "quieter time, or a shorter spec.canary.maxTokens, gives the check answers it can compare")


def condition_of(record: Mapping[str, Any] | None, namespace_id: str | None, prompt_digest: str, outcome: Verdict | None,
                 enabled: bool, max_tokens: int, name: str, namespace: str) -> Verdict | None:
    """HitCorrectness: False while a mismatch stands (canary on or off); else, with the canary on
    and a namespace id, the last outcome, then the record: True when the last check matched and one
    lmcache served did; Unknown LMCacheNotReached when lmcache served none; else Unknown Checking."""
    found = standing(record, namespace_id)
    if found is not None:
        return (False, MISMATCH, mismatch_message(found, str(namespace_id), name, namespace))
    if not enabled or namespace_id is None:
        return None
    if outcome is not None:
        return outcome
    if reference_for(record, namespace_id, prompt_digest) is not None and (record or {}).get("lastCheck", {}).get("match"):
        if served_matches(record) > 0:
            return (True, MATCH, match_message(record or {}, max_tokens))
        return (None, NOT_REACHED, not_reached_message(record or {}))
    return (None, CHECKING, "no verdict yet: the reference is computed without the cache (a fresh cache_salt), then each "
            "Ready vLLM pod that uses the cache is asked the same with it")


def bypass_message(mismatch: Mapping[str, Any], name: str, namespace: str) -> str:
    """CacheBypassed's message (reason HitMismatch)."""
    return (f"a cache hit changed the canary's answer on pod {mismatch.get('pod')} (HitCorrectness): vLLM runs without the "
            "cache (no --kv-transfer-config) until the namespace id changes or a person acknowledges it: "
            f"{ack_command(name, namespace, str(mismatch.get('id')))}")
