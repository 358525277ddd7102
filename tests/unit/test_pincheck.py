"""The operator's pin check (kvpersist.controller.pincheck): declared numKVHeads, headSize and
chatTemplateDigest against the files at the declared commits. A mismatch turns the cache off with
a condition naming the field; a Hub it cannot read changes nothing but an Unknown condition.

The files come from a Hugging Face cache the test writes (tests/unit/hfcache.py) and, for the
operator's own Hub reads, from tests/integration/hub_stub.py (a stand-in for the Hub's resolve
route; no Hub is reachable here)."""

from __future__ import annotations

import copy
import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest

from kvpersist import hubpins
from kvpersist.api import v1alpha1 as api
from kvpersist.controller import pincheck
from kvpersist.controller.reading import target_of
from kvpersist.status.conditions import Observation, compute_status
from tests.cases.invalid_manifests import sample
from tests.integration.hub_stub import HubStub
from tests.unit.hfcache import CONFIG, QWEN_REV, TEMPLATE, write_repo

MODEL = "Qwen/Qwen3-8B"
DIGEST = "sha256:" + hashlib.sha256(TEMPLATE.encode()).hexdigest()


def body(**pins: Any) -> dict[str, Any]:
    """The nvme-minimal sample (images by digest) pinned to the model the test's files describe."""
    obj = copy.deepcopy(sample("nvme-minimal"))
    obj["metadata"].update(namespace="team-a", uid="u1", generation=1)
    obj["spec"]["identity"].update({"modelId": MODEL, "modelRevision": QWEN_REV, "tokenizer": MODEL,
                                    "tokenizerRevision": QWEN_REV, "numKVHeads": 8, "headSize": 128,
                                    "chatTemplateDigest": DIGEST, **pins})
    obj["spec"]["l2"]["encryption"] = {"enabled": False}  # no key to read: the id follows the pins alone
    return obj


def identity(obj: dict[str, Any]) -> api.Identity:
    return api.Identity.model_validate(obj["spec"]["identity"])


def cache_fetcher(tmp_path: Path) -> Any:
    write_repo(tmp_path, MODEL, QWEN_REV, {"config.json": CONFIG, "tokenizer_config.json": {"chat_template": TEMPLATE}})
    calls: list[str] = []
    inner = hubpins.hub_fetch(cache_dir=str(tmp_path), local_files_only=True)

    def fetch(repo: str, rev: str, name: str) -> bytes | None:
        calls.append(name)
        return inner(repo, rev, name)

    return (lambda _deadline: fetch), calls


def checked(files: pincheck.PinFiles, ident: api.Identity) -> None:
    done = threading.Event()
    if files.request(ident, done.set):
        assert done.wait(30), "the pin check did not end"


def test_a_wrong_pin_is_named_with_both_values_and_the_fix() -> None:
    derived = hubpins.derive(hubpins.json.dumps(CONFIG).encode(), {"tokenizer_config.json": None})
    key = (MODEL, QWEN_REV, MODEL, QWEN_REV)
    ok, reason, message = pincheck.compare(identity(body(numKVHeads=4)), derived, key)
    assert (ok, reason) == (False, "PinMismatch")
    assert f"spec.identity.numKVHeads is 4 but config.json at {MODEL}@{QWEN_REV} says 8" in message
    assert f"kvpersist pins {MODEL}@{QWEN_REV}" in message and "headSize" not in message
    assert "spec.identity.chatTemplateDigest" in message and "has no chat template" in message
    assert pincheck.compare(identity(body()), hubpins.derive(hubpins.json.dumps(CONFIG).encode(),
                            {"tokenizer_config.json": hubpins.json.dumps({"chat_template": TEMPLATE}).encode()}),
                            key)[:2] == (True, "PinsMatch")


def test_a_mismatch_turns_the_cache_off_with_the_field_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             controller: Any) -> None:
    fetcher, calls = cache_fetcher(tmp_path)
    controller.pin_files = pincheck.PinFiles(fetcher)
    wrong = body(headSize=64)
    target, res = target_of(wrong)
    assert target.namespace_id is not None  # no verdict yet: the pins as declared
    checked(controller.pin_files, target.spec.identity)
    target, res = target_of(wrong)
    assert target.namespace_id is None and res.code == "PinMismatch"
    assert "spec.identity.headSize is 64 but config.json" in res.reason and "says 128" in res.reason
    verdict = pincheck.condition_of(controller.pin_files.verdict(target.spec.identity), target.spec.identity, True)
    _fields, conds = compute_status(Observation(generation=1, namespace_id=None, identity_reason=res.reason,
                                                identity_code=res.code, l2_kind="nvme", server_desired=0,
                                                vllm_desired=1, pins=verdict))
    by_type = {c["type"]: c for c in conds}
    assert (by_type["PinsVerified"]["status"], by_type["PinsVerified"]["reason"]) == ("False", "PinMismatch")
    assert (by_type["IdentityResolved"]["status"], by_type["IdentityResolved"]["reason"]) == ("False", "PinMismatch")
    assert by_type["Ready"]["reason"] == "CacheDisabled" and "spec.identity.headSize" in by_type["Ready"]["message"]
    # Matching pins (the same files: read once, kept) keep the cache on, and say so.
    right = body()
    checked(controller.pin_files, identity(right))
    assert calls.count("config.json") == 1
    target, res = target_of(right)
    assert target.namespace_id is not None and res.code != "PinMismatch"
    assert controller.pin_files.verdict(target.spec.identity)[:2] == (True, "PinsMatch")
    monkeypatch.setenv(pincheck.ENV, "off")  # checked off: the pins as declared, Unknown
    assert target_of(wrong)[0].namespace_id is not None
    assert pincheck.condition_of(None, identity(wrong), pincheck.enabled())[:2] == (None, "CheckDisabled")


def test_an_unreachable_hub_changes_nothing_but_an_unknown_condition(controller: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    tries: list[float] = []

    def fetcher(_deadline: float) -> hubpins.Fetch:
        def fetch(*_: str) -> bytes | None:
            tries.append(time.monotonic())
            raise httpx2.ConnectError("refused")
        return fetch

    controller.pin_files = pincheck.PinFiles(fetcher)
    wrong = body(numKVHeads=4)
    checked(controller.pin_files, identity(wrong))
    target, _res = target_of(wrong)
    assert target.namespace_id is not None
    ok, reason, message = controller.pin_files.verdict(identity(wrong))
    assert (ok, reason) == (None, "HubUnreachable") and "ConnectError" in message
    assert not controller.pin_files.request(identity(wrong), lambda: None)  # within RETRY_S: no new try
    assert len(tries) == 1
    monkeypatch.setattr(pincheck, "RETRY_S", 0.0)
    checked(controller.pin_files, identity(wrong))
    assert len(tries) == 2


def test_the_operator_reads_the_files_through_its_bounded_hub_client() -> None:
    """The operator's own reads (anonymous, in memory), against the stand-in's resolve route."""
    with HubStub() as hub:
        hub.models[(MODEL, QWEN_REV)] = {"config.json": hubpins.json.dumps({**CONFIG, "num_key_value_heads": 4}).encode(),
                                         "chat_template.jinja": TEMPLATE.encode()}
        hub.gated.add("meta-llama/Gated")
        files = pincheck.PinFiles(lambda deadline: pincheck.hub_fetch(hub.url, deadline))
        checked(files, identity(body()))
        ok, reason, message = files.verdict(identity(body()))
        assert (ok, reason) == (False, "PinMismatch") and "numKVHeads is 8 but" in message and "says 4" in message
        assert "chatTemplateDigest" not in message  # chat_template.jinja gives the declared digest
        assert not any(t for t in hub.seen_tokens), "the pin check sends no token"
        gated = identity(body(modelId="meta-llama/Gated", tokenizer="meta-llama/Gated"))
        checked(files, gated)
        assert files.verdict(gated)[:2] == (None, "HubRefused")
        other = identity(body(modelRevision="f" * 40, tokenizerRevision="f" * 40))
        checked(files, other)
        assert files.verdict(other)[:2] == (None, "RevisionNotFound")


def test_a_silent_hub_is_unknown_within_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as srv:  # accepts, never answers
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        monkeypatch.setattr(pincheck, "CHECK_DEADLINE_S", 1.5)
        files = pincheck.PinFiles(lambda deadline: pincheck.hub_fetch(f"http://127.0.0.1:{srv.getsockname()[1]}", deadline))
        start = time.monotonic()
        checked(files, identity(body()))
        assert time.monotonic() - start < 15
        assert files.verdict(identity(body()))[:2] == (None, "HubUnreachable")
