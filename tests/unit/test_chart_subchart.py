"""The chart as a subchart, as a platform team's umbrella chart uses it: a parent chart depending on
it (file://, `helm dependency build`), with a condition on it, `global` values of its own and of
other subcharts, and nameOverride or fullnameOverride. Everything renders (schema included, which
must let `global` and the parent's condition through), every object is named and labelled after the
overrides, and every name one object gives another (policy bindings, the ServiceAccount, the
creator-rights check's policy) follows them."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests import rbac_needs as rb

GLOBAL = {"commonLabels": {"team": "platform", "tier": 1},
          "imagePullSecrets": [{"name": "platform-pull"}],
          "priorityClassName": "platform-critical",
          "storageClass": "fast"}  # another subchart's global: this chart must let it through


def _parent(tmp_path: Path, helm: Path, values: dict[str, Any]) -> Path:
    parent = tmp_path / "platform"
    parent.mkdir()
    (parent / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0",
        "dependencies": [{"name": "kvpersist", "version": "0.1.0", "repository": f"file://{rb.CHART}",
                          "condition": "kvpersist.enabled"}]}))
    (parent / "values.yaml").write_text(yaml.safe_dump(values))
    built = subprocess.run([str(helm), "dependency", "build", str(parent)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    return parent


def _render(helm: Path, parent: Path, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run([str(helm), "template", "acme", str(parent), "--namespace", "platform-system", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _env(deployment: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_fullname_override_and_global_reach_every_object(helm: Path, tmp_path: Path) -> None:
    parent = _parent(tmp_path, helm, {"global": GLOBAL, "kvpersist": {"enabled": True, "fullnameOverride": "kvp",
                                                                      "watchNamespaces": ["ml"]}})
    docs = _render(helm, parent)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "Role", "RoleBinding", "KopfPeering",
            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "Service", "NetworkPolicy"} <= kinds
    for d in docs:
        labels = d["metadata"].get("labels") or {}
        # global.commonLabels on every object, as strings; the chart's own labels kept.
        assert labels.get("team") == "platform" and labels.get("tier") == "1", d["metadata"]
        assert labels["app.kubernetes.io/instance"] == "acme" and labels["helm.sh/chart"] == "kvpersist-0.1.0"
        name = d["metadata"]["name"]
        if d["kind"] not in ("CustomResourceDefinition", "KopfPeering"):  # the CRD's and the peering's names are fixed
            assert name == "kvp" or name.startswith("kvp-"), (d["kind"], name)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    deployment = by_kind["Deployment", "kvp"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kvp" and ("ServiceAccount", "kvp") in by_kind
    assert pod["imagePullSecrets"] == [{"name": "platform-pull"}]
    assert pod["priorityClassName"] == "platform-critical"
    assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "platform"
    assert _env(deployment)["KVPERSIST_CREATOR_RIGHTS_POLICY"] == "kvp-creator-rights"
    for d in docs:
        if d["kind"] == "ValidatingAdmissionPolicyBinding":
            assert ("ValidatingAdmissionPolicy", d["spec"]["policyName"]) in by_kind, d["metadata"]["name"]
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            assert (d["roleRef"]["kind"], d["roleRef"]["name"]) in by_kind or d["roleRef"]["kind"] == "ClusterRole"
            assert all(s["name"] == "kvp" for s in d["subjects"] if s["kind"] == "ServiceAccount")
    bounds = by_kind["ValidatingAdmissionPolicy", "kvp-operator-bounds"]
    assert "system:serviceaccount:platform-system:kvp'" in bounds["spec"]["matchConditions"][0]["expression"]
    # The operator pod is still found by what the lmcache servers' NetworkPolicies admit.
    assert deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "kvpersist-operator"


def test_name_override_renames_and_the_condition_turns_it_off(helm: Path, tmp_path: Path) -> None:
    parent = _parent(tmp_path, helm, {"global": GLOBAL, "kvpersist": {"nameOverride": "kvcache"}})
    docs = _render(helm, parent)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "acme-kvcache"), ("ServiceAccount", "acme-kvcache"), ("ClusterRole", "acme-kvcache-gc"),
            ("ValidatingAdmissionPolicy", "acme-kvcache-creator-rights")} <= names
    assert not any("kvpersist" in n for k, n in names if k not in ("CustomResourceDefinition", "ClusterKopfPeering"))
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvcache" for d in docs)
    # The parent's condition: off, nothing of this chart.
    assert _render(helm, parent, "--set", "kvpersist.enabled=false") == []


def test_a_parent_value_of_the_wrong_type_is_refused_by_this_charts_schema(helm: Path, tmp_path: Path) -> None:
    parent = _parent(tmp_path, helm, {"global": {"commonLabels": ["not", "a", "map"]}})
    out = subprocess.run([str(helm), "template", "acme", str(parent)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "commonLabels" in out.stderr, out.stderr

