"""docs/api-reference.md, generated from the CRD the models make (build_crd): every field of spec
and status with its type, default, bounds, description and the rules the API server checks on it,
so the reference cannot say what the API does not. `kvpersist-operator api-reference --write`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvpersist.api import policyfiles
from kvpersist.api import v1alpha1 as api
from kvpersist.api.crd import build_crd

REFERENCE_PATH = Path("docs") / "api-reference.md"
_BOUNDS = (("minimum", "≥"), ("maximum", "≤"), ("minLength", "length ≥"), ("maxLength", "length ≤"),
           ("minItems", "items ≥"), ("maxItems", "items ≤"), ("maxProperties", "keys ≤"))


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    kind = node.get("type", "object" if "properties" in node else "any")
    if kind == "array":
        return f"list of {_type(node.get('items') or {})}"
    if kind == "object" and "additionalProperties" in node and "properties" not in node:
        return f"map of {_type(node['additionalProperties'] or {})}"
    return str(kind)


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _limits(node: dict[str, Any]) -> list[str]:
    out = [f"{word} {node[key]}" for key, word in _BOUNDS if key in node]
    if "enum" in node:
        out.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    if "pattern" in node:
        out.append(f"matches `{node['pattern']}`")
    out += [_cell(rule.get("message", rule["rule"])) for rule in node.get("x-kubernetes-validations") or []]
    return out


def _walk(node: dict[str, Any], path: str, required: bool) -> Iterator[tuple[str, dict[str, Any], bool]]:
    yield path, node, required
    for parent, prefix in ((node, path), (node.get("items") or {}, f"{path}[]")):  # an object's fields, a list's items'
        needed = set(parent.get("required") or [])
        for name, child in (parent.get("properties") or {}).items():
            yield from _walk(child, f"{prefix}.{name}", name in needed)


def render_reference() -> str:
    crd = build_crd()
    [version] = [v for v in crd["spec"]["versions"] if v.get("storage")]
    schema = version["schema"]["openAPIV3Schema"]["properties"]
    lines = [f"# {api.KIND} API reference ({api.GROUP}/{version['name']})", "",
             "Generated from the API models (`kvpersist-operator api-reference --write`); do not edit. "
             "The rules column holds what the API server refuses at `kubectl apply`, in its own words. "
             "Concepts and examples: [api.md](api.md).", ""]
    for part in ("spec", "status"):
        lines += [f"## {part}", "", "| field | type | default | rules | description |", "| --- | --- | --- | --- | --- |"]
        for path, node, required in _walk(schema[part], part, False):
            if path == part:
                continue
            default = f"`{json.dumps(node['default'], separators=(',', ':'))}`" if "default" in node else ""
            rules = ([] if not required else ["required"]) + _limits(node)
            lines.append(f"| `{path}` | {_type(node)} | {_cell(default)} | {'; '.join(rules)} | "
                         f"{_cell(node.get('description', ''))} |")
        lines.append("")
    return "\n".join(lines)


def write_reference(root: Path) -> list[Path]:
    return policyfiles.write(root, ((REFERENCE_PATH, render_reference()),))
