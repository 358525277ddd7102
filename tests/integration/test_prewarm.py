"""spec.prewarm's data path on a real `lmcache server` (started with the args the operator renders)
and the real inventory agent in front of it: after a server restart (L1 empty, the chunks in L2),
POST /server/prefetch through the agent loads them into L1, which lmcache's own /status counts,
and the next lookups of those prefixes are L1 hits by lmcache's own counters, none from L2. The
correctness canary reads those counters through the agent the same way (fetch_lookup_counters).

lmcache's prefetch needs a KV layout registered by a worker (503 until then), under the worker's
model name and world size, which the agent reads from lmcache's /status. vLLM registers one when
it allocates its KV; here lmcache's own bench client does (tests/integration/kvdriver.py hold), the
same REGISTER_KV_CACHE call with a real KV shape.
The e2e test with real vLLM: tests/e2e/test_prewarm.py.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvpersist.inventory.agentclient import request_prefetch
from kvpersist.status.usage import fetch_lookup_counters
from tests.integration.conftest import REPO, LocalServer, drive, make_target
from tests.integration.test_l2_serde import _tier_hits

Servers = Callable[..., LocalServer]
CHUNK = 256


@contextmanager
def registered(srv: LocalServer, seqs: str, timeout: float = 120) -> Iterator[dict[str, Any]]:
    """A worker's KV layout registered with srv while the block runs (kvdriver hold): yields the
    model name, world size and each sequence's token ids it registered under."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.kvdriver", "hold", "--rpc-url", srv.rpc_url,
                             "--http-url", srv.http_url, "--seqs", seqs], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
                            env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
    try:
        assert proc.stdout is not None and proc.stdin is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        assert line, f"kvdriver hold did not register within {timeout}s: {proc.stderr.read() if proc.poll() is not None else ''}"
        yield json.loads(line)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def l1_objects(srv: LocalServer) -> int:
    """lmcache's own count of the objects its L1 holds (GET /status)."""
    return int(srv.status()["storage_manager"]["l1_manager"]["total_object_count"])


def test_a_prefetch_through_the_agent_brings_l2_into_l1_and_the_next_lookups_hit_l1(servers: Servers, agents: Any) -> None:
    srv = servers(make_target())
    srv.start()
    assert drive(srv, "store", "0:4")["summary"]["stored_chunks"] == 8
    srv.stop(signal.SIGKILL)  # a server restart: L1 is gone, L2 stays on the volume
    srv.start()
    agent = agents(srv)
    assert l1_objects(srv) == 0
    with registered(srv, "0:4") as layout:
        ids = layout["token_ids"]
        # Without the token: refused, nothing asked of lmcache.
        assert request_prefetch("127.0.0.1", agent.port, ids["0"], None)[0] == 401
        answers = [request_prefetch("127.0.0.1", agent.port, ids[str(seq)], agent.token) for seq in range(4)]
        # One more sequence the server never stored: completed, nothing found (not an error).
        code, unknown = request_prefetch("127.0.0.1", agent.port, [9999, *ids["0"][1:]], agent.token)
    assert [(code, a.status, a.chunks, a.found_keys, a.total_keys) for code, a in answers] == [(200, "completed", 2, 2, 2)] * 4
    # Under the model name and world size the worker registered, which the agent read from lmcache's /status.
    assert all([(x.model_name, x.world_size) for x in a.layouts] == [(layout["model"], layout["world_size"])]
               for _, a in answers)
    assert code == 200 and unknown.status == "completed" and unknown.found_keys == 0 < unknown.total_keys
    assert l1_objects(srv) == 8  # lmcache's own count: the 8 chunks are in L1 now
    before = _tier_hits(srv)
    again = drive(srv, "verify", "0:4")["summary"]
    assert again["hit_chunks"] == 8 and again["verified_chunks"] == 8 and again["wrong_bytes"] == 0
    l1, l2 = _tier_hits(srv)
    assert (l1 - before[0], l2 - before[1]) == (8 * CHUNK, 0)  # every hit from L1, none read from L2 on the request
    # What the canary reads around a check (kvpersist.controller.canary): the same counters, through the agent.
    through_agent = fetch_lookup_counters("127.0.0.1", agent.port, token=agent.token)
    assert through_agent is not None and (through_agent.hit_l1, through_agent.hit_l2) == _tier_hits(srv) == (l1, l2)
    with socket.socket() as closed:  # bound, never listening: no answer is unknown, never zeros
        closed.bind(("127.0.0.1", 0))
        assert fetch_lookup_counters("127.0.0.1", closed.getsockname()[1], timeout=1.0) is None


def test_no_layout_registered_is_a_503_the_operator_waits_on(servers: Servers, agents: Any) -> None:
    """Right after a server (re)start no vLLM has registered: the agent says so, lmcache's words."""
    srv = servers(make_target())
    srv.start()
    agent = agents(srv)
    code, got = request_prefetch("127.0.0.1", agent.port, list(range(600)), agent.token)
    assert code == 503 and "no vLLM has registered its KV layout" in (got.error or "") and got.status is None
