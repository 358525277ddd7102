"""The `kvpersist` command (also `kubectl kvpersist ...`): `status`, `report` and `gc` are the admin's
view and explicit cleanup, `plan -f FILE` what an apply would do, `pins` a model's identity pins
from its Hub files, `version` and `completion`. The operator's own entry points are
`kvpersist-operator`'s: `run` starts the controller, `agent` is the inventory sidecar, `crd`,
`pin-change-policy`, `attach-policy` and `api-reference` print or write the generated CRD, pin-change
warning, attach policies and API reference."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from pathlib import Path
from typing import Any


def _fewer_malloc_arenas() -> None:
    """glibc gives each allocating thread an arena of its own (up to 8 per core): the operator's worker threads held
    mostly empty ones, tens of MiB of peak RSS at 500 resources. Two serve threads that mostly wait on the network.
    Set before any of them starts; not on other C libraries."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, 2)  # M_ARENA_MAX (malloc.h's parameter number): 2 arenas


def _run(args: argparse.Namespace) -> int:
    _fewer_malloc_arenas()
    import kopf

    from kvpersist.controller import (
        agentroll,
        handlers,  # noqa: F401  (importing it registers the kopf handlers)
        health,
        metrics,
        runtime,
    )
    from kvpersist.controller.policy import Policy

    try:  # the chart's allowedImages, secretLabel and metrics.scraper: a typo must stop the operator, not admit everything
        policy = Policy.from_env(os.environ)
        if policy.cluster_domain is None:
            raise ValueError("the cluster's DNS domain is unknown: /etc/resolv.conf has no svc.<domain> search entry "
                             "(not in a pod with cluster DNS?); set KVPERSIST_CLUSTER_DOMAIN (chart value clusterDomain), "
                             "the kubelet's --cluster-domain, e.g. cluster.local")
        endpoint = health.split_endpoint(args.liveness) if args.liveness else None
        runtime.CONTROLLER.policy = policy  # only once every value is good
    except ValueError as exc:
        print(f"kvpersist run: {exc}", file=sys.stderr)
        return 2
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat[args.log_format.upper()],
                   log_refkey="k8s" if args.log_format == "json" else None)
    if not args.verbose:
        runtime.quiet_event_handler_logs()
    agentroll.warn_if_unpinned()
    peering = None if args.standalone else args.peering
    priority = args.priority if args.priority is not None else runtime.random_priority()
    runtime.set_peering(peering, runtime.own_identity(), priority, tuple(args.namespace or ()))
    if args.metrics_port:
        metrics.serve(args.metrics_host, args.metrics_port)
    liveness = None
    if endpoint is not None:  # kopf's endpoint on the loopback, read by a thread; a bounded front answers from it
        host, port, path = endpoint
        liveness, kopf_port = health.kopf_endpoint(path)
        health.serve(host, port, path, kopf_port)
    namespaces = args.namespace or []
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness,
        standalone=args.standalone,
        peering_name=args.peering,
        priority=priority,
    )
    return 0


def _render_or_write(args: argparse.Namespace) -> int:
    """`--write` writes the generated files under `--root` and names them; otherwise one rendering goes to stdout."""
    from kvpersist.api import attachpolicy, crd, pinchange

    render, write = {"crd": (crd.render_crd, crd.write_crds), "pin-change-policy": (pinchange.render_config, pinchange.write),
                     "attach-policy": (attachpolicy.render_config, attachpolicy.write),
                     "api-reference": (crd.render_reference, crd.write_reference)}[args.command]
    if args.write:
        for path in write(Path(args.root)):
            print(f"wrote {path}")
    else:
        sys.stdout.write(render())
    return 0


def _admin(args: argparse.Namespace) -> int:
    from kvpersist import admin, cliflags
    from kvpersist.controller import kube

    try:
        kube.load_config(args.kubeconfig, args.context)
        namespace = cliflags.namespace_of(args)
        if args.command == "gc":
            return admin.cmd_gc(args.namespace_id, namespace, args.dry_run, args.timeout)
        return (admin.cmd_status if args.command == "status" else admin.cmd_report)(namespace, args.output)
    except Exception as exc:
        if (problem := admin.cluster_problem(exc)) is None:
            raise
        print(problem, file=sys.stderr)  # one line naming the fix, no traceback
        return 1


def _convert(args: argparse.Namespace) -> int:
    """`kvpersist convert -f FILE`: KVCacheNamespace manifests written for the larger API, in today's form.

    The API server prunes the fields that went from stored objects, so the place to convert is where a
    manifest is kept (git for Argo CD, a chart's values): this prints each document converted, the
    namespace id unchanged (kvpersist.api.convert), and what changed on stderr.
    """
    import yaml

    from kvpersist.api.convert import ConvertError, convert_object

    text = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text(encoding="utf-8")
    out: list[Any] = []
    try:
        for index, doc in enumerate(yaml.safe_load_all(text)):
            if doc is None:
                continue
            converted, notes = convert_object(doc) if isinstance(doc, dict) else (doc, [])
            name = (doc.get("metadata") or {}).get("name", f"document {index + 1}") if isinstance(doc, dict) else ""
            for note in notes:
                print(f"kvpersist convert: {name}: {note}", file=sys.stderr)
            out.append(converted)
    except ConvertError as exc:
        print(f"kvpersist convert: {exc}", file=sys.stderr)
        return 2
    except yaml.YAMLError as exc:
        print(f"kvpersist convert: {args.filename} is not YAML: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump_all(out, sort_keys=False, width=1 << 16))
    return 0


def _version(args: argparse.Namespace) -> int:
    from kvpersist import __version__, cliflags
    from kvpersist.api import v1alpha1 as api
    from kvpersist.inserver.lmcache_internals import TESTED_LMCACHE

    data: dict[str, object] = {"kvpersist": __version__, "api": api.API_VERSION, "lmcacheTested": list(TESTED_LMCACHE)}
    if not args.client:
        from kvpersist.admin import OPERATOR_SELECTOR, operator_versions

        data["operators"], problem = operator_versions(args.kubeconfig, args.context)
        if problem:
            data["operatorsUnknown"] = problem

    def table(_wide: bool) -> str:
        lines = [f"client: kvpersist {__version__} (API {api.API_VERSION}; lmcache {', '.join(TESTED_LMCACHE)})"]
        if not args.client:
            lines += [f"operator: {o['version']} ({o['namespace']}/{o['name']}, image {o['image']})"
                      for o in data["operators"]]  # type: ignore[attr-defined]
            if data.get("operatorsUnknown"):
                lines.append(f"operator: unknown ({data['operatorsUnknown']})")
            elif not data["operators"]:
                lines.append(f"operator: none found (no Deployment labelled {OPERATOR_SELECTOR})")
        return "\n".join(lines)

    print(cliflags.emit(args.output, data, table))
    return 0


# The operator image's own: `kvpersist-operator`.
OPERATOR_COMMANDS = ("run", "agent", "crd", "pin-change-policy", "attach-policy", "api-reference")


def _operator_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpersist-operator", description="The operator's own entry points (the "
                                     "image runs them; users run `kvpersist`).")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the controller against the current kubeconfig or in-cluster config")
    run.add_argument("-n", "--namespace", action="append", help="watch only this namespace (repeatable)")
    run.add_argument("--liveness", default=None, help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz "
                     "(kopf's own endpoint on the loopback, read every few seconds; a bounded server answers the "
                     "probe from the last reading, never behind its workers)")
    run.add_argument("--standalone", action="store_true", help="no peering: for one replica only")
    run.add_argument("--peering", default=None, help="KopfPeering name shared by replicas that must not both run")
    run.add_argument("--priority", type=int, default=None,
                     help="peering priority (highest live replica works); default: random, so replicas never tie")
    run.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
    run.add_argument("--metrics-host", default="0.0.0.0", help="address for --metrics-port")
    run.add_argument("-v", "--verbose", action="store_true")
    run.add_argument("--log-format", choices=("full", "plain", "json"), default="full",
                     help="full: time, logger, level, message; json: one object a line, with the resource under k8s")
    run.set_defaults(fn=_run)

    # Parsed by kvpersist.inventory.agent itself (operator_main() hands it the rest of the line).
    sub.add_parser("agent", help="the inventory sidecar beside each lmcache server (kvpersist-operator agent --help)")

    # (name, help, --write's help): each prints what the API models generate, or writes it (_render_or_write).
    for name, help_, write_help in (
            ("crd", "print the CRD generated from the API models", "write every committed copy instead of printing"),
            ("pin-change-policy", "print the ValidatingAdmissionPolicy that warns at kubectl apply of a change that moves the "
             "namespace id (generated from the fields that reach it)", "write config/pin-change-warning/ and the chart's template"),
            ("attach-policy", "print the admission policies that attach users' own vLLM pods to a KVCacheNamespace with "
             "spec.vllm.mode Attached (docs/attach.md)", "write config/attach/ and the chart's template"),
            ("api-reference", "print docs/api-reference.md, generated from the API models",
             "write docs/api-reference.md instead of printing")):
        cmd = sub.add_parser(name, help=help_)
        cmd.add_argument("--write", action="store_true", help=write_help)
        cmd.add_argument("--root", default=".", help="repository root for --write")
        cmd.set_defaults(fn=_render_or_write)
    return parser


def user_parser() -> argparse.ArgumentParser:
    """`kvpersist`: what users and admins run (also as `kubectl kvpersist`), with kubectl's flags
    (kvpersist.cliflags); the operator's entry points are `kvpersist-operator`'s."""
    from kvpersist import __version__, cliflags, pinscmd, plancmd

    parser = argparse.ArgumentParser(prog="kvpersist", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvpersist {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("status", "a table of KVCacheNamespaces: phase, namespace id, L1/L2 usage, health, orphans"),
                        ("report", "per volume or bucket: namespaces, bytes, objects, last write, orphan or not; "
                         "orphans first, the best to reclaim at the top"),
                        ("gc", "delete ONE orphaned namespace's data, named explicitly (dry run unless --no-dry-run)")):
        cmd = sub.add_parser(name, help=help_, description=help_)
        if name == "gc":
            cmd.add_argument("namespace_id", metavar="NAMESPACE_ID", help="kvp-<32 hex>, as `kvpersist report` lists it")
            cmd.add_argument("--dry-run", action=argparse.BooleanOptionalAction, default=True,
                             help="only say what would be deleted (default); --no-dry-run deletes")
            cmd.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the operator's answer")
        else:
            cliflags.add_output_flag(cmd)
        cliflags.add_cluster_flags(cmd)
        cmd.set_defaults(fn=_admin)
    plancmd.add_parser(sub)
    pinscmd.add_parser(sub)
    convert = sub.add_parser("convert", help="print KVCacheNamespace manifests in today's API form (spec.image, "
                             "quantities), the namespace id unchanged", description=_convert.__doc__)
    convert.add_argument("-f", "--filename", required=True, metavar="FILE", help="a YAML file of one or more documents, or -")
    convert.set_defaults(fn=_convert)
    version = sub.add_parser("version", help="this client's version, its API version and the lmcache it was tested with, "
                             "and the operators the cluster runs")
    cliflags.add_output_flag(version, ("table", "json", "yaml"))
    version.add_argument("--client", action="store_true", help="this client only: ask no cluster")
    cliflags.add_cluster_flags(version, all_namespaces=False)
    version.set_defaults(fn=_version)
    completion = sub.add_parser("completion", help="print a shell completion script: "
                                "`source <(kvpersist completion bash)`, or zsh")
    completion.add_argument("shell", choices=("bash", "zsh"))
    completion.set_defaults(fn=lambda args: _completion(args, parser))
    return parser


def _completion(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    sys.stdout.write(completion_script(parser, args.shell))
    return 0


def completion_commands(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Each subcommand and its option strings (the long and short spellings), in parser order."""
    return {name: [o for a in sub._actions for o in a.option_strings]
            for action in parser._actions if isinstance(action, argparse._SubParsersAction)  # no public walk of them
            for name, sub in action.choices.items()}


def completion_script(parser: argparse.ArgumentParser, shell: str) -> str:
    """A bash completion function for the parser's program (zsh: through bashcompinit), written from the parser
    itself: a command or flag added to the CLI completes without anyone editing a script."""
    prog = parser.prog
    table = completion_commands(parser)
    func = "_" + prog.replace("-", "_") + "_complete"
    cases = "\n".join(f"    {shlex.quote(name)}) opts={shlex.quote(' '.join(opts))} ;;" for name, opts in table.items())
    body = f"""{func}() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" cmd="" opts="" i
  for ((i = 1; i < COMP_CWORD; i++)); do
    case "${{COMP_WORDS[i]}}" in -*) ;; *) cmd="${{COMP_WORDS[i]}}"; break ;; esac
  done
  if [ -z "$cmd" ]; then
    COMPREPLY=($(compgen -W {shlex.quote(' '.join(table))} -- "$cur"))
    return
  fi
  case "$cmd" in
{cases}
  esac
  COMPREPLY=($(compgen -W "$opts" -- "$cur"))
}}
complete -o default -F {func} {prog}
"""
    return ("autoload -U +X bashcompinit && bashcompinit\n" if shell == "zsh" else "") + body


def operator_main(argv: list[str] | None = None) -> int:
    """`kvpersist-operator run | agent | crd | pin-change-policy | attach-policy | api-reference`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["agent"]:
        from kvpersist.inventory import agent

        return agent.main(argv[1:])
    args = _operator_parser().parse_args(argv)
    return args.fn(args)


def main(argv: list[str] | None = None) -> int:
    """`kvpersist COMMAND`. The operator's commands still answer here, unlisted (`kvpersist run`, `kvpersist agent`:
    the image's entrypoint and every server pod's sidecar as rendered before)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in OPERATOR_COMMANDS:
        return operator_main(argv)
    args = user_parser().parse_args(argv)
    return args.fn(args)


kubectl_plugin = main  # `kubectl kvpersist ...`: kubectl finds kubectl-kvpersist on PATH and passes the rest


if __name__ == "__main__":
    sys.exit(main())
