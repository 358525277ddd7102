"""Who may reach the probe ports. The kubelet probes a pod from its own node, which Kubernetes
always admits whatever a NetworkPolicy says; any other pod that reaches a liveness port can flood
it, and once a full worker queue answered the probe 503 and got the cluster-wide operator
restarted. So the operator's NetworkPolicy (the chart's, `helm template`) and the lmcache servers'
(the operator's builder) have no rule without peers, and none for the operator's liveness port."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpersist.builders.lmcache import agent_container, build_network_policy
from tests.unit.test_builders import target
from tests.unit.test_chart_monitoring import SCRAPER, _kind, _template

VALUE_SETS = [(), ("networkPolicy.metricsFromNamespaces={monitoring}",), ("json:metrics.scraper=" + json.dumps(SCRAPER),),
              ("networkPolicy.metricsFromNamespaces={monitoring,ops}", "json:metrics.scraper=" + json.dumps(SCRAPER),
               "livenessPort=9090", "metrics.port=9091")]


def _rules(policy: dict[str, Any]) -> list[dict[str, Any]]:
    return policy["spec"].get("ingress") or []


@pytest.mark.parametrize("sets", VALUE_SETS, ids=["default", "namespaces", "scraper", "both-moved-ports"])
def test_the_operators_policy_admits_only_named_peers_to_the_metrics_port(helm: Path, sets: tuple[str, ...]) -> None:
    docs = _template(helm, *sets)
    [policy] = _kind(docs, "NetworkPolicy")
    container = _kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["livenessProbe"]["httpGet"]["port"] == "liveness"  # the kubelet's, from the node
    for rule in _rules(policy):
        assert rule.get("from"), f"a rule without peers admits every pod: {rule}"
        assert [p["port"] for p in rule["ports"]] == [ports["metrics"]], rule  # never the liveness port
    if not sets:
        assert _rules(policy) == []  # none named: none admitted


@pytest.mark.parametrize("operator_ns", ["kvpersist-system", None])
@pytest.mark.parametrize("scraper", [SCRAPER, None])
def test_the_servers_policy_admits_no_peer_less_rule(operator_ns: str | None, scraper: dict[str, Any] | None) -> None:
    """The agent's port (its /healthz the server pod's probes) is open to the operator and the
    named scraper only, ZMQ to the id's vLLM pods only; the kubelet needs no rule."""
    t = target()
    policy = build_network_policy(t, operator_ns, scraper)
    agent = agent_container(t, "unused")
    assert agent["livenessProbe"]["httpGet"]["port"] == "agent"
    *agent_rules, zmq = _rules(policy)
    for rule in _rules(policy):
        assert rule.get("from"), f"a rule without peers admits every pod: {rule}"
    for rule in agent_rules:
        assert rule["ports"] == [{"protocol": "TCP", "port": t.spec.lmcache_server.agent_port}]
    assert zmq["ports"] == [{"protocol": "TCP", "port": t.spec.lmcache_server.port}]
    assert len(agent_rules) == bool(operator_ns) + bool(scraper)
