"""spec.prewarm, judged: the declared list (the spec's prompts and a ConfigMap's), which lmcache
server is warmed through which vLLM pod, when a server is due a pass, and the Warm condition.
Pure functions; the passes run in kvpersist.controller.prewarm.

A server is warmed through a vLLM pod of its id on its node: lmcache's prefetch needs the KV layout
a vLLM registers with its server (lmcache 0.5.6 prefetch_service.py: 503 until then), and a prompt
L2 lacks is computed through that pod. A server no vLLM pod uses is not warmed: nothing reads its L1.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpersist.api.spec import CHUNK_TOKENS as CHUNK_TOKENS  # lmcache's chunk: what can be warm (controller.prewarm)
from kvpersist.api.spec import Prewarm
from kvpersist.api.text import printable
from kvpersist.builders.target import SERVER, VLLM
from kvpersist.status import Verdict
from kvpersist.status.workloads import Pod, pod_views

CONDITION = "Warm"
MAX_PROMPTS = 64  # warmed per server and pass, the spec's and the ConfigMap's together (spec first)
MAX_PROMPT_TOKENS = 262_144  # one prompt's token ids in one prefetch (the agent's body cap follows it)
# When a server is due again (monotonic seconds after its last pass with the same pods and list).
REWARM_PERIOD_S = 900.0  # a warm prompt L1's LRU may have evicted since: loaded again, which touches it
NOT_WARM_RETRY_S = 300.0  # a pass that left a prompt not warm (too long, vLLM refused it, L1 full)
FAILED_RETRY_S = 15.0  # a pass that could not ask (the agent, vLLM or the layout not there yet)
_KEY = re.compile(r"^(prompt|system)([-._a-zA-Z0-9]*)$")


@dataclass(frozen=True)
class Prompt:
    """One declared prompt: where it was declared (messages name that, never its text), whether it is
    a system prompt (rendered through the chat template), and its text."""

    source: str
    system: bool
    text: str = field(repr=False)

    @property
    def digest(self) -> str:
        """What identifies its token ids within a namespace id (which pins the tokenizer and template)."""
        return hashlib.sha256(f"{'system' if self.system else 'prompt'}\0{self.text}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Declared:
    """The list to keep warm, and why part of it could not be read (reason, message), if so."""

    prompts: tuple[Prompt, ...] = ()
    problem: tuple[str, str] | None = None
    note: str = ""  # ConfigMap keys left out (neither prompt-* nor system-*)

    @property
    def digest(self) -> str:
        """Changes whenever a prompt is added, removed, reordered or edited: a new pass is due."""
        return hashlib.sha256("\n".join(p.digest for p in self.prompts).encode()).hexdigest()[:16]


class Unread:
    """The ConfigMap has not been read yet (or is being read again): its prompts are not known."""


UNREAD = Unread()


def declared(prewarm: Prewarm | None, namespace: str,
             configmap: Mapping[str, Any] | Unread | str | None = UNREAD) -> Declared:
    """The spec's prompts, then the ConfigMap's by key (prompt-* raw, system-* system prompts), no
    duplicates, at most MAX_PROMPTS. configmap: the object, None when missing, UNREAD, or why it
    could not be read (its prompts are then left out, with a problem that says so)."""
    if prewarm is None:
        return Declared()
    out = [Prompt(f"spec.prewarm.prompts[{i}]", False, t) for i, t in enumerate(prewarm.prompts)]
    out += [Prompt(f"spec.prewarm.systemPrompts[{i}]", True, t) for i, t in enumerate(prewarm.system_prompts)]
    problem: tuple[str, str] | None = None
    note = ""
    ref = prewarm.config_map_ref
    if ref is not None:
        where = f"spec.prewarm.configMapRef: ConfigMap {ref.name}"
        if isinstance(configmap, Unread):
            problem = ("ConfigMapNotRead", f"{where} has not been read yet")
        elif isinstance(configmap, str):
            problem = ("ConfigMapUnreadable", f"{where} could not be read ({configmap}); its prompts are left out until "
                       "it can be")
        elif configmap is None:
            problem = ("ConfigMapNotFound", f"{where} not found in namespace {namespace}: create it (a data key "
                       "prompt-<name> per raw prompt, system-<name> per system prompt), or drop configMapRef")
        else:
            data = configmap.get("data") or {}
            ignored = sorted(k for k in data if not _KEY.match(k) or not isinstance(data[k], str))
            found = [Prompt(f"ConfigMap {ref.name} key {k}", k.startswith("system"), data[k]) for k in sorted(data)
                     if _KEY.match(k) and isinstance(data[k], str) and data[k]]
            out += found
            if ignored:
                shown = ", ".join(printable(k) for k in ignored[:5]) + (", ..." if len(ignored) > 5 else "")
                note = f"; ConfigMap {ref.name} keys ignored (not prompt-* or system-*): {shown}"
            if not found:
                problem = ("ConfigMapEmpty", f"{where} holds no prompt: name each data key prompt-<name> (a raw prompt) "
                           "or system-<name> (a system prompt)")
    unique: dict[str, Prompt] = {}
    for p in out:
        unique.setdefault(p.digest, p)
    prompts = tuple(unique.values())
    if len(prompts) > MAX_PROMPTS:
        problem = problem or ("TooManyPrompts", f"spec.prewarm declares {len(prompts)} prompts, over the {MAX_PROMPTS} the "
                              f"operator keeps warm: the first {MAX_PROMPTS} (the spec's, then the ConfigMap's by key) are "
                              "warmed, drop the others")
        prompts = prompts[:MAX_PROMPTS]
    return Declared(prompts, problem, note)


# ---------------------------------------------------------------- which server through which vLLM pod


@dataclass(frozen=True)
class Pair:
    """A Ready server of the namespace id and the Ready vLLM pod of that id on its node (None: none)."""

    server: Pod
    vllm: Pod | None

    def fingerprint(self, declared: Declared) -> tuple[Any, ...]:
        """What a pass was for: a restart of either pod or another list makes it stale (after a vLLM
        restart the pass is cheap: L1 hits count as found)."""
        v = self.vllm
        return (self.server.uid, self.server.restarts, v.uid if v else None, v.restarts if v else None, declared.digest)


def pairs(pods: Iterable[Mapping[str, Any]], namespace_id: str) -> list[Pair]:
    """Each Ready server of the id, by name, with the first Ready vLLM pod of that id on its node.
    Pods of another id (mid-rollout) are never paired: their KV is another namespace's."""
    servers = [v for v in pod_views(pods, namespace_id, SERVER) if v.ip and v.ready]
    vllms = [v for v in pod_views(pods, namespace_id, VLLM) if v.ip and v.ready]
    return [Pair(s, next((v for v in vllms if v.node and v.node == s.node), None)) for s in servers]


# ---------------------------------------------------------------- a pass and its schedule


@dataclass(frozen=True)
class PromptResult:
    """One prompt on one server: warm or not (and why), its chunks, whether vLLM computed it (not in L2)."""

    source: str
    warm: bool
    chunks: int = 0
    computed: bool = False
    why: str = ""


@dataclass(frozen=True)
class Pass:
    """One server's last pass: its Pair.fingerprint, when it ended (monotonic), each prompt's
    result, and why it stopped when it could not ask (reason, message)."""

    fingerprint: tuple[Any, ...]
    ended: float
    results: tuple[PromptResult, ...] = ()
    failure: tuple[str, str] | None = None

    @property
    def warm(self) -> int:
        return sum(1 for r in self.results if r.warm)


def due(fingerprint: tuple[Any, ...], last: Pass | None, now: float) -> bool:
    """Whether a server needs a pass: never warmed with these pods and list; else after FAILED_RETRY_S,
    NOT_WARM_RETRY_S or REWARM_PERIOD_S since the last, as it failed, left a prompt cold, or not."""
    if last is None or last.fingerprint != fingerprint:
        return True
    wait = (FAILED_RETRY_S if last.failure is not None
            else NOT_WARM_RETRY_S if last.warm < len(last.results) else REWARM_PERIOD_S)
    return now - last.ended >= wait


@dataclass(frozen=True)
class ServerWarmth:
    """One Ready server: its pair, its last pass if for the current pods and list, and progress (done, of) while one runs."""

    pair: Pair
    current: Pass | None = None
    running: tuple[int, int] | None = None


# ---------------------------------------------------------------- the condition


def _not_warm(results: Iterable[PromptResult]) -> str:
    cold = [r for r in results if not r.warm]
    shown = "; ".join(f"{r.source}: {r.why}" for r in cold[:4])
    return shown + (f"; and {len(cold) - 4} more" if len(cold) > 4 else "")


def warm_condition(prewarm: Prewarm | None, listed: Declared, servers: list[ServerWarmth], cache_on: bool,
                   vllm_uses_cache: bool) -> Verdict | None:
    """The Warm condition; None when nothing is declared. It never holds Ready back (cold is only slower)."""
    if prewarm is None or not prewarm.declared:
        return None
    if not cache_on:
        return (None, "CacheDisabled", "the cache is off (see IdentityResolved): nothing is kept warm")
    if not vllm_uses_cache:
        return (None, "CacheBypassed", "vLLM runs without the cache (see CacheBypassed): nothing is kept warm until it "
                "has it again")
    n = len(listed.prompts)
    problem = listed.problem
    if n == 0 and problem is not None:
        return (None if problem[0] == "ConfigMapNotRead" else False, problem[0], problem[1] + listed.note)
    if not servers:
        return (None, "NoServerReady", f"no lmcache server of this namespace id is Ready: {n} prompt(s) are warmed once one is")
    serving = [s for s in servers if s.pair.vllm is not None]
    idle = [s.pair.server.name for s in servers if s.pair.vllm is None]
    skipped = (f"; not warmed: {', '.join(idle)} (no Ready vLLM pod of this namespace id on its node uses it)"
               if idle and serving else "")
    if not serving:
        return (None, "WaitingForVLLM", f"no Ready vLLM pod of this namespace id runs beside a Ready lmcache server "
                f"({', '.join(idle)}): lmcache loads a prefix only once a vLLM has registered its KV layout with the "
                "server; warming starts then")
    pending = [s for s in serving if s.current is None or s.running is not None]
    ended = [(s.pair.server.name, s.current) for s in serving if s.current is not None and s.running is None]
    failed = [(name, p.failure) for name, p in ended if p.failure is not None]
    done = [(name, p) for name, p in ended if p.failure is None]
    tail = listed.note + skipped
    if problem is not None and problem[0] != "ConfigMapNotRead":
        warm = sum(p.warm for _, p in done)
        return (False, problem[0], f"{problem[1]}; {warm} of {n * len(done)} (prompt, server) pairs warm" + tail)
    if failed:
        name, (reason, message) = failed[0]
        more = f" (and {len(failed) - 1} more server(s))" if len(failed) > 1 else ""
        return (None, reason, f"{name}: {message}{more}; trying again every {FAILED_RETRY_S:.0f} s" + tail)
    if pending or (problem is not None and problem[0] == "ConfigMapNotRead"):
        parts = [f"{k} of {of} prompts on {s.pair.server.name}" for s in pending for k, of in [s.running or (0, n)]]
        parts += [f"{p.warm} of {n} on {name}" for name, p in done]
        why = f"; {problem[1]}" if problem else ""
        return (False, "Warming", "warming after a start of an lmcache server or its vLLM pod, or a change of the list: "
                + ", ".join(parts) + why + tail)
    cold = [(name, p) for name, p in done if p.warm < n]
    if cold:
        name, p = cold[0]
        return (False, "PromptsNotWarm", f"{p.warm} of {n} prompts warm on {name}, not warm: "
                f"{_not_warm(p.results)}; tried again every {NOT_WARM_RETRY_S:.0f} s" + tail)
    chunks = sum(r.chunks for _, p in done for r in p.results)
    computed = sum(1 for _, p in done for r in p.results if r.computed)
    how = f"; {computed} computed through vLLM, L2 lacking them" if computed else ""
    in_l1 = f"{chunks} chunk{'s' if chunks != 1 else ''} in L1"
    return (True, "Warm", f"{n} of {n} prompts warm on every server ({len(done)} server(s), {in_l1}){how}" + tail)
