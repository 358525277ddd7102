"""One resource's hanging vLLM pods do not delay another resource's canary verdict (issue 58, item 2),
on the real API server with the real operator.

The canary's checks run as jobs in one pool shared by every resource (4 workers). Here four resources
have 20 vLLM pods each that answer the canary's reference and then hang on every check until the
call's bound; a fifth, B, has one pod whose cached answer differs from its reference (a wrong hit).
B's canary is turned on once every worker is held by a hanging job. Its HitMismatch verdict must
come within B's own interval (60 s): with one job holding a worker for each of its pods' calls (20 x
the bound, as before JOB_BUDGET), B would wait 80 s behind them.

What is real: the operator process (`kvpersist run`, one namespace), the API server and the
controllers, kwok's simulated pods on a kwok node this test adds (Running and Ready with a loopback
pod IP, no process behind it). What stands in: on each vLLM pod's IP and port, a small HTTP server
in this test process plays vLLM's OpenAI API (`StandInVLLM`, not vLLM): POST /v1/completions with
the fields the canary reads, 404 for /metrics (the canary then attributes no tier, which it allows).
The servers' pods answer nothing (no agent behind them): their status is unhealthy, and the cache
fallback is set far beyond the test so vLLM keeps the cache (the canary checks only such pods).
The call's bound is 4 s here (KVPERSIST_CANARY_CALL_TIMEOUT_S), 60 s by default.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.target import VLLM
from kvpersist.status import canary as judge
from kvpersist.status.workloads import pod_views
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import start_operator, stop, target_of
from tests.e2e.test_faults import light
from tests.e2e.test_hostile_peers_e2e import _claimed, hold

pytestmark = pytest.mark.e2e

NODE = "kwok-canary-0"
TAINT = "kvpersist.dev/canary-fairness"
HOSTILE = [f"hang{i}" for i in range(4)]  # as many as the canary's pool has workers
PODS = 20  # each hostile resource's vLLM pods
B = "wronghit"
CALL_S = 4.0  # KVPERSIST_CANARY_CALL_TIMEOUT_S: the bound of one canary call, and a job's budget
INTERVAL_S = 60  # B's spec.canary.intervalSeconds (the least allowed)
HANG_BOUND_S = 60.0  # a held request ends at the latest this long after it came, hung up or not
REFERENCE = tuple(range(100, 116))  # 16 tokens: spec.canary.maxTokens' default
WRONG = tuple(range(200, 216))


class StandInVLLM:
    """A stand-in for one kwok vLLM pod's OpenAI API on the pod's loopback IP and vLLM port. A salted
    completion (the canary's reference, computed without the cache) answers REFERENCE at once; an
    unsalted one (a check, with the cache) answers `cached`, or when `cached` is None is held until
    the operator hangs up. Records when each check came."""

    def __init__(self, pod: str, ip: str, port: int, cached: tuple[int, ...] | None, halt: threading.Event) -> None:
        assert ip.startswith("127."), f"{pod} has IP {ip}: loopback addresses only"
        self.pod, self.cached, self.halt = pod, cached, halt
        self.lock = threading.Lock()
        self.checks: list[float] = []  # monotonic time of each unsalted completion
        self.hung_up_after: list[float] = []  # how long each held check was held before the operator hung up
        self.server = ThreadingHTTPServer((ip, port), self._handler())
        self.server.daemon_threads = False  # server_close() joins every connection thread
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.5}, daemon=True)
        self.thread.start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        vllm = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 10

            def log_message(self, *_: object) -> None:
                return

            def do_GET(self) -> None:
                self._send(404, b'{"error": "not found"}')

            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path != "/v1/completions":
                    return self._send(404, b'{"error": "not found"}')
                salted = "cache_salt" in payload
                if not salted:
                    with vllm.lock:
                        vllm.checks.append(time.monotonic())
                    if vllm.cached is None:
                        held = hold(self.connection, vllm.halt, HANG_BOUND_S)
                        if held is not None:
                            with vllm.lock:
                                vllm.hung_up_after.append(held)
                        return None
                tokens = REFERENCE if salted else vllm.cached
                self._send(200, json.dumps({"choices": [{"token_ids": list(tokens or ()), "text": "",
                                                         "finish_reason": "length"}],
                                            "usage": {"prompt_tokens": 1200}}).encode())

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def resource(ns: str, name: str, replicas: int) -> dict:
    """A resource whose vLLM pods (and so its server, which follows their placement) run on NODE."""
    obj = light(ns, name)
    obj["spec"]["vllm"].update(replicas=replicas, nodeSelector={"kubernetes.io/hostname": NODE},
                               tolerations=[{"key": TAINT, "operator": "Exists", "effect": "NoSchedule"}])
    return obj


def node() -> dict:
    """A kwok node for this test's pods only (tainted): room for 81 vLLM pods, a GPU each."""
    capacity = {"cpu": "2000", "memory": "64Ti", "pods": "200", "ephemeral-storage": "64Ti", "nvidia.com/gpu": "128"}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE, "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                         "labels": {"kubernetes.io/hostname": NODE, "kubernetes.io/os": "linux", "type": "kwok"}},
            "spec": {"taints": [{"key": TAINT, "value": "true", "effect": "NoSchedule"}]},
            "status": {"capacity": capacity, "allocatable": capacity}}


@pytest.fixture()
def scene(kubectl: Kubectl, crd: None, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The node, the namespace, the five resources (canary off) and the operator; every stand-in
    started by the test is closed here."""
    ns = f"e2e-{uuid.uuid4().hex[:8]}"
    names = [*HOSTILE, B]
    halt = threading.Event()
    stand_ins: dict[str, list[StandInVLLM]] = {}
    operator = None
    kubectl.apply(node())
    kubectl.run("create", "namespace", ns)
    try:
        kubectl.apply({"apiVersion": "v1", "kind": "List", "items": [o for n in names for o in _claimed(ns, n)]})
        operator = start_operator(kubectl.kubeconfig, ns, tmp_path / "operator.log",
                                  {"KVPERSIST_CANARY_CALL_TIMEOUT_S": str(CALL_S), "KVPERSIST_CACHE_FALLBACK_S": "3600"})
        objs = {n: resource(ns, n, 1 if n == B else PODS) for n in names}
        kubectl.apply({"apiVersion": "v1", "kind": "List", "items": list(objs.values())})
        yield {"ns": ns, "objs": objs, "stand_ins": stand_ins, "halt": halt, "log": tmp_path / "operator.log"}
    finally:
        if operator is not None:
            stop(operator)
        halt.set()
        for vllm in (v for group in stand_ins.values() for v in group):
            vllm.close()
        kubectl.run("delete", "namespace", ns, "--wait=false", check=False)
        kubectl.run("delete", "pv", *[f"{ns}-{n}-pv" for n in names], "--wait=false", "--ignore-not-found", check=False)
        kubectl.run("delete", "node", NODE, "--ignore-not-found", check=False)


def canary_pods(kubectl: Kubectl, ns: str, nid: str) -> list[judge.Pod]:
    """The namespace id's vLLM pods the canary would check: Ready, with the cache and an IP, on a node
    whose server is Ready (pod_views and judge.servers_of, as the operator selects them)."""
    pods = kubectl.get("pods", namespace=ns)["items"]
    return [p for p in pod_views(pods, nid, VLLM) if p.ready and p.uses_cache and p.ip
            and (servers := judge.servers_of(pods, nid, p.node)) and all(ready for _, _, ready in servers)]


def all_of(pods: list[judge.Pod], want: int) -> list[judge.Pod] | None:
    return pods if len(pods) == want else None


def where(kubectl: Kubectl, ns: str, name: str) -> str:
    """The resource's pods (phase, node, Ready, IP) and its conditions, for a wait that timed out."""
    pods = [p for p in kubectl.get("pods", namespace=ns)["items"] if p["metadata"]["name"].startswith(f"{name}-")]
    rows = [(p["metadata"]["name"], (p.get("status") or {}).get("phase"), (p.get("spec") or {}).get("nodeName"),
             (p.get("status") or {}).get("podIP"), sorted((p["metadata"].get("labels") or {}).items())) for p in pods]
    conds = (kubectl.get("kvcachenamespace", name, ns).get("status") or {}).get("conditions") or []
    return json.dumps({"pods": rows[:3], "count": len(rows), "conditions": [(c["type"], c["status"], c.get("reason"),
                       c.get("message", "")[:200]) for c in conds]}, indent=1)


def hit_correctness(kubectl: Kubectl, ns: str, name: str) -> dict[str, Any]:
    conds = (kubectl.get("kvcachenamespace", name, ns).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == judge.CONDITION), {})


def test_hanging_pods_of_four_resources_do_not_delay_anothers_hit_mismatch(kubectl: Kubectl, scene: dict) -> None:
    ns, objs, stand_ins, halt = scene["ns"], scene["objs"], scene["stand_ins"], scene["halt"]
    port = KVCacheNamespace.model_validate(objs[B]).spec.vllm.port
    for name, obj in objs.items():
        want, nid = 1 if name == B else PODS, str(target_of(obj, kubectl).namespace_id)  # the id follows the key
        pods = wait_for(f"{name}'s {want} vLLM pods Ready on {NODE} beside a Ready server",
                        lambda nid=nid, want=want: all_of(canary_pods(kubectl, ns, nid), want), timeout=180, interval=1.0,
                        explain=lambda name=name: where(kubectl, ns, name))
        stand_ins[name] = [StandInVLLM(p.name, str(p.ip), port, WRONG if name == B else None, halt) for p in pods]

    # Every worker of the pool held: each hostile resource's job has reached a check that hangs.
    for name in HOSTILE:
        kubectl.run("patch", "kvcachenamespace", name, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"canary": {"enabled": True}}}))
    wait_for("a hanging check of every hostile resource", lambda: all(any(v.checks for v in stand_ins[n]) for n in HOSTILE),
             timeout=120, interval=0.25)

    turned_on = time.monotonic()
    kubectl.run("patch", "kvcachenamespace", B, "-n", ns, "--type=merge",
                "-p", json.dumps({"spec": {"canary": {"enabled": True, "intervalSeconds": INTERVAL_S}}}))
    verdict = wait_for(f"{B}'s HitMismatch", lambda: (c := hit_correctness(kubectl, ns, B)).get("reason") == judge.MISMATCH and c,
                       timeout=240, interval=0.5, explain=lambda: json.dumps(hit_correctness(kubectl, ns, B)))
    verdict_s = time.monotonic() - turned_on
    b_vllm = stand_ins[B][0]
    checked_s = b_vllm.checks[0] - turned_on

    asked = {n: sum(1 for v in stand_ins[n] if v.checks and v.checks[0] <= b_vllm.checks[0]) for n in HOSTILE}
    held = [t for n in HOSTILE for v in stand_ins[n] for t in v.hung_up_after]
    print(f"\n{B}: checked {checked_s:.1f} s after its canary was turned on, HitMismatch in status after {verdict_s:.1f} s; "
          f"the hostile resources' pods asked by then (of {PODS} each): {asked}; held checks hung up after "
          f"{min(held):.1f}-{max(held):.1f} s ({len(held)} of them)")
    assert b_vllm.pod in verdict.get("message", ""), verdict
    # The hanging load stood the whole time: every hostile resource still had pods never asked.
    assert all(n < PODS for n in asked.values()), asked
    # The operator bounded every held check by its call's bound, not the stand-in's.
    assert held and max(held) < CALL_S + 5, held
    # B's check came within its own interval, not behind 20 calls of a hostile job (80 s).
    assert checked_s <= INTERVAL_S, f"{B} was checked {checked_s:.1f} s after it was due: beyond its {INTERVAL_S} s interval"
