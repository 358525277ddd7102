"""Thousands of idle connections to the inventory agent and to the operator's metrics server: each
stays within its container's memory limit (as the builders and the chart set them), with a fixed
number of threads, answers a fresh client within the bound its caller gives it, and closes the
idle connections itself (kvpersist.httpserver).

The agent is the real process, started with the args agent_container renders (its claim and token
Secret mapped to folders, 0.0.0.0 to 127.0.0.1), as tests/integration/test_capacity.py starts it;
no lmcache server is needed for /healthz and /inventory. The metrics server runs alone in a
process of its own (kvpersist.controller.metrics.serve, as `kvpersist run --metrics-port` starts
it): a STAND-IN for the operator's process, without kopf and an API server. So is the liveness
endpoint's: the bounded front (kvpersist.controller.health, as `kvpersist run --liveness` starts
it) before kopf's own endpoint (kopf's health_reporter, the aiohttp server kopf.run starts, with
the operator's probe registered), in one process without an API server.

Half of the connections send nothing, half the start of a request head and then nothing (a slow
loris that has stopped trickling). The fd limit of this process, and so of the servers it starts,
is raised above the number of connections, as in a container (1048576 under containerd): what
bounds the servers must be their own cap, not EMFILE.

Complete requests are the other flood: the agent's /server/metrics needs no token, and with an
lmcache that does not answer each holds a worker for the forward's whole deadline. They fill the
workers and the queue (503 to every other request), and the kubelet's /healthz must still be
answered 200, or the probe fails and the pod restarts (and, as readiness, leaves its Service).
"""

from __future__ import annotations

import json
import os
import re
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from kubernetes.utils.quantity import parse_quantity

from kvpersist.builders.lmcache import agent_container
from kvpersist.builders.target import AGENT_TOKEN_KEY, AGENT_TOKEN_MOUNT_PATH, L2_MOUNT_PATH
from kvpersist.httpserver import HEAD_TIMEOUT_S, QUEUE, WORKERS
from kvpersist.inventory.agentclient import TIMEOUT_S, fetch_inventory
from tests.integration.conftest import REPO, free_port, localize_args, make_target
from tests.unit.test_bounded_http import status_of

CONNECTIONS = 10000
THREADS_OVER_IDLE = 2  # what the thread count may grow by under the flood (none expected)
START_S = 60.0
CLOSE_SLACK_S = 15.0  # on top of the head timeout: a loaded 2-core machine


def memory_limit(resources: dict) -> int:
    return int(parse_quantity(resources["limits"]["memory"]))


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS (bytes) and Threads of a process, from /proc."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "VmRSS":
            out["rss"] = int(value.split()[0]) * 1024
        elif key == "Threads":
            out["threads"] = int(value)
    return out


@dataclass
class Served:
    """A server process on 127.0.0.1: its port, its pid, the memory limit of its container, and the
    request a fresh client makes (returns whether it got a good answer)."""

    proc: subprocess.Popen
    port: int
    limit: int
    log: Path
    token: str = ""
    fresh: list = field(default_factory=list)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def raise_fd_limit(n: int) -> None:
    """The soft fd limit of this process (and of the servers it starts) above n; the hard one too
    where allowed (root). A skip only where neither can be."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 512
    if soft >= want:
        return
    if hard != resource.RLIM_INFINITY and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
        except (ValueError, OSError):
            pytest.skip(f"the fd hard limit ({hard}) is under {want} and may not be raised: {n} connections do not fit")
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO), os.environ.get("PYTHONPATH", "")])}


def _wait_up(served: Served, url: str) -> None:
    deadline = time.monotonic() + START_S
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            assert served.proc.poll() is None and time.monotonic() < deadline, f"did not start: {served.log.read_text()[-3000:]}"
            time.sleep(0.1)


def start_agent(tmp: Path, lmcache_port: int | None = None) -> Served:
    """`kvpersist agent` with the args the operator renders for a sample nvme KVCacheNamespace;
    its --server-url at lmcache_port when given."""
    target = make_target()
    container = agent_container(target, "unused")
    volume, token_dir = tmp / "volume", tmp / "agent-token"
    volume.mkdir(parents=True)
    token_dir.mkdir(parents=True)
    token = "idle-test-" + os.urandom(8).hex()
    (token_dir / AGENT_TOKEN_KEY).write_text(token)
    args = localize_args(container["args"], {L2_MOUNT_PATH: volume, AGENT_TOKEN_MOUNT_PATH: token_dir}, "127.0.0.1")
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    if lmcache_port is not None:
        args[args.index("--server-url") + 1] = f"http://127.0.0.1:{lmcache_port}"
    log = tmp / "agent.log"
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpersist.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                env=_env(), start_new_session=True)
    served = Served(proc, port, memory_limit(container["resources"]), log, token)
    _wait_up(served, f"http://127.0.0.1:{port}/healthz")
    probe_timeout = container["livenessProbe"]["timeoutSeconds"]

    def inventory() -> bool:  # the operator's own call, under its own deadline
        return fetch_inventory("127.0.0.1", port, token=token) is not None

    def probe() -> bool:  # the kubelet's probe, under the probe's timeout
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=probe_timeout) as r:
            return r.status == 200

    served.fresh = [("operator /inventory", inventory, TIMEOUT_S), ("kubelet /healthz", probe, probe_timeout)]
    return served


def start_metrics(tmp: Path) -> Served:
    """The operator's metrics server alone (a stand-in for the operator's process); its limit is
    the chart's default for the operator container."""
    values = yaml.safe_load((REPO / "charts" / "kvpersist" / "values.yaml").read_text())
    port = free_port()
    log = tmp / "metrics.log"
    code = ("import threading; from kvpersist.controller import metrics; "
            f"metrics.serve('127.0.0.1', {port}); threading.Event().wait()")
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=_env(),
                                start_new_session=True)
    served = Served(proc, port, memory_limit(values["resources"]), log)
    _wait_up(served, f"http://127.0.0.1:{port}/metrics")

    def scrape() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return b"kvpersist_status_writes_total" in r.read()

    served.fresh = [("Prometheus /metrics", scrape, 5.0)]
    return served


def start_liveness(tmp: Path) -> Served:
    """The liveness front and kopf's endpoint behind it (a stand-in for the operator's process);
    the limit is the chart's for the operator, the bound the chart's probe timeout."""
    chart = REPO / "charts" / "kvpersist"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    deployment = (chart / "templates" / "deployment.yaml").read_text()
    probe_timeout = int(re.search(r"livenessProbe:(?:\n .*?)*?timeoutSeconds: (\d+)", deployment).group(1))  # type: ignore[union-attr]
    port = free_port()
    log = tmp / "liveness.log"
    code = ("import asyncio, kopf; from kopf._core.engines.probing import health_reporter; "
            "from kvpersist.controller import health, status_loop; "
            f"url, upstream = health.kopf_endpoint('/healthz'); health.serve('127.0.0.1', {port}, '/healthz', upstream); "
            "asyncio.run(health_reporter(url, memo=kopf.Memo(), indices={}, registry=kopf.get_default_registry(), "
            "settings=kopf.OperatorSettings()))")
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=_env(),
                                start_new_session=True)
    served = Served(proc, port, memory_limit(values["resources"]), log)
    _wait_up(served, f"http://127.0.0.1:{port}/healthz")

    def probe() -> bool:  # the kubelet's, answered by kopf through the front
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=probe_timeout) as r:
            return r.status == 200 and "statusLoopSecondsSinceTick" in json.loads(r.read())

    served.fresh = [("kubelet /healthz", probe, float(probe_timeout))]
    return served


@contextmanager
def flood(port: int, n: int) -> Iterator[list[socket.socket]]:
    """n connections to the port, every second one having sent the start of a request head; all
    closed at the end."""
    socks: list[socket.socket] = []
    try:
        for i in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 2:
                s.sendall(b"GET /inventory HTTP/1.1\r\nHost: agent\r\nX-Slow: ")
            socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()


def wait_all_closed(socks: list[socket.socket], bound: float) -> int:
    """How many of the sockets the server closed (EOF or reset, after an answer such as a 408 or
    not) within bound seconds."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + bound
    while closed < len(socks) and (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(min(left, 1.0)):
            try:
                data = key.fileobj.recv(4096)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                closed += 1
    sel.close()
    return closed


@pytest.mark.parametrize("start", [start_agent, start_metrics, start_liveness], ids=["agent", "metrics", "liveness"])
def test_thousands_of_idle_connections(tmp_path: Path, start) -> None:  # type: ignore[no-untyped-def]
    raise_fd_limit(CONNECTIONS)
    served = start(tmp_path)
    try:
        before = proc_status(served.proc.pid)
        peak = dict(before)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.05):
                try:
                    now = proc_status(served.proc.pid)
                except (OSError, ValueError):
                    return
                peak.update({k: max(peak[k], v) for k, v in now.items()})

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            with flood(served.port, CONNECTIONS) as socks:
                time.sleep(1.0)  # the server has seen them all
                answers = []
                for name, call, bound in served.fresh:
                    t0 = time.monotonic()
                    ok = call()
                    answers.append((name, ok, round(time.monotonic() - t0, 2), bound))
                closed = wait_all_closed(socks, HEAD_TIMEOUT_S + CLOSE_SLACK_S)
        finally:
            done.set()
            sampler.join(5)
        print(f"{start.__name__}: {CONNECTIONS} idle connections: RSS {before['rss'] >> 20} -> peak {peak['rss'] >> 20} MiB "
              f"(limit {served.limit >> 20} MiB), threads {before['threads']} -> peak {peak['threads']}; fresh clients {answers}; "
              f"closed by the server: {closed}")
        assert peak["rss"] < served.limit, (peak, served.limit)
        assert peak["threads"] <= before["threads"] + THREADS_OVER_IDLE, (before, peak)
        for name, ok, took, bound in answers:
            assert ok and took < bound, f"{name}: answered {ok} in {took}s (bound {bound}s)"
        assert closed == CONNECTIONS, f"the server closed {closed} of {CONNECTIONS} idle connections"
        assert served.proc.poll() is None, served.log.read_text()[-3000:]
    finally:
        served.stop()


def answer_of(port: int, raw: bytes, timeout: float) -> tuple[int, bytes]:
    """One request on a fresh connection: (status code, body)."""
    return status_of(port, raw, timeout)


def test_the_agents_probe_is_answered_while_complete_requests_hold_every_worker(tmp_path: Path) -> None:
    """Token-free /server/metrics requests, sent without pause while lmcache never answers: every
    worker waits out the forward's deadline and the queue stays full (other requests read 503);
    the kubelet's /healthz is answered 200, from the agent's own state, within the probe's timeout."""
    silent = socket.socket()  # an lmcache that takes connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(1024)
    served = start_agent(tmp_path, silent.getsockname()[1])
    probe_timeout = agent_container(make_target(), "unused")["livenessProbe"]["timeoutSeconds"]
    stop = threading.Event()
    request = b"GET /server/metrics HTTP/1.0\r\n\r\n"
    try:
        with ExitStack() as stack:
            def flood_complete() -> None:
                while not stop.is_set():
                    try:
                        s = stack.enter_context(socket.create_connection(("127.0.0.1", served.port), timeout=10))
                        s.sendall(request)
                    except OSError:
                        pass
                    stop.wait(0.005)

            flooder = threading.Thread(target=flood_complete, daemon=True)
            for _ in range(WORKERS + QUEUE):  # the pool and the queue, filled before the flood goes on
                stack.enter_context(socket.create_connection(("127.0.0.1", served.port), timeout=10)).sendall(request)
            flooder.start()
            try:
                def wait_full() -> None:
                    """Until a flood request reads 503; one that finds a slot (as 8 workers free at
                    once) waits its turn instead (504 from the forward) and is tried again."""
                    deadline = time.monotonic() + 60
                    while (code := answer_of(served.port, request, 30)[0]) != 503:
                        assert time.monotonic() < deadline, f"the queue never filled: {code}"

                wait_full()
                probes = []
                for _ in range(5):  # over 2 s: across the moments the workers' forwards end
                    probes.append(answer_of(served.port, b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n", probe_timeout))
                    time.sleep(0.4)
                wait_full()
                print(f"/healthz with every worker held and the queue full: {probes}")
                assert all(code == 200 and json.loads(body) == {"status": "ok"} for code, body in probes), probes
            finally:
                stop.set()
                flooder.join(10)
        assert served.proc.poll() is None, served.log.read_text()[-3000:]
    finally:
        served.stop()
        silent.close()

