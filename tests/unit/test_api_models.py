"""The pydantic models accept every sample and refuse every invalid manifest, naming the field."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from kvpersist.api.quantity import parse_quantity
from kvpersist.api.v1alpha1 import MAX_NAME_LENGTH, KVCacheNamespace, validation_message
from kvpersist.identity import image_digest, key_fingerprint, resolve
from tests.cases.invalid_manifests import CASES, SAMPLES, Case, sample

SAMPLE_NAMES = sorted(p.stem for p in SAMPLES.glob("*.yaml"))
# The samples' digest: no image of kvpersist is published, so it is a placeholder, and says so.
PLACEHOLDER_DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_samples_validate(name: str) -> None:
    obj = KVCacheNamespace.model_validate(sample(name))
    assert obj.spec.identity.model_id


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_samples_run_the_one_image_by_digest_on_gpu_nodes(name: str) -> None:
    """Each sample as shipped: the one images/vllm-lmcache image in spec.image, by a digest the
    sample calls a placeholder and says how to replace; every pin set, so the cache is on; and GPU
    placement (GPUs per pod, a GPU node selector, the GPU taint tolerated)."""
    text = (SAMPLES / f"{name}.yaml").read_text()
    spec = KVCacheNamespace.model_validate(yaml.safe_load(text)).spec
    assert re.fullmatch(r"[a-z0-9.-]+/kvpersist/vllm-lmcache:vllm-[0-9.]+-lmcache-[0-9.]+@sha256:[0-9a-f]{64}", spec.image)
    assert image_digest(spec.image) == PLACEHOLDER_DIGEST
    for words in ("PLACEHOLDER", "images/vllm-lmcache", "spec.image",
                  "docker buildx imagetools inspect", "kvpersist pins MODEL@REVISION"):
        assert words in text, words
    resolution = resolve(spec.pins(key_fingerprint(b"k" * 32)))
    assert resolution.namespace_id is not None, resolution.reason
    ident = spec.identity
    assert (ident.num_kv_heads, ident.head_size) == ((4, 128) if "Qwen2.5-7B" in ident.model_id else (8, 128))
    # GPUs per vLLM pod: gpusPerReplica, else tensorParallelSize (set in every sample: a pin).
    assert ident.tensor_parallel_size is not None and (spec.vllm.gpus_per_replica or 0) in (0, ident.tensor_parallel_size)
    assert spec.vllm.node_selector == {"nvidia.com/gpu.present": "true"}
    assert [t.key for t in spec.vllm.tolerations or []] == ["nvidia.com/gpu"]
    assert spec.vllm.resources is not None and "nvidia.com/gpu" not in (spec.vllm.resources.requests or {})


GPU_DOC = Path(__file__).resolve().parents[2] / "docs" / "gpu-cluster.md"


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_the_walks_sed_puts_your_image_in_spec_image(name: str) -> None:
    """docs/gpu-cluster.md's walk replaces the placeholder with one sed command: run as written
    (IMAGE from the environment), on each sample, it changes spec.image and nothing else."""
    command = re.search(r'^ *(sed "[^"]+") config/samples/nvme-minimal\.yaml > \S+$', GPU_DOC.read_text(),
                        flags=re.MULTILINE)
    assert command, "the walk's sed command is gone from docs/gpu-cluster.md"
    image = "reg.local/kvpersist/vllm-lmcache:vllm-0.33.0-lmcache-0.5.6@sha256:" + "ab" * 32
    path = SAMPLES / f"{name}.yaml"
    out = subprocess.run(["sh", "-c", f'{command.group(1)} "$0"', str(path)], env={"IMAGE": image, "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=30, check=True).stdout
    edited, shipped = yaml.safe_load(out), yaml.safe_load(path.read_text())
    assert edited["spec"]["image"] == image
    del edited["spec"]["image"], shipped["spec"]["image"]
    assert edited == shipped
    KVCacheNamespace.model_validate(yaml.safe_load(out))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_invalid_manifest_refused_naming_field(case: Case) -> None:
    with pytest.raises(ValidationError) as info:
        KVCacheNamespace.model_validate(case.manifest())
    assert case.field in validation_message(info.value)


def test_defaults_are_the_source_setups() -> None:
    """Eviction at 0.9 a tenth at a time (the source setup), not lmcache's own 0.8 / 0.2."""
    spec = KVCacheNamespace.model_validate(sample()).spec
    assert (spec.eviction.policy, spec.eviction.trigger_watermark, spec.eviction.eviction_ratio) == ("LRU", 0.9, 0.1)
    assert spec.l2.nvme is not None
    assert (spec.l2.nvme.adapter, spec.l2.nvme.reclaim_policy) == ("fs_native", "Retain")
    assert (spec.lmcache_server.port, spec.lmcache_server.http_port) == (5555, 5556)


@pytest.mark.parametrize(
    ("text", "value"),
    [("500Gi", 500 * 2**30), ("1Ti", 2**40), ("10G", 10e9), ("1.5Gi", 1.5 * 2**30), ("1e3", 1000.0), ("128", 128.0)],
)
def test_parse_quantity(text: str, value: float) -> None:
    assert parse_quantity(text) == value


def test_parse_quantity_refuses_garbage() -> None:
    with pytest.raises(ValueError, match="not a quantity"):
        parse_quantity("lots")


def test_isolated_lru_is_not_a_policy() -> None:
    obj = sample()
    obj["spec"]["eviction"] = {"policy": "IsolatedLRU"}
    with pytest.raises(ValidationError) as info:
        KVCacheNamespace.model_validate(obj)
    message = validation_message(info.value)
    assert "spec.eviction.policy" in message and "'LRU' or 'noop'" in message



# What Kubernetes takes as the name of each kind the builders make (and of the values derived from it).
RFC_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")  # a Service's name
RFC_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a pod's hostname (a StatefulSet's pods)
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
REVISION_HASH = "x" * 10  # controller-revision-hash: <StatefulSet>-<hash of up to 10 characters>, a label value


def _derived_name_problems(name: str) -> list[str]:
    """Every name and label value the builders derive from metadata.name, with every optional object on,
    that Kubernetes would refuse for its kind."""
    from kvpersist.builders.all import build_all
    from kvpersist.builders.target import Target

    obj = sample()
    obj["spec"]["vllm"].update(service={"enabled": True}, modelCache={"size": "100Gi"})
    obj["spec"].setdefault("lmcacheServer", {})["replicas"] = 256
    spec = KVCacheNamespace.model_validate(obj).spec
    target = Target(name, "ml", spec, resolve(spec.pins(key_fingerprint(b"k" * 32))).namespace_id)
    problems = []
    for m in build_all(target):
        n, kind = m["metadata"]["name"], m["kind"]
        subdomain = len(n) <= 253 and all(RFC_1123_LABEL.fullmatch(part) for part in n.split("."))
        if not (RFC_1035_LABEL.fullmatch(n) if kind == "Service" else subdomain):
            problems.append(f"{kind} {n}")
        if kind == "StatefulSet":
            last_pod = f"{n}-{m['spec']['replicas'] - 1}"
            if not RFC_1123_LABEL.fullmatch(last_pod):
                problems.append(f"pod {last_pod}")
            if not LABEL_VALUE.fullmatch(f"{n}-{REVISION_HASH}"):
                problems.append(f"controller-revision-hash {n}-{REVISION_HASH}")
        for key, value in {**m["metadata"].get("labels", {}),
                           **m.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})}.items():
            if not LABEL_VALUE.fullmatch(value):
                problems.append(f"{kind} {n} label {key}={value}")
    return problems


def test_every_name_allowed_makes_only_names_kubernetes_accepts() -> None:
    """Issue 42 item 6: the longest name metadata.name may have, and one of each shape it allows,
    derive only names and label values Kubernetes accepts for their kinds: no resource is accepted
    at apply and refused later (Failed / ApplyFailed) for its name."""
    longest = "a" + "-9z" * 13
    assert len(longest) == MAX_NAME_LENGTH
    for name in (longest, "a", "a-1", "q", *SAMPLE_NAMES):
        KVCacheNamespace.model_validate({**sample(), "metadata": {"name": name}})
        assert _derived_name_problems(name) == [], name


@pytest.mark.parametrize("name", ["bad.dotted", "1bad", "a" * (MAX_NAME_LENGTH + 5)])
def test_a_name_refused_would_make_a_name_kubernetes_refuses(name: str) -> None:
    """Each rule of metadata.name stands for an object Kubernetes would refuse: the refusal at apply
    time says so, naming metadata.name and the limit."""
    assert _derived_name_problems(name)
    with pytest.raises(ValidationError) as info:
        KVCacheNamespace.model_validate({**sample(), "metadata": {"name": name}})
    message = validation_message(info.value)
    assert message.startswith("metadata.name: ") and f"at most {MAX_NAME_LENGTH}" in message and "RFC 1035" in message
