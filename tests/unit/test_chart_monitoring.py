"""The chart's monitoring pieces with `helm template` and `helm lint`, and the lmcache servers'
NetworkPolicy as the operator builds it: the PrometheusRule (off by default; on, exactly the
rules file), the ServiceMonitor's honorLabels (the per-resource series carry their own namespace
label), and metrics.scraper letting a named scraper through to the metrics ports and nothing else."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpersist.builders.all import build_all
from kvpersist.builders.lmcache import OPERATOR_LABELS, OPERATOR_NAMESPACE_ENV, SCRAPER_ENV, build_network_policy, parse_scraper
from kvpersist.controller.policy import Policy
from tests import rbac_needs as rb
from tests.unit.test_builders import target

RULES = rb.REPO / "charts/kvpersist/files/prometheus-rules.yaml"
SCRAPER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
           "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


# A cluster with the Prometheus Operator: the chart makes its kinds only where they are served.
MONITORING_APIS = [a for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule")
                   for a in ("--api-versions", f"monitoring.coreos.com/v1/{kind}")]


def _template(helm: Path, *sets: str) -> list[dict[str, Any]]:
    args = [str(helm), "template", "kvpersist", str(rb.CHART), "--namespace", "kvpersist-system", *MONITORING_APIS]
    for s in sets:
        args += ["--set-json" if s.startswith("json:") else "--set", s.removeprefix("json:")]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _env(docs: list[dict[str, Any]]) -> dict[str, str]:
    container = _kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_prometheus_rule_is_off_by_default_and_is_the_rules_file_when_on(helm: Path) -> None:
    assert _kind(_template(helm), "PrometheusRule") == []
    [rule] = _kind(_template(helm, "prometheusRule.enabled=true", "prometheusRule.labels.release=kube-prometheus"),
                   "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["namespace"] == "kvpersist-system"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    # The annotations' own templates ({{ $labels.name }}) are left to Prometheus, not rendered by Helm.
    assert "{{ $labels.name }}" in rule["spec"]["groups"][0]["rules"][0]["annotations"]["summary"]

    moved = _kind(_template(helm, "prometheusRule.enabled=true", "prometheusRule.namespace=monitoring",
                            "prometheusRule.runbookBaseURL=https://wiki.example.com/kvpersist/runbooks"), "PrometheusRule")[0]
    urls = [r["annotations"]["runbook_url"] for g in moved["spec"]["groups"] for r in g["rules"]]
    assert moved["metadata"]["namespace"] == "monitoring"
    assert urls and all(u.startswith("https://wiki.example.com/kvpersist/runbooks#kvpersist") for u in urls)


def test_service_monitor_honors_the_resources_namespace_label(helm: Path) -> None:
    [monitor] = _kind(_template(helm, "metrics.serviceMonitor.enabled=true"), "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True


@pytest.mark.parametrize("sets", [(), ("prometheusRule.enabled=true", "metrics.serviceMonitor.enabled=true"),
                                  ("json:metrics.scraper=" + json.dumps(SCRAPER),)])
def test_chart_lints(helm: Path, sets: tuple[str, ...]) -> None:
    args = [str(helm), "lint", "--strict", str(rb.CHART)]
    for s in sets:
        args += ["--set-json" if s.startswith("json:") else "--set", s.removeprefix("json:")]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_scraper_reaches_the_operators_metrics_port_only(helm: Path) -> None:
    default = _template(helm)
    [policy] = _kind(default, "NetworkPolicy")
    assert "ingress" not in policy["spec"] and SCRAPER_ENV not in _env(default)  # none named: none admitted

    docs = _template(helm, "json:metrics.scraper=" + json.dumps(SCRAPER), "networkPolicy.metricsFromNamespaces={ops}")
    [policy] = _kind(docs, "NetworkPolicy")
    first, scraper = policy["spec"]["ingress"]
    assert [p["port"] for p in first["ports"]] == [8081]  # metricsFromNamespaces: the metrics port, not liveness
    assert scraper == {"ports": [{"protocol": "TCP", "port": 8081}], "from": [SCRAPER]}  # the metrics port, nothing else
    assert json.loads(_env(docs)[SCRAPER_ENV]) == SCRAPER  # and the same peer to the operator, for the servers


def test_a_pod_selector_alone_is_refused(helm: Path) -> None:
    out = subprocess.run([str(helm), "template", "kvpersist", str(rb.CHART), "--set-json",
                          'metrics.scraper={"podSelector": {"matchLabels": {"app": "prometheus"}}}'],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "metrics.scraper.podSelector needs metrics.scraper.namespaceSelector" in out.stderr


def test_lmcache_server_policy_admits_the_scraper_to_the_agent_port_only() -> None:
    t = target()
    plain = build_network_policy(t, "kvpersist-system")
    policy = build_network_policy(t, "kvpersist-system", SCRAPER)
    assert policy["spec"]["ingress"][0] == plain["spec"]["ingress"][0]  # the operator's rule, untouched
    assert policy["spec"]["ingress"][1] == {"from": [SCRAPER], "ports": [{"protocol": "TCP", "port": 8090}]}
    assert policy["spec"]["ingress"][2:] == plain["spec"]["ingress"][1:]  # ZMQ: the id's vLLM pods, never the scraper
    assert len(policy["spec"]["ingress"]) == 3 and policy["spec"]["ingress"][2]["ports"][0]["port"] == 5555
    assert OPERATOR_LABELS.items() <= policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"].items()
    # With no operator namespace known, the scraper still gets through to the agent, and only it.
    assert build_network_policy(t, None, SCRAPER)["spec"]["ingress"] == policy["spec"]["ingress"][1:]


def test_the_scraper_comes_from_the_environment_through_the_policy() -> None:
    t = target()
    policy = Policy.from_env({SCRAPER_ENV: json.dumps(SCRAPER), OPERATOR_NAMESPACE_ENV: "kvpersist-system"}, Path("/nonexistent"))
    assert (policy.operator_namespace, policy.metrics_scraper) == ("kvpersist-system", SCRAPER)
    made = build_all(t, policy.operator_namespace, policy.metrics_scraper)
    assert made[0]["kind"] == "NetworkPolicy" and made[0]["spec"]["ingress"][1]["from"] == [SCRAPER]
    zmq = made[0]["spec"]["ingress"][2]
    assert zmq["ports"][0]["port"] == 5555 and SCRAPER not in zmq["from"]  # the ZMQ port stays vLLM's alone
    assert len(build_all(t, "kvpersist-system")[0]["spec"]["ingress"]) == 2  # the operator's, ZMQ


@pytest.mark.parametrize(("raw", "says"), [
    ("not json", "not JSON"),
    ('{"podSelector": {"matchLabels": {"a": "b"}}}', "podSelector needs metrics.scraper.namespaceSelector"),
    ('{"namespaceSelector": {"matchLabels": {"a": "b c"}}}', "metrics.scraper.namespaceSelector.matchLabels"),
    ('{"namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "Like"}]}}', "matchExpressions[0]"),
    ('{"namespaceSelector": {"matchLabel": {"a": "b"}}}', "matchLabels and/or matchExpressions only"),
    ('{"nsSelector": {}}', "namespaceSelector and podSelector"),
])
def test_a_wrong_scraper_stops_the_operator(raw: str, says: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_scraper(raw)
    assert says in str(err.value)


def test_scraper_parses() -> None:
    assert parse_scraper("") is None and parse_scraper("{}") is None
    assert parse_scraper(json.dumps(SCRAPER)) == SCRAPER
    only_ns = {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["obs"]}]}}
    assert parse_scraper(json.dumps(only_ns)) == only_ns


def test_cli_run_refuses_a_wrong_scraper(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpersist import cli

    monkeypatch.setenv(SCRAPER_ENV, '{"podSelector": {"matchLabels": {"a": "b"}}}')
    monkeypatch.setenv("KVPERSIST_CLUSTER_DOMAIN", "cluster.local")
    assert cli.main(["run", "--standalone"]) == 2
    assert "metrics.scraper.podSelector" in capsys.readouterr().err
