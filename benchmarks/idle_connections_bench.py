#!/usr/bin/env python3
"""The inventory agent's (and the operator metrics server's) RSS and threads under N idle
connections, and how long a fresh client waits among them.

The same processes as tests/integration/test_idle_connections.py (the agent from the args the
operator renders; the metrics server alone and the liveness front before kopf's endpoint, stand-ins
for the operator's process), on 127.0.0.1;
half of the connections have sent the start of a request head, half nothing. One line per N.

    <venv>/bin/python benchmarks/idle_connections_bench.py [--connections 1000,3000,10000] [--server agent|metrics|liveness]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from tests.integration.test_idle_connections import (
    flood,
    proc_status,
    raise_fd_limit,
    start_agent,
    start_liveness,
    start_metrics,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", default="1000,3000,10000", help="comma-separated counts")
    parser.add_argument("--server", choices=("agent", "metrics", "liveness"), default="agent")
    args = parser.parse_args()
    counts = [int(c) for c in args.connections.split(",")]
    raise_fd_limit(max(counts))
    start = {"agent": start_agent, "metrics": start_metrics, "liveness": start_liveness}[args.server]
    with tempfile.TemporaryDirectory() as tmp:
        served = start(Path(tmp))
        try:
            idle = proc_status(served.proc.pid)
            print(f"{args.server}: no connection: RSS {idle['rss'] / 2**20:.1f} MiB, {idle['threads']} threads "
                  f"(container limit {served.limit >> 20} MiB)")
            for n in counts:
                t0 = time.monotonic()
                with flood(served.port, n):
                    opened = time.monotonic() - t0
                    time.sleep(1.0)
                    under = proc_status(served.proc.pid)
                    waits = []
                    for name, call, _ in served.fresh:
                        t1 = time.monotonic()
                        ok = call()
                        waits.append(f"{name} {'ok' if ok else 'FAILED'} in {(time.monotonic() - t1) * 1000:.0f} ms")
                print(f"{args.server}: {n} idle connections (opened in {opened:.1f} s): RSS {under['rss'] / 2**20:.1f} MiB, "
                      f"{under['threads']} threads; {', '.join(waits)}", flush=True)
        finally:
            served.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
