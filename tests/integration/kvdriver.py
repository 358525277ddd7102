"""Drives real KV traffic into a real `lmcache server` with lmcache's own bench client, and checks
the bytes that come back.

`lmcache bench server` itself cannot prove that data read back after a restart is right: its
buffers are filled from a fixed seed in every process, and in lmcache_driven mode it does not clear
the destination before a retrieve, so a checksum would match even if nothing was read. This
driver uses the same client classes but clears the destination blocks itself before every
retrieve and checksums the local buffer the server wrote into.

    python -m tests.integration.kvdriver store  --rpc-url tcp://127.0.0.1:5555 --http-url http://127.0.0.1:5556 --seqs 0:8
    python -m tests.integration.kvdriver verify --rpc-url ... --http-url ... --seqs 0:8
    python -m tests.integration.kvdriver lookup ...   (lookups only, back to back: a read rate, no bytes checked)
    python -m tests.integration.kvdriver hold ...     (registers its KV layout, as a vLLM worker does, until stdin closes)

Prints one JSON object: per sequence the chunks looked up, hit, stored, and whether the
retrieved bytes equal the source bytes; the lookup's and the retrieve's time (`*_ms`) and start
(`*_at`, time.monotonic(): one clock for every process of the machine, so the intervals of
drivers run at once can be merged).

    python -m tests.integration.kvdriver forkserver --socket PATH   (ForkServer: runs forked from one import)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

SHAPE = "(2,64,16,2,64):float16:4"  # 4 layers, 2 KV heads of 64: 512 KiB per 256-token chunk
# The identity pins of that shape (a server's L1 page follows them: kvpersist.api l1_page_bytes).
SHAPE_PINS = {"numKVHeads": 2, "headSize": 64, "kvCacheDtype": "float16"}


# How often a lookup asks the server whether its prefetch (an L2 hit's L2 -> L1 load) is done.
# lmcache's bench client sleeps 50 ms between asks, so every L2 hit it timed was rounded up to
# 50 ms steps (an L1 hit answers at the first ask): a 128 MiB lookup that the server finished in
# 30 ms was timed as 50 or 100. vLLM's connector asks again at its next scheduler step, a few ms
# on a GPU; 1 ms, with the same 2.5 s budget, times the server and not the asking.
PREFETCH_POLL_S = 0.001
PREFETCH_POLL_BUDGET_S = 2.5


def _fast_prefetch_polls() -> None:
    """lmcache's bench client, polling its lookups every PREFETCH_POLL_S (its lookup imports the
    poll function from helpers at each call, so replacing it there is enough)."""
    from lmcache.cli.commands.bench.server_bench import helpers

    original = getattr(helpers._poll_prefetch_status, "kvpersist_original", helpers._poll_prefetch_status)

    def poll(client: Any, request_id: str, max_polls: int = 0, poll_interval: float = 0.0) -> int | None:
        return original(client, request_id, max_polls=round(PREFETCH_POLL_BUDGET_S / PREFETCH_POLL_S),
                        poll_interval=PREFETCH_POLL_S)

    poll.kvpersist_original = original  # type: ignore[attr-defined]
    helpers._poll_prefetch_status = poll


def _instance_id(instance_id: int | None) -> None:
    """The id this driver registers its KV under (lmcache's bench client: 1000 for its one rank).
    The server keeps one KV layout per id, so drivers that read from one server at once need an id
    each: two under the same one read back wrong bytes (datapath_bench --clients 2, every request)."""
    if instance_id is not None:
        from lmcache.cli.commands.bench.server_bench import helpers

        helpers._INSTANCE_ID_BASE = instance_id  # the client reads it when it starts


def _config(rpc_url: str, http_url: str, num_tokens: int, shape: str = SHAPE, num_blocks: int = 64) -> Any:
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    return BenchConfig(rpc_url=rpc_url, http_url=http_url, mode="cpu", transfer_mode="lmcache_driven", tp_size=1,
                       use_mla=False, num_tokens=num_tokens, kvcache_shape_spec=shape, num_blocks=num_blocks, block_size=16)


def _checksums(client: Any, request: Any, tokens: int) -> list[str]:
    from lmcache.cli.commands.bench.server_bench.helpers import _compute_client_checksums

    worker = client._workers[0]
    return _compute_client_checksums(list(worker.kv_caches.values()), request.block_offset, tokens // client._block_size,
                                     client._block_size, client._chunk_size)


def _clear(client: Any, request: Any, tokens: int) -> None:
    from lmcache.cli.commands.bench.server_bench.helpers import _zero_fill_client_blocks

    worker = client._workers[0]
    _zero_fill_client_blocks(list(worker.kv_caches.values()), request.block_offset, tokens // client._block_size)


def run(mode: str, rpc_url: str, http_url: str, seqs: range, num_tokens: int, shape: str = SHAPE,
        num_blocks: int = 64, start_at: float | None = None, instance_id: int | None = None) -> dict[str, Any]:
    """start_at: a time.time() to wait for once the client is up, so several drivers (started at
    different moments, each importing torch) begin their requests together; instance_id: see
    _instance_id."""
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient

    _fast_prefetch_polls()
    _instance_id(instance_id)
    client = ServerBenchClient(_config(rpc_url, http_url, num_tokens, shape, num_blocks), log=lambda _msg: None)
    out: dict[str, Any] = {"mode": mode, "sequences": []}
    client.start()
    caches = client._workers[0].kv_caches
    pristine = {name: tensor.clone() for name, tensor in caches.items()}  # the seeded source bytes
    if start_at is not None:
        out["late_s"] = round(max(0.0, time.time() - start_at), 3)  # > 0: it was up after the start time
        time.sleep(max(0.0, start_at - time.time()))
    t_first = time.monotonic()
    try:
        for seq in seqs:
            request = client.create_request(seq, request_id=f"kvdriver-{mode}-{seq}-{time.monotonic_ns()}", request_kind=mode)
            if mode == "lookup":  # L2 -> L1 only (lmcache prefetches an L2 hit at lookup), back to back: a read rate
                t0 = time.monotonic()
                lookup = client.lookup(request)
                out["sequences"].append({"seq": seq, "chunks": lookup.total_chunks, "hit_chunks": lookup.hit_chunks,
                                         "lookup_error": lookup.error, "stored_chunks": 0,
                                         "lookup_ms": round((time.monotonic() - t0) * 1000, 3), "lookup_at": round(t0, 6)})
                client.end_session(request)
                continue
            for name, tensor in caches.items():
                tensor.copy_(pristine[name])
            expected = _checksums(client, request, request.num_full_tokens)
            t0 = time.monotonic()
            lookup = client.lookup(request)
            lookup_ms = (time.monotonic() - t0) * 1000
            row: dict[str, Any] = {"seq": seq, "chunks": lookup.total_chunks, "hit_chunks": lookup.hit_chunks,
                                   "lookup_error": lookup.error, "lookup_ms": round(lookup_ms, 3), "lookup_at": round(t0, 6)}
            hit_tokens = lookup.hit_chunks * request.chunk_size
            if hit_tokens:
                _clear(client, request, hit_tokens)
                # Control: the cleared blocks must not already look right, or the check below proves nothing.
                row["cleared_differs"] = _checksums(client, request, hit_tokens) != expected[: lookup.hit_chunks]
                t0 = time.monotonic()
                retrieved = client.retrieve(request, start_token=0, token_count=hit_tokens)
                row["retrieve_ms"], row["retrieve_at"] = round((time.monotonic() - t0) * 1000, 3), round(t0, 6)
                row["retrieve_ok"] = bool(retrieved and retrieved.succeeded)
                got = _checksums(client, request, hit_tokens)
                row["bytes_match"] = got == expected[: len(got)]
            miss_tokens = request.num_full_tokens - hit_tokens
            if mode == "store" and miss_tokens > 0:
                stored = client.store(request, start_token=hit_tokens, token_count=miss_tokens)
                row["stored_chunks"] = miss_tokens // request.chunk_size if stored and stored.succeeded else 0
            else:
                row["stored_chunks"] = 0
            client.end_session(request)
            out["sequences"].append(row)
        out["wall_s"] = round(time.monotonic() - t_first, 3)
    finally:
        client.close()
    seq_rows = out["sequences"]
    out["summary"] = {
        "chunks": sum(r["chunks"] for r in seq_rows),
        "hit_chunks": sum(r["hit_chunks"] for r in seq_rows),
        "stored_chunks": sum(r["stored_chunks"] for r in seq_rows),
        "wrong_bytes": sum(1 for r in seq_rows if r.get("bytes_match") is False),
        "verified_chunks": sum(r["hit_chunks"] for r in seq_rows if r.get("bytes_match") and r.get("cleared_differs")),
        "lookup_errors": sum(1 for r in seq_rows if r["lookup_error"]),
    }
    return out


def hold(rpc_url: str, http_url: str, seqs: range, num_tokens: int, shape: str = SHAPE, num_blocks: int = 64) -> None:
    """Registers the client's KV layout with the server, as a vLLM worker does when it allocates its
    KV (lmcache's warm prefetch answers 503 until one has), prints one JSON line (the model name
    and world size it registered under, and each sequence's token ids), and holds it until stdin
    closes."""
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.helpers import _MODEL_NAME

    client = ServerBenchClient(_config(rpc_url, http_url, num_tokens, shape, num_blocks), log=lambda _msg: None)
    client.start()
    try:
        ids = {seq: list(client.create_request(seq, request_id=f"kvdriver-hold-{seq}", request_kind="hold").token_ids)
               for seq in seqs}
        sys.stdout.write(json.dumps({"model": _MODEL_NAME, "world_size": client._kv_world_size, "token_ids": ids}) + "\n")
        sys.stdout.flush()
        sys.stdin.read()
    finally:
        client.close()


class ForkServer:
    """One process that imports torch and lmcache's bench client once and forks each driver run
    from there: every run is still its own process (its torch, ZMQ and lmcache client state start
    fresh; only imported modules are shared, and the parent runs nothing else), without the 2.5 s
    of CPU each `python -m` run spends importing them, some 90 times in the integration tier
    (issue 40: the suite's budget on two cores). tests/integration/conftest.py runs one per session."""

    def __init__(self, folder: Path, start_timeout: float = 120.0) -> None:
        self.socket_path = folder / "kvdriver.sock"
        self.log = folder / "kvdriver-forkserver.log"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        self.stop()
        self.socket_path.unlink(missing_ok=True)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.kvdriver", "forkserver", "--socket",
                                          str(self.socket_path)], stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=Path(__file__).resolve().parents[2],
                                         env={**os.environ, "LMCACHE_DISABLE_BANNER": "1", **CLIENT_THREADS})
        deadline = time.monotonic() + self.start_timeout
        while not self.socket_path.exists():  # bound after its imports, just before it accepts
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the kvdriver fork server did not start: {self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)

    def run(self, argv: list[str], timeout: float) -> dict[str, Any]:
        """One driver run (main()'s arguments); its JSON, or AssertionError with its traceback."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(timeout)  # each recv: the run answers once, when it is done
                conn.connect(str(self.socket_path))
                conn.sendall(json.dumps({"argv": argv}).encode())
                conn.shutdown(socket.SHUT_WR)
                data = _read_all(conn)
        except TimeoutError:
            self.stop()  # the hung run with it (one process group)
            raise AssertionError(f"kvdriver {argv[0]} gave no answer in {timeout}s") from None
        reply = json.loads(data) if data else {"error": "the forked run ended without an answer (killed?)"}
        if "error" in reply:
            raise AssertionError(f"kvdriver {argv[0]} failed: {reply['error'][-3000:]}")
        return reply["result"]

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        self.proc = None


FORK_SERVER: ForkServer | None = None  # set for a test session (tests/integration/conftest.py); else a process per run


# The driver stands in for vLLM, which has cores of its own: torch's OpenMP pool here would spin on
# the server's cores while it waits (a quarter of a 2-core machine in a perf profile of a cold read).
CLIENT_THREADS = {"OMP_NUM_THREADS": "1"}


def drive_subprocess(mode: str, rpc_url: str, http_url: str, seqs: str, timeout: float = 300,
                     extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Runs this driver in its own process (torch and ZMQ state stay out of the caller): forked
    from FORK_SERVER when a session runs one, else `python -m`; returns its JSON."""
    argv = [mode, "--rpc-url", rpc_url, "--http-url", http_url, "--seqs", seqs, *extra]
    if FORK_SERVER is not None and mode != "hold":
        return FORK_SERVER.run(argv, timeout)
    out = subprocess.run([sys.executable, "-m", "tests.integration.kvdriver", *argv], capture_output=True, text=True,
                         timeout=timeout, cwd=Path(__file__).resolve().parents[2],
                         env={**os.environ, "LMCACHE_DISABLE_BANNER": "1", **CLIENT_THREADS})
    if out.returncode != 0:
        raise AssertionError(f"kvdriver {mode} failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _read_all(conn: socket.socket) -> bytes:
    chunks = []
    while chunk := conn.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def forkserver(path: str) -> None:
    """ForkServer's other end: imports what a run imports, then forks one child per connection
    (the request: main()'s arguments as JSON; the answer: the run's JSON or its traceback). The
    parent only accepts and forks; the kernel reaps the children. It ends with the test session
    that started it, even one killed before its fixtures could stop it."""
    from lmcache.cli.commands.bench.server_bench import client, config, helpers  # noqa: F401  what each run imports

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # the caller waits for this name: bound and listening
    parent = os.getppid()
    listener.settimeout(1.0)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test session died without stopping it: so does this
                return
            continue
        if os.fork() != 0:
            conn.close()
            continue
        try:  # the child: one run, its answer, and out (os._exit: nothing of the parent's runs again)
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                request = json.loads(_read_all(conn))
                reply: dict[str, Any] = {"result": _run_args(_parser().parse_args(request["argv"]))}
            except BaseException:  # any failure goes back to the test, as its traceback
                reply = {"error": traceback.format_exc()}
            conn.sendall(json.dumps(reply).encode())
            conn.close()
        finally:
            os._exit(0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["store", "verify", "lookup", "hold", "forkserver"])
    parser.add_argument("--rpc-url", required=False)
    parser.add_argument("--http-url", required=False)
    parser.add_argument("--socket", help="forkserver: the UNIX socket to listen on")
    parser.add_argument("--seqs", default="0:8", help="start:end sequence numbers (end exclusive)")
    parser.add_argument("--num-tokens", type=int, default=512)
    parser.add_argument("--shape", default=SHAPE, help="KV shape spec, as lmcache bench server takes it")
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--start-at", type=float, default=None, help="a time.time() to begin the requests at")
    parser.add_argument("--instance-id", type=int, default=None,
                        help="the id to register the KV under (default lmcache's, 1000): one each for drivers run at once")
    return parser


def _run_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.mode not in ("store", "verify", "lookup") or not (args.rpc_url and args.http_url):
        raise SystemExit(f"{args.mode}: store, verify or lookup with --rpc-url and --http-url")
    return run(args.mode, args.rpc_url, args.http_url, _seqs(args), args.num_tokens, args.shape, args.num_blocks,
               args.start_at, args.instance_id)


def _seqs(args: argparse.Namespace) -> range:
    """--seqs start:end as a range."""
    start, end = (int(x) for x in args.seqs.split(":"))
    return range(start, end)


def main() -> None:
    args = _parser().parse_args()
    if args.mode == "forkserver":
        forkserver(args.socket)
        return
    if args.mode == "hold":
        if not (args.rpc_url and args.http_url):
            raise SystemExit("hold: --rpc-url and --http-url")
        hold(args.rpc_url, args.http_url, _seqs(args), args.num_tokens, args.shape, args.num_blocks)
        return
    json.dump(_run_args(args), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
