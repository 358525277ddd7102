"""The operator's policy for what a KVCacheNamespace may use: image prefixes (allowedImages) and
the label a named Secret must carry (secretLabel); and that a refused resource renders nothing."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest

from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.controller import kube, runtime, sharing, transitions
from kvpersist.controller.apply import apply_workloads
from kvpersist.controller.policy import (
    ALLOWED_IMAGES_ENV,
    CLUSTER_DOMAIN_ENV,
    IMAGE_NOT_ALLOWED,
    SECRET_LABEL_ENV,
    SECRET_NOT_ALLOWED,
    Policy,
    canonical_image,
    domain_in_resolv_conf,
    image_allowed,
    image_refusal,
    named_secrets,
    parse_allowed_images,
    parse_cluster_domain,
    parse_secret_label,
    refused_status,
    secret_refusal,
)
from kvpersist.status.conditions import condition
from tests.cases.invalid_manifests import sample, upstream_images

DIGEST = "@sha256:" + "a" * 64
LAB = ("registry.example.com/lmcache",)


@pytest.mark.parametrize(("image", "prefixes", "allowed"), [
    # empty list: any image (the default, today's behaviour)
    ("evil.example.com/x:latest", (), True),
    # a prefix without a trailing boundary matches whole components only
    ("registry.example.com/lmcache", LAB, True),
    ("registry.example.com/lmcache/server" + DIGEST, LAB, True),
    ("registry.example.com/lmcache:v1" + DIGEST, LAB, True),
    ("registry.example.com/lmcache" + DIGEST, LAB, True),
    ("registry.example.com/lmcache-evil/x" + DIGEST, LAB, False),
    ("registry.example.com/lmcachex" + DIGEST, LAB, False),
    ("registry.example.com/other/lmcache" + DIGEST, LAB, False),
    ("evil.example.com/registry.example.com/lmcache/x", LAB, False),
    # a prefix ending in / : or @ is matched as written
    ("registry.example.com/lmcache/server:v1", ("registry.example.com/lmcache/",), True),
    ("registry.example.com/lmcache", ("registry.example.com/lmcache/",), False),
    ("registry.example.com/lmcache/server:v1", ("registry.example.com/lmcache/server:",), True),
    ("registry.example.com/lmcache/server-evil:v1", ("registry.example.com/lmcache/server:",), False),
    ("registry.example.com/lmcache/server" + DIGEST, ("registry.example.com/lmcache/server@",), True),
    ("registry.example.com/lmcache/server:v1", ("registry.example.com/lmcache/server@",), False),
    # a bare registry host: / is its only boundary (host:port and host.evil are other registries)
    ("registry.example.com/anything/x", ("registry.example.com",), True),
    ("registry.example.com:5000/x", ("registry.example.com",), False),
    ("registry.example.com.evil.io/x", ("registry.example.com",), False),
    # a full reference admits exactly that image
    ("registry.example.com/lmcache/server" + DIGEST, ("registry.example.com/lmcache/server" + DIGEST,), True),
    ("registry.example.com/lmcache/server@sha256:" + "b" * 64, ("registry.example.com/lmcache/server" + DIGEST,), False),
    # Docker Hub's short names are compared in their full form too
    ("vllm/vllm-openai:v0.33.0" + DIGEST, ("docker.io/vllm/",), True),
    ("docker.io/vllm/vllm-openai:v0.33.0", ("vllm/vllm-openai",), False),  # a short prefix matches as written
    ("ubuntu:22.04", ("docker.io/library/ubuntu",), True),
    ("vllm-evil/vllm-openai", ("docker.io/vllm",), False),
    ("lmcache/vllm-openai-evil:v1", ("lmcache/vllm-openai",), False),
])
def test_image_prefixes_match_whole_components(image: str, prefixes: tuple[str, ...], allowed: bool) -> None:
    assert image_allowed(image, prefixes) is allowed


def test_canonical_image() -> None:
    assert canonical_image("vllm/vllm-openai:v1") == "docker.io/vllm/vllm-openai:v1"
    assert canonical_image("ubuntu") == "docker.io/library/ubuntu"
    assert canonical_image("docker.io/ubuntu") == "docker.io/library/ubuntu"
    assert canonical_image("index.docker.io/vllm/x") == "docker.io/vllm/x"
    assert canonical_image("localhost/x") == "localhost/x"
    assert canonical_image("localhost:5000/x") == "localhost:5000/x"
    assert canonical_image("registry.example.com/x") == "registry.example.com/x"


def test_image_refusal_names_the_field_image_prefixes_and_fix() -> None:
    spec = KVCacheNamespace.model_validate(upstream_images()).spec
    assert image_refusal(spec, ()) is None
    assert image_refusal(spec, ("docker.io/vllm/", "docker.io/lmcache/")) is None
    assert image_refusal(spec, ("docker.io/vllm/",)) is None  # vllm/ is docker.io/vllm/
    reason, message = image_refusal(spec, ("docker.io/lmcache/",))
    assert reason == IMAGE_NOT_ALLOWED
    assert "spec.image" in message and spec.image in message
    assert "docker.io/lmcache/" in message and "allowedImages" in message and "left as they are" in message


def test_parse_allowed_images() -> None:
    assert parse_allowed_images("") == ()
    assert parse_allowed_images(" a.io/x/, b.io/y  c.io ") == ("a.io/x/", "b.io/y", "c.io")
    with pytest.raises(ValueError, match=ALLOWED_IMAGES_ENV):
        parse_allowed_images("a.io/x/,/etc")


def test_parse_secret_label() -> None:
    assert parse_secret_label("") is None
    assert parse_secret_label("kvpersist.dev/usable-by=kvpersist") == ("kvpersist.dev/usable-by", "kvpersist")
    assert parse_secret_label("usable=") == ("usable", "")
    for bad in ("kvpersist.dev/usable-by", "-bad=x", "a=b c", "Bad.Prefix/x=y", "a=" + "v" * 64):
        with pytest.raises(ValueError, match=SECRET_LABEL_ENV):
            parse_secret_label(bad)


def test_policy_from_env(tmp_path: Path) -> None:
    none = tmp_path / "absent"
    policy = Policy.from_env({ALLOWED_IMAGES_ENV: "r.io/a/", SECRET_LABEL_ENV: "k=v"}, none)
    assert policy == Policy(("r.io/a/",), ("k", "v"))
    assert policy.generated_secret_labels() == {"k": "v"}
    assert Policy.from_env({}, none) == Policy() and Policy().generated_secret_labels() == {}


# What a kubelet writes into a pod of namespace ml with --cluster-domain=corp.example.
POD_RESOLV_CONF = "nameserver 10.96.0.10\nsearch ml.svc.corp.example svc.corp.example corp.example\noptions ndots:5\n"


def test_the_cluster_domain_is_read_from_the_pods_resolver_or_the_chart(tmp_path: Path) -> None:
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(POD_RESOLV_CONF)
    assert Policy.from_env({}, resolv).cluster_domain == "corp.example"
    assert Policy.from_env({CLUSTER_DOMAIN_ENV: "Cluster.Local."}, resolv).cluster_domain == "cluster.local"
    assert domain_in_resolv_conf("nameserver 1.1.1.1\nsearch example.com\n") is None  # no cluster DNS: unknown
    assert Policy.from_env({}, tmp_path / "absent").cluster_domain is None
    for bad in ("cluster local", "-x.local", "a..b", "x" * 64 + ".local"):
        with pytest.raises(ValueError, match=CLUSTER_DOMAIN_ENV):
            parse_cluster_domain(bad)


def test_vllm_names_its_server_absolutely_in_the_clusters_domain(tmp_path: Path) -> None:
    """A relative <route>.<ns>.svc (two dots, under ndots 5) is tried against the search list
    first, where <route>.<ns>.svc.svc.<domain> is the Service <route>.<ns> of a namespace named
    svc: whoever owns it would receive every vLLM's KV connection. The absolute name is never
    searched."""
    from kvpersist.builders.vllm import server_host
    from kvpersist.controller import decision

    resolv = tmp_path / "resolv.conf"
    resolv.write_text(POD_RESOLV_CONF)
    obj = sample("nvme-minimal")
    obj["metadata"]["namespace"] = "ml"
    snap = decision.Snapshot(body=obj, spec=KVCacheNamespace.model_validate(obj).spec, policy=Policy.from_env({}, resolv))
    target = decision._target(snap, None)
    host = server_host(target)
    assert host == f"{target.local_service_name}.{target.namespace}.svc.corp.example."
    assert host.endswith(".") and ".svc.svc." not in host


def _bucket_spec(key_ref: bool = True) -> Any:
    obj = sample("hf-bucket")
    if key_ref:
        obj["spec"]["l2"]["encryption"] = {"keySecretRef": {"name": "shared-key"}}
    return KVCacheNamespace.model_validate(obj).spec


def test_named_secrets_are_the_users_only() -> None:
    assert named_secrets(_bucket_spec()) == [("spec.l2.hfBucket.tokenSecretRef", "hf-kv-writer"),
                                             ("spec.l2.encryption.keySecretRef", "shared-key")]
    assert named_secrets(KVCacheNamespace.model_validate(sample()).spec) == []  # the generated key is the operator's
    off = sample()
    off["spec"]["l2"]["encryption"] = {"enabled": False, "keySecretRef": {"name": "unused"}}
    assert named_secrets(KVCacheNamespace.model_validate(off).spec) == []  # not mounted when L2 is plain



def test_the_vllm_pods_secrets_are_named_secrets_too() -> None:
    """secretLabel holds for every Secret a resource puts in a pod: the vLLM pod's tokens, its envFrom
    Secrets (not its ConfigMaps) and the pull Secrets."""
    obj = sample()
    obj["spec"]["vllm"].update(hfTokenSecretRef={"name": "hf-reader"}, apiKeySecretRef={"name": "vllm-api"},
                               envFrom=[{"configMapRef": {"name": "conf"}}, {"secretRef": {"name": "vllm-env"}}])
    obj["spec"]["imagePullSecrets"] = [{"name": "regcred"}]
    assert named_secrets(KVCacheNamespace.model_validate(obj).spec) == [
        ("spec.vllm.hfTokenSecretRef", "hf-reader"), ("spec.vllm.apiKeySecretRef", "vllm-api"),
        ("spec.vllm.envFrom[1].secretRef", "vllm-env"), ("spec.imagePullSecrets[0]", "regcred")]


def test_secret_refusal() -> None:
    label = ("kvpersist.dev/usable-by", "kvpersist")
    field = "spec.l2.encryption.keySecretRef"
    assert secret_refusal(field, "k", "ml", {"labels": {}}, None) is None  # no label required
    assert secret_refusal(field, "k", "ml", {"labels": {"kvpersist.dev/usable-by": "kvpersist"}}, label) is None
    for metadata in ({"labels": {"kvpersist.dev/usable-by": "other"}}, {"labels": None}, {}):
        reason, message = secret_refusal(field, "k", "ml", metadata, label)
        assert reason == SECRET_NOT_ALLOWED
        assert field in message and "Secret k" in message and "kvpersist.dev/usable-by=kvpersist" in message
        assert "kubectl label secret k -n ml kvpersist.dev/usable-by=kvpersist" in message
    reason, message = secret_refusal(field, "k", "ml", None, label)  # missing: not usable unchecked later
    assert reason == SECRET_NOT_ALLOWED and "does not exist" in message


def test_refused_status() -> None:
    conds = [condition("IdentityResolved", True, "PinsComplete"), condition("L2Ready", None, "NotMeasured"),
             condition("Ready", False, "ServersStarting")]
    fields, out = refused_status({"phase": "Pending"}, conds, (IMAGE_NOT_ALLOWED, "m"), 3)
    assert fields["phase"] == "Failed"
    assert [(c["type"], c["reason"]) for c in out] == [("IdentityResolved", "PinsComplete"), ("L2Ready", "NotMeasured"),
                                                       ("Ready", IMAGE_NOT_ALLOWED)]
    _fields, out = refused_status({}, conds, (SECRET_NOT_ALLOWED, "s"), 3)
    by_type = {c["type"]: c for c in out}
    assert by_type["L2Ready"]["reason"] == SECRET_NOT_ALLOWED and by_type["Ready"]["status"] == "False"


def _body(obj: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(obj)
    body["metadata"].update(namespace="ml", uid="u1", generation=1)
    return body


def test_a_refused_resource_renders_and_reads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """apply_workloads under a policy that refuses: no object applied or created (existing ones
    stay), no Secret data read; the same resource under an open policy is applied."""
    calls: list[str] = []
    monkeypatch.setattr(kube, "apply", lambda m: calls.append(f"apply {m['kind']}") or m)
    monkeypatch.setattr(kube, "create_if_absent", lambda m: calls.append(f"create {m['kind']}") or m)
    monkeypatch.setattr(kube, "get", lambda *a: calls.append(f"get {a[1]} {a[2]}"))
    # The Secrets named exist (unlabelled); the agent token does not yet (the operator makes it), nor
    # any other object under its names.
    monkeypatch.setattr(kube, "get_metadata", lambda *a: calls.append(f"metadata {a[1]} {a[2]}") or (
        None if a[1] != "Secret" or a[2].endswith("-agent-token") else {}))
    monkeypatch.setattr(kube, "post_event", lambda *a: None)
    monkeypatch.setattr(kube, "list_all", lambda *a, **kw: [])  # no other user of its claim, no route in the way
    monkeypatch.setattr(kube, "named_metadata", lambda *a: None)  # no object under its names yet
    monkeypatch.setattr(runtime.CONTROLLER, "policy", Policy(allowed_images=("registry.example.com/",)))
    body = _body(upstream_images())
    key = ("ml", body["metadata"]["name"])
    runtime.CONTROLLER.state(key)  # known, as after its first watch event
    apply_workloads(body, logging.getLogger("test"))
    assert calls == [] and runtime.CONTROLLER.state(key).applied[1].refusal[0] == IMAGE_NOT_ALLOWED

    obj = sample()
    obj["spec"]["l2"]["encryption"] = {"keySecretRef": {"name": "shared-key"}}
    monkeypatch.setattr(runtime.CONTROLLER, "policy", Policy(secret_label=("kvpersist.dev/usable-by", "kvpersist")))
    apply_workloads(_body(obj), logging.getLogger("test"))
    assert calls == ["metadata Secret shared-key"] and runtime.CONTROLLER.state(key).applied[1].refusal[0] == SECRET_NOT_ALLOWED

    calls.clear()
    monkeypatch.setattr(runtime.CONTROLLER, "policy", Policy(allowed_images=("docker.io/vllm/", "lmcache/"),
                                                   secret_label=("kvpersist.dev/usable-by", "kvpersist")))
    created: list[dict[str, Any]] = []
    monkeypatch.setattr(kube, "create_if_absent", lambda m: created.append(m) or m)
    apply_workloads(body, logging.getLogger("test"))
    assert runtime.CONTROLLER.state(key).applied[1].refusal is None
    assert {"apply StatefulSet", "apply Deployment"} <= set(calls)
    # The operator's own Secrets carry the label, so they are usable under the same rule.
    assert {s["metadata"]["name"] for s in created} == {"llama31-8b-l2-key", "llama31-8b-agent-token"}
    assert all(s["metadata"]["labels"]["kvpersist.dev/usable-by"] == "kvpersist" for s in created)
    runtime.CONTROLLER.forget(key)


def test_refusal_event_is_posted_once_with_its_reason() -> None:
    ready = condition("Ready", False, IMAGE_NOT_ALLOWED, "spec.image: ...")
    new = {"phase": "Failed", "conditions": [ready]}
    events = transitions.events_for({"phase": "Pending"}, new, [ready])
    assert events == [("Warning", IMAGE_NOT_ALLOWED, "spec.image: ...")]  # not also a generic Failed
    assert transitions.events_for(new, new, [ready]) == []
    other = condition("Ready", False, SECRET_NOT_ALLOWED, "spec.l2...: ...")
    assert transitions.events_for(new, {**new, "conditions": [other]}, [other]) == [("Warning", SECRET_NOT_ALLOWED,
                                                                                     "spec.l2...: ...")]


def test_storage_released_only_once_the_store_is_no_longer_held() -> None:
    """A status written for another reason while Ready stays StorageInUse says nothing of the store;
    StorageReleased comes when Ready leaves StorageInUse."""
    held = condition("Ready", False, sharing.STORAGE_IN_USE, "spec.l2.nvme: held by ns/other")
    old = {"phase": "CacheDisabled", "conditions": [held]}
    assert transitions.events_for(old, {**old, "observedGeneration": 2}, [held]) == []
    ready = condition("Ready", True, "Ready", "")
    events = transitions.events_for(old, {"phase": "Ready", "conditions": [ready]}, [ready])
    assert sharing.RELEASED in [reason for _, reason, _ in events]


def test_a_malformed_value_stops_the_operator_at_start(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A typo in secretLabel must not start an operator that admits every Secret."""
    import kopf

    from kvpersist import cli

    monkeypatch.setattr(kopf, "run", lambda **_: pytest.fail("kopf.run reached with a malformed policy"))
    monkeypatch.setenv(SECRET_LABEL_ENV, "kvpersist.dev/usable-by")
    assert cli.main(["run", "--standalone"]) == 2
    assert SECRET_LABEL_ENV in capsys.readouterr().err and runtime.CONTROLLER.policy == Policy()


def test_the_operator_refuses_to_start_when_it_cannot_tell_the_cluster_domain(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from kvpersist import cli
    from kvpersist.controller import policy

    monkeypatch.delenv(CLUSTER_DOMAIN_ENV, raising=False)
    monkeypatch.setattr(policy, "RESOLV_CONF", tmp_path / "absent")
    assert cli.main(["run", "--standalone"]) == 2
    err = capsys.readouterr().err
    assert "cluster's DNS domain is unknown" in err and "clusterDomain" in err
