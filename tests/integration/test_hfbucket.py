"""The hfbucket L2 wiring: lmcache's own parser accepts what the operator renders, the token
travels only as an env var from the Secret, and the operator's preflight maps the Hub's answers
to clear reasons.

No Hugging Face endpoint is reachable from these machines, so nothing here uploads: the
preflight's error handling is tested at the HTTP level against tests/integration/hub_stub.py,
a local server answering as the Hub does for these cases (labelled a stand-in)."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from kvpersist.builders.all import build_all
from kvpersist.builders.lmcache import server_args
from kvpersist.builders.target import HF_TOKEN_ENV
from kvpersist.inventory import bucket
from tests.integration.conftest import make_target
from tests.integration.hub_stub import GOOD_TOKEN, HubStub

pytestmark = pytest.mark.datapath
REF = "Secret hf-kv-writer key token"


def _lmcache_parse(args: list[str]):
    """The `lmcache server` command's own argument parser and config builders."""
    from lmcache.cli.commands.server import ServerCommand
    from lmcache.v1.distributed.config import parse_args_to_config
    from lmcache.v1.multiprocess.config import parse_args_to_http_frontend_config, parse_args_to_mp_server_config

    parser = argparse.ArgumentParser()
    ServerCommand().add_arguments(parser)
    ns = parser.parse_args(args)
    return parse_args_to_config(ns), parse_args_to_mp_server_config(ns), parse_args_to_http_frontend_config(ns)


@pytest.mark.parametrize("sample_name", ["nvme-minimal", "hf-bucket", "tp2-fp8"])
def test_lmcache_parser_accepts_rendered_args(sample_name: str) -> None:
    target = make_target(sample_name)
    storage, mp, http = _lmcache_parse(server_args(target)[1:])  # without the "server" subcommand
    adapters = storage.l2_adapter_config.adapters
    assert len(adapters) == 1
    cfg = adapters[0]
    assert cfg.eviction_config is not None and cfg.eviction_config.eviction_policy == target.spec.eviction.policy
    assert http.http_port == target.spec.lmcache_server.http_port and mp.port == target.spec.lmcache_server.port
    if sample_name == "hf-bucket":
        assert type(cfg).__name__ == "HFBucketL2AdapterConfig"
        assert cfg.token_env == HF_TOKEN_ENV and cfg.token is None and cfg.shared is True
        assert cfg.bucket_handle.endswith("/" + str(target.namespace_id))
        assert cfg.bucket_location is not None
    else:
        assert cfg.persist_config.persist_enabled is True


def test_token_only_through_secret_env() -> None:
    target = make_target("hf-bucket")
    objs = build_all(target)
    text = json.dumps(objs)
    assert "hf_" not in text and '"token":' not in text
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    env = sts["spec"]["template"]["spec"]["containers"][0]["env"]
    token_env = [e for e in env if e["name"] == HF_TOKEN_ENV]
    assert token_env == [{"name": HF_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": "hf-kv-writer", "key": "token"}}}]
    assert not [o for o in objs if o["kind"] == "ConfigMap"]  # none made: the token in none either


@pytest.fixture()
def hub():
    with HubStub(existing={"acme-ml/kv-cache"}, delay=5.0) as stub:
        yield stub


@pytest.mark.parametrize(
    ("handle", "token", "create", "ok", "reason"),
    [
        ("hf://buckets/acme-ml/kv-cache/prod", GOOD_TOKEN, False, True, "BucketReachable"),
        ("hf://buckets/acme-ml/missing", GOOD_TOKEN, False, False, "BucketNotFound"),
        ("hf://buckets/acme-ml/new-one/prod", GOOD_TOKEN, True, True, "BucketCreated"),
        ("hf://buckets/acme-ml/kv-cache", "hf_wrong_token_abcdef", False, False, "TokenRejected"),
        ("hf://buckets/readonly-org/kv", GOOD_TOKEN, True, False, "TokenForbidden"),
    ],
)
def test_preflight_against_hub_stub(hub: HubStub, handle: str, token: str, create: bool, ok: bool, reason: str) -> None:
    result = bucket.preflight_bucket(handle, token, create, REF, endpoint=hub.url)
    assert (result.ok, result.reason) == (ok, reason), result.message
    assert token not in result.message and GOOD_TOKEN not in result.message
    assert hub.seen_tokens and set(hub.seen_tokens) == {token}  # the token went to the Hub, and only there
    if reason == "BucketCreated":
        assert ("POST", "/api/buckets/acme-ml/new-one") in hub.requests and "acme-ml/new-one" in hub.existing
    if reason == "BucketNotFound":
        assert "createBucketIfMissing" in result.message


def test_preflight_unreachable_hub_is_a_reason_not_a_crash() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        result = bucket.preflight_bucket("hf://buckets/acme-ml/kv-cache", GOOD_TOKEN, False, REF,
                                           endpoint=f"http://127.0.0.1:{port}")
    assert (result.ok, result.reason) == (False, "HubUnreachable")


def test_preflight_is_bounded_in_time(hub: HubStub, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    monkeypatch.setattr(bucket, "PREFLIGHT_TIMEOUT_S", 1.0)
    monkeypatch.setattr(bucket, "_client_bounded", False)
    t0 = time.monotonic()
    result = bucket.preflight_bucket("hf://buckets/slow/bucket", GOOD_TOKEN, False, REF, endpoint=hub.url)
    assert time.monotonic() - t0 < 4.0
    assert result.reason == "HubUnreachable"
    monkeypatch.setattr(bucket, "_client_bounded", False)  # the next user re-binds with the real bound


def test_split_handle() -> None:
    assert bucket.split_handle("hf://buckets/acme-ml/kv-cache/prod/x") == ("acme-ml/kv-cache", "prod/x")
    with pytest.raises(ValueError, match="not a bucket handle"):
        bucket.split_handle("s3://acme/kv")
