"""The kubelet stand-in (hack/kubelet_runner.py) writes a pod's status by uid, as a kubelet does,
against the real API server: a StatefulSet deletes a pod and makes another of the same name
between a runner round's listing and its write, and the old pod's container states (a refused
build's lastState, exit 78) must not land on the new pod. They did once, by name: CI's
test_build_check saw BuildVerified stay False beside a healthy server, the new pod carrying the
refused one's lastState for good (the runner keeps what a status already holds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvpersist.builders.buildcheck import EXIT_CODE, MISMATCH_PREFIX
from tests.e2e.kube import Kubectl, bin_dir

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
from kubelet_runner import Runner  # noqa: E402

pytestmark = pytest.mark.e2e


def _pod(kubectl: Kubectl, ns: str) -> dict:
    """A pod bound to a node no kubelet plays (nothing else writes its status)."""
    kubectl.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "server-0", "namespace": ns},
                   "spec": {"nodeName": "no-kubelet-here", "containers": [{"name": "lmcache-server", "image": "x"}]}})
    return kubectl.get("pod", "server-0", ns)


def _force_delete(kubectl: Kubectl, ns: str) -> None:
    """No kubelet ends this pod's graceful deletion: it would wait for good."""
    kubectl.run("delete", "pod", "server-0", "-n", ns, "--grace-period=0", "--force", "--wait=true", "--timeout=30s")


def test_a_status_written_for_a_deleted_pod_never_lands_on_its_namesake(kubectl: Kubectl, namespace: str,
                                                                         tmp_path: Path) -> None:
    runner = Runner(kubectl.kubeconfig, namespace, tmp_path, kubectl=str(bin_dir() / "kubectl"), lmcache="lmcache")
    refused = {"status": {"containerStatuses": [{
        "name": "lmcache-server", "image": "x", "imageID": "", "ready": False, "restartCount": 3,
        "lastState": {"terminated": {"exitCode": EXIT_CODE, "message": f"{MISMATCH_PREFIX} lmcache 0.5.6 is installed"}}}]}}
    old = _pod(kubectl, namespace)
    _force_delete(kubectl, namespace)
    new = _pod(kubectl, namespace)
    assert new["metadata"]["uid"] != old["metadata"]["uid"]

    assert runner._patch_pod(old, refused, "status") is False  # the API server refuses: another uid
    assert runner._patch_pod(old, {"metadata": {"annotations": {"x": "y"}}}) is False
    now = kubectl.get("pod", "server-0", namespace)
    assert not (now.get("status") or {}).get("containerStatuses"), now["status"]
    assert "x" not in (now["metadata"].get("annotations") or {})

    # Its own pod's write goes through (the check refuses only a namesake).
    assert runner._patch_pod(new, refused, "status") is True
    written = kubectl.get("pod", "server-0", namespace)["status"]["containerStatuses"][0]
    assert written["lastState"]["terminated"]["exitCode"] == EXIT_CODE
    _force_delete(kubectl, namespace)  # gone now: the namespace's teardown does not wait on it
