"""The chart installed as a platform team would: `helm install --set replicaCount=2 --set
watchNamespaces={ns}`. Its two replicas reconcile the watched namespace, exactly one of them
active (kopf's namespaced peering, the KopfPeering the chart ships there, the chart's Roles), and
after the active one is SIGKILLed the other takes over (the time is recorded).

What stands in: the local cluster has no container runtime, so the chart's two operator pods are
scheduled on kwok nodes and run nothing there; each is run here as a local process with exactly
what the chart's Deployment gives its container (its args and env as the API server stored them,
the fieldRefs resolved: POD_ID is that pod's name, KVPERSIST_OPERATOR_NAMESPACE the release's), and
with only the chart's ServiceAccount's rights (a kubeconfig with its token, bound to that pod as a
kubelet's projected token is, so the API server's audit log names the pod behind each request:
the standby's writes are counted there). Liveness and metrics listen on loopback ports of their
own (each pod has its own IP in a cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kvpersist.controller.runtime import PEERING_LIFETIME_S
from tests.e2e.audit import writes
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, free_port, manifest, more_rounds, refreshes, stop, storage
from tests.e2e.test_faults import healthz
from tests.e2e.test_ha import assert_only_the_active_one_wrote, kill_and_take_over, observed
from tests.e2e.test_helm import CHART, helm

pytestmark = pytest.mark.e2e


def _as_the_pod_runs(container: dict[str, Any], pod: dict[str, Any]) -> tuple[list[str], dict[str, str], int]:
    """The container's args and env as the chart set them, fieldRefs resolved for this pod; the
    liveness and metrics addresses moved to free loopback ports (the metrics one returned)."""
    args, metrics_port = [], 0
    for arg in container["args"]:
        if arg.startswith("--liveness="):
            arg = f"--liveness=http://127.0.0.1:{free_port()}/healthz"
        elif arg.startswith("--metrics-port="):
            metrics_port = free_port()
            arg = f"--metrics-port={metrics_port}"
        args.append(arg)
    assert metrics_port, container["args"]
    args.append("--metrics-host=127.0.0.1")
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in ("metadata.name", "metadata.namespace", "metadata.uid"), f"unresolved fieldRef {path}"
            env[item["name"]] = pod["metadata"][path.split(".")[1]]
    return args, env, metrics_port


def test_helm_two_replicas_watching_one_namespace_reconcile_and_fail_over(kubectl: Kubectl, crd: None, tmp_path: Path,
                                                                           audit_log: Path, fault_log) -> None:
    suffix = uuid.uuid4().hex[:6]
    release, release_ns, app_ns, other_ns = f"ha-{suffix}", f"ha-sys-{suffix}", f"ha-w-{suffix}", f"ha-o-{suffix}"
    fullname = f"{release}-kvpersist"
    procs: dict[str, subprocess.Popen] = {}
    ready_urls: dict[str, str] = {}
    logs: dict[str, Path] = {}
    for ns in (app_ns, other_ns):
        kubectl.run("create", "namespace", ns)
    try:
        helm("install", release, str(CHART), "--namespace", release_ns, "--create-namespace", "--kubeconfig",
             str(kubectl.kubeconfig), "--set", "replicaCount=2", "--set", f"watchNamespaces={{{app_ns}}}",
             "--set", "peering.name=kvpersist", "--set", "crds.enabled=false")  # the session's CRD
        deployment = kubectl.get("deployment", fullname, release_ns)
        assert deployment["spec"]["replicas"] == 2
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        assert f"--namespace={app_ns}" in container["args"]
        # The chart's namespaced peering object, where kopf peers with watchNamespaces; and with two
        # replicas its PodDisruptionBudget (a drain takes one at a time).
        kubectl.get("kopfpeering", "kvpersist", app_ns)
        assert kubectl.get("poddisruptionbudget", fullname, release_ns)["spec"]["maxUnavailable"] == 1

        def pods() -> list[dict]:
            items = kubectl.get("pods", namespace=release_ns)["items"]
            return [p for p in items if p["metadata"]["name"].startswith(fullname) and not p["metadata"].get("deletionTimestamp")]

        wait_for("the chart's two operator pods", lambda: len(pods()) == 2, timeout=60)
        user = f"system:serviceaccount:{release_ns}:{fullname}"
        for pod in pods():
            args, env, metrics_port = _as_the_pod_runs(container, pod)
            name = pod["metadata"]["name"]
            own = kubectl.as_service_account(release_ns, fullname, tmp_path / f"{name}.kubeconfig", pod=pod).kubeconfig
            logs[name] = tmp_path / f"{name}.log"
            with logs[name].open("ab") as out:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "kvpersist.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, **env, "KUBECONFIG": str(own), "PYTHONUNBUFFERED": "1"})
            procs[name].metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"  # type: ignore[attr-defined]
            ready_urls[name] = next(a for a in args if a.startswith("--liveness=")).removeprefix("--liveness=").replace(
                "/healthz", "/readyz")

        # Peered and each knowing its part before the resource exists (until a replica has seen
        # its peer it is rightly the only one).
        record = wait_for("both replicas in the peering record", lambda: (lambda r: r if set(r) >= set(procs) else None)(
            json.loads(kubectl.run("get", "kopfpeering", "kvpersist", "-n", app_ns, "-o", "json").stdout).get("status") or {}),
            timeout=60)
        active = max(procs, key=lambda r: record[r]["priority"])
        standby = next(r for r in procs if r != active)
        wait_for("the standby to say so", lambda: "standing by" in logs[standby].read_text(), timeout=30)
        wait_for("the active one to say so", lambda: "this replica is active" in logs[active].read_text(), timeout=30)
        # The chart's readinessProbe: each replica ready once kopf runs and its watch caches listed, the standby too.
        for name, url in ready_urls.items():
            wait_for(f"{name} ready at {url}", lambda u=url: healthz(u) == 200, timeout=60)
        kubectl.apply(storage(app_ns))
        applied_at = datetime.now(UTC)
        obj = manifest(app_ns)
        kubectl.apply(obj)
        outside = manifest(other_ns)  # not watched: nobody reconciles it
        kubectl.apply(outside)
        generation = kubectl.get("kvns", NAME, app_ns)["metadata"]["generation"]
        applied = time.monotonic()
        wait_for("status from the active replica", lambda: observed(kubectl, app_ns, generation), timeout=120)
        first_status = time.monotonic() - applied
        # Exact namespace names: no scan of the cluster's namespaces, which the chart does not grant.
        for log in logs.values():
            assert "Not enough permissions to list namespaces" not in log.read_text(), log.read_text()[-2000:]
        assert "this replica is active" not in logs[standby].read_text()
        assert not (kubectl.get("kvns", NAME, other_ns).get("status") or {}), "a namespace outside watchNamespaces was reconciled"
        for proc in procs.values():
            assert proc.poll() is None, "a replica exited"
        more_rounds(procs[active], app_ns, NAME, rounds=1)  # a round of the active one: the standby's loop ticked ten times
        kill_at = datetime.now(UTC)
        wrote = assert_only_the_active_one_wrote(audit_log, dict.fromkeys(procs, user), active, standby, applied_at, kill_at,
                                                 pods={name: name for name in procs},
                                                 shows=f"patch kvcachenamespaces/status {app_ns}/")
        assert refreshes(procs[standby], app_ns, NAME) == 0  # nor did it compute one

        took = kill_and_take_over(kubectl, app_ns, obj, generation, procs[active])
        print(f"\n[helm-ha] active replica {active} SIGKILLed; {standby} reconciled the next change after {took:.1f}s; "
              f"before, {len(wrote)} writes by {active}, none by {standby}")
        taken = wait_for("the former standby's writes", lambda: writes(audit_log, user, pod=standby, since=kill_at), timeout=30)
        assert any(w.startswith("patch kvcachenamespaces/status ") for w in taken), taken[:20]
        fault_log("`helm install --set replicaCount=2 --set watchNamespaces={ns}` (the two operator pods' containers run "
                  "as local processes with their args, env and ServiceAccount); the active one SIGKILLed",
                  f"the watched namespace reconciled (first status {first_status:.1f}s after the apply), one replica "
                  f"active and the other standing by on the chart's KopfPeering there, a namespace outside "
                  f"watchNamespaces untouched; after the kill the standby reconciled the next spec change in "
                  f"{took:.1f}s (peering lifetime {PEERING_LIFETIME_S}s)")
    finally:
        for proc in procs.values():
            stop(proc)
        helm("uninstall", release, "--namespace", release_ns, "--kubeconfig", str(kubectl.kubeconfig), check=False)
        for ns in (app_ns, other_ns, release_ns):
            kubectl.run("delete", "namespace", ns, "--wait=false", check=False)
        kubectl.run("delete", "pv", f"{app_ns}-pv", "--wait=false", "--ignore-not-found", check=False)
        kubectl.run("delete", "storageclass", f"{app_ns}-nvme", "--ignore-not-found", check=False)
