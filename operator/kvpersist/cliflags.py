"""The flags every user command shares, spelled and defaulted as kubectl's: `-n` is the kubeconfig
context's namespace unless given, `-A` every namespace, `-o table|wide|json|yaml|name|jsonpath=...`,
`--kubeconfig` and `--context`. One place, so `status`, `report`, `gc` and `plan` cannot drift apart."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import kubernetes
import yaml

OUTPUTS = ("table", "wide", "json", "yaml", "name")
JSONPATH = "jsonpath="


def add_cluster_flags(cmd: argparse.ArgumentParser, all_namespaces: bool = True) -> None:
    """-n/--namespace (and -A where a command can span namespaces), --kubeconfig, --context."""
    cmd.add_argument("-n", "--namespace", help="the namespace (default: the kubeconfig context's, as kubectl)")
    if all_namespaces:
        cmd.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    cmd.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    cmd.add_argument("--context", default=None, help="kubeconfig context")


def add_output_flag(cmd: argparse.ArgumentParser, choices: Sequence[str] = OUTPUTS) -> None:
    """-o: one of choices, or jsonpath=TEMPLATE (kubectl's template syntax over what -o json prints)."""

    def output(value: str) -> str:
        if value in choices:
            return value
        if value.startswith(JSONPATH):
            try:
                _template(value[len(JSONPATH):])
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"-o {value}: {exc}") from None
            return value
        raise argparse.ArgumentTypeError(f"-o {value}: use one of {', '.join(choices)} or jsonpath=TEMPLATE, "
                                         "e.g. jsonpath='{[*].name}'")

    cmd.add_argument("-o", "--output", type=output, default=choices[0], metavar="FORMAT",
                     help=f"output format: {', '.join(choices)} or jsonpath=TEMPLATE (over what -o json prints, "
                     f"e.g. '{{[*].name}}'; default {choices[0]})")


def context_namespace(kubeconfig: str | None, context: str | None) -> str:
    """What kubectl uses without -n: the namespace of the context in use (or named), else `default`."""
    try:
        contexts, active = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)
    except (kubernetes.config.ConfigException, OSError):
        return "default"
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
    return ((chosen or {}).get("context") or {}).get("namespace") or "default"


def namespace_of(args: argparse.Namespace) -> str | None:
    """None with -A (every namespace), else -n or the context's namespace."""
    return None if getattr(args, "all_namespaces", False) else (args.namespace or context_namespace(args.kubeconfig, args.context))


def emit(output: str, data: Any, table: Callable[[bool], str], name_of: Callable[[Any], str] = str) -> str:
    """The text for one -o: json, yaml or jsonpath of the data, one name_of(item) a line, else the table."""
    if output == "json":
        return json.dumps(data, indent=2)
    if output == "yaml":
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False).rstrip("\n")
    if output.startswith(JSONPATH):
        return jsonpath(output[len(JSONPATH):], data)
    if output == "name":
        return "\n".join(name_of(item) for item in (data if isinstance(data, list) else [data]))
    return table(output == "wide")


# ------------------------------------------------------------------ kubectl's jsonpath, the part people use

_BLOCK = re.compile(r"\{((?:[^{}\"]|\"(?:[^\"\\]|\\.)*\")*)\}")
_STEP = re.compile(r"\.([\w-]+|\*)|\[(\*|-?\d+|'[^']*'|\"[^\"]*\"|\?\(@((?:\.[\w-]+)+)\s*(==|!=)\s*(\S+?)\))\]")


def _template(text: str) -> list[tuple[Any, ...]]:
    """The template's parts: ("text", literal), ("path", expr), ("range", expr, [its body's parts]). Raises ValueError."""
    parts: list[tuple[Any, ...]] = []
    ranges: list[tuple[str, list[tuple[Any, ...]]]] = []  # each open {range}: its expr, the parts before it
    pos = 0
    for m in _BLOCK.finditer(text):
        if "{" in text[pos:m.start()] or "}" in text[pos:m.start()]:
            raise ValueError(f"unbalanced braces near {text[pos:m.start()]!r}")
        parts.append(("text", text[pos:m.start()]))
        inner = m.group(1).strip()
        if inner.startswith('"'):
            parts.append(("text", json.loads(inner, strict=False)))  # a quoted literal: "\n", "\t"
        elif inner == "end":
            if not ranges:
                raise ValueError("{end} without {range}")
            expr, before = ranges.pop()
            parts = [*before, ("range", expr, parts)]
        elif inner.startswith("range "):
            ranges.append((_checked(inner[len("range "):].strip()), parts))
            parts = []
        else:
            parts.append(("path", _checked(inner)))
        pos = m.end()
    if "{" in text[pos:] or "}" in text[pos:]:
        raise ValueError(f"unbalanced braces near {text[pos:]!r}")
    if ranges:
        raise ValueError("{range} without {end}")
    return [*parts, ("text", text[pos:])]


def _checked(expr: str) -> str:
    rest = expr[1:] if expr.startswith(("$", "@")) else expr
    if rest in ("", "."):
        return ""
    if _STEP.sub("", rest):
        raise ValueError(f"cannot read {expr!r}: use .field, [n], [*], ['key'] or [?(@.field==value)]")
    return rest


def _select(expr: str, root: Any) -> list[Any]:
    nodes = [root]
    for m in _STEP.finditer(expr):
        nodes = [found for node in nodes for found in _step(node, m.group(1), m.group(2), m)]
    return nodes


def _step(node: Any, key: str | None, index: str | None, m: re.Match[str]) -> Iterator[Any]:
    if key == "*" or index == "*":
        yield from (node.values() if isinstance(node, dict) else node if isinstance(node, list) else ())
    elif key is not None or (index is not None and index[0] in "'\""):
        name = key if key is not None else index[1:-1]  # type: ignore[index]
        if isinstance(node, dict) and name in node:
            yield node[name]
    elif index is not None and index.startswith("?"):
        want = m.group(5).strip("'\"")
        for item in node if isinstance(node, list) else ():
            got = _select(m.group(3), item)
            equal = bool(got) and _text(got[0]) == want
            if equal == (m.group(4) == "=="):
                yield item
    elif index is not None and isinstance(node, list) and -len(node) <= int(index) < len(node):
        yield node[int(index)]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def jsonpath(template: str, data: Any) -> str:
    """kubectl's -o jsonpath over data: fields, indexes, [*], simple filters, {range}..{end} and
    quoted literals; each match printed as kubectl does (strings bare, the rest as JSON, space apart)."""

    def render(parts: list[tuple[Any, ...]], root: Any) -> str:
        out = []
        for kind, value, *body in parts:
            if kind == "text":
                out.append(value)
            elif kind == "path":
                out.append(" ".join(_text(v) for v in _select(value, root)))
            else:  # range: the body once per match
                out.extend(render(body[0], item) for item in _select(value, root))
        return "".join(out)

    return render(_template(template), data)
