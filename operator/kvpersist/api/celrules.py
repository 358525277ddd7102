"""The CRD's own CEL rules (x-kubernetes-validations), each written once beside its model, evaluated by the
models on the object as the API server stores it: the operator refuses what `kubectl apply` refuses, in the
same words. Transition rules (oldSelf) are skipped: the models have no old object. Kubernetes' quantity
library is bound here (kvpersist.api.quantity); a quantity travels through CEL as a one-key map.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

from kvpersist.api import celengine, quantity

celexpr = celengine.extension()

_QUANTITY_KEY = "kvpersist.dev/quantity"
_OLD_SELF = re.compile(r"\boldSelf\b")


def cel(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict[str, str]:
    """One x-kubernetes-validations entry."""
    optional = {"fieldPath": field_path, "reason": reason}
    return {"rule": rule, "message": message, **{k: v for k, v in optional.items() if v}}


def _to_cel(q: quantity.Quantity) -> dict[str, str]:
    return {_QUANTITY_KEY: f"{q.unscaled}/{q.scale}/{int(q.fast)}"}


def _from_cel(value: Any) -> quantity.Quantity:
    if not isinstance(value, dict) or set(value) != {_QUANTITY_KEY}:
        raise TypeError(f"not a quantity: {value!r}")
    unscaled, scale, fast = value[_QUANTITY_KEY].split("/")
    return quantity.Quantity(int(unscaled), int(scale), fast == "1")


def _as_integer(value: Any) -> int:
    number = _from_cel(value).value
    if number != number.to_integral_value() or not -(2**63) <= number <= quantity.MAX_INT64:
        raise ValueError("cannot convert value to integer")
    return int(number)


def _compare(a: Any, b: Any) -> int:
    x, y = _from_cel(a).value, _from_cel(b).value
    return (x > y) - (x < y)


def _is_quantity(text: str) -> bool:
    try:
        quantity.parse(text)
    except ValueError:
        return False
    return True


# Kubernetes' quantity library (k8s.io/apiserver/pkg/cel/library/quantity.go), less add and sub:
# no rule uses them (a rule that did would fail every sample, tests/unit/test_cel_rules.py).
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": lambda text: _to_cel(quantity.parse(text)),
    "isQuantity": _is_quantity,
    "asApproximateFloat": lambda q: quantity.as_approximate_float(_from_cel(q)),
    "asInteger": _as_integer,
    "isInteger": lambda q: (v := _from_cel(q).value) == v.to_integral_value() and -(2**63) <= v <= quantity.MAX_INT64,
    "sign": lambda q: (lambda v: (v > 0) - (v < 0))(_from_cel(q).value),
    "compareTo": _compare,
    "isGreaterThan": lambda a, b: _compare(a, b) > 0,
    "isLessThan": lambda a, b: _compare(a, b) < 0,
}


_program = functools.cache(celexpr.compile)
_FIELD_OF_SELF = re.compile(r"\bself\.([A-Za-z_][A-Za-z0-9_]*)\b(?!\s*\()")
_SELF = re.compile(r"\bself\b")


@functools.cache
def _fields_read(rule: str) -> frozenset[str] | None:
    """The fields of self a rule reads when it reads self only through them (`self.a.b`), else None:
    the library converts self in full for every evaluation, and most rules read two fields."""
    fields = _FIELD_OF_SELF.findall(rule)
    return frozenset(fields) if len(fields) == len(_SELF.findall(rule)) else None


def holds(rule: str, value: Any) -> bool:
    """Whether a rule holds with self = value; an evaluation error is a refusal, as on the API server."""
    fields = _fields_read(rule) if isinstance(value, dict) else None
    if fields is not None:
        value = {k: v for k, v in value.items() if k in fields}
    return _holds(rule, json.dumps(value, sort_keys=True))


# Remembered by value: the library compiles a rule's regular expression at every call of matches()
# (a fifth of a millisecond for the extraArgs allow-list), and the same lists, maps and sections
# recur across specs and across reads of one spec.
@functools.lru_cache(maxsize=4096)
def _holds(rule: str, value_json: str) -> bool:
    context = celexpr.Context(variables={"self": json.loads(value_json)}, functions=FUNCTIONS)
    try:
        result = _program(rule).execute(context)
    except Exception:  # the library raises RuntimeError, KeyError, ...: each one refuses
        return False
    return result is True


def json_numbers(schema: dict[str, Any], value: Any, path: str) -> Any:
    """value with its JSON numbers read as the API server reads them against the schema: an integral
    float is an integer where one is wanted (2.0 replicas), and a boolean is never a number, not even
    for an enum of integers (pydantic's Literal[1, 8] would take true): ValueError naming the field."""
    kind = "integer" if schema.get("x-kubernetes-int-or-string") else schema.get("type")
    if isinstance(value, bool):
        if kind in ("integer", "number"):
            raise ValueError(f"{path}: {str(value).lower()} is not of type {kind}")
        return value
    if isinstance(value, float) and kind == "integer" and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        if props is not None:
            return {k: json_numbers(props[k], v, f"{path}.{k}") if k in props else v for k, v in value.items()}
        if isinstance(extra, dict):
            return {k: json_numbers(extra, v, f"{path}[{k}]") for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [json_numbers(schema["items"], v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


def violations(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    """`path.fieldPath: message` for every rule of a structural schema (and of every node under it)
    that value breaks, as the API server reports them; transition rules are not judged."""
    out: list[str] = []
    for rule in schema.get("x-kubernetes-validations", ()):
        if not _OLD_SELF.search(rule["rule"]) and not holds(rule["rule"], value):
            where = path + rule.get("fieldPath", "")
            out.append(f"{where}: {rule['message']}" if where else rule["message"])
    if isinstance(value, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, sub in value.items():
            if props is not None and key in props:
                out += violations(props[key], sub, f"{path}.{key}")
            elif props is None and isinstance(extra, dict):
                out += violations(extra, sub, f"{path}[{key}]")
    elif isinstance(value, list) and "items" in schema:
        for i, sub in enumerate(value):
            out += violations(schema["items"], sub, f"{path}[{i}]")
    return out
