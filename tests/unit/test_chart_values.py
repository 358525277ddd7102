"""The chart's values for the operator pod and its conventions, with `helm template` (the local
cluster's helm, which knows its own Kubernetes version: no --kube-version): the PodDisruptionBudget,
the readiness probe, pod labels and annotations, priority and spreading; the monitoring objects only
where their API is served and the metrics Service is on; the admission policy bindings scoped to
the watched namespaces; NOTES naming the namespace to apply to; the CRD as a kept template."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests import rbac_needs as rb

CRD = "kvcachenamespaces.kvpersist.dev"


def _render(helm: Path, *args: str, chart: Path = rb.CHART) -> list[dict[str, Any]]:
    out = subprocess.run([str(helm), "template", "kvpersist", str(chart), "--namespace", "kvpersist-system", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _kind(docs, "Deployment")[0]["spec"]["template"]


def test_helm_knows_its_kubernetes_version(helm: Path) -> None:
    """The local cluster's helm is built with its version and its client-go's Kubernetes version
    (hack/build-cluster-bins.sh): the chart's 1.30 check passes with no --kube-version."""
    version = subprocess.run([str(helm), "version", "--template", "{{.Version}}"], capture_output=True, text=True,
                             timeout=60).stdout
    assert version.count(".") == 2 and version.startswith("v3."), version
    assert _kind(_render(helm), "Deployment")


def test_pod_disruption_budget_with_two_replicas_or_when_enabled(helm: Path) -> None:
    assert _kind(_render(helm), "PodDisruptionBudget") == []
    [pdb] = _kind(_render(helm, "--set", "replicaCount=2"), "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"] == _kind(_render(helm), "Deployment")[0]["spec"]["selector"]["matchLabels"]
    [pdb] = _kind(_render(helm, "--set", "podDisruptionBudget.enabled=true", "--set", "podDisruptionBudget.minAvailable=50%"),
                  "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == "50%" and "maxUnavailable" not in pdb["spec"]
    assert _kind(_render(helm, "--set", "replicaCount=3", "--set", "podDisruptionBudget.enabled=false"),
                 "PodDisruptionBudget") == []


def test_readiness_probe_and_pod_values(helm: Path) -> None:
    plain = _pod(_render(helm))
    [container] = plain["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "liveness"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert "priorityClassName" not in plain["spec"] and "topologySpreadConstraints" not in plain["spec"]
    spread = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
    pod = _pod(_render(helm, "--set-json", 'podLabels={"team": "ml", "app.kubernetes.io/name": "mine"}',
                       "--set-json", 'podAnnotations={"example.com/owner": "ml-platform"}',
                       "--set", "priorityClassName=system-cluster-critical",
                       "--set-json", f"topologySpreadConstraints=[{json.dumps(spread)}]"))
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "kvpersist-operator"  # the selector's: never replaced
    assert pod["metadata"]["annotations"] == {"example.com/owner": "ml-platform"}
    assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    [constraint] = pod["spec"]["topologySpreadConstraints"]
    assert constraint == {**spread, "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "kvpersist-operator",
                                                                      "app.kubernetes.io/instance": "kvpersist"}}}


def test_monitoring_objects_only_where_served_and_with_the_metrics_service(helm: Path) -> None:
    on = ("--set", "metrics.serviceMonitor.enabled=true", "--set", "prometheusRule.enabled=true",
          "--set", "lmcacheMetrics.podMonitor.enabled=true")
    apis = [a for kind in ("ServiceMonitor", "PrometheusRule", "PodMonitor")
            for a in ("--api-versions", f"monitoring.coreos.com/v1/{kind}")]
    monitoring = {"ServiceMonitor", "PrometheusRule", "PodMonitor"}
    assert not monitoring & {d["kind"] for d in _render(helm, *on)}  # no Prometheus Operator: none
    assert monitoring <= {d["kind"] for d in _render(helm, *on, *apis)}
    without_service = {d["kind"] for d in _render(helm, *on, *apis, "--set", "metrics.service.enabled=false")}
    assert not {"ServiceMonitor", "PrometheusRule", "Service"} & without_service and "PodMonitor" in without_service
    assert not monitoring & {d["kind"] for d in _render(helm, *apis)}  # served, not asked for: none


def _raw(helm: Path, *args: str) -> str:
    out = subprocess.run([str(helm), "template", "kvpersist", str(rb.CHART), "--namespace", "kvpersist-system", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_what_is_asked_for_and_not_served_is_said_in_the_render(helm: Path) -> None:
    """`helm template` prints no NOTES: a kind the cluster does not serve is a comment there, naming
    the value and the --api-versions that renders it, not a silent gap."""
    on = ("--set", "metrics.serviceMonitor.enabled=true", "--set", "prometheusRule.enabled=true")
    served = ("--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy")
    said = [line for line in _raw(helm, *on).splitlines() if line.startswith("# NOT RENDERED: ")]
    assert [line.split()[3] for line in said] == ["metrics.serviceMonitor.enabled", "prometheusRule.enabled",
                                                  "attach.enabled"]
    assert "--api-versions monitoring.coreos.com/v1/ServiceMonitor" in said[0]
    assert "--api-versions admissionregistration.k8s.io/v1/MutatingAdmissionPolicy" in said[2]
    apis = [a for kind in ("ServiceMonitor", "PrometheusRule") for a in ("--api-versions", f"monitoring.coreos.com/v1/{kind}")]
    assert "NOT RENDERED" not in _raw(helm, *on, *apis, *served)
    assert "NOT RENDERED" not in _raw(helm, *served)  # nothing asked for, nothing to say
    off = _raw(helm, *on, *apis, *served, "--set", "metrics.service.enabled=false")
    assert "# NOT RENDERED: metrics.serviceMonitor.enabled is true, but metrics.service.enabled is false" in off


def test_pull_secrets_by_name_peering_per_release_and_json_logs(helm: Path) -> None:
    pod = _pod(_render(helm, "--set", "imagePullSecrets={regcred}", "--set-json",
                       'global={"imagePullSecrets": ["regcred", {"name": "platform"}]}'))
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "platform"}]  # each once
    for release, ns_flags, kind in (("kvpersist", (), "ClusterKopfPeering"), ("staging", (), "ClusterKopfPeering"),
                                    ("staging", ("--set", "watchNamespaces={ml}"), "KopfPeering")):
        out = subprocess.run([str(helm), "template", release, str(rb.CHART), "--namespace", "kvpersist-system", *ns_flags],
                             capture_output=True, text=True, timeout=120)
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        [peering] = _kind(docs, kind)
        [container] = _pod(docs)["spec"]["containers"]
        name = "kvpersist" if release == "kvpersist" else f"{release}-kvpersist"  # the release's full name
        assert peering["metadata"]["name"] == name and f"--peering={name}" in container["args"]
    [container] = _pod(_render(helm, "--set", "peering.name=shared"))["spec"]["containers"]
    assert "--peering=shared" in container["args"] and not any(a.startswith("--log-format") for a in container["args"])
    [container] = _pod(_render(helm, "--set", "logFormat=json"))["spec"]["containers"]
    assert "--log-format=json" in container["args"]
    refused = subprocess.run([str(helm), "template", "kvpersist", str(rb.CHART), "--set", "logFormat=yaml"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "logFormat" in refused.stderr


def test_policy_bindings_cover_the_watched_namespaces_only(helm: Path) -> None:
    clusterwide = _kind(_render(helm), "ValidatingAdmissionPolicyBinding")
    assert clusterwide and all("matchResources" not in b["spec"] for b in clusterwide)
    namespaced = {b["metadata"]["name"]: b["spec"] for b in
                  _kind(_render(helm, "--set", "watchNamespaces={ml,research}"), "ValidatingAdmissionPolicyBinding")}
    scope = {"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["ml", "research"]}]}}
    for name in ("creator-rights", "vllm-service-types", "operator-bounds", "gc-request"):
        assert namespaced[f"kvpersist-{name}"]["matchResources"] == scope, name


def _notes(helm: Path, tmp_path: Path, *args: str) -> str:
    """NOTES.txt as `helm install` prints it: `helm template` leaves NOTES out, so a copy of the chart
    renders the same text as a ConfigMap."""
    chart = tmp_path / "kvpersist"
    shutil.copytree(rb.CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "notes-as-configmap.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  NOTES.txt: |\n"
        + "".join("    " + line for line in notes.splitlines(True)))
    [doc] = _render(helm, "--show-only", "templates/notes-as-configmap.yaml", *args, chart=chart)
    return doc["data"]["NOTES.txt"]


def test_notes_name_the_namespace_to_apply_to(helm: Path, tmp_path: Path) -> None:
    watched = _notes(helm, tmp_path / "a", "--set", "watchNamespaces={ml,research}")
    assert "It watches only: ml, research." in watched
    assert "kubectl apply -n ml -f <your copy of config/samples/nvme-minimal.yaml>" in watched
    everywhere = _notes(helm, tmp_path / "b")
    assert "It watches every namespace" in everywhere and "kubectl apply -n YOUR-NAMESPACE -f" in everywhere
    assert "bind the ClusterRole\nkvpersist-gc" in everywhere and "The KVCacheNamespace CRD is this release's" in everywhere
    asked = _notes(helm, tmp_path / "c", "--set", "metrics.serviceMonitor.enabled=true", "--set", "crds.enabled=false")
    assert ("metrics.serviceMonitor.enabled is true, but this cluster does not serve "
            "monitoring.coreos.com/v1/ServiceMonitor") in asked
    assert "crds.enabled is false" in asked and "Asked for but not made" in asked
    served = _notes(helm, tmp_path / "d", "--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy")
    assert "Asked for but not made" not in served


def test_the_crd_is_a_kept_template_of_the_generated_one(helm: Path) -> None:
    [crd] = _kind(_render(helm), "CustomResourceDefinition")
    # The chart's copy of the generated CRD (tests/unit/test_crd.py: the same as `kvpersist crd` prints).
    generated = yaml.safe_load((rb.CHART / "files" / f"{CRD}.yaml").read_text())
    assert crd["metadata"]["annotations"] == {**generated["metadata"]["annotations"], "helm.sh/resource-policy": "keep"}
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert {k: v for k, v in crd.items() if k != "metadata"} == {k: v for k, v in generated.items() if k != "metadata"}
    assert _kind(_render(helm, "--set", "crds.enabled=false"), "CustomResourceDefinition") == []
    # crds/ keeps only the kopf peering CRDs (installed once): Helm would never upgrade this one there.
    assert sorted(p.name for p in (rb.CHART / "crds").glob("*.yaml")) == ["clusterkopfpeerings.kopf.dev.yaml",
                                                                         "kopfpeerings.kopf.dev.yaml"]
    assert crd["metadata"]["name"] == CRD
