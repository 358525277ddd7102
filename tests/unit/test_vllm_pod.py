"""spec.vllm's pod fields (env, envFrom, hfTokenSecretRef, apiKeySecretRef, modelCache, service)
and spec.imagePullSecrets, through the pure builders: what the pods and the Service become, that
no Secret is ever a literal, that none of them reaches the namespace id, and that the env names
the operator owns or that change the KV are refused naming the field. The API server's side is
tests/cases/invalid_manifests.py (tests/e2e/test_api.py) and tests/e2e/test_vllm_pod.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from kvpersist.api import celrules
from kvpersist.api.spec import ENV_REFUSED, ENV_RULE, MODEL_CACHE_PATH, PYTHON_ENV_ALLOWED, VLLM_ENV_ALLOWED, env_name_rule
from kvpersist.api.v1alpha1 import KVCacheNamespace, validation_message
from kvpersist.builders.all import build_all
from kvpersist.builders.lmcache import build_lmcache_statefulset
from kvpersist.builders.target import Target
from kvpersist.builders.vllm import ENV_FROM_ALLOWED, ENV_FROM_PREFIX, build_vllm_deployment, build_vllm_service
from kvpersist.identity import key_fingerprint, resolve
from tests.cases.invalid_manifests import sample

FINGERPRINT = key_fingerprint(b"k" * 32)


def _vllm(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda obj: obj["spec"]["vllm"].update(fields)


def _pull(obj: dict[str, Any]) -> None:
    obj["spec"]["imagePullSecrets"] = [{"name": "regcred"}, {"name": "mirror-cred"}]


FIELDS: dict[str, Callable[[dict[str, Any]], None]] = {
    "env": _vllm(env=[{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}, {"name": "HF_HUB_OFFLINE", "value": "1"}]),
    "envFrom": _vllm(envFrom=[{"secretRef": {"name": "vllm-secrets"}}, {"configMapRef": {"name": "vllm-conf"}}]),
    "hfTokenSecretRef": _vllm(hfTokenSecretRef={"name": "hf-reader", "key": "token"}),
    "apiKeySecretRef": _vllm(apiKeySecretRef={"name": "vllm-api", "key": "key"}),
    "modelCache": _vllm(modelCache={"existingClaimName": "qwen-weights"}),
    "modelCache.size": _vllm(modelCache={"size": "200Gi", "storageClassName": "fast-rwx",
                                         "accessModes": ["ReadWriteMany"]}),
    "service": _vllm(service={"enabled": True, "type": "LoadBalancer", "port": 80}),
    "imagePullSecrets": _pull,
}


def _target(*mutations: Callable[[dict[str, Any]], None], name: str = "nvme-minimal") -> Target:
    obj = sample(name)
    for m in mutations:
        m(obj)
    spec = KVCacheNamespace.model_validate(obj).spec
    return Target(obj["metadata"]["name"], "ml", spec, resolve(spec.pins(FINGERPRINT)).namespace_id)


def _container(t: Target) -> dict[str, Any]:
    [container] = build_vllm_deployment(t)["spec"]["template"]["spec"]["containers"]
    return container


def _env(t: Target) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in _container(t)["env"]}


@pytest.mark.parametrize("field", FIELDS)
def test_no_field_reaches_the_namespace_id(field: str) -> None:
    """None of them changes the KV bytes (where the weights are cached, who may call vLLM, which
    registry the images come from): the namespace id is the same with and without each, all at once too."""
    plain = _target()
    assert plain.namespace_id is not None
    assert _target(FIELDS[field]).namespace_id == plain.namespace_id
    assert _target(*FIELDS.values()).namespace_id == plain.namespace_id  # (modelCache.size replaces modelCache)


def test_env_and_env_from_reach_the_vllm_container_after_the_operators_own() -> None:
    t = _target(FIELDS["env"], FIELDS["envFrom"])
    container = _container(t)
    names = [e["name"] for e in container["env"]]
    assert names[:3] == ["HOME", "PYTHONHASHSEED", "VLLM_ENABLE_V1_MULTIPROCESSING"]
    assert {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"} in container["env"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
    # Under a prefix the loader, Python and the runtime never read: the start script sets the allowed keys.
    assert container["envFrom"] == [{"prefix": ENV_FROM_PREFIX, "secretRef": {"name": "vllm-secrets"}},
                                    {"prefix": ENV_FROM_PREFIX, "configMapRef": {"name": "vllm-conf"}}]
    # Without envFrom the container's command is vLLM's own, as before.
    assert "envFrom" not in _container(_target(FIELDS["env"]))
    assert _container(_target(FIELDS["env"], lambda o: o["spec"]["identity"].pop("connectorBuild")))["command"] == ["vllm"]


def test_the_tokens_come_from_their_secrets_and_nowhere_else() -> None:
    """HF_TOKEN and VLLM_API_KEY by secretKeyRef only: no literal in args, env values or any manifest."""
    t = _target(FIELDS["hfTokenSecretRef"], FIELDS["apiKeySecretRef"])
    env = _env(t)
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-reader", "key": "token"}}}
    assert env["VLLM_API_KEY"] == {"name": "VLLM_API_KEY",
                                   "valueFrom": {"secretKeyRef": {"name": "vllm-api", "key": "key"}}}
    # No flag for either (vLLM's --api-key would put the key in the pod's args): the same line as without them.
    assert _container(t)["args"] == _container(_target())["args"]
    assert not any(a.startswith("--api-key") for a in _container(t)["args"])
    # The Secrets are named in the Deployment's secretKeyRefs only: no other manifest (the ConfigMap) carries them.
    for m in build_all(t):
        if m["kind"] != "Deployment":
            assert "hf-reader" not in json.dumps(m) and "vllm-api" not in json.dumps(m), m["kind"]
    assert "HF_TOKEN" not in _env(_target()) and "VLLM_API_KEY" not in _env(_target())


def test_model_cache_mounts_the_users_claim_at_hf_home() -> None:
    t = _target(FIELDS["modelCache"])
    pod = build_vllm_deployment(t)["spec"]["template"]["spec"]
    [claim] = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claim["persistentVolumeClaim"] == {"claimName": "qwen-weights"}
    mounts = {m["name"]: m for m in _container(t)["volumeMounts"]}
    assert mounts[claim["name"]]["mountPath"] == MODEL_CACHE_PATH and not mounts[claim["name"]].get("readOnly")
    assert _env(t)["HF_HOME"] == {"name": "HF_HOME", "value": MODEL_CACHE_PATH}
    # The operator makes no claim for it, so it can never delete one: no PersistentVolumeClaim among its manifests.
    assert not [m for m in build_all(t) if m["kind"] == "PersistentVolumeClaim"]
    # Without one, the same path on an emptyDir: with HF_HUB_OFFLINE lmcache keys chunks by the model's
    # local path, so turning modelCache on or off must not move it (every stored chunk would miss).
    plain = build_vllm_deployment(_target())["spec"]["template"]["spec"]
    assert _env(_target())["HF_HOME"] == {"name": "HF_HOME", "value": MODEL_CACHE_PATH}
    assert {"name": "model-cache", "emptyDir": {}} in plain["volumes"]
    assert {"name": "model-cache", "mountPath": MODEL_CACHE_PATH} in plain["containers"][0]["volumeMounts"]


def test_model_cache_size_makes_an_owned_claim_the_vllm_pods_mount() -> None:
    """spec.vllm.modelCache.size: PersistentVolumeClaim <name>-model-cache among the manifests (so
    the apply looks its name up: a user's claim there is NameTaken, never mounted), before the
    Deployment that mounts it, with the declared size, class and access modes, the operator's
    labels and no namespace id (the weights serve every id); nothing else changes."""
    t = _target(FIELDS["modelCache.size"])
    manifests = build_all(t)
    [claim] = [m for m in manifests if m["kind"] == "PersistentVolumeClaim"]
    name = f"{t.name}-model-cache"
    assert claim["metadata"]["name"] == name and claim["metadata"]["namespace"] == "ml"
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "200Gi"}},
                             "storageClassName": "fast-rwx"}
    labels = claim["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "kvpersist" and labels["app.kubernetes.io/instance"] == t.name
    assert labels["app.kubernetes.io/managed-by"] == "kvpersist" and "kvpersist.dev/namespace-id" not in labels
    assert labels["app.kubernetes.io/component"] not in ("lmcache-server", "vllm")  # not an L2 claim, no pod selector
    kinds = [m["kind"] for m in manifests]
    assert kinds.index("PersistentVolumeClaim") < kinds.index("Deployment")
    pod = build_vllm_deployment(t)["spec"]["template"]["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": name}} in pod["volumes"]
    assert _env(t)["HF_HOME"] == {"name": "HF_HOME", "value": MODEL_CACHE_PATH}
    # The defaults: ReadWriteOnce, the cluster's default class (no storageClassName).
    [plain_claim] = [m for m in build_all(_target(_vllm(modelCache={"size": 100}))) if m["kind"] == "PersistentVolumeClaim"]
    assert plain_claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "100"}}}
    # The other manifests are those of the same resource with the user's claim instead, but for the
    # pod's fsGroup: the non-root vLLM writes the claim the operator made through its group, and a
    # user's claim is never re-owned.
    users = build_all(_target(_vllm(modelCache={"existingClaimName": name})))
    assert pod["securityContext"]["fsGroup"] == 2000
    for m in manifests:
        if m["kind"] == "Deployment":
            m["spec"]["template"]["spec"]["securityContext"].pop("fsGroup")
            m["spec"]["template"]["spec"]["securityContext"].pop("fsGroupChangePolicy")
    assert [m for m in manifests if m is not claim] == users


def test_model_cache_claim_differences_name_the_field() -> None:
    """The claim is made once and never patched: what the spec declares and the existing claim lacks
    is named by field (the Warning event's text); equal quantities in other spellings are no difference."""
    from kvpersist.builders.vllm import build_model_cache_claim, claim_differences

    claim = build_model_cache_claim(_target(FIELDS["modelCache.size"]))
    assert claim is not None
    same = {"spec": {**claim["spec"], "resources": {"requests": {"storage": str(200 * 2**30)}}, "volumeName": "pv-1"}}
    assert claim_differences(claim, same) == []
    other = {"spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "100Gi"}},
                      "storageClassName": "standard"}}
    assert claim_differences(claim, other) == [
        "spec.vllm.modelCache.size is 200Gi, the claim's 100Gi",
        "spec.vllm.modelCache.storageClassName is fast-rwx, the claim's standard",
        "spec.vllm.modelCache.accessModes is ['ReadWriteMany'], the claim's ['ReadWriteOnce']"]
    # No class declared: the one the API server defaulted on the claim is no difference.
    unset = build_model_cache_claim(_target(_vllm(modelCache={"size": "100Gi"})))
    assert unset is not None and claim_differences(unset, other) == []


@pytest.mark.parametrize("cache, field", [
    ({}, "spec.vllm.modelCache"),
    ({"size": "1Gi", "existingClaimName": "w"}, "spec.vllm.modelCache"),
    ({"existingClaimName": "w", "storageClassName": "fast"}, "spec.vllm.modelCache.storageClassName"),
    ({"existingClaimName": "w", "accessModes": ["ReadWriteMany"]}, "spec.vllm.modelCache.accessModes"),
    ({"size": "1Gi", "accessModes": []}, "spec.vllm.modelCache.accessModes"),
    ({"size": "1 Gi"}, "spec.vllm.modelCache.size"),
])
def test_model_cache_takes_exactly_one_claim_naming_the_field(cache: dict[str, Any], field: str) -> None:
    obj = sample()
    obj["spec"]["vllm"]["modelCache"] = cache
    with pytest.raises(ValidationError) as info:
        KVCacheNamespace.model_validate(obj)
    message = validation_message(info.value)
    assert field in message, message
    if field == "spec.vllm.modelCache":
        assert "size" in message and "existingClaimName" in message, message


def test_image_pull_secrets_on_every_pod_the_operator_makes() -> None:
    """vLLM's pods and the lmcache servers' (whose inventory agent is the operator's image, pulled in
    the user's namespace); no pod without them when none are named."""
    t = _target(FIELDS["imagePullSecrets"])
    want = [{"name": "regcred"}, {"name": "mirror-cred"}]
    pods = [m["spec"]["template"]["spec"] for m in build_all(t) if m["kind"] in ("Deployment", "StatefulSet")]
    assert len(pods) == 2 and all(p["imagePullSecrets"] == want for p in pods)
    assert {c["name"] for c in build_lmcache_statefulset(t)["spec"]["template"]["spec"]["containers"]} == {
        "lmcache-server", "inventory-agent"}
    plain = _target()
    assert not any("imagePullSecrets" in m["spec"]["template"]["spec"] for m in build_all(plain)
                   if m["kind"] in ("Deployment", "StatefulSet"))


def test_the_vllm_service_selects_only_this_resources_vllm_pods() -> None:
    t = _target(FIELDS["service"])
    svc = build_vllm_service(t)
    assert svc is not None and svc in build_all(t)
    assert svc["metadata"]["name"] == f"{t.name}-vllm"
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    deployment = build_vllm_deployment(t)
    # Its selector is the Deployment's own: this resource's vLLM pods, of every namespace id, and no server.
    assert svc["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["selector"]["app.kubernetes.io/instance"] == t.name
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "vllm"
    plain = _target()
    assert build_vllm_service(plain) is None
    # Disabled (the default), the other manifests are the same as with it: only the Service is added.
    assert [m for m in build_all(t) if m != svc] == build_all(plain)


@pytest.mark.parametrize("name", ["PYTHONHASHSEED", "VLLM_ENABLE_V1_MULTIPROCESSING", "LMCACHE_CHUNK_SIZE",
                                  "KVPERSIST_BUILD_CHECK", "VLLM_ATTENTION_BACKEND", "VLLM_USE_MODELSCOPE",
                                  "CUDA_VISIBLE_DEVICES", "HF_TOKEN", "VLLM_API_KEY", "HF_HOME", "HF_ENDPOINT",
                                  "PYTHONPATH", "LD_PRELOAD", "LD_AUDIT", "LD_BIND_NOT", "PYTHONWARNINGS",
                                  "PYTHONBREAKPOINT", "PYTHONUSERBASE", "PYTHON_GIL", "PYTHONUTF8", "GCONV_PATH",
                                  "VLLM_LOGGING_CONFIG_PATH"])
def test_refused_env_names_are_refused_naming_the_field(name: str) -> None:
    obj = sample()
    obj["spec"]["vllm"]["env"] = [{"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}, {"name": name, "value": "1"}]
    with pytest.raises(ValidationError) as info:
        KVCacheNamespace.model_validate(obj)
    message = validation_message(info.value)
    # The CRD's rule refuses it, with the CRD's message.
    assert message == f"spec: spec.vllm.env[1].name: {ENV_RULE}", message


def test_the_operators_own_env_names_are_all_refused() -> None:
    """Whatever the builders set on the vLLM container, with every field on, the API refuses in env:
    a user's value could not silently replace the operator's (Kubernetes takes the last of a name)."""
    t = _target(*FIELDS.values())
    user = {e.name for e in t.spec.vllm.env}
    owned = [name for name in _env(t) if name not in user]
    assert {"PYTHONHASHSEED", "HF_TOKEN", "VLLM_API_KEY", "HF_HOME", "KVPERSIST_BUILD_CHECK"} <= set(owned)
    for name in owned:
        assert not celrules.holds(env_name_rule(), name), name
    for name in (*VLLM_ENV_ALLOWED, *PYTHON_ENV_ALLOWED, "HF_HUB_OFFLINE", "MY_SETTING", "LDAP_URI", "PYTHO"):
        assert celrules.holds(env_name_rule(), name), name


# What an image sets itself (a CUDA image: its libraries, every GPU for the runtime; a Python image's path).
IMAGE_ENV = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": "/usr/local/cuda/lib64", "NVIDIA_VISIBLE_DEVICES": "all",
             "PYTHONPATH": "/image/lib"}
# Shows the environment it got, as JSON: the stand-in for vLLM, a Python program like it.
SHOW_ENV = "import json, os; print(json.dumps(dict(os.environ)))"


def _kubelet_env(container: dict[str, Any], sources: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: the image's, then each envFrom source's
    keys under the entry's own prefix, then `env` (a valueFrom read as "from-secret")."""
    env = dict(IMAGE_ENV)
    for entry in container.get("envFrom", []):
        ref = entry.get("secretRef") or entry["configMapRef"]
        env.update({entry.get("prefix", "") + k: v for k, v in sources[ref["name"]].items()})
    env.update({e["name"]: e.get("value", "from-secret") for e in container["env"]})
    return env


def _start(container: dict[str, Any], env: dict[str, str]) -> tuple[dict[str, str], str]:
    """Runs the container's start script with sh, Python printing its environment in vLLM's place;
    the build check is left out (its own tests). Returns that environment and the stderr."""
    command = container["command"]
    assert command[:2] == ["sh", "-c"] and "$(" not in command[2]  # the kubelet would expand $(...)
    script = command[2].replace('python3 -c "$KVPERSIST_BUILD_CHECK" && ', "")
    out = subprocess.run(["/bin/sh", "-c", script, sys.executable, "-c", SHOW_ENV], env=env, capture_output=True,
                         timeout=60, check=True, text=True)
    return json.loads(out.stdout), out.stderr


def test_refused_names_that_come_through_env_from_never_reach_vllm_nor_the_loader_nor_python() -> None:
    """envFrom's keys are not known at apply time. A library LD_AUDIT or LD_PRELOAD names would be
    loaded by the loader into the start script's own shell, and a module a PYTHONWARNINGS category
    names imported by Python, before any unset could run: so each key comes in under a prefix and the
    start script sets only the names the API allows, saying on stderr which it left out. The loader
    and Python say when they see them (a missing library, an unknown module): neither does here.
    The image's own variables, the container's env (which wins) and the allowed keys are as they were."""
    t = _target(FIELDS["env"], FIELDS["envFrom"], FIELDS["hfTokenSecretRef"], FIELDS["modelCache"])
    container = _container(t)
    refused = {"LD_AUDIT": "/nonexistent/audit.so", "LD_PRELOAD": "/nonexistent/preload.so",
               "LD_LIBRARY_PATH": "/attacker/lib", "PYTHONWARNINGS": "error::nonexistent_module.Warning",
               "PYTHONPATH": "/attacker/py", "PYTHONSTARTUP": "/attacker/startup.py", "PYTHONBREAKPOINT": "evil.hook",
               "GCONV_PATH": "/attacker/gconv", "NVIDIA_VISIBLE_DEVICES": "0,1,2,3", "PATH": "/attacker/bin",
               "LMCACHE_CHUNK_SIZE": "16", "VLLM_ATTENTION_BACKEND": "TRITON_ATTN", "CUDA_VISIBLE_DEVICES": "3",
               "HF_ENDPOINT": "https://mirror.example", "KVPERSIST_X": "1"}
    kept = {"VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1", "HUGGING_FACE_HUB_TOKEN": "hf_x",
            "MY_SETTING": "a\nKVPERSIST_ENVFROM_LD_AUDIT=/x\nLD_AUDIT=/y"}
    overridden = {"VLLM_LOGGING_LEVEL": "INFO", "HF_TOKEN": "hf_literal", "PYTHONHASHSEED": "7", "HF_HUB_OFFLINE": "0"}
    env = _kubelet_env(container, {"vllm-secrets": {**refused, **overridden}, "vllm-conf": kept})
    seen, stderr = _start(container, env)
    assert "ld.so" not in stderr and "nonexistent_module" not in stderr, stderr
    for name in refused:
        assert f"kvpersist: {name} from spec.vllm.envFrom is a refused name" in stderr, name
        assert seen.get(name) == IMAGE_ENV.get(name), name
    for name, value in kept.items():
        assert seen[name] == value, name
    for e in container["env"]:
        assert seen[e["name"]] == e.get("value", "from-secret"), e["name"]
    assert not [n for n in seen if n.startswith(ENV_FROM_PREFIX)]
    assert set(ENV_FROM_ALLOWED) <= set(ENV_REFUSED)
    # The same keys with the envFrom entries as they were before (no prefix): the loader and Python see them.
    bare = {**container, "envFrom": [{k: v for k, v in e.items() if k != "prefix"} for e in container["envFrom"]]}
    out = subprocess.run([sys.executable, "-c", SHOW_ENV], capture_output=True, text=True, timeout=60,
                         env=_kubelet_env(bare, {"vllm-secrets": refused, "vllm-conf": {}}))
    assert "ld.so" in out.stderr and "nonexistent_module" in out.stderr, out.stderr


def test_a_deleted_model_cache_claim_is_applied_again() -> None:
    """No drift watch on claims (L2's change status all the time): the status refresh sees the
    operator's weights claim gone from the claims' watch cache and marks the resource for an apply,
    which makes it again. A user's claim (existingClaimName), or none, is never looked for."""
    from kvpersist.controller.retention import made_claim_missing
    from kvpersist.status.workloads import Seen

    t = _target(FIELDS["modelCache.size"])
    entry = {"metadata": {"name": f"{t.name}-model-cache", "labels": {}}, "status": {"phase": "Bound"}}
    l2 = {"metadata": {"name": f"l2-{t.name}-lmcache-0", "labels": {}}, "status": {}}
    assert made_claim_missing(t, Seen(claims=[l2]))
    assert not made_claim_missing(t, Seen(claims=[l2, entry]))
    assert not made_claim_missing(_target(FIELDS["modelCache"]), Seen())
    assert not made_claim_missing(_target(), Seen())
