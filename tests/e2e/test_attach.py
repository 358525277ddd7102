"""Attach mode on the real API server (docs/attach.md): a KVCacheNamespace with spec.vllm.mode Attached,
the operator running it (real lmcache server under hack/kubelet_runner.py), config/attach's policies
installed. The API server itself completes a pod labelled kvpersist.dev/attach (MutatingAdmissionPolicy)
and refuses one whose vLLM would compute other KV (ValidatingAdmissionPolicy), from the resource's
status.attach, which the operator writes.

The vLLM containers here are SIMULATED by the runner (no model of these pins on this machine: it
reports them Ready and runs nothing); the real vLLM attached, served from cache after its pod is
deleted: tests/e2e/test_attach_vllm.py.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from kvpersist.builders.target import NAMESPACE_ID_LABEL
from tests.e2e.kube import REPO, Kubectl, wait_for
from tests.e2e.operator_env import NAME, REAL_NODE, REAL_NODE_TAINT, kvpersist_env, manifest, target_of

pytestmark = pytest.mark.e2e

ATTACH_POLICY = REPO / "config" / "attach" / "attach.yaml"
LABEL = "kvpersist.dev/attach"
DATA = REPO / "tests" / "e2e" / "data"
KSERVE_POD = DATA / "kserve-0.18-llminferenceservice-pod.yaml"  # constructed from KServe's template and merge
LLM_D_POD = DATA / "llm-d-modelservice-decode-pod.yaml"  # rendered by helm from llm-d's chart
ROUTING_SIDECAR = "ghcr.io/llm-d/llm-d-routing-sidecar@sha256:" + "5e" * 32


@pytest.fixture(scope="module")
def attach_policy(kubectl: Kubectl, crd: None) -> Iterator[None]:
    """config/attach's two policies and bindings, removed afterwards (the chart installs the same names).
    Waits until the API server has type-checked the validating one against the CRD, warning-free."""
    kubectl.run("apply", "--server-side", "--force-conflicts", "-f", str(ATTACH_POLICY))

    def checked() -> dict | None:
        policy = kubectl.get("validatingadmissionpolicy", "kvpersist-attach")
        return policy if (policy.get("status") or {}).get("observedGeneration") == policy["metadata"]["generation"] else None

    policy = wait_for("the API server to type-check kvpersist-attach", checked, timeout=60)
    assert not (policy["status"].get("typeChecking") or {}).get("expressionWarnings"), policy["status"]
    assert kubectl.get("mutatingadmissionpolicy", "kvpersist-attach")["spec"]["paramKind"]["kind"] == "KVCacheNamespace"
    yield
    kubectl.run("delete", "-f", str(ATTACH_POLICY), "--ignore-not-found", check=False)


def attached_manifest(ns: str) -> dict[str, Any]:
    obj = manifest(ns)
    obj["spec"]["vllm"].pop("hfTokenSecretRef", None)
    obj["spec"]["vllm"]["mode"] = "Attached"
    return obj


@pytest.fixture(scope="module")
def env(kubectl: Kubectl, crd: None, attach_policy: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with kvpersist_env(kubectl, tmp_path_factory.mktemp("attach")) as e:
        obj = attached_manifest(e.ns)
        kubectl.apply(obj)
        nsid = target_of(obj, kubectl).namespace_id
        attach = wait_for("status.attach", lambda: ((kubectl.get("kvns", NAME, e.ns).get("status") or {}).get("attach")),
                          timeout=120)
        yield {"env": e, "obj": obj, "nsid": nsid, "attach": attach}


def vllm_container(attach: dict[str, Any], image: str, *extra: str) -> dict[str, Any]:
    """A vLLM container as a user writes it for this resource: `vllm serve MODEL`, every pin, their own flags."""
    pins = [x for p in attach["pins"] for x in (p["flag"], p["value"])]
    return {"name": "vllm", "image": image, "command": ["vllm"],
            "args": ["serve", attach["model"], *pins, "--host", "0.0.0.0", "--port", "8000", "--enforce-eager", *extra]}


def user_pod(ns: str, name: str, container: dict[str, Any], labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod the operator did not make, on the real node beside the server (the runner simulates its vLLM)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": {LABEL: NAME} if labels is None else labels},
            "spec": {"containers": [container], "nodeSelector": {"kubernetes.io/hostname": REAL_NODE},
                     "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}]}}


def stack_pod(path: Any, ns: str, name: str, attach: dict[str, Any], image: str, *extra: str) -> dict[str, Any]:
    """A pod as KServe or llm-d makes it (tests/e2e/data), with this resource's name, image and pins:
    llm-d's chart writes `vllm serve` and the model first, KServe's merge takes the user's args."""
    pod = yaml.safe_load(path.read_text())
    pod["metadata"].update(name=name, namespace=ns)
    pod["metadata"]["labels"][LABEL] = NAME
    c = pod["spec"]["containers"][0]
    pins = [x for p in attach["pins"] for x in (p["flag"], p["value"])]
    c["image"] = image
    c["args"] = [*(["serve"] if c["command"] == ["vllm"] else []), attach["model"], *pins, *extra]
    for init in pod["spec"].get("initContainers", []):
        init["image"] = ROUTING_SIDECAR
    pod["spec"].update(nodeSelector={"kubernetes.io/hostname": REAL_NODE},
                       tolerations=[{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}])
    return pod


def dry_run(kubectl: Kubectl, pod: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The pod as the API server would store it (every admission run, nothing stored), or its refusal."""
    out = kubectl.run("create", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(pod), check=False)
    return (json.loads(out.stdout), "") if out.returncode == 0 else (None, out.stderr)


def test_the_operator_runs_the_servers_publishes_the_contract_and_no_vllm(kubectl: Kubectl, env: dict) -> None:
    ns, attach = env["env"].ns, env["attach"]
    assert attach["namespaceId"] == env["nsid"]
    assert attach["args"][0] == "--kv-transfer-config" and f"{NAME}-lmcache-{env['nsid'][4:12]}" in attach["args"][1]
    wait_for("the lmcache StatefulSet", lambda: kubectl.run("get", "statefulset", f"{NAME}-lmcache", "-n", ns,
                                                            check=False).returncode == 0, timeout=60)
    assert not kubectl.get("deployments", namespace=ns)["items"]  # the user's vLLM: none of the operator's
    zmq = kubectl.get("networkpolicy", f"{NAME}-lmcache-{env['nsid'][4:12]}", ns)
    # The attached pods of this id only (ZMQ's rule, the last): no selector of the managed vLLM pods
    # (there are none; a pod wearing their labels would be a peer admitted by no policy).
    assert zmq["spec"]["ingress"][-1]["from"] == [{"podSelector": {"matchLabels": {LABEL: NAME, NAMESPACE_ID_LABEL: env["nsid"]}}}]


def test_a_labelled_pod_gets_the_connection_and_is_counted(kubectl: Kubectl, env: dict) -> None:
    """Only additions, where the pod has none of its own: the kv-transfer-config, the fixed variables,
    /dev/shm, the namespace id label, and required affinity to this id's servers; then status counts it."""
    ns, attach, image = env["env"].ns, env["attach"], env["obj"]["spec"]["image"]
    container = vllm_container(attach, image)
    container["env"] = [{"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}]
    pod = user_pod(ns, "mine-0", container, labels={LABEL: NAME, "app": "their-own"})
    pod["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [REAL_NODE]}]}]}}}
    kubectl.apply(pod)
    stored = kubectl.get("pod", "mine-0", ns)
    c = stored["spec"]["containers"][0]
    assert c["args"] == [*container["args"], *attach["args"]]  # the user's, in order, then the connection
    assert c["env"] == [*container["env"], *attach["env"]]
    assert {"name": "kvpersist-dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert {"name": "kvpersist-dshm", "emptyDir": {"medium": "Memory"}} in stored["spec"]["volumes"]
    assert stored["metadata"]["labels"] == {LABEL: NAME, "app": "their-own", NAMESPACE_ID_LABEL: env["nsid"]}
    assert stored["spec"]["affinity"]["nodeAffinity"] == pod["spec"]["affinity"]["nodeAffinity"]  # kept
    assert stored["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [
        {"labelSelector": {"matchLabels": attach["serverSelector"]}, "topologyKey": "kubernetes.io/hostname"}]

    def counted() -> dict | None:
        st = kubectl.get("kvns", NAME, ns).get("status") or {}
        return st if (st.get("attach") or {}).get("readyPods") == 1 else None

    st = wait_for("status to count the attached pod Ready", counted, timeout=120)
    assert st["attach"]["pods"] == 1 and st["replicas"] == "1/1"
    vllm = next(c for c in st["conditions"] if c["type"] == "VLLMReady")
    assert (vllm["status"], vllm["reason"]) == ("True", "AttachedPodsReady")
    # A pod of the same spec without the label is none of the policies' business: stored as written.
    plain, _ = dry_run(kubectl, user_pod(ns, "plain-0", vllm_container(attach, image), labels={"app": "x"}))
    assert plain is not None and plain["spec"]["containers"][0]["args"] == vllm_container(attach, image)["args"]
    assert "affinity" not in plain["spec"]


def _refusal(kubectl: Kubectl, pod: dict[str, Any]) -> str:
    stored, error = dry_run(kubectl, pod)
    assert stored is None, f"admitted: {json.dumps(stored)[:400]}"
    assert "kvpersist-attach" in error, error
    return error


def test_what_would_compute_other_kv_is_refused_naming_the_field_and_the_pin(kubectl: Kubectl, env: dict) -> None:
    ns, attach, image = env["env"].ns, env["attach"], env["obj"]["spec"]["image"]
    revision = next(p for p in attach["pins"] if p["flag"] == "--revision")["value"]

    def pod(container: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return user_pod(ns, "refused-0", container, **kw)

    other = vllm_container(attach, image)
    other["args"][other["args"].index(revision)] = "f" * 40
    error = _refusal(kubectl, pod(other))
    assert f"--revision {revision} (spec.identity.modelRevision)" in error and f"KVCacheNamespace {NAME}" in error
    error = _refusal(kubectl, pod(vllm_container(attach, image, "--quantization", "fp8")))
    assert "--quantization refused" in error
    error = _refusal(kubectl, pod(vllm_container(attach, image, "--kv-transfer-config", '{"kv_connector":"Other"}')))
    assert "status.attach.args" in error  # the user's own connector: refused, never overwritten
    shell = vllm_container(attach, image)
    shell["command"], shell["args"] = ["sh", "-c", "vllm " + " ".join(shell["args"])], []
    assert 'command must be ["vllm"]' in _refusal(kubectl, pod(shell))
    assert "must be pinned by digest to sha256:" in _refusal(kubectl, pod(vllm_container(attach, "vllm/vllm-openai:latest")))
    hashed = vllm_container(attach, image)
    hashed["env"] = [{"name": "PYTHONHASHSEED", "value": "random"}]
    assert "PYTHONHASHSEED=0 exactly once" in _refusal(kubectl, pod(hashed))
    backend = vllm_container(attach, image)
    backend["env"] = [{"name": "VLLM_ATTENTION_BACKEND", "value": "FLASHINFER"}]
    assert "VLLM_ATTENTION_BACKEND refused" in _refusal(kubectl, pod(backend))
    local = vllm_container(attach, image)
    local["args"][1] = "/models/llama"
    assert "must start with serve " + attach["model"] in _refusal(kubectl, pod(local))
    stray = vllm_container(attach, image, "--seed")
    assert "--seed" in _refusal(kubectl, pod(stray))
    forged = pod(vllm_container(attach, image), labels={LABEL: NAME, NAMESPACE_ID_LABEL: "kvp-" + "0" * 32})
    assert f"must be {env['nsid']}" in _refusal(kubectl, forged)
    assert "no KVCacheNamespace named nobody" in _refusal(kubectl, pod(vllm_container(attach, image), labels={LABEL: "nobody"}))
    # The container named by the annotation, when it is not `vllm`.
    named = pod({**vllm_container(attach, image), "name": "main"})
    assert "no container named vllm" in _refusal(kubectl, named)
    named["metadata"]["annotations"] = {"kvpersist.dev/attach-container": "main"}
    stored, error = dry_run(kubectl, named)
    assert stored is not None, error
    assert stored["spec"]["containers"][0]["args"][-2:] == attach["args"]


def test_what_an_attached_pod_runs_is_judged_for_its_whole_life(kubectl: Kubectl, env: dict) -> None:
    """Issue 57: after admission, an image set on the live pod and an ephemeral container (kubectl
    debug) are refused; an annotation (metadata alone, the controllers' business) is not."""
    ns, attach, image = env["env"].ns, env["attach"], env["obj"]["spec"]["image"]
    kubectl.apply(user_pod(ns, "live-0", vllm_container(attach, image)))
    other = "docker.io/library/busybox@sha256:" + "ab" * 32
    out = kubectl.run("set", "image", "pod/live-0", f"vllm={other}", "-n", ns, check=False)
    assert out.returncode != 0 and "must be pinned by digest to" in out.stderr, out.stdout + out.stderr
    assert kubectl.get("pod", "live-0", ns)["spec"]["containers"][0]["image"] == image
    debug = {"spec": {"ephemeralContainers": [{"name": "debugger", "image": other, "command": ["sh"]}]}}
    out = kubectl.run("patch", "pod", "live-0", "-n", ns, "--subresource=ephemeralcontainers", "--type=strategic",
                      "-p", json.dumps(debug), check=False)
    assert out.returncode != 0 and "ephemeral containers are refused" in out.stderr, out.stdout + out.stderr
    assert not kubectl.get("pod", "live-0", ns)["spec"].get("ephemeralContainers")
    kubectl.run("annotate", "pod", "live-0", "-n", ns, "example.com/note=kept")
    kubectl.run("delete", "pod", "live-0", "-n", ns, "--wait=false")


def test_look_alikes_and_code_behind_the_pins_are_refused(kubectl: Kubectl, env: dict) -> None:
    """Issue 57: a pod that wears this resource's namespace id under another attach label; variables
    that load code or weights behind the pins (a logging config's callables, a seeded model cache)."""
    ns, attach, image = env["env"].ns, env["attach"], env["obj"]["spec"]["image"]
    look_alike = user_pod(ns, "look-alike-0", {"name": "vllm", "image": "busybox", "command": ["sh"]},
                          labels={LABEL: "nobody", NAMESPACE_ID_LABEL: env["nsid"]})
    assert f"is the namespace id of KVCacheNamespace {NAME}, but label {LABEL} names nobody" in _refusal(kubectl, look_alike)
    for name, value in (("VLLM_LOGGING_CONFIG_PATH", "/tmp/logging.json"), ("HF_HUB_CACHE", "/seeded"), ("HF_HOME", "/seeded")):
        c = vllm_container(attach, image)
        c["env"] = [{"name": name, "value": value}]
        assert f"{name} refused" in _refusal(kubectl, user_pod(ns, "behind-0", c))
    # Other containers share the pod's network (a peer of the servers): only images the resource lists.
    sidecar = {"name": "proxy", "image": "docker.io/library/busybox@sha256:" + "cd" * 32, "command": ["sleep", "inf"]}
    meshed = user_pod(ns, "meshed-0", vllm_container(attach, image))
    meshed["spec"]["containers"].append(sidecar)
    assert f"containers other than vllm: proxy ({sidecar['image']}) refused" in _refusal(kubectl, meshed)
    init = user_pod(ns, "init-0", vllm_container(attach, image))
    init["spec"]["initContainers"] = [{**sidecar, "name": "seed", "restartPolicy": "Always"}]  # a native sidecar
    assert "seed (" in _refusal(kubectl, init)
    hooked = vllm_container(attach, image)
    hooked["lifecycle"] = {"postStart": {"exec": {"command": ["sh", "-c", "true"]}}}
    assert "lifecycle is refused" in _refusal(kubectl, user_pod(ns, "hooked-0", hooked))
    kubectl.run("patch", "kvns", NAME, "-n", ns, "--type=merge", "-p",
                json.dumps({"spec": {"vllm": {"attachedContainers": [sidecar["image"]]}}}))
    try:
        wait_for("the pod with the listed sidecar admitted", lambda: dry_run(kubectl, meshed)[0], timeout=30, interval=1,
                 explain=lambda: dry_run(kubectl, meshed)[1])
    finally:
        kubectl.run("patch", "kvns", NAME, "-n", ns, "--type=json", "-p",
                    json.dumps([{"op": "remove", "path": "/spec/vllm/attachedContainers"}]))
    # A pin given twice (the second value would win in vLLM's parser) or a pin pair removed.
    revision = next(p for p in attach["pins"] if p["flag"] == "--revision")["value"]
    twice = vllm_container(attach, image, "--revision", "f" * 40)
    assert "must carry each pin once" in _refusal(kubectl, user_pod(ns, "twice-0", twice))
    removed = vllm_container(attach, image)
    at = removed["args"].index(revision)
    del removed["args"][at - 1:at + 1]
    assert f"--revision {revision} (spec.identity.modelRevision)" in _refusal(kubectl, user_pod(ns, "removed-0", removed))


def test_vllm_serve_as_the_command_is_attached_as_llm_d_writes_it(kubectl: Kubectl, env: dict) -> None:
    """llm-d's modelservice chart writes command ["vllm", "serve"] and the model first in args."""
    ns, attach, image = env["env"].ns, env["attach"], env["obj"]["spec"]["image"]
    c = vllm_container(attach, image)
    c["command"], c["args"] = ["vllm", "serve"], c["args"][1:]
    stored, error = dry_run(kubectl, user_pod(ns, "llm-d-0", c))
    assert stored is not None, error
    assert stored["spec"]["containers"][0]["args"] == [*c["args"], *attach["args"]]
    other = {**c, "args": ["other/model", *c["args"][1:]]}
    assert "must start with serve " + attach["model"] in _refusal(kubectl, user_pod(ns, "llm-d-1", other))


def test_pods_as_kserve_and_llm_d_make_them_are_attached(kubectl: Kubectl, env: dict) -> None:
    """Issue 57: KServe 0.18's pod (main container, its HOME, HF_HUB_CACHE on an emptyDir of its own,
    /dev/shm) and llm-d's decode pod (`vllm serve`, HF_HOME on an emptyDir, the routing proxy as a
    native sidecar, listed by digest) get the connection and nothing of theirs changes."""
    ns, attach, image = env["env"].ns, env["attach"], env["obj"]["spec"]["image"]
    kserve = stack_pod(KSERVE_POD, ns, "kserve-0", attach, image, "--port", "8000")
    stored, error = dry_run(kubectl, kserve)
    assert stored is not None, error
    c = stored["spec"]["containers"][0]
    assert c["args"] == [*kserve["spec"]["containers"][0]["args"], *attach["args"]]
    assert c["env"] == [*kserve["spec"]["containers"][0]["env"], *attach["env"]]
    assert c["securityContext"] == kserve["spec"]["containers"][0]["securityContext"]
    assert not any(v["name"] == "kvpersist-dshm" for v in stored["spec"]["volumes"])  # KServe mounts its own
    llm_d = stack_pod(LLM_D_POD, ns, "llm-d-decode-0", attach, image, "--port", "8200",
                      "--served-model-name", attach["model"])
    assert "routing-proxy (" in _refusal(kubectl, llm_d)  # until the resource lists its image
    kubectl.run("patch", "kvns", NAME, "-n", ns, "--type=merge", "-p",
                json.dumps({"spec": {"vllm": {"attachedContainers": [ROUTING_SIDECAR]}}}))
    try:
        stored = wait_for("llm-d's decode pod admitted", lambda: dry_run(kubectl, llm_d)[0], timeout=30, interval=1,
                          explain=lambda: dry_run(kubectl, llm_d)[1])
        c = stored["spec"]["containers"][0]
        assert c["command"] == ["vllm", "serve"] and c["args"] == [*llm_d["spec"]["containers"][0]["args"], *attach["args"]]
        assert stored["spec"]["initContainers"][0]["image"] == ROUTING_SIDECAR
        assert {"name": "kvpersist-dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]  # the chart mounts none
        # The model cache where another container can write it (the proxy mounting it too), or on a
        # claim (not empty at start), or beside the volume's path, is a seeded cache: refused.
        shared = copy.deepcopy(llm_d)
        shared["spec"]["initContainers"][0]["volumeMounts"] = [{"name": "model-storage", "mountPath": "/seed"}]
        claim = copy.deepcopy(llm_d)
        claim["spec"]["volumes"][1] = {"name": "model-storage", "persistentVolumeClaim": {"claimName": "weights"}}
        elsewhere = copy.deepcopy(llm_d)
        elsewhere["spec"]["containers"][0]["env"][3]["value"] = "/model-cache/sub"
        for pod in (shared, claim, elsewhere):
            assert "HF_HOME refused" in _refusal(kubectl, pod)
    finally:
        kubectl.run("patch", "kvns", NAME, "-n", ns, "--type=json", "-p",
                    json.dumps([{"op": "remove", "path": "/spec/vllm/attachedContainers"}]))


def test_a_managed_resource_takes_no_attached_pod(kubectl: Kubectl, env: dict) -> None:
    ns = env["env"].ns
    managed = manifest(ns)
    managed["metadata"]["name"] = "managed"
    kubectl.apply(managed)
    pod = user_pod(ns, "to-managed-0", vllm_container(env["attach"], env["obj"]["spec"]["image"]), labels={LABEL: "managed"})
    error = _refusal(kubectl, pod)
    # The API server names the first refusal of the params it judged, in its order: either says why.
    assert "runs its own vLLM (spec.vllm.mode Managed)" in error or "named managed with spec.vllm.mode Attached" in error
    error = kubectl.run("patch", "kvns", "managed", "-n", ns, "--type=merge", "-p", '{"spec":{"vllm":{"mode":"Attached"}}}',
                        check=False).stderr
    assert "vllm.mode is fixed at creation" in error
    kubectl.run("delete", "kvns", "managed", "-n", ns, "--wait=false")


def test_with_the_cache_bypassed_new_pods_are_admitted_without_the_connection(kubectl: Kubectl, env: dict,
                                                                            namespace: str) -> None:
    """status.attach.bypassed (the operator sets it while a HitMismatch stands or its servers are away
    too long: tests/unit/test_attach.py): no connection added or required, the pins still checked. In
    a namespace no operator watches, the status is written here, a STAND-IN for the operator's write,
    so that nothing rewrites it during the check."""
    obj = attached_manifest(namespace)
    kubectl.apply(obj)
    attach = {**env["attach"], "bypassed": "a cache hit changed the canary's answer (HitMismatch 0123456789ab)"}
    kubectl.run("patch", "kvns", NAME, "-n", namespace, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": {"attach": attach}}))
    container = vllm_container(attach, obj["spec"]["image"])
    stored, error = dry_run(kubectl, user_pod(namespace, "bypassed-0", container))
    assert stored is not None, error
    c = stored["spec"]["containers"][0]
    assert c["args"] == container["args"] and "env" not in c and "affinity" not in stored["spec"]
    assert stored["metadata"]["labels"][NAMESPACE_ID_LABEL] == attach["namespaceId"]
    other = vllm_container(attach, obj["spec"]["image"])
    other["args"][other["args"].index("--revision") + 1] = "f" * 40
    assert "(spec.identity.modelRevision)" in _refusal(kubectl, user_pod(namespace, "bypassed-1", other))
    # Its own connection to the servers, while the cache is off: refused like any unknown flag.
    own = vllm_container(attach, obj["spec"]["image"], *env["attach"]["args"])
    assert "--kv-transfer-config refused" in _refusal(kubectl, user_pod(namespace, "bypassed-2", own))


def test_pods_labelled_while_the_policies_are_missing_are_named_in_status(kubectl: Kubectl, env: dict) -> None:
    """Without the policies (the chart's attach.enabled false, a cluster before 1.36) the API server
    admits a labelled pod as written: no connection, no cache. Status names it."""
    ns, attach = env["env"].ns, env["attach"]
    kubectl.run("delete", "mutatingadmissionpolicybinding,validatingadmissionpolicybinding", "kvpersist-attach")
    try:
        def admitted_as_written() -> bool:
            stored, _ = dry_run(kubectl, user_pod(ns, "unpoliced-0", vllm_container(attach, env["obj"]["spec"]["image"])))
            return stored is not None and NAMESPACE_ID_LABEL not in stored["metadata"]["labels"]

        wait_for("the API server to drop the bindings", admitted_as_written, timeout=60, interval=1)
        kubectl.apply(user_pod(ns, "unpoliced-0", vllm_container(attach, env["obj"]["spec"]["image"])))

        def named() -> dict | None:
            st = kubectl.get("kvns", NAME, ns).get("status") or {}
            vllm = next((c for c in st.get("conditions") or [] if c["type"] == "VLLMReady"), {})
            return vllm if vllm.get("reason") == "AttachPoliciesMissing" else None

        vllm = wait_for("VLLMReady AttachPoliciesMissing", named, timeout=120)
        assert vllm["status"] == "False" and "unpoliced-0" in vllm["message"]
    finally:
        kubectl.run("apply", "--server-side", "--force-conflicts", "-f", str(ATTACH_POLICY))
        kubectl.run("delete", "pod", "unpoliced-0", "-n", ns, "--wait=false", check=False)
