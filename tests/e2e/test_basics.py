"""Kubernetes basics on the real API server: a user bound to the built-in `edit` role (through the
chart's aggregated ClusterRoles) creates and scales a KVCacheNamespace, with the creator-rights
policy in force; `kubectl get` tells Ready apart from the vLLM pod count; `kubectl scale` reaches
the vLLM Deployment through the operator; `view` reads and may not write.

Users are impersonated (`kubectl --as`); the operator runs as a process (the `operator` fixture),
its pods simulated by kwok (Running and Ready at once); the servers' PodDisruptionBudget (with two
servers; none for one) is owned and, deleted, applied again (drift). Without the aggregated roles (today's main) `edit` grants
nothing on KVCacheNamespaces; without the scale subresource `kubectl scale` is refused; the
default columns were once NAMESPACE-ID ... READY (the pod count) AGE; now seven, the rest at -o wide.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.cases.invalid_manifests import sample
from tests.e2e.kube import REPO, Kubectl, bin_dir, wait_for

pytestmark = pytest.mark.e2e

EDITOR, VIEWER = "carol@example.com", "dave@example.com"
NAME = "llama31-8b"


def as_user(kubectl: Kubectl, user: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return kubectl.run(f"--as={user}", *args, stdin=stdin, check=False)


@pytest.fixture(scope="module")
def aggregate_roles(kubectl: Kubectl, crd: None) -> Iterator[list[str]]:
    """The chart's aggregated ClusterRoles, as `helm template` renders them (bound to nobody)."""
    out = subprocess.run([str(bin_dir() / "helm"), "template", "kvpersist", str(REPO / "charts" / "kvpersist"),
                          "--show-only", "templates/aggregate-roles.yaml"],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    kubectl.run("apply", "-f", "-", stdin=out)
    names = ["kvpersist-edit", "kvpersist-view"]
    yield names
    kubectl.run("delete", "clusterrole", *names, "--ignore-not-found", check=False)


def _bind(kubectl: Kubectl, ns: str, user: str, cluster_role: str) -> None:
    kubectl.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": f"{cluster_role}-{user.split('@')[0]}", "namespace": ns},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]})


def _columns(kubectl: Kubectl, ns: str, *flags: str) -> dict[str, str]:
    lines = kubectl.run("get", "kvcachenamespaces", "-n", ns, *flags).stdout.splitlines()
    header = lines[0]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    return {header[a:b].strip(): lines[1][a:b].strip() for a, b in bounds}


def test_an_editor_creates_and_scales_and_get_tells_ready_from_the_pod_count(
        kubectl: Kubectl, operator, namespace: str, creator_rights_policy: None, aggregate_roles: list[str]) -> None:
    ns = namespace
    _bind(kubectl, ns, EDITOR, "edit")
    _bind(kubectl, ns, VIEWER, "view")
    # The aggregation controller folds the chart's rules into edit and view a moment after they exist.
    wait_for("edit and view to hold the aggregated rules", lambda: all(
        as_user(kubectl, user, "auth", "can-i", verb, "kvcachenamespaces.kvpersist.dev", "-n", ns).returncode == 0
        for user, verb in ((EDITOR, "create"), (EDITOR, "delete"), (VIEWER, "list"))), timeout=90)
    assert as_user(kubectl, EDITOR, "auth", "can-i", "update", "kvcachenamespaces.kvpersist.dev",
                   "--subresource=scale", "-n", ns).returncode == 0
    # gc deletes cached data: its own permission, not part of edit.
    assert as_user(kubectl, EDITOR, "auth", "can-i", "update", "kvcachenamespaces.kvpersist.dev",
                   "--subresource=gc", "-n", ns).returncode != 0
    for verb in ("create", "patch", "delete"):
        assert as_user(kubectl, VIEWER, "auth", "can-i", verb, "kvcachenamespaces.kvpersist.dev", "-n", ns).returncode != 0

    # A missing pin: the cache is off (Ready False) while vLLM runs without it, its pod Ready.
    obj = sample()
    del obj["spec"]["identity"]["chatTemplateDigest"]
    obj["metadata"].update(name=NAME, namespace=ns)
    created = as_user(kubectl, EDITOR, "create", "-f", "-", stdin=json.dumps(obj))  # through the creator-rights policy
    assert created.returncode == 0, created.stderr
    wait_for("status 1/1 vLLM pods with Ready False", lambda: (lambda s: s.get("replicas") == "1/1" and any(
        c["type"] == "Ready" and c["status"] == "False" for c in s.get("conditions", [])))(
        kubectl.get("kvns", NAME, ns).get("status") or {}), timeout=120)
    cols = _columns(kubectl, ns)
    assert list(cols) == ["NAME", "PHASE", "REASON", "VLLM", "L2-USED", "HIT", "AGE"], cols  # seven by default
    assert (cols["NAME"], cols["PHASE"], cols["REASON"], cols["VLLM"]) == (NAME, "CacheDisabled", "CacheDisabled", "1/1"), cols
    wide = _columns(kubectl, ns, "-o", "wide")
    assert list(wide) == [*cols, "READY", "NAMESPACE-ID", "L2", "L1-USED"], wide
    assert (wide["READY"], wide["L2"]) == ("False", "nvme"), wide
    assert as_user(kubectl, VIEWER, "get", "kvcachenamespaces", "-n", ns).returncode == 0

    # kubectl scale: an UPDATE of the scale subresource, which the creator-rights policy does not
    # match (replicas reach no Secret or claim); the operator scales the Deployment.
    scaled = as_user(kubectl, EDITOR, "scale", f"kvcachenamespace/{NAME}", "--replicas=2", "-n", ns)
    assert scaled.returncode == 0, scaled.stderr
    assert kubectl.get("kvns", NAME, ns)["spec"]["vllm"]["replicas"] == 2
    wait_for("the vLLM Deployment at 2 replicas", lambda: kubectl.get("deployment", f"{NAME}-vllm", ns)["spec"]["replicas"] == 2,
             timeout=120)
    scale = wait_for("the scale subresource's status at 2", lambda: (lambda s: s if s.get("status", {}).get("replicas") == 2
                     else None)(json.loads(kubectl.run("get", "kvns", NAME, "-n", ns, "--subresource=scale", "-o",
                                                       "json").stdout)), timeout=120)
    assert scale["spec"]["replicas"] == 2
    assert scale["status"]["selector"] == (f"app.kubernetes.io/name=kvpersist,app.kubernetes.io/instance={NAME},"
                                           "app.kubernetes.io/component=vllm")
    assert as_user(kubectl, VIEWER, "scale", f"kvcachenamespace/{NAME}", "--replicas=3", "-n", ns).returncode != 0
    wait_for("VLLM 2/2", lambda: _columns(kubectl, ns)["VLLM"] == "2/2", timeout=120)

    # One lmcache server: no PodDisruptionBudget (one disruption at a time over one server limits nothing).
    assert _pdb(kubectl, ns) is None
    # Two (the editor's change, through the creator-rights policy): the servers' budget, made by the
    # operator and owned by the resource.
    patched = as_user(kubectl, EDITOR, "patch", "kvns", NAME, "-n", ns, "--type=merge", "-p",
                      json.dumps({"spec": {"lmcacheServer": {"replicas": 2}}}))
    assert patched.returncode == 0, patched.stderr
    pdb = wait_for("the servers' PodDisruptionBudget", lambda: _pdb(kubectl, ns), timeout=60)
    assert pdb["spec"]["maxUnavailable"] == 1
    assert [o["name"] for o in pdb["metadata"]["ownerReferences"]] == [NAME]
    # Deleted by hand, it comes back (drift: the operator watches PodDisruptionBudgets it owns).
    kubectl.run("delete", "poddisruptionbudget", f"{NAME}-lmcache", "-n", ns, "--wait=true")
    wait_for("the PodDisruptionBudget to come back", lambda: (lambda o: o and o["metadata"]["uid"] != pdb["metadata"]["uid"])(
        _pdb(kubectl, ns)), timeout=60)
    # Back to one server: the budget goes.
    kubectl.run("patch", "kvns", NAME, "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"lmcacheServer": {"replicas": 1}}}))
    wait_for("the PodDisruptionBudget to go", lambda: _pdb(kubectl, ns) is None, timeout=60)


def _pdb(kubectl: Kubectl, ns: str) -> dict | None:
    return json.loads(kubectl.run("get", "poddisruptionbudget", f"{NAME}-lmcache", "-n", ns, "-o", "json",
                                  check=False).stdout or "null")
