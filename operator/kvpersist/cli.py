"""The `kvpersist` command: `run` starts the controller; `status`, `report` and `gc` are the admin's
view and explicit cleanup, `plan -f FILE` what an apply would do to the namespace id (also
`kubectl kvpersist ...`); `agent` is the inventory sidecar; `pins`
prints a model's identity pins from its Hub files; `crd` prints or writes the generated CRD;
`pin-change-policy` the generated pin-change warning."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

# glibc's malloc gives each thread that allocates an arena of its own (up to 8 per core); the
# operator's worker threads (refresh, apply, bucket, watch caches) each held one, mostly empty, and
# at 500 resources that was tens of MiB of its peak RSS. Two arenas serve threads that spend most
# of their time waiting on the network. Set before any of them starts; not on other C libraries.
M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)
ARENAS = 2


def _fewer_malloc_arenas() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, ARENAS)
    except (OSError, AttributeError):
        pass  # not glibc (musl, macOS): nothing to set


def _run(args: argparse.Namespace) -> int:
    _fewer_malloc_arenas()
    import kopf

    from kvpersist.builders.networkpolicy import metrics_scraper
    from kvpersist.controller import (
        handlers,  # noqa: F401  (importing it registers the kopf handlers)
        leadership,
        runtime,
    )
    from kvpersist.controller.policy import Policy

    try:  # the chart's allowedImages, secretLabel and metrics.scraper: a typo must stop the operator, not admit everything
        runtime.set_policy(Policy.from_env(os.environ))
        metrics_scraper()
    except ValueError as exc:
        print(f"kvpersist run: {exc}", file=sys.stderr)
        return 2
    kopf.configure(verbose=args.verbose)
    if not args.verbose:
        runtime.quiet_event_handler_logs()
    from kvpersist.controller import agentroll

    agentroll.warn_if_unpinned()
    peering = None if args.standalone else args.peering
    priority = args.priority if args.priority is not None else leadership.random_priority()
    runtime.set_peering(peering, leadership.own_identity(), priority, tuple(args.namespace or ()))
    if args.metrics_port:
        from kvpersist.controller import metrics

        metrics.serve(args.metrics_host, args.metrics_port)
    liveness = None
    if args.liveness:  # kopf's endpoint on the loopback, read by a thread; a bounded front answers from it
        from kvpersist.controller import health

        try:
            host, port, path = health.split_endpoint(args.liveness)
        except ValueError as exc:
            print(f"kvpersist run: {exc}", file=sys.stderr)
            return 2
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


def _render_or_write(args: argparse.Namespace, render: Callable[[], str], write: Callable[[Path], list[Path]]) -> int:
    """`--write` writes the generated files under `--root` and names them; otherwise one rendering goes to stdout."""
    if args.write:
        for path in write(Path(args.root)):
            print(f"wrote {path}")
    else:
        sys.stdout.write(render())
    return 0


def _crd(args: argparse.Namespace) -> int:
    from kvpersist.api.crd import render_crd, write_crds

    return _render_or_write(args, render_crd, write_crds)


def _pin_change_policy(args: argparse.Namespace) -> int:
    from kvpersist.api.pinchange import render_config, write

    return _render_or_write(args, render_config, write)


def _admin(args: argparse.Namespace) -> int:
    from kubernetes.client.exceptions import ApiException

    from kvpersist import admin
    from kvpersist.controller import kube

    kube.load_config(args.kubeconfig, args.context)
    namespace = None if args.all_namespaces else args.namespace
    try:
        if args.command == "status":
            return admin.cmd_status(namespace, args.output)
        if args.command == "report":
            return admin.cmd_report(namespace, args.output)
        return admin.cmd_gc(args.namespace_id, namespace, args.dry_run, args.timeout)
    except ApiException as exc:
        print(f"error: the API server answered {exc.status} {exc.reason}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["agent"]:
        from kvpersist.inventory import agent

        return agent.main(argv[1:])
    parser = argparse.ArgumentParser(prog="kvpersist", description=__doc__)
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
    run.set_defaults(fn=_run)

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
            cmd.add_argument("-o", "--output", choices=("table", "json"), default="table")
        cmd.add_argument("-n", "--namespace", help="only this Kubernetes namespace (default: all)")
        cmd.add_argument("-A", "--all-namespaces", action="store_true", help="all namespaces (the default)")
        cmd.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
        cmd.add_argument("--context", default=None, help="kubeconfig context")
        cmd.set_defaults(fn=_admin)

    # Parsed by kvpersist.inventory.agent itself (main() hands it the rest of the line).
    sub.add_parser("agent", help="the inventory sidecar beside each lmcache server (kvpersist agent --help)")

    from kvpersist import pinscmd, plancmd

    pinscmd.add_parser(sub)
    plancmd.add_parser(sub)

    crd = sub.add_parser("crd", help="print the CRD generated from the API models")
    crd.add_argument("--write", action="store_true", help="write every committed copy instead of printing")
    crd.add_argument("--root", default=".", help="repository root for --write")
    crd.set_defaults(fn=_crd)

    policy = sub.add_parser("pin-change-policy", help="print the ValidatingAdmissionPolicy that warns at kubectl apply of a "
                            "change that moves the namespace id (generated from the fields that reach it)")
    policy.add_argument("--write", action="store_true", help="write config/pin-change-warning/ and the chart's template")
    policy.add_argument("--root", default=".", help="repository root for --write")
    policy.set_defaults(fn=_pin_change_policy)

    args = parser.parse_args(argv)
    return args.fn(args)


def kubectl_plugin() -> int:
    """`kubectl kvpersist ...`: kubectl finds kubectl-kvpersist on PATH and passes the rest."""
    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
