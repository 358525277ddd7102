"""lmcache's warm prefetch (L2 -> L1), as the inventory agent runs it for the operator, and the
answer the operator reads back (agentclient.request_prefetch; docs/design.md, "Warm restarts").

lmcache 0.5.6 (http_apis/cache_api.py, cache_control/prefetch_service.py): POST /cache/prefetches
{model_name, world_size, token_ids} answers 202 {request_id, chunks, "submitted"} or {chunks: 0,
"noop"} (under one chunk), 503 while no worker registered that layout, 400 for a refusal; GET
/cache/prefetches/{id} answers {"pending"} or, once only, {"completed", found_keys, total_keys} (then
404; found: whole chunks, in L1 too). The model name and world size are the registering vLLM's own,
which the operator cannot know, so the agent prefetches under every registration lmcache's GET
/status lists.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvpersist import httpclient
from kvpersist.httpclient import Count, M, PeerError

PATH = "/server/prefetch"  # the agent's route (kvpersist.inventory.agent), the resource's token required
MAX_TOKENS = 262_144  # one prompt's token ids (kvpersist.controller.prewarm refuses longer prompts)
MAX_BODY = 16 + 12 * MAX_TOKENS  # {"tokenIds": [...]}: 11 bytes a token at most, and the key
WAIT_S = 20.0  # submit to completion, all registrations; an L2 read of one long prompt takes well under a second
CALL_TIMEOUT_S = 2.0  # each call to lmcache
STATUS_MAX_BYTES = 4 * 2**20  # lmcache's /status (as the agent forwards it)
POLL_S = (0.02, 0.05, 0.1, 0.2, 0.5)  # between polls, then every 0.5 s
ANSWER_MAX_BYTES = 64 * 1024  # lmcache's prefetch answers are a few dozen bytes
AT_ONCE = 2  # prefetches the agent runs at once (the operator sends one per server at a time)
MAX_LAYOUTS = 8  # registrations prefetched under (distinct model name and world size)

TokenId = Annotated[int, Field(strict=True, ge=0, lt=2**31)]


class Ask(BaseModel):
    """The operator's request to the agent: one prompt's token ids."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    token_ids: list[TokenId] = Field(alias="tokenIds", min_length=1, max_length=MAX_TOKENS)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class Layout(_Lenient):
    """One registration: as lmcache's /status lists it (snake_case), and as the prefetch ran under it."""

    model_name: str = Field(alias="modelName", min_length=1, max_length=1024)
    world_size: int = Field(alias="worldSize", strict=True, ge=1, le=1024)


class _Status(_Lenient):
    """What lmcache's /status says of the workers registered with it (the two transfer modules)."""

    non_cuda_context_meta: dict[str, Layout] = Field(default_factory=dict, max_length=1024)
    cache_context_meta: dict[str, Layout] = Field(default_factory=dict, max_length=1024)


class _Submitted(_Lenient):
    request_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[0-9A-Za-z_-]+$")
    chunks: Count
    status: Literal["submitted", "noop"]


class _Polled(_Lenient):
    status: Literal["pending", "completed"]
    found_keys: Count | None = None
    total_keys: Count | None = None


class Answer(_Lenient):
    """The agent's answer to the operator: the jobs' outcome summed over the registrations, or why none."""

    status: Literal["completed", "noop"] | None = None
    chunks: Count = 0
    found_keys: Count = Field(0, alias="foundKeys")
    total_keys: Count = Field(0, alias="totalKeys")
    layouts: list[Layout] = Field(default_factory=list, max_length=MAX_LAYOUTS)
    seconds: float = Field(0.0, ge=0, le=3600)
    error: str | None = Field(None, max_length=2048)

    @property
    def whole(self) -> bool:
        """Every chunk of the prompt is in L1 now (or there is none to keep: under one chunk)."""
        return self.status == "noop" or (self.status == "completed" and self.found_keys >= self.total_keys)


def _error(code: int, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"error": message[:2000]}


def _detail(reply: httpclient.Reply) -> str:
    """lmcache's own words for a refusal ({"detail": ...} from FastAPI), short and on one line."""
    try:
        detail = json.loads(reply.body).get("detail")
    except (ValueError, AttributeError):
        detail = None
    text = detail if isinstance(detail, str) else reply.body[:300].decode("utf-8", "replace")
    return " ".join(text.split())[:300]


def peer_code(exc: PeerError) -> int:
    """A peer that did not answer in time is a 504, any other failure to reach it a 502."""
    return 504 if "deadline" in str(exc) or "timed out" in str(exc) else 502


class _Failed(Exception):
    """lmcache's failure: (HTTP code, message)."""


def _parse(reply: httpclient.Reply, model: type[M], what: str) -> M:
    """lmcache's answer as `model`; one that is not is lmcache's failure (502), never ours."""
    try:
        return httpclient.parse(reply.body, model)
    except PeerError as exc:
        raise _Failed(502, f"{what}: {exc}") from None


class Prefetcher:
    """Submits and polls lmcache's warm prefetch on the pod's loopback; at most AT_ONCE at a time."""

    def __init__(self, server: tuple[str, int], wait_s: float = WAIT_S) -> None:
        self.server = server
        self.wait_s = wait_s
        self._slots = threading.BoundedSemaphore(AT_ONCE)

    def run(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """(HTTP code, answer) for one request body: 200 with the outcome; 400 for a body that is not an
        Ask; 429 when AT_ONCE already run; 503 while no worker has registered; 502/504 for lmcache's failures."""
        try:
            ask = Ask.model_validate_json(body)
        except ValidationError as exc:
            return _error(400, f"not a prefetch request: {httpclient.problems(exc)}")
        if not self._slots.acquire(blocking=False):
            return _error(429, f"{AT_ONCE} prefetches already run on this server; try again")
        try:
            return self._run(ask)
        except _Failed as exc:
            return _error(*exc.args)
        finally:
            self._slots.release()

    def _call(self, path: str, max_bytes: int, payload: dict[str, Any] | None = None) -> httpclient.Reply:
        """One bounded call to lmcache: a POST of payload, else a GET; _Failed (502, 504) when down or slow."""
        host, port = self.server
        try:
            if payload is None:
                return httpclient.get(host, port, path, timeout=CALL_TIMEOUT_S, max_bytes=max_bytes)
            return httpclient.post_json(host, port, path, payload, timeout=CALL_TIMEOUT_S, max_bytes=max_bytes)
        except PeerError as exc:
            raise _Failed(peer_code(exc), f"lmcache {path}: {exc}") from None

    def layouts(self) -> list[Layout]:
        """The registrations lmcache's /status lists (model name, world size), each once, sorted."""
        reply = self._call("/status", STATUS_MAX_BYTES)
        if not reply.ok:
            raise _Failed(502, f"lmcache /status answered HTTP {reply.status}: {_detail(reply)}")
        status = _parse(reply, _Status, "lmcache /status")
        found = {(r.model_name, r.world_size) for r in (*status.non_cuda_context_meta.values(),
                                                         *status.cache_context_meta.values())}
        return [Layout(model_name=m, world_size=w) for m, w in sorted(found)[:MAX_LAYOUTS]]

    def _run(self, ask: Ask) -> tuple[int, dict[str, Any]]:
        t0 = time.monotonic()
        deadline = t0 + self.wait_s
        layouts = self.layouts()
        if not layouts:
            return _error(503, "no vLLM has registered its KV layout with this lmcache server yet (its /status lists no "
                          "worker): lmcache loads a prefix only under a registered model name and world size")
        done = [o for o in [self._one(layout, ask.token_ids, deadline) for layout in layouts] if o is not None]
        seconds = round(time.monotonic() - t0, 3)
        if not done:
            return 200, Answer(status="noop", layouts=layouts, seconds=seconds).model_dump(by_alias=True)
        return 200, Answer(status="completed", chunks=max(o[0] for o in done), found_keys=sum(o[1] for o in done),
                           total_keys=sum(o[2] for o in done), layouts=layouts,
                           seconds=seconds).model_dump(by_alias=True)

    def _one(self, layout: Layout, token_ids: list[int], deadline: float) -> tuple[int, int, int] | None:
        """(chunks, found keys, total keys) of one registration's job; None for a noop. Raises _Failed."""
        payload = {"model_name": layout.model_name, "world_size": layout.world_size, "token_ids": token_ids}
        reply = self._call("/cache/prefetches", ANSWER_MAX_BYTES, payload)
        if reply.status in (400, 422, 503):  # refused, or unregistered since /status: lmcache's reason, its code
            raise _Failed(reply.status, f"lmcache /cache/prefetches answered {reply.status}: {_detail(reply)}")
        if reply.status not in (200, 202):
            raise _Failed(502, f"lmcache /cache/prefetches answered HTTP {reply.status}: {_detail(reply)}")
        submitted = _parse(reply, _Submitted, "lmcache /cache/prefetches")
        if submitted.status == "noop":
            return None
        if submitted.request_id is None:
            raise _Failed(502, "lmcache /cache/prefetches: submitted without a request_id")
        path = f"/cache/prefetches/{submitted.request_id}"
        for i in range(10_000):
            if time.monotonic() > deadline:
                raise _Failed(504, f"lmcache's prefetch {submitted.request_id} of {submitted.chunks} chunks still pending "
                              f"after {self.wait_s:.0f} s")
            time.sleep(POLL_S[min(i, len(POLL_S) - 1)])
            polled = self._call(path, ANSWER_MAX_BYTES)
            if polled.status == 404:  # completion is told once: someone else polled it, or lmcache lost it
                raise _Failed(502, f"lmcache {path}: the job is gone before it was seen complete")
            if polled.status != 200:
                raise _Failed(502, f"lmcache {path} answered HTTP {polled.status}: {_detail(polled)}")
            state = _parse(polled, _Polled, f"lmcache {path}")
            if state.status == "pending":
                continue
            found, total = state.found_keys, state.total_keys
            if found is None or total is None or found > total:
                raise _Failed(502, f"lmcache {path}: completed with found_keys {found} of total_keys {total}")
            return submitted.chunks, found, total
        raise _Failed(504, f"lmcache's prefetch {submitted.request_id} never completed")
