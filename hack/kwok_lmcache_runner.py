#!/usr/bin/env python3
"""Plays kubelet for lmcache-server pods on the kwok nodes: runs each of the pod's containers (the
REAL `lmcache server`, and the kvpersist inventory agent beside it) with its own command, args
and env, on the pod's IP.

kwok gives pods IPs in 127.16.0.0/16 (loopback) but runs no containers. This fills the gap for
the lmcache servers, so the operator's usage collector, probes-by-hand and the data path talk to
the real thing. Two mappings only, both what a kubelet would do:
  - the claim mounted at the container's L2 path becomes a folder under --volumes-dir
    (one folder per PersistentVolumeClaim, kept across pod restarts like a real volume),
  - env vars from Secrets are resolved with kubectl.

    python3 hack/kwok_lmcache_runner.py --namespace default [--once]

Needs the lmcache CLI (the datapath extra) and kubectl on PATH.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SELECTOR = "app.kubernetes.io/component=lmcache-server,app.kubernetes.io/managed-by=kvpersist"
STOP_TIMEOUT_S = 20.0


def localize_args(args: list[str], mounts: dict[str, Path], host: str, max_l1_gb: float | None = None) -> list[str]:
    """A container's args as run on this machine: mount paths become local folders, the
    all-interfaces bind address becomes the pod's (loopback) address, L1 optionally capped."""
    out: list[str] = []
    for arg in args:
        for mount_path, local in mounts.items():
            arg = arg.replace(mount_path, str(local))
        if out and out[-1] == "--l1-size-gb" and max_l1_gb is not None and float(arg) > max_l1_gb:
            print(f"[runner] L1 capped from {arg} to {max_l1_gb} GiB (--max-l1-gb: this machine is smaller than the "
                  "pod's node)", file=sys.stderr, flush=True)
            arg = str(max_l1_gb)
        out.append(host if arg == "0.0.0.0" else arg)
    return out


@dataclass
class Runner:
    kubeconfig: Path
    namespace: str
    workdir: Path
    kubectl: str = "kubectl"
    lmcache: str = "lmcache"
    kvpersist: str = field(default_factory=lambda: shutil.which("kvpersist") or str(Path(sys.executable).parent / "kvpersist"))
    max_l1_gb: float | None = None  # cap for machines smaller than the sample's nodes
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)  # "<pod uid>/<container>" -> process
    names: dict[str, str] = field(default_factory=dict)  # "<pod uid>/<container>" -> pod name

    def _kubectl_json(self, *args: str) -> dict:
        out = subprocess.run([self.kubectl, f"--kubeconfig={self.kubeconfig}", "-n", self.namespace, *args, "-o", "json"],
                             capture_output=True, text=True, timeout=30, check=True)
        return json.loads(out.stdout)

    def volume_dir(self, claim: str) -> Path:
        path = self.workdir / "volumes" / self.namespace / claim
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _env(self, container: dict) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV")}
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
            elif "secretKeyRef" in item.get("valueFrom", {}):
                ref = item["valueFrom"]["secretKeyRef"]
                secret = self._kubectl_json("get", "secret", ref["name"])
                env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        return env

    def argv(self, pod: dict, container: dict | None = None) -> list[str]:
        """A container's command line as a kubelet would run it, with its L2 mount mapped."""
        container = container or pod["spec"]["containers"][0]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in pod["spec"].get("volumes", []) if "persistentVolumeClaim" in v}
        mounts = {m["mountPath"]: self.volume_dir(claims[m["name"]]) for m in container.get("volumeMounts", [])
                  if m["name"] in claims}
        out = localize_args(container.get("args", []), mounts, pod["status"]["podIP"], self.max_l1_gb)
        command = container.get("command", [])
        local = {"lmcache": self.lmcache, "kvpersist": self.kvpersist}
        return [local.get(command[0], command[0]), *command[1:], *out]

    def sync(self) -> None:
        """Start a server for each Running pod that has none; stop those whose pod is gone."""
        pods = self._kubectl_json("get", "pods", "-l", SELECTOR)["items"]
        live = {}
        for pod in pods:
            status = pod.get("status", {})
            if status.get("phase") == "Running" and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
                live[pod["metadata"]["uid"]] = pod
        for key in [k for k in self.procs if k.split("/")[0] not in live]:
            self.stop(key)
        for uid, pod in live.items():
            for container in pod["spec"]["containers"]:
                key = f"{uid}/{container['name']}"
                proc = self.procs.get(key)
                if proc is not None and proc.poll() is None:
                    continue
                name = pod["metadata"]["name"]
                log = (self.workdir / "logs").joinpath(f"{self.namespace}-{name}-{container['name']}.log")
                log.parent.mkdir(parents=True, exist_ok=True)
                with log.open("ab") as out:
                    self.procs[key] = subprocess.Popen(self.argv(pod, container), env=self._env(container), stdout=out,
                                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
                self.names[key] = name
                print(f"[runner] started {container['name']} for {self.namespace}/{name} on {pod['status']['podIP']} "
                      f"(pid {self.procs[key].pid})", file=sys.stderr, flush=True)

    def stop(self, key: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(key, None)
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def kill(self, pod_name: str, container: str = "lmcache-server") -> None:
        """SIGKILL one container of a pod (its lmcache server by default), as a crash would."""
        for key, name in list(self.names.items()):
            if name == pod_name and key.endswith(f"/{container}"):
                self.stop(key, signal.SIGKILL)

    def stop_all(self) -> None:
        for uid in list(self.procs):
            self.stop(uid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG", ""))
    parser.add_argument("--workdir", default=str(Path.home() / ".cache" / "kvpersist" / "kwok-pods"))
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--once", action="store_true", help="one sync, leave the servers running, exit")
    parser.add_argument("--max-l1-gb", type=float, default=None, help="cap --l1-size-gb (the host's RAM is the limit)")
    args = parser.parse_args()
    lmcache = shutil.which("lmcache")
    if not lmcache:
        sys.exit("error: lmcache not on PATH: install the datapath extra (bash hack/venv.sh)")
    runner = Runner(Path(args.kubeconfig), args.namespace, Path(args.workdir), lmcache=lmcache, max_l1_gb=args.max_l1_gb)
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
            except subprocess.SubprocessError as exc:
                print(f"[runner] sync failed: {exc}", file=sys.stderr, flush=True)
            time.sleep(args.interval)
    finally:
        runner.stop_all()


if __name__ == "__main__":
    main()
