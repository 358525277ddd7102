"""An L2 budget below the data size, with a real lmcache server: at the cap further stores are
refused and nothing stored is evicted; after the server restarts (L1 empty) the stored KV still
hits from L2 with the right bytes; status, events, `kvpersist status` and `report` show the cap."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvpersist.api.spec import l1_page_bytes
from kvpersist.api.v1alpha1 import KVCacheNamespace
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, in_pod, kvpersist_env, manifest, target_of
from tests.fsstate import files_state
from tests.integration.kvdriver import drive_subprocess

pytestmark = [pytest.mark.e2e, pytest.mark.datapath]

BUDGET = 2 * 2**20  # room for 3 encrypted chunks of 512 KiB (tests.integration.kvdriver.SHAPE), not 4


def drive(ip: str, mode: str, seqs: str) -> dict:
    return drive_subprocess(mode, f"tcp://{ip}:5555", in_pod(ip), seqs)["summary"]


def healthy(ip: str) -> bool:
    try:
        with urllib.request.urlopen(f"{in_pod(ip)}/healthcheck", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def cli(k: Kubectl, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpersist.cli", *args, "--kubeconfig", str(k.kubeconfig)],
                          capture_output=True, text=True, timeout=120)


def test_budget_refuses_new_writes_and_keeps_serving(kubectl: Kubectl, crd: None, tmp_path: Path) -> None:
    with kvpersist_env(kubectl, tmp_path) as env:
        ns, runner = env.ns, env.runner
        obj = manifest(ns)
        obj["spec"]["l2"]["nvme"].update(budget="2Mi", adapter="nixl_store_dynamic")
        get_status = lambda: kubectl.get("kvns", NAME, ns).get("status") or {}  # noqa: E731
        kubectl.apply(obj)
        folder = env.volume() / str(target_of(obj, kubectl).namespace_id)  # the id follows the generated key
        wait_for("Ready", lambda: get_status().get("phase") == "Ready", timeout=180)
        ip = kubectl.get("pod", f"{NAME}-lmcache-0", ns)["status"]["podIP"]

        first = drive(ip, "store", "0:8")  # 16 chunks, 8 MiB, into a 2 MiB budget
        assert first["stored_chunks"] == 16 and first["lookup_errors"] == 0  # accepted into L1 all the same
        status = wait_for("budget Exhausted", lambda: (lambda s: s if (s.get("budget") or {}).get("state") == "Exhausted"
                                                       else None)(get_status()), timeout=90)
        # Each 512 KiB chunk is framed by the L2 serde (spec.l2.encryption: version, IV and tag) and
        # the file padded to whole L1 pages: as many whole files as fit under the cap, and not one more.
        page = l1_page_bytes(KVCacheNamespace.model_validate(obj).spec)
        sizes = {p.stat().st_size for p in folder.iterdir()}
        assert len(sizes) == 1, sizes
        size, stored = sizes.pop(), len(list(folder.iterdir()))
        assert size == 2**19 + page and stored * size <= BUDGET < (stored + 1) * size and stored >= 3
        assert status["budget"]["bytes"] == BUDGET and stored * 2**19 < status["usage"]["l2UsedBytes"] <= stored * size
        cond = next(c for c in status["conditions"] if c["type"] == "WithinBudget")
        assert (cond["status"], cond["reason"]) == ("False", "BudgetExhausted") and "/2Mi of this namespace" in cond["message"]
        assert status["phase"] == "Ready"  # serving goes on: the cap is doing its job
        kept = files_state(folder)

        drive(ip, "store", "8:10")  # more KV: refused by L2, nothing evicted to make room
        wait_for("the store queue to drain", lambda: not any(folder.glob("*.tmp*")), timeout=30)
        assert files_state(folder) == kept

        runner.kill(f"{NAME}-lmcache-0")  # L1 is gone with the process; L2 is all that is left
        wait_for("the server to come back", lambda: healthy(ip), timeout=120, interval=1)
        served = drive(ip, "verify", "0:8")
        assert served["hit_chunks"] == stored and served["wrong_bytes"] == 0
        assert served["verified_chunks"] == served["hit_chunks"]

        events = json.loads(kubectl.run("get", "events", "-n", ns, "--field-selector", "reason=BudgetExhausted", "-o",
                                        "json").stdout)["items"]
        assert events and "2Mi" in events[0]["message"]
        table = cli(kubectl, "status", "-n", ns)
        assert table.returncode == 0 and "Exhausted" in table.stdout, table.stdout + table.stderr
        report = wait_for("the report's cap", lambda: (lambda r: r if r.returncode == 0 and "2Mi" in r.stdout else None)(
            cli(kubectl, "report", "-n", ns)), timeout=90)
        row = next(line for line in report.stdout.splitlines() if str(target_of(obj, kubectl).namespace_id) in line)
        assert "current" in row and "2Mi" in row.split()
