"""spec.vllm.inferencePool on the real API server, with the operator running. Where the API is
installed (a stand-in CRD, tests/e2e/data/, written from the Gateway API Inference Extension's v1
field list: the API server checks the pool against the same required fields and bounds), the pool
<name>-vllm selects exactly the operator's vLLM pods (whose KV events carry the namespace id as
topic) on spec.vllm.port and names the endpoint picker; turning the section off deletes it. Where
it is not installed, the resource still reconciles and a Warning event names the missing API, and
installing it later makes the pool with no change to the resource."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.builders.target import NAMESPACE_ID_LABEL
from kvpersist.builders.vllm import KV_EVENTS_TOPIC_ANNOTATION
from kvpersist.builders.vllm import POOL_API_GROUP as API_GROUP
from kvpersist.controller.inferencepool import API_MISSING
from tests.cases.invalid_manifests import sample
from tests.e2e.kube import REPO, Kubectl, wait_for

pytestmark = pytest.mark.e2e
CRD_NAME = f"inferencepools.{API_GROUP}"
STAND_IN = REPO / "tests" / "e2e" / "data" / f"{CRD_NAME}.yaml"
POOLS = CRD_NAME  # kubectl's resource name, fully qualified: no other API's "inferencepools"


def _resource(ns: str, name: str, pool: bool = True) -> dict:
    obj = sample()
    obj["metadata"].update(name=name, namespace=ns)
    obj["spec"]["vllm"].update(port=8123, kvEvents={"enabled": True})
    if pool:
        obj["spec"]["vllm"]["inferencePool"] = {"endpointPicker": {"name": "kv-router-epp", "failureMode": "FailOpen"}}
    return obj


def _crd_absent(kubectl: Kubectl) -> None:
    kubectl.run("delete", "--ignore-not-found", "--wait=true", "-f", str(STAND_IN), timeout=120)
    wait_for("the stand-in CRD gone", lambda: kubectl.run("get", "crd", CRD_NAME, check=False).returncode != 0,
             timeout=60)


@pytest.fixture(scope="module")
def stand_in_crd(kubectl: Kubectl) -> Iterator[None]:
    """The stand-in InferencePool CRD for the module's tests that need it; removed afterwards."""
    kubectl.run("apply", "--server-side", "-f", str(STAND_IN))
    kubectl.wait_established(CRD_NAME)
    try:
        yield
    finally:
        _crd_absent(kubectl)


def _vllm_pods(kubectl: Kubectl, ns: str, name: str) -> list[dict]:
    return [p for p in kubectl.get("pods", namespace=ns)["items"]
            if p["metadata"]["labels"].get("app.kubernetes.io/instance") == name
            and p["metadata"]["labels"].get("app.kubernetes.io/component") == "vllm"]


def _pool(kubectl: Kubectl, ns: str, name: str) -> dict | None:
    proc = kubectl.run("get", POOLS, name, "-n", ns, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def _events(kubectl: Kubectl, ns: str, reason: str) -> list[dict]:
    return [e for e in kubectl.get("events", namespace=ns)["items"] if e["reason"] == reason]


def test_without_the_api_the_resource_reconciles_and_a_warning_names_it(kubectl: Kubectl, namespace: str,
                                                                        request: pytest.FixtureRequest) -> None:
    _crd_absent(kubectl)  # before the operator starts: its discovery must not find the API
    operator = request.getfixturevalue("operator")
    ns = namespace
    kubectl.apply(_resource(ns, "nopool"))
    log = lambda: "--- operator log:\n" + operator.read_text()[-3000:]  # noqa: E731
    events = wait_for("the InferencePoolAPIMissing Warning", lambda: _events(kubectl, ns, API_MISSING), timeout=120,
                      explain=log)
    [event] = events
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "nopool"
    assert f"{API_GROUP}/v1" in event["message"] and "not installed" in event["message"]
    # Nothing else changes: the vLLM Deployment and its pod are made as without the section.
    wait_for("nopool's vLLM pod", lambda: _vllm_pods(kubectl, ns, "nopool"), timeout=180, explain=log)
    assert kubectl.get("deployment", "nopool-vllm", ns)["spec"]["template"]["spec"]["containers"]
    # One event per generation: a new generation (two replicas) posts one more, its applies no more.
    kubectl.run("patch", "kvcachenamespace", "nopool", "-n", ns, "--type=merge", "-p", '{"spec": {"vllm": {"replicas": 2}}}')
    wait_for("nopool's two vLLM pods", lambda: len(_vllm_pods(kubectl, ns, "nopool")) == 2, timeout=180, explain=log)
    wait_for("a second InferencePoolAPIMissing", lambda: len(_events(kubectl, ns, API_MISSING)) == 2, timeout=60,
             explain=log)
    assert len(_events(kubectl, ns, API_MISSING)) == 2
    # Installed later: the status refresh asks discovery again (at most once a minute) and the pool is
    # made with no change to the resource.
    request.getfixturevalue("stand_in_crd")
    pool = wait_for("nopool's InferencePool once the API is installed", lambda: _pool(kubectl, ns, "nopool-vllm"),
                    timeout=150, explain=log)
    assert pool["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "nopool"
    assert len(_events(kubectl, ns, API_MISSING)) == 2


def test_the_pool_selects_the_operators_vllm_pods_and_goes_when_turned_off(kubectl: Kubectl, stand_in_crd: None,
                                                                           namespace: str, operator: Path) -> None:
    ns = namespace
    kubectl.apply(_resource(ns, "pooled"))
    kubectl.apply(_resource(ns, "other", pool=False))  # another resource's vLLM pod: never in pooled's pool
    log = lambda: "--- operator log:\n" + operator.read_text()[-3000:]  # noqa: E731
    pool = wait_for("pooled's InferencePool", lambda: _pool(kubectl, ns, "pooled-vllm"), timeout=120, explain=log)
    spec = pool["spec"]
    assert spec["targetPorts"] == [{"number": 8123}]
    assert spec["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "kv-router-epp", "port": {"number": 9002},
                                         "failureMode": "FailOpen"}
    assert pool["metadata"]["ownerReferences"][0]["name"] == "pooled"
    pods = wait_for("pooled's vLLM pod", lambda: _vllm_pods(kubectl, ns, "pooled"), timeout=180, explain=log)
    wait_for("other's vLLM pod", lambda: _vllm_pods(kubectl, ns, "other"), timeout=180, explain=log)
    selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    selected = kubectl.run("get", "pods", "-n", ns, "-l", selector, "-o", "name").stdout.split()
    assert sorted(selected) == sorted(f"pod/{p['metadata']['name']}" for p in pods)
    for pod in pods:  # what a KV-aware picker subscribes to: the events' topic is the pod's namespace id
        meta = pod["metadata"]
        assert meta["annotations"][KV_EVENTS_TOPIC_ANNOTATION] == meta["labels"][NAMESPACE_ID_LABEL]
    # The API server holds the pool to the upstream bounds: a bad one is refused (the stand-in checks).
    bad = {**pool, "metadata": {"name": "bad", "namespace": ns}, "spec": {**spec, "targetPorts": []}}
    assert kubectl.apply(bad, check=False).returncode != 0

    kubectl.run("patch", "kvcachenamespace", "pooled", "-n", ns, "--type=json",
                "-p", '[{"op": "remove", "path": "/spec/vllm/inferencePool"}]')
    wait_for("pooled's InferencePool deleted", lambda: _pool(kubectl, ns, "pooled-vllm") is None, timeout=120,
             explain=log)
    assert "deleted InferencePool pooled-vllm" in operator.read_text()
    assert _vllm_pods(kubectl, ns, "pooled")  # the pods stay
