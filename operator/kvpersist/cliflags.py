"""The flags every user command shares, spelled and defaulted as kubectl's: `-n` is the kubeconfig
context's namespace unless given, `-A` every namespace, `-o table|wide|json|yaml`, `--kubeconfig`
and `--context`. One place, so `status`, `report`, `gc` and `plan` cannot drift apart."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

import yaml

OUTPUTS = ("table", "wide", "json", "yaml")


def add_cluster_flags(cmd: argparse.ArgumentParser, all_namespaces: bool = True) -> None:
    """-n/--namespace (and -A where a command can span namespaces), --kubeconfig, --context."""
    cmd.add_argument("-n", "--namespace", help="the namespace (default: the kubeconfig context's, as kubectl)")
    if all_namespaces:
        cmd.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    cmd.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    cmd.add_argument("--context", default=None, help="kubeconfig context")


def add_output_flag(cmd: argparse.ArgumentParser, choices: Sequence[str] = OUTPUTS) -> None:
    cmd.add_argument("-o", "--output", choices=tuple(choices), default=choices[0],
                     help=f"output format: {', '.join(choices)} (default {choices[0]})")


def context_namespace(kubeconfig: str | None, context: str | None) -> str:
    """The namespace of the kubeconfig context in use (or the one named), `default` when it names
    none or there is no kubeconfig: what kubectl uses without -n."""
    import kubernetes

    try:
        contexts, active = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)
    except (kubernetes.config.ConfigException, OSError):
        return "default"
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
    return ((chosen or {}).get("context") or {}).get("namespace") or "default"


def namespace_of(args: argparse.Namespace) -> str | None:
    """None with -A (every namespace), else -n or the context's namespace."""
    if getattr(args, "all_namespaces", False):
        return None
    return args.namespace or context_namespace(args.kubeconfig, args.context)


def emit(output: str, data: Any, table: Callable[[bool], str]) -> str:
    """The text for one -o: json or yaml of the data itself, else the table (wide when asked)."""
    if output == "json":
        return json.dumps(data, indent=2)
    if output == "yaml":
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False).rstrip("\n")
    return table(output == "wide")
