"""The committed CRD is exactly what the models generate, and it is a structural schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvpersist.api.crd import CRD_PATHS, build_crd, render_crd

ROOT = Path(__file__).resolve().parents[2]


def _walk(node: dict[str, Any], path: str):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_committed_crd_is_generated() -> None:
    copies = [ROOT / p for p in CRD_PATHS] + list((ROOT / "charts").glob(f"*/files/{CRD_PATHS[0].name}"))
    assert len(copies) == 2  # crds/ and the chart's copy (files/: templates/crd.yaml renders it)
    assert copies
    for path in copies:
        assert path.read_text() == render_crd(), f"{path} is stale: run `kvpersist crd --write`"


def _schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_every_spec_field_has_a_description() -> None:
    undocumented = [
        path for path, node in _walk(_schema()["properties"]["spec"], "spec")
        if not node.get("description") and not path.endswith(("[]", "{}"))
    ]
    assert undocumented == []


def test_schema_is_structural() -> None:
    for path, node in _walk(_schema(), ""):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        assert ("$ref" not in node and "anyOf" not in node) or node.get("x-kubernetes-int-or-string"), path
        assert node.get("additionalProperties") is not False, path
        assert not isinstance(node.get("exclusiveMinimum"), (int, float)) or isinstance(
            node["exclusiveMinimum"], bool), path


def test_crd_names_and_printer_columns() -> None:
    crd = build_crd()
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("KVCacheNamespace", "kvcachenamespaces", ["kvns"])
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"]["status"] == {}
    cols = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(cols) == ["Phase", "Reason", "VLLM", "L2-Used", "Hit", "Age", "Ready", "Namespace-ID", "L2", "L1-Used"]
    # At most seven columns with NAME by default (issue 43); the rest at -o wide.
    default = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert len(default) + 1 <= 7 and default[-1] == "Age", default
    # READY is the Ready condition, never a pod count (which reads "1/1" while the cache is off).
    assert cols["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert cols["Reason"] == '.status.conditions[?(@.type=="Ready")].reason'
    assert cols["VLLM"] == ".status.replicas"
    hit = next(c for c in version["additionalPrinterColumns"] if c["name"] == "Hit")
    assert hit["jsonPath"] == ".status.hits.summary"
    status = _schema()["properties"]["status"]["properties"]
    hits = status["hits"]["properties"]
    assert {"lookupTokens", "hitTokens", "hitTokensL1", "hitTokensL2", "hitRate", "hitRateL1", "hitRateL2", "window",
            "summary", "servers", "since", "measuredAt"} <= set(hits)
    assert hits["hitTokensL1"]["type"] == "integer" and hits["hitRate"]["type"] == "number"
    assert {"seconds", "hitRate", "hitTokensPerSecond"} <= set(hits["window"]["properties"])


def test_render_is_yaml_of_build() -> None:
    assert yaml.safe_load(render_crd()) == build_crd()


def test_scale_subresource_acts_on_vllm_replicas() -> None:
    """kubectl scale / an HPA: spec.vllm.replicas; the status paths are integer / string fields the
    status writer fills (kvpersist.status.conditions.compute_status)."""
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.vllm.replicas",
                                                "statusReplicasPath": ".status.vllmReplicas",
                                                "labelSelectorPath": ".status.vllmSelector"}
    status = _schema()["properties"]["status"]["properties"]
    assert status["vllmReplicas"]["type"] == "integer" and status["vllmSelector"]["type"] == "string"
    assert _schema()["properties"]["spec"]["properties"]["vllm"]["properties"]["replicas"]["type"] == "integer"
