"""Two operator replicas with kopf peering on the local cluster: exactly one is active and writes
status (each takes a random priority, so they never tie and both pause); the standby writes
nothing; after the active one is SIGKILLed, the other takes over within the peering lifetime
(the time is printed). The replicas are local processes, as the chart runs them (cluster-wide,
`--peering`), each with its own POD_ID as the chart sets from the pod name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kvpersist.controller.leadership import PEERING_LIFETIME_S
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, manifest, stop, storage

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
PEERING_CRD = REPO / "charts" / "kvpersist" / "crds" / "clusterkopfpeerings.kopf.dev.yaml"


def observed(kubectl: Kubectl, ns: str, generation: int) -> dict | None:
    status = kubectl.get("kvns", NAME, ns).get("status") or {}
    return status if status.get("observedGeneration") == generation and status.get("phase") else None


def kill_and_take_over(kubectl: Kubectl, ns: str, obj: dict, generation: int, active: subprocess.Popen) -> float:
    """SIGKILLs the active replica, changes the spec (a change only a working replica can
    reconcile) and waits for it to be reconciled; the seconds from the kill to that."""
    os.killpg(active.pid, signal.SIGKILL)
    active.wait(timeout=10)
    killed = time.monotonic()
    obj["spec"]["l1"]["sizeGB"] = 0.5
    kubectl.apply(obj)
    new_generation = kubectl.get("kvns", NAME, ns)["metadata"]["generation"]
    assert new_generation > generation
    wait_for("the standby to take over", lambda: observed(kubectl, ns, new_generation),
             timeout=4 * PEERING_LIFETIME_S + 60, interval=0.5)
    took = time.monotonic() - killed
    sts = kubectl.get("statefulset", f"{NAME}-lmcache", ns)
    assert "--l1-size-gb" in (args := sts["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args[args.index("--l1-size-gb") + 1] == "0.5"
    return took


def test_two_replicas_one_active_and_failover(kubectl: Kubectl, crd: None, tmp_path: Path, fault_log) -> None:
    ns, peering = f"e2e-{uuid.uuid4().hex[:8]}", f"kvpersist-ha-{uuid.uuid4().hex[:6]}"
    kubectl.run("apply", "--server-side", "-f", str(PEERING_CRD))
    kubectl.run("wait", "--for", "condition=established", "--timeout=60s", "crd/clusterkopfpeerings.kopf.dev")
    kubectl.apply({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": peering}})
    kubectl.run("create", "namespace", ns)
    kubectl.apply(storage(ns))
    logs = {r: tmp_path / f"{r}.log" for r in ("replica-a", "replica-b")}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for replica, log in logs.items():
            with log.open("ab") as out:
                procs[replica] = subprocess.Popen(
                    [sys.executable, "-m", "kvpersist.cli", "run", "--peering", peering], stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, "KUBECONFIG": str(kubectl.kubeconfig), "POD_ID": replica, "PYTHONUNBUFFERED": "1"})
        obj = manifest(ns)
        kubectl.apply(obj)
        generation = kubectl.get("kvns", NAME, ns)["metadata"]["generation"]
        wait_for("status from the active replica", lambda: observed(kubectl, ns, generation), timeout=120)

        record = json.loads(kubectl.run("get", "clusterkopfpeering", peering, "-o", "json").stdout)["status"]
        assert set(record) >= set(logs), record
        active = max(logs, key=lambda r: record[r]["priority"])
        standby = next(r for r in logs if r != active)
        assert record[active]["priority"] != record[standby]["priority"]
        wait_for("the standby to say so", lambda: "standing by" in logs[standby].read_text(), timeout=30)
        assert "this replica is active" in logs[active].read_text()
        assert "this replica is active" not in logs[standby].read_text()

        took = kill_and_take_over(kubectl, ns, obj, generation, procs[active])
        print(f"\n[ha] active replica SIGKILLed; the standby reconciled the next change after {took:.1f}s "
              f"(peering lifetime {PEERING_LIFETIME_S}s)")
        wait_for("the standby to log that it is active", lambda: "this replica is active" in logs[standby].read_text(),
                 timeout=30)
        fault_log("two operator replicas with peering (random priorities); the active one SIGKILLed",
                  f"one replica active, the other standing by (never active before the kill); after it the standby "
                  f"reconciled the next spec change in {took:.1f}s (peering lifetime {PEERING_LIFETIME_S}s)")
    finally:
        for proc in procs.values():
            stop(proc)
        kubectl.run("delete", "clusterkopfpeering", peering, "--wait=false", check=False)
