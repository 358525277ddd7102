"""A full L2 volume under a running KVCacheNamespace: stores fail, the server keeps serving, and
the resource's status says so (L2Ready=False, L2WritesFailing, phase Degraded), although
lmcache's own /status still calls every part healthy."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, Runner, RunnerThread, manifest, start_operator, stop, storage
from tests.integration.kvdriver import drive_subprocess

pytestmark = [pytest.mark.e2e, pytest.mark.datapath]


def drive(ip: str, mode: str, seqs: str) -> dict:
    return drive_subprocess(mode, f"tcp://{ip}:5555", f"http://{ip}:8080", seqs)["summary"]


def test_full_volume_is_reported_and_serving_continues(kubectl: Kubectl, crd: None, tmp_path: Path) -> None:
    ns = f"e2e-{uuid.uuid4().hex[:8]}"
    kubectl.run("create", "namespace", ns)
    kubectl.apply(storage(ns))
    runner = Runner(kubectl.kubeconfig, ns, tmp_path / "pods", kubectl=str(kubectl.binary),
                    lmcache=str(Path(sys.executable).parent / "lmcache"))
    volume = runner.volume_dir(f"l2-{NAME}-lmcache-0")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(volume)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): the disk-full case needs root")
    operator = start_operator(kubectl.kubeconfig, ns, tmp_path / "operator.log")
    try:
        with RunnerThread(runner):
            kubectl.apply(manifest(ns))
            get_status = lambda: kubectl.get("kvns", NAME, ns).get("status") or {}  # noqa: E731
            wait_for("Ready", lambda: get_status().get("phase") == "Ready", timeout=180)
            ip = kubectl.get("pod", f"{NAME}-lmcache-0", ns)["status"]["podIP"]

            stored = drive(ip, "store", "0:16")  # 32 chunks of 512 KiB into 4 MiB
            assert stored["lookup_errors"] == 0
            status = wait_for("L2WritesFailing", lambda: (lambda s: s if any(
                c["type"] == "L2Ready" and c["reason"] == "L2WritesFailing" for c in s.get("conditions", [])) else None)(
                get_status()), timeout=60)
            l2 = next(c for c in status["conditions"] if c["type"] == "L2Ready")
            assert l2["status"] == "False" and "full" in l2["message"]
            assert status["phase"] == "Degraded"
            assert status["servers"][0]["healthy"] is True  # the server itself is fine

            served = drive(ip, "verify", "0:16")  # serving continues from L1
            assert served["hit_chunks"] == 32 and served["wrong_bytes"] == 0
            events = kubectl.run("get", "events", "-n", ns, "--field-selector", "reason=Degraded", "-o", "json").stdout
            assert any("L2WritesFailing" in e["message"] or "full" in e["message"] for e in json.loads(events)["items"])
    finally:
        stop(operator)
        subprocess.run(["umount", "-l", str(volume)], check=False)
        kubectl.run("delete", "namespace", ns, "--wait=false", check=False)
        kubectl.run("delete", "pv", f"{ns}-pv", "--wait=false", check=False)
        kubectl.run("delete", "storageclass", f"{ns}-nvme", check=False)
