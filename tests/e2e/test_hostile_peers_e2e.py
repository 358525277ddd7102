"""Hostile peers against the real operator on the local cluster: while one server's agent trickles
its answers a byte at a time, one answers garbage JSON, one sends a 100 MB body and one bucket's
Hub hangs on its tree listing, 20 healthy resources keep fresh status, the faulty ones go
unhealthy naming their fault, and the operator's memory stays bounded.

What is real: the operator process (`kvpersist run`, one namespace), the API server and the
controllers (StatefulSets, pods, claims), kwok's simulated pods on the kwok-* nodes (Running with
a loopback pod IP, no process behind it). What stands in: on each server pod's IP and agent port,
a small HTTP server in this test process plays the pod's inventory agent (`StandInAgent`, not
`kvpersist.inventory.agent`): it checks the resource's bearer token from its `NAME-agent-token` Secret and
answers GET /server/status with lmcache 0.5.6's real /status body
(tests/unit/data/lmcache-0.5.6-status-nixl-8-objects.json), /server/metrics with its real
/metrics body, and /inventory as the agent does; three of them misbehave. The Hub is
tests/integration/hub_stub.py (no Hugging Face endpoint is reachable here) given to the operator
as HF_ENDPOINT, its tree route made to hang.

Refresh latency is measured from outside: each healthy stand-in's L1 usage moves to a new number
and the time until status.usage shows that number is what a user waits for a change to appear.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import itertools
import json
import select
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as kclient
from kubernetes import config as kconfig

from kvpersist.api import v1alpha1 as api
from kvpersist.controller.runtime import STATUS_INTERVAL_S
from kvpersist.httpclient import MAX_JSON_BYTES
from tests.cases.invalid_manifests import sample
from tests.e2e.kube import REPO, Kubectl
from tests.e2e.operator_env import start_operator, stop, target_of
from tests.e2e.test_faults import light
from tests.integration.hub_stub import GOOD_TOKEN, HubStub

pytestmark = pytest.mark.e2e

DATA = REPO / "tests" / "unit" / "data"
STATUS = json.loads((DATA / "lmcache-0.5.6-status-nixl-8-objects.json").read_text())
METRICS = (DATA / "lmcache-0.5.6-metrics-0-fresh.txt").read_bytes()
HEALTHY = 20
FAULTS = ("trickle", "garbage", "huge")
BUCKET = "bucket"  # the hfBucket resource: its server answers well, its Hub's listing hangs
HUB_BUCKET = "acme-ml/kv-cache"
HUGE = 100 * 2**20
BLOCK = b"x" * 65536
TRICKLE_EVERY_S = 0.1  # one byte of the trickled body per this
ROUNDS = 3  # usage changes of every healthy server, one after another
# A change shows in status within one refresh period, plus: the loop's 1 s tick, the refresh itself
# (a healthy stand-in answers in milliseconds; then the status patch), the watch delivering the
# write to the operator, this test's 0.25 s poll and a list call; 5 s for all of that on the
# shared 2-core test machine. A status loop held up by a faulty peer (2 s per trickled read, a
# 10 s hung listing) would overshoot it.
LATENCY_SLACK_S = 5.0
LATENCY_BOUND_S = STATUS_INTERVAL_S + LATENCY_SLACK_S
# The operator reads at most MAX_JSON_BYTES (4 MiB) of any answer, and a handful of reads run at
# once; with the allocator's per-thread arenas that stays well under 64 MiB. Reading one 100 MB
# body whole would add at least 100 MB.
RSS_GROWTH_BOUND = 64 * 2**20


class StandInAgent:
    """A stand-in for one lmcache server pod's inventory agent, bound to the pod's (loopback) IP
    and agent port: answers the operator's three reads as the agent does, with the resource's
    bearer token required for /server/status and /inventory. `mode` makes it hostile: "trickle"
    (the body a byte at a time), "garbage" (JSON of the wrong shape), "huge" (a 100 MB body).
    close() stops its server and every connection thread, each wait bounded."""

    def __init__(self, pod: str, ip: str, port: int, token: str, l1_base: int, halt: threading.Event) -> None:
        assert ip.startswith("127."), f"{pod} has IP {ip}: loopback addresses only"
        self.pod, self.token, self.l1_base, self.halt = pod, token, l1_base, halt
        self.mode = "healthy"
        self.epoch = 0
        self.lock = threading.Lock()
        self.polls: list[float] = []  # when each authorized /server/status came (monotonic)
        self.refused = 0  # requests without the right token
        self.huge_sent: list[int] = []  # bytes of each huge answer sent before the operator hung up
        self.server = ThreadingHTTPServer((ip, port), self._handler())
        self.server.daemon_threads = False  # server_close() joins every connection thread
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.5},
                                       name=f"stand-in-{pod}"[:40], daemon=True)
        self.thread.start()

    def l1_used(self, epoch: int) -> int:
        return self.l1_base + epoch * 2**20

    def status_body(self) -> bytes:
        status = copy.deepcopy(STATUS)
        used = self.l1_used(self.epoch)
        status["storage_manager"]["l1_manager"]["memory_used_bytes"] = used
        status["storage_manager"]["l1_managers"]["_default"]["memory_used_bytes"] = used
        return json.dumps(status).encode()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        agent = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 10  # every socket operation of a connection: a stuck write ends the thread

            def log_message(self, *_: object) -> None:
                return

            def do_GET(self) -> None:
                with contextlib.suppress(OSError):  # the operator hung up on a slow or oversized answer, as it should
                    agent.answer(self)

        return Handler

    def answer(self, req: BaseHTTPRequestHandler) -> None:
        path = req.path.split("?")[0]
        if path in ("/server/status", "/inventory") and req.headers.get("Authorization") != f"Bearer {self.token}":
            with self.lock:
                self.refused += 1
            return _send(req, 401, b'{"error": "missing or wrong bearer token"}')
        if path not in ("/server/status", "/server/metrics", "/inventory"):
            return _send(req, 404, b'{"error": "not found"}')
        if path == "/server/status" and self.mode == "healthy":
            with self.lock:
                self.polls.append(time.monotonic())
        if self.mode == "trickle":
            return self._trickle(req, self.status_body())
        if self.mode == "garbage":
            return _send(req, 200, b'{"is_healthy": "very", "storage_manager": [null, 3], "namespaces": "all of them"}')
        if self.mode == "huge":
            return self._huge(req, declare=path == "/inventory")
        if path == "/server/status":
            return _send(req, 200, self.status_body())
        if path == "/server/metrics":
            return _send(req, 200, METRICS, "text/plain; version=0.0.4")
        return _send(req, 200, json.dumps({"location": "/l2", "namespaces": [], "otherBytes": 0, "capacityBytes": 2**30,
                                           "freeBytes": 2**30 - 4194304, "serving": None, "trimmed": None}).encode())

    def _trickle(self, req: BaseHTTPRequestHandler, body: bytes) -> None:
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        for i in range(len(body)):
            if self.halt.wait(TRICKLE_EVERY_S):
                return
            req.wfile.write(body[i:i + 1])

    def _huge(self, req: BaseHTTPRequestHandler, declare: bool) -> None:
        """100 MB: with its Content-Length declared, or (closed-delimited) announced by nothing."""
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        if declare:
            req.send_header("Content-Length", str(HUGE))
        req.end_headers()
        sent = 0
        try:
            while sent < HUGE and not self.halt.is_set():
                req.wfile.write(BLOCK)
                sent += len(BLOCK)
        finally:
            with self.lock:
                self.huge_sent.append(sent)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), f"the stand-in for {self.pod} did not stop"


def _send(req: BaseHTTPRequestHandler, code: int, body: bytes, kind: str = "application/json") -> None:
    req.send_response(code)
    req.send_header("Content-Type", kind)
    req.send_header("Content-Length", str(len(body)))
    req.end_headers()
    req.wfile.write(body)


class HangingListings:
    """Makes a HubStub's tree route (the bucket listing) hang: the request is read and never
    answered; each connection is held until the operator gives up on it (recorded) or release is
    set. Every other route (the preflight) answers as the stub does."""

    def __init__(self, hub: HubStub, release: threading.Event) -> None:
        self.release = release
        self.lock = threading.Lock()
        self.asked = 0
        self.given_up_after: list[float] = []  # seconds until the operator closed each hung listing
        self.threads: list[threading.Thread] = []
        outer, base = self, hub.server.RequestHandlerClass

        class Handler(base):  # type: ignore[misc, valid-type]
            def do_GET(self) -> None:
                if "/tree" in self.path:
                    outer.hang(self.connection)
                else:
                    super().do_GET()

        hub.server.RequestHandlerClass = Handler

    def hang(self, sock: socket.socket) -> None:
        with self.lock:
            self.asked += 1
            self.threads.append(threading.current_thread())
        held = hold(sock, self.release)
        if held is not None:
            with self.lock:
                self.given_up_after.append(held)

    def join(self) -> None:
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=5)
        assert not any(t.is_alive() for t in threads), "a hung listing's thread did not stop"


def hold(sock: socket.socket, release: threading.Event, bound_s: float = float("inf")) -> float | None:
    """Answers nothing on a request's connection: how long until the client hung up, or None when
    release was set or bound_s passed first."""
    started = time.monotonic()
    while not release.is_set() and time.monotonic() - started < bound_s:
        readable, _, _ = select.select([sock], [], [], 0.2)
        if readable:
            try:
                closed = not sock.recv(1)
            except OSError:
                closed = True
            if closed:
                return time.monotonic() - started
    return None


class RssSampler:
    """VmRSS of a process, sampled every interval on a thread of its own until stop()."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.pid, self.interval = pid, interval
        self.samples: list[int] = []
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def read(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no VmRSS for pid {self.pid}")

    def _loop(self) -> None:
        while not self.halt.is_set():
            try:
                self.samples.append(self.read())
            except (OSError, AssertionError):
                return  # the process is gone; the test says why
            self.halt.wait(self.interval)

    def start(self) -> RssSampler:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.halt.set()
        self.thread.join(timeout=5)


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _claimed(ns: str, name: str) -> list[dict]:
    """A PersistentVolume bound ahead to the claim NAME-data, and the claim: a light resource's
    existing claim, so its server pod can be scheduled (kwok mounts nothing)."""
    pv = f"{ns}-{name}-pv"
    return [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                  "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": f"/tmp/{pv}-unused"},
                  "claimRef": {"namespace": ns, "name": f"{name}-data"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": f"{name}-data", "namespace": ns},
         "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": pv,
                  "resources": {"requests": {"storage": "1Gi"}}}},
    ]


def _simulated(obj: dict) -> dict:
    """Off the real node (its pods need hack/kubelet_runner.py): servers follow vLLM's placement,
    so without it they land on the kwok-* nodes, simulated."""
    for key in ("nodeSelector", "tolerations"):
        obj["spec"]["vllm"].pop(key, None)
    return obj


def _bucket_resource(ns: str) -> dict:
    obj = sample("hf-bucket")
    obj["metadata"].update(name=BUCKET, namespace=ns)
    obj["spec"]["l1"]["size"] = "256Mi"
    obj["spec"]["l2"]["hfBucket"]["createBucketIfMissing"] = False
    obj["spec"]["vllm"]["replicas"] = 0
    return obj


@pytest.fixture()
def scene(kubectl: Kubectl, crd: None, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The namespace with 20 healthy light resources, three to turn hostile and the bucket one;
    the Hub stub (listing hangs) and the operator. Everything started here is stopped here."""
    ns = f"e2e-{uuid.uuid4().hex[:8]}"
    names = [f"ok{i:02d}" for i in range(HEALTHY)] + list(FAULTS)
    kubectl.run("create", "namespace", ns)
    halt, release = threading.Event(), threading.Event()
    closers: list[Callable[[], None]] = []
    agents: dict[str, StandInAgent] = {}
    operator = None
    hub = HubStub(existing={HUB_BUCKET})
    hanging = HangingListings(hub, release)
    try:
        with hub:
            claims = [o for n in names for o in _claimed(ns, n)]
            secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-kv-writer", "namespace": ns},
                      "type": "Opaque", "data": {"token": base64.b64encode(GOOD_TOKEN.encode()).decode()}}
            kubectl.apply({"apiVersion": "v1", "kind": "List", "items": [*claims, secret]})
            log = tmp_path / "operator.log"
            operator = start_operator(kubectl.kubeconfig, ns, log, {"HF_ENDPOINT": hub.url})
            objs = [_simulated(light(ns, n)) for n in names] + [_bucket_resource(ns)]
            kubectl.apply({"apiVersion": "v1", "kind": "List", "items": objs})
            yield {"ns": ns, "names": names, "objs": objs, "agents": agents, "halt": halt, "hub": hub, "hanging": hanging,
                   "operator": operator, "log": log, "closers": closers}
    finally:
        if operator is not None:
            stop(operator)
        halt.set()
        release.set()
        for close in closers:
            close()
        hub.thread.join(timeout=5)
        left: list[str] = []
        for stopper in [agent.close for agent in agents.values()] + [hanging.join]:
            try:
                stopper()
            except AssertionError as exc:
                left.append(str(exc))
        kubectl.run("delete", "namespace", ns, "--wait=false", check=False)
        kubectl.run("delete", "pv", *[f"{ns}-{n}-pv" for n in names], "--wait=false", "--ignore-not-found", check=False)
        assert not left, left


def _statuses(custom: kclient.CustomObjectsApi, ns: str) -> dict[str, dict[str, Any]]:
    items = custom.list_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.PLURAL, _request_timeout=10)["items"]
    return {o["metadata"]["name"]: o.get("status") or {} for o in items}


def _until(what: str, check: Callable[[], dict[str, Any]], timeout: float, interval: float = 0.25) -> dict[str, float]:
    """Polls check() (name -> truthy once done) and returns when each name first was done, in
    seconds from now; fails after timeout naming those still pending."""
    t0 = time.monotonic()
    done: dict[str, float] = {}
    pending: list[str] = []
    while time.monotonic() - t0 < timeout:
        state = check()
        now = time.monotonic() - t0
        for name, ok in state.items():
            if ok and name not in done:
                done[name] = now
        pending = [n for n in state if n not in done]
        if not pending:
            return done
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}: still pending {pending}")


def _server(status: dict[str, Any]) -> dict[str, Any]:
    return (status.get("servers") or [{}])[0]


def _reason(message: str) -> str:
    """A server's message without where it was asked (the pod IP changes from run to run)."""
    return message.split("(the pod's agent): ", 1)[-1]


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def test_healthy_status_stays_fresh_while_peers_trickle_flood_garble_and_hang(kubectl: Kubectl, scene: dict,
                                                                           fault_log) -> None:
    ns, names, agents = scene["ns"], scene["names"], scene["agents"]
    api_client = kconfig.new_client_from_config(config_file=str(kubectl.kubeconfig))
    scene["closers"].append(api_client.close)
    custom = kclient.CustomObjectsApi(api_client)
    every = [*names, BUCKET]
    healthy = [n for n in every if n not in FAULTS]  # the 20, and the bucket resource's server

    # Each resource's server pod on a kwok node, Running with a loopback IP; then its stand-in agent.
    def pods() -> dict[str, Any]:
        found = {p["metadata"]["name"]: p for p in kubectl.get("pods", namespace=ns)["items"]}
        status = {n: (found.get(f"{n}-lmcache-0") or {}).get("status") or {} for n in every}
        return {n: s.get("podIP") if s.get("phase") == "Running" else None for n, s in status.items()}

    _until("every server pod Running with an IP", pods, timeout=150, interval=1.0)
    ips = pods()
    for i, obj in enumerate(scene["objs"]):
        name = obj["metadata"]["name"]
        node = kubectl.get("pod", f"{name}-lmcache-0", ns)["spec"]["nodeName"]
        assert node.startswith("kwok-"), f"{name}'s server pod is on {node}, not a simulated node"
        target = target_of(obj)
        raw = kubectl.get("secret", target.agent_token_secret, ns)["data"]["token"]
        agents[name] = StandInAgent(f"{name}-lmcache-0", ips[name], target.spec.lmcache_server.agent_port,
                                    base64.b64decode(raw).decode().strip(), (i + 1) * 2**24, scene["halt"])

    # All well first: every resource's status shows its server's usage.
    def all_well() -> dict[str, bool]:
        return {n: (st.get("usage") or {}).get("l1UsedBytes") == agents[n].l1_used(0) and bool(_server(st).get("healthy"))
                for n, st in _statuses(custom, ns).items()}

    _until("every resource to show its server's usage", all_well, timeout=120)
    rss = RssSampler(scene["operator"].pid)
    before = 0
    for _ in range(4):  # settled: the highest of a second's samples
        before = max(before, rss.read())
        time.sleep(0.25)
    rss.start()
    try:
        # The faults: three agents turn hostile (the Hub's listing has hung from the start).
        faults_on = time.monotonic()
        for fault in FAULTS:
            agents[fault].mode = fault
        unhealthy = _until("the three faulty resources to go unhealthy", lambda: {n: not _server(st).get("healthy", True)
                                                                                  for n, st in _statuses(custom, ns).items()
                                                                                  if n in FAULTS}, timeout=60)
        polls_from = time.monotonic()
        latencies: list[tuple[float, str]] = []  # (seconds until status showed the change, resource)
        for epoch in range(1, ROUNDS + 1):
            for n in healthy:
                agents[n].epoch = epoch
            seen = _until(f"round {epoch}'s usage in every healthy resource's status", lambda e=epoch: {
                n: (st.get("usage") or {}).get("l1UsedBytes") == agents[n].l1_used(e)
                for n, st in _statuses(custom, ns).items() if n in healthy}, timeout=LATENCY_BOUND_S + 30)
            latencies += [(seconds, f"{n}@{epoch}") for n, seconds in seen.items()]
        polls_to = time.monotonic()
        statuses = _statuses(custom, ns)
    finally:
        rss.stop()
    peak = max([before, *rss.samples])

    # Fresh: every change showed within the refresh period plus slack, and every healthy server
    # was asked at least once per period the whole time.
    assert len(latencies) == ROUNDS * len(healthy)
    p50, (worst, slowest) = statistics.median(s for s, _ in latencies), max(latencies)
    assert worst <= LATENCY_BOUND_S, (f"{slowest}'s usage change took {worst:.1f}s to show (bound {LATENCY_BOUND_S:g}s); "
                                      f"over {LATENCY_BOUND_S:g}s: {[(round(s, 1), n) for s, n in latencies if s > LATENCY_BOUND_S]}")
    gaps = []
    for n in healthy:
        polls = [polls_from, *[t for t in agents[n].polls if polls_from <= t <= polls_to], polls_to]
        gaps.append(max(b - a for a, b in itertools.pairwise(polls)))
    assert max(gaps) <= LATENCY_BOUND_S, f"a healthy server went unasked for {max(gaps):.1f}s"
    for n in healthy:
        assert _condition(statuses[n], "LMCacheReady").get("status") == "True", (n, statuses[n].get("conditions"))

    # Unhealthy, each naming its fault.
    messages = {f: _server(statuses[f]).get("message", "") for f in FAULTS}
    assert "timed out" in messages["trickle"] and "within 2s" in messages["trickle"], messages
    assert messages["garbage"].startswith("malformed /status"), messages
    assert f"over the {MAX_JSON_BYTES}-byte limit" in messages["huge"], messages
    for f in FAULTS:
        assert statuses[f].get("phase") == "Degraded", (f, statuses[f].get("phase"))
        cond = _condition(statuses[f], "LMCacheReady")
        assert cond.get("reason") == "ServerUnhealthy" and messages[f] in cond.get("message", ""), cond

    # Bounded memory: the 100 MB answers were cut near the cap, and the operator's RSS stayed low.
    huge_sent = list(agents["huge"].huge_sent)
    assert huge_sent, "the operator never read the huge stand-in"
    assert max(huge_sent) < HUGE / 4, f"the operator read {_mib(max(huge_sent))} of a 100 MB answer"
    assert peak - before <= RSS_GROWTH_BOUND, f"operator RSS grew from {_mib(before)} to {_mib(peak)}"

    # The Hub: the preflight answered, the listing hung (off the refresh path, as shown above).
    hanging = scene["hanging"]
    assert hanging.asked >= 1, "the operator never listed the bucket"
    assert ("GET", f"/api/buckets/{HUB_BUCKET}") in scene["hub"].requests, "no preflight reached the Hub"
    assert _condition(statuses[BUCKET], "L2Ready").get("status") == "True", statuses[BUCKET].get("conditions")
    assert all(a.refused == 0 for a in agents.values()), {n: a.refused for n, a in agents.items() if a.refused}
    assert scene["operator"].poll() is None, "the operator exited"
    assert "Traceback" not in scene["log"].read_text(errors="replace")

    why = {f: _reason(m) for f, m in messages.items()}
    gave_up = ", ".join(f"{s:.1f}s" for s in hanging.given_up_after) or "none yet"
    fault_log(
        f"{HEALTHY} healthy resources (stand-in agents on kwok pod IPs answering lmcache 0.5.6's real /status) while "
        "one server's agent trickles its body a byte at a time, one answers garbage JSON, one sends a 100 MB body, and "
        "an hfBucket resource's Hub hangs on the bucket listing",
        f"healthy status stayed fresh: {len(latencies)} usage changes (the {HEALTHY} and the bucket resource's server, "
        f"{ROUNDS} rounds) showed in status after p50 {p50:.1f}s, max {worst:.1f}s (bound: {STATUS_INTERVAL_S:g} s refresh "
        f"period + {LATENCY_SLACK_S:g} s); each healthy server asked at least every {max(gaps):.1f}s; unhealthy after "
        f"the fault began: trickle {unhealthy['trickle']:.1f}s ('{why['trickle']}'), garbage "
        f"{unhealthy['garbage']:.1f}s ('{why['garbage'][:90]}...'), 100 MB {unhealthy['huge']:.1f}s "
        f"('{why['huge']}'; at most {_mib(max(huge_sent))} of 100 MB sent before the operator hung up); "
        f"the Hub's listing asked {hanging.asked} time(s), each hung until the operator gave up ({gave_up}); operator "
        f"RSS {_mib(before)} before the faults, peak {_mib(peak)} during them (bound: before + {_mib(RSS_GROWTH_BOUND)}); "
        f"{time.monotonic() - faults_on:.0f}s under the faults")
