#!/usr/bin/env python3
"""A real local Kubernetes control plane on loopback: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok with fake nodes.

No container runtime or release download works on these machines, so the binaries
are built from Go modules (hack/build-cluster-bins.sh) and run here as processes.

    python3 hack/localcluster.py build    # build/cache the binaries, print their folder
    python3 hack/localcluster.py up       # start everything, print the kubeconfig path
    python3 hack/localcluster.py status   # exit 0 when every component runs and the API is ready
    python3 hack/localcluster.py down     # stop everything, wipe the cluster's data

Standard library only: it runs before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("KVPERSIST_CACHE", Path.home() / ".cache" / "kvpersist"))
STATE = Path(os.environ.get("KVPERSIST_CLUSTER_DIR", CACHE / "cluster"))
KUBECONFIG = STATE / "kubeconfig"
AUDIT_LOG = STATE / "logs" / "audit.log"
HOST = "127.0.0.1"
PORT_BASE = int(os.environ.get("KVPERSIST_CLUSTER_PORT_BASE", "26400"))
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_API_IP = "10.96.0.1"
START_TIMEOUT_S = float(os.environ.get("KVPERSIST_CLUSTER_START_TIMEOUT", "180"))
STOP_TIMEOUT_S = 20.0

PORTS = {
    "etcd-client": PORT_BASE + 1,
    "etcd-peer": PORT_BASE + 2,
    "kube-apiserver": PORT_BASE + 43,
    "kube-controller-manager": PORT_BASE + 57,
    "kube-scheduler": PORT_BASE + 59,
    "kwok": PORT_BASE + 47,
}
API_URL = f"https://{HOST}:{PORTS['kube-apiserver']}"

# Fake nodes: one CPU node for the lmcache servers and one GPU node sized like an 8-GPU host.
REAL_NODE = "real-gpu-0"
REAL_NODE_TAINT = "kvpersist.dev/real-kubelet"
# A second real node, for tests across nodes (tests/e2e/test_scale_out.py). Its own taint keeps
# every pod that tolerates only REAL_NODE_TAINT (the demo, a test with a toleration and no
# hostname) off it: only what tolerates both lands there.
SECOND_NODE = "real-gpu-1"
SECOND_NODE_TAINT = "kvpersist.dev/second-real-node"
REAL_NODES = (REAL_NODE, SECOND_NODE)


def real_node(name: str) -> dict:
    """A GPU node whose pods are run for real by hack/kubelet_runner.py, which plays its kubelet:
    kwok starts its pods unready, and the runner reports Ready when the pod's own readiness probe
    passes. Tainted, so only pods that ask for it (tests, the demo) land here."""
    taints = [{"key": REAL_NODE_TAINT, "value": "true", "effect": "NoSchedule"}]
    if name != REAL_NODE:
        taints.append({"key": SECOND_NODE_TAINT, "value": "true", "effect": "NoSchedule"})
    return {
        "name": name,
        "labels": {
            "node.kubernetes.io/instance-type": "gpu-8x",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": "NVIDIA-H200",
            REAL_NODE_TAINT: "true",
        },
        "taints": taints,
        "capacity": {
            "cpu": "96",
            "memory": "1536Gi",
            "pods": "110",
            "ephemeral-storage": "4Ti",
            "nvidia.com/gpu": "8",
        },
    }


NODES = [
    {
        "name": "kwok-cpu-0",
        "labels": {"node.kubernetes.io/instance-type": "cpu-large"},
        "capacity": {"cpu": "32", "memory": "256Gi", "pods": "110", "ephemeral-storage": "1Ti"},
    },
    {
        "name": "kwok-gpu-0",
        "labels": {
            "node.kubernetes.io/instance-type": "gpu-8x",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": "NVIDIA-H200",
        },
        "capacity": {
            "cpu": "96",
            "memory": "1536Gi",
            "pods": "110",
            "ephemeral-storage": "4Ti",
            "nvidia.com/gpu": "8",
        },
    },
    *(real_node(name) for name in REAL_NODES),
]


class ClusterError(Exception):
    """A one-line, actionable failure."""


# What the NVIDIA GPU Operator creates, and what the pods name by default (spec.*.runtimeClassName):
# the API server refuses a pod whose RuntimeClass does not exist. A stand-in here: kwok and the
# kubelet runner run no container runtime, so its handler is never called.
RUNTIME_CLASS = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"}, "handler": "nvidia"}


def log(msg: str) -> None:
    print(f"[localcluster] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- binaries


def bin_dir(build: bool) -> Path:
    """The folder holding the cached binaries; builds them first when asked."""
    script = REPO / "hack" / "build-cluster-bins.sh"
    if build:
        out = subprocess.run(["bash", str(script)], check=False, stdout=subprocess.PIPE, text=True)
        if out.returncode != 0:
            raise ClusterError(f"building the cluster binaries failed (exit {out.returncode}); see the log above")
        return Path(out.stdout.strip().splitlines()[-1])
    out = subprocess.run(["bash", str(script), "--bin-dir"], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip())


def need_binaries() -> dict[str, Path]:
    d = bin_dir(build=False)
    names = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kubectl", "helm"]
    found = {n: d / n for n in names}
    missing = [n for n, p in found.items() if not os.access(p, os.X_OK)]
    if missing:
        raise ClusterError(
            f"missing binaries {', '.join(missing)} in {d}: run `python3 hack/localcluster.py build` first"
        )
    return found


# ---------------------------------------------------------------- certificates


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def make_pki(pki: Path) -> None:
    """A CA, the apiserver's serving cert, one client cert per component, the SA key pair."""
    if shutil.which("openssl") is None:
        raise ClusterError("openssl not found: install it (apt-get install openssl)")
    pki.mkdir(parents=True, exist_ok=True)
    if (pki / "done").exists():
        return
    openssl("genrsa", "-out", str(pki / "ca.key"), "2048")
    openssl("req", "-x509", "-new", "-nodes", "-key", str(pki / "ca.key"), "-subj", "/CN=kvpersist-local-ca",
            "-days", "3650", "-out", str(pki / "ca.crt"))
    san = f"DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:{HOST},IP:{SERVICE_API_IP}"
    certs = {
        "apiserver": ("/CN=kube-apiserver", "serverAuth", san),
        "admin": ("/O=system:masters/CN=kubernetes-admin", "clientAuth", None),
        "controller-manager": ("/CN=system:kube-controller-manager", "clientAuth", None),
        "scheduler": ("/CN=system:kube-scheduler", "clientAuth", None),
        "kwok": ("/O=system:masters/CN=kwok-controller", "clientAuth", None),
    }
    for name, (subj, usage, alt) in certs.items():
        ext = pki / f"{name}.ext"
        lines = ["basicConstraints=CA:FALSE", "keyUsage=digitalSignature,keyEncipherment", f"extendedKeyUsage={usage}"]
        if alt:
            lines.append(f"subjectAltName={alt}")
        ext.write_text("\n".join(lines) + "\n")
        openssl("genrsa", "-out", str(pki / f"{name}.key"), "2048")
        openssl("req", "-new", "-key", str(pki / f"{name}.key"), "-subj", subj, "-out", str(pki / f"{name}.csr"))
        openssl("x509", "-req", "-in", str(pki / f"{name}.csr"), "-CA", str(pki / "ca.crt"), "-CAkey",
                str(pki / "ca.key"), "-CAcreateserial", "-days", "3650", "-extfile", str(ext),
                "-out", str(pki / f"{name}.crt"))
    openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
    (pki / "done").write_text("ok\n")


def write_kubeconfig(path: Path, pki: Path, user: str) -> None:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kvpersist-local", "cluster": {"server": API_URL, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate": str(pki / f"{user}.crt"), "client-key": str(pki / f"{user}.key")}}],
        "contexts": [{"name": "kvpersist-local", "context": {"cluster": "kvpersist-local", "user": user, "namespace": "default"}}],
        "current-context": "kvpersist-local",
    }
    path.write_text(json.dumps(cfg, indent=2) + "\n")  # JSON is valid YAML, and the stdlib writes it


# ---------------------------------------------------------------- processes


@dataclass
class Component:
    name: str
    argv: list[str]
    ready: str  # "tcp" (port accepts) or "api" (apiserver /readyz says ok)


def pid_file(name: str) -> Path:
    return STATE / "pids" / f"{name}.pid"


def running_pid(name: str) -> int | None:
    """The pid of our component, or None; a stale pid file of a reused pid does not count."""
    pf = pid_file(name)
    try:
        pid = int(pf.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except (OSError, ValueError):
        return None
    return pid if Path(cmdline).name == name else None


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


def api_ready(pki: Path, path: str = "/readyz") -> bool:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    try:
        with urllib.request.urlopen(API_URL + path, context=ctx, timeout=3) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start(comp: Component, pki: Path) -> None:
    logf = open(STATE / "logs" / f"{comp.name}.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(comp.argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    logf.close()
    pid_file(comp.name).write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + START_TIMEOUT_S
    port = PORTS[comp.name if comp.name != "etcd" else "etcd-client"]
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (STATE / "logs" / f"{comp.name}.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise ClusterError(f"{comp.name} exited with {proc.returncode}: {' | '.join(tail)}")
        if (comp.ready == "api" and api_ready(pki)) or (comp.ready == "tcp" and port_open(port)):
            log(f"{comp.name} ready (pid {proc.pid})")
            return
        time.sleep(0.5)
    raise ClusterError(f"{comp.name} not ready after {START_TIMEOUT_S:.0f}s; see {STATE / 'logs' / (comp.name + '.log')}")


# Requests of ServiceAccounts outside kube-system (an operator run with a chart's credentials),
# at Metadata level: the user, verb, resource, status code and the authorizer's decision, no bodies.
# Each request is logged when it completes (ResponseComplete); a watch also when it starts
# (ResponseStarted), since it completes only when the server ends it, minutes later, and a count of
# reads must see the watches a window opened (tests/e2e/test_idle_reads.py).
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "userGroups": ["system:serviceaccounts:kube-system"]},
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"], "verbs": ["watch"]},
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"], "omitStages": ["ResponseStarted"]},
        {"level": "None"},
    ],
}


def write_audit_policy() -> Path:
    path = STATE / "audit-policy.json"
    path.write_text(json.dumps(AUDIT_POLICY, indent=2) + "\n")
    return path


def components(bins: dict[str, Path], pki: Path) -> list[Component]:
    etcd_url = f"http://{HOST}:{PORTS['etcd-client']}"
    kc = STATE / "kubeconfigs"
    return [
        Component("etcd", [
            str(bins["etcd"]), "--name=kvpersist-local", f"--data-dir={STATE / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls=http://{HOST}:{PORTS['etcd-peer']}",
            f"--initial-advertise-peer-urls=http://{HOST}:{PORTS['etcd-peer']}",
            f"--initial-cluster=kvpersist-local=http://{HOST}:{PORTS['etcd-peer']}",
            "--listen-metrics-urls=", "--quota-backend-bytes=4294967296", "--log-level=warn",
            "--unsafe-no-fsync",  # a throwaway test cluster: durability of etcd itself is not under test
        ], "tcp"),
        Component("kube-apiserver", [
            str(bins["kube-apiserver"]), f"--etcd-servers={etcd_url}",
            f"--bind-address={HOST}", f"--advertise-address={HOST}", f"--secure-port={PORTS['kube-apiserver']}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--authorization-mode=Node,RBAC",
            "--allow-privileged=true", "--profiling=false", "--v=1",
            # Who was refused what, for tests that must tell an RBAC refusal from any other 403.
            f"--audit-policy-file={write_audit_policy()}", f"--audit-log-path={AUDIT_LOG}", "--audit-log-format=json",
            "--audit-log-maxsize=64", "--audit-log-maxbackup=1",
            # The default reconciler refuses a loopback advertise address; nothing in-cluster needs it.
            "--endpoint-reconciler-type=none",
        ], "api"),
        Component("kube-controller-manager", [
            str(bins["kube-controller-manager"]), f"--kubeconfig={kc / 'controller-manager'}",
            f"--authentication-kubeconfig={kc / 'controller-manager'}",
            f"--authorization-kubeconfig={kc / 'controller-manager'}",
            f"--bind-address={HOST}", f"--secure-port={PORTS['kube-controller-manager']}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}", f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--profiling=false", "--v=1",
            # Pod IPs here are loopback addresses, which Endpoints and EndpointSlices refuse: those
            # controllers would retry (and post events) forever. Nothing routes Service traffic here.
            "--controllers=*,-endpoint,-endpointslice,-endpointslicemirroring",
        ], "tcp"),
        Component("kube-scheduler", [
            str(bins["kube-scheduler"]), f"--kubeconfig={kc / 'scheduler'}",
            f"--authentication-kubeconfig={kc / 'scheduler'}", f"--authorization-kubeconfig={kc / 'scheduler'}",
            f"--bind-address={HOST}", f"--secure-port={PORTS['kube-scheduler']}",
            "--leader-elect=false", "--profiling=false", "--v=1",
        ], "tcp"),
        Component("kwok", [
            str(bins["kwok"]), f"--kubeconfig={kc / 'kwok'}",
            "--manage-all-nodes=false", "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--config={write_kwok_stages(bins)}", "--node-lease-duration-seconds=40",
            f"--server-address={HOST}:{PORTS['kwok']}", f"--node-ip={HOST}",
            f"--cidr={os.environ.get('KVPERSIST_POD_CIDR', '127.16.0.0/16')}",
        ], "tcp"),
    ]


def kubectl(bins: dict[str, Path], *args: str, stdin: str | None = None) -> str:
    out = subprocess.run([str(bins["kubectl"]), f"--kubeconfig={KUBECONFIG}", *args], input=stdin, text=True,
                         capture_output=True, timeout=60)
    if out.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def node_manifest(spec: dict) -> dict:
    labels = {"kubernetes.io/hostname": spec["name"], "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
              "type": "kwok", **spec["labels"]}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": spec["name"], "labels": labels,
                     "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"}},
        "spec": {"taints": spec.get("taints", [])},
        "status": {"capacity": spec["capacity"], "allocatable": spec["capacity"]},
    }


# Pods on the real nodes start Running with an IP but unready; the runner, as their kubelet,
# reports readiness from their probes. kwok's own "pod-ready" stage leaves them alone.
REAL_NODE_VALUES = "\n".join(f"      - '{name}'" for name in REAL_NODES)
REAL_NODE_STAGE = f"""apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-start-unready-on-real-node
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values:
      - 'Pending'
    - key: '.spec.nodeName'
      operator: 'In'
      values:
{REAL_NODE_VALUES}
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      conditions:
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "True"
        type: Initialized
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "True"
        type: PodScheduled
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "False"
        reason: ContainersNotReady
        type: Ready
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "False"
        reason: ContainersNotReady
        type: ContainersReady
      containerStatuses:
      {{{{ range .spec.containers }}}}
      - image: {{{{ .image | Quote }}}}
        name: {{{{ .name | Quote }}}}
        ready: false
        started: false
        restartCount: 0
        state:
          running:
            startedAt: {{{{ $now | Quote }}}}
      {{{{ end }}}}
      {{{{ $hostIPs := NodeIPsWith .spec.nodeName }}}}
      {{{{ with $hostIPs }}}}
      hostIP: {{{{ index . 0 | Quote }}}}
      hostIPs:
      {{{{ range . }}}}
      - ip: {{{{ . | Quote }}}}
      {{{{ end }}}}
      {{{{ end }}}}
      {{{{ $podIPs := PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" )
           ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}}}
      {{{{ with $podIPs }}}}
      podIP: {{{{ index . 0 | Quote }}}}
      podIPs:
      {{{{ range . }}}}
      - ip: {{{{ . | Quote }}}}
      {{{{ end }}}}
      {{{{ end }}}}
      phase: Running
      startTime: {{{{ $now | Quote }}}}
"""


def write_kwok_stages(bins: dict[str, Path]) -> Path:
    """kwok's fast stages from its module, with "pod-ready" kept off the real node, plus the
    real node's own start stage."""
    docs = bins["kwok"].parent.joinpath("kwok-stages.yaml").read_text().split("\n---\n")
    out = []
    for doc in docs:
        if "name: pod-ready\n" in doc:
            marker = "    matchExpressions:\n"
            assert marker in doc, "kwok's pod-ready stage changed shape: update write_kwok_stages"
            doc = doc.replace(marker, marker + f"    - key: '.spec.nodeName'\n      operator: 'NotIn'\n      values:\n"
                              f"{REAL_NODE_VALUES}\n", 1)
        out.append(doc)
    path = STATE / "kwok-stages.yaml"
    path.write_text("\n---\n".join([*out, REAL_NODE_STAGE]))
    return path


def wait_nodes_ready(bins: dict[str, Path]) -> None:
    deadline = time.monotonic() + 60
    want = {n["name"] for n in NODES}
    while time.monotonic() < deadline:
        items = json.loads(kubectl(bins, "get", "nodes", "-o", "json"))["items"]
        ready = {i["metadata"]["name"] for i in items
                 if any(c["type"] == "Ready" and c["status"] == "True" for c in i.get("status", {}).get("conditions", []))}
        if want <= ready:
            return
        time.sleep(1)
    raise ClusterError(f"nodes {sorted(want)} not Ready after 60s; see {STATE / 'logs' / 'kwok.log'}")


def wait_default_sa(bins: dict[str, Path]) -> None:
    """Pods are refused until the controller-manager made the namespace's default ServiceAccount."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if subprocess.run([str(bins["kubectl"]), f"--kubeconfig={KUBECONFIG}", "get", "serviceaccount", "default"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30).returncode == 0:
            return
        time.sleep(1)
    raise ClusterError("the default ServiceAccount did not appear within 60s; see the controller-manager log")


# ---------------------------------------------------------------- commands


def cmd_build(_: argparse.Namespace) -> None:
    print(bin_dir(build=True))


def cmd_up(args: argparse.Namespace) -> None:
    if args.build:
        bin_dir(build=True)
    bins = need_binaries()
    names = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"]
    live = [n for n in names if running_pid(n)]
    if live == names and api_ready(STATE / "pki"):
        kubectl(bins, "apply", "-f", "-", stdin=json.dumps(RUNTIME_CLASS))  # one started before it was added
        log("already running")
        print(KUBECONFIG)
        return
    if live:
        raise ClusterError(f"a partial cluster is running ({', '.join(live)}): run `python3 hack/localcluster.py down` first")
    for name, port in PORTS.items():
        if not port_free(port):
            raise ClusterError(f"port {port} ({name}) on {HOST} is in use: stop what holds it, or set "
                               "KVPERSIST_CLUSTER_PORT_BASE to another base port")
    t0 = time.monotonic()
    for sub in ("pids", "logs", "kubeconfigs"):
        (STATE / sub).mkdir(parents=True, exist_ok=True)
    shutil.rmtree(STATE / "etcd", ignore_errors=True)
    pki = STATE / "pki"
    make_pki(pki)
    write_kubeconfig(KUBECONFIG, pki, "admin")
    for user in ("controller-manager", "scheduler", "kwok"):
        write_kubeconfig(STATE / "kubeconfigs" / user, pki, user)
    try:
        for comp in components(bins, pki):
            start(comp, pki)
        nodes = {"apiVersion": "v1", "kind": "List", "items": [*(node_manifest(n) for n in NODES), RUNTIME_CLASS]}
        kubectl(bins, "apply", "-f", "-", stdin=json.dumps(nodes))
        wait_nodes_ready(bins)
        wait_default_sa(bins)
    except BaseException:
        stop_all()
        raise
    log(f"up in {time.monotonic() - t0:.1f}s; export KUBECONFIG={KUBECONFIG}")
    print(KUBECONFIG)


def stop_component(name: str, pid: int, sig: int = signal.SIGTERM) -> None:
    """Signals the component's process group, SIGKILL when it outlives the bound (the API server
    can take long to drain its watches)."""
    os.killpg(pid, sig)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and running_pid(name):
        time.sleep(0.2)
    if running_pid(name):
        os.killpg(pid, signal.SIGKILL)
        time.sleep(0.5)
    pid_file(name).unlink(missing_ok=True)


def stop_all() -> list[str]:
    """Stops in reverse start order; returns what was stopped."""
    stopped = []
    for name in ["kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"]:
        pid = running_pid(name)
        if pid is None:
            pid_file(name).unlink(missing_ok=True)
            continue
        stop_component(name, pid)
        stopped.append(name)
    return stopped


def cmd_down(_: argparse.Namespace) -> None:
    stopped = stop_all()
    shutil.rmtree(STATE / "etcd", ignore_errors=True)
    for old in (STATE / "logs").glob("audit*.log"):
        old.unlink()
    left = [n for n in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok") if running_pid(n)]
    if left:
        raise ClusterError(f"still running after down: {', '.join(left)}")
    log(f"stopped {', '.join(stopped) if stopped else 'nothing (was not running)'}")


def cmd_restart(args: argparse.Namespace) -> None:
    """Stops one component and starts it again with the same flags: for fault tests."""
    name = args.component
    pki = STATE / "pki"
    comp = next((c for c in components(need_binaries(), pki) if c.name == name), None)
    if comp is None:
        raise ClusterError(f"no component {name!r}; one of etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok")
    pid = running_pid(name)
    if pid is None:
        raise ClusterError(f"{name} is not running: `python3 hack/localcluster.py up` first")
    stop_component(name, pid, signal.SIGKILL if args.kill else signal.SIGTERM)
    if running_pid(name):
        raise ClusterError(f"{name} (pid {pid}) did not stop, even after SIGKILL")
    time.sleep(args.down_seconds)
    start(comp, pki)


def cmd_status(_: argparse.Namespace) -> None:
    names = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"]
    ok = True
    for n in names:
        pid = running_pid(n)
        ok &= pid is not None
        print(f"{n:26s} {'running pid ' + str(pid) if pid else 'stopped'}")
    ready = ok and api_ready(STATE / "pki")
    print(f"{'api /readyz':26s} {'ok' if ready else 'not ready'}")
    print(f"{'audit log':26s} {AUDIT_LOG}")
    print(f"{'kubeconfig':26s} {KUBECONFIG}")  # last: scripts read it from the last line
    if not ready:
        sys.exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build and cache the binaries").set_defaults(fn=cmd_build)
    up = sub.add_parser("up", help="start the cluster (builds binaries with --build)")
    up.add_argument("--build", action="store_true", help="build missing binaries first")
    up.set_defaults(fn=cmd_up)
    sub.add_parser("down", help="stop the cluster and wipe its data").set_defaults(fn=cmd_down)
    sub.add_parser("status", help="exit 0 when the cluster runs").set_defaults(fn=cmd_status)
    restart = sub.add_parser("restart", help="stop one component and start it again (fault tests)")
    restart.add_argument("component")
    restart.add_argument("--kill", action="store_true", help="SIGKILL instead of SIGTERM")
    restart.add_argument("--down-seconds", type=float, default=0.0, help="stay down this long before starting")
    restart.set_defaults(fn=cmd_restart)
    sub.add_parser("bin-dir", help="print the binaries' folder").set_defaults(fn=lambda _: print(bin_dir(False)))
    args = p.parse_args()
    try:
        args.fn(args)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
