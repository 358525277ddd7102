"""A pydantic model's JSON Schema ($refs, anyOf-null) as the structural OpenAPI v3 schema a CRD
carries (inlined, typed at every level): the CRD is built from it, and the models walk it for CEL."""

from __future__ import annotations

from typing import Any

from kvpersist.api.celrules import cel
from kvpersist.api.text import NO_CONTROL_PATTERN

_DROP = {"title"}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:  # the node's own keys (a description) over its target's
        node = {**defs[node["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
    return node


# Kubernetes' qualified names (label keys, resource names such as nvidia.com/gpu): here because a
# map keyed by them gets a CEL rule over its keys (_key_rule), and spec's key type uses it.
LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
QUALIFIED_NAME = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?" + LABEL_NAME + "$"

KEY_PATTERNS = {
    NO_CONTROL_PATTERN: "no control or format character (Unicode Cc, Cf, Zl, Zp: NUL, TAB, CR, LF, bidi controls "
                            "such as U+202E)",
    QUALIFIED_NAME: "a qualified name as Kubernetes has it, e.g. memory or nvidia.com/gpu: an optional DNS "
                        "subdomain and /, then at most 63 letters, digits, -, _ or ., a letter or digit at each end",
}
KEY_LENGTHS = {QUALIFIED_NAME: {"minLength": 1, "maxLength": 317}}
KEY_CHECKS = {"minLength": "k.size() >= {}", "maxLength": "k.size() <= {}", "pattern": "k.matches(r'{}')"}  # CEL, key k


def _key_rule(names: dict[str, Any]) -> dict[str, str]:
    """propertyNames (a map's key schema) as a CEL rule: a raw string, so \\x{...} escapes reach RE2 as
    written. pydantic < 2.9 writes only the pattern: a known key type's lengths come from KEY_LENGTHS."""
    names = {**KEY_LENGTHS.get(names.get("pattern", ""), {}), **names}
    if set(names) - set(KEY_CHECKS) or "'" in names.get("pattern", ""):
        raise ValueError(f"propertyNames not translated to CEL: {names}")
    checks = [check.format(names[key]) for key, check in KEY_CHECKS.items() if key in names]
    size = f"{names.get('minLength', 0)} to {names['maxLength']}" if "maxLength" in names else "any number of"
    shape = KEY_PATTERNS.get(names["pattern"], f"matching {names['pattern']}") if "pattern" in names else "any text"
    return cel(f"self.all(k, {' && '.join(checks) or 'true'})", f"each key: {shape} ({size} characters)",
               reason="FieldValueInvalid")


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
        if len(branches) != 1:
            raise ValueError(f"union types are not structural: {node}")
        rest = {k: v for k, v in node.items() if k != "anyOf" and not (k == "default" and v is None)}
        return structural({**_resolve(branches[0], defs), **rest}, defs)
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
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):  # boolean in OpenAPI v3, beside the bound
            out[key[9:].lower()], out[key] = value, True
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
        out["type"] = "integer" if isinstance(out["enum"][0], int) else "string"
    if "properties" in out:
        out["type"] = "object"
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "type" not in out:
        raise ValueError(f"schema node without a type: {node}")
    return out


def schema_of(model: type) -> dict[str, Any]:
    """A model's structural schema, as the CRD carries it (its CEL rules included)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))
