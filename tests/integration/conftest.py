"""A real `lmcache server` process, started with exactly the args the operator renders for a
sample KVCacheNamespace: the L2 mount mapped into a temp folder, loopback address, free ports."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvpersist.api.convert import gib_quantity
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.lmcache import TELEMETRY_OFF_ENV, server_args
from kvpersist.builders.target import L2_KEY_BYTES, L2_KEY_FILE, L2_KEY_MOUNT_PATH, L2_MOUNT_PATH, Target
from kvpersist.identity import key_fingerprint, resolve
from kvpersist.inserver import program_source
from kvpersist.inventory.volume import TRIMMED_ADAPTERS, is_chunk_name
from tests.cases.invalid_manifests import sample
from tests.integration import kvdriver
from tests.integration.kvdriver import SHAPE_PINS, drive_subprocess

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
from kubelet_runner import localize_args  # noqa: E402

# This interpreter's own lmcache (its venv's bin need not be on PATH), else the one on PATH.
LMCACHE = shutil.which("lmcache", path=str(Path(sys.executable).parent)) or shutil.which("lmcache")
START_TIMEOUT_S = 120.0
# The key the servers mount unless a test gives another (write_key), and so the fingerprint in the
# targets' namespace ids: a server refuses to start on a key its target does not name.
STAND_IN_KEY = hashlib.sha256(b"kvpersist integration tests: the folder's key").digest()
STAND_IN_FINGERPRINT = key_fingerprint(STAND_IN_KEY)
NO_SERDE = "none"
# The rendered container's fixed variables that change what the server does here (no banner, no telemetry).
RENDERED_ENV = {"LMCACHE_DISABLE_BANNER": "1", **{e["name"]: e["value"] for e in TELEMETRY_OFF_ENV}}


def chunk_files(folder: Path) -> list[Path]:
    """A namespace folder's committed chunk files, in name order, whatever the adapter's layout
    (fs_native `*.data`, nixl_store_dynamic `*.bin`): what the inventory agent counts."""
    return sorted(p for p in folder.iterdir() if p.is_file() and any(is_chunk_name(p.name, a) for a in TRIMMED_ADAPTERS)
                  ) if folder.is_dir() else []


# Below the kernel's ephemeral range (32768-60999 here: /proc/sys/net/ipv4/ip_local_port_range),
# whose ports every outgoing connection takes as its source: one chosen there was taken by such a
# connection between the choice and the server's bind ("address already in use", seen once in CI).
# Below the local clusters' ports too (hack/localcluster.py: 26400 and 28400 on).
LISTEN_PORTS = range(12000, 26000)


def free_port() -> int:
    for _ in range(500):
        port = random.randrange(LISTEN_PORTS.start, LISTEN_PORTS.stop)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {LISTEN_PORTS}")


def free_port_pair() -> int:
    """A free loopback port whose next one is free too: a server's ZMQ port, and its admin port
    the operator puts next to it (LMCacheServer.http_port)."""
    for _ in range(50):
        port = free_port()
        if port < 65535:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two free loopback ports side by side")


def make_target(name: str = "nvme-minimal", l1_gb: float = 0.25, capacity_gb: float = 1, encrypted: bool = True,
                nvme: dict[str, Any] | None = None, server_cpu: str | None = None, **pins: Any) -> Target:
    """A sample's Target with these settings (nvme: more spec.l2.nvme fields, e.g. the adapter;
    server_cpu: the server pod's CPU request, which the serde's workers follow), its KV geometry
    pins those of the KV the driver sends (kvdriver.SHAPE) unless pins say otherwise."""
    obj = copy.deepcopy(sample(name))
    obj["spec"]["identity"].update({**SHAPE_PINS, **pins})
    obj["spec"]["l2"]["encryption"] = {"enabled": encrypted}
    obj["spec"]["l1"]["size"] = gib_quantity(l1_gb, "l1_gb")
    if "nvme" in obj["spec"]["l2"]:
        obj["spec"]["l2"]["nvme"].update(size="10Gi", maxCapacity=gib_quantity(capacity_gb, "capacity_gb"), **(nvme or {}))
    obj["spec"].setdefault("lmcacheServer", {})["port"] = free_port_pair()
    if server_cpu is not None:
        obj["spec"].setdefault("lmcacheServer", {})["resources"] = {"requests": {"cpu": server_cpu}}
    spec = KVCacheNamespace.model_validate(obj).spec
    # The id names the folder; the servers here mount key files the tests write (write_key), by
    # default the stand-in key, whose fingerprint the id carries (the operator reads the real one).
    namespace_id = resolve(spec.pins(STAND_IN_FINGERPRINT)).namespace_id
    return Target(obj["metadata"]["name"], "test", spec, namespace_id,
                  key_fingerprint=STAND_IN_FINGERPRINT if spec.l2.encryption.enabled else None)


def write_key(folder: Path, key: bytes | None = None) -> Path:
    """A folder as the key Secret's volume looks in the pod: master.key, 0400; the stand-in key
    (the one make_target's ids name) unless key is given."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / L2_KEY_FILE
    if not path.exists() or key is not None:
        if path.exists():
            path.chmod(0o600)
        path.write_bytes(key if key is not None else STAND_IN_KEY)
        path.chmod(0o400)
    return folder


def other_key(folder: Path) -> Path:
    """A key folder with a new random key (another Secret's bytes)."""
    return write_key(folder, os.urandom(L2_KEY_BYTES))


def expecting(target: Target, key_dir: Path) -> Target:
    """target as rendered for the key in key_dir, its namespace id (and so its folder) unchanged:
    what a server meets when a folder is moved by hand under another key."""
    return dataclasses.replace(target, key_fingerprint=key_fingerprint((key_dir / L2_KEY_FILE).read_bytes()))


@dataclass
class LocalServer:
    """One lmcache server process for a target; the volume folder outlives restarts."""

    target: Target
    volume: Path
    log: Path
    key_dir: Path | None = None  # the L2 key Secret's volume: master.key (made by write_key when None)
    proc: subprocess.Popen | None = None
    starts: list[float] = field(default_factory=list)
    # Another serde than the rendered one, e.g. lmcache's own "aesgcm" (its frames are ours): the
    # interoperability tests and the benchmark's comparison; NO_SERDE: lmcache's bare read, what
    # encryption off rendered before every object was checked. The rest of the args stay rendered.
    serde_type: str | None = None
    extra_args: tuple[str, ...] = ()  # appended to the rendered args (benchmarks/datapath_bench.py --server-arg)
    env: dict[str, str] = field(default_factory=dict)  # more environment, as the pod's env (e.g. the Hub token)
    cpus: str | None = None  # a taskset CPU list the process is held to (the pod's CPU request, in benchmarks)

    @property
    def argv(self) -> list[str]:
        assert LMCACHE
        mounts = {L2_MOUNT_PATH: self.volume}
        if self.target.key_secret is not None:
            if self.key_dir is None:
                self.key_dir = write_key(self.log.parent / f"{self.log.stem}-l2-key")
            mounts[L2_KEY_MOUNT_PATH] = self.key_dir
        # The program the pod runs (builders/lmcache.py SERVER_COMMAND): this Python (lmcache's,
        # or one with lmcache on PYTHONPATH: gpu_run.py --wheels) with kvpersist.inserver.serve,
        # which registers kvpersist's serde and runs lmcache.
        args = server_args(self.target)
        if self.serde_type is not None:
            at = args.index("--l2-adapter") + 1
            adapter = json.loads(args[at])
            if self.serde_type == NO_SERDE:
                del adapter["serde"]
            else:
                adapter["serde"]["type"] = self.serde_type
            args[at] = json.dumps(adapter, separators=(",", ":"), sort_keys=True)
        pinned = ["taskset", "-c", self.cpus] if self.cpus else []
        return [*pinned, sys.executable, "-c", program_source(),
                *localize_args(args, mounts, "127.0.0.1"), *self.extra_args]

    @property
    def rpc_url(self) -> str:
        return f"tcp://127.0.0.1:{self.target.spec.lmcache_server.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.target.spec.lmcache_server.http_port}"

    @property
    def l2_dir(self) -> Path:
        return self.volume / str(self.target.namespace_id)

    def start(self) -> float:
        """Starts and waits for /healthcheck; returns seconds to healthy."""
        t0 = time.monotonic()
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **RENDERED_ENV, **self.env})
        self.starts.append(t0)
        while time.monotonic() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise AssertionError(f"lmcache server exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            if self.healthy():
                return time.monotonic() - t0
            time.sleep(0.25)
        raise AssertionError(f"lmcache server not healthy after {START_TIMEOUT_S}s: {self.log.read_text()[-3000:]}")

    def start_to_exit(self, env: dict[str, str] | None = None) -> int | None:
        """Starts the server expecting it to end before it is healthy: its exit code, or None
        (stopped again) when it came up healthy instead."""
        t0 = time.monotonic()
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **RENDERED_ENV, **self.env, **(env or {})})
        self.starts.append(t0)
        while time.monotonic() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                return self.proc.returncode
            if self.healthy():
                self.stop()
                return None
            time.sleep(0.25)
        raise AssertionError(f"lmcache server neither exited nor became healthy in {START_TIMEOUT_S}s")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.http_url + "/healthcheck", timeout=2) as r:
                return r.status == 200
        except (OSError, http.client.HTTPException):  # not (yet) our server on that port: not healthy
            return False

    def l2_objects(self, status: dict[str, Any] | None = None) -> int:
        """The objects lmcache's L2 adapters say they hold (its /status, or the one given), 0 when
        it cannot say."""
        try:
            status = self.status() if status is None else status
            return sum(int(a.get("stored_object_count", 0)) for a in status["storage_manager"]["l2_adapters"])
        except (OSError, KeyError, ValueError, TypeError):
            return 0

    def wait_l2_writes(self, objects: int, timeout: float = 60.0, quiet_s: float = 2.0) -> bool:
        """True once lmcache's store controller holds no key for L2 and runs no write (its /status)
        and its L2 holds `objects`, or it has stayed idle for quiet_s (an L2 that evicts, refuses or
        fails a write never gets there); False after timeout, the test's own checks then saying
        what is missing. (A store's answer comes before its L2 writes, which a driver process's
        exit used to hide.) One /status read a poll."""
        deadline = time.monotonic() + timeout
        idle_since: float | None = None
        while time.monotonic() < deadline:
            try:
                status = self.status()
                stores = status["storage_manager"]["store_controller"]
                idle = stores["pending_keys_count"] == 0 and stores["in_flight_task_count"] == 0
            except (OSError, KeyError, ValueError):
                status, idle = None, False
            now = time.monotonic()
            idle_since = (idle_since or now) if idle else None
            if idle and (self.l2_objects(status) >= objects or now - idle_since >= quiet_s):
                return True
            time.sleep(0.1)
        return False

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.http_url + "/status", timeout=5) as r:
            return json.loads(r.read())

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def drive(server: LocalServer, mode: str, seqs: str) -> dict[str, Any]:
    """Runs the KV driver (tests/integration/kvdriver.py) against server; after a store, waits
    (bounded) for the server's L2 writes, which run after the store's answer, so the folder the test
    reads next holds them."""
    before = server.l2_objects() if mode == "store" else None
    out = drive_subprocess(mode, server.rpc_url, server.http_url, seqs)
    if before is not None:
        server.wait_l2_writes(before + out["summary"]["stored_chunks"])
    return out


@pytest.fixture(scope="session", autouse=True)
def kv_driver_fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The session's driver runs forked from one process that imported torch once
    (kvdriver.ForkServer; started at the first run), stopped at the end."""
    server = kvdriver.ForkServer(tmp_path_factory.mktemp("kvdriver"))
    kvdriver.FORK_SERVER = server
    try:
        yield
    finally:
        kvdriver.FORK_SERVER = None
        server.stop()


@pytest.fixture()
def servers(tmp_path: Path) -> Iterator[Callable[..., LocalServer]]:
    """Factory of LocalServers sharing one volume folder by default; all stopped at the end."""
    if LMCACHE is None:
        pytest.fail("lmcache not on PATH: run through hack/test.sh (installs the datapath extra)")
    made: list[LocalServer] = []

    def make(target: Target, volume: Path | None = None, key_dir: Path | None = None) -> LocalServer:
        # One key per test, as one Secret serves every replica and restart; a test may pass another.
        key = key_dir or write_key(tmp_path / "l2-key")
        srv = LocalServer(target, volume or (tmp_path / "volume"), tmp_path / f"server-{len(made)}.log", key)
        srv.volume.mkdir(parents=True, exist_ok=True)
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.stop()


@pytest.fixture()
def agents(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Inventory agents as the operator renders them (test_capacity.AgentProcess), one per call,
    all stopped at the end."""
    from tests.integration.test_capacity import AgentProcess  # it imports this module

    made: list[AgentProcess] = []

    def make(srv: LocalServer, pod_name: str | None = None, flags: dict[str, str] | None = None) -> AgentProcess:
        made.append(AgentProcess(srv, tmp_path / f"agent-{len(made)}.log", pod_name, flags))
        return made[-1]

    yield make
    for agent in made:
        agent.stop()
