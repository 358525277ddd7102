"""spec.vllm's pod fields and spec.imagePullSecrets on the real API server, with the operator
running: one resource with all of them becomes a vLLM Deployment whose pods (made by the real
controller-manager; kwok runs no containers, so the pod specs are what is checked) carry the env,
the envFrom, the two tokens by secretKeyRef, the model cache claim at HF_HOME and the pull
Secrets; the lmcache servers' pod template carries the pull Secrets too; and the vLLM Service
selects exactly this resource's vLLM pods, not another resource's nor a server. The claim the
operator makes for the weights (spec.vllm.modelCache.size) is owned, mounted, kept as made, and
never made over a user's claim of its name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cases.invalid_manifests import sample
from tests.e2e.kube import Kubectl, wait_for

pytestmark = pytest.mark.e2e
MODEL_CACHE_PATH = "/var/lib/kvpersist/hf"  # HF_HOME, as docs/api.md gives it


def _resource(ns: str, name: str, **vllm: object) -> dict:
    obj = sample()
    obj["metadata"].update(name=name, namespace=ns)
    obj["spec"]["vllm"].update(vllm)
    return obj


def test_a_resource_with_every_pod_field_becomes_pods_and_a_service(kubectl: Kubectl, namespace: str,
                                                                     operator: Path) -> None:
    ns = namespace
    obj = _resource(ns, "gated", replicas=2, env=[{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
                    envFrom=[{"secretRef": {"name": "vllm-env"}}, {"configMapRef": {"name": "vllm-conf"}}],
                    hfTokenSecretRef={"name": "hf-reader"}, apiKeySecretRef={"name": "vllm-api"},
                    modelCache={"existingClaimName": "weights"}, service={"enabled": True, "port": 80})
    obj["spec"]["imagePullSecrets"] = [{"name": "regcred"}]
    kubectl.apply(obj)
    kubectl.apply(_resource(ns, "other"))  # another resource's vLLM pod: never behind gated's Service

    def vllm_pods(instance: str) -> list[dict] | None:
        pods = [p for p in kubectl.get("pods", namespace=ns)["items"]
                if p["metadata"]["labels"].get("app.kubernetes.io/instance") == instance
                and p["metadata"]["labels"].get("app.kubernetes.io/component") == "vllm"]
        return pods if len(pods) == (2 if instance == "gated" else 1) else None

    log = lambda: "--- operator log:\n" + operator.read_text()[-3000:]  # noqa: E731
    pods = wait_for("gated's two vLLM pods", lambda: vllm_pods("gated"), timeout=180, explain=log)
    wait_for("other's vLLM pod", lambda: vllm_pods("other"), timeout=180, explain=log)
    for pod in pods:
        spec = pod["spec"]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        [container] = spec["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["VLLM_LOGGING_LEVEL"]["value"] == "DEBUG"
        assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-reader", "key": "token"}}
        assert env["VLLM_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "vllm-api", "key": "api-key"}}
        assert env["HF_HOME"]["value"] == MODEL_CACHE_PATH
        assert not any("valueFrom" not in e and e["name"] in ("HF_TOKEN", "VLLM_API_KEY") for e in container["env"])
        assert container["envFrom"] == [{"prefix": "KVPERSIST_ENVFROM_", "secretRef": {"name": "vllm-env"}},
                                        {"prefix": "KVPERSIST_ENVFROM_", "configMapRef": {"name": "vllm-conf"}}]
        assert not any(a.startswith("--api-key") for a in container.get("args", []))
        [cache] = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
        assert cache["persistentVolumeClaim"]["claimName"] == "weights"
        assert {"name": cache["name"], "mountPath": MODEL_CACHE_PATH} in [
            {k: m[k] for k in ("name", "mountPath")} for m in container["volumeMounts"]]
    sts = kubectl.get("statefulset", "gated-lmcache", ns)
    assert sts["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert "imagePullSecrets" not in kubectl.get("statefulset", "other-lmcache", ns)["spec"]["template"]["spec"]

    wait_for("gated's vLLM Service", lambda: kubectl.run("get", "service", "gated-vllm", "-n", ns, "-o", "name",
                                                         check=False).returncode == 0, timeout=60, explain=log)
    svc = kubectl.get("service", "gated-vllm", ns)
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["ports"][0]["port"] == 80 and svc["spec"]["ports"][0]["targetPort"] == "http"
    assert svc["metadata"]["ownerReferences"][0]["name"] == "gated"
    selector = ",".join(f"{k}={v}" for k, v in svc["spec"]["selector"].items())
    selected = kubectl.run("get", "pods", "-n", ns, "-l", selector, "-o", "name").stdout.split()
    assert sorted(selected) == sorted(f"pod/{p['metadata']['name']}" for p in pods)
    # Off by default: the other resource has none.
    assert kubectl.run("get", "service", "other-vllm", "-n", ns, check=False).returncode != 0
    # Turned off, it goes (the operator's own), and the pods stay.
    kubectl.run("patch", "kvns", "gated", "-n", ns, "--type=merge", "-p", '{"spec":{"vllm":{"service":{"enabled":false}}}}')
    wait_for("gated's vLLM Service to go", lambda: kubectl.run("get", "service", "gated-vllm", "-n", ns,
                                                               check=False).returncode != 0, timeout=60, explain=log)


def test_the_api_server_refuses_env_names_the_operator_owns_or_that_change_the_kv(kubectl: Kubectl, crd: None,
                                                                                  namespace: str) -> None:
    """The CRD's own rule (not an unknown-field error): the refusal names the entry's name field and
    the rule, and an allowed name next to it passes."""
    for name in ("PYTHONHASHSEED", "LMCACHE_CHUNK_SIZE", "VLLM_ATTENTION_BACKEND", "CUDA_VISIBLE_DEVICES", "HF_TOKEN"):
        obj = _resource(namespace, "refused", env=[{"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}, {"name": name, "value": "1"}])
        out = kubectl.apply(obj, check=False)
        assert out.returncode != 0 and "spec.vllm.env[1].name" in out.stderr and "env names refused" in out.stderr, (
            name, out.stderr)
    assert kubectl.apply(_resource(namespace, "allowed", env=[{"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}]),
                         check=False).returncode == 0


def test_model_cache_size_makes_an_owned_claim_and_never_takes_a_users(kubectl: Kubectl, namespace: str,
                                                                       operator: Path) -> None:
    """spec.vllm.modelCache.size: the operator creates `<name>-model-cache` with the declared size,
    owned by the resource (the garbage collector deletes it with it), and the vLLM pods mount it at
    HF_HOME; a later size change is not applied to the claim, a Warning event ModelCacheDiffers
    names the field. A user's claim already under that name is never taken over: NameTaken."""
    ns = namespace
    log = lambda: "--- operator log:\n" + operator.read_text()[-3000:]  # noqa: E731
    # The user's claim under the name the second resource's would have: made before it.
    kubectl.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                   "metadata": {"name": "taken-model-cache", "namespace": ns},
                   "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "none",
                            "resources": {"requests": {"storage": "1Gi"}}}})
    kubectl.apply(_resource(ns, "made", modelCache={"size": "2Gi", "storageClassName": "none"}))
    kubectl.apply(_resource(ns, "taken", modelCache={"size": "2Gi"}))

    def claim() -> dict | None:
        out = kubectl.run("get", "pvc", "made-model-cache", "-n", ns, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    made = wait_for("made's model-cache claim", claim, timeout=120, explain=log)
    uid = kubectl.get("kvns", "made", ns)["metadata"]["uid"]
    [ref] = made["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("KVCacheNamespace", "made", uid, True)
    assert made["spec"]["resources"]["requests"]["storage"] == "2Gi" and made["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert made["spec"]["storageClassName"] == "none"
    assert made["metadata"]["labels"]["app.kubernetes.io/instance"] == "made"

    def volumes() -> list | None:
        out = kubectl.run("get", "deployment", "made-vllm", "-n", ns, "-o", "json", check=False)
        return json.loads(out.stdout)["spec"]["template"]["spec"]["volumes"] if out.returncode == 0 else None

    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "made-model-cache"}} in wait_for(
        "made's vLLM Deployment", volumes, timeout=60, explain=log)

    def ready_reason(name: str) -> str | None:
        conds = (kubectl.get("kvns", name, ns).get("status") or {}).get("conditions") or []
        return next((c["reason"] + ": " + c["message"] for c in conds if c["type"] == "Ready"), None)

    taken = wait_for("taken's NameTaken", lambda: (r := ready_reason("taken")) and r.startswith("NameTaken") and r,
                     timeout=60, explain=log)
    assert "taken-model-cache" in taken, taken
    assert "ownerReferences" not in kubectl.get("pvc", "taken-model-cache", ns)["metadata"]
    assert kubectl.run("get", "deployment", "taken-vllm", "-n", ns, check=False).returncode != 0  # nothing applied

    kubectl.run("patch", "kvns", "made", "-n", ns, "--type=merge", "-p", '{"spec":{"vllm":{"modelCache":{"size":"3Gi"}}}}')

    def differs() -> str | None:
        events = kubectl.get("events", namespace=ns)["items"]
        return next((e["message"] for e in events if e.get("reason") == "ModelCacheDiffers"
                     and e["involvedObject"]["name"] == "made"), None)

    message = wait_for("a ModelCacheDiffers event", differs, timeout=60, explain=log)
    assert "spec.vllm.modelCache.size is 3Gi, the claim's 2Gi" in message, message
    assert claim()["spec"]["resources"]["requests"]["storage"] == "2Gi"  # kept as it was made
