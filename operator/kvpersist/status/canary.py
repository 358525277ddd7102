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
itself, are nondeterminism (batching on a GPU may change greedy decoding), Unknown.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpersist.api.v1alpha1 import KVCacheNamespaceSpec
from kvpersist.builders.target import BYPASS_ANNOTATION, NAMESPACE_ID_LABEL, SERVER, VLLM

CONDITION = "HitCorrectness"
MATCH = "HitsMatch"
MISMATCH = "HitMismatch"
CHECKING = "Checking"
NONDETERMINISTIC = "NondeterministicOutput"
UNREACHABLE = "VLLMUnreachable"
VLLM_ERROR = "VLLMError"
API_KEY_UNAVAILABLE = "APIKeyUnavailable"
ACK_ANNOTATION = "kvpersist.dev/hit-correctness-ack"

# After a server restart vLLM finds its new server by its heartbeat (a ping every 10 s, each
# waiting up to 10 s): a check before that is computed, not served from the cache. So a pod whose
# servers changed is checked once they have all been Ready this long.
SETTLE_S = 30.0
# A check or reference that failed (vLLM unreachable, an error) is tried again after this.
RETRY_S = 60.0

COMPONENT_LABEL = "app.kubernetes.io/component"

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


def _ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


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
                       (p.get("spec") or {}).get("nodeName"), _ready(p),
                       BYPASS_ANNOTATION not in (meta.get("annotations") or {})))
    return sorted(out, key=lambda q: q.name)


def servers_of(pods: Iterable[Mapping[str, Any]], namespace_id: str, node: str | None) -> tuple[tuple[str, int, bool], ...]:
    """(uid, restarts, ready) of the lmcache servers of the id on a node: those its vLLM pod reaches
    (the node-local Service), whose restart is a reason to check again."""
    if node is None:
        return ()
    return tuple(sorted((str(p["metadata"].get("uid") or ""), int((p.get("status") or {}).get("restarts") or 0), _ready(p))
                        for p in _of_id(pods, namespace_id, SERVER) if (p.get("spec") or {}).get("nodeName") == node))


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


# ---------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Answers:
    """One check's answers: the cached one, and when it differs from the reference, a second
    answer without the cache and a second with it."""

    cached: tuple[int, ...]
    cache_free_again: tuple[int, ...] | None = None
    cached_again: tuple[int, ...] | None = None

    @property
    def complete(self) -> bool:
        return self.cache_free_again is not None and self.cached_again is not None


def judge(reference: tuple[int, ...], answers: Answers) -> str | None:
    """MATCH, MISMATCH or NONDETERMINISTIC; None: the cached answer differs and the second pair
    is still to be asked."""
    if answers.cached == reference:
        return MATCH
    if not answers.complete:
        return None
    if answers.cache_free_again != reference or answers.cached_again == reference:
        return NONDETERMINISTIC  # the cache-free answers disagree, or the cached ones do
    return MISMATCH


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


def with_reference(record: Mapping[str, Any] | None, namespace_id: str, prompt_digest: str, tokens: tuple[int, ...],
                   pod: str, at: str) -> dict[str, Any]:
    """A new reference. A mismatch of the same namespace id stays (a new prompt does not make the
    old hit right); under another id the record starts clean."""
    out: dict[str, Any] = {"namespaceId": namespace_id, "promptDigest": prompt_digest,
                           "referenceTokenIds": list(tokens), "referenceAt": at, "referencePod": pod}
    kept = standing(record, namespace_id)
    if kept is not None:
        out["mismatch"] = kept
    return out


def with_check(record: Mapping[str, Any], pod: str, at: str, match: bool) -> dict[str, Any]:
    return {**record, "lastCheck": {"at": at, "pod": pod, "match": match}}


def with_mismatch(record: Mapping[str, Any], mismatch_id: str, pod: str, at: str, expected: tuple[int, ...],
                  got: tuple[int, ...]) -> dict[str, Any]:
    return {**record, "mismatch": {"id": mismatch_id, "at": at, "pod": pod, "expected": list(expected), "got": list(got)}}


def acknowledged(record: Mapping[str, Any] | None, namespace_id: str | None,
                 annotations: Mapping[str, str] | None) -> dict[str, Any] | None:
    """The record without its mismatch when the annotation names it; else None (nothing to do)."""
    found = standing(record, namespace_id)
    if found is None or (annotations or {}).get(ACK_ANNOTATION, "").strip() != found["id"]:
        return None
    return {k: v for k, v in (record or {}).items() if k != "mismatch"}


def field_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """status.canary to write as a merge patch, or None when nothing changed: keys the new record
    lacks are nulled (a merge patch would keep them)."""
    if new is None or dict(new) == dict(old or {}):
        return None
    return {**{k: None for k in (old or {}) if k not in new}, **new}


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


def match_message(record: Mapping[str, Any], max_tokens: int) -> str:
    check = record.get("lastCheck") or {}
    return (f"the canary's {max_tokens} greedy tokens served with the cache are those computed without it (reference "
            f"by pod {record.get('referencePod')}; last checked on pod {check.get('pod')}, status.canary.lastCheck)")


def nondeterministic_message(pod: str, reference: tuple[int, ...], answers: Answers) -> str:
    why = ("a second answer without the cache differs from the reference" if answers.cache_free_again != reference
           else "a second answer with the cache is the reference")
    at = first_difference(reference, answers.cached)
    return (f"vLLM pod {pod} answered the canary {_window(list(answers.cached), at)} with the cache, not the reference "
            f"{_window(list(reference), at)} (from token {at}), but {why}: its greedy output is not deterministic "
            "(batching on a GPU can change it), so the check cannot tell a wrong hit; the cache stays on. A quieter time, "
            "or a shorter spec.canary.maxTokens, gives the check answers it can compare")


def condition_of(record: Mapping[str, Any] | None, namespace_id: str | None, prompt_digest: str, outcome: Verdict | None,
                 enabled: bool, max_tokens: int, name: str, namespace: str) -> Verdict | None:
    """HitCorrectness: False HitMismatch while a mismatch stands (the canary on or off: it keeps the
    cache off either way); else, with the canary on, the last outcome for this id and digest (an
    unreachable vLLM, nondeterminism, a match), the recorded last check after an operator restart,
    or Unknown Checking; nothing with the canary off or without a namespace id."""
    found = standing(record, namespace_id)
    if found is not None:
        return (False, MISMATCH, mismatch_message(found, str(namespace_id), name, namespace))
    if not enabled or namespace_id is None:
        return None
    if outcome is not None:
        return outcome
    if reference_for(record, namespace_id, prompt_digest) is not None and (record or {}).get("lastCheck", {}).get("match"):
        return (True, MATCH, match_message(record or {}, max_tokens))
    return (None, CHECKING, "no verdict yet: the reference is computed without the cache (a fresh cache_salt), then each "
            "Ready vLLM pod that uses the cache is asked the same with it")


def bypass_message(mismatch: Mapping[str, Any], name: str, namespace: str) -> str:
    """CacheBypassed's message (reason HitMismatch)."""
    return (f"a cache hit changed the canary's answer on pod {mismatch.get('pod')} (HitCorrectness): vLLM runs without the "
            "cache (no --kv-transfer-config) until the namespace id changes or a person acknowledges it: "
            f"{ack_command(name, namespace, str(mismatch.get('id')))}")
