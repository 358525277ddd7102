"""spec.prewarm: the declared list (the spec's prompts and a ConfigMap's), which lmcache server is
warmed through which vLLM pod, when a server is due a pass, the Warm condition, and the passes
(docs/design.md, "Warm restarts"). A server is warmed through a vLLM pod of its id on its node, whose
registered KV layout lmcache's prefetch needs; one no vLLM pod uses is not: nothing reads its L1.
Passes and the configMapRef read run in a pool of their own, never on the status refresh, one per
server at a time, every call bounded: a slow or hostile peer costs its own server's pass, never
another's refresh.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import re
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from kvpersist import vllmclient
from kvpersist.api.spec import CHUNK_TOKENS, Prewarm
from kvpersist.api.text import printable
from kvpersist.builders.target import SERVER, VLLM, Target
from kvpersist.controller import kube
from kvpersist.httpclient import PeerError
from kvpersist.inventory.agentclient import request_prefetch
from kvpersist.inventory.prefetch import MAX_TOKENS, Answer
from kvpersist.status import Verdict
from kvpersist.status.workloads import Pod, pod_views

log = logging.getLogger("kvpersist.prewarm")
WORKERS = 4  # passes at once, all resources together (each one server's)
CONFIGMAP_TTL_S = 60.0  # spec.prewarm.configMapRef read again at most this often (a change shows within it)
PASS_DEADLINE_S = 600.0  # one server's pass, all prompts: past it the rest are left for the next
LAYOUT_WAIT_S = 45.0  # a server just started: vLLM registers its KV layout again within ~10 s
LAYOUT_POLL_S = 3.0
RECHECK_TRIES = 5  # after a prompt was computed through vLLM: its store into L1 ends after the answer
RECHECK_S = 1.0
TOKEN_CACHE_TOKENS = 8_000_000  # token ids kept (4 bytes each), all namespaces together; oldest dropped first

MAX_PROMPTS = 64  # warmed per server and pass, the spec's and the ConfigMap's together (spec first)
# When a server is due again (monotonic seconds after its last pass with the same pods and list).
REWARM_PERIOD_S = 900.0  # a warm prompt L1's LRU may have evicted since: loaded again, which touches it
NOT_WARM_RETRY_S = 300.0  # a pass that left a prompt not warm (too long, vLLM refused it, L1 full)
FAILED_RETRY_S = 15.0  # a pass that could not ask (the agent, vLLM or the layout not there yet)
_KEY = re.compile(r"^(prompt|system)([-._a-zA-Z0-9]*)$")

Key = tuple[str, str]


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


def declared(prewarm: Prewarm, namespace: str,
             configmap: Mapping[str, Any] | Unread | str | None = UNREAD) -> Declared:
    """The spec's prompts, then the ConfigMap's by key (prompt-* raw, system-* system prompts), no
    duplicates, at most MAX_PROMPTS. configmap: the object, None when missing, UNREAD, or why it
    could not be read (its prompts are then left out, with a problem that says so)."""
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


def warm_condition(listed: Declared, servers: list[ServerWarmth], cache_on: bool,
                   vllm_uses_cache: bool) -> Verdict:
    """The Warm condition of a declared list. It never holds Ready back (cold is only slower)."""
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


# ---------------------------------------------------------------- running a pass


class PassFailed(Exception):
    """A pass cannot go on (its args: reason, message): the agent, vLLM or the layout is not there."""


@dataclass(frozen=True)
class Peers:
    """The server's agent (it finds what vLLM registered under in lmcache's /status) and the vLLM pod beside it."""

    agent_ip: str
    agent_port: int
    agent_token: str | None
    vllm_ip: str
    vllm_port: int
    served_model: str
    api_key: str | None = None
    max_model_len: int | None = None

    def tokenize(self, prompt: Prompt) -> list[int]:
        if prompt.system:
            return vllmclient.tokenize(self.vllm_ip, self.vllm_port, messages=[{"role": "system", "content": prompt.text}],
                                       api_key=self.api_key)
        return vllmclient.tokenize(self.vllm_ip, self.vllm_port, prompt=prompt.text, api_key=self.api_key)

    def prefetch(self, token_ids: list[int]) -> tuple[int, Answer]:
        return request_prefetch(self.agent_ip, self.agent_port, token_ids, self.agent_token)

    def complete(self, token_ids: list[int]) -> None:
        vllmclient.complete(self.vllm_ip, self.vllm_port, self.served_model, token_ids, max_tokens=1, api_key=self.api_key)


def run_pass(fingerprint: tuple[Any, ...], prompts: tuple[Prompt, ...], peers: Any, token_ids: Callable[[Prompt], list[int]],
             progress: Callable[[int, int], None], deadline: float, sleep: Callable[[float], None] = time.sleep) -> Pass:
    """One server's pass over the prompts (peers: Peers or a test's stand-in); what stops it is the Pass's failure."""
    results: list[PromptResult] = []
    try:
        for i, prompt in enumerate(prompts):
            progress(i, len(prompts))
            if time.monotonic() > deadline:
                results += [PromptResult(p.source, False, why=f"the pass ran past its {PASS_DEADLINE_S:.0f} s")
                            for p in prompts[i:]]
                break
            results.append(_one(prompt, peers, token_ids, sleep))
        progress(len(prompts), len(prompts))
    except PassFailed as exc:
        return Pass(fingerprint, time.monotonic(), tuple(results), exc.args)
    return Pass(fingerprint, time.monotonic(), tuple(results))


def _prefetch(ids: list[int], peers: Any, sleep: Callable[[float], None], layout_wait: float) -> Answer:
    """The prefetch's answer, waiting up to layout_wait while no vLLM registered with the server (503).
    Raises PassFailed when it cannot be asked, _Refused when it refuses the prompt."""
    waited_until = time.monotonic() + layout_wait
    while True:
        code, answer = peers.prefetch(ids)
        if code == 200 and answer.error is None:
            return answer
        if code == 0:
            raise PassFailed("AgentUnreachable", f"the inventory agent did not answer: {answer.error}")
        if code == 404:
            raise PassFailed("AgentOutdated", "the inventory agent has no /server/prefetch: it predates spec.prewarm "
                             "and is rolled to the operator's image a few servers at a time (docs/upgrading.md)")
        if code in (400, 413, 422):
            raise _Refused(f"the lmcache server refused it: {answer.error}")
        if code != 503:
            raise PassFailed("ServerUnreachable", f"the lmcache server's prefetch failed (HTTP {code}): {answer.error}")
        if time.monotonic() >= waited_until:
            raise PassFailed("NoLayout", f"{answer.error} (waited {layout_wait:.0f} s)")
        sleep(LAYOUT_POLL_S)


class _Refused(Exception):
    """This prompt was refused by a peer (not the peer's fault): the prompt is not warm."""


def _ask_vllm(call: Callable[[], Any], refused: str, failed: str) -> Any:
    """call()'s answer. A vLLM 4xx refused this prompt (_Refused); any other failure stops the pass (PassFailed)."""
    try:
        return call()
    except PeerError as exc:
        if " answered HTTP 4" in str(exc):
            raise _Refused(f"{refused}: {exc}") from None
        raise PassFailed("VLLMUnreachable", f"{failed}: {exc}") from None


def _one(prompt: Prompt, peers: Any, token_ids: Callable[[Prompt], list[int]],
         sleep: Callable[[float], None]) -> PromptResult:
    try:
        ids: list[int] = _ask_vllm(lambda: token_ids(prompt), "vLLM's /tokenize refused it", "vLLM's /tokenize failed")
        if len(ids) > MAX_TOKENS:
            raise _Refused(f"{len(ids)} tokens, over the {MAX_TOKENS} one prefetch takes")
        answer = _prefetch(ids, peers, sleep, LAYOUT_WAIT_S)
        if answer.status == "noop":
            return PromptResult(prompt.source, True, 0, why=f"under one chunk ({CHUNK_TOKENS} tokens): nothing to keep")
        if answer.whole:
            return PromptResult(prompt.source, True, answer.chunks)
        if peers.max_model_len is not None and len(ids) >= peers.max_model_len:
            raise _Refused(f"{len(ids)} tokens, not under spec.identity.maxModelLen {peers.max_model_len}: vLLM cannot "
                           f"compute it, and L2 holds {answer.found_keys} of its {answer.total_keys} chunk keys")
        _ask_vllm(lambda: peers.complete(ids), f"L2 held {answer.found_keys} of {answer.total_keys} chunk keys and vLLM "
                  "refused to compute it", "vLLM's /v1/completions failed")
        again = answer
        for _ in range(RECHECK_TRIES):
            sleep(RECHECK_S)
            again = _prefetch(ids, peers, sleep, 0.0)
            if again.whole:
                return PromptResult(prompt.source, True, again.chunks, computed=True)
        raise _Refused(f"computed through vLLM, yet the server holds {again.found_keys} of its {again.total_keys} chunk "
                       "keys (L1 full, or its stores failing: see L2Ready)")
    except _Refused as exc:
        return PromptResult(prompt.source, False, why=str(exc)[:300])


# ---------------------------------------------------------------- per resource, per server


@dataclass
class _Server:
    last: Pass | None = None
    running: tuple[int, int] | None = None
    future: concurrent.futures.Future[None] | None = None


@dataclass
class _Resource:
    # spec.prewarm.configMapRef as last read: (when, its name, the object / None / why unreadable)
    configmap: tuple[float, str, Mapping[str, Any] | str | None] | None = None
    configmap_job: concurrent.futures.Future[None] | None = None
    servers: dict[str, _Server] = field(default_factory=dict)


class TokenCache:
    """Token ids by (namespace id, prompt digest), at most TOKEN_CACHE_TOKENS in all (oldest out)."""

    def __init__(self, budget: int = TOKEN_CACHE_TOKENS) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._ids: OrderedDict[tuple[str, str], array[int]] = OrderedDict()
        self._held = 0

    def get(self, key: tuple[str, str]) -> list[int] | None:
        with self._lock:
            if (found := self._ids.get(key)) is None:
                return None
            self._ids.move_to_end(key)
            return found.tolist()

    def put(self, key: tuple[str, str], ids: list[int]) -> None:
        if len(ids) > self.budget:
            return
        with self._lock:
            self._held -= len(self._ids.pop(key, ()))
            self._ids[key] = array("i", ids)
            self._held += len(ids)
            while self._held > self.budget:
                _, dropped = self._ids.popitem(last=False)
                self._held -= len(dropped)


class Prewarmer:
    """spec.prewarm's passes and their outcomes, per resource and server; a pool of its own."""

    def __init__(self, configmap_reader: Callable[[str, str], Mapping[str, Any] | None] | None = None) -> None:
        self._lock = threading.Lock()
        self._resources: dict[Key, _Resource] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="kvp-prewarm")
        self._read_configmap = configmap_reader or _read_configmap
        self.tokens = TokenCache()

    def forget(self, key: Key) -> None:
        with self._lock:
            self._resources.pop(key, None)

    def observe(self, key: Key, target: Target, pods: list[Mapping[str, Any]], agent_token: str | None,
                api_key: Callable[[], str | None], on_done: Callable[[], None]) -> Verdict | None:
        """The Warm condition from the passes so far, starting the ConfigMap read and the passes due (off this
        thread, with api_key, vLLM's API key's reader). No I/O: called on the status refresh."""
        prewarm = target.spec.prewarm
        if prewarm is None or not prewarm.declared:
            self.forget(key)
            return None
        now = time.monotonic()
        with self._lock:
            res = self._resources.setdefault(key, _Resource())
        listed = self._declared(res, prewarm, target.namespace, on_done, now)
        if target.namespace_id is None or not target.vllm_uses_cache:
            return warm_condition(listed, [], target.cache_enabled, target.vllm_uses_cache)
        found = pairs(pods, target.namespace_id)
        views = []
        with self._lock:
            for name in set(res.servers) - {p.server.name for p in found}:
                if res.servers[name].future is None or res.servers[name].future.done():
                    del res.servers[name]
            for pair in found:
                srv = res.servers.setdefault(pair.server.name, _Server())
                fingerprint = pair.fingerprint(listed)
                busy = srv.future is not None and not srv.future.done()
                waiting = listed.problem is not None and listed.problem[0] == "ConfigMapNotRead"
                if pair.vllm is not None and not busy and not waiting and due(fingerprint, srv.last, now):
                    srv.running = (0, len(listed.prompts))
                    srv.future = self._pool.submit(self._pass, key, target, pair, listed, agent_token, api_key, srv, on_done)
                    busy = True
                current = srv.last if srv.last is not None and srv.last.fingerprint == fingerprint else None
                views.append(ServerWarmth(pair, current, srv.running if busy else None))
        return warm_condition(listed, views, True, True)

    def _declared(self, res: _Resource, prewarm: Prewarm, namespace: str, on_done: Callable[[], None], now: float) -> Declared:
        """The list as last read, starting a read of the ConfigMap when it is due."""
        ref = prewarm.config_map_ref
        if ref is None:
            return declared(prewarm, namespace)
        with self._lock:
            read = res.configmap if res.configmap is not None and res.configmap[1] == ref.name else None
            reading = res.configmap_job is not None and not res.configmap_job.done()
            if not reading and (read is None or now - read[0] >= CONFIGMAP_TTL_S):
                res.configmap_job = self._pool.submit(self._configmap_read, res, ref.name, namespace, on_done)
        value: Mapping[str, Any] | str | Unread | None = read[2] if read is not None else UNREAD
        return declared(prewarm, namespace, value)

    def _configmap_read(self, res: _Resource, name: str, namespace: str, on_done: Callable[[], None]) -> None:
        try:
            found: Mapping[str, Any] | str | None = self._read_configmap(name, namespace)
        except ApiException as exc:
            found = f"the API server answered {exc.status}" + (": the operator may not get ConfigMaps there"
                                                                 if exc.status == 403 else "")
        except Exception as exc:  # no answer at all: said in the condition, tried again
            found = f"no answer from the API server ({exc.__class__.__name__})"
        with self._lock:
            changed = res.configmap is None or res.configmap[2] != found
            res.configmap = (time.monotonic(), name, found)
        if changed:
            on_done()

    def _pass(self, key: Key, target: Target, pair: Pair, listed: Declared, agent_token: str | None,
              api_key: Callable[[], str | None], srv: _Server, on_done: Callable[[], None]) -> None:
        assert pair.vllm is not None and target.namespace_id is not None
        vllm, nsid = pair.vllm, target.namespace_id
        spec = target.spec
        fingerprint = pair.fingerprint(listed)

        def progress(done: int, of: int) -> None:
            with self._lock:
                srv.running = (done, of)

        def token_ids(prompt: Prompt, peers: Peers) -> list[int]:
            if (cached := self.tokens.get((nsid, prompt.digest))) is not None:
                return cached
            ids = peers.tokenize(prompt)
            self.tokens.put((nsid, prompt.digest), ids)
            return ids

        t0 = time.monotonic()
        try:
            peers = Peers(pair.server.ip, spec.lmcache_server.agent_port, agent_token, vllm.ip, spec.vllm.port,
                          spec.vllm.served_model_name or spec.identity.model_id, api_key(), spec.identity.max_model_len)
            if agent_token is None:
                raise PassFailed("AgentTokenMissing", f"the agent token Secret {target.agent_token_secret} cannot be "
                                 "read; it is applied again")
            done = run_pass(fingerprint, listed.prompts, peers, lambda p: token_ids(p, peers), progress,
                            t0 + PASS_DEADLINE_S)
        except PassFailed as exc:
            done = Pass(fingerprint, time.monotonic(), (), exc.args)
        except Exception as exc:  # a pass must end in a verdict, never a dead worker
            log.exception("warm pass of %s/%s on %s failed", key[0], key[1], pair.server.name)
            done = Pass(fingerprint, time.monotonic(), (), ("PassFailed", f"{exc.__class__.__name__}: {exc}"[:300]))
        with self._lock:
            srv.last, srv.running = done, None
        if done.failure is not None:
            log.info("%s/%s: warm pass on %s through %s stopped: %s", key[0], key[1], pair.server.name, vllm.name,
                     done.failure[1])
        else:
            log.info("%s/%s: %d of %d prompts warm on %s in %.1f s (%d chunks, %d computed through %s)", key[0], key[1],
                     done.warm, len(done.results), pair.server.name, time.monotonic() - t0,
                     sum(r.chunks for r in done.results), sum(1 for r in done.results if r.computed), vllm.name)
        on_done()


def _read_configmap(name: str, namespace: str) -> Mapping[str, Any] | None:
    """spec.prewarm.configMapRef's ConfigMap, its data only (kept until the next read). Raises ApiException. Blocking."""
    found = kube.get("v1", "ConfigMap", name, namespace)
    return {"data": dict(found.get("data") or {})} if found is not None else None


def read_api_key(target: Target, refusal: Callable[[str, str, str], tuple[str, str] | None]) -> str | None:
    """VLLM_API_KEY of spec.vllm.apiKeySecretRef, None without one; refusal: the chart's secretLabel check
    (controller.reading). Never logged. Raises PassFailed if unreadable or refused. Blocking."""
    ref = target.spec.vllm.api_key_secret_ref
    if ref is None:
        return None
    field_name = "spec.vllm.apiKeySecretRef"
    refused = refusal(field_name, ref.name, target.namespace)
    if refused is not None:
        raise PassFailed(refused[0], refused[1])
    try:
        raw = kube.secret_value(kube.get("v1", "Secret", ref.name, target.namespace), ref.key)
    except ApiException as exc:
        raise PassFailed("APIKeyUnreadable", f"{field_name}: Secret {ref.name} could not be read (HTTP {exc.status})") from None
    if not raw:
        raise PassFailed("APIKeyUnreadable", f"{field_name}: Secret {ref.name} has no key {ref.key}")
    return raw.decode().strip()
