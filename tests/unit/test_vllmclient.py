"""kvpersist.vllmclient against a loopback HTTP server STANDING IN for a vLLM pod's OpenAI server
(no vLLM here: tests/e2e/test_canary.py asks the real one). The stand-in answers in vLLM 0.32's
shapes (entrypoints/openai/completion/protocol.py: choices[].token_ids with return_token_ids;
/tokenize's tokens) and records what it was sent, so these tests show what the client asks for
(greedy, token ids back, a cache_salt only when given, the API key only in its header) and that a
vLLM that errs, answers garbage or too much, or does not answer in time is a PeerError naming why
within its deadline: VLLMAnswerError when vLLM answered, a plain PeerError when it could not be
reached. The prompt's token count comes with an answer; /metrics is read with the same bounds."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvpersist import vllmclient
from kvpersist.httpclient import PeerError
from tests.serving import in_thread

Answer = Callable[[str, dict[str, Any]], tuple[int, bytes]]


class StandIn:
    """What the stand-in was asked (path, body, Authorization header), and how it answers."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.asked: list[tuple[str, dict[str, Any], str | None]] = []


def completion(tokens: list[int], text: str = "x") -> bytes:
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None,
         "prompt_token_ids": None, "token_ids": tokens}], "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens)}}).encode()


@pytest.fixture
def vllm() -> Iterator[tuple[StandIn, int]]:
    stand_in = StandIn(lambda path, body: (200, completion(list(range(body.get("max_tokens", 1))))))

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            stand_in.asked.append((self.path, body, self.headers.get("Authorization")))
            code, out = stand_in.answer(self.path, body)
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def do_GET(self) -> None:
            stand_in.asked.append((self.path, {}, self.headers.get("Authorization")))
            code, out = stand_in.answer(self.path, {})
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    with in_thread(ThreadingHTTPServer(("127.0.0.1", 0), Handler)) as port:
        yield stand_in, port


def test_a_completion_is_greedy_returns_token_ids_and_salts_only_when_asked(vllm: tuple[StandIn, int]) -> None:
    stand_in, port = vllm
    plain = vllmclient.complete("127.0.0.1", port, "org/model", "a prompt", max_tokens=4)
    salted = vllmclient.complete("127.0.0.1", port, "org/model", "a prompt", max_tokens=4, cache_salt="kvp-canary-00ff",
                                 api_key="sk-secret")
    assert plain.token_ids == salted.token_ids == (0, 1, 2, 3)
    (path, first, auth_first), (_, second, auth_second) = stand_in.asked
    assert path == "/v1/completions"
    assert first == {"model": "org/model", "prompt": "a prompt", "max_tokens": 4, "temperature": 0.0,
                     "return_token_ids": True, "ignore_eos": True, "stream": False}
    assert second == {**first, "cache_salt": "kvp-canary-00ff"}
    assert auth_first is None and auth_second == "Bearer sk-secret"
    vllmclient.complete("127.0.0.1", port, "org/model", "a prompt", max_tokens=4, cache_salt="s", store=False)
    assert stand_in.asked[-1][1]["kv_transfer_params"] == {"lmcache.max_offload_tokens": 0}  # LMCache stores none of it


def test_fewer_tokens_are_an_answer_more_are_not(vllm: tuple[StandIn, int]) -> None:
    stand_in, port = vllm
    stand_in.answer = lambda path, body: (200, completion([7, 8]))
    assert vllmclient.complete("127.0.0.1", port, "m", "p", max_tokens=4).token_ids == (7, 8)  # a stop token ended it
    with pytest.raises(vllmclient.VLLMAnswerError, match="gave 2 token ids for max_tokens 1"):
        vllmclient.complete("127.0.0.1", port, "m", "p", max_tokens=1)


@pytest.mark.parametrize(("code", "body", "said"), [
    (400, b'{"error": {"message": "This model\'s maximum context length is 4096 tokens"}}', "answered HTTP 400"),
    (401, b'{"error": "Unauthorized"}', "answered HTTP 401"),
    (200, b"<html>not json</html>", "not JSON"),
    (200, json.dumps({"choices": [{"text": "x"}]}).encode(), "choices.0.token_ids"),  # a vLLM without return_token_ids
    (200, json.dumps({"choices": [{"token_ids": [-1]}]}).encode(), "choices.0.token_ids.0"),
    (200, json.dumps({"choices": [{"token_ids": ["7"]}]}).encode(), "choices.0.token_ids.0"),
    (200, json.dumps({"choices": []}).encode(), "choices"),
])
def test_an_error_or_a_malformed_answer_is_a_vllm_answer_error_naming_it(vllm: tuple[StandIn, int], code: int,
                                                                          body: bytes, said: str) -> None:
    stand_in, port = vllm
    stand_in.answer = lambda path, asked: (code, body)
    with pytest.raises(vllmclient.VLLMAnswerError, match=said.replace("(", r"\(")):
        vllmclient.complete("127.0.0.1", port, "m", "p", max_tokens=2)


def test_a_body_over_the_cap_is_refused(vllm: tuple[StandIn, int], monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in, port = vllm
    monkeypatch.setattr(vllmclient, "MAX_COMPLETION_BYTES", 1024)
    stand_in.answer = lambda path, body: (200, completion([1], text="x" * 4096))
    with pytest.raises(PeerError, match="over the 1024-byte limit"):
        vllmclient.complete("127.0.0.1", port, "m", "p", max_tokens=1)


def test_the_prompts_token_count_comes_with_the_answer(vllm: tuple[StandIn, int]) -> None:
    """usage.prompt_tokens: what the canary's counters are compared with (kvpersist.status.canary)."""
    stand_in, port = vllm
    assert vllmclient.complete("127.0.0.1", port, "m", "p", max_tokens=2).prompt_tokens == 3
    stand_in.answer = lambda path, body: (200, json.dumps({"choices": [{"token_ids": [1]}]}).encode())
    assert vllmclient.complete("127.0.0.1", port, "m", "p", max_tokens=2).prompt_tokens is None  # not said: unknown
    for wrong in (-1, "3947", 2**60):
        stand_in.answer = lambda path, body, w=wrong: (200, json.dumps({"choices": [{"token_ids": [1]}],
                                                                        "usage": {"prompt_tokens": w}}).encode())
        with pytest.raises(vllmclient.VLLMAnswerError, match=r"usage\.prompt_tokens"):
            vllmclient.complete("127.0.0.1", port, "m", "p", max_tokens=2)


def test_metrics_is_read_with_a_deadline_and_a_cap(vllm: tuple[StandIn, int], monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in, port = vllm
    stand_in.answer = lambda path, body: (200, b"vllm:prompt_tokens_total 7\n")
    assert vllmclient.metrics("127.0.0.1", port, api_key="sk-1") == "vllm:prompt_tokens_total 7\n"
    assert stand_in.asked[-1] == ("/metrics", {}, "Bearer sk-1")
    stand_in.answer = lambda path, body: (404, b"not found")
    with pytest.raises(vllmclient.VLLMAnswerError, match="answered HTTP 404"):
        vllmclient.metrics("127.0.0.1", port)
    monkeypatch.setattr(vllmclient, "MAX_METRICS_BYTES", 1024)
    stand_in.answer = lambda path, body: (200, b"# x\n" * 1024)
    with pytest.raises(PeerError, match="over the 1024-byte limit"):
        vllmclient.metrics("127.0.0.1", port)


def test_tokenize_returns_the_ids(vllm: tuple[StandIn, int]) -> None:
    stand_in, port = vllm
    stand_in.answer = lambda path, body: (200, json.dumps({"count": 3, "max_model_len": 4096, "tokens": [1, 5, 9],
                                                           "token_strs": None}).encode())
    assert vllmclient.tokenize("127.0.0.1", port, prompt="a b") == [1, 5, 9]
    assert stand_in.asked[-1][:2] == ("/tokenize", {"prompt": "a b", "add_special_tokens": True})


def test_an_unreachable_or_silent_vllm_is_a_peer_error_within_the_deadline() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: refused
        with pytest.raises(PeerError) as refused:
            vllmclient.complete("127.0.0.1", port, "m", "p", max_tokens=1, timeout=1.0)
        assert not isinstance(refused.value, vllmclient.VLLMAnswerError)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        start = time.monotonic()
        with pytest.raises(PeerError, match="timed out") as late:
            vllmclient.complete("127.0.0.1", silent.getsockname()[1], "m", "p", max_tokens=1, timeout=1.0)
        assert time.monotonic() - start < 2.5
        assert not isinstance(late.value, vllmclient.VLLMAnswerError)
