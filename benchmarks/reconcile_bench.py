#!/usr/bin/env python3
"""The operator on the local cluster: apply-to-Ready latency against a bare Deployment, and what
500 resources cost (time to converge, the operator's peak RSS and CPU seconds, API requests per
reconcile, API writes per minute when nothing changes).

    .venv/bin/python benchmarks/reconcile_bench.py latency        # 1 and 50 resources
    .venv/bin/python benchmarks/reconcile_bench.py scale --count 500

Brings the local cluster up when it is not running (and down again after), installs the CRD,
runs `kvpersist run` as its own process. Pods are kwok's; the one phase-Ready measurement runs
the real lmcache server for its pod (hack/kubelet_runner.py). Resources for the 50- and
500-resource runs use a Hugging Face bucket L2 (no claim to bind) and no vLLM replicas (the
GPU node has 8 GPUs), so "ready" there means the lmcache StatefulSet rolled out and the
operator wrote a status for the current generation.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "hack"))
from tests.cases.invalid_manifests import sample  # noqa: E402
from tests.e2e.kube import LOCALCLUSTER, Kubectl, bin_dir, wait_for  # noqa: E402
from tests.e2e.operator_env import RunnerThread, on_real_node  # noqa: E402
from tests.integration.hub_stub import GOOD_TOKEN, HubStub  # noqa: E402

from kubelet_runner import Runner  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


class Cluster:
    def __init__(self) -> None:
        running = subprocess.run([*LOCALCLUSTER, "status"], capture_output=True).returncode == 0
        if not running:
            subprocess.run([*LOCALCLUSTER, "up"], check=True, capture_output=True, timeout=300)
        self.started = not running
        status = subprocess.run([*LOCALCLUSTER, "status"], check=True, capture_output=True, text=True).stdout
        self.kubeconfig = Path(next(line.split()[-1] for line in status.splitlines() if line.startswith("kubeconfig")))
        self.k = Kubectl(self.kubeconfig, bin_dir() / "kubectl")
        self.k.run("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
        self.k.run("wait", "--for", "condition=established", "--timeout=60s", "crd/kvcachenamespaces.kvpersist.dev")

    def close(self) -> None:
        if self.started:
            subprocess.run([*LOCALCLUSTER, "down"], capture_output=True, timeout=120)

    def requests(self) -> dict[tuple[str, str, str], float]:
        """apiserver_request_total by (verb, resource, subresource)."""
        text = self.k.run("get", "--raw", "/metrics", timeout=60).stdout
        out: dict[tuple[str, str, str], float] = {}
        for line in text.splitlines():
            if line.startswith("apiserver_request_total{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
                key = (labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", ""))
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return out


# Reads the operator's status refresh makes, as kube-apiserver counts them (GET of its own
# workloads and Secrets, LIST of pods and claims). Other clients make some of these too (kubectl
# in this benchmark, the controllers), so this is an upper bound; writes come from the
# operator's own counters instead, which are exact.
OPERATOR_READS = {("GET", "statefulsets"), ("GET", "deployments"), ("GET", "secrets"), ("LIST", "pods"),
                  ("LIST", "persistentvolumeclaims"), ("GET", "persistentvolumeclaims")}


def operator_reads(before: dict, after: dict) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items() if (k[0], k[1]) in OPERATOR_READS and k[2] == "")


class Operator:
    def __init__(self, kubeconfig: Path, namespace: str | None, log: Path, env: dict[str, str] | None = None) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.metrics_port = sock.getsockname()[1]
        args = [sys.executable, "-m", "kvpersist.cli", "run", "--standalone", "--metrics-host", "127.0.0.1",
                "--metrics-port", str(self.metrics_port)]
        if namespace:
            args += ["--namespace", namespace]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "KUBECONFIG": str(kubeconfig), **(env or {})})
        self.peak_rss_kib = 0
        self._halt = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()
        # Started means serving its metrics, plus a moment for kopf's watches: startup is not
        # what the latency numbers are about.
        wait_for("the operator to start", self._up, 60, interval=0.2)
        time.sleep(2)

    def _up(self) -> bool:
        try:
            self.counters()
            return True
        except OSError:
            return False

    def _sample(self) -> None:
        while not self._halt.is_set() and self.proc.poll() is None:
            try:
                for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak_rss_kib = max(self.peak_rss_kib, int(line.split()[1]))
            except OSError:
                return
            self._halt.wait(0.5)

    def counters(self) -> dict[str, float]:
        """The operator's own counters (kvpersist_* from its /metrics): what it wrote, exactly."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("kvpersist_") and "{" not in line}

    def writes(self) -> float:
        c = self.counters()
        return c["kvpersist_applies_total"] + c["kvpersist_status_writes_total"] + c["kvpersist_events_total"]

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self._halt.set()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def light(ns: str, name: str) -> dict:
    obj = sample("hf-bucket")
    obj["metadata"] = {"name": name, "namespace": ns}
    obj["spec"]["l1"]["sizeGB"] = 0.25
    obj["spec"]["vllm"]["replicas"] = 0
    return obj


def deployment(ns: str, name: str) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": ns},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "c", "image": "registry.invalid/x:1"}]}}}}


def apply_and_time(k: Kubectl, objs: list[dict], ready: Callable[[dict], bool], list_args: tuple[str, ...],
                   timeout: float, key: Callable[[dict], str] = lambda o: o["metadata"]["name"]) -> list[float]:
    """Applies objs concurrently; returns per-object seconds from its apply to the first listed
    item with key(item) == its name for which ready(item) holds."""
    applied: dict[str, float] = {}
    done: dict[str, float] = {}

    def one(obj: dict) -> None:
        applied[obj["metadata"]["name"]] = time.monotonic()
        k.apply(obj)

    with ThreadPoolExecutor(max_workers=10) as pool:
        list(pool.map(one, objs))
    deadline = time.monotonic() + timeout
    while len(done) < len(objs) and time.monotonic() < deadline:
        now = time.monotonic()
        for item in json.loads(k.run(*list_args, "-o", "json", timeout=60).stdout)["items"]:
            name = key(item)
            if name in applied and name not in done and ready(item):
                done[name] = now - applied[name]
        time.sleep(0.1)
    if len(done) < len(objs):
        raise SystemExit(f"only {len(done)}/{len(objs)} ready after {timeout:.0f}s")
    return list(done.values())


def observed(o: dict) -> bool:
    return (o.get("status") or {}).get("observedGeneration") == o["metadata"]["generation"]


def ready_after_health(k: Kubectl, obj: dict, timeout: float) -> tuple[float, float]:
    """Seconds from apply to phase Ready, and to the server's own /healthcheck answering 200."""
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    t0 = time.monotonic()
    k.apply(obj)
    healthy = ready = None
    while (healthy is None or ready is None) and time.monotonic() - t0 < timeout:
        if healthy is None:
            pod = json.loads(k.run("get", "pod", f"{name}-lmcache-0", "-n", ns, "-o", "json", check=False).stdout or "{}")
            ip = (pod.get("status") or {}).get("podIP")
            try:
                with urllib.request.urlopen(f"http://{ip}:8080/healthcheck", timeout=1) as r:
                    healthy = time.monotonic() - t0 if ip and r.status == 200 else None
            except (OSError, ValueError):
                pass
        if ready is None and (k.get("kvns", name, ns).get("status") or {}).get("phase") == "Ready":
            ready = time.monotonic() - t0
        time.sleep(0.1)
    if healthy is None or ready is None:
        raise SystemExit(f"not Ready and healthy after {timeout:.0f}s")
    return ready, healthy


def latency(cluster: Cluster, work: Path) -> None:
    k = cluster.k
    rows = []
    for n in (1, 50):
        ns = f"bench-{uuid.uuid4().hex[:6]}"
        k.run("create", "namespace", ns)
        base = apply_and_time(k, [deployment(ns, f"d{i}") for i in range(n)],
                              lambda o: (o.get("status") or {}).get("readyReplicas") == 1, ("get", "deployments", "-n", ns), 300)
        op = Operator(cluster.kubeconfig, ns, work / f"operator-{n}.log")
        try:
            # Ready for a KVCacheNamespace here: its lmcache StatefulSet rolled out (kwok pod Ready),
            # the same bar as the bare Deployment; then the operator's status at that generation.
            kv = apply_and_time(k, [light(ns, f"k{i}") for i in range(n)],
                                lambda s: (s.get("status") or {}).get("readyReplicas") == 1, ("get", "statefulsets", "-n", ns),
                                300, key=lambda s: s["metadata"]["labels"]["app.kubernetes.io/instance"])
            t0 = time.monotonic()
            wait_for("every status observed", lambda ns=ns, n=n: sum(
                1 for o in json.loads(k.run("get", "kvns", "-n", ns, "-o", "json").stdout)["items"] if observed(o)) == n, 300)
            rolled = time.monotonic() - t0
        finally:
            op.stop()
            k.run("delete", "namespace", ns, "--wait=false", check=False)
        rows.append((n, base, kv, rolled))
    # One resource to phase Ready, with the real lmcache server behind its pod.
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    k.run("create", "namespace", ns)
    obj = sample("nvme-minimal")
    obj["metadata"]["namespace"] = ns
    obj["spec"]["l1"]["sizeGB"] = 0.25
    obj["spec"]["l2"] = {"nvme": {"existingClaimName": "bench-data", "maxCapacityGB": 1}}
    on_real_node(obj)  # the runner is the kubelet there: the pod turns Ready when its probes pass
    k.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "bench-data", "namespace": ns},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                      "storageClassName": "bench-none"}})
    k.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-pv"},
             "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "bench-none",
                      "hostPath": {"path": "/mnt/bench"}, "claimRef": {"namespace": ns, "name": "bench-data"}}})
    runner = Runner(cluster.kubeconfig, ns, work / "pods", kubectl=str(k.binary),
                    lmcache=str(Path(sys.executable).parent / "lmcache"))
    op = Operator(cluster.kubeconfig, ns, work / "operator-ready.log")
    try:
        with RunnerThread(runner):
            ready_s, healthy_s = ready_after_health(k, obj, 300)
    finally:
        op.stop()
        k.run("delete", "namespace", ns, "--wait=false", check=False)
        k.run("delete", "pv", f"{ns}-pv", "--wait=false", check=False)

    print("| resources | bare Deployment → Ready p50 / p95 (s) | KVCacheNamespace → its lmcache StatefulSet Ready "
          "p50 / p95 (s) | then every status observed (s) | overhead p50 (ratio) |")
    print("| --- | --- | --- | --- | --- |")
    for n, base, kv, sts in rows:
        print(f"| {n} | {statistics.median(base):.2f} / {percentile(base, 0.95):.2f} | {statistics.median(kv):.2f} / "
              f"{percentile(kv, 0.95):.2f} | {sts:.2f} | {statistics.median(kv) / statistics.median(base):.2f} |")
    print(f"\nOne KVCacheNamespace, apply → phase Ready (real lmcache server behind its pod, started by the runner): "
          f"{ready_s:.2f} s; the server answered /healthcheck at {healthy_s:.2f} s (phase Ready {ready_s - healthy_s:.2f} s later)")


def scale(cluster: Cluster, work: Path, count: int, idle_s: float) -> None:
    k = cluster.k
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    k.run("create", "namespace", ns)
    # A healthy bucket: the token's Secret exists and the Hub answers (the local stand-in of its API
    # shapes from the tests, as no Hub is reachable here), so steady state is the normal one.
    hub = HubStub(existing={"acme-ml/kv-cache"}).__enter__()
    k.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-kv-writer", "namespace": ns},
             "stringData": {"token": GOOD_TOKEN}})
    op = Operator(cluster.kubeconfig, ns, work / "operator-scale.log", env={"HF_ENDPOINT": hub.url})
    try:
        time.sleep(3)
        cpu0, req0, w0 = op.cpu_seconds(), cluster.requests(), op.writes()
        t0 = time.monotonic()
        objs = [light(ns, f"s{i:04d}") for i in range(count)]
        with ThreadPoolExecutor(max_workers=10) as pool:
            list(pool.map(lambda chunk: k.apply({"apiVersion": "v1", "kind": "List", "items": chunk}),
                          [objs[i:i + 25] for i in range(0, count, 25)]))

        def all_observed() -> bool:
            items = json.loads(k.run("get", "kvns", "-n", ns, "-o", "json", timeout=120).stdout)["items"]
            return sum(1 for o in items if (o.get("status") or {}).get("observedGeneration")
                       == o["metadata"]["generation"]) == count

        wait_for(f"{count} resources reconciled", all_observed, 1800, interval=2)
        converge_s = time.monotonic() - t0
        cpu1, req1, w1 = op.cpu_seconds(), cluster.requests(), op.writes()
        # Settle: first statuses are written at reconcile time, later ones as pods get scheduled and
        # the loop comes round. Idle starts when the operator has written nothing for 30 s.
        settle_t0, last, quiet_since = time.monotonic(), op.writes(), time.monotonic()
        while time.monotonic() - quiet_since < 30 and time.monotonic() - settle_t0 < 600:
            time.sleep(2)
            now_writes = op.writes()
            if now_writes != last:
                last, quiet_since = now_writes, time.monotonic()
        settle_s = time.monotonic() - settle_t0 - 30
        req2, cpu2, w2 = cluster.requests(), op.cpu_seconds(), op.writes()
        time.sleep(idle_s)
        req3, cpu3, w3 = cluster.requests(), op.cpu_seconds(), op.writes()
    finally:
        op.stop()
        hub.__exit__(None, None, None)
        k.run("delete", "namespace", ns, "--wait=false", check=False)
    writes_per_reconcile = (w1 - w0) / count
    per_reconcile = writes_per_reconcile + operator_reads(req0, req1) / count
    idle_writes = (w3 - w2) * 60 / idle_s
    idle_reads = operator_reads(req2, req3) * 60 / idle_s
    print("| resources | all reconciled (s) | statuses settled (s more) | operator peak RSS (MiB) | operator CPU to converge (s) | "
          "API requests / reconcile (writes) | idle: API writes / min | idle: API reads / min | idle: operator CPU / min (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {count} | {converge_s:.1f} | {settle_s:.0f} | {op.peak_rss_kib / 1024:.0f} | {cpu1 - cpu0:.1f} | "
          f"{per_reconcile:.1f} ({writes_per_reconcile:.1f}) | {idle_writes:.1f} | {idle_reads:.0f} | "
          f"{(cpu3 - cpu2) * 60 / idle_s:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("latency")
    sc = sub.add_parser("scale")
    sc.add_argument("--count", type=int, default=500)
    sc.add_argument("--idle-seconds", type=float, default=60)
    args = parser.parse_args()
    cluster = Cluster()
    work = Path(tempfile.mkdtemp(prefix="kvpersist-bench-"))
    try:
        if args.what == "latency":
            latency(cluster, work)
        else:
            scale(cluster, work, args.count, args.idle_seconds)
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
