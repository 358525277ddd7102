"""Bring your own vLLM, with real parts (docs/attach.md): a team's own Deployment of the real vLLM (its
CPU build, under hack/kubelet_runner.py on the real node), which the operator did not make, labelled
kvpersist.dev/attach for a KVCacheNamespace with spec.vllm.mode Attached; the operator runs only the
real `lmcache server`, and config/attach's policies complete the pod at admission. Its pod is the one
KServe 0.18 makes for an LLMInferenceService (tests/e2e/data): its read-only root is applied by the
runner, and its model cache (HF_HUB_CACHE on an emptyDir) is the runner's stand-in for a download
from the Hub (none here).

In order: the first pod computes the long prompt (no external hit) and LMCache stores it; the pod is
deleted, and its replacement (another pod the API server completed) is served that prefix from the
server's L1, with the same greedy answer; status counts the attached pod, its hits and the canary's
check of it. Then a second Deployment of another model revision is refused at admission: its
ReplicaSet creates no pod, and the Deployment's ReplicaFailure names the argument and the pin.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, REAL_NODE, REAL_NODE_TAINT, kvpersist_env, target_of
from tests.e2e.test_attach import KSERVE_POD, LABEL, LLM_D_POD, attach_policy  # noqa: F401  (the fixture)
from tests.e2e.test_real_vllm import (  # noqa: F401  (model: the fixture)
    CHUNK,
    EVENTS_SET,
    EventTap,
    ask,
    complete,
    greedy,
    kv_events,
    model,
    print_logs,
    real_manifest,
)

pytestmark = [pytest.mark.e2e, pytest.mark.datapath, pytest.mark.vllm]

TEAM = "team-vllm"  # the user's own Deployment


def team_deployment(ns: str, name: str, attach: dict[str, Any], image: str, revision: str | None = None,
                    kserve: bool = False) -> dict[str, Any]:
    """vLLM as a team runs it: their names and labels, `vllm serve MODEL` with every pin (revision
    replaced, for the refused one), where it listens, their own flags; nothing about the cache. With
    kserve, its pod is the one KServe 0.18 makes for an LLMInferenceService (tests/e2e/data): container
    main, HOME and HF_HUB_CACHE on emptyDirs, a read-only root, non-root."""
    args = ["serve", attach["model"]]
    for pin in attach["pins"]:
        args += [pin["flag"], revision if revision is not None and pin["flag"] == "--revision" else pin["value"]]
    # vLLM's own prefix cache would answer a repeated prompt before LMCache is asked (as in test_real_vllm).
    args += ["--host", "0.0.0.0", "--port", "8000", "--no-enable-prefix-caching", "--enforce-eager"]
    if kserve:
        pod = yaml.safe_load(KSERVE_POD.read_text())
        pod["metadata"]["labels"].update({"app": name, LABEL: NAME})
        container = pod["spec"]["containers"][0]
        container.update(image=image, args=args)
        template = {"metadata": pod["metadata"], "spec": pod["spec"]}
    else:
        template = {"metadata": {"labels": {"app": name, LABEL: NAME}}, "spec": {
            "containers": [{"name": "vllm", "image": image, "command": ["vllm"], "args": args,
                            "ports": [{"name": "http", "containerPort": 8000}],
                            "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 5}}]}}
    template["spec"].update(nodeSelector={"kubernetes.io/hostname": REAL_NODE},
                            tolerations=[{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}])
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}, "template": template}}


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
        obj["spec"]["vllm"]["kvEvents"] = {"enabled": True, "topicFormat": "LLMD"}  # llm-d's topic (the last test)
        kubectl.apply(obj)
        nsid = target_of(obj, kubectl).namespace_id
        attach = wait_for("status.attach", lambda: (kubectl.get("kvns", NAME, env.ns).get("status") or {}).get("attach"),
                          timeout=180)
        assert attach["namespaceId"] == nsid
        # The TLS Secret KServe makes beside its pods (mounted by its template).
        kubectl.run("create", "secret", "generic", "qwen3-kserve-self-signed-certs", "-n", env.ns,
                    "--from-literal=tls.crt=", "--from-literal=tls.key=")
        kubectl.apply(team_deployment(env.ns, TEAM, attach, obj["spec"]["image"], kserve=True))
        try:
            yield {"env": env, "obj": obj, "nsid": nsid, "attach": attach}
        except BaseException:
            print_logs(env)
            raise


def test_an_attached_deployment_is_served_from_cache_after_its_pod_is_deleted(kubectl: Kubectl, chain: dict) -> None:
    ns, attach = chain["env"].ns, chain["attach"]
    first = wait_for("the team's vLLM pod Ready", lambda: team_pod(kubectl, ns), timeout=600, interval=2)
    args = first["spec"]["containers"][0]["args"]
    assert args[-len(attach["args"]):] == attach["args"]  # the connection the API server added; the team wrote none
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
    assert second["spec"]["containers"][0]["args"][-len(attach["args"]):] == attach["args"]
    canary_checked(kubectl, ns, second["metadata"]["name"])
    tokens2, hits2 = ask(second["status"]["podIP"])
    assert (tokens2, hits2) == (tokens, cacheable), (tokens2, hits2, cacheable)
    assert greedy(second["status"]["podIP"]) == cold_answer  # served from cache, as computed cold
    chain["pod"], chain["cacheable"], chain["tokens"] = second["metadata"]["name"], cacheable, tokens


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
    # The canary's check of the replacement pod was served by lmcache (its prefix cache started empty):
    # evidence, so True, not merely never False.
    assert (conditions["HitCorrectness"]["status"], conditions["HitCorrectness"]["reason"]) == ("True", "HitsMatch"), \
        conditions["HitCorrectness"]


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


def test_kv_events_reach_llm_d_in_the_topic_its_scorer_parses(kubectl: Kubectl, chain: dict) -> None:
    """spec.vllm.kvEvents with topicFormat LLMD on the attached pod (KServe's shape): the policy added the
    flag and the pod's IP from the downward API, the kubelet expanded it, and every message's topic is
    kv@<pod IP>:<port>@<model>, which llm-d's scorer (llm-d-kv-cache, pkg/kvevents: subscribed to `kv@`,
    engineadapter parseTopic splitting on `@`) reads as the pod its endpoint picker keys by IP:port and
    the model. Its decoder's payload format is llm-d's side (docs/attach.md)."""
    ns, obj = chain["env"].ns, chain["obj"]
    assert "pod" in chain, "the first test did not get that far"
    pod = kubectl.get("pod", chain["pod"], ns)
    ip, c = pod["status"]["podIP"], pod["spec"]["containers"][0]
    assert {"name": "KVPERSIST_POD_IP", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}} \
        in c["env"]
    model_name = obj["spec"]["vllm"].get("servedModelName") or obj["spec"]["identity"]["modelId"]
    tap = EventTap(ip, 5557)
    try:
        complete(ip, EVENTS_SET[0], max_tokens=4)

        def stored() -> list | None:
            complete(ip, "ba.", max_tokens=1)  # a finished store is announced at vLLM's next engine step
            frames = list(tap.frames)
            return frames if any(e.get("type") == "BlockStored" for e in kv_events(frames)) else None

        wait_for("lmcache's stores announced on the attached pod's KV events socket", stored, timeout=60, interval=1)
    finally:
        frames = tap.close()
    topics = {topic for topic, _seq, _batch in frames}
    assert topics == {f"kv@{ip}:8000@{model_name}".encode()}, topics
    kind, pod_id, model_in_topic = next(iter(topics)).decode().split("@")
    assert (kind, pod_id, model_in_topic) == ("kv", f"{ip}:8000", model_name)


def test_an_llm_d_decode_pod_is_served_from_the_cache(kubectl: Kubectl, chain: dict) -> None:
    """llm-d's decode pod as its modelservice chart renders it (tests/e2e/data) with routing.proxy.enabled
    false (helm template: then no routing-proxy init container and vLLM on 8000, nothing else differs):
    `vllm serve MODEL`, HF_HOME on its emptyDir (the runner's stand-in for the Hub download), no probe.
    Admitted, its first pod computes the long prompt and its replacement is served it from the server.
    Not the KServe-shaped pods' chunks: offline (HF_HUB_OFFLINE, as here) vLLM names the model by its
    local snapshot path, /model-cache/... here and /models/... there, and lmcache keys chunks by that
    name, so the two stacks' chunks miss each other (docs/attach.md)."""
    ns, attach, obj = chain["env"].ns, chain["attach"], chain["obj"]
    assert "tokens" in chain, "the first test did not get that far"
    kubectl.run("scale", "deployment", TEAM, "-n", ns, "--replicas=0")  # two real vLLMs would not fit 2 cores
    wait_for("the team's pods gone", lambda: not any(
        p["metadata"]["name"].startswith(f"{TEAM}-") for p in kubectl.get("pods", namespace=ns)["items"]), timeout=120)
    pod = yaml.safe_load(LLM_D_POD.read_text())
    del pod["spec"]["initContainers"]
    c = pod["spec"]["containers"][0]
    pins = [x for p in attach["pins"] for x in (p["flag"], p["value"])]
    c.update(image=obj["spec"]["image"], args=[attach["model"], "--port", "8000", "--served-model-name", attach["model"],
                                                *pins, "--host", "0.0.0.0", "--no-enable-prefix-caching", "--enforce-eager"])
    pod["metadata"]["labels"][LABEL] = NAME
    pod["spec"].update(nodeSelector={"kubernetes.io/hostname": REAL_NODE},
                       tolerations=[{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}])
    labels = {k: v for k, v in pod["metadata"]["labels"].items() if k != LABEL}
    kubectl.apply({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "llm-d-decode", "namespace": ns},
                   "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                            "template": {"metadata": pod["metadata"], "spec": pod["spec"]}}})

    def serving(exclude: str = "") -> dict | None:
        for p in kubectl.get("pods", namespace=ns)["items"]:
            ip = (p.get("status") or {}).get("podIP")
            if p["metadata"]["name"].startswith("llm-d-decode-") and ip and p["metadata"]["name"] != exclude \
                    and not p["metadata"].get("deletionTimestamp"):
                try:
                    with urllib.request.urlopen(f"http://{ip}:8000/health", timeout=5) as r:
                        return p if r.status == 200 else None
                except OSError:
                    return None
        return None

    first = wait_for("llm-d's decode pod serving", serving, timeout=600, interval=3)
    assert first["spec"]["containers"][0]["command"] == ["vllm", "serve"]
    assert first["spec"]["containers"][0]["args"][-len(attach["args"]):] == attach["args"]
    assert ask(first["status"]["podIP"]) == (chain["tokens"], 0)  # computed, and stored
    kubectl.run("delete", "pod", first["metadata"]["name"], "-n", ns, "--wait=false")
    second = wait_for("its replacement serving", lambda: serving(first["metadata"]["name"]), timeout=600, interval=3)
    tokens, hits = ask(second["status"]["podIP"])
    assert (tokens, hits) == (chain["tokens"], chain["cacheable"]), (tokens, hits, chain["cacheable"])
