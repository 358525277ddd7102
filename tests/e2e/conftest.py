"""Fixtures for the e2e suite: the real local cluster, the CRD, and the operator as a process."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.kube import CLUSTER_KINDS, LOCALCLUSTER, REPO, Kubectl, bin_dir, delete_and_wait_gone, names_of, wait_for
from tests.e2e.operator_env import CLUSTER_DOMAIN, start_operator, stop

pytestmark = pytest.mark.e2e

# The operators these tests start inherit this environment. Their Hub calls (the pin check of every
# resource with a modelRevision, a bucket preflight) go to a loopback port nothing serves unless
# the test names a stand-in (tests/integration/hub_stub.py) as HF_ENDPOINT: never the real Hub, whose
# answers for the samples' public models would make a test depend on the network.
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
# No pod here has cluster DNS (the runner writes hosts files under cluster.local), so the operators
# are told the cluster's domain instead of reading their resolver's (kvpersist.controller.policy).
os.environ.setdefault("KVPERSIST_CLUSTER_DOMAIN", CLUSTER_DOMAIN)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Path]:
    """The shared local cluster: reused when running, else started here and stopped at the end."""
    running = subprocess.run([*LOCALCLUSTER, "status"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             timeout=30).returncode == 0
    if not running:
        subprocess.run([*LOCALCLUSTER, "up"], check=True, stdout=subprocess.PIPE, timeout=300)
    out = subprocess.run([*LOCALCLUSTER, "status"], check=True, stdout=subprocess.PIPE, text=True, timeout=30).stdout
    kubeconfig = Path(next(line.split()[-1] for line in out.splitlines() if line.startswith("kubeconfig")))
    yield kubeconfig
    if not running:
        subprocess.run([*LOCALCLUSTER, "down"], check=True, timeout=120)


@pytest.fixture(scope="session")
def kubectl(cluster: Path) -> Kubectl:
    return Kubectl(cluster, bin_dir() / "kubectl")


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_nothing(kubectl: Kubectl) -> Iterator[None]:
    """Whatever a module created at cluster scope (namespaces, PVs, storage classes) is deleted and
    gone before the next module starts: the chart's operator watches every namespace, and a module
    must pass whatever ran before it."""
    before = {kind: names_of(kubectl, kind) for kind in CLUSTER_KINDS}
    yield
    delete_and_wait_gone(kubectl, {kind: names_of(kubectl, kind) - before[kind] for kind in CLUSTER_KINDS})


@pytest.fixture(scope="session")
def audit_log(cluster: Path) -> Path:
    """The API server's audit log (ServiceAccount requests with the authorizer's decision)."""
    out = subprocess.run([*LOCALCLUSTER, "status"], check=True, stdout=subprocess.PIPE, text=True, timeout=30).stdout
    path = Path(next(line.split()[-1] for line in out.splitlines() if line.startswith("audit log")))
    assert path.exists(), f"{path} missing: the local cluster predates its audit log; run `python3 hack/localcluster.py down`"
    return path


@pytest.fixture(scope="session")
def crd(kubectl: Kubectl) -> None:
    kubectl.run("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kubectl.wait_established("kvcachenamespaces.kvpersist.dev")


GC_POLICY = REPO / "config" / "gc" / "gc-authorization.yaml"
CREATOR_RIGHTS_POLICY = REPO / "config" / "creator-rights" / "creator-rights.yaml"
PIN_CHANGE_POLICY = REPO / "config" / "pin-change-warning" / "pin-change-warning.yaml"


def _installed_policy(kubectl: Kubectl, path: Path, name: str) -> Iterator[None]:
    """A config/ ValidatingAdmissionPolicy (and what its file holds besides) for one module: removed
    afterwards, since the chart (tests/e2e/test_helm.py) installs the same names. Waits until the
    API server has type-checked the policy against the CRD, and fails on any warning."""
    kubectl.run("apply", "--server-side", "--force-conflicts", "-f", str(path))

    def checked() -> dict | None:
        policy = kubectl.get("validatingadmissionpolicy", name)
        done = (policy.get("status") or {}).get("observedGeneration") == policy["metadata"]["generation"]
        return policy if done else None

    policy = wait_for(f"the API server to type-check {name}", checked, timeout=60)
    assert not (policy["status"].get("typeChecking") or {}).get("expressionWarnings"), policy["status"]
    yield
    kubectl.run("delete", "-f", str(path), "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def gc_policy(kubectl: Kubectl, crd: None) -> Iterator[None]:
    """config/gc's ValidatingAdmissionPolicy, binding and ClusterRole kvpersist-gc."""
    yield from _installed_policy(kubectl, GC_POLICY, "kvpersist-gc-request")


@pytest.fixture(scope="module")
def creator_rights_policy(kubectl: Kubectl, crd: None) -> Iterator[None]:
    """config/creator-rights' ValidatingAdmissionPolicy and binding: a KVCacheNamespace's spec
    needs its author to hold what its pods will (create on pods, get on what it names)."""
    yield from _installed_policy(kubectl, CREATOR_RIGHTS_POLICY, "kvpersist-creator-rights")


@pytest.fixture(scope="module")
def pin_change_policy(kubectl: Kubectl, crd: None) -> Iterator[None]:
    """config/pin-change-warning's ValidatingAdmissionPolicy (Warn) and binding: a Warning at
    kubectl apply of a change that moves the namespace id."""
    yield from _installed_policy(kubectl, PIN_CHANGE_POLICY, "kvpersist-pin-change-warning")


@pytest.fixture()
def namespace(kubectl: Kubectl) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    kubectl.run("create", "namespace", name)
    yield name
    kubectl.run("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture()
def operator(cluster: Path, crd: None, namespace: str, tmp_path: Path) -> Iterator[Path]:
    """`kvpersist run` as its own process, watching the test's namespace; its log path is yielded."""
    log = tmp_path / "operator.log"
    proc = start_operator(cluster, namespace, log)
    try:
        yield log
    finally:
        stop(proc)

RELIABILITY_LOG = REPO / "build" / "reliability.jsonl"


@pytest.fixture(scope="session")
def _reliability_records() -> Iterator[list[dict]]:
    records: list[dict] = []
    yield records
    if records:
        RELIABILITY_LOG.parent.mkdir(exist_ok=True)
        with RELIABILITY_LOG.open("w") as out:
            for rec in records:
                out.write(json.dumps(rec) + "\n")


@pytest.fixture()
def fault_log(request: pytest.FixtureRequest, _reliability_records: list[dict]):
    """Records one fault and what happened; hack/reliability_report.py renders docs/reliability.md."""
    def record(fault: str, outcome: str) -> None:
        _reliability_records.append({"test": request.node.nodeid, "fault": fault, "outcome": outcome})
    return record
