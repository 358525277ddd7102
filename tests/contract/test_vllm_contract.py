"""vLLM accepts what the operator renders: every vLLM launch line the builder produces is parsed
by vLLM 0.33.0's own `vllm serve` parser, turned into its engine args and validated by its config
classes, and must carry exactly the pinned identity. Runs on CPU (vLLM's CPU platform)."""

from __future__ import annotations

import argparse
import itertools
from typing import Any, get_args

import pytest
from pydantic import ValidationError

from kvpersist.api.identity import BLOCK_SIZES, KV_CACHE_DTYPES, Identity
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.target import Target
from kvpersist.builders.vllm import CONNECTOR_MODULES, vllm_args
from kvpersist.identity import key_fingerprint, resolve
from tests.cases.invalid_manifests import SAMPLES, sample

pytestmark = pytest.mark.contract
# vLLM's --kv-cache-dtype values that KV_CACHE_DTYPES leaves out, and why.
UNRESOLVED_KV_CACHE_DTYPES = {
    "auto": "follows the model's dtype, which the pins do not name",
    "fp8": "means fp8_e4m3 on CUDA but e4m3fnuz on ROCm: name fp8_e4m3 or fp8_e5m2",
}


@pytest.fixture(scope="module")
def vllm() -> Any:
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()  # no GPU here: vLLM's parser needs a platform
    return vllm


def _parse(args: list[str]) -> tuple[argparse.Namespace, Any]:
    """As `vllm serve ...` does: its subcommand parser, its validation, its engine args."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    ns = parser.parse_args(args)
    serve.validate(ns)
    if ns.model_tag is not None:  # what ServeSubcommand.cmd does before building the engine args
        ns.model = ns.model_tag
    return ns, AsyncEngineArgs.from_cli_args(ns)


def _validate(engine: Any) -> None:
    """The values, checked by vLLM's config classes (the parser alone accepts --kv-cache-dtype float99)."""
    from vllm.config import CacheConfig

    CacheConfig(block_size=engine.block_size, cache_dtype=engine.kv_cache_dtype)


def _target(obj: dict) -> Target:
    spec = KVCacheNamespace.model_validate(obj).spec
    return Target(obj["metadata"]["name"], "ml", spec, resolve(spec.pins(key_fingerprint(b"k" * 32))).namespace_id)


def _check(target: Target) -> None:
    ns, engine = _parse(vllm_args(target))
    _validate(engine)
    ident = target.spec.identity
    pins = ident.resolved()  # the tokenizer defaults to the model's own, at its revision
    assert ns.subparser == "serve"
    assert engine.model == ident.model_id and engine.revision == ident.model_revision
    assert engine.tokenizer == pins["tokenizer"] and engine.tokenizer_revision == pins["tokenizer_revision"]
    assert engine.kv_cache_dtype == ident.kv_cache_dtype and engine.block_size == ident.block_size
    assert engine.tensor_parallel_size == ident.tensor_parallel_size and engine.max_model_len == ident.max_model_len
    kv = engine.kv_transfer_config
    if target.cache_enabled:
        assert type(kv).__name__ == "KVTransferConfig"
        assert kv.kv_connector == pins["connector"] == "LMCacheMPConnector"
        assert kv.kv_connector_module_path == CONNECTOR_MODULES["LMCacheMPConnector"] and kv.kv_role == "kv_both"
    else:
        assert kv is None


@pytest.mark.parametrize("name", sorted(p.stem for p in SAMPLES.glob("*.yaml")))
def test_every_sample_launch_parses_and_carries_the_pins(vllm: Any, name: str) -> None:
    _check(_target(sample(name)))


PIN_TABLE = (
    [{"kvCacheDtype": d} for d in KV_CACHE_DTYPES]
    + [{"blockSize": b} for b in BLOCK_SIZES]
    + [{"tensorParallelSize": tp, "gpus": tp} for tp in (1, 2, 4, 8)]
    + [{"maxModelLen": n} for n in (2048, 32768, 131072)]
    + [{"kvCacheDtype": d, "blockSize": b} for d, b in itertools.product(("bfloat16", "fp8_e5m2"), (8, 128))]
)


@pytest.mark.parametrize("pins", PIN_TABLE, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_pin_table_launches_parse(vllm: Any, pins: dict) -> None:
    obj = sample()
    pins = dict(pins)
    gpus = pins.pop("gpus", None)
    obj["spec"]["identity"].update(pins)
    if gpus:
        obj["spec"]["vllm"]["gpusPerReplica"] = gpus
    _check(_target(obj))


def test_cache_disabled_launch_parses_without_connector(vllm: Any) -> None:
    obj = sample()
    del obj["spec"]["identity"]["chatTemplateDigest"]
    target = _target(obj)
    assert not target.cache_enabled
    _check(target)


def test_kv_dtype_enum_is_vllms_less_the_unresolved(vllm: Any) -> None:
    from vllm.config.cache import CacheDType

    accepted = set(get_args(CacheDType))
    assert set(KV_CACHE_DTYPES) | set(UNRESOLVED_KV_CACHE_DTYPES) == accepted, (
        "vLLM's --kv-cache-dtype values changed: add the new resolved ones to KV_CACHE_DTYPES, regenerate the CRD")
    assert not set(KV_CACHE_DTYPES) & set(UNRESOLVED_KV_CACHE_DTYPES)


def test_block_size_enum_is_accepted_by_vllm(vllm: Any) -> None:
    for block in BLOCK_SIZES:
        _validate(type("E", (), {"block_size": block, "kv_cache_dtype": "bfloat16"}))


@pytest.mark.parametrize(("pin", "value"), [("kv_cache_dtype", "float99"), ("block_size", 0), ("tensor_parallel_size", 0)])
def test_values_vllm_refuses_are_refused_first(vllm: Any, pin: str, value: Any) -> None:
    from vllm.config import CacheConfig, ParallelConfig

    with pytest.raises((ValidationError, ValueError)):
        if pin == "tensor_parallel_size":
            ParallelConfig(tensor_parallel_size=value)
        else:
            CacheConfig(**({"cache_dtype": value, "block_size": 16} if pin == "kv_cache_dtype" else {"block_size": value}))
    alias = {"kv_cache_dtype": "kvCacheDtype", "block_size": "blockSize", "tensor_parallel_size": "tensorParallelSize"}[pin]
    with pytest.raises(ValidationError) as info:
        Identity.model_validate({**sample()["spec"]["identity"], alias: value})
    assert [e["loc"][0] for e in info.value.errors()] == [alias]  # refused, naming the same field


def test_connector_module_defines_the_connector(vllm: Any) -> None:
    import importlib

    module = importlib.import_module(CONNECTOR_MODULES["LMCacheMPConnector"])
    assert module.LMCacheMPConnector.__name__ == "LMCacheMPConnector"


@pytest.mark.parametrize("replay", [None, 5558])
def test_kv_events_launch_parses_into_vllms_events_config(vllm: Any, replay: int | None) -> None:
    """spec.vllm.kvEvents as vLLM reads it: its KVEventsConfig, a ZMQ publisher bound on every
    interface (ZmqEventPublisher binds an endpoint with `*`), topic the namespace id."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    obj = sample()
    obj["spec"]["vllm"]["kvEvents"] = {"enabled": True, **({"replayPort": replay} if replay else {})}
    target = _target(obj)
    _check(target)
    _ns, engine = _parse(vllm_args(target))
    events = engine.kv_events_config
    assert events.enable_kv_cache_events and events.publisher == "zmq" and events.topic == target.namespace_id
    assert events.endpoint == "tcp://*:5557" and ZmqEventPublisher._is_bind_endpoint(events.endpoint)
    assert events.replay_endpoint == (f"tcp://*:{replay}" if replay else None)
