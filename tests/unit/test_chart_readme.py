"""The chart's README (its values table cannot drift from values.yaml), its kubeVersion, and the
CLI's two commands (`kvpersist`, `kubectl kvpersist`) as the README says to install them."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from kvpersist.api.crd import render_crd
from tests import rbac_needs as rb

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import chart_readme  # noqa: E402


def test_the_values_table_is_what_values_yaml_says() -> None:
    readme, values = chart_readme.README.read_text(), chart_readme.VALUES.read_text()
    assert chart_readme.rendered_readme(readme, values) == readme, "stale: python3 hack/chart_readme.py"


def test_every_value_is_a_row_with_its_default_and_a_description() -> None:
    values = chart_readme.VALUES.read_text()
    rows = {key: (default, desc) for key, default, desc in chart_readme.rows(values)}
    loaded = yaml.safe_load(values)
    assert {k.split(".")[0] for k in rows} == set(loaded)
    assert rows["aggregateRoles.enabled"][0] == "true" and "edit" in rows["aggregateRoles.enabled"][1]
    assert rows["resources.requests"][0] == '{"cpu": "100m", "memory": "192Mi"}'
    assert [k for k, (_, desc) in rows.items() if not desc] == []
    # A value added to values.yaml (or a default changed) changes the table: the check can fail.
    changed = values.replace("replicaCount: 1\n", "replicaCount: 2\nnewKnob: x  # a new knob\n")
    table = chart_readme.table(changed)
    assert "| `replicaCount` | `2` |" in table and "| `newKnob` | `\"x\"` | a new knob |" in table
    assert table != chart_readme.table(values)


def test_each_value_is_described_by_its_own_comment_not_its_sections() -> None:
    values = chart_readme.VALUES.read_text()
    comments = chart_readme._comments(values)
    for key, _, desc in chart_readme.rows(values):
        assert desc == comments[key], key
        if "." in key:
            assert desc != comments.get(key.rsplit(".", 1)[0]), f"{key}: its section's comment, not its own"
    # A leaf without a comment of its own gets none from its section: the empty row fails the test above.
    bare = values.replace("  # When the kubelet pulls the operator image.\n", "")
    assert dict((k, d) for k, _, d in chart_readme.rows(bare))["image.pullPolicy"] == ""


def test_kube_version_refuses_clusters_without_validating_admission_policy_v1(helm: Path) -> None:
    """Below 1.30 (a GKE-style "29+" minor included) the chart refuses to render, naming the
    minimum; 1.30 and a provider's suffixed release pass. (A kubeVersion in Chart.yaml would also
    refuse an API server built from source, which reports v0.0.0-master: the local cluster's.)"""
    chart = yaml.safe_load((REPO / "charts" / "kvpersist" / "Chart.yaml").read_text())
    assert "kubeVersion" not in chart

    def render(version: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(helm), "template", "kvpersist", str(REPO / "charts" / "kvpersist"), "--kube-version",
                               version], capture_output=True, text=True, timeout=120)

    for old in ("1.29.9", "v1.29.2-gke.1"):
        out = render(old)
        assert out.returncode != 0 and "kvpersist needs Kubernetes 1.30 or later" in out.stderr, out.stderr
    for ok in ("1.30.0", "v1.30.4-eks-a1b2c3", "1.37.2"):
        assert render(ok).returncode == 0, ok


def test_both_commands_are_installed_and_kubectl_runs_the_plugin(tmp_path: Path) -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"kvpersist": "kvpersist.cli:main", "kvpersist-operator": "kvpersist.cli:operator_main",
                       "kubectl-kvpersist": "kvpersist.cli:kubectl_plugin"}
    readme = (REPO / "charts" / "kvpersist" / "README.md").read_text()
    assert "pipx install ." in readme and "kubectl kvpersist" in readme
    kubectl = rb.helm_binary()
    if kubectl is None:
        pytest.skip("kubectl not built: python3 hack/localcluster.py build")
    # The console script pip writes for the entry point, on PATH: kubectl finds kubectl-<name> and runs it.
    plugin = tmp_path / "kubectl-kvpersist"
    plugin.write_text(f"#!{sys.executable}\nimport sys\nfrom kvpersist.cli import kubectl_plugin\n"
                      "sys.exit(kubectl_plugin())\n")
    plugin.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run([str(kubectl.parent / "kubectl"), "kvpersist", "crd"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == render_crd()
