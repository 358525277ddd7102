"""Generates the KVCacheNamespace CustomResourceDefinition from the pydantic models.

pydantic writes JSON Schema (draft 2020-12, with $refs and anyOf-null for optional fields);
Kubernetes wants a structural OpenAPI v3 schema (inlined, typed at every level, boolean
exclusiveMinimum). This module is that translation and nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvpersist.api import v1alpha1 as api

_DROP = {"title"}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return node


KEY_PATTERNS = {
    api.NO_CONTROL_PATTERN: "no control or format character (Unicode Cc, Cf, Zl, Zp: NUL, TAB, CR, LF, bidi controls "
                            "such as U+202E)",
    api.QUALIFIED_NAME: "a qualified name as Kubernetes has it, e.g. memory or nvidia.com/gpu: an optional DNS "
                        "subdomain and /, then at most 63 letters, digits, -, _ or ., a letter or digit at each end",
}


KEY_LENGTHS = {api.QUALIFIED_NAME: {"minLength": 1, "maxLength": 317}}


def _key_rule(names: dict[str, Any]) -> dict[str, str]:
    """propertyNames (the schema of a map's keys, which pydantic writes) as a CEL rule: a raw
    string, so the pattern's \\x{...} escapes reach RE2 as written."""
    # pydantic < 2.9 writes only the pattern of a map's keys (patternProperties): the lengths of a
    # known key type come from here then, so every pydantic writes the same rule.
    names = {**KEY_LENGTHS.get(names.get("pattern", ""), {}), **names}
    unknown = set(names) - {"minLength", "maxLength", "pattern"}
    if unknown or "'" in names.get("pattern", ""):
        raise ValueError(f"propertyNames not translated to CEL: {names}")
    checks = [f"k.size() >= {names['minLength']}"] if "minLength" in names else []
    checks += [f"k.size() <= {names['maxLength']}"] if "maxLength" in names else []
    checks += [f"k.matches(r'{names['pattern']}')"] if "pattern" in names else []
    size = f"{names.get('minLength', 0)} to {names['maxLength']}" if "maxLength" in names else "any number of"
    shape = KEY_PATTERNS.get(names["pattern"], f"matching {names['pattern']}") if "pattern" in names else "any text"
    message = f"each key: {shape} ({size} characters)"
    return api.cel(f"self.all(k, {' && '.join(checks) or 'true'})", message, reason="FieldValueInvalid")


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One pydantic schema node as a structural OpenAPI v3 node."""
    node = _resolve(node, defs)
    if len(node.get("allOf", ())) == 1:  # pydantic < 2.9 wraps a described $ref: {"allOf": [{"$ref": ...}], ...}
        rest = {k: v for k, v in node.items() if k != "allOf"}
        return structural({**_resolve(node["allOf"][0], defs), **rest}, defs)
    if node.get("x-kubernetes-int-or-string"):
        return {k: v for k, v in node.items() if k not in _DROP}
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if len(branches) != 1:
            raise ValueError(f"union types are not structural: {node}")
        inner = _resolve(branches[0], defs)
        if rest.get("default", ...) is None:
            rest.pop("default")
        return structural({**inner, **rest}, defs)
    if "patternProperties" in node:  # pydantic's spelling of a map whose keys have a pattern
        (pattern, values), *more = node["patternProperties"].items()
        if more or "additionalProperties" in node:
            raise ValueError(f"patternProperties not translated: {node}")
        node = {**{k: v for k, v in node.items() if k != "patternProperties"}, "additionalProperties": values,
                "propertyNames": {**node.get("propertyNames", {}), "pattern": pattern}}
    out: dict[str, Any] = {}
    key_rule: dict[str, str] | None = None
    for key, value in node.items():
        if key in _DROP or key == "$defs":
            continue
        if key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = structural(value, defs)
        elif key == "additionalProperties":
            # False (pydantic's extra="forbid") is not structural; the API server prunes and,
            # with kubectl's default strict field validation, refuses unknown fields anyway.
            if isinstance(value, dict):
                out[key] = structural(value, defs)
        elif key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "const":
            out["enum"] = [value]
        elif key == "propertyNames":
            # Not in a CRD's schema: the map's keys are checked by a CEL rule over them instead.
            key_rule = _key_rule(value)
        else:
            out[key] = value
    if key_rule is not None:  # last, where every pydantic version puts it
        out["x-kubernetes-validations"] = [*out.pop("x-kubernetes-validations", []), key_rule]
    if out.get("type") == "number":  # one spelling whatever pydantic wrote (versions differ: 0 or 0.0)
        out.update({k: float(out[k]) for k in ("minimum", "maximum", "default") if isinstance(out.get(k), int)})
    if "enum" in out and "type" not in out:
        first = out["enum"][0]
        out["type"] = "integer" if isinstance(first, int) else "string"
    if "properties" in out:
        out["type"] = "object"
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "type" not in out:
        raise ValueError(f"schema node without a type: {node}")
    return out


def _schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


def build_crd() -> dict[str, Any]:
    spec = _schema(api.KVCacheNamespaceSpec)
    status = _schema(api.KVCacheNamespaceStatus)
    root = {
        "type": "object",
        "description": "A persistent, identity-namespaced KV cache for vLLM served by LMCache.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [
            api.cel(
                f"self.metadata.name.size() <= {api.MAX_NAME_LENGTH} && self.metadata.name.matches('{api.NAME_PATTERN}')",
                api.NAME_RULE,
                reason="FieldValueInvalid",
            ),
        ],
    }
    ready = '.status.conditions[?(@.type=="Ready")]'
    columns = [
        {"name": "Namespace-ID", "type": "string", "jsonPath": ".status.namespaceId"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        # The Ready condition itself, and why: "VLLM 1/1" alone reads as ready while the cache is off.
        {"name": "Ready", "type": "string", "jsonPath": f"{ready}.status", "description": "The Ready condition"},
        {"name": "Reason", "type": "string", "jsonPath": f"{ready}.reason", "description": "Why Ready is what it is"},
        {"name": "VLLM", "type": "string", "jsonPath": ".status.replicas", "description": "vLLM pods ready/wanted"},
        {"name": "L2", "type": "string", "jsonPath": ".status.l2Kind"},
        {"name": "L1-Used", "type": "string", "jsonPath": ".status.usage.l1Used"},
        {"name": "L2-Used", "type": "string", "jsonPath": ".status.usage.l2Used"},
        {"name": "Hit", "type": "string", "jsonPath": ".status.hits.summary",
         "description": "Cache hit rate over the last 5 minutes, else in total"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    # kubectl scale and a HorizontalPodAutoscaler act on spec.vllm.replicas (the lmcache servers
    # are sized by hand: each holds L1 that a scale-down would lose).
    scale = {"specReplicasPath": ".spec.vllm.replicas", "statusReplicasPath": ".status.vllmReplicas",
             "labelSelectorPath": ".status.vllmSelector"}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{api.PLURAL}.{api.GROUP}",
            "annotations": {"argocd.argoproj.io/sync-wave": "-1"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": api.SHORT_NAMES,
                "categories": ["kvpersist"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": scale},
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


HEADER = "# Generated by `kvpersist crd` from operator/kvpersist/api/v1alpha1.py. Do not edit.\n"


def render_crd() -> str:
    return HEADER + yaml.dump(build_crd(), Dumper=_NoAliases, sort_keys=False, width=120)


class _NoAliases(yaml.SafeDumper):
    """Writes a schema shared by two fields twice, never as a YAML anchor and alias (older pydantic
    shares such dicts; the CRD must read the same whichever pydantic wrote it)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


CRD_PATHS = [Path("crds") / f"{api.PLURAL}.{api.GROUP}.yaml"]


def write_crds(root: Path) -> list[Path]:
    """Writes the CRD to every committed copy under root; returns the paths written."""
    text = render_crd()
    written = []
    for rel in CRD_PATHS + [p for p in [Path("charts/kvpersist/crds") / CRD_PATHS[0].name] if (root / p.parent).is_dir()]:
        (root / rel).write_text(text)
        written.append(root / rel)
    return written
