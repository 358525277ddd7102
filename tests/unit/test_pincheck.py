"""The operator's pin check (kvpersist.controller.pincheck): declared numKVHeads, headSize and
chatTemplateDigest against the files at the declared commits. A mismatch turns the cache off with
a condition naming the field; a Hub it cannot read changes nothing but an Unknown condition.

The files come from a Hugging Face cache the test writes (tests/unit/hfcache.py) and, for the
operator's own Hub reads, from tests/integration/hub_stub.py (a stand-in for the Hub's resolve
route; no Hub is reachable here)."""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest

from kvpersist.api import v1alpha1 as api
from kvpersist.api.identity import Identity
from kvpersist.api.spec import HFTokenSecretRef
from kvpersist.api.statusmodels import KVCacheNamespaceStatus
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


def identity(obj: dict[str, Any]) -> Identity:
    return Identity.model_validate(obj["spec"]["identity"])


def cache_fetcher(tmp_path: Path) -> Any:
    write_repo(tmp_path, MODEL, QWEN_REV, {"config.json": CONFIG, "tokenizer_config.json": {"chat_template": TEMPLATE}})
    calls: list[str] = []
    inner = pincheck.cache_fetch(cache_dir=str(tmp_path), local_files_only=True)

    def fetch(repo: str, rev: str, name: str) -> bytes | None:
        calls.append(name)
        return inner(repo, rev, name)

    return (lambda _deadline, _token: fetch), calls


def checked(files: pincheck.PinFiles, ident: Identity) -> None:
    done = threading.Event()
    if files.request(ident, done.set):
        assert done.wait(30), "the pin check did not end"


def test_a_wrong_pin_is_named_with_both_values_and_the_fix() -> None:
    derived = pincheck.derive(json.dumps(CONFIG).encode(), {"tokenizer_config.json": None})
    key = (MODEL, QWEN_REV, MODEL, QWEN_REV)
    ok, reason, message = pincheck.compare(identity(body(numKVHeads=4)), derived, key)
    assert (ok, reason) == (False, "PinMismatch")
    assert f"spec.identity.numKVHeads is 4 but config.json at {MODEL}@{QWEN_REV} says 8" in message
    assert f"kvpersist pins {MODEL}@{QWEN_REV}" in message and "headSize" not in message
    assert "spec.identity.chatTemplateDigest" in message and "has no chat template" in message
    assert pincheck.compare(identity(body()), pincheck.derive(json.dumps(CONFIG).encode(),
                            {"tokenizer_config.json": json.dumps({"chat_template": TEMPLATE}).encode()}),
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
    verdict = controller.pin_files.verdict(target.spec.identity)
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
    assert controller.pin_files.verdict(identity(wrong), checking=pincheck.enabled())[:2] == (None, "CheckDisabled")


def test_an_unreachable_hub_changes_nothing_but_an_unknown_condition(controller: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    tries: list[float] = []

    def fetcher(_deadline: float, _token: str | None) -> pincheck.Fetch:
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
        hub.models[(MODEL, QWEN_REV)] = {"config.json": json.dumps({**CONFIG, "num_key_value_heads": 4}).encode(),
                                         "chat_template.jinja": TEMPLATE.encode()}
        hub.gated.add("meta-llama/Gated")
        files = pincheck.PinFiles(lambda deadline, _token: pincheck.hub_fetch(hub.url, deadline))
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
        files = pincheck.PinFiles(lambda deadline, _token: pincheck.hub_fetch(f"http://127.0.0.1:{srv.getsockname()[1]}",
                                                                                 deadline))
        start = time.monotonic()
        checked(files, identity(body()))
        assert time.monotonic() - start < 15
        assert files.verdict(identity(body()))[:2] == (None, "HubUnreachable")


def two_pins(**more: Any) -> dict[str, Any]:
    """body() with only modelId and modelRevision in spec.identity (and what more adds)."""
    obj = body()
    obj["spec"]["identity"] = {"modelId": MODEL, "modelRevision": QWEN_REV, **more}
    return obj


def files_of(config: dict[str, Any] = CONFIG, template: str | None = TEMPLATE) -> pincheck.Facts:
    derived = pincheck.derive(json.dumps(config).encode(), {
        "tokenizer_config.json": json.dumps({"chat_template": template}).encode() if template else None})
    return pincheck.Facts(f"{MODEL}@{QWEN_REV}", tuple(pincheck.file_pins(derived).items()))


def test_two_pins_resolve_to_the_id_of_the_same_pins_written_out() -> None:
    from kvpersist.builders.vllm import vllm_args
    from kvpersist.controller.decision import target_for
    from kvpersist.identity import image_digest

    spec = api.KVCacheNamespace.model_validate(two_pins()).spec
    target, res = target_for("a", "team-a", spec, None, files_of())
    written = body(kvCacheDtype="bfloat16", blockSize=16, tensorParallelSize=1, maxModelLen=40960,
                   connectorBuild=image_digest(spec.image))
    explicit, _ = target_for("a", "team-a", api.KVCacheNamespace.model_validate(written).spec, None)
    assert res.namespace_id is not None and res.namespace_id == explicit.namespace_id
    args = vllm_args(target)  # rendered, so vLLM cannot choose otherwise
    for flag, value in (("--kv-cache-dtype", "bfloat16"), ("--block-size", "16"), ("--tensor-parallel-size", "1"),
                        ("--max-model-len", "40960")):
        assert args[args.index(flag) + 1] == value
    shown = pincheck.status_of(spec.identity, target.spec.identity, files_of())
    assert shown["pins"]["numKVHeads"] == 8 and shown["pins"]["chatTemplateDigest"] == DIGEST
    assert shown["filled"] == sorted(["blockSize", "chatTemplateDigest", "connectorBuild", "headSize", "kvCacheDtype",
                                      "maxModelLen", "numKVHeads", "tensorParallelSize"])
    KVCacheNamespaceStatus.model_validate({"identity": shown})  # what the CRD's status takes


def test_a_pin_written_stays_and_a_written_pin_the_files_contradict_turns_the_cache_off(controller: Any,
                                                                                      tmp_path: Path) -> None:
    from kvpersist.controller.decision import target_for

    spec = api.KVCacheNamespace.model_validate(two_pins(maxModelLen=8192, blockSize=32)).spec
    target, res = target_for("a", "team-a", spec, None, files_of())
    assert (target.spec.identity.max_model_len, target.spec.identity.block_size) == (8192, 32) and res.namespace_id
    fetcher, _calls = cache_fetcher(tmp_path)
    controller.pin_files = pincheck.PinFiles(fetcher)
    wrong = two_pins(numKVHeads=4)
    checked(controller.pin_files, identity(wrong))
    target, res = target_of(wrong)
    assert target.namespace_id is None and res.code == "PinMismatch" and "numKVHeads is 4" in res.reason
    target, res = target_of(two_pins())  # the same files fill the rest: read once
    assert target.namespace_id is not None and target.spec.identity.num_kv_heads == 8


def test_until_the_files_are_read_the_cache_stays_off_with_the_reason(controller: Any) -> None:
    from kvpersist.controller.decision import target_for

    spec = api.KVCacheNamespace.model_validate(two_pins()).spec
    target, res = target_for("a", "team-a", spec, None, pincheck.Facts("m@r", unread="cannot reach the Hugging Face Hub"))
    assert target.namespace_id is None and res.code == "PinsUnresolved"
    assert "numKVHeads" in res.reason and "cannot reach the Hugging Face Hub" in res.reason
    assert target.spec.identity.num_kv_heads is None  # vLLM gets no guessed flag
    target, res = target_for("a", "team-a", spec, None, None)  # the check off: nothing read, nothing filled
    assert target.namespace_id is None and pincheck.ENV in res.reason
    target, res = target_of(two_pins())  # the operator: no read yet
    assert res.code == "PinsUnresolved" and "reading the files" in res.reason


def test_what_the_files_do_not_decide_is_named_not_guessed() -> None:
    from kvpersist.controller.decision import target_for

    mla = {"hidden_size": 7168, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "torch_dtype": "float32"}
    spec = api.KVCacheNamespace.model_validate(two_pins()).spec
    target, res = target_for("a", "team-a", spec, None, files_of(mla, template=None))
    assert target.namespace_id is None and res.code == "PinsUnresolved"
    for field in ("chatTemplateDigest (the tokenizer has no chat template", "kvCacheDtype", "maxModelLen",
                  "blockSize (an MLA model's"):
        assert f"spec.identity.{field}" in res.reason
    assert (target.spec.identity.num_kv_heads, target.spec.identity.head_size) == (1, 576)


def test_status_keeps_the_files_for_a_restart_and_only_for_the_same_commits(controller: Any) -> None:
    spec = api.KVCacheNamespace.model_validate(two_pins()).spec
    from kvpersist.controller.decision import target_for

    full = target_for("a", "team-a", spec, None, files_of())[0].spec.identity
    status = {"identity": pincheck.status_of(spec.identity, full, files_of())}
    facts = controller.pin_files.facts(spec, "team-a", status, True)  # nothing read by this operator
    assert facts is not None and dict(facts.values or ()) == dict(files_of().values or ())
    obj = {**two_pins(), "status": status}
    assert target_of(obj)[0].namespace_id is not None
    other = api.KVCacheNamespace.model_validate(two_pins(modelRevision="f" * 40)).spec
    assert controller.pin_files.facts(other, "team-a", status, True).values is None
    forged = {"identity": {"files": {**status["identity"]["files"], "numKVHeads": "eight"}}}
    assert controller.pin_files.facts(spec, "team-a", forged, True).values is None


def test_every_sample_keeps_its_id_whatever_the_files_say() -> None:
    from kvpersist.controller.decision import target_for

    odd = files_of({"hidden_size": 64, "num_attention_heads": 2, "max_position_embeddings": 7, "torch_dtype": "float16"})
    for name in ("nvme-minimal", "hf-bucket", "tp2-fp8"):
        spec = api.KVCacheNamespace.model_validate(sample(name)).spec
        assert pincheck.unset(spec.identity) == ()
        assert target_for("a", "team-a", spec, "0" * 16, odd)[1] == target_for("a", "team-a", spec, "0" * 16)[1]


def test_a_merge_patch_names_what_went_as_null() -> None:
    from kvpersist.api.status import merge_patch

    assert merge_patch({"pins": {"a": 1, "b": 2}, "files": {"at": "x"}}, {"pins": {"a": 1}}) == \
        {"files": None, "pins": {"b": None, "a": 1}}


class _Settled(pincheck.PinFiles):
    """One worker, and each request returns only once its check has ended: nothing runs when
    wait looks, as when the Hub's refusal is quicker than the caller."""

    def request(self, *args: Any, **kwargs: Any) -> bool:
        started = super().request(*args, **kwargs)
        if self._pool is not None:
            self._pool.submit(lambda: None).result(timeout=30)  # queued behind the check
        return started


def test_a_refusal_done_before_wait_looks_still_leads_to_the_tokens_read() -> None:
    """On 0958f5d wait returned when the anonymous read had already ended (nothing running), so
    a quick 403 left a gated model's first apply without the token's read (a flaky CI failure)."""
    from tests.integration.hub_stub import GOOD_TOKEN

    gated = "meta-llama/Gated"
    with HubStub() as hub:
        hub.models[(gated, QWEN_REV)] = {"config.json": json.dumps(CONFIG).encode(),
                                         "chat_template.jinja": TEMPLATE.encode()}
        hub.gated.add(gated)
        files = _Settled(lambda deadline, token: pincheck.hub_fetch(hub.url, deadline, token), workers=1)
        spec = api.KVCacheNamespace.model_validate(two_pins(modelId=gated)).spec
        spec = spec.model_copy(update={"vllm": spec.vllm.model_copy(update={
            "hf_token_secret_ref": HFTokenSecretRef(name="hf-reader")})})
        files.wait(spec.identity, lambda: None, timeout=30, token=(pincheck.scope_of(spec, "team-a"), lambda: GOOD_TOKEN))
        facts = files.facts(spec, "team-a", None, True)
        assert facts is not None and dict(facts.values or ())["num_kv_heads"] == 8, facts


def test_a_gated_model_is_read_with_the_resources_own_token_and_its_answer_is_that_namespaces_alone() -> None:
    """The stand-in Hub refuses meta-llama/Gated without its token (403 GatedRepo)."""
    from tests.integration.hub_stub import GOOD_TOKEN

    gated = "meta-llama/Gated"
    with HubStub() as hub:
        hub.models[(gated, QWEN_REV)] = {"config.json": json.dumps(CONFIG).encode(),
                                         "chat_template.jinja": TEMPLATE.encode()}
        hub.gated.add(gated)
        files = pincheck.PinFiles(lambda deadline, token: pincheck.hub_fetch(hub.url, deadline, token))
        mine = api.KVCacheNamespace.model_validate(two_pins(modelId=gated)).spec
        mine = mine.model_copy(update={"vllm": mine.vllm.model_copy(update={
            "hf_token_secret_ref": HFTokenSecretRef(name="hf-reader")})})
        theirs = api.KVCacheNamespace.model_validate(two_pins(modelId=gated)).spec  # names no token
        reads: list[str] = []

        def token() -> str:
            reads.append("read")
            return GOOD_TOKEN

        done = threading.Event()
        files.wait(mine.identity, done.set, timeout=30, token=(pincheck.scope_of(mine, "team-a"), token))
        facts = files.facts(mine, "team-a", None, True)
        assert facts is not None and dict(facts.values or ())["num_kv_heads"] == 8, facts
        assert reads == ["read"] and GOOD_TOKEN in hub.seen_tokens
        other = files.facts(theirs, "team-b", None, True)  # another tenant: the refusal, never the token's answer
        assert other is not None and other.values is None and "anonymously" in other.unread
        assert files.facts(mine, "team-b", None, True).values is None  # the same Secret's name elsewhere: not it
        wrong = pincheck.PinFiles(lambda deadline, token: pincheck.hub_fetch(hub.url, deadline, token))
        wrong.wait(mine.identity, lambda: None, timeout=30, token=(pincheck.scope_of(mine, "team-a"), lambda: "hf_wrong"))
        assert "hfTokenSecretRef's token" in wrong.facts(mine, "team-a", None, True).unread
