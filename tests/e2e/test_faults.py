"""Faults on the local cluster with real lmcache servers: the operator killed mid-reconcile, the
API server restarted, a cache server gone and back, 50 resources churned at once.

Each test records what happened (numbers included) through the `fault_log` fixture; the report
in docs/reliability.md is rendered from those records by hack/reliability_report.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.kube import LOCALCLUSTER, Kubectl, wait_for
from tests.e2e.operator_env import (
    NAME,
    Runner,
    RunnerThread,
    free_port,
    manifest,
    more_rounds,
    operator_metrics,
    refreshes,
    start_operator,
    stop,
    storage,
)

pytestmark = [pytest.mark.e2e, pytest.mark.datapath]
# What each resource owns: its namespace id's policy (the agent's port, ZMQ), the per-id local
# Service, the StatefulSet and the Deployment.
KINDS = [("networkpolicy", "lmcache-<id>"), ("service", "lmcache-<id>"), ("statefulset", "lmcache"), ("deployment", "vllm")]


@pytest.fixture()
def env(kubectl: Kubectl, crd: None, tmp_path: Path) -> Iterator[dict]:
    ns = f"e2e-{uuid.uuid4().hex[:8]}"
    kubectl.run("create", "namespace", ns)
    state: dict = {"ns": ns, "log": tmp_path / "operator.log", "tmp": tmp_path, "procs": []}

    def operator() -> subprocess.Popen:
        proc = start_operator(kubectl.kubeconfig, ns, state["log"])
        state["procs"].append(proc)
        return proc

    state["start_operator"] = operator
    try:
        yield state
    finally:
        for proc in state["procs"]:
            stop(proc)
        kubectl.run("delete", "namespace", ns, "--wait=false", check=False)


def light(ns: str, name: str, **spec_changes: object) -> dict:
    """A resource that needs no volume and no GPU: an existing claim and no vLLM replicas."""
    obj = manifest(ns)
    obj["metadata"]["name"] = name
    obj["spec"]["l2"] = {"nvme": {"existingClaimName": f"{name}-data", "maxCapacity": "1Gi"}}
    obj["spec"]["vllm"]["replicas"] = 0
    obj["spec"].update(spec_changes)
    return obj


def converged(kubectl: Kubectl, ns: str, names: list[str]) -> Callable[[], bool]:
    """Every resource observed at its current generation, with each of its objects present once."""
    def check() -> bool:
        items = {o["metadata"]["name"]: o for o in kubectl.get("kvns", namespace=ns)["items"]}
        for name in names:
            obj = items.get(name)
            if obj is None or (obj.get("status") or {}).get("observedGeneration") != obj["metadata"]["generation"]:
                return False
        for kind, _ in KINDS:
            owned = [o for o in kubectl.get(kind, namespace=ns)["items"]
                     if o["metadata"].get("labels", {}).get("app.kubernetes.io/instance") in names]
            expected = len(names) * sum(1 for k, _ in KINDS if k == kind)
            if len(owned) != expected:
                return False
        return True
    return check


def test_operator_sigkill_mid_reconcile_converges(kubectl: Kubectl, env: dict, fault_log) -> None:
    ns = env["ns"]
    names = [f"r{i:02d}" for i in range(20)]
    kubectl.apply({"apiVersion": "v1", "kind": "List", "items": [light(ns, n) for n in names]})
    op = env["start_operator"]()
    wait_for("the operator to be part-way", lambda: sum(1 for o in kubectl.get("kvns", namespace=ns)["items"]
                                                      if o.get("status")) >= 1, timeout=60, interval=0.05)
    op.send_signal(signal.SIGKILL)
    op.wait(timeout=10)
    done_at_kill = sum(1 for o in kubectl.get("kvns", namespace=ns)["items"] if o.get("status"))
    t0 = time.monotonic()
    env["start_operator"]()
    wait_for("all 20 converged", converged(kubectl, ns, names), timeout=180)
    seconds = time.monotonic() - t0
    for name in names:
        assert kubectl.get("kvns", name, ns)["status"]["namespaceId"].startswith("kvp-")
    fault_log("operator SIGKILLed while reconciling 20 resources, then restarted",
              f"{done_at_kill}/20 had status at the kill; all 20 converged {seconds:.1f}s after the restart; "
              f"each owned object exists exactly once ({len(KINDS)} per resource), every resource has its namespace id")


def test_apiserver_restart_operator_reconnects(kubectl: Kubectl, env: dict, fault_log) -> None:
    ns = env["ns"]
    op = env["start_operator"]()
    kubectl.apply(light(ns, "steady"))
    wait_for("first reconcile", converged(kubectl, ns, ["steady"]), timeout=60)
    t0 = time.monotonic()
    restart = subprocess.run([*LOCALCLUSTER, "restart", "kube-apiserver", "--down-seconds", "5"], timeout=240,
                             capture_output=True, text=True)
    assert restart.returncode == 0, restart.stderr
    down = time.monotonic() - t0
    t1 = time.monotonic()
    kubectl.apply(light(ns, "steady", l1={"size": "512Mi"}))
    wait_for("the spec change after the restart to be applied", lambda: "0.5" in kubectl.get(
        "statefulset", "steady-lmcache", ns)["spec"]["template"]["spec"]["containers"][0]["args"], timeout=120)
    wait_for("converged", converged(kubectl, ns, ["steady"]), timeout=120)
    seconds = time.monotonic() - t1
    assert op.poll() is None, "the operator exited when the API server went away"
    fault_log("kube-apiserver stopped under a running operator (SIGTERM; SIGKILL when still draining after 20 s) "
              "and started again 5 s later",
              f"API server back after {down:.1f}s; the operator process stayed up (no crash loop), reconnected its "
              f"watches, and applied a spec change made after the restart in {seconds:.1f}s")


PEERING_CRD = Path(__file__).resolve().parents[2] / "charts" / "kvpersist" / "crds" / "kopfpeerings.kopf.dev.yaml"


def healthz(url: str) -> int | None:
    """The operator's liveness endpoint's HTTP status; None while it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def test_a_minute_without_the_api_server_does_not_stop_the_status_loop(kubectl: Kubectl, env: dict, fault_log) -> None:
    """As the chart runs it (with peering, so each tick reads the peering object; a liveness probe):
    kube-apiserver stopped for 60 s. A refused connection is urllib3's MaxRetryError, no ApiException;
    the status loop must go on through the outage, so liveness stays fine (a kubelet would otherwise
    restart the operator for as long as the outage lasts) and status rounds resume on the return."""
    ns = env["ns"]
    peering = f"kvpersist-outage-{uuid.uuid4().hex[:6]}"
    kubectl.run("apply", "--server-side", "-f", str(PEERING_CRD))
    kubectl.wait_established("kopfpeerings.kopf.dev")
    kubectl.apply({"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": peering, "namespace": ns}})
    port, live_port = free_port(), free_port()
    live = f"http://127.0.0.1:{live_port}/healthz"
    with env["log"].open("ab") as out:
        op = subprocess.Popen([sys.executable, "-m", "kvpersist.cli", "run", "--peering", peering, "--namespace", ns,
                               "--liveness", live, "--metrics-host", "127.0.0.1", "--metrics-port", str(port)],
                              stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "KUBECONFIG": str(kubectl.kubeconfig), "POD_ID": "outage",
                                   "PYTHONUNBUFFERED": "1", "KVPERSIST_STRICT_STATUS": "1"})
    op.metrics_url = f"http://127.0.0.1:{port}/metrics"  # type: ignore[attr-defined]
    env["procs"].append(op)
    kubectl.apply(light(ns, "steady"))
    wait_for("first reconcile", converged(kubectl, ns, ["steady"]), timeout=90)
    wait_for("liveness fine", lambda: healthz(live) == 200, timeout=30)
    wait_for("this replica active", lambda: "this replica is active" in env["log"].read_text(errors="replace"), timeout=30)
    more_rounds(op, ns, "steady")
    restart = subprocess.run([*LOCALCLUSTER, "restart", "kube-apiserver", "--down-seconds", "60"], timeout=300,
                             capture_output=True, text=True)
    assert restart.returncode == 0, restart.stderr
    back = time.monotonic()
    assert op.poll() is None, "the operator exited while the API server was away"
    assert healthz(live) == 200, "liveness failed after the outage: the status loop stopped"
    before = refreshes(op, ns, "steady")
    wait_for("status rounds again", lambda: refreshes(op, ns, "steady") >= before + 2, timeout=60, interval=0.5)
    resumed = time.monotonic() - back
    assert healthz(live) == 200
    text = env["log"].read_text(errors="replace")
    assert f"status refresh of {ns}/steady failed" in text, text[-3000:]  # it ran through the outage, failing
    assert "Multidimensional multitasker has failed" not in text  # kopf itself (its peering keep-alive) went on too
    fault_log("kube-apiserver stopped for 60 s under an operator with peering and a liveness probe, as the chart runs it",
              f"the process stayed up, liveness answered 200 after the outage (the status loop went on through "
              f"it), and two status rounds ran {resumed:.1f}s after the API server was back")


def test_unreachable_server_degrades_then_recovers(kubectl: Kubectl, env: dict, fault_log) -> None:
    ns = env["ns"]
    kubectl.apply(storage(ns))
    env["start_operator"]()
    runner = Runner(kubectl.kubeconfig, ns, env["tmp"] / "pods", kubectl=str(kubectl.binary),
                    lmcache=str(Path(sys.executable).parent / "lmcache"))
    phase = lambda: (kubectl.get("kvns", NAME, ns).get("status") or {}).get("phase")  # noqa: E731
    try:
        with RunnerThread(runner):
            kubectl.apply(manifest(ns))
            wait_for("Ready", lambda: phase() == "Ready", timeout=180)
        # The runner thread is gone: the server process is stopped and nobody restarts it; the pod stays Ready.
        t0 = time.monotonic()
        status = wait_for("Degraded", lambda: (lambda s: s if s.get("phase") == "Degraded" else None)(
            kubectl.get("kvns", NAME, ns).get("status") or {}), timeout=60)
        to_degraded = time.monotonic() - t0
        reason = next(c for c in status["conditions"] if c["type"] == "LMCacheReady")
        assert reason["reason"] == "ServerUnhealthy" and "unreachable" in reason["message"]
        t1 = time.monotonic()
        with RunnerThread(runner):
            wait_for("Ready again", lambda: phase() == "Ready", timeout=120)
            to_ready = time.monotonic() - t1
    finally:
        runner.stop_all()
    fault_log("an lmcache server process stops while its pod stays Ready",
              f"Degraded after {to_degraded:.1f}s (LMCacheReady=False, ServerUnhealthy: '{reason['message'][:80]}...'); "
              f"Ready again {to_ready:.1f}s after the server came back (bound: 10 s poll + 2 s timeout)")


def test_fifty_resources_churned_concurrently(kubectl: Kubectl, env: dict, fault_log) -> None:
    ns = env["ns"]
    env["start_operator"]()
    names = [f"c{i:02d}" for i in range(50)]

    def churn(name: str) -> None:
        obj = light(ns, name)
        if int(name[1:]) % 2:  # half with a claim per server, kept by design when deleted
            obj["spec"]["l2"] = {"nvme": {"size": "1Gi", "maxCapacity": "1Gi"}}
        kubectl.apply(obj)
        obj["spec"]["l1"] = {"size": "512Mi"}
        kubectl.apply(obj)

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=10) as pool:
        list(pool.map(churn, names))
    doomed, kept = names[:25], names[25:]
    with ThreadPoolExecutor(max_workers=10) as pool:
        list(pool.map(lambda n: kubectl.run("delete", "kvns", n, "-n", ns, "--wait=false"), doomed))
    wait_for("the 25 kept to converge", converged(kubectl, ns, kept), timeout=300)
    for name in kept:
        args = kubectl.get("statefulset", f"{name}-lmcache", ns)["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--l1-size-gb") + 1] == "0.5"

    def no_orphans() -> bool:
        for kind, _ in KINDS:
            left = [o["metadata"]["name"] for o in kubectl.get(kind, namespace=ns)["items"]
                    if o["metadata"].get("labels", {}).get("app.kubernetes.io/instance") in doomed]
            if left:
                return False
        return True

    wait_for("no orphans of the 25 deleted", no_orphans, timeout=300)
    seconds = time.monotonic() - t0
    pvcs = [p["metadata"]["name"] for p in kubectl.get("pvc", namespace=ns)["items"]]
    doomed_pvcs = [p for p in pvcs if any(p == f"l2-{n}-lmcache-0" for n in doomed)]
    assert all(int(p.split("-")[1][1:]) % 2 for p in doomed_pvcs)  # only claims (kept by design) remain
    fault_log("50 resources created, updated and 25 of them deleted, 10 clients at a time",
              f"the 25 kept converged to their second generation and the deleted ones left no object behind in "
              f"{seconds:.1f}s; {len(doomed_pvcs)} claims of deleted resources remain, as reclaimPolicy Retain says")


def test_a_transient_refusal_is_retried_with_backoff_and_said_in_status(kubectl: Kubectl, env: dict, fault_log) -> None:
    """A full ResourceQuota makes the API server refuse the NetworkPolicies (403, "exceeded quota"):
    not the spec's fault, so the operator keeps trying (5 s, 10 s, ...) and Ready says why; once
    the quota is gone, the next try applies them."""
    ns, name = env["ns"], "retried"
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-policies", "namespace": ns},
             "spec": {"hard": {"count/networkpolicies.networking.k8s.io": "0"}}}
    kubectl.apply(quota)
    env["start_operator"]()
    kubectl.apply(light(ns, name))

    def ready() -> dict:
        conds = (kubectl.get("kvns", name, ns).get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == "Ready"), {})

    def policies() -> list[str]:  # its namespace id's: <name>-lmcache-<8 hex>
        return [p["metadata"]["name"] for p in kubectl.get("networkpolicies", namespace=ns)["items"]
                if p["metadata"]["labels"].get("app.kubernetes.io/instance") == name]

    wait_for("Ready to say the apply is being retried", lambda: ready().get("reason") == "ApplyRetrying", timeout=90)
    assert "exceeded quota" in ready()["message"] and "HTTP 403" in ready()["message"], ready()
    wait_for("a second try", lambda: "failed 2 time(s)" in ready().get("message", ""), timeout=60)
    seen = ready()["message"]
    # The policy comes first (no server pod before its ports are closed to others): nothing after it yet.
    assert policies() == [] and kubectl.run("get", "statefulset", f"{name}-lmcache", "-n", ns, check=False).returncode != 0

    kubectl.run("delete", "resourcequota", "no-policies", "-n", ns)
    freed = time.monotonic()
    wait_for("the policy applied on the next try", policies, timeout=120)
    applied = time.monotonic() - freed
    wait_for("the StatefulSet applied too", lambda: kubectl.run(
        "get", "statefulset", f"{name}-lmcache", "-n", ns, check=False).returncode == 0, timeout=60)
    wait_for("Ready no longer ApplyRetrying", lambda: ready().get("reason") != "ApplyRetrying", timeout=60)
    fault_log("a ResourceQuota refusing the NetworkPolicies (HTTP 403, exceeded quota), then removed",
              f"Ready False ApplyRetrying ('{seen[:140]}...'), tried again with backoff; applied {applied:.1f}s after the "
              "quota was removed (bound: the backoff then due, 20 s at the third try, + 1 s tick), the StatefulSet after them")


def test_an_object_the_api_server_refuses_as_invalid_fails_until_the_spec_changes(kubectl: Kubectl, env: dict,
                                                                                  fault_log) -> None:
    """A ValidatingAdmissionPolicy refuses the resource's StatefulSet (422 Invalid, as a schema or
    webhook refusal would): no retry can pass, so it is ApplyFailed for that generation (phase
    Failed, the API server's words in Ready), tried no more; a spec change once the policy is gone
    applies it."""
    ns, name = env["ns"], "invalid-apply"
    policy = f"kvpersist-test-refuse-{ns}"
    refused_by = f"the test's admission policy refuses StatefulSets of {name}"
    objs = [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy", "metadata": {"name": policy},
         "spec": {"failurePolicy": "Fail",
                  "matchConstraints": {"resourceRules": [{"apiGroups": ["apps"], "apiVersions": ["v1"],
                                                          "operations": ["CREATE", "UPDATE"], "resources": ["statefulsets"]}]},
                  "validations": [{"expression": "!has(object.metadata.labels) || !('app.kubernetes.io/instance' in "
                                                 f"object.metadata.labels) || object.metadata.labels['app.kubernetes.io/instance'] "
                                                 f"!= '{name}'", "message": refused_by}]}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": policy},
         "spec": {"policyName": policy, "validationActions": ["Deny"],
                  "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}}},
    ]
    probe = {"apiVersion": "apps/v1", "kind": "StatefulSet",
             "metadata": {"name": "probe", "namespace": ns, "labels": {"app.kubernetes.io/instance": name}},
             "spec": {"serviceName": "probe", "selector": {"matchLabels": {"p": "p"}},
                      "template": {"metadata": {"labels": {"p": "p"}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}}}
    try:
        kubectl.apply({"apiVersion": "v1", "kind": "List", "items": objs})
        # In force once the API server refuses a dry run the same way (its policy cache is asynchronous).
        wait_for("the policy in force", lambda: refused_by in kubectl.apply(probe, "--dry-run=server", check=False).stderr,
                 timeout=60, interval=1)
        op = env["start_operator"]()
        kubectl.apply(light(ns, name))

        def ready() -> dict:
            conds = (kubectl.get("kvns", name, ns).get("status") or {}).get("conditions") or []
            return next((c for c in conds if c["type"] == "Ready"), {})

        cond = wait_for("Ready False ApplyFailed", lambda: (lambda c: c if c.get("reason") == "ApplyFailed" else None)(ready()),
                        timeout=90)
        assert cond["status"] == "False" and cond["observedGeneration"] == 1
        assert "the API server refused an object" in cond["message"] and refused_by in cond["message"], cond
        assert kubectl.get("kvns", name, ns)["status"]["phase"] == "Failed"
        errors = operator_metrics(op)["kvpersist_apply_errors_total"]
        more_rounds(op, ns, name, rounds=1)  # not retried (a retry would be due within the 5 s backoff): only a changed spec can pass
        assert operator_metrics(op)["kvpersist_apply_errors_total"] == errors and ready()["reason"] == "ApplyFailed"
        assert kubectl.run("get", "statefulset", f"{name}-lmcache", "-n", ns, check=False).returncode != 0

        kubectl.run("delete", "validatingadmissionpolicybinding", policy)
        wait_for("the policy out of force", lambda: refused_by not in kubectl.apply(probe, "--dry-run=server", check=False).stderr,
                 timeout=60, interval=1)
        kubectl.apply(light(ns, name, l1={"size": "512Mi"}))
        wait_for("the StatefulSet applied for the new generation", lambda: kubectl.run(
            "get", "statefulset", f"{name}-lmcache", "-n", ns, check=False).returncode == 0, timeout=60)
        after = wait_for("Ready no longer ApplyFailed", lambda: (lambda c: c if c.get("observedGeneration") == 2 and c.get(
            "reason") != "ApplyFailed" else None)(ready()), timeout=60)
        fault_log("an admission policy refusing the StatefulSet as invalid (HTTP 422), removed, then a spec change",
                  f"Ready False ApplyFailed with the API server's message, phase Failed, not retried over the next status "
                  f"round; the next generation applied (Ready {after['reason']})")
    finally:
        for kind in ("validatingadmissionpolicybinding", "validatingadmissionpolicy"):
            kubectl.run("delete", kind, policy, "--ignore-not-found", check=False)
