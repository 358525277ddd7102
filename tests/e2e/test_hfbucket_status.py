"""An hfBucket KVCacheNamespace's L2Ready follows the operator's preflight of the bucket and the
token in its Secret, and the token shows up nowhere a user or another tenant can read.

The Hub is tests/integration/hub_stub.py (a local stand-in answering as the Hub does for these
cases; no Hugging Face endpoint is reachable here), given to the operator as HF_ENDPOINT."""

from __future__ import annotations

import base64
import json
import uuid
from pathlib import Path

import pytest

from tests.cases.invalid_manifests import sample
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import start_operator, stop
from tests.integration.hub_stub import GOOD_TOKEN, HubStub

pytestmark = pytest.mark.e2e
NAME = "qwen25-7b-bucket"
BAD_TOKEN = "hf_planted_bad_token_9f8e7d6c5b4a"


def _secret(ns: str, token: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-kv-writer", "namespace": ns},
            "type": "Opaque", "data": {"token": base64.b64encode(token.encode()).decode()}}


def _l2(k: Kubectl, ns: str) -> dict | None:
    status = k.get("kvns", NAME, ns).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == "L2Ready"), None)


def test_bucket_preflight_reasons_and_no_token_leak(kubectl: Kubectl, crd: None, tmp_path: Path) -> None:
    ns = f"e2e-{uuid.uuid4().hex[:8]}"
    kubectl.run("create", "namespace", ns)
    log = tmp_path / "operator.log"
    with HubStub(existing={"acme-ml/kv-cache"}) as hub:
        operator = start_operator(kubectl.kubeconfig, ns, log, {"HF_ENDPOINT": hub.url})
        try:
            obj = sample("hf-bucket")
            obj["metadata"]["namespace"] = ns
            obj["spec"]["l2"]["hfBucket"]["createBucketIfMissing"] = False
            kubectl.apply(obj)
            cond = wait_for("SecretNotFound", lambda: (lambda c: c if c and c["reason"] == "SecretNotFound" else None)(
                _l2(kubectl, ns)), timeout=120)
            assert "kubectl create secret generic hf-kv-writer" in cond["message"]

            kubectl.apply(_secret(ns, BAD_TOKEN))
            cond = wait_for("TokenRejected", lambda: (lambda c: c if c and c["reason"] == "TokenRejected" else None)(
                _l2(kubectl, ns)), timeout=120)
            assert cond["status"] == "False" and "hf-kv-writer" in cond["message"]

            kubectl.apply(_secret(ns, GOOD_TOKEN))
            cond = wait_for("BucketReachable", lambda: (lambda c: c if c and c["reason"] == "BucketReachable" else None)(
                _l2(kubectl, ns)), timeout=120)
            assert BAD_TOKEN in hub.seen_tokens and GOOD_TOKEN in hub.seen_tokens  # the Hub did get them

            # The bucket's inventory, from its listing: an old namespace's objects are an orphan.
            orphan = "kvp-" + "e" * 32
            hub.put("acme-ml/kv-cache", f"prod/{orphan}/m%40a.bin", b"x" * 100, 1_700_000_000.0)
            inventory = wait_for("the bucket inventory", lambda: (lambda i: i if i.get("orphanedBytes") == 100 else None)(
                (kubectl.get("kvns", obj["metadata"]["name"], ns).get("status") or {}).get("inventory") or {}), timeout=120)
            volume = inventory["volumes"][0]
            assert volume["location"] == obj["spec"]["l2"]["hfBucket"]["bucketHandle"]
            assert volume["namespaces"][0] == {"namespaceId": orphan, "bytes": 100, "objects": 1,
                                               "lastWrite": "2023-11-14T22:13:20Z", "orphan": True}

            # Nowhere else: not in any object of the namespace (the Secret aside), events, or the operator's log.
            dump = kubectl.run("get", "kvns,statefulsets,deployments,configmaps,services,events,pods", "-n", ns,
                               "-o", "json").stdout
            for token in (BAD_TOKEN, GOOD_TOKEN):
                assert token not in dump
                assert base64.b64encode(token.encode()).decode() not in dump
                assert token not in log.read_text()
            sts = json.loads(kubectl.run("get", "statefulset", f"{NAME}-lmcache", "-n", ns, "-o", "json").stdout)
            assert "hf_" not in " ".join(sts["spec"]["template"]["spec"]["containers"][0]["args"])
        finally:
            stop(operator)
            kubectl.run("delete", "namespace", ns, "--wait=false", check=False)
