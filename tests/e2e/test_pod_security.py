"""Pod Security Standards, judged by the API server's own PodSecurity admission: the operator's
pods (the lmcache server and its agent, vLLM) meet the restricted level (non-root, no capability, no
host namespace, RuntimeDefault seccomp) and are admitted in a namespace that enforces it; the same
admission refuses one of them with a capability added, so the check can fail (docs/security.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cases.invalid_manifests import sample
from tests.e2e.kube import REPO, Kubectl, bin_dir, wait_for
from tests.e2e.operator_env import stop

pytestmark = pytest.mark.e2e
ENFORCE = "pod-security.kubernetes.io/enforce"


@pytest.fixture()
def restricted(kubectl: Kubectl, cluster: Path, crd: None, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A namespace that enforces restricted and an operator watching it; its log path."""
    ns = f"e2e-pss-restricted-{uuid.uuid4().hex[:6]}"
    kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {ENFORCE: "restricted"}}})
    log = tmp_path / "operator.log"
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpersist.cli", "run", "--standalone", "--namespace", ns],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "KUBECONFIG": str(cluster)},
                                start_new_session=True)
    try:
        yield ns, log
    finally:
        stop(proc)
        kubectl.run("delete", "namespace", ns, "--wait=false", check=False)


def _pods(kubectl: Kubectl, ns: str) -> list[dict]:
    return kubectl.get("pods", namespace=ns)["items"]


def test_the_servers_and_vllm_are_admitted_at_restricted(kubectl: Kubectl, restricted: tuple[str, Path]) -> None:
    ns, log = restricted
    obj = sample()
    obj["metadata"]["namespace"] = ns
    kubectl.apply(obj)

    def both() -> list[dict] | None:
        pods = _pods(kubectl, ns)
        return pods if {p["metadata"]["labels"].get("app.kubernetes.io/component") for p in pods} >= {
            "lmcache-server", "vllm"} else None

    try:
        pods = wait_for("the lmcache server and vLLM pods at restricted", both, timeout=120, interval=2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- operator log:\n{log.read_text()[-3000:]}") from None
    for pod in pods:
        spec = pod["spec"]
        assert not any(spec.get(f) for f in ("hostIPC", "hostPID", "hostNetwork")), spec
        assert not any(v.get("hostPath") for v in spec.get("volumes", [])), spec["volumes"]
        assert spec["automountServiceAccountToken"] is False
        if pod["metadata"]["labels"].get("app.kubernetes.io/component") == "lmcache-server":
            # Admitted with what gives the server the node's GPUs: a RuntimeClass and the NVIDIA env.
            env = {e["name"]: e.get("value") for e in spec["containers"][0].get("env", [])}
            assert spec["runtimeClassName"] == "nvidia" and env["NVIDIA_VISIBLE_DEVICES"] == "all", spec
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not any(v.get("projected") for v in spec.get("volumes", [])), "a ServiceAccount token was mounted"
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True and not sc.get("privileged")
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    # The check can fail: one of these pods with a capability added is refused by the same admission.
    server = next(p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/component") == "lmcache-server")
    copy = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "capable", "namespace": ns}, "spec": server["spec"]}
    copy["spec"].pop("nodeName", None)
    copy["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] = ["NET_ADMIN"]
    out = kubectl.apply(copy, "--dry-run=server", check=False)
    assert out.returncode != 0 and 'violates PodSecurity "restricted:latest"' in out.stderr, out.stderr


def test_the_operators_own_pod_meets_restricted(kubectl: Kubectl) -> None:
    """The chart's operator pod, as a Pod, through the API server's admission in a namespace that
    enforces restricted (server-side dry run: nothing runs)."""
    rendered = subprocess.run([str(bin_dir() / "helm"), "template", "kvp", str(REPO / "charts" / "kvpersist")],
                              capture_output=True, text=True, timeout=120, check=True).stdout
    deployment = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment")
    template = deployment["spec"]["template"]
    assert template["spec"]["automountServiceAccountToken"] is True  # the one pod that calls the API server
    ns = f"e2e-pss-restricted-{uuid.uuid4().hex[:6]}"
    kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {ENFORCE: "restricted"}}})
    try:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "operator", "namespace": ns, **template["metadata"]},
               "spec": {**template["spec"], "serviceAccountName": "default"}}
        out = kubectl.apply(pod, "--dry-run=server", check=False)
        assert out.returncode == 0 and "PodSecurity" not in out.stderr, out.stderr
        # The check can fail: the same pod with a capability added is refused by the same admission.
        pod["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] = ["NET_ADMIN"]
        out = kubectl.apply(pod, "--dry-run=server", check=False)
        assert out.returncode != 0 and 'violates PodSecurity "restricted:latest"' in out.stderr, out.stderr
    finally:
        kubectl.run("delete", "namespace", ns, "--wait=false", check=False)
