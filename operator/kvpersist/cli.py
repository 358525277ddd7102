"""The `kvpersist` command: `run` starts the controller; `crd` prints or writes the generated CRD."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _run(args: argparse.Namespace) -> int:
    import kopf

    from kvpersist import handlers  # noqa: F401  (registers the kopf handlers)

    kopf.configure(verbose=args.verbose)
    if args.metrics_port:
        from kvpersist import metrics

        metrics.serve(args.metrics_host, args.metrics_port)
    namespaces = args.namespace or []
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=args.liveness,
        standalone=args.standalone,
        peering_name=args.peering,
    )
    return 0


def _crd(args: argparse.Namespace) -> int:
    from kvpersist.api.crd import render_crd, write_crds

    if args.write:
        for path in write_crds(Path(args.root)):
            print(f"wrote {path}")
    else:
        sys.stdout.write(render_crd())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpersist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the controller against the current kubeconfig or in-cluster config")
    run.add_argument("-n", "--namespace", action="append", help="watch only this namespace (repeatable)")
    run.add_argument("--liveness", default=None, help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    run.add_argument("--standalone", action="store_true", help="no peering: for one replica only")
    run.add_argument("--peering", default=None, help="KopfPeering name shared by replicas that must not both run")
    run.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
    run.add_argument("--metrics-host", default="0.0.0.0", help="address for --metrics-port")
    run.add_argument("-v", "--verbose", action="store_true")
    run.set_defaults(fn=_run)

    crd = sub.add_parser("crd", help="print the CRD generated from the API models")
    crd.add_argument("--write", action="store_true", help="write every committed copy instead of printing")
    crd.add_argument("--root", default=".", help="repository root for --write")
    crd.set_defaults(fn=_crd)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
