"""The KVCacheNamespace API on a real kube-apiserver: samples apply, mistakes are refused at
`kubectl apply` naming the field, `kubectl explain` documents the pins, `kubectl get` shows the columns."""

from __future__ import annotations

import base64
import json
import random
import re

import pytest
import yaml
from pydantic import ValidationError

from kvpersist.api.text import FORBIDDEN, SURROGATES
from kvpersist.api.v1alpha1 import KVCacheNamespace, validation_message
from kvpersist.identity import key_fingerprint, resolve
from tests.cases.invalid_manifests import CASES, SAMPLES, Case, sample
from tests.cases.oracles import forbidden
from tests.e2e.kube import Kubectl, wait_for

pytestmark = pytest.mark.e2e
SAMPLE_NAMES = sorted(p.stem for p in SAMPLES.glob("*.yaml"))


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_sample_applies(kubectl: Kubectl, crd: None, namespace: str, name: str) -> None:
    path = SAMPLES / f"{name}.yaml"
    kubectl.run("apply", "--server-side", "--dry-run=server", "-n", namespace, "-f", str(path))
    kubectl.run("apply", "-n", namespace, "-f", str(path))
    obj = yaml.safe_load(path.read_text())
    stored = kubectl.get("kvns", obj["metadata"]["name"], namespace)
    # Defaults come from the schema, so what is stored is what the operator's model would default to.
    model = KVCacheNamespace.model_validate(obj)
    assert stored["spec"]["eviction"]["policy"] == model.spec.eviction.policy
    assert stored["spec"]["lmcacheServer"]["port"] == model.spec.lmcache_server.port
    assert stored["spec"]["image"] == model.spec.image


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_invalid_manifest_refused(kubectl: Kubectl, crd: None, namespace: str, case: Case) -> None:
    obj = case.manifest()
    obj["metadata"]["namespace"] = namespace
    out = kubectl.apply(obj, check=False)
    assert out.returncode != 0, f"{case.id} was accepted"
    assert case.field in out.stderr, out.stderr
    assert kubectl.run("get", "kvns", "-n", namespace, "-o", "name").stdout.strip() == ""


def test_shared_serves_several_servers_on_one_claim_and_is_fixed_once_set(kubectl: Kubectl, crd: None,
                                                                            namespace: str) -> None:
    """spec.l2.nvme.shared: an existing claim may serve several servers; switching shared either
    way is refused at apply time with the fix (a new KVCacheNamespace), as is the reclaimPolicy
    of the one claim the operator made."""
    obj = sample()
    obj["metadata"].update(name="shared-l2", namespace=namespace)
    obj["spec"]["l2"]["nvme"] = {"existingClaimName": "lustre-kv", "maxCapacity": "100Gi", "shared": True,
                                 "adapter": "nixl_store_dynamic"}
    obj["spec"].setdefault("lmcacheServer", {})["replicas"] = 3
    kubectl.apply(obj)
    assert kubectl.get("kvns", "shared-l2", namespace)["spec"]["l2"]["nvme"]["shared"] is True
    obj["spec"]["l2"]["nvme"]["shared"] = False
    obj["spec"].setdefault("lmcacheServer", {})["replicas"] = 1
    out = kubectl.apply(obj, check=False)
    assert out.returncode != 0 and "spec.l2.nvme.shared" in out.stderr and "new KVCacheNamespace" in out.stderr, out.stderr
    made = sample()
    made["metadata"].update(name="shared-made", namespace=namespace)
    made["spec"]["l2"]["nvme"].update(shared=True, reclaimPolicy="Delete", adapter="nixl_store_dynamic")
    kubectl.apply(made)
    made["spec"]["l2"]["nvme"]["reclaimPolicy"] = "Retain"
    out = kubectl.apply(made, check=False)
    assert out.returncode != 0 and "spec.l2.nvme.reclaimPolicy" in out.stderr, out.stderr
    plain = sample()
    plain["metadata"].update(name="not-shared", namespace=namespace)
    plain["spec"]["l2"]["nvme"]["adapter"] = "nixl_store_dynamic"  # shared's adapter: refused for the switch alone
    kubectl.apply(plain)
    plain["spec"]["l2"]["nvme"]["shared"] = True
    out = kubectl.apply(plain, check=False)
    assert out.returncode != 0 and "spec.l2.nvme.shared" in out.stderr, out.stderr


def _probe_characters() -> list[int]:
    """Each edge of each refused range, its middle and its neighbours, characters that must pass
    (a space, accents, CJK, an emoji, the last code point) and a fixed random sample of the rest;
    surrogates cannot travel in JSON."""
    chars = {0x20, 0x41, 0x7E, 0xA0, 0xE9, 0x3000, 0xFFFD, 0x1F600, 0x10FFFF, 0xE0000, 0xE0080}
    chars |= set(random.Random(29).sample(range(0x110000), 120))  # and some of the rest, the same each run
    for a, b in FORBIDDEN:
        chars |= {a - 1, a, (a + b) // 2, b, b + 1}
    return sorted(c for c in chars if c >= 0 and not SURROGATES[0] <= c <= SURROGATES[1])


def test_the_api_server_and_the_models_refuse_the_same_characters(kubectl: Kubectl, crd: None, namespace: str) -> None:
    """The CRD's pattern, as the API server's Go regexp reads it, and the models' check, against
    the one table (kvpersist.api.text.FORBIDDEN), character by character: each probe is one
    extraArgs value ("a<c>b", no leading dash, so the allow-list rule passes it), and the API
    server names each index it refuses."""
    chars = _probe_characters()
    mismatched = []
    for start in range(0, len(chars), 60):
        chunk = chars[start:start + 60]
        obj = sample()
        obj["metadata"].update(name="chars", namespace=namespace)
        obj["spec"]["vllm"]["extraArgs"] = [f"a{chr(c)}b" for c in chunk]
        out = kubectl.apply(obj, "--dry-run=server", check=False)
        assert out.returncode == 0 or "is invalid" in out.stderr, out.stderr
        by_api = {int(i) for i in re.findall(r"spec\.vllm\.extraArgs\[(\d+)\]: Invalid value", out.stderr)}
        one = sample()
        for i, c in enumerate(chunk):
            one["spec"]["vllm"]["servedModelName"] = f"a{chr(c)}b"
            try:
                KVCacheNamespace.model_validate(one)
                by_models = False
            except ValidationError as exc:
                by_models = True
                assert "spec.vllm.servedModelName" in validation_message(exc) and f"U+{c:04X}" in str(exc), exc
            if not (i in by_api) == by_models == forbidden(chr(c)):
                mismatched.append(f"U+{c:04X} ({'refused' if forbidden(chr(c)) else 'allowed'} by the table): API server "
                                  f"{'refuses' if i in by_api else 'accepts'}, models {'refuse' if by_models else 'accept'}")
    assert mismatched == []
    assert len(chars) >= 4 * len(FORBIDDEN)


# (field, value, whether it is valid: at least 1Mi, a budget within maxCapacity (90% of 500Gi)): a quantity in either of
# the forms Kubernetes takes, a number or a string, within and outside the rules that compare it.
QUANTITY_PROBES = [
    ("size", 536870912000, True), ("size", "500Gi", True), ("size", 1000, False), ("size", "1000", False),
    ("budget", 1073741824, True), ("budget", "1Gi", True), ("budget", 1000, False), ("budget", "1000", False),
]


@pytest.mark.parametrize(("field", "value", "valid"), QUANTITY_PROBES, ids=[f"{f}={v!r}" for f, v, _ in QUANTITY_PROBES])
def test_the_api_server_and_the_models_judge_a_quantity_alike_as_a_number_or_a_string(
        kubectl: Kubectl, crd: None, namespace: str, field: str, value: int | str, valid: bool) -> None:
    """spec.l2.nvme.size and budget are int-or-string, as every Kubernetes quantity: a rule that
    reads them must take both. The rules once called quantity() on the number itself, so the API
    server refused `size: 536870912000` with "no such overload" under a rule telling the user to
    raise size, where the models accepted it."""
    obj = sample()
    obj["metadata"].update(name="quantity", namespace=namespace)
    obj["spec"]["l2"]["nvme"].update({field: value, "adapter": "nixl_store_dynamic"})  # the adapter a budget takes
    out = kubectl.apply(obj, "--dry-run=server", check=False)
    try:
        KVCacheNamespace.model_validate(obj)
        by_models = None
    except ValidationError as exc:
        by_models = validation_message(exc)
    if valid:
        assert out.returncode == 0, out.stderr
        assert by_models is None, by_models
    else:
        assert out.returncode != 0 and "is invalid" in out.stderr, out.stderr
        assert "no such overload" not in out.stderr, out.stderr
        assert f"spec.l2.nvme.{field}" in out.stderr or "raise size" in out.stderr, out.stderr
        assert by_models is not None and "spec.l2.nvme" in by_models, by_models


def test_runtime_class_defaults_to_nvidia_and_an_empty_one_is_kept(kubectl: Kubectl, crd: None, namespace: str) -> None:
    """The NVIDIA GPU Operator's RuntimeClass by default; "" (the node's default runtime) must
    survive `kubectl apply` and the schema's defaulting (a null does not: kubectl drops it)."""
    obj = sample()
    obj["metadata"].update(name="rc-default", namespace=namespace)
    kubectl.apply(obj)
    stored = kubectl.get("kvns", "rc-default", namespace)["spec"]
    assert stored["lmcacheServer"]["runtimeClassName"] == stored["vllm"]["runtimeClassName"] == "nvidia"
    obj["metadata"]["name"] = "rc-none"
    obj["spec"].setdefault("lmcacheServer", {})["runtimeClassName"] = ""
    obj["spec"]["vllm"]["runtimeClassName"] = ""
    kubectl.apply(obj)
    stored = kubectl.get("kvns", "rc-none", namespace)["spec"]
    assert stored["lmcacheServer"]["runtimeClassName"] == stored["vllm"]["runtimeClassName"] == ""
    model = KVCacheNamespace.model_validate({**obj, "spec": stored}).spec
    assert model.lmcache_server.runtime_class_name == model.vllm.runtime_class_name == ""
    bad = {**obj, "metadata": {**obj["metadata"], "name": "rc-bad"}}
    bad["spec"] = {**obj["spec"], "vllm": {**obj["spec"]["vllm"], "runtimeClassName": "Not_A_Name"}}
    out = kubectl.apply(bad, check=False)
    assert out.returncode != 0 and "spec.vllm.runtimeClassName" in out.stderr, out.stderr


def test_explain_shows_descriptions(kubectl: Kubectl, crd: None) -> None:
    out = kubectl.run("explain", "kvcachenamespace.spec.identity").stdout
    for field, words in [("modelRevision", "40-character commit SHA"), ("kvCacheDtype", "auto"),
                         ("chatTemplateDigest", "sha256"), ("tensorParallelSize", "tensor-parallel")]:
        assert field in out and words in out, field


def test_get_shows_columns_and_namespace_id(kubectl: Kubectl, operator, namespace: str) -> None:
    kubectl.run("apply", "-n", namespace, "-f", str(SAMPLES / "nvme-minimal.yaml"))
    wait_for("status.namespaceId", lambda: kubectl.get("kvns", "llama31-8b", namespace).get("status", {}).get("namespaceId"),
             timeout=60)
    # The id is the pins with the fingerprint of the L2 key the operator generated (a pin since schema 3).
    key = base64.b64decode(kubectl.get("secret", "llama31-8b-l2-key", namespace)["data"]["master-key"])
    expected = resolve(KVCacheNamespace.model_validate(sample()).spec.pins(key_fingerprint(key))).namespace_id
    assert expected is not None
    out = kubectl.run("get", "kvns", "-n", namespace, "-o", "wide").stdout
    header = out.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "REASON", "VLLM", "L2-USED", "HIT", "AGE", "READY", "NAMESPACE-ID", "L2", "L1-USED"]
    row = out.splitlines()[1].split()
    assert row[0] == "llama31-8b" and expected in row and "nvme" in row


def test_missing_pin_disables_cache_with_condition(kubectl: Kubectl, operator, namespace: str) -> None:
    obj = sample()
    del obj["spec"]["identity"]["modelRevision"]  # no commit: no files to fill a pin from
    obj["metadata"]["namespace"] = namespace
    kubectl.apply(obj)
    status = wait_for("phase CacheDisabled", lambda: (lambda s: s if s.get("phase") == "CacheDisabled" else None)(
        kubectl.get("kvns", "llama31-8b", namespace).get("status", {})), timeout=60)
    assert "namespaceId" not in status
    cond = next(c for c in status["conditions"] if c["type"] == "IdentityResolved")
    assert cond["status"] == "False" and cond["reason"] == "IdentityIncomplete"
    assert "spec.identity.modelRevision" in cond["message"]
    dep = wait_for("the vLLM Deployment", lambda: kubectl.run("get", "deployment", "llama31-8b-vllm", "-n", namespace,
                                                            "-o", "json", check=False).stdout)
    args = json.loads(dep)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--kv-transfer-config" not in args and "meta-llama/Llama-3.1-8B-Instruct" in args
    sts = kubectl.get("statefulset", "llama31-8b-lmcache", namespace)
    assert sts["spec"]["replicas"] == 0
    wait_for("an IdentityIncomplete event", lambda: kubectl.run(
        "get", "events", "-n", namespace, "--field-selector", "reason=IdentityIncomplete", "-o", "name").stdout.strip())


def test_image_by_tag_disables_cache_and_a_new_digest_is_a_new_namespace(kubectl: Kubectl, operator,
                                                                          namespace: str) -> None:
    """What runs is part of the identity: a tag alone leaves the cache off with the fix named; a
    digest turns it on; another digest of the same image is another namespace."""
    obj = sample()
    pinned = obj["spec"]["image"]
    obj["spec"]["image"] = pinned.split("@")[0]  # the tag alone
    obj["metadata"]["namespace"] = namespace
    kubectl.apply(obj)

    def status_with(pred):
        return lambda: (lambda s: s if pred(s) else None)(kubectl.get("kvns", "llama31-8b", namespace).get("status", {}))

    status = wait_for("phase CacheDisabled", status_with(lambda s: s.get("phase") == "CacheDisabled"), timeout=60)
    cond = next(c for c in status["conditions"] if c["type"] == "IdentityResolved")
    assert cond["reason"] == "ImageNotPinned" and "spec.image" in cond["message"] and "@sha256:" in cond["message"]
    assert "namespaceId" not in status
    wait_for("an ImageNotPinned event", lambda: kubectl.run(
        "get", "events", "-n", namespace, "--field-selector", "reason=ImageNotPinned", "-o", "name").stdout.strip())

    obj["spec"]["image"] = pinned
    kubectl.apply(obj)
    first = wait_for("a namespace id", status_with(lambda s: s.get("namespaceId")), timeout=60)["namespaceId"]
    fingerprint = key_fingerprint(base64.b64decode(kubectl.get("secret", "llama31-8b-l2-key", namespace)["data"]["master-key"]))
    assert first == resolve(KVCacheNamespace.model_validate(obj).spec.pins(fingerprint)).namespace_id

    obj["spec"]["image"] = pinned.split("@")[0] + "@sha256:" + "0" * 64  # another build, same tag
    kubectl.apply(obj)
    second = wait_for("another namespace id", status_with(lambda s: s.get("namespaceId") not in (None, first)),
                      timeout=60)["namespaceId"]
    assert second == resolve(KVCacheNamespace.model_validate(obj).spec.pins(fingerprint)).namespace_id
    server = wait_for("the server set on the new id", lambda: (lambda s: s if second in json.dumps(s["spec"]["template"])
                                                               else None)(kubectl.get("statefulset", "llama31-8b-lmcache",
                                                                                      namespace)), timeout=60)
    assert first not in json.dumps(server["spec"]["template"])
