"""Bounded calls to a vLLM pod's OpenAI-compatible server: tokenize, one greedy completion, /metrics. A peer like
any other (kvpersist.httpclient), its answer validated before use: a malformed one is a PeerError naming what was
wrong, never a wrong figure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, Field

from kvpersist import httpclient
from kvpersist.httpclient import Count, M, PeerError

TOKENIZE_TIMEOUT_S = 10.0
COMPLETE_TIMEOUT_S = 120.0  # one short greedy answer; a CPU test model or a busy GPU takes seconds
MAX_TOKENS_BYTES = 16 * 2**20  # token ids of a long prompt as JSON: ~8 bytes a token, 1M tokens at most
MAX_COMPLETION_BYTES = 2**20
MAX_PROMPT_TOKENS = 1_000_000  # lmcache's own cap on a prefetch (cache_control/key_resolver.py)
METRICS_TIMEOUT_S = 5.0
MAX_METRICS_BYTES = 4 * 2**20  # vLLM 0.33.0's is some tens of KB (histograms per engine)

TokenId = Annotated[int, Field(strict=True, ge=0, lt=2**31)]


# The answers' models ignore fields they do not name (pydantic's default): a newer vLLM adds some.
class TokenizeAnswer(BaseModel):
    tokens: list[TokenId] = Field(max_length=MAX_PROMPT_TOKENS)


class _Choice(BaseModel):
    token_ids: list[TokenId] = Field(max_length=4096)
    text: str = ""
    finish_reason: str | None = None


class _Usage(BaseModel):
    prompt_tokens: Count | None = None


class CompletionAnswer(BaseModel):
    choices: list[_Choice] = Field(min_length=1, max_length=1)
    usage: _Usage | None = None


class VLLMAnswerError(PeerError):
    """vLLM answered, but not usably: an HTTP error status (prompt too long, wrong API key, unknown model)
    or not the answer asked for. A plain PeerError is a vLLM not reached or not answering in time."""


@dataclass(frozen=True)
class Completion:
    """A greedy answer: the generated token ids (what the canary compares), its text, and
    usage.prompt_tokens (None when vLLM did not say)."""

    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int | None = None


def _headers(api_key: str | None) -> dict[str, str]:
    # The key only ever travels in this header, to the pod it protects; never logged.
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _checked(reply: httpclient.Reply, what: str) -> bytes:
    if not reply.ok:
        detail = reply.body[:200].decode("utf-8", "replace").replace("\n", " ")
        raise VLLMAnswerError(f"{what} answered HTTP {reply.status}: {detail}")
    return reply.body


def _parsed(reply: httpclient.Reply, model: type[M], what: str) -> M:
    body = _checked(reply, what)
    try:
        return httpclient.parse(body, model)
    except PeerError as exc:
        raise VLLMAnswerError(f"{what} answered what is not its answer: {exc}") from None


def tokenize(host: str, port: int, *, prompt: str | None = None, messages: list[Mapping[str, str]] | None = None,
             api_key: str | None = None, timeout: float = TOKENIZE_TIMEOUT_S) -> list[int]:
    """The token ids the pod's own tokenizer gives a prompt, or its chat template over messages (POST
    /tokenize): exactly the ids a later request of that text prefills."""
    if (prompt is None) == (messages is None):
        raise ValueError("tokenize takes a prompt or messages, not both")
    payload: dict[str, Any] = ({"prompt": prompt, "add_special_tokens": True} if prompt is not None else
                               {"messages": list(messages or []), "add_generation_prompt": False,
                                "add_special_tokens": False})
    reply = httpclient.post_json(host, port, "/tokenize", payload, timeout=timeout, max_bytes=MAX_TOKENS_BYTES,
                                 headers=_headers(api_key))
    return list(_parsed(reply, TokenizeAnswer, "/tokenize").tokens)


# kv_transfer_params for LMCache's connector (lmcache_mp_connector): no KV offloaded, so nothing of the
# request is stored (lmcache_mp_metadata.py). Not part of any cache key (request_configs compare=False).
NO_STORE = {"lmcache.max_offload_tokens": 0}


def complete(host: str, port: int, model: str, prompt: str | list[int], *, max_tokens: int,
             cache_salt: str | None = None, store: bool = True, api_key: str | None = None,
             timeout: float = COMPLETE_TIMEOUT_S) -> Completion:
    """One greedy completion (temperature 0) of a prompt, text or token ids. A fresh cache_salt (vLLM's
    prefix cache and lmcache's keys both take it) makes a request nothing cached can serve. store False:
    LMCache keeps nothing of it; only for a pod with LMCache's connector (vLLM without one warns for
    every request carrying kv_transfer_params)."""
    payload: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                               "return_token_ids": True, "ignore_eos": True, "stream": False}
    if cache_salt is not None:
        payload["cache_salt"] = cache_salt
    if not store:
        payload["kv_transfer_params"] = dict(NO_STORE)
    reply = httpclient.post_json(host, port, "/v1/completions", payload, timeout=timeout,
                                 max_bytes=MAX_COMPLETION_BYTES, headers=_headers(api_key))
    answer = _parsed(reply, CompletionAnswer, "/v1/completions")
    choice = answer.choices[0]
    # Fewer is an answer (a stop token of the model's generation config ends it, ignore_eos aside);
    # more is not what was asked.
    if len(choice.token_ids) > max_tokens:
        raise VLLMAnswerError(f"/v1/completions gave {len(choice.token_ids)} token ids for max_tokens {max_tokens} "
                              f"(finish_reason {choice.finish_reason!r})")
    return Completion(tuple(choice.token_ids), choice.text, answer.usage.prompt_tokens if answer.usage else None)


def metrics(host: str, port: int, *, api_key: str | None = None, timeout: float = METRICS_TIMEOUT_S) -> str:
    """The text of a vLLM pod's GET /metrics (Prometheus), bounded; kvpersist.status.canary parses it."""
    reply = httpclient.get(host, port, "/metrics", timeout=timeout, max_bytes=MAX_METRICS_BYTES,
                           headers=_headers(api_key))
    return _checked(reply, "/metrics").decode("utf-8", "replace")
