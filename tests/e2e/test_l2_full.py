"""A full L2 volume under a running KVCacheNamespace: stores fail, the server keeps serving, and
the resource's status says so (L2Ready=False, L2WritesFailing, phase Degraded), although
lmcache's own /status still calls every part healthy."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, in_pod, kvpersist_env, manifest
from tests.integration.kvdriver import drive_subprocess

pytestmark = [pytest.mark.e2e, pytest.mark.datapath]


def drive(ip: str, mode: str, seqs: str) -> dict:
    return drive_subprocess(mode, f"tcp://{ip}:5555", in_pod(ip), seqs)["summary"]


def test_full_volume_is_reported_and_serving_continues(kubectl: Kubectl, crd: None, tmp_path: Path) -> None:
    with kvpersist_env(kubectl, tmp_path) as env:
        ns = env.ns
        volume = env.volume()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(volume)], capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): the disk-full case needs root")
        try:
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
            subprocess.run(["umount", "-l", str(volume)], check=False)
