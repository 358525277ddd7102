"""The CRD's own CEL rules, evaluated by the models on the object as the API server stores it, so the operator
refuses what `kubectl apply` refuses, in the same words (transition rules skipped: the models have no old object).
Kubernetes' quantity library is bound here (kvpersist.api.quantity); a quantity travels through CEL as a one-key map."""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from kvpersist.api import quantity

PACKAGE = "cel"
EXTENSION = "cel.cel"  # the name the package itself imports it by: one module, whichever loads it first


def extension() -> ModuleType:
    """The library's Rust extension without its package: `import cel` runs the package's __init__, which
    imports its REPL (typer, rich, ...), 27 MiB of every process that validates a spec (issue 58). Through
    the package where the layout is another. It initialises once a process (a second time it panics):
    whoever loads it first, the package or this, the other finds it in sys.modules."""
    loaded = sys.modules.get(EXTENSION)
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec(PACKAGE)
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    paths = [Path(f) / f"cel{suffix}" for f in folders for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    path = next((p for p in paths if p.is_file()), None)
    if path is None:
        return importlib.import_module(PACKAGE)
    loader = importlib.machinery.ExtensionFileLoader(EXTENSION, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(EXTENSION, loader))
    loader.exec_module(module)
    sys.modules[EXTENSION] = module
    return module


celexpr = extension()

_QUANTITY_KEY = "kvpersist.dev/quantity"
_OLD_SELF = re.compile(r"\boldSelf\b")


def cel(rule: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict[str, str]:
    """One x-kubernetes-validations entry."""
    optional = {"fieldPath": field_path, "reason": reason}
    return {"rule": rule, "message": message, **{k: v for k, v in optional.items() if v}}


def _to_cel(q: quantity.Quantity) -> dict[str, str]:
    return {_QUANTITY_KEY: f"{q.unscaled}/{q.scale}"}


def _from_cel(value: Any) -> quantity.Quantity:
    unscaled, scale = value[_QUANTITY_KEY].split("/")
    return quantity.Quantity(int(unscaled), int(scale))


# Kubernetes' quantity library (k8s.io/apiserver/pkg/cel/library/quantity.go), only what the rules call:
# a rule calling another would fail every sample (tests/unit/test_cel_rules.py).
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": lambda text: _to_cel(quantity.parse(text)),
    "asApproximateFloat": lambda q: quantity.as_approximate_float(_from_cel(q)),
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
