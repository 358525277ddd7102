"""The correctness canary, judged: when each vLLM pod is due a check, what a check's answers mean,
and the HitCorrectness condition, its event texts and status.canary. Pure functions; the calls to
vLLM and the bookkeeping are kvpersist.controller.canary.

The product exists so that a hit never changes an answer. The canary checks it where it runs: a
pinned greedy request (spec.canary) is answered once without the cache (a fresh random cache_salt
is in every key of vLLM's prefix cache and of lmcache, so nothing cached can serve it) and that
answer is kept in status.canary as the reference of the namespace id. The same request without a
salt is then asked of every Ready vLLM pod that uses the cache, after each (re)start of the pod or
of the lmcache server(s) on its node, and every intervalSeconds. An answer that differs is asked
again, once without the cache and once with it: only when the cache-free answer is the reference
again and the cached one differs again is it a HitMismatch (the cache off until a person
acknowledges it); cache-free answers that disagree, or a cached answer that disagrees with
itself, are nondeterminism (batching on a GPU may change greedy decoding), Unknown; a reference
that a second cache-free answer contradicts is computed again, at most MAX_RECOMPUTES times.

vLLM asks the cache (LMCache's connector) only for the part of a prompt its own prefix cache does
not hold, so a check may be answered from vLLM's GPU memory and say nothing about lmcache. Each
cached request is therefore attributed (served_by) from the pod's prompt-token counters and the
lookup counters of the lmcache servers on its node, read before and after it: only a check that
lmcache served counts as evidence, and HitCorrectness is True only with such a check.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpersist.api.v1alpha1 import CHUNK_TOKENS, KVCacheNamespaceSpec
from kvpersist.builders.target import BYPASS_ANNOTATION, NAMESPACE_ID_LABEL, SERVER, VLLM
from kvpersist.status import usage
from kvpersist.status.usage import LookupCounters
from kvpersist.status.workloads import COMPONENT_LABEL, pod_ready

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

# After a server restart vLLM finds its new server by its heartbeat (a ping every 10 s, each
# waiting up to 10 s): a check before that is computed, not served from the cache. So a pod whose
# servers changed is checked once they have all been Ready this long.
SETTLE_S = 30.0
# A check or reference that failed (vLLM unreachable, an error) is tried again after this.
RETRY_S = 60.0
# A reference a second cache-free answer contradicted is computed again, RETRY_S, then twice and
# four times that later; after MAX_RECOMPUTES the canary gives no verdict for that (id, digest).
MAX_RECOMPUTES = 3

Verdict = tuple[bool | None, str, str]  # (status, reason, message), as conditions.condition takes them


def digest(spec: KVCacheNamespaceSpec) -> str:
    """What decides the canary's answer besides the namespace id: the prompt and maxTokens, and
    the vLLM settings outside the id that may change its float rounding (extraArgs, env). Another
    digest is another reference."""
    canary = spec.canary
    decided = {"prompt": canary.effective_prompt, "maxTokens": canary.max_tokens,
               "extraArgs": list(spec.vllm.extra_args), "env": [[e.name, e.value] for e in spec.vllm.env]}
    return "sha256:" + hashlib.sha256(json.dumps(decided, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------- pods and when they are due


@dataclass(frozen=True)
class Pod:
    """A vLLM pod of the namespace id, as the watch cache has it."""

    name: str
    ip: str | None
    uid: str
    restarts: int
    node: str | None
    ready: bool
    uses_cache: bool  # launched with --kv-transfer-config (not rolled without the cache)


def _of_id(pods: Iterable[Mapping[str, Any]], namespace_id: str, component: str) -> list[Mapping[str, Any]]:
    return [p for p in pods if (p.get("metadata") or {}).get("labels", {}).get(COMPONENT_LABEL) == component
            and p["metadata"]["labels"].get(NAMESPACE_ID_LABEL) == namespace_id
            and not p["metadata"].get("deletionTimestamp")]


def vllm_pods(pods: Iterable[Mapping[str, Any]], namespace_id: str) -> list[Pod]:
    """The vLLM pods of this namespace id (an old id's pods mid-rollout run other pins), by name."""
    out = []
    for p in _of_id(pods, namespace_id, VLLM):
        meta, status = p["metadata"], p.get("status") or {}
        out.append(Pod(meta["name"], status.get("podIP"), str(meta.get("uid") or ""), int(status.get("restarts") or 0),
                       (p.get("spec") or {}).get("nodeName"), pod_ready(p),
                       BYPASS_ANNOTATION not in (meta.get("annotations") or {})))
    return sorted(out, key=lambda q: q.name)


def _servers_on(pods: Iterable[Mapping[str, Any]], namespace_id: str, node: str | None) -> list[Mapping[str, Any]]:
    """The lmcache servers of the id on a node: those its vLLM pod reaches (the node-local Service)."""
    return [p for p in _of_id(pods, namespace_id, SERVER) if node is not None and (p.get("spec") or {}).get("nodeName") == node]


def server_addresses(pods: Iterable[Mapping[str, Any]], namespace_id: str, node: str | None) -> tuple[tuple[str, str], ...]:
    """(name, IP) of the servers on a node that have an IP: whose lookup counters say from which
    tier they served the pod's check."""
    return tuple(sorted((p["metadata"]["name"], str(p["status"]["podIP"]))
                        for p in _servers_on(pods, namespace_id, node) if (p.get("status") or {}).get("podIP")))


def servers_of(pods: Iterable[Mapping[str, Any]], namespace_id: str, node: str | None) -> tuple[tuple[str, int, bool], ...]:
    """(uid, restarts, ready) of the servers on a node, whose restart is a reason to check again."""
    return tuple(sorted((str(p["metadata"].get("uid") or ""), int((p.get("status") or {}).get("restarts") or 0), pod_ready(p))
                        for p in _servers_on(pods, namespace_id, node)))


CheckKey = tuple[tuple[str, int], tuple[tuple[str, int], ...]]  # the pod's (uid, restarts), its servers' (uid, restarts)


def check_key(pod: Pod, servers: tuple[tuple[str, int, bool], ...]) -> CheckKey:
    return (pod.uid, pod.restarts), tuple((uid, restarts) for uid, restarts, _ in servers)


@dataclass
class PodMemory:
    """What the operator remembers of one pod's checks (in memory: a restarted operator checks
    every pod once)."""

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
    """Whether a pod is to be checked now (observe() has seen it this round): Ready, using the
    cache, its servers Ready; and then never checked in this form (after a (re)start of the pod at
    once, of a server once they have been Ready for SETTLE_S), or not for interval_s; never within
    RETRY_S of a check that did not answer."""
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

# vLLM's count of each request's prompt tokens by where their KV came from (vLLM 0.33.0,
# vllm/v1/metrics/loggers.py; PromptTokenStats in vllm/v1/metrics/stats.py): computed on the pod,
# found in its own prefix cache, or loaded through the KV connector (LMCache). A request adds its
# prompt's tokens once, split over the three, in the output step of its first token (before its
# answer is returned). One record per request, unlike vllm:external_prefix_cache_hits_total (the
# connector's counter), so the three bound each other.
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass(frozen=True)
class PromptTokenSources:
    """A vLLM pod's cumulative prompt tokens by source, and its process start (a restarted vLLM
    counts from zero)."""

    computed: int
    local_cache_hit: int
    external: int
    started: float | None = None


def prompt_token_sources(text: str) -> PromptTokenSources | None:
    """The counters of a vLLM /metrics body; None when unknown: not Prometheus text, no such
    counter (a vLLM without it), or a value that is no count. Never raises."""
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
    """What was read on one side of a cached request: the pod's prompt-token counters and the
    lookup counters of the lmcache servers on its node, by pod name (None: unknown)."""

    vllm: PromptTokenSources | None
    servers: Mapping[str, LookupCounters | None]


def cacheable_tokens(prompt_tokens: int) -> int:
    """The tokens of a prompt lmcache can serve: its whole chunks, the last token left out (vLLM
    always computes it and looks up only the tokens before it)."""
    return (prompt_tokens - 1) // CHUNK_TOKENS * CHUNK_TOKENS if prompt_tokens > 0 else 0


def _grew(before: int, after: int) -> int | None:
    return after - before if after >= before else None


def served_by(prompt_tokens: int | None, before: Counters, after: Counters) -> str:
    """Which tier served one cached request of prompt_tokens tokens (P), from counters read around
    it. Other requests to the pod may move the same counters meanwhile, so each figure is a lower
    bound for this request alone: its three sources add up to P, and each counter grew by at least
    this request's share, so it had at least P minus the growth of the other two from each source.
    A tier is named only when that bound reaches the cacheable tokens (C): external >= C is lmcache
    (L1 or L2 when the servers' counters bound that too), local hits >= C vLLM's own cache (GPU),
    computed > P - C computed; anything else, or counters that did not grow by P at all (this
    request not counted yet), a restart between the readings or counters unread, is UNKNOWN."""
    if not prompt_tokens or before.vllm is None or after.vllm is None:
        return UNKNOWN
    cacheable = cacheable_tokens(prompt_tokens)
    b, a = before.vllm, after.vllm
    if cacheable <= 0 or (b.started is not None and a.started is not None and b.started != a.started):
        return UNKNOWN
    grew = [_grew(b.computed, a.computed), _grew(b.local_cache_hit, a.local_cache_hit), _grew(b.external, a.external)]
    if None in grew:
        return UNKNOWN
    computed, local, external = (int(g or 0) for g in grew)
    if computed + local + external < prompt_tokens:
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
    """L1, L2 or LMCACHE for a request that loaded at least `external` (>= cacheable) tokens from
    lmcache. Its one lookup on the node's server(s) hit at least that many tokens, split hit_l1 +
    hit_l2; each counter grew by at least this lookup's share, so L2 gave it at least external
    minus what hit_l1 grew by (and L1 likewise). Named only when that reaches the cacheable
    tokens: all of it from one tier. LMCACHE when a server's counters are unknown on either side,
    it restarted, its event bus still held events or dropped some (lookups not counted yet, or
    never), or they grew by less than external (this lookup not counted yet)."""
    if not before or set(before) != set(after):
        return LMCACHE
    hit = l1 = l2 = 0
    for pod, old in before.items():
        new = after[pod]
        if old is None or new is None or (old.started is not None and new.started is not None
                                          and old.started != new.started):
            return LMCACHE
        if new.events_queued or (old.events_dropped is not None and new.events_dropped is not None
                                 and new.events_dropped != old.events_dropped):
            return LMCACHE
        grew = [_grew(old.hit, new.hit), _grew(old.hit_l1, new.hit_l1), _grew(old.hit_l2, new.hit_l2)]
        if None in grew:
            return LMCACHE
        hit, l1, l2 = hit + int(grew[0] or 0), l1 + int(grew[1] or 0), l2 + int(grew[2] or 0)
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
    """One check's answers: the cached one, and when it differs from the reference, a second
    answer without the cache and a second with it."""

    cached: tuple[int, ...]
    cache_free_again: tuple[int, ...] | None = None
    cached_again: tuple[int, ...] | None = None


def judge(reference: tuple[int, ...], answers: Answers) -> str | None:
    """MATCH, MISMATCH or NONDETERMINISTIC; None: the cached answer differs and the second pair
    is still to be asked."""
    if answers.cached == reference:
        return MATCH
    if answers.cache_free_again is None or answers.cached_again is None:
        return None
    if answers.cache_free_again != reference or answers.cached_again == reference:
        return NONDETERMINISTIC  # the cache-free answers disagree, or the cached ones do
    return MISMATCH


def reference_contradicted(reference: tuple[int, ...], answers: Answers) -> bool:
    """A second cache-free answer differs from the reference: the reference itself may be the odd
    one out (computed in a nondeterministic moment), so it is computed again (MAX_RECOMPUTES)."""
    return answers.cache_free_again is not None and answers.cache_free_again != reference


def recompute_after(recomputes: int) -> float | None:
    """Seconds until a contradicted reference is computed again, doubling each time; None once it
    was computed again MAX_RECOMPUTES times for its (id, digest)."""
    return RETRY_S * 2**recomputes if recomputes < MAX_RECOMPUTES else None


def first_difference(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ---------------------------------------------------------------- status.canary


def reference_for(record: Mapping[str, Any] | None, namespace_id: str | None, prompt_digest: str) -> tuple[int, ...] | None:
    """The recorded reference, when it is for this namespace id and digest."""
    if not record or record.get("namespaceId") != namespace_id or record.get("promptDigest") != prompt_digest:
        return None
    return tuple(record.get("referenceTokenIds") or ())


def standing(record: Mapping[str, Any] | None, namespace_id: str | None) -> dict[str, Any] | None:
    """The mismatch that keeps the cache off: one found under this namespace id and not yet
    acknowledged. Another id starts clean (its data is another folder)."""
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
    """A new reference, its checks to come (the matches counted were against the old one). A
    mismatch of the same namespace id stays (a new prompt does not make the old hit right); under
    another id the record starts clean. Another reference for the same id and digest is one
    computed again: counted (referenceRecomputes)."""
    out: dict[str, Any] = {"namespaceId": namespace_id, "promptDigest": prompt_digest,
                           "referenceTokenIds": list(tokens), "referenceAt": at, "referencePod": pod}
    if prompt_tokens is not None:
        out["promptTokens"] = prompt_tokens
    if reference_for(record, namespace_id, prompt_digest) is not None:
        out["referenceRecomputes"] = recomputes(record) + 1
    kept = standing(record, namespace_id)
    if kept is not None:
        out["mismatch"] = kept
    return out


def with_check(record: Mapping[str, Any], pod: str, at: str, match: bool, tier: str = UNKNOWN) -> dict[str, Any]:
    """The check as lastCheck; a match counted by the tier that served it (matches), and, served
    by lmcache, kept as lastServedCheck: the evidence HitCorrectness True rests on."""
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
    found = {"id": mismatch_id, "at": at, "pod": pod, "expected": list(expected), "got": list(got)}
    if tiers:
        found["tiers"] = list(tiers)
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
    """Token ids from the first difference on, at most size of them: the message stays within an
    Event's 1024 characters with the acknowledgement in it (status.canary.mismatch has them all)."""
    shown = ", ".join(str(t) for t in tokens[start:start + size])
    return f"[{'..., ' if start else ''}{shown}{', ...' if len(tokens) > start + size else ''}]"


def mismatch_message(mismatch: Mapping[str, Any], namespace_id: str, name: str, namespace: str) -> str:
    """What happened, what it did, and what to do, within an Event's 1024 characters: the Warning
    event and the condition's message."""
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
    counts = _matches(record or {})
    return sum(counts[t] for t in FROM_LMCACHE)


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
    """recompute_in: when the reference a second cache-free answer contradicted is computed again
    (None: it was computed again MAX_RECOMPUTES times already)."""
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
    """HitCorrectness: False HitMismatch while a mismatch stands (the canary on or off: it keeps the
    cache off either way); else, with the canary on, the last outcome for this id and digest (an
    unreachable vLLM, nondeterminism), then the record: the last check a match and some matching
    check served by lmcache, True; matches none of which lmcache served (vLLM's own prefix cache
    answered), Unknown LMCacheNotReached: no claim about the cache; else Unknown Checking. Nothing
    with the canary off or without a namespace id."""
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
