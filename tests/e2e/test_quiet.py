"""Quiet means quiet (issue 46, item 1): resources whose lmcache servers can never be scheduled
cost the API server nothing once the fallback has rolled vLLM without the cache. The fallback
rolls vLLM once, the drift watch never takes that roll for someone else's edit, and status is
written only when something a user can see changed: counted from the API server's own audit log
(every verb of the operator's ServiceAccount), a minute after the fallback.

Real API server and scheduler; the servers ask for a CPU request no node has (Pending forever),
vLLM's pods are the local cluster's kwok pods on its fake GPU node (Ready once scheduled: what
counts here is the operator's side)."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kvpersist.controller.runtime import STATUS_INTERVAL_S
from tests.e2e.audit import WRITE_VERBS, events
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import manifest, more_rounds, start_operator, stop

pytestmark = pytest.mark.e2e
NAMES = ("quiet-a", "quiet-b", "quiet-c")
FALLBACK_S = 10
WINDOW_S = 60.0


@pytest.fixture()
def quiet_operator(kubectl: Kubectl, crd: None, namespace: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The operator as ServiceAccount `operator` of the test's namespace (cluster-admin: what is
    under test is what it asks of the API server, not RBAC), the fallback bound short."""
    ns = namespace
    binding = f"{ns}-operator"
    kubectl.run("create", "serviceaccount", "operator", "-n", ns)
    kubectl.run("create", "clusterrolebinding", binding, "--clusterrole=cluster-admin", f"--serviceaccount={ns}:operator")
    own = kubectl.as_service_account(ns, "operator", tmp_path / "operator.kubeconfig")
    proc = start_operator(own.kubeconfig, ns, tmp_path / "operator.log", {"KVPERSIST_CACHE_FALLBACK_S": str(FALLBACK_S)})
    try:
        yield {"ns": ns, "proc": proc, "user": f"system:serviceaccount:{ns}:operator", "as_operator": own}
    finally:
        stop(proc)
        kubectl.run("delete", "clusterrolebinding", binding, "--ignore-not-found", check=False)


def resource(ns: str, name: str) -> dict[str, Any]:
    """The e2e sample (one image by digest: the cache on), on kwok's GPU node rather than the real one."""
    obj = manifest(ns)
    obj["metadata"]["name"] = name
    for pinned in ("nodeSelector", "tolerations"):
        obj["spec"]["vllm"].pop(pinned, None)
    obj["spec"].setdefault("lmcacheServer", {})["resources"] = {"requests": {"cpu": "5000"}}  # no node has it: Pending forever
    obj["spec"]["vllm"]["replicas"] = 1
    return obj


def requests(audit_log: Path, user: str, since: datetime, until: datetime) -> list[str]:
    """Every request of the operator's account received between since and until, of any verb:
    "verb resource[/sub] namespace/name" (a watch counted when it starts)."""
    out = []
    for e in events(audit_log, user, stages=("ResponseStarted", "ResponseComplete")):
        verb, ref = e.get("verb"), e.get("objectRef") or {}
        if e.get("stage") != ("ResponseStarted" if verb == "watch" else "ResponseComplete"):
            continue
        received = datetime.fromisoformat(e["requestReceivedTimestamp"].replace("Z", "+00:00"))
        if since <= received <= until:
            sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
            out.append(f"{verb} {ref.get('resource')}{sub} {ref.get('namespace', '')}/{ref.get('name', '')}")
    return out


def test_unschedulable_servers_cost_no_requests_a_minute_after_the_fallback(
        kubectl: Kubectl, quiet_operator: dict[str, Any], audit_log: Path) -> None:
    ns, proc, user = quiet_operator["ns"], quiet_operator["proc"], quiet_operator["user"]
    started = datetime.now(UTC)
    for name in NAMES:
        kubectl.apply(resource(ns, name))

    def bypassed(name: str) -> bool:
        conds = (kubectl.get("kvns", name, ns).get("status") or {}).get("conditions") or []
        return any(c["type"] == "CacheBypassed" and c["status"] == "True" for c in conds)

    wait_for("CacheBypassed on every resource", lambda: all(bypassed(n) for n in NAMES), timeout=FALLBACK_S + 120)
    fell_back = time.monotonic()

    def vllm_ready(name: str) -> bool:
        dep = kubectl.get("deployment", f"{name}-vllm", ns)
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        return "--kv-transfer-config" not in args and (dep.get("status") or {}).get("readyReplicas") == 1
    wait_for("vLLM without the cache Ready", lambda: all(vllm_ready(n) for n in NAMES), timeout=120)
    # A minute after the fallback: whatever followed it (the roll, the status that says so) is over.
    time.sleep(max(0.0, WINDOW_S - (time.monotonic() - fell_back)))
    server = kubectl.get("pod", f"{NAMES[0]}-lmcache-0", ns)
    assert server["status"]["phase"] == "Pending", server["status"]  # the case under test: never scheduled

    since = datetime.now(UTC)
    more_rounds(proc, ns, *NAMES, rounds=int(WINDOW_S // STATUS_INTERVAL_S))
    until = datetime.now(UTC)
    # The audit log is written as requests complete: one request of ours as the operator's
    # account marks the window's end; once it is in the log, so is everything before it.
    marker = f"marker-{uuid.uuid4().hex[:8]}"
    quiet_operator["as_operator"].run("get", "configmap", marker, "-n", ns, "--ignore-not-found")
    wait_for("the marker request in the audit log", lambda: any((e.get("objectRef") or {}).get("name") == marker
                                                                 for e in events(audit_log, user)), timeout=30)
    seen = [r for r in requests(audit_log, user, since, until) if marker not in r]
    writes = [r for r in seen if r.split()[0] in WRITE_VERBS]
    assert writes == [], f"{len(writes)} writes in {until - since} of quiet rounds: {writes}"
    # No read a round would repeat: no get at all, and a list or watch at most once each (kopf's
    # watches end every few minutes and are opened again; that is the watch, not a round).
    repeated = sorted(r for r, n in Counter(seen).items() if r.startswith("get ") or n > 1)
    assert repeated == [], f"reads in {until - since} of quiet rounds: {seen}"
    # The one roll the fallback makes, counted: from its creation on, each vLLM Deployment was
    # written twice by the operator (made with the cache, rolled without it) and its spec changed
    # once (generation 2): the drift watch never took the roll for someone else's edit to undo.
    since_start = requests(audit_log, user, started, until)
    for name in NAMES:
        writes = [r for r in since_start if r.split()[0] in WRITE_VERBS and r.endswith(f" {ns}/{name}-vllm")
                  and r.split()[1] == "deployments"]
        assert len(writes) == 2, f"{name}-vllm: {writes}"
        assert kubectl.get("deployment", f"{name}-vllm", ns)["metadata"]["generation"] == 2
