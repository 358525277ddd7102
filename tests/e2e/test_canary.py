"""The correctness canary (kvpersist.controller.canary) with real parts: real vLLM (its CPU build)
with LMCache's connector, the real `lmcache server` and the operator on the local cluster, the tiny
test model (hack/testmodel.py) and the canary's built-in prompt (spec.canary.prompt unset: nearly
4,000 tokens of the test tokenizer, 15 whole lmcache chunks). L2 encryption is off, so the objects
are checked frames under a public key: a copy under another name is a miss (issue 56), but whoever
may write the folder can forge one, as step 2 does; with encryption on not even that (only the key
seals). The canary is for what nothing else catches. vLLM's own prefix cache is off (as in tests/e2e/test_real_vllm.py),
so every check reaches LMCache.

Two steps of one scenario, in order:
1. The reference is computed without the cache and the first check agrees, but nothing served it
   from the cache (status.canary.lastCheck.tier computed: the salted reference stored nothing), so
   HitCorrectness is Unknown LMCacheNotReached, not True; the lmcache server pod deleted, a check
   after its restart is served from L2 (tier l2, as the operator attributed it from the pod's and
   the server's counters; vLLM's own counter of tokens from the external cache and the server's L2
   hits read here too): HitCorrectness True; the vLLM pod deleted, a check of the new pod is served
   from the server's L1 (tier l1): HitCorrectness stays True. The reference's salted request leaves
   no chunk file (LMCache is asked to store none of it).
2. A planted wrong hit: the pin modelRevision changed to another revision of the same model id
   (hack/testmodel.py --variant 1: the same files but for other weights), so the prompt's tokens,
   and so lmcache's chunk hashes, are the same and its KV is not. Before the new namespace's pods
   start, the old namespace's chunk objects of the prompt are forged into the new namespace's folder
   under the names the new identity looks up: opened under their own name and sealed again under
   the new one (reseal), as anyone who may write the folder can with encryption off (a plain copy
   is a miss since every object is bound to its name). (With a Hub model id lmcache's model name is the id,
   the same for both revisions, and the names are the same; offline, as here, vLLM names the model
   by its local snapshot path, which carries the revision, so the copies are renamed to it.) The
   new identity's reference is computed without the cache (salted: it cannot read those files);
   its first check is served from them (status.canary.mismatch.tiers: the first differing answer
   from L2, where only the planted files are, the second from L1, which kept them): HitMismatch
   (HitCorrectness False, a Warning event,
   CacheBypassed, Ready False), vLLM rolled without --kv-transfer-config, and a request then served
   with no external hit gives the reference's tokens. The acknowledgement annotation takes the
   cache back (the Deployment with the connector again, CacheRestored).
The variant's attention weighs in (hack/testmodel.py VARIANT_ATTENTION): with the base model's,
the tiny model's next token hardly depends on its context, and the wrong KV would not change the
16 greedy tokens (measured with transformers: identical; with the variant they differ from the
third token on), so the canary could not see it: a real model's answer depends on its context.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpersist import vllmclient
from kvpersist.api.spec import DEFAULT_CANARY_PROMPT
from kvpersist.inventory.volume import TRIMMED_ADAPTERS, is_chunk_name
from kvpersist.status.canary import ACK_ANNOTATION
from tests.e2e.kube import REPO, Kubectl, wait_for
from tests.e2e.operator_env import NAME, Env, in_pod, kvpersist_env, target_of
from tests.e2e.test_build_check import events, where_it_stands
from tests.e2e.test_real_vllm import (  # noqa: F401  (model: a fixture)
    CHUNK,
    external_hits,
    lmcache_hits,
    metrics,
    model,
    pod,
    print_logs,
    real_manifest,
    server_ip,
    vllm_pod,
)

pytestmark = [pytest.mark.e2e, pytest.mark.datapath, pytest.mark.vllm]

PROMPT_TOKENS = 3947  # the built-in prompt in the test tokenizer
CHUNKS = 15  # its whole lmcache chunks (before its last token)
MIN_HIT = 10 * CHUNK  # a check served from the cache hits (nearly) all of them


@pytest.fixture(scope="module")
def variant(model: dict) -> dict:  # noqa: F811
    """Another revision of the test model: the same tokenizer and config, other weights."""
    out = subprocess.run([str(Path(model["vllm"]).parent / "python"), str(REPO / "hack" / "testmodel.py"), "--size", "tiny",
                          "--hf-home", model["hfHome"], "--variant", "1"], check=True, capture_output=True, text=True,
                         timeout=600)
    return json.loads(out.stdout)


def status_of(kubectl: Kubectl, ns: str) -> dict[str, Any]:
    return kubectl.get("kvns", NAME, ns).get("status") or {}


def cond(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def salted(name: str) -> bool:
    """A chunk file of a salted request: `@<salt>` after the hash (fs_native's names hold three `@`
    without one, nixl_store_dynamic's none)."""
    return name.count("@") > (3 if name.endswith(".data") else 0)


def object_key(name: str) -> Any:
    """lmcache's ObjectKey of an unsalted fs_native chunk file `<model>@0x<rank>@<group>@<hash>.data`
    (its C++ connector writes a model's `/` as `-SEP-`)."""
    from types import SimpleNamespace

    served, rank, group, chunk = name.removesuffix(".data").split("@")
    return SimpleNamespace(model_name=served.replace("-SEP-", "/"), kv_rank=int(rank, 16), object_group_id=int(group, 16),
                           chunk_hash=bytes.fromhex(chunk), cache_salt="")


def reseal(src: Path, old_ns: str, dst: Path, new_ns: str) -> None:
    """A forged object: src's chunk opened under its own name and namespace and sealed under dst's,
    with the public key of encryption off (kvpersist.inserver.serve.CHECKED_KEY). The plaintext's
    length is not in the frame: the multiple of 256 bytes that opens is it."""
    import os

    from kvpersist.inserver import serve

    key = serve.PublicKey()
    frame = bytearray(src.read_bytes())
    old = serve.object_binding(key.fingerprint, old_ns, object_key(src.name))
    top = (len(frame) - serve.HEADER_LEN) // 256 * 256
    for n in range(top, max(0, top - 8192), -256):  # the file is the frame padded to 4 KiB pages
        if serve.sealed_size(n) > len(frame):
            continue
        out = bytearray(n)
        try:
            serve.open_frame(key.aead(""), key.fingerprint, old, memoryview(frame), memoryview(out))
        except Exception:
            continue
        sealed = bytearray(len(frame))  # the same padded size
        new = serve.object_binding(key.fingerprint, new_ns, object_key(dst.name))
        serve.seal(key.aead(""), key.fingerprint, new, os.urandom(serve.IV_LEN), memoryview(out), memoryview(sealed))
        dst.write_bytes(bytes(sealed))
        return
    raise AssertionError(f"{src.name}: no plaintext length opens it")


def chunk_files(folder: Path) -> list[Path]:
    """The namespace folder's committed chunk files, whatever the adapter (a salted one's name ends
    `@<salt>.data`, or `.bin` with nixl_store_dynamic)."""
    return sorted(p for p in folder.iterdir() if any(is_chunk_name(p.name, a) for a in TRIMMED_ADAPTERS)
                  ) if folder.is_dir() else []


def vllm_counter(ip: str) -> float:
    return external_hits(metrics(f"http://{ip}:8000/metrics"))


@pytest.fixture(scope="module")
def scenario(kubectl: Kubectl, crd: None, model: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:  # noqa: F811
    """One resource with the canary on (checks after restarts only, in this test's time: the
    periodic one is a unit test's) and L2 encryption off, and the time each step took."""
    with kvpersist_env(kubectl, tmp_path_factory.mktemp("canary"), vllm=model["vllm"], hf_home=Path(model["hfHome"])) as env:
        obj = real_manifest(env.ns, model)
        obj["spec"]["l2"]["encryption"] = {"enabled": False}
        obj["spec"]["canary"] = {"enabled": True, "intervalSeconds": 3600}
        kubectl.apply(obj)
        state: dict[str, Any] = {"env": env, "obj": obj, "nsid": target_of(obj, kubectl).namespace_id,
                                 "started": time.monotonic(), "marks": []}
        try:
            yield state
        except BaseException:
            print_logs(env)
            raise
        finally:
            print(f"\n[canary] {'; '.join(state['marks'])}")


def mark(state: dict[str, Any], what: str) -> None:
    state["marks"].append(f"{what} at {time.monotonic() - state['started']:.0f}s")


def checked_after(kubectl: Kubectl, env: Env, stamp: str | None, pod_name: str, what: str) -> dict[str, Any]:
    """status.canary.lastCheck once a check of pod_name answered after stamp."""
    def probe() -> dict[str, Any] | None:
        check = (status_of(kubectl, env.ns).get("canary") or {}).get("lastCheck") or {}
        return check if check.get("pod") == pod_name and (stamp is None or check["at"] > stamp) else None
    return wait_for(what, probe, timeout=300, interval=1, explain=lambda: where_it_stands(kubectl, env.ns, env.log))


def test_the_canary_stays_true_over_vllm_and_server_restarts_served_from_the_cache(kubectl: Kubectl,
                                                                                    scenario: dict) -> None:
    env, nsid = scenario["env"], scenario["nsid"]
    ns = env.ns
    vllm = vllm_pod(kubectl, ns)
    first = checked_after(kubectl, env, None, vllm["metadata"]["name"], "the reference and the first check")
    mark(scenario, "reference and first check")
    status = status_of(kubectl, ns)
    record = status["canary"]
    assert record["namespaceId"] == status["namespaceId"] == nsid
    assert record["referencePod"] == vllm["metadata"]["name"] and len(record["referenceTokenIds"]) == 16
    assert first["match"] is True and first["tier"] == "computed", first  # nothing was stored before it
    assert record["promptTokens"] == PROMPT_TOKENS and "lastServedCheck" not in record, record
    # A match that no cache served verifies nothing about the cache.
    unverified = wait_for("HitCorrectness LMCacheNotReached", lambda: (lambda c: c if c.get("reason") == "LMCacheNotReached"
                                                                        else None)(cond(status_of(kubectl, ns), "HitCorrectness")),
                          timeout=30)
    assert unverified["status"] == "Unknown" and "not verified" in unverified["message"], unverified
    reference = record["referenceTokenIds"]

    # The server restarts: the check after it is served from L2 (its L1 is new and empty), once the
    # first check's chunks are there (L1 writes them to L2 behind the request). The reference's
    # salted request stored none (no file name with '@').
    folder = env.volume() / nsid
    wait_for("the prompt's chunks in L2", lambda: len(chunk_files(folder)) >= CHUNKS, timeout=60)
    assert not [p.name for p in chunk_files(folder) if salted(p.name)]
    ip = vllm["status"]["podIP"]
    before = vllm_counter(ip)
    old_server = kubectl.get("pod", f"{NAME}-lmcache-0", ns)["metadata"]["uid"]
    kubectl.run("delete", "pod", f"{NAME}-lmcache-0", "-n", ns, "--wait=false")
    server = server_ip(kubectl, ns, exclude_uid=old_server)
    after_server = checked_after(kubectl, env, first["at"], vllm["metadata"]["name"], "a check after the server's restart")
    mark(scenario, "check after the server restart")
    assert after_server["match"] is True and after_server["tier"] == "l2", after_server
    l1, l2 = lmcache_hits(metrics(f"{in_pod(server)}/metrics"))
    assert vllm_counter(ip) - before >= MIN_HIT and l2 >= MIN_HIT, (vllm_counter(ip) - before, l1, l2)
    verified = wait_for("HitCorrectness True", lambda: (lambda c: c if c.get("status") == "True" else None)(
        cond(status_of(kubectl, ns), "HitCorrectness")), timeout=30)
    assert verified["reason"] == "HitsMatch" and "1 matching check(s) served by lmcache (L1 0, L2 1" in verified["message"]

    # The vLLM pod restarts: the check of the new pod is served from the server's cache.
    kubectl.run("delete", "pod", vllm["metadata"]["name"], "-n", ns, "--wait=false")
    new = vllm_pod(kubectl, ns, exclude={vllm["metadata"]["name"]})
    after_vllm = checked_after(kubectl, env, after_server["at"], new["metadata"]["name"], "a check of the new vLLM pod")
    mark(scenario, "check after the vLLM restart")
    assert after_vllm["match"] is True and after_vllm["tier"] == "l1" and vllm_counter(new["status"]["podIP"]) >= MIN_HIT
    status = status_of(kubectl, ns)
    assert cond(status, "HitCorrectness")["status"] == "True" and status["canary"]["referenceTokenIds"] == reference
    assert status["canary"]["matches"] == {"gpu": 0, "l1": 1, "l2": 1, "lmcache": 0, "computed": 1, "unknown": 0}
    assert status["canary"]["lastServedCheck"] == after_vllm
    assert not events(kubectl, ns, "HitMismatch")
    scenario["phase_a"] = True


def test_a_planted_wrong_hit_turns_the_cache_off_until_acknowledged(kubectl: Kubectl, scenario: dict, model: dict,  # noqa: F811
                                                                     variant: dict) -> None:
    if not scenario.get("phase_a"):
        pytest.fail("the first step did not pass: the planted files are its chunks")
    env, obj, nsid = scenario["env"], scenario["obj"], scenario["nsid"]
    ns = env.ns
    changed = json.loads(json.dumps(obj))
    changed["spec"]["identity"].update(modelRevision=variant["modelRevision"], tokenizerRevision=variant["tokenizerRevision"])
    new_id = target_of(changed, kubectl).namespace_id
    assert new_id != nsid
    old_folder, new_folder = env.volume() / nsid, env.volume() / new_id
    chunks = [p for p in chunk_files(old_folder) if not salted(p.name)]
    assert len(chunks) >= CHUNKS, [p.name for p in chunk_files(old_folder)]
    new_folder.mkdir()
    for chunk in chunks:  # the names the new identity looks up (module docstring), forged under them
        planted = chunk.name.replace(model["modelRevision"], variant["modelRevision"])
        assert planted != chunk.name, chunk.name
        reseal(chunk, nsid, new_folder / planted, new_id)
    kubectl.apply(changed)
    found = wait_for("HitCorrectness False", lambda: (lambda c: c if c.get("status") == "False" else None)(
        cond(status_of(kubectl, ns), "HitCorrectness")), timeout=360, interval=1,
        explain=lambda: where_it_stands(kubectl, ns, env.log))
    mark(scenario, "HitMismatch")
    status = status_of(kubectl, ns)
    record = status["canary"]
    assert status["namespaceId"] == record["namespaceId"] == new_id and found["reason"] == "HitMismatch"
    mismatch = record["mismatch"]
    assert mismatch["expected"] == record["referenceTokenIds"] != mismatch["got"], record
    # Served from the planted objects: the first differing answer from L2 (the new folder holds only
    # them), the second from L1, which kept them (the pod's external hits, attributed by the operator).
    assert mismatch["tiers"] == ["l2", "l1"], mismatch
    assert record["lastCheck"]["match"] is False
    ack = f"kubectl annotate kvcachenamespace {NAME} -n {ns} {ACK_ANNOTATION}={mismatch['id']} --overwrite"
    assert ack in found["message"] and new_id in found["message"], found["message"]
    warned = wait_for("the HitMismatch event", lambda: events(kubectl, ns, "HitMismatch"), timeout=30)
    assert warned[0]["type"] == "Warning" and ack in warned[0]["message"]
    bypass = wait_for("CacheBypassed", lambda: (lambda c: c if c.get("reason") == "HitMismatch" else None)(
        cond(status_of(kubectl, ns), "CacheBypassed")), timeout=30)
    assert bypass["status"] == "True" and ack in bypass["message"]
    ready = cond(status_of(kubectl, ns), "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "HitMismatch")
    dep = wait_for("vLLM's Deployment without the cache", lambda: (lambda c: c if "--kv-transfer-config" not in c[
        "args"] else None)(kubectl.get("deployment", f"{NAME}-vllm", ns)["spec"]["template"]["spec"]["containers"][0]),
        timeout=60)
    assert dep["command"] == ["vllm"]
    plain = wait_for("a vLLM pod without the cache", lambda: next(
        (p for p in [pod(kubectl, ns, f"{NAME}-vllm-")] if p is not None
         and "--kv-transfer-config" not in p["spec"]["containers"][0]["args"]), None), timeout=300, interval=1)
    mark(scenario, "vLLM without the cache")
    # Served without the cache, the answer is the reference again (computed, so right).
    answer = vllmclient.complete(plain["status"]["podIP"], 8000, "kvpersist/tiny-llama", DEFAULT_CANARY_PROMPT,
                                 max_tokens=16)
    assert list(answer.token_ids) == mismatch["expected"]
    assert vllm_counter(plain["status"]["podIP"]) == 0  # no external hit: no connector

    # Acknowledged: the cache comes back (the mismatch is gone from status).
    kubectl.run("annotate", "kvns", NAME, "-n", ns, f"{ACK_ANNOTATION}={mismatch['id']}", "--overwrite")
    wait_for("the Deployment with the cache again", lambda: "--kv-transfer-config" in kubectl.get(
        "deployment", f"{NAME}-vllm", ns)["spec"]["template"]["spec"]["containers"][0]["args"], timeout=60)
    status = wait_for("CacheBypassed gone", lambda: (lambda s: s if not cond(s, "CacheBypassed") else None)(
        status_of(kubectl, ns)), timeout=30)
    assert "mismatch" not in status["canary"] and cond(status, "HitCorrectness").get("reason") != "HitMismatch"
    assert wait_for("CacheRestored", lambda: events(kubectl, ns, "CacheRestored"), timeout=30)
    mark(scenario, "acknowledged")
