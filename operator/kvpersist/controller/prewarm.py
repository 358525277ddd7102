"""spec.prewarm carried out: the passes kvpersist.status.prewarm finds due, each over one Ready lmcache
server through the Ready vLLM pod of its namespace id beside it. Per prompt: its token ids from that
pod's /tokenize (pinned tokenizer and template, so kept per (namespace id, prompt)); lmcache's warm
prefetch L2 -> L1 through the inventory agent (lmcache's admin API is on the pod's loopback); when L2
lacks a chunk, one greedy token through vLLM (computed, stored) and the prefetch again.

Passes and the configMapRef read run in a pool of their own, never on the status refresh, one per
server at a time, every call bounded: a slow or hostile peer costs its own server's pass, never another's refresh.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from kvpersist import vllmclient
from kvpersist.api.spec import Prewarm
from kvpersist.builders.target import Target
from kvpersist.controller import kube
from kvpersist.httpclient import PeerError
from kvpersist.inventory.agentclient import request_prefetch
from kvpersist.inventory.prefetch import Answer
from kvpersist.status import prewarm as judge
from kvpersist.status.prewarm import UNREAD, Declared, Pair, Pass, Prompt, PromptResult, ServerWarmth, Unread

log = logging.getLogger("kvpersist.prewarm")

WORKERS = 4  # passes at once, all resources together (each one server's)
CONFIGMAP_TTL_S = 60.0  # spec.prewarm.configMapRef read again at most this often (a change shows within it)
PASS_DEADLINE_S = 600.0  # one server's pass, all prompts: past it the rest are left for the next
LAYOUT_WAIT_S = 45.0  # a server just started: vLLM registers its KV layout again within ~10 s
LAYOUT_POLL_S = 3.0
RECHECK_TRIES = 5  # after a prompt was computed through vLLM: its store into L1 ends after the answer
RECHECK_S = 1.0
TOKEN_CACHE_TOKENS = 8_000_000  # token ids kept (4 bytes each), all namespaces together; oldest dropped first

Key = tuple[str, str]


class PassFailed(Exception):
    """A pass cannot go on (reason, message): the agent, vLLM or the layout is not there."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(reason, message)
        self.reason, self.message = reason, message


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
                                       add_generation_prompt=False, api_key=self.api_key)
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
        return Pass(fingerprint, time.monotonic(), tuple(results), (exc.reason, exc.message))
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
        if len(ids) > judge.MAX_PROMPT_TOKENS:
            raise _Refused(f"{len(ids)} tokens, over the {judge.MAX_PROMPT_TOKENS} one prefetch takes")
        answer = _prefetch(ids, peers, sleep, LAYOUT_WAIT_S)
        if answer.status == "noop":
            return PromptResult(prompt.source, True, 0, why=f"under one chunk ({judge.CHUNK_TOKENS} tokens): nothing to keep")
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
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._read_configmap = configmap_reader or _read_configmap
        self.tokens = TokenCache()

    def forget(self, key: Key) -> None:
        with self._lock:
            self._resources.pop(key, None)

    def _submit(self, job: Callable[..., None], *args: Any) -> concurrent.futures.Future[None]:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="kvp-prewarm")
        return self._pool.submit(job, *args)

    def observe(self, key: Key, target: Target, pods: list[Mapping[str, Any]], agent_token: str | None,
                api_key: Callable[[], str | None], on_done: Callable[[], None]) -> judge.Verdict | None:
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
            return judge.warm_condition(prewarm, listed, [], target.cache_enabled, target.vllm_uses_cache)
        found = judge.pairs(pods, target.namespace_id)
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
                if pair.vllm is not None and not busy and not waiting and judge.due(fingerprint, srv.last, now):
                    srv.running = (0, len(listed.prompts))
                    srv.future = self._submit(self._pass, key, target, pair, listed, agent_token, api_key, srv, on_done)
                    busy = True
                current = srv.last if srv.last is not None and srv.last.fingerprint == fingerprint else None
                views.append(ServerWarmth(pair, current, srv.running if busy else None))
        return judge.warm_condition(prewarm, listed, views, True, True)

    def _declared(self, res: _Resource, prewarm: Prewarm, namespace: str, on_done: Callable[[], None], now: float) -> Declared:
        """The list as last read, starting a read of the ConfigMap when it is due."""
        ref = prewarm.config_map_ref
        if ref is None:
            return judge.declared(prewarm, namespace)
        with self._lock:
            read = res.configmap if res.configmap is not None and res.configmap[1] == ref.name else None
            reading = res.configmap_job is not None and not res.configmap_job.done()
            if not reading and (read is None or now - read[0] >= CONFIGMAP_TTL_S):
                res.configmap_job = self._submit(self._configmap_read, res, ref.name, namespace, on_done)
        value: Mapping[str, Any] | str | Unread | None = read[2] if read is not None else UNREAD
        return judge.declared(prewarm, namespace, value)

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
            done = Pass(fingerprint, time.monotonic(), (), (exc.reason, exc.message))
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
