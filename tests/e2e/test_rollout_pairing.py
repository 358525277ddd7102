"""A pin change rolls without pairing identities: at no moment of the rollout does a vLLM pod of
one namespace id have a route to an lmcache server of another, by the Service name its launch
line carries, that Service's selector, or the name resolution the local cluster does
(hack/kubelet_runner.py: a Service name to a Ready endpoint it selects). Old and new pods do
overlap (checked, so the check is not vacuous), and once the old id's pods are gone, its
Service and NetworkPolicy are deleted. Real lmcache servers; vLLM pods simulated (the
routes are what is under test, not vLLM)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.kube import REPO, Kubectl, wait_for
from tests.e2e.operator_env import NAME, REAL_NODE, kvpersist_env, manifest, target_of

sys.path.insert(0, str(REPO / "hack"))
from kubelet_runner import hosts_file

pytestmark = [pytest.mark.e2e, pytest.mark.datapath]
NSID = "kvpersist.dev/namespace-id"


def component(pod: dict) -> str:
    return pod["metadata"]["labels"].get("app.kubernetes.io/component", "")


def service_of(vllm_pod: dict) -> str:
    args = vllm_pod["spec"]["containers"][0]["args"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    return config["kv_connector_extra_config"]["lmcache.mp.host"].removeprefix("tcp://").split(".")[0]


def sample(kubectl: Kubectl, ns: str) -> tuple[list[str], bool]:
    """Every route from a vLLM pod (terminating ones too) to a server of another id; and whether
    pods of two ids were there at once."""
    pods = kubectl.get("pods", namespace=ns)["items"]
    services = {s["metadata"]["name"]: s for s in kubectl.get("services", namespace=ns)["items"]}
    servers = [p for p in pods if component(p) == "lmcache-server"]
    by_ip = {p["status"].get("podIP"): p for p in servers if p["status"].get("podIP")}
    resolved = {}
    for line in hosts_file(pods, list(services.values()), REAL_NODE).splitlines()[1:]:
        ip, names = line.split("\t")
        resolved[names.split()[-1]] = ip
    bad, ids = [], {p["metadata"]["labels"].get(NSID) for p in pods}
    for vllm in (p for p in pods if component(p) == "vllm"):
        mine, name = vllm["metadata"]["labels"].get(NSID), service_of(vllm)
        selector = (services.get(name) or {}).get("spec", {}).get("selector") or {}
        for server in servers:
            theirs = server["metadata"]["labels"].get(NSID)
            if selector and all(server["metadata"]["labels"].get(k) == v for k, v in selector.items()) and theirs != mine:
                bad.append(f"{vllm['metadata']['name']} ({mine}) -> Service {name} selects {server['metadata']['name']} ({theirs})")
        target = by_ip.get(resolved.get(name))
        if target is not None and target["metadata"]["labels"].get(NSID) != mine:
            bad.append(f"{vllm['metadata']['name']} ({mine}) -> {name} resolves to {target['metadata']['name']}")
    return bad, len(ids - {None}) > 1


def test_pin_change_never_pairs_identities(kubectl: Kubectl, crd: None, tmp_path: Path) -> None:
    with kvpersist_env(kubectl, tmp_path) as env:
        ns = env.ns
        obj = manifest(ns)
        obj["spec"]["vllm"]["replicas"] = 2
        kubectl.apply(obj)
        wait_for("phase Ready", lambda: (kubectl.get("kvns", NAME, ns).get("status") or {}).get("phase") == "Ready", timeout=180)
        old = target_of(obj, kubectl)
        obj["spec"]["identity"]["maxModelLen"] = 16384
        new = target_of(obj, kubectl)
        assert new.namespace_id != old.namespace_id
        kubectl.apply(obj)

        violations, overlaps, samples = [], 0, 0
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            bad, overlap = sample(kubectl, ns)
            violations += bad
            overlaps += overlap
            samples += 1
            pods = kubectl.get("pods", namespace=ns)["items"]
            status = kubectl.get("kvns", NAME, ns).get("status") or {}
            if (status.get("phase") == "Ready" and status.get("namespaceId") == new.namespace_id
                    and all(p["metadata"]["labels"].get(NSID) == new.namespace_id for p in pods)):
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the rollout did not finish within 240 s")
        assert violations == [], violations[:10]
        assert overlaps > 0, f"no moment with pods of both ids in {samples} samples: the check above saw nothing"

        # The old id's route is gone once its pods are; the new one stays.
        def routes(name: str) -> list[str]:
            return [kind for kind in ("service", "networkpolicy")
                    if kubectl.run("get", kind, name, "-n", ns, check=False).returncode == 0]

        wait_for("the old id's Service and policy to go", lambda: routes(old.local_service_name) == [], timeout=90)
        assert routes(new.local_service_name) == ["service", "networkpolicy"]
        assert routes(f"{NAME}-lmcache") == []  # no policy of every server: each id's holds the agent's rule
