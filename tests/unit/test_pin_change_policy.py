"""The pin-change warning without a cluster: the committed policy is the generated one, the chart
ships the same objects behind pinChangeWarning.enabled (on by default; `helm template` and `helm
lint`), the policy compares every field of id_fields and only those, and warns, never refuses.
The API server's side (its type check, the CEL run, kubectl's Warning text):
tests/e2e/test_pin_change_plan.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpersist.api import pinchange
from kvpersist.api.identity import id_fields
from kvpersist.identity import IMAGE_DIGEST_RE
from kvpersist.status.usage import human_bytes
from tests import rbac_needs as rb

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / pinchange.CONFIG_PATH
TEMPLATE = ROOT / pinchange.TEMPLATE_PATH


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_committed_files_are_generated() -> None:
    assert CONFIG.read_text() == pinchange.render_config(), "stale: run `kvpersist pin-change-policy --write`"
    assert TEMPLATE.read_text() == pinchange.render_template(), "stale: run `kvpersist pin-change-policy --write`"


def test_write_writes_both(tmp_path: Path) -> None:
    written = pinchange.write(tmp_path)
    assert [p.relative_to(tmp_path) for p in written] == [pinchange.CONFIG_PATH, pinchange.TEMPLATE_PATH]
    assert written[0].read_text() == CONFIG.read_text()


def test_chart_ships_the_same_policy_as_config_on_by_default() -> None:
    """The template with the chart's names and labels taken out is the plain manifest."""
    template = TEMPLATE.read_text()
    assert "{{- if .Values.pinChangeWarning.enabled }}" in template
    assert yaml.safe_load((ROOT / "charts/kvpersist/values.yaml").read_text())["pinChangeWarning"] == {"enabled": True}
    rendered = template.replace(pinchange.BINDING_SCOPE, "")  # empty without watchNamespaces
    rendered = re.sub(r"\{\{-? (if|end)[^}]*\}\}\n?", "", rendered)
    rendered = re.sub(r"\n *labels: \{\{-[^}]*\}\}", "", rendered)
    rendered = rendered.replace('{{ include "kvpersist.fullname" . }}', "kvpersist")
    assert "{{" not in rendered
    assert _docs(rendered) == _docs(CONFIG.read_text())


def test_it_warns_on_spec_updates_and_never_refuses() -> None:
    policy, binding = _docs(CONFIG.read_text())
    assert binding["spec"] == {"policyName": "kvpersist-pin-change-warning", "validationActions": ["Warn"]}
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Ignore"  # an error in the policy admits the change
    # The main resource only: status and scale are subresources (the operator's writes, kubectl scale).
    assert spec["matchConstraints"]["resourceRules"] == [{"apiGroups": ["kvpersist.dev"], "apiVersions": ["*"],
                                                          "operations": ["UPDATE"], "resources": ["kvcachenamespaces"]}]
    [check] = spec["validations"]
    assert check["expression"].strip() == "size(variables.changed) == 0 || variables.served == ''"
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert variables["served"].strip().endswith("? oldObject.status.namespaceId : ''")
    message = check["messageExpression"]
    for part in ("variables.changed.join(', ')", "variables.served", "variables.held", "`kvpersist gc '",
                 "kubectl kvpersist plan -f FILE"):
        assert part in message, part
    assert "oldObject.status.usage.l2UsedBytes" in variables["bytes"]
    assert "oldObject.status.usage.l2Objects" in variables["objects"]
    assert "oldObject.status.hits.summary" in variables["hits"]


def test_every_field_that_moves_the_id_is_compared_and_nothing_else() -> None:
    """One entry per id_fields path, each comparing oldObject's value with object's; an image by
    the digest identity.image_digest reads."""
    changed = {v["name"]: v["expression"] for v in _docs(CONFIG.read_text())[0]["spec"]["variables"]}["changed"]
    entries = re.findall(r"\? '(spec\.[A-Za-z0-9.]+)' : ''", changed)
    assert entries == [f.path for f in id_fields()]
    body = changed[changed.index("[\n") + 2:changed.rindex("\n]")]
    for f in id_fields():
        entry = next(e for e in body.split(",\n") if e.endswith(f"? '{f.path}' : ''"))
        assert f"string(oldObject.{f.path})" in entry and f"string(object.{f.path})" in entry, entry
        assert (".find('" in entry) == (f.kind == "digest"), entry
    assert IMAGE_DIGEST_RE.pattern.replace("(", "").replace(")", "") == pinchange.DIGEST_RE


def _cel_round(n: int) -> str:
    """The size variables' integer arithmetic, transcribed to Python: a check of the method (one
    decimal, half to even on the exact quotient), not of the CEL text (the e2e test runs that on
    the API server)."""
    unit = next((size for _, size in pinchange.UNITS if n >= size), 1)
    if unit == 1:
        return f"{n}B"
    quotient, remainder = n * 10 // unit, n * 10 % unit
    tenths = quotient + (1 if 2 * remainder > unit or (2 * remainder == unit and quotient % 2 == 1) else 0)
    name = dict((size, name) for name, size in pinchange.UNITS)[unit]
    return f"{tenths // 10}" + ("" if tenths % 10 == 0 else f".{tenths % 10}") + name


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1075, 1280, 1331, 1536, 10_239, 2**20 - 1, 2**20, 13_207_024_435,
                               2**40 * 3 + 2**39, 2**50])
def test_the_size_arithmetic_matches_human_bytes(n: int) -> None:
    assert _cel_round(n) == human_bytes(n)


def test_the_size_arithmetic_matches_human_bytes_everywhere_below_a_mebibyte_and_around_each_unit() -> None:
    values = [*range(0, 2**20, 7), *(u * k + d for _, u in pinchange.UNITS for k in (1, 2, 999, 1023) for d in range(-3, 4))]
    assert [v for v in values if _cel_round(v) != human_bytes(v)] == []


def _template(helm: Path, *sets: str) -> list[dict[str, Any]]:
    args = [str(helm), "template", "kvpersist", str(rb.CHART), "--namespace", "kvpersist-system"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _ours(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")
            and d["metadata"]["name"].endswith("-pin-change-warning")]


def test_helm_template_renders_it_by_default_and_not_when_off(helm: Path) -> None:
    on = _ours(_template(helm))
    assert [d["kind"] for d in on] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    [creator] = [d for d in _template(helm) if d["metadata"]["name"] == "kvpersist-creator-rights"
                 and d["kind"] == "ValidatingAdmissionPolicy"]
    assert on[0]["metadata"]["labels"] == creator["metadata"]["labels"]  # the chart's labels
    plain = _docs(CONFIG.read_text())
    for rendered, want in zip(on, plain, strict=True):
        assert rendered["spec"] == want["spec"]
    assert _ours(_template(helm, "pinChangeWarning.enabled=false")) == []


@pytest.mark.parametrize("value", ["true", "false"])
def test_chart_lints_either_way(helm: Path, value: str) -> None:
    out = subprocess.run([str(helm), "lint", "--strict", str(rb.CHART), "--set", f"pinChangeWarning.enabled={value}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
