"""Bring your own vLLM, with real parts (docs/attach.md): a team's own Deployment of the real vLLM (its
CPU build, under hack/kubelet_runner.py on the real node), which the operator did not make, labelled
kvpersist.dev/attach for a KVCacheNamespace with spec.vllm.mode Attached; the operator runs only the
real `lmcache server`, and config/attach's policies complete the pod at admission.

In order: the first pod computes the long prompt (no external hit) and LMCache stores it; the pod is
deleted, and its replacement (another pod the API server completed) is served that prefix from the
server's L1, with the same greedy answer; status counts the attached pod, its hits and the canary's
check of it. Then a second Deployment of another model revision is refused at admission: its
ReplicaSet creates no pod, and the Deployment's ReplicaFailure names the argument and the pin.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, REAL_NODE, REAL_NODE_TAINT, kvpersist_env, target_of
from tests.e2e.test_attach import LABEL, attach_policy  # noqa: F401  (the fixture)
from tests.e2e.test_real_vllm import CHUNK, ask, greedy, model, print_logs, real_manifest  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.datapath, pytest.mark.vllm]

TEAM = "team-vllm"  # the user's own Deployment


def team_deployment(ns: str, name: str, attach: dict[str, Any], image: str, revision: str | None = None) -> dict[str, Any]:
    """vLLM as a team runs it: their names and labels, `vllm serve MODEL` with every pin (revision
    replaced, for the refused one), where it listens, their own flags; nothing about the cache."""
    args = ["serve", attach["model"]]
    for pin in attach["pins"]:
        args += [pin["flag"], revision if revision is not None and pin["flag"] == "--revision" else pin["value"]]
    # vLLM's own prefix cache would answer a repeated prompt before LMCache is asked (as in test_real_vllm).
    args += ["--host", "0.0.0.0", "--port", "8000", "--no-enable-prefix-caching", "--enforce-eager"]
    labels = {"app": name, LABEL: NAME}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": labels}, "spec": {
                         "containers": [{"name": "vllm", "image": image, "command": ["vllm"], "args": args,
                                         "ports": [{"name": "http", "containerPort": 8000}],
                                         "readinessProbe": {"httpGet": {"path": "/health", "port": 8000},
                                                            "periodSeconds": 5}}],
                         "nodeSelector": {"kubernetes.io/hostname": REAL_NODE},
                         "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}]}}}}


def team_pod(kubectl: Kubectl, ns: str, exclude: frozenset[str] = frozenset()) -> dict | None:
    for p in kubectl.get("pods", namespace=ns)["items"]:
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in (p.get("status") or {}).get("conditions", []))
        if p["metadata"]["name"].startswith(f"{TEAM}-") and ready and p["metadata"]["name"] not in exclude \
                and not p["metadata"].get("deletionTimestamp"):
            return p
    return None


def canary_checked(kubectl: Kubectl, ns: str, pod: str) -> dict:
    """status.canary.lastCheck once the canary has checked this pod."""
    def checked() -> dict | None:
        check = ((kubectl.get("kvns", NAME, ns).get("status") or {}).get("canary") or {}).get("lastCheck") or {}
        return check if check.get("pod") == pod else None

    return wait_for(f"the canary's check of {pod}", checked, timeout=300, interval=2)


@pytest.fixture(scope="module")
def chain(kubectl: Kubectl, crd: None, attach_policy: None, model: dict,  # noqa: F811
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with kvpersist_env(kubectl, tmp_path_factory.mktemp("attachvllm"), vllm=model["vllm"], hf_home=Path(model["hfHome"])) as env:
        obj = real_manifest(env.ns, model)
        obj["spec"]["vllm"] = {**{k: v for k, v in obj["spec"]["vllm"].items() if k != "extraArgs"}, "mode": "Attached"}
        obj["spec"]["canary"] = {"enabled": True, "intervalSeconds": 3600}  # checks after restarts only, in this test's time
        kubectl.apply(obj)
        nsid = target_of(obj, kubectl).namespace_id
        attach = wait_for("status.attach", lambda: (kubectl.get("kvns", NAME, env.ns).get("status") or {}).get("attach"),
                          timeout=180)
        assert attach["namespaceId"] == nsid
        kubectl.apply(team_deployment(env.ns, TEAM, attach, obj["spec"]["image"]))
        try:
            yield {"env": env, "obj": obj, "nsid": nsid, "attach": attach}
        except BaseException:
            print_logs(env)
            raise


def test_an_attached_deployment_is_served_from_cache_after_its_pod_is_deleted(kubectl: Kubectl, chain: dict) -> None:
    ns, attach = chain["env"].ns, chain["attach"]
    first = wait_for("the team's vLLM pod Ready", lambda: team_pod(kubectl, ns), timeout=600, interval=2)
    args = first["spec"]["containers"][0]["args"]
    assert args[-2:] == attach["args"]  # the connection the API server added; the team wrote none
    assert first["metadata"]["labels"][LABEL] == NAME and first["metadata"]["labels"]["kvpersist.dev/namespace-id"] == chain["nsid"]
    assert "kvpersist.dev/simulated" not in first["metadata"].get("annotations", {})  # the real vLLM
    ip = first["status"]["podIP"]
    # The canary asks each new pod (a salted reference, then a check with the cache); its requests
    # would share batches with ours and move the logprobs compared below: ours wait until it is done.
    canary_checked(kubectl, ns, first["metadata"]["name"])
    cold_answer = greedy(ip)
    tokens, hits = ask(ip)
    assert tokens > 6 * CHUNK and hits == 0, (tokens, hits)
    cacheable = (tokens - 1) // CHUNK * CHUNK
    kubectl.run("delete", "pod", first["metadata"]["name"], "-n", ns, "--wait=false")
    second = wait_for("its replacement Ready", lambda: team_pod(kubectl, ns, frozenset({first["metadata"]["name"]})),
                      timeout=600, interval=2)
    assert second["spec"]["containers"][0]["args"][-2:] == attach["args"]
    canary_checked(kubectl, ns, second["metadata"]["name"])
    tokens2, hits2 = ask(second["status"]["podIP"])
    assert (tokens2, hits2) == (tokens, cacheable), (tokens2, hits2, cacheable)
    assert greedy(second["status"]["podIP"]) == cold_answer  # served from cache, as computed cold
    chain["pod"], chain["cacheable"] = second["metadata"]["name"], cacheable


def test_status_counts_the_attached_pod_its_hits_and_the_canarys_check(kubectl: Kubectl, chain: dict) -> None:
    ns = chain["env"].ns
    assert "pod" in chain, "the previous test did not get that far"

    def settled() -> dict | None:
        st = kubectl.get("kvns", NAME, ns).get("status") or {}
        check = (st.get("canary") or {}).get("lastCheck") or {}
        ok = ((st.get("attach") or {}).get("readyPods") == 1 and int((st.get("hits") or {}).get("hitTokens") or 0)
              >= chain["cacheable"] and check.get("pod") == chain["pod"])
        return st if ok else None

    st = wait_for("status: the attached pod, its hits, the canary's check of it", settled, timeout=300, interval=3)
    assert st["attach"]["pods"] == 1 and st["replicas"] == "1/1"
    assert st["canary"]["lastCheck"]["match"] is True
    conditions = {c["type"]: c for c in st["conditions"]}
    assert (conditions["VLLMReady"]["status"], conditions["VLLMReady"]["reason"]) == ("True", "AttachedPodsReady")
    assert conditions["HitCorrectness"]["status"] in ("True", "Unknown"), conditions["HitCorrectness"]  # never False


def test_a_deployment_of_another_revision_is_refused_at_admission(kubectl: Kubectl, chain: dict) -> None:
    ns, attach = chain["env"].ns, chain["attach"]
    revision = next(p for p in attach["pins"] if p["flag"] == "--revision")["value"]
    other = "0" * 40 if revision != "0" * 40 else "1" * 40
    kubectl.apply(team_deployment(ns, "other-revision", attach, chain["obj"]["spec"]["image"], revision=other))

    def refused() -> str | None:
        d = kubectl.get("deployment", "other-revision", ns)
        failure = [c for c in (d.get("status") or {}).get("conditions") or [] if c["type"] == "ReplicaFailure"]
        return failure[0]["message"] if failure else None

    message = wait_for("the other revision's ReplicaFailure", refused, timeout=120, interval=2)
    assert "kvpersist-attach" in message and f"--revision {revision} (spec.identity.modelRevision)" in message, message
    pods = [p["metadata"]["name"] for p in kubectl.get("pods", namespace=ns)["items"]]
    assert not any(p.startswith("other-revision-") for p in pods), pods
    print(json.dumps({"refused": message[:300]}), file=sys.stderr)
