#!/usr/bin/env python3
"""The operator on the local cluster: apply-to-Ready latency against a bare Deployment, and what
500 resources cost (time to converge, the operator's peak RSS and CPU seconds, API requests per
reconcile, API writes per minute when nothing changes).

    .venv/bin/python benchmarks/reconcile_bench.py latency        # 1 and 50 resources (--faults: under them)
    .venv/bin/python benchmarks/reconcile_bench.py latency --trials 7 --trials-50 2 --no-phase-ready
    .venv/bin/python benchmarks/reconcile_bench.py scale --count 500
    .venv/bin/python benchmarks/reconcile_bench.py scale --count 100 --with-named   # each naming its claim and a key Secret
    .venv/bin/python benchmarks/reconcile_bench.py scale --count 500 --unschedulable  # servers Pending forever
    .venv/bin/python benchmarks/reconcile_bench.py hostile --count 1000  # RSS under others' huge ConfigMaps and Secrets

Brings the local cluster up when it is not running (and down again after), installs the CRD,
runs `kvpersist run` as its own process. Pods are kwok's; the one phase-Ready measurement runs
the real lmcache server for its pod (hack/kubelet_runner.py). Resources for the 50- and
500-resource runs use a Hugging Face bucket L2 (no claim to bind) and no vLLM replicas (the
GPU node has 8 GPUs), so "ready" there means the lmcache StatefulSet rolled out and the
operator wrote a status for the current generation. `scale` adds kwok nodes with room for every
server pod (and deletes them after), or with --unschedulable measures servers that never run;
`latency` adds them too (50 of each kind at once do not fit the cluster's GPU node), prints each
trial's phases as they end, where one resource's time goes (watch events and the operator's own
requests from the audit log), and, when objects never get Ready, which and why, after the
figures measured before.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
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
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "hack"))
from kubernetes import client as kclient  # noqa: E402
from kubernetes import config as kconfig  # noqa: E402
from kubernetes import watch as kwatch  # noqa: E402
from tests.cases.invalid_manifests import sample  # noqa: E402
from tests.e2e.audit import WRITE_VERBS, events  # noqa: E402
from tests.e2e.kube import LOCALCLUSTER, Kubectl, bin_dir, wait_for  # noqa: E402
from tests.e2e.operator_env import RunnerThread, in_pod, on_real_node  # noqa: E402
from tests.integration.hub_stub import GOOD_TOKEN, HubStub  # noqa: E402

from kubelet_runner import CLUSTER_DOMAIN, Runner  # noqa: E402


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
        self.audit_log = Path(next(line.split()[-1] for line in status.splitlines() if line.startswith("audit log")))
        self.k = Kubectl(self.kubeconfig, bin_dir() / "kubectl")
        self.k.run("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
        self.k.wait_established("kvcachenamespaces.kvpersist.dev")

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


# Reads of the kinds a status refresh used to make, as kube-apiserver counts them from every client
# (kube-controller-manager's garbage collector among them): printed beside the operator's own
# requests, which the audit log gives exactly (AuditedRequests).
OPERATOR_READS = {("GET", "statefulsets"), ("GET", "deployments"), ("GET", "secrets"), ("LIST", "pods"),
                  ("LIST", "persistentvolumeclaims"), ("GET", "persistentvolumeclaims")}


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
                                         env={**os.environ, "KUBECONFIG": str(kubeconfig),
                                              "KVPERSIST_CLUSTER_DOMAIN": CLUSTER_DOMAIN, **(env or {})})
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

    def rss_kib(self) -> int:
        from tests.e2e.test_hostile_peers_e2e import RssSampler

        return RssSampler(self.proc.pid).read() // 1024

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
    obj["spec"]["l1"]["size"] = "256Mi"
    obj["spec"]["vllm"]["replicas"] = 0
    return obj


NAMED_LABEL = "kvpersist.dev/usable-by=kvpersist"


def named(ns: str, name: str) -> dict:
    """A resource that names what the status refresh used to read by request every round: its own
    claim (existingClaimName) and a labelled key Secret (keySecretRef; the operator runs with secretLabel)."""
    obj = sample("nvme-minimal")
    obj["metadata"] = {"name": name, "namespace": ns}
    obj["spec"]["l1"]["size"] = "256Mi"
    obj["spec"]["l2"] = {"nvme": {"existingClaimName": f"{name}-data", "maxCapacity": "1Gi"},
                         "encryption": {"keySecretRef": {"name": "bench-key"}}}
    obj["spec"]["vllm"]["replicas"] = 0
    return obj


def user_claim(ns: str, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": f"{name}-data", "namespace": ns},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}},
                     "storageClassName": f"{ns}-none"}}


# What a named Secret or claim cost per round, read one by one.
NAMED_READS = {("GET", "secrets"), ("GET", "persistentvolumeclaims")}


def deployment(ns: str, name: str) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": ns},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "c", "image": "registry.invalid/x:1"}]}}}}


class Watches:
    """Watch events of Deployments, StatefulSets and KVCacheNamespaces in one namespace, each stamped
    with its arrival (time.monotonic()) by a thread per kind. Apply-to-Ready is timed from these,
    not from a poll loop (whose round, about 0.35 s with kubectl, was coarser than a 1-resource
    figure). Each watch starts at the resourceVersion of a list made first: no event is missed."""

    def __init__(self, kubeconfig: Path, ns: str) -> None:
        self.api = kconfig.new_client_from_config(config_file=str(kubeconfig))
        apps, custom = kclient.AppsV1Api(self.api), kclient.CustomObjectsApi(self.api)
        crd = {"group": "kvpersist.dev", "version": "v1alpha1", "plural": "kvcachenamespaces"}
        self.events: list[tuple[float, str, str, dict]] = []  # (arrival, kind, type, object)
        self.lock = threading.Lock()
        self.watches: list[kwatch.Watch] = []
        self.threads: list[threading.Thread] = []
        # Pods too: when each workload's pod was created, bound to a node and Ready (the timeline of
        # apply → Ready), and what a pod that never got Ready shows.
        for kind, fn, kw in (("Deployment", apps.list_namespaced_deployment, {}),
                             ("StatefulSet", apps.list_namespaced_stateful_set, {}),
                             ("KVCacheNamespace", custom.list_namespaced_custom_object, crd),
                             ("Pod", kclient.CoreV1Api(self.api).list_namespaced_pod, {})):
            listed = fn(namespace=ns, _request_timeout=30, **kw)
            rv = listed["metadata"]["resourceVersion"] if isinstance(listed, dict) else listed.metadata.resource_version
            w = kwatch.Watch()
            self.watches.append(w)
            thread = threading.Thread(target=self._follow, args=(w, kind, fn, ns, rv, kw), daemon=True, name=f"watch-{kind}")
            thread.start()
            self.threads.append(thread)
        time.sleep(1)  # the watch requests under way before anything is created (they miss nothing either way)

    def _follow(self, w: kwatch.Watch, kind: str, fn: Callable[..., Any], ns: str, rv: str, kw: dict) -> None:
        with contextlib.suppress(Exception):  # ends when stopped, or when the connection goes at close()
            for event in w.stream(fn, namespace=ns, resource_version=rv, timeout_seconds=900, **kw):
                now = time.monotonic()
                with self.lock:
                    self.events.append((now, kind, event["type"], event["raw_object"]))

    def first(self, kind: str, key: Callable[[dict], str | None], pred: Callable[[dict], bool]) -> dict[str, float]:
        """Per key(object): the arrival of the first event of kind whose object satisfies pred."""
        found: dict[str, float] = {}
        with self.lock:
            for at, k, _type, obj in self.events:
                name = key(obj) if k == kind else None
                if name is not None and name not in found and pred(obj):
                    found[name] = at
        return found

    def latest(self, kind: str, key: Callable[[dict], str | None]) -> dict[str, list[dict]]:
        """Per key(object): the last state of each object of kind seen (none once DELETED)."""
        last: dict[tuple[str, str], dict | None] = {}
        with self.lock:
            for _at, k, type_, obj in self.events:
                name = key(obj) if k == kind else None
                if name is not None:
                    last[name, obj["metadata"]["name"]] = None if type_ == "DELETED" else obj
        out: dict[str, list[dict]] = {}
        for (name, _), obj in last.items():
            if obj is not None:
                out.setdefault(name, []).append(obj)
        return out

    def close(self) -> None:
        for w in self.watches:
            w.stop()
        self.api.close()
        for thread in self.threads:
            thread.join(timeout=5)


class NotReady(Exception):
    """Objects not Ready in time; the message says which and why (their pods, conditions, events)."""


def create_and_time(api: kclient.ApiClient, watches: Watches, objs: list[dict], kind: str,
                    key: Callable[[dict], str | None], ready: Callable[[dict], bool], timeout: float,
                    created: dict[str, float] | None = None, returned: dict[str, float] | None = None) -> list[float]:
    """Creates objs, 10 at a time; per object, seconds from just before its create call (kept in
    created; the call's return in returned) to the arrival of the first watch event of kind (keyed
    by key) for which ready holds. Raises NotReady naming the objects that were not, and why."""
    created = {} if created is None else created
    returned = {} if returned is None else returned

    def one(obj: dict) -> None:
        created[obj["metadata"]["name"]] = time.monotonic()
        if obj["kind"] == "Deployment":
            kclient.AppsV1Api(api).create_namespaced_deployment(obj["metadata"]["namespace"], obj, _request_timeout=60)
        elif obj["kind"] == "StatefulSet":
            kclient.AppsV1Api(api).create_namespaced_stateful_set(obj["metadata"]["namespace"], obj, _request_timeout=60)
        else:
            kclient.CustomObjectsApi(api).create_namespaced_custom_object(
                "kvpersist.dev", "v1alpha1", obj["metadata"]["namespace"], "kvcachenamespaces", obj, _request_timeout=60)
        returned[obj["metadata"]["name"]] = time.monotonic()

    with ThreadPoolExecutor(max_workers=10) as pool:
        list(pool.map(one, objs))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = watches.first(kind, key, ready)
        if len(done.keys() & created.keys()) == len(objs):
            return [done[name] - at for name, at in created.items()]
        time.sleep(0.05)
    # Only this call's objects count (the watch has every earlier phase's objects of the kind too).
    late = sorted(created.keys() - watches.first(kind, key, ready).keys())
    raise NotReady(f"only {len(objs) - len(late)}/{len(objs)} {kind}s ready after {timeout:.0f}s; not ready:\n"
                   + why_not_ready(api, watches, objs[0]["metadata"]["namespace"], kind, key, late))


def pod_key(o: dict) -> str | None:
    """The workload a bench pod belongs to: its instance label (lmcache servers), else its app label (the bare ones)."""
    labels = o["metadata"].get("labels") or {}
    return labels.get("app.kubernetes.io/instance") or labels.get("app")


def _conditions(o: dict, *false_only: str) -> str:
    out = []
    for c in (o.get("status") or {}).get("conditions") or []:
        if false_only and (c.get("type") not in false_only or c.get("status") == "True"):
            continue
        out.append(f"{c.get('type')}={c.get('status')}" + (f" {c.get('reason')}" if c.get("reason") else "")
                   + (f": {c.get('message')}" if c.get("message") else ""))
    return "; ".join(out)


def why_not_ready(api: kclient.ApiClient, watches: Watches, ns: str, kind: str, key: Callable[[dict], str | None],
                  late: list[str]) -> str:
    """For each object not Ready: its workload's replicas, its pods' phase and failing conditions, the
    Warning events about them (and, for a KVCacheNamespace, its own conditions), grouped by that
    reason, so fifty objects stuck on one cause read as one line."""
    workloads, kvns = watches.latest(kind, key), watches.latest("KVCacheNamespace", by_name)
    every_pod = [objs[0] for objs in watches.latest("Pod", by_name).values()]
    # A workload's pods: its key's (a resource's instance label, a bare one's app label) or named after it.
    pods = {name: [p for p in every_pod if pod_key(p) == name or p["metadata"]["name"].startswith(f"{name}-")] for name in late}
    unread = ""
    try:
        listed = kclient.CoreV1Api(api).list_namespaced_event(ns, _request_timeout=30)
        warnings = [api.sanitize_for_serialization(e) for e in listed.items if e.type == "Warning"]
    except Exception as exc:  # a diagnosis: say what could not be read, and go on
        warnings, unread = [], f"\n  (the namespace's events could not be read: {exc})"
    by_reason: dict[str, list[str]] = {}
    for name in late:
        parts = []
        if kind == "StatefulSet" and name in kvns and name not in workloads:
            conditions = _conditions(kvns[name][0], "Ready", "Progressing", "Degraded") or "no status yet"
            parts.append(f"no StatefulSet made by the operator; the resource: {conditions}")
        for w in workloads.get(name, []):
            st = w.get("status") or {}
            parts.append(f"{kind} replicas {st.get('replicas', 0)}, ready {st.get('readyReplicas', 0)}")
        if name in workloads and not pods.get(name):
            parts.append("no pod")
        for pod in pods.get(name, []):
            st = pod.get("status") or {}
            parts.append(f"pod {st.get('phase', '?')}" + (f" on {pod['spec']['nodeName']}" if pod["spec"].get("nodeName") else "")
                         + (f" ({_conditions(pod, 'PodScheduled', 'Ready')})" if _conditions(pod, "PodScheduled", "Ready") else ""))
        seen = set()
        for e in warnings:  # the latest few, one per reason
            involved = (e.get("involvedObject") or {}).get("name", "")
            if involved.startswith(name) and e.get("reason") not in seen:
                seen.add(e.get("reason"))
                parts.append(f"event {e.get('reason')}: {e.get('message')}")
        # Names stripped from the reason so that objects stuck alike group together.
        reason = re.sub(rf"\b{re.escape(name)}\b", "<name>", "; ".join(parts) or "nothing seen of it (no workload, no pod)")
        by_reason.setdefault(reason, []).append(name)
    lines = []
    for reason, names in sorted(by_reason.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        lines.append(f"  {len(names)} ({shown}): {reason}")
    return "\n".join(lines) + unread


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
            if ip:
                try:
                    with urllib.request.urlopen(f"{in_pod(ip)}/healthcheck", timeout=1) as r:  # its loopback only
                        healthy = time.monotonic() - t0 if r.status == 200 else None
                except (OSError, ValueError):
                    pass
        if ready is None and (k.get("kvns", name, ns).get("status") or {}).get("phase") == "Ready":
            ready = time.monotonic() - t0
        time.sleep(0.1)
    if healthy is None or ready is None:
        raise SystemExit(f"not Ready and healthy after {timeout:.0f}s")
    return ready, healthy


def bucket_secret(ns: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-kv-writer", "namespace": ns},
            "stringData": {"token": GOOD_TOKEN}}


class FaultScene:
    """The faults of tests/e2e/test_hostile_peers_e2e.py, held while the latency trials run: three
    resources whose server pods' agents are stand-ins (small HTTP servers in this process on the
    kwok pods' loopback IPs, named as such there) that trickle, answer garbage and send 100 MB, and
    a Hub (the stub) whose bucket listing hangs, for every hfBucket resource, the trials' too."""

    def __init__(self, k: Kubectl, hub: HubStub) -> None:
        from tests.e2e.operator_env import target_of
        from tests.e2e.test_faults import light as light_nvme
        from tests.e2e.test_hostile_peers_e2e import FAULTS, HangingListings, StandInAgent, _claimed, _simulated

        self.k, self.halt, self.release = k, threading.Event(), threading.Event()
        self.hanging = HangingListings(hub, self.release)
        self.ns = f"bench-faults-{uuid.uuid4().hex[:6]}"
        self.agents: list[StandInAgent] = []
        self.faults = FAULTS
        k.run("create", "namespace", self.ns)
        objs = [_simulated(light_nvme(self.ns, f)) for f in FAULTS]
        k.apply({"apiVersion": "v1", "kind": "List", "items": [o for f in FAULTS for o in _claimed(self.ns, f)] + objs})

        def ips() -> dict[str, str] | None:
            pods = {p["metadata"]["name"]: p.get("status") or {} for p in k.get("pods", namespace=self.ns)["items"]}
            found = {f: (pods.get(f"{f}-lmcache-0") or {}).get("podIP") for f in FAULTS}
            return found if all(found.values()) else None

        wait_for("the faulty resources' server pods", lambda: ips() is not None, 150, interval=1)
        for i, (fault, obj) in enumerate(zip(FAULTS, objs, strict=True)):
            target = target_of(obj)
            raw = k.get("secret", target.agent_token_secret, self.ns)["data"]["token"]
            agent = StandInAgent(f"{fault}-lmcache-0", ips()[fault], target.spec.lmcache_server.agent_port,
                                 base64.b64decode(raw).decode().strip(), (i + 1) * 2**24, self.halt)
            agent.mode = fault
            self.agents.append(agent)

        def unhealthy() -> bool:
            items = k.get("kvns", namespace=self.ns)["items"]
            return len(items) == len(FAULTS) and all(
                any(c["type"] == "LMCacheReady" and c["status"] == "False" for c in (o.get("status") or {}).get("conditions", []))
                for o in items)

        wait_for("the faulty resources to show unhealthy", unhealthy, 120, interval=1)

    def close(self) -> None:
        self.halt.set()
        self.release.set()
        for agent in self.agents:
            agent.close()
        self.hanging.join()
        self.k.run("delete", "namespace", self.ns, "--wait=false", check=False)
        self.k.run("delete", "pv", *[f"{self.ns}-{f}-pv" for f in self.faults], "--wait=false", "--ignore-not-found",
                   check=False)


def sts_instance(s: dict) -> str | None:
    return (s["metadata"].get("labels") or {}).get("app.kubernetes.io/instance")


def one_ready(o: dict) -> bool:
    return (o.get("status") or {}).get("readyReplicas") == 1


def statefulset(ns: str, name: str) -> dict:
    """A bare StatefulSet with the bare Deployment's pod: what the kind itself costs, without an operator."""
    obj = deployment(ns, name)
    obj["kind"] = "StatefulSet"
    obj["spec"]["serviceName"] = name
    return obj


def rendered(ns: str, name: str) -> dict:
    """The lmcache StatefulSet the operator renders for light(ns, name), to be created by hand: what
    its pod (two containers, a required anti-affinity, a runtimeClassName) costs, without an operator."""
    from tests.e2e.operator_env import target_of

    from kvpersist.builders.lmcache import build_lmcache_statefulset
    return build_lmcache_statefulset(target_of(light(ns, name)))


def by_name(o: dict) -> str:
    return o["metadata"]["name"]


def bare_sts(o: dict) -> str | None:
    return None if sts_instance(o) else o["metadata"]["name"]  # the operator's carry its instance label


def pod_bound(o: dict) -> bool:
    return bool(o["spec"].get("nodeName"))


def pod_ready(o: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in (o.get("status") or {}).get("conditions") or [])


def anything(_o: dict) -> bool:
    return True


def timeline(watches: Watches, kind: str, key: Callable[[dict], str | None], name: str, created: float,
             returned: float, operator: list[tuple[float, float, str]] | None = None,
             clock: float = 0.0, pod_of: str | None = None) -> dict[str, float]:
    """One object's way from its create call to Ready, as seconds from just before the call: the
    call's return, the watch events' arrivals here (its ADDED, its workload's, its pod's ADDED, bound
    and Ready, the workload's readyReplicas 1) and, for a KVCacheNamespace, every request the operator
    made in the namespace until then (received → completed, from the audit log; clock = time.time()
    - time.monotonic()). pod_of: its pods' key (pod_key), when not name."""
    out = {"create call returned": returned - created}
    if kind == "KVCacheNamespace":
        out["KVCacheNamespace ADDED"] = watches.first("KVCacheNamespace", by_name, anything)[name] - created
        wkind, wkey = "StatefulSet", sts_instance
    else:
        wkind, wkey = kind, key
    out[f"{wkind} ADDED"] = watches.first(wkind, wkey, anything)[name] - created
    for label, pred in (("pod ADDED", anything), ("pod bound to a node", pod_bound), ("pod Ready", pod_ready)):
        at = watches.first("Pod", pod_key, pred).get(pod_of or name)
        if at is not None:
            out[label] = at - created
    ready_at = watches.first(wkind, wkey, one_ready)[name]
    out[f"{wkind} readyReplicas 1"] = ready_at - created
    seen: Counter[str] = Counter()
    for received, completed, what in operator or []:
        received, completed = received - clock, completed - clock
        if received < created - 0.5 or received > ready_at:
            continue
        what = re.sub(r"-[0-9a-f]{8}\b", "-<id>", what)  # the per-id names: a new key, so a new id, each trial
        seen[what] += 1
        label = f"operator: {what}" + (f" #{seen[what]}" if seen[what] > 1 else "")
        out[label + " (received)"] = received - created
        out[label + " (completed)"] = completed - created
    return out


def print_timelines(title: str, lines: list[dict[str, float]]) -> None:
    """The median of each step over the trials, in order of time; an operator request as received → completed."""
    steps: dict[str, list[float]] = {}
    for line in lines:
        for label, at in line.items():
            steps.setdefault(label, []).append(at)
    med = {label: statistics.median(v) for label, v in steps.items()}
    print(f"  {title} (median of {len(lines)}):", flush=True)
    for label in sorted(med, key=lambda lab: med[lab]):
        if label.endswith(" (completed)"):
            continue
        if label.endswith(" (received)"):
            base = label.removesuffix(" (received)")
            seen = f" (in {len(steps[label])} of {len(lines)})" if len(steps[label]) != len(lines) else ""
            print(f"    {med[label]:7.3f} → {med[base + ' (completed)']:.3f}  {base}{seen}", flush=True)
        else:
            print(f"    {med[label]:7.3f}  {label}", flush=True)


def latency(cluster: Cluster, work: Path, trials: dict[int, int], faults: bool) -> None:
    """Per trial, a fresh namespace: n bare Deployments created, then n bare StatefulSets, then n
    KVCacheNamespaces; each object's apply to its first workload Ready, timed from watch events.
    One operator process for all trials (cluster-wide), its memory read between them. Each phase
    prints as it completes; a phase whose objects never get Ready says which and why, and the
    figures measured before it still print."""
    k = cluster.k
    # Room for every pod of a trial (the bare Deployments', the bare StatefulSets' and the rendered
    # ones' at once): the cluster's GPU node fits 110 pods and 48 servers (2 CPUs each of 96), and
    # the bare pods, which ask for nothing, land mostly there; with 50 of each, 15 of the 50
    # hand-made servers stayed Pending ("Too many pods").
    nodes = bench_nodes(k, 3 * max((n for n, c in trials.items() if c), default=1))
    hub = HubStub(existing={"acme-ml/kv-cache"}).__enter__()
    scene: FaultScene | None = None
    # The operator as a ServiceAccount of its own, so that the audit log has its requests (the timeline).
    op_ns = f"bench-op-{uuid.uuid4().hex[:6]}"
    k.run("create", "namespace", op_ns)
    audited = AuditedRequests(cluster, op_ns, work)
    op = Operator(audited.as_operator.kubeconfig, None, work / "operator-latency.log", env={"HF_ENDPOINT": hub.url})
    print(f"latency: trials {trials}; {len(nodes)} bench nodes added; operator log {work / 'operator-latency.log'}", flush=True)
    rss = {"idle": op.rss_kib()}
    rows: list[tuple[int, dict[str, list[list[float]]]]] = []
    lines: dict[str, list[dict[str, float]]] = {"deploy": [], "rendered": [], "kv": []}
    failed: Exception | None = None

    def phase(label: str, run_list: list[list[float]]) -> None:
        print(f" {label} {statistics.median(run_list[-1]):.3f}", end="", flush=True)

    try:
        if faults:
            scene = FaultScene(k, hub)
            rss["with the faults"] = op.rss_kib()
        for n, count in trials.items():
            if not count:
                continue
            runs: dict[str, list[list[float]]] = {"deploy": [], "sts": [], "rendered": [], "kv": [], "hop": [], "status": []}
            rows.append((n, runs))
            for trial in range(count):
                ns = f"bench-{uuid.uuid4().hex[:6]}"
                k.run("create", "namespace", ns)
                k.apply(bucket_secret(ns))
                watches = Watches(cluster.kubeconfig, ns)
                print(f"{n} at once, trial {trial + 1}/{count} ({ns}), p50 s from the create call:", end="", flush=True)
                try:
                    d_created: dict[str, float] = {}
                    d_returned: dict[str, float] = {}
                    deploy = create_and_time(watches.api, watches, [deployment(ns, f"d{i}") for i in range(n)],
                                             "Deployment", by_name, one_ready, 300, d_created, d_returned)
                    runs["deploy"].append(deploy)
                    phase("bare Deployment", runs["deploy"])
                    runs["sts"].append(create_and_time(watches.api, watches, [statefulset(ns, f"s{i}") for i in range(n)],
                                                       "StatefulSet", bare_sts, one_ready, 300))
                    phase("| bare StatefulSet", runs["sts"])
                    by_hand = [rendered(ns, f"r{i}") for i in range(n)]
                    r_created: dict[str, float] = {}
                    r_returned: dict[str, float] = {}
                    runs["rendered"].append(create_and_time(watches.api, watches, by_hand, "StatefulSet", by_name, one_ready, 300,
                                                            r_created, r_returned))
                    phase("| rendered lmcache StatefulSet by hand", runs["rendered"])
                    # Gone before the resources come: their pods take the same room on the nodes.
                    k.run("delete", "statefulset", *[o["metadata"]["name"] for o in by_hand], "-n", ns, "--wait=true",
                          "--cascade=foreground", timeout=300)
                    wait_for("the hand-made StatefulSets' pods gone", lambda ns=ns: not [
                        p for p in k.get("pods", namespace=ns)["items"] if p["metadata"]["name"].startswith("r")], 300)
                    # Ready for a KVCacheNamespace: its lmcache StatefulSet rolled out (kwok pod Ready),
                    # the same bar as the bare ones'; then the operator's status at that generation.
                    objs, created, returned = [light(ns, f"k{i}") for i in range(n)], {}, {}
                    clock = time.time() - time.monotonic()
                    kv = create_and_time(watches.api, watches, objs, "StatefulSet", sts_instance, one_ready, 300, created, returned)
                    runs["kv"].append(kv)
                    made = watches.first("StatefulSet", sts_instance, anything)  # its ADDED event
                    runs["hop"].append([made[name] - created[name] for name in created])
                    phase("| KVCacheNamespace → its StatefulSet Ready", runs["kv"])
                    phase("(its StatefulSet created at", runs["hop"])
                    print(f"; {statistics.median(kv) / statistics.median(deploy):.2f}x the Deployment)", end="", flush=True)
                    try:
                        wait_for("every status observed", lambda n=n, w=watches: len(w.first(
                            "KVCacheNamespace", by_name, observed)) == n, 120, interval=0.1)
                    except AssertionError as exc:  # wait_for's timeout: say which, keep the figures
                        late = sorted(set(created) - watches.first("KVCacheNamespace", by_name, observed).keys())
                        raise NotReady(f"{exc}: no status at its generation from {len(late)} of {n}:\n" + why_not_ready(
                            watches.api, watches, ns, "StatefulSet", sts_instance, late)) from exc
                    seen = watches.first("KVCacheNamespace", by_name, observed)
                    runs["status"].append([seen[name] - created[name] for name in seen])
                    phase("| first status at its generation", runs["status"])
                    print(flush=True)
                    if n == 1:
                        lines["deploy"].append(timeline(watches, "Deployment", by_name, "d0", d_created["d0"], d_returned["d0"]))
                        lines["rendered"].append(timeline(watches, "StatefulSet", by_name, "r0-lmcache", r_created["r0-lmcache"],
                                                          r_returned["r0-lmcache"], pod_of="r0"))
                        lines["kv"].append(timeline(watches, "KVCacheNamespace", sts_instance, "k0", created["k0"],
                                                    returned["k0"], audited.in_namespace(ns), clock))
                except Exception as exc:  # the figures measured so far still print (below), then the failure
                    what = "NOT READY" if isinstance(exc, NotReady) else f"FAILED ({type(exc).__name__})"
                    print(f"\n{what} ({n} at once, trial {trial + 1}): {exc}", flush=True)
                    failed = exc
                finally:
                    watches.close()
                    # Gone before the next trial: a namespace still being emptied costs the next one time.
                    k.run("delete", "namespace", ns, "--wait=true", timeout=300, check=False)
                if failed is not None:
                    break
            rss[f"after the {n}-resource trials"] = op.rss_kib()
            if n == 1 and lines["kv"]:
                print("Where one resource's time goes, seconds from just before its create call (watch events as they "
                      "arrived here; the operator's requests in its namespace, received → completed, from the audit log):",
                      flush=True)
                print_timelines("bare Deployment", lines["deploy"])
                print_timelines("the rendered lmcache StatefulSet, created by hand", lines["rendered"])
                print_timelines("KVCacheNamespace", lines["kv"])
            print_table(rows, trials, faults)
            if failed is not None:
                break
    finally:
        op.stop()
        audited.close()
        k.run("delete", "namespace", op_ns, "--wait=false", check=False)
        if scene is not None:
            scene.close()
        hub.__exit__(None, None, None)
        for node in nodes:
            k.run("delete", "node", node, "--wait=false", check=False)
    print("\nOperator RSS (MiB): " + ", ".join(f"{what} {kib / 1024:.0f}" for what, kib in rss.items())
          + f"; peak {op.peak_rss_kib / 1024:.0f}", flush=True)
    if failed is not None:
        raise SystemExit(f"latency: stopped at the failure above; the figures measured before it are printed. "
                         f"{type(failed).__name__}: {str(failed).splitlines()[0]}")


def print_table(rows: list[tuple[int, dict[str, list[list[float]]]]], trials: dict[int, int], faults: bool) -> None:
    """The table of every trial completed so far (a trial cut short counts in none of its columns)."""
    def p50(run_list: list[list[float]]) -> str:
        values = [x for run in run_list for x in run]
        return f"{statistics.median(values):.3f}" if values else "—"

    def ratios(run_list: list[list[float]], base: list[list[float]]) -> str:
        """The per-trial ratios' median, and their middle half (p25 to p75): one slow trial on two
        shared cores (a namespace still being deleted) should not set the range."""
        each = [statistics.median(a) / statistics.median(b) for a, b in zip(run_list, base, strict=False)]
        if not each:
            return "—"
        return f"{statistics.median(each):.2f} ({percentile(each, 0.25):.2f} to {percentile(each, 0.75):.2f})"

    under = " (under the faults: one server trickles, one answers garbage, one sends 100 MB, the Hub's listing hangs)"
    print(f"\nApply → first workload Ready, timed from watch events, trials per row {trials}{under if faults else ''}; "
          "ratios: the per-trial ratios' median (p25 to p75):\n")
    print("| resources at once | trials done | bare Deployment → Ready p50 (s) | bare StatefulSet → Ready p50 (s) | the "
          "rendered lmcache StatefulSet, created by hand → Ready p50 (s) | KVCacheNamespace → its lmcache StatefulSet Ready "
          "p50 (s) | of which the operator: apply → its StatefulSet created, p50 (s) | ratio to the bare Deployment, per "
          "trial | ratio to the bare StatefulSet, per trial | ratio to the rendered one by hand, per trial | apply → first "
          "status at its generation, p50 (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n, runs in rows:
        done = len(runs["status"])
        print(f"| {n} | {done} | {p50(runs['deploy'][:done])} | {p50(runs['sts'][:done])} | {p50(runs['rendered'][:done])} | "
              f"{p50(runs['kv'][:done])} | {p50(runs['hop'][:done])} | {ratios(runs['kv'][:done], runs['deploy'][:done])} | "
              f"{ratios(runs['kv'][:done], runs['sts'][:done])} | {ratios(runs['kv'][:done], runs['rendered'][:done])} | "
              f"{p50(runs['status'][:done])} |", flush=True)
    print(flush=True)


def phase_ready(cluster: Cluster, work: Path) -> None:
    """One resource to phase Ready, with the real lmcache server behind its pod."""
    k = cluster.k
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    k.run("create", "namespace", ns)
    obj = sample("nvme-minimal")
    obj["metadata"]["namespace"] = ns
    obj["spec"]["l1"]["size"] = "256Mi"
    obj["spec"]["l2"] = {"nvme": {"existingClaimName": "bench-data", "maxCapacity": "1Gi"}}
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

    print(f"\nOne KVCacheNamespace, apply → phase Ready (real lmcache server behind its pod, started by the runner): "
          f"{ready_s:.2f} s; the server answered /healthcheck at {healthy_s:.2f} s (phase Ready {ready_s - healthy_s:.2f} s later)")


BENCH_NODE_LABEL = "kvpersist.dev/bench-node"
PODS_PER_NODE = 110


def bench_nodes(k: Kubectl, pods: int) -> list[str]:
    """kwok nodes (like the local cluster's GPU node) with room for the pods a run makes: the
    cluster's own two fit 220 pods, so 500 resources would otherwise leave most servers Pending."""
    names = [f"bench-node-{i}" for i in range(-(-pods // PODS_PER_NODE))]
    # Room by pod count, not by CPU or memory (a server asks for a few cores and its L1 in RAM).
    capacity = {"cpu": "2000", "memory": "64Ti", "pods": str(PODS_PER_NODE), "ephemeral-storage": "64Ti", "nvidia.com/gpu": "8"}
    for name in names:
        k.apply({"apiVersion": "v1", "kind": "Node",
                 "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                              "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "type": "kwok",
                                         "nvidia.com/gpu.present": "true", BENCH_NODE_LABEL: "true"}},
                 "status": {"capacity": capacity, "allocatable": capacity}})
    return names


def pod_phases(k: Kubectl, ns: str) -> dict[str, int]:
    items = json.loads(k.run("get", "pods", "-n", ns, "-o", "json", timeout=120).stdout)["items"]
    out: dict[str, int] = {}
    for pod in items:
        phase = (pod.get("status") or {}).get("phase", "?")
        out[phase] = out.get(phase, 0) + 1
    return out


class AuditedRequests:
    """The operator's own requests as the API server's audit log has them: it runs as a
    ServiceAccount of its own (cluster-admin: what is measured is how much it asks, not RBAC), so
    other clients (kube-controller-manager, this benchmark's kubectl) are not counted."""

    def __init__(self, cluster: Cluster, ns: str, work: Path) -> None:
        self.k, self.log, self.ns = cluster.k, cluster.audit_log, ns
        self.user = f"system:serviceaccount:{ns}:kvpersist-bench"
        self.k.run("create", "serviceaccount", "kvpersist-bench", "-n", ns)
        self.binding = f"{ns}-kvpersist-bench"
        self.k.run("create", "clusterrolebinding", self.binding, "--clusterrole=cluster-admin",
                   f"--serviceaccount={ns}:kvpersist-bench")
        self.as_operator = self.k.as_service_account(ns, "kvpersist-bench", work / "operator-sa.kubeconfig")

    @staticmethod
    def now() -> datetime:
        return datetime.now(UTC)

    def _marker(self) -> str:
        """Waits until a marker request of the same account is in the log, so what came before is complete."""
        marker = f"marker-{uuid.uuid4().hex[:8]}"
        self.as_operator.run("get", "configmap", marker, "-n", self.ns, "--ignore-not-found")
        wait_for("the marker in the audit log", lambda: any((e.get("objectRef") or {}).get("name") == marker
                                                             for e in events(self.log, self.user)), 120, interval=1)
        return marker

    def between(self, since: datetime, until: datetime) -> list[tuple[str, str]]:
        """(verb, resource[/sub]) of every request received in the window (a watch when it started);
        waits until a marker request of the same account is in the log, so the window is complete."""
        marker = self._marker()
        out = []
        for e in events(self.log, self.user, stages=("ResponseStarted", "ResponseComplete")):
            verb, ref = e.get("verb"), e.get("objectRef") or {}
            if e.get("stage") != ("ResponseStarted" if verb == "watch" else "ResponseComplete") or ref.get("name") == marker:
                continue
            received = datetime.fromisoformat(e["requestReceivedTimestamp"].replace("Z", "+00:00"))
            if since <= received <= until:
                sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
                out.append((verb, f"{ref.get('resource')}{sub}"))
        return out

    def in_namespace(self, ns: str) -> list[tuple[float, float, str]]:
        """(received, completed, "verb resource[/sub] name") of each completed request in namespace
        ns, times as time.time() (the API server's clock is this machine's), oldest first."""
        self._marker()
        out = []
        for e in events(self.log, self.user):
            ref = e.get("objectRef") or {}
            if ref.get("namespace") != ns or e.get("verb") == "watch":
                continue
            sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
            out.append((datetime.fromisoformat(e["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp(),
                        datetime.fromisoformat(e["stageTimestamp"].replace("Z", "+00:00")).timestamp(),
                        f"{e.get('verb')} {ref.get('resource')}{sub} {ref.get('name', '')}".rstrip()))
        return sorted(out)

    def close(self) -> None:
        self.k.run("delete", "clusterrolebinding", self.binding, "--ignore-not-found", check=False)


def split(requests: list[tuple[str, str]]) -> tuple[int, int, int]:
    """(writes, gets and lists, watches opened)."""
    writes = sum(1 for verb, _ in requests if verb in WRITE_VERBS)
    watches = sum(1 for verb, _ in requests if verb == "watch")
    return writes, len(requests) - writes - watches, watches


def scale(cluster: Cluster, work: Path, count: int, idle_s: float, with_named: bool = False,
          unschedulable: bool = False, fallback_s: float = 30) -> None:
    """Each phase prints as it completes (a failure late in a run keeps the figures before it)."""
    k = cluster.k
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    k.run("create", "namespace", ns)
    nodes = [] if unschedulable else bench_nodes(k, count)
    if with_named:
        k.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "bench-key", "namespace": ns,
                 "labels": dict([NAMED_LABEL.split("=")])}, "stringData": {"master-key": uuid.uuid4().hex * 2}})
        claims = [user_claim(ns, f"s{i:04d}") for i in range(count)]
        for i in range(0, count, 50):
            k.apply({"apiVersion": "v1", "kind": "List", "items": claims[i:i + 50]})
    # A healthy bucket: the token's Secret exists and the Hub answers (the local stand-in of its API
    # shapes from the tests, as no Hub is reachable here), so steady state is the normal one.
    hub = HubStub(existing={"acme-ml/kv-cache"}).__enter__()
    k.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-kv-writer", "namespace": ns},
             "stringData": {"token": GOOD_TOKEN}})
    env = {"HF_ENDPOINT": hub.url, **({"KVPERSIST_SECRET_LABEL": NAMED_LABEL} if with_named else {}),
           **({"KVPERSIST_CACHE_FALLBACK_S": str(fallback_s)} if unschedulable else {})}
    audited = AuditedRequests(cluster, ns, work)
    op = Operator(audited.as_operator.kubeconfig, ns, work / "operator-scale.log", env=env)
    kind = ("naming their own claim and a key Secret (secretLabel set)" if with_named else "on a Hugging Face bucket")
    if unschedulable:
        kind += f"; servers that can never be scheduled (a CPU request no node has), fallback after {fallback_s:.0f} s"
    print(f"scale: {count} resources {kind}; {len(nodes)} bench nodes added ({PODS_PER_NODE} pods each); "
          f"operator log {work / 'operator-scale.log'}", flush=True)
    try:
        time.sleep(3)
        cpu0, w0 = op.cpu_seconds(), op.writes()
        t0, at0 = time.monotonic(), audited.now()
        objs = [(named if with_named else light)(ns, f"s{i:04d}") for i in range(count)]
        if unschedulable:
            for obj in objs:
                obj["spec"]["lmcacheServer"] = {"resources": {"requests": {"cpu": "5000"}}}
        with ThreadPoolExecutor(max_workers=10) as pool:
            list(pool.map(lambda chunk: k.apply({"apiVersion": "v1", "kind": "List", "items": chunk}),
                          [objs[i:i + 25] for i in range(0, count, 25)]))

        def all_observed() -> bool:
            items = json.loads(k.run("get", "kvns", "-n", ns, "-o", "json", timeout=120).stdout)["items"]
            return sum(1 for o in items if (o.get("status") or {}).get("observedGeneration")
                       == o["metadata"]["generation"]) == count

        wait_for(f"{count} resources reconciled", all_observed, 1800, interval=2)
        converge_s, at1 = time.monotonic() - t0, audited.now()
        cpu1, w1 = op.cpu_seconds(), op.writes()
        converge_requests = audited.between(at0, at1)
        c_writes, c_reads, c_watches = split(converge_requests)
        writes_per_reconcile = c_writes / count
        per_reconcile = (c_writes + c_reads) / count
        print(f"converged: {count} reconciled in {converge_s:.1f} s, operator CPU {cpu1 - cpu0:.1f} s, peak RSS so far "
              f"{op.peak_rss_kib / 1024:.0f} MiB, API requests / reconcile {per_reconcile:.1f} ({writes_per_reconcile:.1f} "
              "writes)", flush=True)
        # Settle: first statuses are written at reconcile time, later ones as pods get scheduled and
        # the loop comes round (and, with unschedulable servers, the fallback rolls vLLM). Idle
        # starts when the operator has written nothing for 30 s.
        settle_t0, last, quiet_since = time.monotonic(), op.writes(), time.monotonic()
        settle_limit = 600 + (fallback_s if unschedulable else 0)
        while time.monotonic() - quiet_since < 30 and time.monotonic() - settle_t0 < settle_limit:
            time.sleep(2)
            now_writes = op.writes()
            if now_writes != last:
                last, quiet_since = now_writes, time.monotonic()
        settled = time.monotonic() - quiet_since >= 30
        settle_s = time.monotonic() - settle_t0 - (30 if settled else 0)
        phases = pod_phases(k, ns)  # before the idle window: the benchmark's own LIST is no operator read
        posted = Counter(e.get("reason") for e in json.loads(k.run("get", "events", "-n", ns, "-o", "json").stdout)["items"]
                         if e.get("reportingComponent") == "kvpersist")
        req2, cpu2, w2, at2 = cluster.requests(), op.cpu_seconds(), op.writes(), audited.now()
        print(f"settled: {settle_s:.0f} s more{'' if settled else f' (NOT settled: still writing after {settle_limit:.0f} s)'}"
              f", operator CPU {cpu2 - cpu1:.1f} s; pods by phase {phases}", flush=True)
        time.sleep(idle_s)
        req3, cpu3, w3, at3 = cluster.requests(), op.cpu_seconds(), op.writes(), audited.now()
        idle_requests = audited.between(at2, at3)
    finally:
        op.stop()
        audited.close()
        hub.__exit__(None, None, None)
        k.run("delete", "namespace", ns, "--wait=false", check=False)
        for node in nodes:
            k.run("delete", "node", node, "--wait=false", check=False)
    i_writes, i_reads, i_watches = split(idle_requests)
    idle_writes = i_writes * 60 / idle_s
    idle_reads = i_reads * 60 / idle_s
    counted = {f"{verb} {what}": n for (verb, what), n in sorted(Counter(idle_requests).items())}
    print(f"converge: the operator's requests (audit log) {c_writes} writes, {c_reads} gets and lists, {c_watches} watches "
          f"opened; its own counters: {w1 - w0:.0f} writes (applies, status writes, events)", flush=True)
    by_request = {f"{verb} {what}": round(n / count, 2) for (verb, what), n in sorted(Counter(converge_requests).items())
                  if verb != "watch"}
    print(f"converge: the operator's requests per resource, by verb and resource: {by_request}; its events by reason "
          f"(all resources): {dict(posted)}", flush=True)
    print(f"idle {idle_s:.0f} s: the operator's requests (audit log): {counted or 'none'} ({i_watches} watches opened: "
          "kopf opens each kind's watch again every 300 s, not a read of a round); its counters: "
          f"{w3 - w2:.0f} writes", flush=True)
    idle_named = sum(v - req2.get(key, 0.0) for key, v in req3.items() if (key[0], key[1]) in NAMED_READS and key[2] == "")
    by_kind = {f"{k[0]} {k[1]}": v - req2.get(k, 0.0) for k, v in req3.items()
               if (k[0], k[1]) in OPERATOR_READS and k[2] == "" and v > req2.get(k, 0.0)}
    print(f"idle {idle_s:.0f} s: one-by-one GETs of Secrets and claims (any client): {idle_named * 60 / idle_s:.1f} / min; "
          f"reads counted, by kind (any client): {by_kind or 'none'}", flush=True)
    print("| resources | all reconciled (s) | statuses settled (s more) | operator peak RSS (MiB) | operator CPU to converge (s) | "
          "API requests / reconcile (writes) | idle: API writes / min | idle: API gets and lists / min | "
          "idle: operator CPU / min (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {count} | {converge_s:.1f} | {settle_s:.0f} | {op.peak_rss_kib / 1024:.0f} | {cpu1 - cpu0:.1f} | "
          f"{per_reconcile:.1f} ({writes_per_reconcile:.1f}) | {idle_writes:.1f} | {idle_reads:.0f} | "
          f"{(cpu3 - cpu2) * 60 / idle_s:.1f} |", flush=True)


def hostile_object(kind: str, ns: str, name: str) -> dict:
    """A ConfigMap or Secret as large as its metadata may be: 1,500 labels and a 250 KiB annotation
    (the API's annotation limit is 256 KiB), no data."""
    labels = {f"k{i:04d}-{'x' * 50}": "v" * 63 for i in range(1500)}
    return {"apiVersion": "v1", "kind": kind, "metadata": {"name": name, "namespace": ns, "labels": labels,
                                                           "annotations": {"bulk": "a" * 250 * 1024}}}


def hostile(cluster: Cluster, work: Path, count: int) -> None:
    """Issue 58 item 1: the operator's RSS with `count` ConfigMaps and as many Secrets of hostile
    metadata in its watched namespace, created while it runs, then across a restart (its caches
    list them all again). No KVCacheNamespace is involved: anyone who may create ConfigMaps there
    can do this."""
    k = cluster.k
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    k.run("create", "namespace", ns)
    log = work / "operator-hostile.log"
    op = Operator(cluster.kubeconfig, ns, log)
    rows: list[tuple[str, float, float]] = []
    try:
        time.sleep(5)
        rows.append(("started, namespace empty", op.rss_kib() / 1024, op.peak_rss_kib / 1024))
        size = len(json.dumps(hostile_object("ConfigMap", ns, "x")))
        print(f"hostile: {count} ConfigMaps and {count} Secrets of {size / 2**20:.2f} MiB of metadata each into {ns}; "
              f"operator log {log}", flush=True)
        objs = [hostile_object(kind, ns, f"h{i:05d}") for kind in ("ConfigMap", "Secret") for i in range(count)]
        def create(chunk: list[dict]) -> None:  # create, not apply: a last-applied annotation would pass the limit
            k.run("create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": chunk}), timeout=300)

        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(create, [objs[i:i + 10] for i in range(0, len(objs), 10)]))
        del objs
        time.sleep(20)  # the watch events delivered
        rows.append((f"{count} + {count} created while it ran", op.rss_kib() / 1024, op.peak_rss_kib / 1024))
        op.stop()
        op = Operator(cluster.kubeconfig, ns, log)  # its caches list every one of them again
        time.sleep(20)
        rows.append(("restarted: listed them all", op.rss_kib() / 1024, op.peak_rss_kib / 1024))
    finally:
        op.stop()
        k.run("delete", "namespace", ns, "--wait=false", check=False)
    print("| operator | RSS (MiB) | peak RSS of this process (MiB) |")
    print("| --- | --- | --- |")
    for what, rss, peak in rows:
        print(f"| {what} | {rss:.0f} | {peak:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--trials", type=int, default=15, help="trials with 1 resource")
    lat.add_argument("--trials-50", type=int, default=3, help="trials with 50 resources at once")
    lat.add_argument("--faults", action="store_true", help="hold the hostile peers of the e2e fault test meanwhile")
    lat.add_argument("--no-phase-ready", action="store_true", help="skip the phase-Ready run with the real server")
    sub.add_parser("phase-ready")
    sc = sub.add_parser("scale")
    sc.add_argument("--count", type=int, default=500)
    sc.add_argument("--idle-seconds", type=float, default=60)
    sc.add_argument("--with-named", action="store_true", help="resources naming their own claim and a key Secret")
    sc.add_argument("--unschedulable", action="store_true",
                    help="servers that can never be scheduled: the idle after the fallback rolled vLLM")
    sc.add_argument("--fallback-seconds", type=float, default=30, help="the fallback bound with --unschedulable")
    ho = sub.add_parser("hostile", help="the operator's RSS under ConfigMaps and Secrets of hostile metadata")
    ho.add_argument("--count", type=int, default=1000, help="ConfigMaps, and as many Secrets")
    args = parser.parse_args()
    cluster = Cluster()
    work = Path(tempfile.mkdtemp(prefix="kvpersist-bench-"))
    try:
        if args.what == "latency":
            latency(cluster, work, {1: args.trials, 50: args.trials_50}, args.faults)
            if not args.no_phase_ready:
                phase_ready(cluster, work)
        elif args.what == "phase-ready":
            phase_ready(cluster, work)
        elif args.what == "hostile":
            hostile(cluster, work, args.count)
        else:
            scale(cluster, work, args.count, args.idle_seconds, args.with_named, args.unschedulable, args.fallback_seconds)
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
