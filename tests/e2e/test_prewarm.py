"""spec.prewarm end to end with real parts: the operator, the real `lmcache server` with the real
inventory agent beside it, and real vLLM (its CPU build) under hack/kubelet_runner.py on the
local cluster, with the small generated test model (tests/e2e/test_real_vllm.py's setting).

One scenario, asserted on status and on lmcache's and vLLM's own counters, never on timing:
a resource declares a prompt and a system prompt neither of which was ever asked; Warm turns True
(both were computed once through vLLM: L2 had neither); the lmcache server pod is deleted (vLLM
kept); Warm leaves True and comes back to True after the re-warm, this time from L2 (nothing
computed); then the prompt's request, and a chat that starts with the system prompt, are served
from L1 (lmcache's lookup_hit_l1 tokens up, lookup_hit_l2 not), read through the pod's loopback.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import NAME, in_pod, kvpersist_env
from tests.e2e.test_real_vllm import (  # noqa: F401  (model: a fixture)
    CHUNK,
    external_hits,
    lmcache_hits,
    metrics,
    model,
    pod,
    print_logs,
    prompt,
    real_manifest,
    server_ip,
    vllm_pod,
)
from tests.e2e.test_real_vllm import cacheable as whole_chunks

pytestmark = [pytest.mark.e2e, pytest.mark.datapath, pytest.mark.vllm]

# vLLM's finished requests, and lmcache's chunks loaded from L2 into L1 whole and stored into L2.
VLLM_REQUESTS = "vllm:request_success_total"
L2_LOADED = "lmcache_mp_l2_prefetch_load_completed_chunks_total"
L2_STORED = "lmcache_mp_l2_store_completed_objects_chunks_total"
PROMPT = prompt(31, 700)  # about 900 tokens of the test tokenizer: three whole chunks
SYSTEM = "You answer in the style of a ship's log. " + prompt(32, 300)  # a whole chunk and more, as a system message


def warm(kubectl: Kubectl, ns: str) -> dict:
    conds = (kubectl.get("kvns", NAME, ns).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "Warm"), {})


def stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def ask(ip: str, body: dict, path: str) -> dict:
    req = urllib.request.Request(f"http://{ip}:8000{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def warmed(kubectl: Kubectl, crd: None, model: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:  # noqa: F811
    with kvpersist_env(kubectl, tmp_path_factory.mktemp("prewarm"), vllm=model["vllm"], hf_home=Path(model["hfHome"])) as env:
        obj = real_manifest(env.ns, model)
        obj["spec"]["prewarm"] = {"prompts": [PROMPT], "systemPrompts": [SYSTEM]}
        # The canary's requests would move the counters this module reads; it is not under test here.
        obj["spec"]["canary"] = {"enabled": False}
        kubectl.apply(obj)
        try:
            yield {"env": env, "model": model}
        except BaseException:
            print_logs(env)
            print(env.log.read_text(errors="replace")[-6000:])
            raise


def test_declared_prompts_never_asked_are_computed_once_and_warm(kubectl: Kubectl, warmed: dict) -> None:
    ns = warmed["env"].ns
    vllm_pod(kubectl, ns, timeout=300)
    cond = wait_for("Warm True", lambda: (lambda c: c if c.get("status") == "True" else None)(warm(kubectl, ns)), timeout=300,
                    interval=2, explain=lambda: f"Warm is {warm(kubectl, ns)}")
    assert cond["reason"] == "Warm" and "2 of 2 prompts warm on every server (1 server(s)" in cond["message"], cond
    assert "2 computed through vLLM, L2 lacking them" in cond["message"], cond  # neither was ever asked
    ready = next(c for c in kubectl.get("kvns", NAME, ns)["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    # What the message says, by vLLM's and lmcache's own counters: two requests computed through
    # vLLM (one per prompt: the only requests it served), none of their chunks loaded from L2 (it
    # had none), and what they computed stored into L2.
    ip = vllm_pod(kubectl, ns)["status"]["podIP"]
    vllm = metrics(f"http://{ip}:8000/metrics")
    lmcache = metrics(f"{in_pod(server_ip(kubectl, ns))}/metrics")
    assert vllm.get(VLLM_REQUESTS) == 2 and external_hits(vllm) == 0, {k: vllm.get(k) for k in (VLLM_REQUESTS,)}
    chunks = int(re.search(r"(\d+) chunks in L1", cond["message"]).group(1))  # type: ignore[union-attr]
    assert lmcache.get(L2_LOADED, 0.0) == 0 and lmcache.get(L2_STORED, 0.0) >= chunks, (lmcache.get(L2_LOADED),
                                                                                        lmcache.get(L2_STORED), chunks)
    warmed["requests"] = vllm[VLLM_REQUESTS]


def test_after_a_server_restart_they_are_warmed_again_from_l2_and_served_from_l1(kubectl: Kubectl, warmed: dict) -> None:
    ns, env = warmed["env"].ns, warmed["env"]
    before = warm(kubectl, ns)
    assert before.get("status") == "True"
    # What the first pass computed is in L1 at once and in L2 a moment later (lmcache writes L2
    # behind): the restart comes once the files are there, so the re-warm has them to read.
    chunks = int(re.search(r"(\d+) chunks in L1", before["message"]).group(1))  # type: ignore[union-attr]
    folder = env.volume() / kubectl.get("kvns", NAME, ns)["status"]["namespaceId"]
    wait_for(f"{chunks} chunk files in L2", lambda: len([f for f in folder.glob("*") if f.is_file()]) >= chunks,
             timeout=60, interval=1)
    old = kubectl.get("pod", f"{NAME}-lmcache-0", ns)["metadata"]["uid"]
    deleted_at = time.time()
    kubectl.run("delete", "pod", f"{NAME}-lmcache-0", "-n", ns, "--wait=false")
    server = in_pod(server_ip(kubectl, ns, exclude_uid=old))

    def warm_again() -> dict | None:
        c = warm(kubectl, ns)
        return c if c.get("status") == "True" and stamp(c["lastTransitionTime"]) >= int(deleted_at) else None

    cond = wait_for("Warm True again after the restart", warm_again, timeout=300, interval=2,
                    explain=lambda: f"Warm is {warm(kubectl, ns)}")
    # Both from L2 this time: nothing computed (the message would count it) ...
    assert "2 of 2 prompts warm on every server" in cond["message"] and "computed" not in cond["message"], cond
    ip = vllm_pod(kubectl, ns)["status"]["podIP"]
    # ... and by the counters: vLLM (the same pod) served no request meanwhile, and the new server
    # loaded every chunk of the pass from L2.
    assert metrics(f"http://{ip}:8000/metrics").get(VLLM_REQUESTS) == warmed.get("requests", 2)
    loaded = metrics(f"{server}/metrics").get(L2_LOADED, 0.0)
    assert loaded >= chunks, (loaded, chunks)
    model_id = warmed["model"]["modelId"]
    l1_0, l2_0 = lmcache_hits(metrics(f"{server}/metrics"))
    hits_0 = external_hits(metrics(f"http://{ip}:8000/metrics"))
    tokens = ask(ip, {"model": model_id, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0}, "/v1/completions")["usage"]
    l1_1, l2_1 = lmcache_hits(metrics(f"{server}/metrics"))
    served = external_hits(metrics(f"http://{ip}:8000/metrics")) - hits_0
    cacheable = whole_chunks(tokens["prompt_tokens"])
    assert cacheable >= 3 * CHUNK and served == cacheable, (tokens, served)
    assert (l1_1 - l1_0, l2_1 - l2_0) == (cacheable, 0), (l1_1 - l1_0, l2_1 - l2_0)
    # A chat that starts with the system prompt: its whole chunks come from L1 too.
    chat = {"model": model_id, "max_tokens": 1, "temperature": 0.0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Log the weather."}]}
    ask(ip, chat, "/v1/chat/completions")
    l1_2, l2_2 = lmcache_hits(metrics(f"{server}/metrics"))
    assert l1_2 - l1_1 >= CHUNK and l2_2 == l2_1, (l1_2 - l1_1, l2_2 - l2_1)
