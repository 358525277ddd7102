"""The NetworkPolicy of the lmcache server pods, one per namespace id: the agent's port to the
operator alone, ZMQ to vLLM pods of the same namespace id alone. lmcache's admin API (no authentication) binds loopback;
the agent checks the resource's token itself, and the policy is the second line where the CNI enforces it."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from kvpersist.api.spec import LABEL_VALUE
from kvpersist.builders.target import SERVER, VLLM, Target, manifest
from kvpersist.builders.vllm import attached, attached_peer

# Where the operator runs, so the policy can admit it. Set by the Helm chart.
OPERATOR_NAMESPACE_ENV = "KVPERSIST_OPERATOR_NAMESPACE"
OPERATOR_LABELS = {"app.kubernetes.io/name": "kvpersist-operator"}

# A scraper admitted to the agent's port (the servers' /metrics): {"namespaceSelector": <LabelSelector>,
# "podSelector": <LabelSelector>?} as JSON, from the chart's metrics.scraper.
SCRAPER_ENV = "KVPERSIST_METRICS_SCRAPER"
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_OPERATORS = {"In", "NotIn", "Exists", "DoesNotExist"}


def _selector_problems(where: str, sel: Any) -> list[str]:
    """What is wrong with a LabelSelector (matchLabels, matchExpressions), each naming its place."""
    if not isinstance(sel, dict) or set(sel) - {"matchLabels", "matchExpressions"}:
        return [f"{where}: a label selector has matchLabels and/or matchExpressions only"]
    out = []
    for k, v in (sel.get("matchLabels") or {}).items() if isinstance(sel.get("matchLabels") or {}, dict) else [(None, None)]:
        if k is None or not _LABEL_KEY.fullmatch(str(k)) or len(str(k)) > 316 or not isinstance(v, str) \
                or not re.fullmatch(LABEL_VALUE, v):
            out.append(f"{where}.matchLabels: {k!r}: {v!r} is not a label key and value")
    exprs = sel.get("matchExpressions") or []
    for i, e in enumerate(exprs if isinstance(exprs, list) else [None]):
        ok = (isinstance(e, dict) and set(e) <= {"key", "operator", "values"} and isinstance(e.get("key"), str)
              and _LABEL_KEY.fullmatch(e["key"]) is not None and e.get("operator") in _OPERATORS
              and isinstance(e.get("values", []), list) and all(isinstance(x, str) for x in e.get("values", [])))
        if not ok:
            out.append(f"{where}.matchExpressions[{i}]: write {{key, operator: In|NotIn|Exists|DoesNotExist, values}}")
    return out


def parse_scraper(raw: str) -> dict[str, Any] | None:
    """The scraper's peer from SCRAPER_ENV's JSON; None when unset or empty. ValueError naming the
    field and the fix: a wrong selector must stop the operator, never admit more than was meant."""
    if not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        raise ValueError(f"{SCRAPER_ENV}: not JSON; the chart writes it from metrics.scraper") from None
    if not isinstance(value, dict) or set(value) - {"namespaceSelector", "podSelector"}:
        raise ValueError(f"{SCRAPER_ENV}: an object of namespaceSelector and podSelector (metrics.scraper)")
    if not value.get("namespaceSelector"):
        if value.get("podSelector"):
            raise ValueError("metrics.scraper.podSelector needs metrics.scraper.namespaceSelector: alone it selects pods "
                             "of each policy's own namespace; set namespaceSelector: {matchLabels: "
                             "{kubernetes.io/metadata.name: <the scraper's namespace>}}")
        return None
    problems = [p for k in ("namespaceSelector", "podSelector") if value.get(k)
                for p in _selector_problems(f"metrics.scraper.{k}", value[k])]
    if problems:
        raise ValueError("; ".join(problems))
    return {k: value[k] for k in ("namespaceSelector", "podSelector") if value.get(k)}


def build_network_policy(target: Target, operator_ns: str | None, scraper: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One per namespace id, named like its Service: the agent's port from the operator's pods only (none
    when its namespace is unknown) and the scraper when named (the servers' only metrics port); ZMQ
    from the id's vLLM pods only, so old pods never store into new servers during a pin change, whose
    old servers keep their own until none is left (controller.stale_routes). Attached: ZMQ from pods
    the attach policies admitted (attached_peer), not any pod wearing managed pods' labels. Cache off,
    or another id holding the name (target.routes False): every server under <name>-lmcache, no ZMQ,
    so none is ever without the agent's rule. No rule without peers: the kubelet probes from the node."""
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_ns}},
                "podSelector": {"matchLabels": OPERATOR_LABELS}}
    peers = [*([operator] if operator_ns else []), *([dict(scraper)] if scraper else [])]
    rules = [{"from": [peer], "ports": [{"protocol": "TCP", "port": target.spec.lmcache_server.agent_port}]} for peer in peers]
    if not target.routes:
        return _policy(target, target.per_id_name(None), target.selector(SERVER), rules, per_id=False)
    if target.cache_enabled:
        rules.append({
            "from": [attached_peer(target) if attached(target) else {"podSelector": {"matchLabels": target.id_selector(VLLM)}}],
            "ports": [{"protocol": "TCP", "port": target.spec.lmcache_server.port}],
        })
    return _policy(target, target.local_service_name, target.id_selector(SERVER), rules)


def _policy(target: Target, name: str, servers: dict[str, str], rules: list[dict[str, Any]],
            per_id: bool = True) -> dict[str, Any]:
    """Ingress to the servers `servers` selects by `rules` only; per_id False: labelled with no id."""
    spec: dict[str, Any] = {"podSelector": {"matchLabels": servers}, "policyTypes": ["Ingress"]}
    if rules:  # no rules: no key (the same deny-all); an applied `ingress: []` is stored as absent,
        spec["ingress"] = rules  # so every apply would count as a change and bump the generation
    return manifest("networking.k8s.io/v1", "NetworkPolicy", target.metadata(name, SERVER, per_id), spec)
