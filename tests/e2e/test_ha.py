"""Two operator replicas with kopf peering on the local cluster: exactly one is active and writes
status; the standby writes nothing, even one that was active before and still holds the
resource; after the active one is SIGKILLed, the other takes over within the peering lifetime
(the time is printed). The replicas are local processes, as the chart runs them (cluster-wide,
`--peering`), each with its own POD_ID as the chart sets from the pod name, and each as a
ServiceAccount of its own: the API server's audit log says which replica wrote what (writes are
counted there, not read from the replicas' own logs). Random priorities (the chart's way): the
chart's two pods in tests/e2e/test_helm_ha.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from kvpersist.controller.runtime import PEERING_LIFETIME_S
from tests.e2e.audit import writes
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, free_port, manifest, more_rounds, refreshes, stop, storage

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
    obj["spec"]["l1"]["size"] = "512Mi"
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


def assert_only_the_active_one_wrote(audit_log: Path, users: dict[str, str], active: str, standby: str, since: datetime,
                                     until: datetime, pods: dict[str, str] | None = None, active_since: datetime | None = None,
                                     shows: str = " ") -> list[str]:
    """From the API server's audit log: the standby wrote nothing at all (its peering heartbeat
    aside) between since and until, while the active one's writes from active_since (since by
    default) include one containing `shows` (the check sees that identity at all). Those writes."""
    def of(replica: str, start: datetime) -> list[str]:
        return writes(audit_log, users[replica], pod=(pods or {}).get(replica), since=start, until=until)

    mine = wait_for(f"the active replica's writes ({shows.strip() or 'any'}) in the audit log",
                    lambda: (lambda w: w if any(shows in x for x in w) else None)(of(active, active_since or since)), timeout=30)
    assert of(standby, since) == [], f"the standby {standby} wrote: {of(standby, since)[:20]}"
    return mine


def test_a_replica_that_hands_over_writes_nothing_until_the_active_one_dies(kubectl: Kubectl, crd: None, tmp_path: Path,
                                                                           audit_log: Path, fault_log) -> None:
    """Replica A runs alone and reconciles the resource; B joins with a higher priority and takes
    over. A, now standing by, still holds the resource and its caches (kopf only paused its
    handlers): the leadership check alone keeps it from writing, and the audit log shows it writes
    nothing while B works. B is SIGKILLed; A reconciles the next change."""
    ns, peering = f"e2e-{uuid.uuid4().hex[:8]}", f"kvpersist-ha-{uuid.uuid4().hex[:6]}"
    kubectl.run("apply", "--server-side", "-f", str(PEERING_CRD))
    kubectl.wait_established("clusterkopfpeerings.kopf.dev")
    kubectl.apply({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": peering}})
    kubectl.run("create", "namespace", ns)
    kubectl.apply(storage(ns))
    logs = {r: tmp_path / f"{r}.log" for r in ("replica-a", "replica-b")}
    procs: dict[str, subprocess.Popen] = {}
    # Each replica its own ServiceAccount (cluster-admin: what is under test is who writes, not
    # RBAC, which tests/e2e/test_helm*.py run with the chart's own), so the audit log tells them apart.
    users = {r: f"system:serviceaccount:{ns}:{r}" for r in logs}
    bindings = [f"{ns}-{r}" for r in logs]

    def start(replica: str, priority: int) -> None:
        kubectl.run("create", "serviceaccount", replica, "-n", ns)
        kubectl.run("create", "clusterrolebinding", f"{ns}-{replica}", "--clusterrole=cluster-admin",
                    f"--serviceaccount={ns}:{replica}")
        own = kubectl.as_service_account(ns, replica, tmp_path / f"{replica}.kubeconfig").kubeconfig
        port = free_port()
        with logs[replica].open("ab") as out:
            procs[replica] = subprocess.Popen(
                [sys.executable, "-m", "kvpersist.cli", "run", "--peering", peering, "--priority", str(priority),
                 "--metrics-host", "127.0.0.1", "--metrics-port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, "KUBECONFIG": str(own), "POD_ID": replica, "PYTHONUNBUFFERED": "1"})
        procs[replica].metrics_url = f"http://127.0.0.1:{port}/metrics"  # type: ignore[attr-defined]

    try:
        a, b = "replica-a", "replica-b"
        start(a, 10)
        obj = manifest(ns)
        kubectl.apply(obj)
        generation = kubectl.get("kvns", NAME, ns)["metadata"]["generation"]
        wait_for("status from A, alone", lambda: observed(kubectl, ns, generation), timeout=120)
        wait_for("A to say it is active", lambda: "this replica is active" in logs[a].read_text(), timeout=30)

        b_started = datetime.now(UTC)
        start(b, 20)
        record = wait_for("B in the peering record", lambda: (lambda r: r if set(r) >= set(logs) else None)(
            json.loads(kubectl.run("get", "clusterkopfpeering", peering, "-o", "json").stdout).get("status") or {}),
            timeout=60)
        assert record[b]["priority"] > record[a]["priority"]
        wait_for("A to stand by", lambda: "standing by" in logs[a].read_text(), timeout=60)
        wait_for("B to say it is active", lambda: "this replica is active" in logs[b].read_text(), timeout=60)
        more_rounds(procs[b], ns, NAME, rounds=1)  # whatever A had under way when it stood down has ended
        handed_over, a_rounds = datetime.now(UTC), refreshes(procs[a], ns, NAME)
        assert a_rounds > 0  # A did hold the resource
        more_rounds(procs[b], ns, NAME, rounds=1)  # a round of B: A's status loop had ten ticks to write in
        kill_at = datetime.now(UTC)
        # B's writes: its resume applies the resource's workloads (status it writes only on a change).
        wrote = assert_only_the_active_one_wrote(audit_log, users, b, a, handed_over, kill_at, active_since=b_started,
                                                 shows=f" {ns}/")
        # Nor did A compute one (a status it would write only where its stale caches differ).
        assert refreshes(procs[a], ns, NAME) == a_rounds, "the standby refreshed status"

        took = kill_and_take_over(kubectl, ns, obj, generation, procs[b])
        print(f"\n[ha] active replica SIGKILLed; the standby reconciled the next change after {took:.1f}s "
              f"(peering lifetime {PEERING_LIFETIME_S}s); before, {len(wrote)} writes by the active one, none by the standby")
        taken = wait_for("the former standby's writes", lambda: writes(audit_log, users[a], since=kill_at), timeout=30)
        assert any(w.startswith("patch kvcachenamespaces/status ") for w in taken), taken[:20]
        fault_log("two operator replicas with peering: A alone, then B with a higher priority; B SIGKILLed",
                  f"B took over and A stood by, writing nothing (API server audit log, {len(wrote)} writes by B meanwhile) "
                  f"though it still held the resource; after the kill A reconciled the next spec change in {took:.1f}s "
                  f"(peering lifetime {PEERING_LIFETIME_S}s)")
    finally:
        for proc in procs.values():
            stop(proc)
        kubectl.run("delete", "clusterkopfpeering", peering, "--wait=false", check=False)
        kubectl.run("delete", "clusterrolebinding", *bindings, "--ignore-not-found", check=False)
