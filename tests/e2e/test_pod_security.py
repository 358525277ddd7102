"""Pod Security Standards, judged by the API server's own PodSecurity admission: the operator's
pods share no host namespace and are admitted in a namespace labelled enforce=baseline, refused
one level lower (restricted: the lmcache server and vLLM run as root), and then the resource's
status says so, in the API server's words, with the fix (docs/security.md)."""

from __future__ import annotations

import json
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
from tests.e2e.operator_env import NAME, stop

pytestmark = pytest.mark.e2e
ENFORCE = "pod-security.kubernetes.io/enforce"


@pytest.fixture()
def levels(kubectl: Kubectl, cluster: Path, crd: None, tmp_path: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """A namespace per level ({level: namespace}) and one operator watching both; its log path."""
    suffix = uuid.uuid4().hex[:6]
    spaces = {level: f"e2e-pss-{level}-{suffix}" for level in ("baseline", "restricted")}
    for level, ns in spaces.items():
        kubectl.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {ENFORCE: level}}})
    log = tmp_path / "operator.log"
    args = [arg for ns in spaces.values() for arg in ("--namespace", ns)]
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpersist.cli", "run", "--standalone", *args], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "KUBECONFIG": str(cluster)},
                                start_new_session=True)
    try:
        yield spaces, log
    finally:
        stop(proc)
        for ns in spaces.values():
            kubectl.run("delete", "namespace", ns, "--wait=false", check=False)


def _pods(kubectl: Kubectl, ns: str) -> list[dict]:
    return kubectl.get("pods", namespace=ns)["items"]


def _conditions(kubectl: Kubectl, ns: str) -> dict[str, dict]:
    status = kubectl.get("kvns", NAME, ns).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or []}


def test_pods_are_admitted_at_baseline_and_refused_at_restricted_with_a_condition(kubectl: Kubectl, levels) -> None:
    spaces, log = levels
    for ns in spaces.values():
        obj = sample()
        obj["metadata"]["namespace"] = ns
        kubectl.apply(obj)

    # baseline: the API server admits both pods (kwok runs them; that they can start is not the point).
    baseline = spaces["baseline"]
    pods = wait_for("the lmcache server and vLLM pods at baseline", lambda: (lambda p: p if {
        x["metadata"]["labels"].get("app.kubernetes.io/component") for x in p} >= {"lmcache-server", "vllm"} else None)(
        _pods(kubectl, baseline)), timeout=90)
    for pod in pods:
        spec = pod["spec"]
        # No host namespace: CUDA IPC goes through lmcache's isolated IPC (docs/security.md).
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
            assert not c["securityContext"].get("privileged")
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    # One level lower the API server itself names what these running pods violate (root).
    dry = kubectl.run("label", "--dry-run=server", "--overwrite", "namespace", baseline, f"{ENFORCE}=restricted")
    assert 'violate the new PodSecurity enforce level "restricted' in dry.stderr and "runAsNonRoot" in dry.stderr, \
        dry.stderr
    # Running as root is all restricted refuses (pods alike are listed as one "(and 1 other pod)").
    violations = [line.split(": ", 2)[2] for line in dry.stderr.splitlines() if line.startswith(f"Warning: {NAME}-")]
    assert violations and set(violations) == {"runAsNonRoot != true"}, dry.stderr

    # restricted: refused. No pod exists, and status says why, in the API server's words, with the fix.
    restricted = spaces["restricted"]

    def forbidden() -> dict[str, dict] | None:
        conds = _conditions(kubectl, restricted)
        both = all(conds.get(t, {}).get("reason") == "PodsForbidden" for t in ("LMCacheReady", "VLLMReady"))
        return conds if both else None

    try:
        conds = wait_for("LMCacheReady and VLLMReady PodsForbidden", forbidden, timeout=120, interval=2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- operator log:\n{log.read_text()[-3000:]}") from None
    for type_ in ("LMCacheReady", "VLLMReady"):
        message = conds[type_]["message"]
        assert conds[type_]["status"] == "False"
        assert 'violates PodSecurity "restricted:latest"' in message and "runAsNonRoot != true" in message, message
        assert "host namespaces" not in message, message
        assert f"{ENFORCE}=baseline" in message and "docs/security.md" in message, message
    assert conds["Ready"]["reason"] == "PodsForbidden"
    assert _pods(kubectl, restricted) == []
    # The Deployment surfaced the refusal itself (what the operator read from its watch cache).
    dep = kubectl.get("deployment", f"{NAME}-vllm", restricted)
    assert any(c["type"] == "ReplicaFailure" and "PodSecurity" in c["message"] for c in dep["status"]["conditions"]), \
        json.dumps(dep["status"])

    # The fix the condition names: the controllers retry, the pods are created, and the reason goes.
    kubectl.run("label", "--overwrite", "namespace", restricted, f"{ENFORCE}=baseline")
    wait_for("the lmcache server pod after labelling baseline",
             lambda: any(p["metadata"]["name"] == f"{NAME}-lmcache-0" for p in _pods(kubectl, restricted)), timeout=180,
             interval=2)
    wait_for("LMCacheReady no longer PodsForbidden",
             lambda: _conditions(kubectl, restricted).get("LMCacheReady", {}).get("reason") not in (None, "PodsForbidden"),
             timeout=60, interval=2)


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
