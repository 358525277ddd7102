"""The operator end to end: a KVCacheNamespace becomes real workloads on the local cluster, kwok
runs the pods, and each lmcache-server pod is backed by a real `lmcache server` process on the
pod's loopback IP (hack/kubelet_runner.py), so status shows what the real server reports.

One scenario, in order: apply -> Ready with usage; KV stored grows usage; L1 change rolls out;
a pin change moves to a new namespace without touching the old files; delete keeps the claim.
"""

from __future__ import annotations

import base64
import json
import shutil
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.builders.lmcache import server_args
from kvpersist.builders.vllm import vllm_args
from kvpersist.identity import key_fingerprint
from kvpersist.inventory.volume import is_chunk_name
from kvpersist.l2backends.nvme import framed_disk_share
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, REAL_NODE, bench_store, in_pod, kvpersist_env, manifest, start_operator, stop, target_of
from tests.fsstate import files_state

pytestmark = [pytest.mark.e2e, pytest.mark.datapath]


LMCACHE = shutil.which("lmcache")


def kvns_status(k: Kubectl, ns: str) -> dict:
    return k.get("kvns", NAME, ns).get("status") or {}


@pytest.fixture(scope="module")
def scenario(kubectl: Kubectl, crd: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if LMCACHE is None:
        pytest.fail("lmcache not on PATH: run through hack/test.sh (installs the datapath extra)")
    with kvpersist_env(kubectl, tmp_path_factory.mktemp("reconcile")) as env:
        yield {"ns": env.ns, "work": env.work, "runner": env.runner, "env": env}


def test_apply_becomes_workloads_and_ready(kubectl: Kubectl, scenario: dict) -> None:
    ns = scenario["ns"]
    obj = manifest(ns)
    kubectl.apply(obj)
    t = target_of(obj, kubectl)
    status = wait_for("phase Ready", lambda: (lambda s: s if s.get("phase") == "Ready" else None)(kvns_status(kubectl, ns)),
                      timeout=180)
    assert status["namespaceId"] == t.namespace_id and status["replicas"] == "1/1"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    # Informational ones apart: PinsVerified is Unknown (no Hub is reachable here), L2SpaceAvailable
    # follows the real disk the claim lies on (True or False, never missing), and
    # CreatorRightsEnforced whether another module left config/creator-rights installed (never missing).
    assert conditions.pop("PinsVerified") == "Unknown" and conditions.pop("L2SpaceAvailable") in ("True", "False")
    assert conditions.pop("CreatorRightsEnforced") in ("True", "False")
    assert conditions == {
        "IdentityResolved": "True", "L2Ready": "True", "LMCacheReady": "True", "VLLMReady": "True", "BuildVerified": "True",
        "Ready": "True"}

    sts = kubectl.get("statefulset", f"{NAME}-lmcache", ns)
    assert sts["spec"]["template"]["spec"]["containers"][0]["args"] == server_args(t)
    assert sts["metadata"]["ownerReferences"][0]["kind"] == "KVCacheNamespace"
    dep = kubectl.get("deployment", f"{NAME}-vllm", ns)
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"] == vllm_args(t)
    vllm_pod = next(p for p in kubectl.get("pods", namespace=ns)["items"] if p["metadata"]["name"].startswith(f"{NAME}-vllm"))
    server_pod = kubectl.get("pod", f"{NAME}-lmcache-0", ns)
    assert vllm_pod["spec"]["nodeName"] == server_pod["spec"]["nodeName"] == REAL_NODE
    # No model on this machine for the sample: the vLLM pod is simulated, and says so.
    assert "vLLM" in vllm_pod["metadata"]["annotations"]["kvpersist.dev/simulated"]
    svc = kubectl.get("service", t.local_service_name, ns)  # <name>-lmcache-<8 hex of the id>
    assert svc["spec"]["selector"]["kvpersist.dev/namespace-id"] == t.namespace_id
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    # One NetworkPolicy, the id's, named like its Service: the agent's port from the operator (where
    # its namespace is known), ZMQ from the id's vLLM pods. No connection ConfigMap (status.namespaceId
    # names the id) and no policy of every server.
    policy = kubectl.get("networkpolicy", t.local_service_name, ns)
    assert policy["spec"]["podSelector"]["matchLabels"]["kvpersist.dev/namespace-id"] == t.namespace_id
    *agent, zmq = policy["spec"]["ingress"]
    assert zmq["ports"] == [{"protocol": "TCP", "port": t.spec.lmcache_server.port}]
    assert all(r["ports"] == [{"protocol": "TCP", "port": t.spec.lmcache_server.agent_port}] for r in agent)
    for kind, name in (("configmap", f"{NAME}-connection"), ("networkpolicy", f"{NAME}-lmcache")):
        assert kubectl.run("get", kind, name, "-n", ns, check=False).returncode != 0, (kind, name)
    pvc = kubectl.get("pvc", f"l2-{NAME}-lmcache-0", ns)
    assert pvc["status"]["phase"] == "Bound"
    # L2's capacity as lmcache enforces it: the share of maxCapacity a framed file's padding leaves.
    share = framed_disk_share(t.spec)
    assert 16 / 17 <= share < 1
    assert status["usage"]["l1CapacityBytes"] == 2**28 and abs(status["usage"]["l2CapacityBytes"] - 2**30 * share) < 2
    assert status["servers"] == [{"pod": f"{NAME}-lmcache-0", "healthy": True, "message": ""}]
    events = kubectl.run("get", "events", "-n", ns, "--field-selector", "reason=Ready", "-o", "name").stdout
    assert events.strip()
    # L2 is encrypted (the server above is healthy and read its key from the mounted file): the key
    # is a generated Secret that nothing owns, and its bytes are nowhere in the workloads.
    key = kubectl.get("secret", f"{NAME}-l2-key", ns)
    assert "ownerReferences" not in key["metadata"] and len(base64.b64decode(key["data"]["master-key"])) == 32
    assert json.loads(server_args(t)[server_args(t).index("--l2-adapter") + 1])["serde"]["type"] == "kvpersist-aesgcm"
    workloads = json.dumps([sts, dep, svc, policy])
    assert key["data"]["master-key"] not in workloads and f"{NAME}-l2-key" in json.dumps(sts)
    # Named in status by its fingerprint, with no Event: a new resource's key is no news (its change is).
    assert kubectl.get("kvns", NAME, ns)["status"]["l2Key"]["fingerprint"] == key_fingerprint(
        base64.b64decode(key["data"]["master-key"]))
    scenario["key"] = key["data"]


def _server_status(ip: str) -> dict:
    with urllib.request.urlopen(f"{in_pod(ip)}/status", timeout=5) as r:
        return json.loads(r.read())


def test_usage_matches_server_and_grows(kubectl: Kubectl, scenario: dict) -> None:
    ns = scenario["ns"]
    ip = kubectl.get("pod", f"{NAME}-lmcache-0", ns)["status"]["podIP"]
    before = kvns_status(kubectl, ns)["usage"]
    bench_store(ip, 0, 4)
    folder = _l2_dir(scenario, target_of(manifest(ns), kubectl).namespace_id)
    files = wait_for("the 8 chunks in L2", lambda: (lambda f: f if len(f) == 8 else None)(
        [p for p in folder.iterdir() if is_chunk_name(p.name, "fs_native")] if folder.is_dir() else []), timeout=60)
    server = _server_status(ip)["storage_manager"]
    # fs_native keeps no object count: the objects are the volume's (the agent's count of the folder),
    # the bytes lmcache's own and the volume's alike (both the padded files).
    want_objects, want_l2 = len(files), server["l2_eviction_controller"]["adapters"][0]["total_bytes_used"]
    assert want_l2 == sum(p.stat().st_size for p in files) > 0
    usage = wait_for("status usage to match the server and the volume", lambda: (lambda u: u if u.get(
        "l2Objects") == want_objects else None)(kvns_status(kubectl, ns).get("usage") or {}), timeout=120)
    assert usage["l2UsedBytes"] == want_l2 > before.get("l2UsedBytes", 0)
    assert usage["l1UsedBytes"] == server["l1_manager"]["memory_used_bytes"] > 0
    scenario["stored_files"] = files_state(folder)
    assert len(scenario["stored_files"]) == want_objects


def _l2_dir(scenario: dict, namespace_id: str | None) -> Path:
    return scenario["work"] / "pods" / "volumes" / scenario["ns"] / f"l2-{NAME}-lmcache-0" / str(namespace_id)


def test_deleted_or_edited_children_come_back(kubectl: Kubectl, scenario: dict, fault_log) -> None:
    """Drift: the NetworkPolicy that keeps the agent's and ZMQ ports closed and the Service vLLM
    connects through, each deleted, and the Service's selector edited, are applied again by the
    operator within seconds (it watches what it owns)."""
    ns = scenario["ns"]
    t = target_of(manifest(ns), kubectl)
    children = [("networkpolicy", t.local_service_name), ("service", t.local_service_name)]
    times = []
    for kind, name in children:
        uid = kubectl.get(kind, name, ns)["metadata"]["uid"]
        started = time.monotonic()
        kubectl.run("delete", kind, name, "-n", ns, "--wait=true", timeout=60)
        back = wait_for(f"{kind} {name} to come back", lambda k=kind, n=name, u=uid: (lambda o: o if o and o["metadata"][
            "uid"] != u else None)(json.loads(kubectl.run("get", k, n, "-n", ns, "-o", "json", check=False).stdout or "null")),
            timeout=30, interval=0.2)
        times.append(f"{kind} {time.monotonic() - started:.1f}s")
        print(f"\n[drift] {kind} {name} deleted, back after {times[-1]}")
        assert back["metadata"]["ownerReferences"][0]["name"] == NAME
    kubectl.run("patch", "service", t.local_service_name, "-n", ns, "--type=merge", "-p",
                json.dumps({"spec": {"selector": {"kvpersist.dev/namespace-id": "kvp-" + "0" * 32}}}))
    restored = wait_for("the Service's selector restored", lambda: (lambda sel: sel if sel.get(
        "kvpersist.dev/namespace-id") == t.namespace_id else None)(kubectl.get("service", t.local_service_name, ns)["spec"][
            "selector"]), timeout=30, interval=0.2)
    assert restored["kvpersist.dev/namespace-id"] == t.namespace_id
    fault_log("owned children deleted by hand (the per-id NetworkPolicy and Service), and the Service's selector "
              "edited", "each came back, applied again by the operator: "
              + ", ".join(times) + "; the selector restored")


def test_l1_change_rolls_out(kubectl: Kubectl, scenario: dict) -> None:
    ns = scenario["ns"]
    obj = manifest(ns)
    obj["spec"]["l1"]["size"] = "512Mi"
    kubectl.apply(obj)
    wait_for("the server to restart with 0.5 GiB of L1", lambda: (kvns_status(kubectl, ns).get("usage") or {}).get(
        "l1CapacityBytes") == 2**29 and kvns_status(kubectl, ns).get("phase") == "Ready", timeout=180)
    sts = kubectl.get("statefulset", f"{NAME}-lmcache", ns)
    assert sts["status"]["currentRevision"] == sts["status"]["updateRevision"]


def test_pin_change_moves_to_new_namespace_and_keeps_old_files(kubectl: Kubectl, scenario: dict) -> None:
    ns = scenario["ns"]
    old_id = kvns_status(kubectl, ns)["namespaceId"]
    obj = manifest(ns, maxModelLen=16384)
    obj["spec"]["l1"]["size"] = "512Mi"
    kubectl.apply(obj)
    new_id = target_of(obj, kubectl).namespace_id
    assert new_id != old_id
    wait_for("the new namespace id and Ready", lambda: kvns_status(kubectl, ns).get("namespaceId") == new_id
             and kvns_status(kubectl, ns).get("phase") == "Ready", timeout=180)
    args = kubectl.get("statefulset", f"{NAME}-lmcache", ns)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert new_id in " ".join(args) and old_id not in " ".join(args)
    assert files_state(_l2_dir(scenario, old_id)) == scenario["stored_files"]
    events = kubectl.run("get", "events", "-n", ns, "--field-selector", "reason=NamespaceResolved", "-o", "json").stdout
    assert any(old_id in e["message"] and new_id in e["message"] for e in json.loads(events)["items"])


def test_kill_operator_mid_reconcile_converges_without_duplicates(kubectl: Kubectl, scenario: dict) -> None:
    ns = scenario["ns"]
    env = scenario["env"]
    stop(env.operator, signal.SIGKILL)
    extra = []
    for i in range(5):
        obj = manifest(ns)
        obj["metadata"]["name"] = f"extra-{i}"
        obj["spec"]["l2"] = {"nvme": {"existingClaimName": f"claim-{i}", "maxCapacity": "1Gi"}}
        extra.append(obj)
    kubectl.apply({"apiVersion": "v1", "kind": "List", "items": extra})
    env.operator = start_operator(kubectl.kubeconfig, ns, env.log)
    time.sleep(1.5)  # let it get part-way through the five reconciles
    stop(env.operator, signal.SIGKILL)
    env.operator = start_operator(kubectl.kubeconfig, ns, env.log)
    for obj in extra:
        name = obj["metadata"]["name"]
        wait_for(f"{name} reconciled", lambda n=name: kubectl.get("kvns", n, ns).get("status", {}).get("observedGeneration"),
                 timeout=120)
    for kind in ("statefulsets", "deployments", "services", "networkpolicies"):
        names = [o["metadata"]["name"] for o in kubectl.get(kind, namespace=ns)["items"]]
        assert len(names) == len(set(names))
    for obj in extra:
        name = obj["metadata"]["name"]
        for kind, suffix in (("statefulset", "lmcache"), ("deployment", "vllm")):
            assert kubectl.get(kind, f"{name}-{suffix}", ns)["metadata"]["labels"]["app.kubernetes.io/instance"] == name
        kubectl.run("delete", "kvns", name, "-n", ns)


def test_reclaim_delete_removes_the_claims_it_made(kubectl: Kubectl, scenario: dict) -> None:
    ns = scenario["ns"]
    obj = manifest(ns)
    obj["metadata"]["name"] = "scratch"
    obj["spec"]["l2"] = {"nvme": {"size": "1Gi", "maxCapacity": "1Gi", "reclaimPolicy": "Delete"}}
    kubectl.run("apply", "-f", "-", stdin=json.dumps(obj))
    storage_pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-scratch-pv"},
                  "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                           "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": f"/mnt/{ns}-scratch"}}}
    kubectl.apply(storage_pv)
    wait_for("the scratch claim to bind", lambda: kubectl.run("get", "pvc", "l2-scratch-lmcache-0", "-n", ns, "-o",
                                                             "jsonpath={.status.phase}", check=False).stdout == "Bound",
             timeout=120)
    kubectl.run("delete", "kvns", "scratch", "-n", ns)
    wait_for("the claim to go with the resource", lambda: kubectl.run("get", "pvc", "l2-scratch-lmcache-0", "-n", ns,
                                                                     check=False).returncode != 0, timeout=120)
    kubectl.run("delete", "pv", f"{ns}-scratch-pv", "--wait=false", check=False)


def test_delete_removes_workloads_keeps_claim_and_data(kubectl: Kubectl, scenario: dict) -> None:
    """Deleted with the operator down: no finalizer holds the object, the garbage collector
    removes what it owned, and the claim with its KV data stays (reclaimPolicy Retain)."""
    ns = scenario["ns"]
    stop(scenario["env"].operator)
    kubectl.run("delete", "kvns", NAME, "-n", ns, timeout=60)
    gone = lambda: all(kubectl.run("get", kind, name, "-n", ns, check=False).returncode != 0 for kind, name in [  # noqa: E731
        ("statefulset", f"{NAME}-lmcache"), ("deployment", f"{NAME}-vllm"),
        ("service", target_of(manifest(ns), kubectl).local_service_name),
        ("networkpolicy", target_of(manifest(ns), kubectl).local_service_name)])
    wait_for("the owned objects to be garbage-collected", gone, timeout=120)
    assert kubectl.get("pvc", f"l2-{NAME}-lmcache-0", ns)["status"]["phase"] == "Bound"
    # And the key without which that data is unreadable: kept, unchanged.
    assert kubectl.get("secret", f"{NAME}-l2-key", ns)["data"] == scenario["key"]
    old_id = target_of(manifest(ns), kubectl).namespace_id
    assert files_state(_l2_dir(scenario, old_id)) == scenario["stored_files"]
