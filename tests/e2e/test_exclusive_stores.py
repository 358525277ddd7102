"""Persisted KV is never shared by two writers, nor routed to another identity, by accident: the
real API server, the real operator process, resources side by side.

- Two KVCacheNamespaces naming one existingClaimName (one namespace), or one bucket prefix with
  the same namespace id (two namespaces): the second is refused (StorageInUse, naming the first;
  its servers at zero, vLLM without the cache), steadily, and takes over once the first is gone.
- A route object of another namespace id already under the id's route name (8 hex of the id): it
  is never applied over; vLLM goes without the cache until the operator has deleted it.
- An earlier version's connection ConfigMap, the resource's own, is deleted (none is made now).
- With the cache off, or while another id holds the route name, `<name>-lmcache` is every server's
  agent-port policy, without ZMQ; the id's own policy replaces it once the route is free.
Pods are not run (none is needed: what is under test is what the operator writes).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cases.invalid_manifests import sample
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import stop, target_of

pytestmark = pytest.mark.e2e
NSID = "kvpersist.dev/namespace-id"
HOLD_S = 25.0  # over two status intervals (10 s): long enough to see a refusal flap, were it to


def start_operator(kubeconfig: Path, namespaces: list[str], log: Path) -> subprocess.Popen:
    """`kvpersist run` watching these namespaces (operator_env.start_operator takes one)."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KVPERSIST_STRICT_STATUS": "1"}
    args = [a for ns in namespaces for a in ("--namespace", ns)]
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "kvpersist.cli", "run", "--standalone", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.fixture()
def namespaces(kubectl: Kubectl, crd: None, tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """Two fresh namespaces and one operator watching both; its log path."""
    names = [f"e2e-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for ns in names:
        kubectl.run("create", "namespace", ns)
    log = tmp_path / "operator.log"
    proc = start_operator(kubectl.kubeconfig, names, log)
    try:
        yield names[0], names[1], log
    finally:
        stop(proc)
        for ns in names:
            kubectl.run("delete", "namespace", ns, "--wait=false", check=False)


def resource(ns: str, name: str, l2: dict[str, Any] | None = None, **identity: Any) -> dict[str, Any]:
    """The sample, plain L2 (no key Secret to make or read), no vLLM replica unless asked."""
    obj = copy.deepcopy(sample("hf-bucket" if l2 and "hfBucket" in l2 else "nvme-minimal"))
    obj["metadata"] = {"name": name, "namespace": ns}
    obj["spec"]["l1"]["size"] = "256Mi"
    if l2 is not None:
        obj["spec"]["l2"] = l2
    obj["spec"]["l2"]["encryption"] = {"enabled": False}
    obj["spec"]["identity"].update(identity)
    obj["spec"]["vllm"]["replicas"] = 0
    return obj


def kvns(kubectl: Kubectl, ns: str, name: str) -> dict[str, Any]:
    return kubectl.get("kvns", name, ns)


def cond(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def replicas(kubectl: Kubectl, ns: str, name: str) -> int | None:
    found = kubectl.run("get", "statefulset", f"{name}-lmcache", "-n", ns, "-o", "jsonpath={.spec.replicas}", check=False)
    return int(found.stdout) if found.returncode == 0 and found.stdout.strip() else None


def events(kubectl: Kubectl, ns: str, reason: str, name: str) -> list[str]:
    out = kubectl.get("events", namespace=ns)["items"]
    return [e["message"] for e in out if e.get("reason") == reason and e["involvedObject"].get("name") == name]


def refused_steadily(kubectl: Kubectl, ns: str, name: str, holder: str) -> None:
    """StorageInUse naming the holder, servers at zero, on every look for HOLD_S: no flap."""
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:
        obj = kvns(kubectl, ns, name)
        ready = cond(obj, "Ready")
        assert ready.get("reason") == "StorageInUse" and holder in ready.get("message", ""), ready
        assert obj["status"]["phase"] == "CacheDisabled" and replicas(kubectl, ns, name) == 0
        time.sleep(1.0)


def test_two_resources_on_one_claim_the_second_waits_for_the_first(kubectl: Kubectl,
                                                                    namespaces: tuple[str, str, Path]) -> None:
    ns, _other, log = namespaces
    claim = {"nvme": {"existingClaimName": "shared-data", "maxCapacity": "1Gi"}}
    kubectl.apply(resource(ns, "first", claim))
    wait_for("first to serve its claim", lambda: replicas(kubectl, ns, "first") == 1
             and (kvns(kubectl, ns, "first").get("status") or {}).get("namespaceId"), timeout=90)
    time.sleep(1.1)  # creationTimestamp has whole seconds: second is younger, not a tie
    # Other pins, so another namespace id: one volume is one store whatever the ids (one disk,
    # and each agent holds its folder to its own capacity, with no idea of the other's).
    kubectl.apply(resource(ns, "second", claim, maxModelLen=16384))
    second = wait_for("second to be refused", lambda: (o := kvns(kubectl, ns, "second")) and cond(o, "Ready").get(
        "reason") == "StorageInUse" and o, timeout=90)
    message = cond(second, "Ready")["message"]
    assert f"{ns}/first" in message and "claim shared-data" in message and "existingClaimName" in message, message
    assert cond(second, "L2Ready")["reason"] == "StorageInUse" and cond(second, "IdentityResolved")["status"] == "True"
    assert second["status"]["namespaceId"] != kvns(kubectl, ns, "first")["status"]["namespaceId"]
    wait_for("a StorageInUse event", lambda: events(kubectl, ns, "StorageInUse", "second"), timeout=30)
    refused_steadily(kubectl, ns, "second", f"{ns}/first")
    assert replicas(kubectl, ns, "first") == 1  # the first is untouched throughout
    assert "StorageInUse" not in json.dumps(kvns(kubectl, ns, "first")["status"]["conditions"])

    kubectl.run("delete", "kvns", "first", "-n", ns)
    wait_for("second to take the claim over", lambda: replicas(kubectl, ns, "second") == 1
             and cond(kvns(kubectl, ns, "second"), "Ready").get("reason") != "StorageInUse", timeout=120)
    wait_for("a StorageReleased event", lambda: events(kubectl, ns, "StorageReleased", "second"), timeout=30)
    assert "Traceback" not in log.read_text()


def test_one_bucket_prefix_and_id_in_two_namespaces_is_one_store(kubectl: Kubectl,
                                                                  namespaces: tuple[str, str, Path]) -> None:
    ns_a, ns_b, log = namespaces
    bucket = {"hfBucket": {"bucketHandle": "hf://buckets/acme-ml/kv-cache/shared", "tokenSecretRef": {"name": "hf"},
                           "maxCapacity": "1Gi"}}
    kubectl.apply(resource(ns_a, "team-a", bucket))
    first = wait_for("team-a's namespace id", lambda: (kvns(kubectl, ns_a, "team-a").get("status") or {}).get(
        "namespaceId"), timeout=90)
    time.sleep(1.1)
    kubectl.apply(resource(ns_b, "team-b", bucket))  # the same pins, the same id, the same prefix
    second = wait_for("team-b to be refused", lambda: (o := kvns(kubectl, ns_b, "team-b")) and cond(o, "Ready").get(
        "reason") == "StorageInUse" and o, timeout=90)
    message = cond(second, "Ready")["message"]
    assert f"{ns_a}/team-a" in message and f"hf://buckets/acme-ml/kv-cache/shared/{first}" in message, message
    refused_steadily(kubectl, ns_b, "team-b", f"{ns_a}/team-a")
    assert replicas(kubectl, ns_a, "team-a") == 1
    # Another id under the same prefix is another prefix: both serve.
    kubectl.apply(resource(ns_b, "team-c", bucket, maxModelLen=16384))
    wait_for("team-c to serve", lambda: replicas(kubectl, ns_b, "team-c") == 1
             and (kvns(kubectl, ns_b, "team-c").get("status") or {}).get("namespaceId"), timeout=90)
    assert cond(kvns(kubectl, ns_b, "team-c"), "Ready").get("reason") != "StorageInUse"
    kubectl.run("delete", "kvns", "team-a", "-n", ns_a)
    wait_for("team-b to take the prefix over", lambda: replicas(kubectl, ns_b, "team-b") == 1
             and cond(kvns(kubectl, ns_b, "team-b"), "Ready").get("reason") != "StorageInUse", timeout=120)
    assert "Traceback" not in log.read_text()


def test_a_route_name_another_id_holds_is_never_re_pointed(kubectl: Kubectl, namespaces: tuple[str, str, Path]) -> None:
    ns, _other, log = namespaces
    obj = resource(ns, "routed")
    obj["spec"]["vllm"]["replicas"] = 1
    t = target_of(obj)
    assert t.namespace_id
    name = t.per_id_name(t.namespace_id)
    twin = t.namespace_id[:12] + ("0" * 24 if t.namespace_id[12:] != "0" * 24 else "1" * 24)  # the same 8 hex
    assert t.per_id_name(twin) == name
    labels = {"app.kubernetes.io/name": "kvpersist", "app.kubernetes.io/managed-by": "kvpersist",
              "app.kubernetes.io/instance": "routed"}
    # The resource first with the cache off (vLLM by tag: no namespace id, no per-id route), so that
    # what an earlier id left can carry its owner reference, as everything the operator made does
    # (an object under its names without one is not its own: kvpersist.controller.ownership).
    unpinned = copy.deepcopy(obj)
    unpinned["spec"]["image"] = "vllm/vllm-openai:v0.33.0"
    kubectl.apply(unpinned)
    wait_for("the cache-off apply", lambda: kubectl.run("get", "networkpolicy", "routed-lmcache", "-n", ns,
                                                         check=False).returncode == 0, timeout=60)
    uid = kvns(kubectl, ns, "routed")["metadata"]["uid"]
    owner = [{"apiVersion": "kvpersist.dev/v1alpha1", "kind": "KVCacheNamespace", "name": "routed", "uid": uid,
              "controller": True, "blockOwnerDeletion": True}]
    # What an earlier id of this resource left: a vLLM pod still running under it, and its Service (the
    # pod first: a route of an id no pod uses is stale, and the operator deletes it at once).
    kubectl.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "routed-vllm-old", "namespace": ns, "labels": {
        **labels, "app.kubernetes.io/component": "vllm", NSID: twin}}, "spec": {
        "nodeSelector": {"kvpersist.dev/no-such-node": "true"}, "containers": [{"name": "vllm", "image": "vllm@sha256:"
                                                                                  + "0" * 64}]}})
    kubectl.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns, "labels": {
        **labels, "app.kubernetes.io/component": "lmcache-server", NSID: twin}, "ownerReferences": owner}, "spec": {
        "selector": {**labels, "app.kubernetes.io/component": "lmcache-server", NSID: twin},
        "ports": [{"name": "zmq", "port": 5555, "targetPort": "zmq"}]}})
    planted = kubectl.get("service", name, ns)
    # And the connection ConfigMap as an earlier operator wrote it (with the config "for other clients"
    # as one before that did): the resource's own, deleted by this one.
    kubectl.run("apply", "--server-side", "--field-manager=kvpersist", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "routed-connection", "namespace": ns, "labels": {
            **labels, "app.kubernetes.io/component": "lmcache-server"}, "ownerReferences": owner},
        "data": {"kv-transfer-config.json": '{"kv_connector":"LMCacheMPConnector"}', "namespace-id": twin,
                 "cache": "enabled"}}))
    kubectl.apply(obj)

    bypass = wait_for("CacheBypassed RouteNameTaken", lambda: cond(kvns(kubectl, ns, "routed"), "CacheBypassed").get(
        "reason") == "RouteNameTaken" and cond(kvns(kubectl, ns, "routed"), "CacheBypassed"), timeout=90)
    assert name in bypass["message"] and twin in bypass["message"], bypass
    deadline = time.monotonic() + HOLD_S
    while time.monotonic() < deadline:  # applied again and again (drift, refreshes): never over the twin's route
        svc = kubectl.get("service", name, ns)
        assert svc["metadata"]["uid"] == planted["metadata"]["uid"]
        assert svc["spec"]["selector"][NSID] == twin and svc["metadata"]["labels"][NSID] == twin, svc["spec"]
        assert kubectl.run("get", "networkpolicy", name, "-n", ns, check=False).returncode != 0  # no per-id policy either
        agent_only = kubectl.get("networkpolicy", "routed-lmcache", ns)  # but every server's agent-port one
        assert 5555 not in [port["port"] for rule in agent_only["spec"].get("ingress") or [] for port in rule["ports"]]
        dep = kubectl.get("deployment", "routed-vllm", ns)
        assert "--kv-transfer-config" not in dep["spec"]["template"]["spec"]["containers"][0]["args"]
        time.sleep(1.0)
    assert kubectl.run("get", "configmap", "routed-connection", "-n", ns, check=False).returncode != 0
    assert "deleted ConfigMap routed-connection" in log.read_text()

    kubectl.run("delete", "pod", "routed-vllm-old", "-n", ns, "--grace-period=0", "--force")
    mine = wait_for("the id's own Service", lambda: (s := kubectl.get("services", namespace=ns)["items"]) and next(
        (x for x in s if x["metadata"]["name"] == name and x["spec"]["selector"].get(NSID) == t.namespace_id), None),
        timeout=120)
    assert mine["metadata"]["uid"] != planted["metadata"]["uid"]  # deleted (stale), then made anew: never re-pointed
    wait_for("vLLM with the cache, through it", lambda: any(name in a for a in kubectl.get(
        "deployment", "routed-vllm", ns)["spec"]["template"]["spec"]["containers"][0]["args"]), timeout=60)
    wait_for("CacheBypassed gone", lambda: not cond(kvns(kubectl, ns, "routed"), "CacheBypassed"), timeout=60)
    assert kubectl.get("networkpolicy", name, ns)["spec"]["podSelector"]["matchLabels"][NSID] == t.namespace_id
    wait_for("every server's agent-port policy gone", lambda: kubectl.run(
        "get", "networkpolicy", "routed-lmcache", "-n", ns, check=False).returncode != 0, timeout=60)
    assert "Traceback" not in log.read_text()


def test_with_the_cache_off_the_admin_port_policy_has_its_name_alone(kubectl: Kubectl,
                                                                     namespaces: tuple[str, str, Path]) -> None:
    ns, _other, _log = namespaces
    obj = resource(ns, "off")
    del obj["spec"]["identity"]["chatTemplateDigest"]  # a missing pin: the cache off
    kubectl.apply(obj)
    wait_for("CacheDisabled", lambda: (kvns(kubectl, ns, "off").get("status") or {}).get("phase") == "CacheDisabled",
             timeout=90)
    policies = [p for p in kubectl.get("networkpolicies", namespace=ns)["items"]
                if p["metadata"]["labels"].get("app.kubernetes.io/instance") == "off"]
    assert [p["metadata"]["name"] for p in policies] == ["off-lmcache"]
    ports = [port["port"] for rule in policies[0]["spec"].get("ingress") or [] for port in rule["ports"]]
    assert 5555 not in ports  # no ZMQ rule: no namespace id's vLLM pods to admit
    assert not (kvns(kubectl, ns, "off").get("status") or {}).get("namespaceId")  # the cache off, as status says
