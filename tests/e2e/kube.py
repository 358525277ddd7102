"""kubectl against the local cluster, for tests: real binary, real API server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
LOCALCLUSTER = [sys.executable, str(REPO / "hack" / "localcluster.py")]
sys.path.insert(0, str(REPO / "hack"))
from kubelet_runner import RESOURCES, ApiError, ApiReader  # noqa: E402

_READERS: dict[Path, ApiReader | None] = {}


def bin_dir() -> Path:
    out = subprocess.run([*LOCALCLUSTER, "bin-dir"], check=True, stdout=subprocess.PIPE, text=True, timeout=30)
    return Path(out.stdout.strip())


@dataclass
class Kubectl:
    kubeconfig: Path
    binary: Path

    def run(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(self.binary), f"--kubeconfig={self.kubeconfig}", *args], input=stdin, text=True,
                              capture_output=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def wait_established(self, *crds: str, timeout: float = 90) -> None:
        """`kubectl wait --for condition=established` on each CRD, retried: a CRD just created has no
        `status.conditions` yet, and kubectl then fails at once ("accessor error: <nil>") instead of
        waiting, which ended a CI shard at setup."""
        deadline = time.monotonic() + timeout
        for crd in crds:
            while True:
                proc = self.run("wait", "--for", "condition=established", "--timeout=10s", f"crd/{crd}", check=False,
                                timeout=30)
                if proc.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"crd/{crd} not established after {timeout:.0f}s: {proc.stderr.strip()}")
                time.sleep(0.5)

    def apply(self, obj: dict[str, Any] | str, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
        text = obj if isinstance(obj, str) else json.dumps(obj)
        return self.run("apply", *flags, "-f", "-", stdin=text, check=check)

    def get(self, kind: str, name: str | None = None, namespace: str | None = None) -> dict[str, Any]:
        """`kubectl get KIND [NAME] [-n NAMESPACE] -o json`. The kinds the waits poll are read straight
        from the API server with the same credentials (hack/kubelet_runner.py ApiReader: no process
        per call, and the waits poll every half second); any other through kubectl. An error is an
        AssertionError naming the request, as a failed kubectl call is."""
        reader = self._reader()
        if reader is not None and kind.lower() in RESOURCES:
            try:
                return reader.kubectl_get(kind, name, namespace)
            except ApiError as exc:
                raise AssertionError(f"kubectl get {kind} {name or ''} -n {namespace} failed: {exc}") from None
        args = ["get", kind, *([name] if name else []), "-o", "json"]
        if namespace:
            args += ["-n", namespace]
        return json.loads(self.run(*args).stdout)

    def _reader(self) -> ApiReader | None:
        """One ApiReader per kubeconfig (None where only kubectl can read it)."""
        if self.kubeconfig not in _READERS:
            try:
                _READERS[self.kubeconfig] = ApiReader(self.kubeconfig)
            except (ValueError, KeyError, OSError, StopIteration):
                _READERS[self.kubeconfig] = None
        return _READERS[self.kubeconfig]

    def can_i_list(self, user: str, namespace: str) -> set[tuple[str, str]]:
        """(resource[.group][/subresource], verb) as `kubectl auth can-i --list --as=user -n
        namespace` prints them; non-resource URLs (discovery, /healthz...) left out."""
        out = self.run("auth", "can-i", "--list", f"--as={user}", "-n", namespace).stdout
        granted = set()
        for line in out.splitlines()[1:]:
            cols = line.split()
            if not cols or cols[0].startswith("["):
                continue  # non-resource URLs, which every authenticated user may GET
            resource, verbs = cols[0], line[line.index("[", line.index(cols[0]) + len(cols[0])):]
            verbs = verbs.split("]")[-2].split("[")[-1].split() if "]" in verbs else []
            granted |= {(resource, v) for v in verbs}
        return granted

    def can_i(self, user: str, verb: str, resource: str, *where: str) -> bool:
        """`kubectl auth can-i verb resource --as=user` (where: -n NS, or --all-namespaces)."""
        out = self.run("auth", "can-i", verb, resource, f"--as={user}", *where, check=False)
        if out.stdout.strip() not in ("yes", "no"):
            raise AssertionError(f"kubectl auth can-i {verb} {resource}: {out.stdout} {out.stderr}")
        return out.stdout.strip() == "yes"

    def as_service_account(self, namespace: str, service_account: str, path: Path, pod: dict[str, Any] | None = None) -> Kubectl:
        """kubectl as a ServiceAccount: a kubeconfig at path holding only its token (no client
        certificate, which the API server would authenticate first). With a pod, the token is
        bound to it, as a kubelet's projected token is: the API server then records the pod's
        name with each request (the audit log's user.extra), so two replicas of one
        Deployment are told apart."""
        bound = ["--bound-object-kind=Pod", f"--bound-object-name={pod['metadata']['name']}",
                 f"--bound-object-uid={pod['metadata']['uid']}"] if pod else []
        token = self.run("create", "token", service_account, "-n", namespace, "--duration=2h", *bound).stdout.strip()
        admin = yaml.safe_load(self.kubeconfig.read_text())
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "clusters": admin["clusters"],
            "users": [{"name": service_account, "user": {"token": token}}],
            "contexts": [{"name": "sa", "context": {"cluster": admin["clusters"][0]["name"], "user": service_account}}],
            "current-context": "sa",
        }))
        return Kubectl(path, self.binary)


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 60, interval: float = 0.5,
             explain: Callable[[], str] | None = None) -> Any:
    """Polls probe until it returns something truthy; fails after timeout with what was awaited,
    and explain()'s account of the state it was stuck in (a bare False says nothing in a CI log)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    why = ""
    if explain is not None:
        try:
            why = f"; {explain()}"
        except Exception as exc:  # the account is a help, never the failure itself
            why = f"; (explain failed: {exc!r})"
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r}){why}")


# Cluster-scoped kinds the e2e modules create besides namespaces (test storage).
CLUSTER_KINDS = ("namespaces", "persistentvolumes", "storageclasses")
GONE_TIMEOUT_S = 180.0


def names_of(kubectl: Kubectl, kind: str) -> set[str]:
    out = kubectl.run("get", kind, "-o", "jsonpath={.items[*].metadata.name}")
    return set(out.stdout.split())


def delete_and_wait_gone(kubectl: Kubectl, leftovers: dict[str, set[str]], timeout: float = GONE_TIMEOUT_S) -> None:
    """Deletes what a module left and waits until the API server no longer has it, so no later
    module's operator can see a half-deleted namespace (a terminating one refuses new content)."""
    for kind, names in leftovers.items():
        if names:
            kubectl.run("delete", kind, *sorted(names), "--wait=false", "--ignore-not-found", check=False)
    wait_for(f"{leftovers} to be gone", lambda: not any(names & names_of(kubectl, kind) for kind, names in leftovers.items()),
             timeout=timeout, interval=1.0)
