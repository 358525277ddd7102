"""What the generated admission policies share (kvpersist.api.pinchange, kvpersist.api.attachpolicy):
YAML as a person would write it, the chart's copy of a plain manifest under the release's name and
labels, and writing both committed copies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class NoAliases(yaml.SafeDumper):
    """Writes a node shared by two places twice, never as a YAML anchor and alias (older pydantic
    shares such dicts; the CRD must read the same whichever pydantic wrote it)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


class _Dumper(NoAliases):
    """CEL and messages as literal blocks (no quoting of their quotes), as a person would write
    them; short lists in flow style."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    block = "\n" in text or "'" in text or len(text) > 100
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if block else None)


def _list(dumper: yaml.SafeDumper, items: list[Any]) -> yaml.SequenceNode:
    flow = all(isinstance(i, str | int) for i in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flow)


_Dumper.add_representer(str, _str)
_Dumper.add_representer(list, _list)


def admission(kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """An admissionregistration.k8s.io/v1 object (a policy or its binding)."""
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind, "metadata": {"name": name}, "spec": spec}


def var(name: str, *lines: str) -> dict[str, str]:
    """A policy's CEL variable, its lines joined as the policy's YAML shows them."""
    return {"name": name, "expression": "\n  ".join(lines)}


def dump(doc: dict[str, Any]) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=1000)


def chart_doc(doc: dict[str, Any], policy: str) -> str:
    """A document of policy kvpersist-<policy> under the release's name, <fullname>-<policy> (its
    policyName too), and with the chart's labels."""
    plain_name, chart_name = f"kvpersist-{policy}", '{{ include "kvpersist.fullname" . }}-' + policy
    labels = '  labels: {{- include "kvpersist.labels" . | nindent 4 }}\n'
    text = dump(doc).replace(f"name: {plain_name}\n", f"name: {chart_name}\n{labels}", 1)
    return text.replace(f"policyName: {plain_name}\n", f"policyName: {chart_name}\n")


def write(root: Path, files: tuple[tuple[Path, str], ...]) -> list[Path]:
    """Writes each (path under root, text); returns the paths written."""
    for rel, text in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return [root / rel for rel, _ in files]


class CEL(str):
    """A CEL expression: cel_literal writes it as is, not as a string."""


def cel_literal(value: Any) -> str:
    """A JSON-like value as a CEL literal; a map whose values differ in type wraps each in dyn() (CEL's maps are
    homogeneous), one whose values agree does not."""
    if isinstance(value, CEL):
        return str(value)
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(cel_literal, value)) + "]"
    mixed = len({type(v) for v in value.values()}) > 1
    return "{" + ", ".join(f"{cel_literal(k)}: " + (f"dyn({cel_literal(v)})" if mixed else cel_literal(v))
                           for k, v in value.items()) + "}"
