"""kvpersist's alert rules (charts/kvpersist/files/prometheus-rules.yaml, shipped again as
config/prometheus/kvpersist-rules.yaml) without a Prometheus.

What is checked everywhere: each expression parses and type-checks with promql-parser (a port of
Prometheus's own PromQL parser, from the dev extra), each `for` is a duration, each alert has a
severity, a summary, a description and a runbook_url whose section exists in docs/runbooks.md, and
each series an expression reads is one the operator exposes, with labels and condition types it
writes. And `promtool check rules` (Prometheus's own loader, the annotation templates included) and
`promtool test rules` on tests/unit/data/alert-rules-test.yaml, which shows each alert firing on the
series it is for and not on the others: promtool from hack/promtool.sh (Debian's package, pinned by
hash), which hack/test.sh puts on PATH; without it that test is skipped, and a skip fails the run.
The chart's side (helm template/lint, the PrometheusRule on and off) is in
tests/unit/test_chart_monitoring.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from kvpersist.controller import fallback, metrics
from kvpersist.status.conditions import CONDITION_TYPES

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "charts/kvpersist/files/prometheus-rules.yaml"
PLAIN = REPO / "config/prometheus/kvpersist-rules.yaml"
RUNBOOKS = REPO / "docs/runbooks.md"
PROMTOOL_TESTS = Path(__file__).parent / "data" / "alert-rules-test.yaml"
RUNBOOK_BASE = "https://github.com/kvpersist/kvpersist/blob/main/docs/runbooks.md"
# Condition types the rules may name: the operator's own, and L2SpaceAvailable, which the disk
# check of issue 30 item 7 adds (its alert is KVPersistL2DiskFilling).
TYPES = {*CONDITION_TYPES, fallback.CONDITION, "L2SpaceAvailable"}
LABELS = {"namespace", "name", "type", "status", "reason", "phase"}  # what the operator's series carry
SEVERITIES = {"critical", "warning", "info"}


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    out = []
    for group in doc["groups"]:
        assert set(group) == {"name", "rules"} and group["name"].startswith("kvpersist.")
        out += group["rules"]
    return out


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", markdown, flags=re.M)}


def _selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    found: list[tuple[str, list[tuple[str, str, str]]]] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node.name, [(m.name, str(m.op), m.value) for m in node.matchers.matchers]))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def test_the_plain_file_is_the_charts() -> None:
    assert PLAIN.read_bytes() == RULES.read_bytes(), "copy charts/kvpersist/files/prometheus-rules.yaml to config/prometheus/"


def test_every_alert_parses_and_is_complete() -> None:
    rules = _rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)) >= 8
    anchors = _anchors(RUNBOOKS.read_text())
    for rule in rules:
        name = rule["alert"]
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, name
        assert re.fullmatch(r"KVPersist[A-Z][A-Za-z0-9]+", name)
        tree = promql_parser.parse(rule["expr"])  # raises on a syntax or type error
        assert not isinstance(tree, promql_parser.MatrixSelector | promql_parser.StringLiteral | promql_parser.NumberLiteral)
        assert promql_parser.parse_duration(rule["for"]).total_seconds() >= 300, name
        assert rule["labels"]["severity"] in SEVERITIES, name
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        assert annotations["runbook_url"] == f"{RUNBOOK_BASE}#{name.lower()}", name
        assert name.lower() in anchors, f"docs/runbooks.md has no section ## {name}"
        for text in annotations.values():
            assert text.count("{{") == text.count("}}"), (name, text)
            for label in re.findall(r"\$labels\.(\w+)", text):  # only labels the expression keeps
                assert re.search(rf"by \([^)]*\b{label}\b", rule["expr"]), (name, label)


def test_every_runbook_section_has_its_alert() -> None:
    sections = {h for h in re.findall(r"^## (KVPersist\w+)$", RUNBOOKS.read_text(), flags=re.M)}
    assert sections == {r["alert"] for r in _rules()}


def test_rules_read_only_what_the_operator_exposes() -> None:
    """A misspelled metric, label or condition type would make an alert that never fires."""
    families = metrics.families()
    reasons = (REPO / "operator/kvpersist/status/conditions.py").read_text()
    seen = set()
    for rule in _rules():
        for name, matchers in _selectors(rule["expr"]):
            assert name in families, (rule["alert"], name)
            seen.add(name)
            for label, op, value in matchers:
                assert label in LABELS, (rule["alert"], label)
                if label == "type" and op == "MatchOp.Equal":
                    assert value in TYPES, (rule["alert"], value)
                if label == "status":
                    assert value in ("True", "False", "Unknown"), (rule["alert"], value)
                if label == "reason":
                    assert f'"{value}"' in reasons, (rule["alert"], value)
    assert {metrics.CONDITION, "kvpersist_resource_l2_write_failures_total", "kvpersist_status_refreshes_total",
            "kvpersist_resource_last_refresh_timestamp_seconds"} <= seen


def test_the_parser_refuses_what_prometheus_refuses() -> None:
    """The check above can fail: a range where an instant vector is due, an unknown function."""
    for bad in ("rate(kvpersist_resource_hit_tokens_total)", "ratee(x[5m])", 'x{a="b"', "x and 1"):
        with pytest.raises(Exception):  # noqa: B017  (the binding raises its own error types)
            promql_parser.parse(bad)


def test_promtool_loads_the_rules_and_their_unit_tests_pass(tmp_path: Path) -> None:
    """Prometheus's own rule loader and rule unit tests. hack/test.sh puts promtool on PATH
    (hack/promtool.sh); without it this test is a skip, which fails that run (KVPERSIST_SKIPS_FAIL)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH: `export PATH=$(bash hack/promtool.sh):$PATH` (hack/test.sh does)")
    check = subprocess.run([promtool, "check", "rules", str(PLAIN)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")  # promtool compares annotations too; the tests are about when alerts fire
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(doc))
    tests = yaml.safe_load(PROMTOOL_TESTS.read_text())
    tests["rule_files"] = [str(tmp_path / "rules.yaml")]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    run = subprocess.run([promtool, "test", "rules", str(tmp_path / "tests.yaml")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    tested = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]}
    assert tested == {r["alert"] for r in _rules()}


def test_dashboard_queries_parse_and_read_what_the_operator_exposes() -> None:
    """The Grafana dashboard's queries, with its variables filled in as Grafana would: they parse,
    the operator's series they read exist, and L2 usage and failed writes stand beside the hit rate."""
    import json

    dash = json.loads((REPO / "charts/kvpersist/files/grafana-dashboard.json").read_text())
    families = metrics.families()
    read: set[str] = set()
    for panel in dash["panels"]:
        for t in panel["targets"]:
            expr = t["expr"].replace("$__rate_interval", "5m").replace("$__range", "6h")
            expr = expr.replace("$namespace", ".*").replace("$kvcachenamespace", ".*")
            for name, _ in _selectors(expr):
                assert not name.startswith("kvpersist_") or name in families, (panel["title"], name)
                read.add(name)
    assert {"kvpersist_resource_l2_used_bytes", "kvpersist_resource_l2_write_failures_total"} <= read
    titles = {p["title"]: p["gridPos"] for p in dash["panels"]}
    assert titles["L2 usage"]["y"] == titles["L2 writes failed per second"]["y"] < titles["Hit rate per tier"]["y"]
