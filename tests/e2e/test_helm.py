"""The Helm chart on the local cluster: lint, server-side dry run of its output, install, then the
operator running with exactly the chart's ServiceAccount credentials reconciles samples to Ready
(the RBAC is enough) and `kubectl auth can-i --list` shows nothing more than it needs. Statuses
captured here feed the Argo CD Lua health check in a real Lua runtime; a server-side diff of the
user's manifest after reconcile shows no drift."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests import rbac_needs
from tests.e2e.kube import REPO, Kubectl, bin_dir, wait_for
from tests.e2e.operator_env import NAME, Runner, RunnerThread, manifest, stop, storage

pytestmark = [pytest.mark.e2e, pytest.mark.datapath]
CHART = REPO / "charts" / "kvpersist"
RELEASE = "kvpersist"

# Every (resource, verb) the operator may do is derived from its code and kopf's handlers
# (tests/rbac_needs.py; the chart is this, installed cluster-wide), not copied from rbac.yaml. And
# the ones every authenticated user has by default (self reviews), which can-i --list also prints.
DEFAULTS = {("selfsubjectaccessreviews.authorization.k8s.io", "create"),
            ("selfsubjectrulesreviews.authorization.k8s.io", "create"),
            ("selfsubjectreviews.authentication.k8s.io", "create")} | {
    # system:cluster-trust-bundle-discovery, bound by Kubernetes to every ServiceAccount.
    ("clustertrustbundles.certificates.k8s.io", v) for v in ("get", "list", "watch")}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([str(bin_dir() / "helm"), *args], capture_output=True, text=True, timeout=120)
    if check and out.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)}: {out.stderr}")
    return out


def test_helm_lint() -> None:
    out = helm("lint", str(CHART))
    assert "0 chart(s) failed" in out.stdout


def test_template_accepted_by_server_side_dry_run(kubectl: Kubectl, crd: None) -> None:
    rendered = helm("template", RELEASE, str(CHART), "--namespace", "kvpersist-dryrun", "--include-crds").stdout
    kinds = {d["kind"] for d in yaml.safe_load_all(rendered) if d}
    assert {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
            "ClusterKopfPeering", "Service", "NetworkPolicy"} <= kinds
    kubectl.run("create", "namespace", "kvpersist-dryrun", check=False)
    # CRDs first (a real apply), then everything else as a server-side dry run that the API server validates.
    crds = "---\n".join(yaml.safe_dump(d) for d in yaml.safe_load_all(rendered) if d and d["kind"] == "CustomResourceDefinition")
    kubectl.run("apply", "--server-side", "--force-conflicts", "-f", "-", stdin=crds)
    kubectl.wait_established("clusterkopfpeerings.kopf.dev")
    rest = "---\n".join(yaml.safe_dump(d) for d in yaml.safe_load_all(rendered) if d and d["kind"] != "CustomResourceDefinition")
    out = kubectl.run("apply", "--server-side", "--dry-run=server", "-f", "-", stdin=rest)
    assert "serverside-applied (server dry run)" in out.stdout
    kubectl.run("delete", "namespace", "kvpersist-dryrun", "--wait=false", check=False)


@pytest.fixture(scope="module")
def installed(kubectl: Kubectl, crd: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    release_ns = f"kvp-sys-{uuid.uuid4().hex[:6]}"
    app_ns = f"e2e-{uuid.uuid4().hex[:8]}"
    work = tmp_path_factory.mktemp("helm")
    # crds.enabled=false: the CRD is the session's (tests/e2e/conftest.py), no release's; the chart's
    # own CRD, taken over and kept, is tests/e2e/test_upgrade.py's.
    helm("install", RELEASE, str(CHART), "--namespace", release_ns, "--create-namespace",
         "--kubeconfig", str(kubectl.kubeconfig), "--set", "crds.enabled=false")
    kubectl.run("create", "namespace", app_ns)
    kubectl.apply(storage(app_ns))
    # The chart's ServiceAccount, as a kubeconfig with its token: the operator gets nothing else.
    sa_kubeconfig = kubectl.as_service_account(release_ns, RELEASE, work / "sa.kubeconfig").kubeconfig
    log = work / "operator.log"
    # As the chart runs it: cluster-wide, with peering; the namespace the NetworkPolicy admits.
    operator = subprocess.Popen(
        [sys.executable, "-m", "kvpersist.cli", "run", "--peering", "kvpersist"],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "KUBECONFIG": str(sa_kubeconfig), "KVPERSIST_OPERATOR_NAMESPACE": release_ns})
    runner = Runner(kubectl.kubeconfig, app_ns, work / "pods", kubectl=str(kubectl.binary),
                    lmcache=str(Path(sys.executable).parent / "lmcache"))
    state = {"release_ns": release_ns, "app_ns": app_ns, "log": log, "runner": runner, "statuses": {}}
    thread = RunnerThread(runner)
    thread.__enter__()
    state["runner_thread"] = thread
    try:
        yield state
    finally:
        state["runner_thread"].__exit__(None, None, None)
        stop(operator)
        helm("uninstall", RELEASE, "--namespace", release_ns, "--kubeconfig", str(kubectl.kubeconfig), check=False)
        for ns in (app_ns, release_ns):
            kubectl.run("delete", "namespace", ns, "--wait=false", check=False)
        kubectl.run("delete", "pv", f"{app_ns}-pv", "--wait=false", check=False)
        kubectl.run("delete", "storageclass", f"{app_ns}-nvme", check=False)


def _status(kubectl: Kubectl, ns: str, name: str) -> dict:
    return kubectl.get("kvns", name, ns)


def rbac_decisions(audit_log: Path, user: str) -> tuple[list[str], int]:
    """The requests of `user` that the authorizer refused ("verb resource namespace/name"), and
    how many it allowed, from the API server's audit log (rotated files included)."""
    refused, allowed = [], 0
    for path in sorted(audit_log.parent.glob(audit_log.stem + "*" + audit_log.suffix)):
        for line in path.read_text(errors="replace").splitlines():
            if f'"{user}"' not in line:
                continue
            event = json.loads(line)
            if event.get("user", {}).get("username") != user:
                continue
            decision = event.get("annotations", {}).get("authorization.k8s.io/decision")
            ref = event.get("objectRef", {})
            if decision == "forbid":
                refused.append(f"{event['verb']} {ref.get('resource')} {ref.get('namespace', '')}/{ref.get('name', '')}")
            elif decision == "allow":
                allowed += 1
    return refused, allowed


def test_audit_check_sees_an_rbac_refusal(kubectl: Kubectl, installed: dict, audit_log: Path, tmp_path: Path) -> None:
    """The check above can fail: a ServiceAccount without rights is refused, and the audit log says so."""
    ns = installed["release_ns"]
    kubectl.run("create", "serviceaccount", "nobody", "-n", ns)
    nobody = kubectl.as_service_account(ns, "nobody", tmp_path / "nobody.kubeconfig")
    out = nobody.run("get", "secrets", "-n", installed["app_ns"], check=False)
    assert out.returncode != 0 and "forbidden" in out.stderr.lower(), out.stderr
    user = f"system:serviceaccount:{ns}:nobody"
    refused = wait_for("the refusal in the audit log", lambda: rbac_decisions(audit_log, user)[0], timeout=30)
    assert refused == [f"list secrets {installed['app_ns']}/"], refused


def test_chart_service_account_reconciles_to_ready(kubectl: Kubectl, installed: dict, audit_log: Path) -> None:
    """Under the chart's admission policies (on by default): the creator-rights one admits the
    admin's resource, and never the operator's own writes (metadata patches, status) to it."""
    ns = installed["app_ns"]
    for policy in (f"{RELEASE}-creator-rights", f"{RELEASE}-gc-request"):
        assert kubectl.get("validatingadmissionpolicybinding", policy)["spec"]["validationActions"] == ["Deny"]
    kubectl.apply(manifest(ns))
    obj = wait_for("Ready under the chart's RBAC", lambda: (lambda o: o if o.get("status", {}).get("phase") == "Ready" else None)(
        _status(kubectl, ns, NAME)), timeout=180)
    installed["statuses"]["Ready"] = obj
    # Refused by RBAC, by the API server's own account: not any 403 (a namespace being terminated
    # answers 403 too), and not a search of the operator's log for digits.
    user = f"system:serviceaccount:{installed['release_ns']}:{RELEASE}"
    refused, allowed = rbac_decisions(audit_log, user)
    assert allowed > 0, f"no request of {user} in {audit_log}: the audit check would be vacuous"
    assert refused == [], refused[:10]
    # And the operator's log holds no RBAC refusal either (the API server's wording for one).
    log = installed["log"].read_text()
    assert re.search(rf'"{re.escape(user)}" cannot \w+ resource', log) is None, log[-3000:]
    [pol] = [p for p in kubectl.get("networkpolicies", namespace=ns)["items"]  # the namespace id's, one
             if p["metadata"]["labels"].get("app.kubernetes.io/instance") == NAME]
    http_rule, _zmq = pol["spec"]["ingress"]
    assert http_rule["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": installed["release_ns"]}


def test_can_i_list_shows_only_what_is_needed(kubectl: Kubectl, installed: dict) -> None:
    sa = f"system:serviceaccount:{installed['release_ns']}:{RELEASE}"
    granted = kubectl.can_i_list(sa, installed["app_ns"])
    need = rbac_needs.needs("clusterwide")
    needed, optional = rbac_needs.can_i_pairs(set(need.required)), rbac_needs.can_i_pairs(set(need.optional))
    extra, missing = granted - DEFAULTS - needed - optional, needed - granted
    assert not extra and not missing, f"extra: {extra}; missing: {missing}"
    assert not any(v == "*" or r == "*" for r, v in granted)


def test_no_drift_after_reconcile(kubectl: Kubectl, installed: dict, tmp_path: Path) -> None:
    ns = installed["app_ns"]
    path = tmp_path / "kvcache.yaml"
    path.write_text(yaml.safe_dump(manifest(ns)))
    out = kubectl.run("diff", "--server-side", "--field-manager=argocd-controller", "-f", str(path), check=False)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr


def test_capture_other_phases(kubectl: Kubectl, installed: dict) -> None:
    ns = installed["app_ns"]
    disabled = manifest(ns)
    disabled["metadata"]["name"] = "no-digest"
    del disabled["spec"]["identity"]["chatTemplateDigest"]
    disabled["spec"]["l2"]["nvme"] = {"existingClaimName": "unused", "maxCapacity": "1Gi"}
    disabled["spec"]["vllm"]["replicas"] = 0
    kubectl.apply(disabled)
    installed["statuses"]["CacheDisabled"] = wait_for("CacheDisabled", lambda: (lambda o: o if o.get("status", {}).get(
        "phase") == "CacheDisabled" else None)(_status(kubectl, ns, "no-digest")), timeout=60)

    # More vLLM pods than the GPU node has GPUs: some run, the rest wait: Progressing.
    grown = manifest(ns)
    grown["spec"]["vllm"]["replicas"] = 20
    kubectl.apply(grown)
    installed["statuses"]["Progressing"] = wait_for("Progressing", lambda: (lambda o: o if o.get("status", {}).get(
        "phase") == "Progressing" else None)(_status(kubectl, ns, NAME)), timeout=60)

    # The cache server of the Ready resource goes away (its process, not its pod): Degraded.
    installed["runner_thread"].__exit__(None, None, None)
    installed["runner_thread"] = RunnerThread(Runner(kubectl.kubeconfig, "nothing-here", installed["runner"].workdir))
    installed["runner_thread"].__enter__()
    installed["statuses"]["Degraded"] = wait_for("Degraded", lambda: (lambda o: o if o.get("status", {}).get(
        "phase") == "Degraded" else None)(_status(kubectl, ns, NAME)), timeout=60)


def _to_lua(lua, value):
    if isinstance(value, dict):
        return lua.table_from({k: _to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([_to_lua(lua, v) for v in value])
    return value


def argo_health(obj: dict) -> tuple[str, str]:
    from lupa import LuaRuntime

    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = _to_lua(lua, obj)
    script = (CHART / "files" / "argocd-health.lua").read_text()
    hs = lua.execute(script)
    return hs["status"], hs["message"]


def test_argocd_health_of_captured_statuses(installed: dict) -> None:
    captured = installed["statuses"]
    assert set(captured) == {"Ready", "CacheDisabled", "Progressing", "Degraded"}
    expected = {"Ready": "Healthy", "CacheDisabled": "Degraded", "Progressing": "Progressing", "Degraded": "Degraded"}
    for phase, obj in captured.items():
        status, message = argo_health(obj)
        assert status == expected[phase], (phase, status, message)
        assert message
    assert "spec.identity.chatTemplateDigest" in argo_health(captured["CacheDisabled"])[1]  # the field, as users write it
    stale = json.loads(json.dumps(captured["Ready"]))
    stale["metadata"]["generation"] = stale["status"]["observedGeneration"] + 1
    assert argo_health(stale)[0] == "Progressing"
    assert argo_health({"metadata": {"name": "new"}})[0] == "Progressing"


def test_kvpersist_version_finds_the_installed_operator(kubectl: Kubectl, installed: dict) -> None:
    """`kvpersist version` on the cluster the chart was installed in: the client's version and the
    release's operator Deployment (its appVersion label and image), as an admin sees them."""
    out = subprocess.run([sys.executable, "-m", "kvpersist.cli", "version", "-o", "json", "--kubeconfig",
                          str(kubectl.kubeconfig)], capture_output=True, text=True, timeout=60, check=True)
    data = json.loads(out.stdout)
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    mine = [o for o in data["operators"] if o["namespace"] == installed["release_ns"]]
    assert "operatorsUnknown" not in data and len(mine) == 1, data
    assert mine[0]["version"] == chart["appVersion"] and mine[0]["image"], mine
