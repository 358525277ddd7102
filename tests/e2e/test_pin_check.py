"""The operator's pin check on a real API server: a declared pin the model's files contradict
turns the cache off, with PinsVerified and IdentityResolved naming the field, both values and the
fix, and a Warning event; the right pin brings the cache back.

The Hub is tests/integration/hub_stub.py (a stand-in for the Hub's resolve route, serving the
files the test gives it; no Hugging Face endpoint is reachable here), given as HF_ENDPOINT."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import pytest

from tests.cases.invalid_manifests import sample
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import start_operator, stop
from tests.integration.hub_stub import HubStub

pytestmark = pytest.mark.e2e
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _cond(k: Kubectl, ns: str, name: str, type_: str) -> dict | None:
    status = k.get("kvns", name, ns).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


def test_a_pin_the_files_contradict_turns_the_cache_off_naming_the_field(kubectl: Kubectl, crd: None,
                                                                          tmp_path: Path) -> None:
    ns = f"e2e-{uuid.uuid4().hex[:8]}"
    kubectl.run("create", "namespace", ns)
    obj = sample("nvme-minimal")
    obj["metadata"]["namespace"] = ns
    name, ident = obj["metadata"]["name"], obj["spec"]["identity"]
    with HubStub() as hub:
        hub.models[(ident["modelId"], ident["modelRevision"])] = {
            "config.json": json.dumps({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                                       "head_dim": 128, "max_position_embeddings": 131072}).encode(),
            "tokenizer_config.json": json.dumps({"chat_template": TEMPLATE}).encode()}
        operator = start_operator(kubectl.kubeconfig, ns, tmp_path / "operator.log", {"HF_ENDPOINT": hub.url})
        try:
            kubectl.apply(obj)  # the sample's digest is made up: not the template's
            cond = wait_for("PinsVerified PinMismatch", lambda: (lambda c: c if c and c["reason"] == "PinMismatch" else None)(
                _cond(kubectl, ns, name, "PinsVerified")), timeout=120)
            digest = "sha256:" + hashlib.sha256(TEMPLATE.encode()).hexdigest()
            assert cond["status"] == "False"
            assert f"spec.identity.chatTemplateDigest is {ident['chatTemplateDigest']}" in cond["message"]
            tokenizer = f"{ident.get('tokenizer', ident['modelId'])}@{ident.get('tokenizerRevision', ident['modelRevision'])}"
            assert f"tokenizer_config.json at {tokenizer} gives {digest}" in cond["message"]
            assert "kvpersist pins" in cond["message"]
            status = wait_for("the cache off", lambda: (lambda s: s if s.get("phase") == "CacheDisabled" else None)(
                kubectl.get("kvns", name, ns).get("status") or {}), timeout=120)
            assert status.get("namespaceId") is None
            assert _cond(kubectl, ns, name, "IdentityResolved")["reason"] == "PinMismatch"
            events = kubectl.get("events", namespace=ns)["items"]
            assert any(e["reason"] == "PinMismatch" and "chatTemplateDigest" in e["message"] for e in events)

            kubectl.run("patch", "kvns", name, "-n", ns, "--type", "merge", "-p",
                        json.dumps({"spec": {"identity": {"chatTemplateDigest": digest}}}))
            cond = wait_for("PinsVerified PinsMatch", lambda: (lambda c: c if c and c["reason"] == "PinsMatch" else None)(
                _cond(kubectl, ns, name, "PinsVerified")), timeout=120)
            assert cond["status"] == "True"
            wait_for("a namespace id", lambda: (kubectl.get("kvns", name, ns).get("status") or {}).get("namespaceId"),
                     timeout=120)
            assert sum(1 for _, path in hub.requests if path.endswith("/config.json")) == 1  # a commit's files, read once
        finally:
            stop(operator)
            kubectl.run("delete", "namespace", ns, "--wait=false", check=False)


def test_a_newcomers_two_pins_reach_ready_with_the_cache_on_and_a_restart_without_the_hub_keeps_them(
        kubectl: Kubectl, crd: None, tmp_path: Path) -> None:
    """spec.identity with modelId and modelRevision alone (image, l1, l2 as a newcomer writes them):
    the operator fills the rest from the stand-in Hub's files, the id is that of the same pins
    written out, vLLM is started with them, status.identity shows them; an operator restarted with
    no Hub resolves the same id from status.identity.files and rolls nothing."""
    from kvpersist.identity import image_digest
    from tests.e2e.operator_env import kvpersist_env, manifest, more_rounds, start_operator, target_of
    from tests.integration.kvdriver import SHAPE_PINS

    with HubStub() as hub, kvpersist_env(kubectl, tmp_path, {"HF_ENDPOINT": hub.url}) as env:
        explicit = manifest(env.ns)
        ident = explicit["spec"]["identity"]
        hub.models[(ident["modelId"], ident["modelRevision"])] = {
            "config.json": json.dumps({"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": SHAPE_PINS[
                "numKVHeads"], "head_dim": SHAPE_PINS["headSize"], "max_position_embeddings": 2048,
                "torch_dtype": SHAPE_PINS["kvCacheDtype"]}).encode(),
            "tokenizer_config.json": json.dumps({"chat_template": TEMPLATE}).encode()}
        two = json.loads(json.dumps(explicit))
        two["spec"]["identity"] = {"modelId": ident["modelId"], "modelRevision": ident["modelRevision"]}
        name = two["metadata"]["name"]
        kubectl.apply(two)
        status = wait_for("Ready with the cache on", lambda: (lambda s: s if s.get("phase") == "Ready" and s.get(
            "namespaceId") else None)(kubectl.get("kvns", name, env.ns).get("status") or {}), timeout=240)
        ident.update(blockSize=16, tensorParallelSize=1, maxModelLen=2048, connectorBuild=image_digest(explicit["spec"]["image"]),
                     chatTemplateDigest="sha256:" + hashlib.sha256(TEMPLATE.encode()).hexdigest())
        assert status["namespaceId"] == target_of(explicit, kubectl).namespace_id  # the same pins written out
        shown = status["identity"]
        assert shown["pins"] == {k: v for k, v in ident.items()}, shown
        assert "numKVHeads" in shown["filled"] and shown["files"]["at"] == f"{ident['modelId']}@{ident['modelRevision']}"
        dep = kubectl.get("deployment", f"{name}-vllm", env.ns)
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        for flag, value in (("--block-size", "16"), ("--max-model-len", "2048"), ("--kv-cache-dtype", "float16"),
                            ("--tensor-parallel-size", "1")):
            assert args[args.index(flag) + 1] == value, args
        assert "--kv-transfer-config" in args
        generation = dep["metadata"]["generation"]

        stop(env.operator)  # a restart while the Hub cannot be reached: status keeps what the files said
        env.operator = start_operator(kubectl.kubeconfig, env.ns, env.log, {"HF_ENDPOINT": "http://127.0.0.1:9"})
        more_rounds(env.operator, env.ns, name)
        status = kubectl.get("kvns", name, env.ns)["status"]
        assert status["namespaceId"] == target_of(explicit, kubectl).namespace_id and status["phase"] == "Ready"
        assert kubectl.get("deployment", f"{name}-vllm", env.ns)["metadata"]["generation"] == generation  # no roll
        assert sum(1 for _, path in hub.requests if path.endswith("/config.json")) == 1
