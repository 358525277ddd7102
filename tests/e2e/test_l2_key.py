"""L2's key is part of the namespace: a key change is a new namespace, never the same folder read
with another key (issue 27, item 1). Real API server, real lmcache servers writing real encrypted
files (hack/kubelet_runner.py), the operator as a process.

In order, on one resource: its Secret switched to another (keySecretRef), then the bytes in that
Secret rotated (first with the operator down and the server container restarted before any
rollout: the server refuses the new bytes and leaves every file as it was; later the old bytes
back: the old namespace served again from its files): each time a new namespace id, the old folder left byte for byte as it was and
listed as an orphan by `kvpersist report`, a Warning L2KeyChanged, and the same prompts stored
anew in the new folder (misses, recomputed, never served from the other key's files). Then the
generated key: deleted with data under it and the operator restarted, it is not made again (cache
off, L2KeyLost in IdentityResolved and L2Ready and a Warning event naming the Secret, the namespace
and what it holds, gc refusing that namespace); restored from a backup, the same namespace comes
back and its stored KV hits; deleted again and the loss accepted with the annotation, a new key,
a new namespace, and the old one an orphan.
"""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.identity import key_fingerprint
from kvpersist.inventory.volume import served_of
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import (
    NAME,
    bench_store,
    in_pod,
    kvpersist_env,
    manifest,
    more_rounds,
    start_operator,
    stop,
    target_of,
)
from tests.e2e.test_real_vllm import lmcache_hits, metrics
from tests.fsstate import files_state

pytestmark = [pytest.mark.e2e, pytest.mark.datapath]

LMCACHE = shutil.which("lmcache")
KEY_SECRET = f"{NAME}-l2-key"  # the generated one
REPLACE_ANNOTATION = "kvpersist.dev/replace-l2-key"
L2_LOADED = "lmcache_mp_l2_prefetch_load_completed_chunks_total"  # chunks lmcache loaded from L2 into L1 whole
BENCH_TOKENS = 4 * 512  # bench_store(ip, 0, 4): four sequences of 512 tokens


def status(k: Kubectl, ns: str) -> dict:
    return k.get("kvns", NAME, ns).get("status") or {}


def cli(k: Kubectl, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpersist.cli", *args, "--kubeconfig", str(k.kubeconfig)],
                          capture_output=True, text=True, timeout=240)


def condition(st: dict, type_: str) -> dict:
    return next((c for c in st.get("conditions") or [] if c["type"] == type_), {})


def seen(k: Kubectl, ns: str) -> str:
    """What a timed-out wait saw: phase, namespace id, IdentityResolved, and the generated Secret."""
    st = status(k, ns)
    ident = condition(st, "IdentityResolved")
    secret = k.run("get", "secret", KEY_SECRET, "-n", ns, "-o", "name", check=False).returncode == 0
    return (f"phase {st.get('phase')}, namespaceId {st.get('namespaceId')}, IdentityResolved {ident.get('reason')}, "
            f"Secret {KEY_SECRET} {'present' if secret else 'absent'}")


def server_on(k: Kubectl, ns: str, namespace_id: str) -> str:
    """The IP of the Ready server pod of that namespace id (the one a bench must reach)."""
    def ip() -> str | None:
        pod = json.loads(k.run("get", "pod", f"{NAME}-lmcache-0", "-n", ns, "-o", "json", check=False).stdout or "{}")
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions", []))
        labels = (pod.get("metadata") or {}).get("labels") or {}
        on = labels.get("kvpersist.dev/namespace-id") == namespace_id and not pod["metadata"].get("deletionTimestamp")
        return pod["status"].get("podIP") if ready and on else None
    return wait_for(f"a Ready server of {namespace_id}", ip, timeout=300, interval=1)


def ready_on(k: Kubectl, ns: str, namespace_id: str | None) -> dict:
    st = wait_for(f"Ready on {namespace_id}", lambda: (lambda s: s if s.get("phase") == "Ready" and s.get("namespaceId")
                                                      == namespace_id else None)(status(k, ns)), timeout=300, interval=1)
    server_on(k, ns, st["namespaceId"])
    return st


def ready_elsewhere(k: Kubectl, ns: str, old_id: str) -> dict:
    """Ready on a namespace id other than old_id (what a key change must lead to)."""
    try:
        st = wait_for(f"Ready on another namespace than {old_id}", lambda: (lambda s: s if s.get("phase") == "Ready" and s.get(
            "namespaceId") not in (None, old_id) else None)(status(k, ns)), timeout=300, interval=1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; now: {seen(k, ns)}") from exc
    server_on(k, ns, st["namespaceId"])
    return st


def settled(folder: Path) -> dict:
    """The folder's files once the server's asynchronous L2 writes have landed (two equal looks)."""
    last: dict = {}

    def same() -> dict | None:
        nonlocal last
        now = files_state(folder) if folder.exists() else {}
        done = now if now and now == last else None
        last = now
        return done

    return wait_for(f"the writes into {folder.name} to settle", same, timeout=60, interval=2)


def served_from_l2(k: Kubectl, ns: str) -> tuple[float, float]:
    """The bench's prompts asked again of the server (L1 empty after its restart): the chunks
    lmcache loaded from L2 into L1 whole (an object that failed authentication is none) and its
    L2 hit tokens, by its own counters."""
    server = in_pod(server_ip(k, ns))
    before = metrics(f"{server}/metrics")
    bench_store(server_ip(k, ns), 0, 4)
    after = metrics(f"{server}/metrics")
    return after.get(L2_LOADED, 0.0) - before.get(L2_LOADED, 0.0), lmcache_hits(after)[1] - lmcache_hits(before)[1]


def key_refusal(k: Kubectl, ns: str) -> str | None:
    """The server container's termination message while it refuses its key file (lastState)."""
    pod = k.get("pod", f"{NAME}-lmcache-0", ns)
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (status.get("lastState") or {}).get("terminated") or {}
        if status.get("name") == "lmcache-server" and term.get("exitCode") == 78:
            return str(term.get("message") or "")
    return None


def put_secret(k: Kubectl, ns: str, name: str, key: bytes) -> None:
    k.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns}, "type": "Opaque",
             "data": {"master-key": base64.b64encode(key).decode()}})


def events(k: Kubectl, ns: str, reason: str) -> list[str]:
    out = k.run("get", "events", "-n", ns, "--field-selector", f"reason={reason}", "-o", "json").stdout
    return [e["message"] for e in json.loads(out)["items"]]


def server_ip(k: Kubectl, ns: str) -> str:
    return k.get("pod", f"{NAME}-lmcache-0", ns)["status"]["podIP"]


def report(k: Kubectl, ns: str) -> dict[str, dict]:
    out = cli(k, "report", "-n", ns, "-o", "json")
    assert out.returncode == 0, out.stderr
    return {r["namespace_id"]: r for r in json.loads(out.stdout)}


def orphan_in_report(k: Kubectl, ns: str, namespace_id: str, files: dict) -> dict:
    """`kvpersist report` lists the namespace as an orphan holding exactly its files."""
    size = sum(v[0] for v in files.values())
    return wait_for(f"the report to list {namespace_id} as an orphan of {size} bytes", lambda: (lambda r: r.get(
        namespace_id) if r.get(namespace_id, {}).get("orphan") and r[namespace_id]["bytes"] == size else None)(
        report(k, ns)), timeout=120, interval=2)


@pytest.fixture(scope="module")
def scenario(kubectl: Kubectl, crd: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if LMCACHE is None:
        pytest.fail("lmcache not on PATH: run through hack/test.sh (installs the datapath extra)")
    with kvpersist_env(kubectl, tmp_path_factory.mktemp("l2key")) as env:
        yield {"ns": env.ns, "env": env, "volume": env.volume()}


def with_key_secret(ns: str, name: str | None) -> dict:
    obj = manifest(ns)
    if name is not None:
        obj["spec"]["l2"]["encryption"] = {"keySecretRef": {"name": name}}
    return obj


def test_another_key_secret_is_another_namespace(kubectl: Kubectl, scenario: dict) -> None:
    """keySecretRef pointed at another Secret (as docs/api.md suggests for sharing a bucket): the
    id follows the key, the first key's data stays, an orphan."""
    ns, volume = scenario["ns"], scenario["volume"]
    one, two = secrets.token_bytes(32), secrets.token_bytes(32)
    put_secret(kubectl, ns, "key-one", one)
    put_secret(kubectl, ns, "key-two", two)
    first = with_key_secret(ns, "key-one")
    kubectl.apply(first)
    a = wait_for("Ready", lambda: (lambda s: s.get("namespaceId") if s.get("phase") == "Ready" else None)(
        status(kubectl, ns)), timeout=300, interval=1)
    server_on(kubectl, ns, a)
    bench_store(server_ip(kubectl, ns), 0, 4)
    stored = settled(volume / a)

    second = with_key_secret(ns, "key-two")
    kubectl.apply(second)
    b = ready_elsewhere(kubectl, ns, a)["namespaceId"]  # today's main: the same id, forever (misses, no condition)
    assert files_state(volume / a) == stored  # untouched
    # The ids are the pins with the fingerprint of the key the servers mount, and status names it (not the key).
    assert (a, b) == (target_of(first, kubectl).namespace_id, target_of(second, kubectl).namespace_id)
    assert status(kubectl, ns)["l2Key"] == {"secret": "key-two", "generated": False, "fingerprint": key_fingerprint(two),
                                            "namespaceId": b}
    changed = events(kubectl, ns, "L2KeyChanged")
    assert any(key_fingerprint(one) in m and key_fingerprint(two) in m and a in m and b in m for m in changed), changed
    orphan_in_report(kubectl, ns, a, stored)
    # The fingerprints are everywhere a user looks; the keys nowhere but in their Secrets.
    dump = kubectl.run("get", "kvns,events,configmaps,statefulsets,deployments,pods,pvc", "-n", ns, "-o", "json").stdout
    seen_by_user = dump + scenario["env"].log.read_text()
    assert key_fingerprint(two) in dump
    for key in (one, two):
        assert not [form for form in (base64.b64encode(key).decode(), key.hex()) if form in seen_by_user]
    scenario.update(a=a, b=b, two=two)


def test_rotated_bytes_in_the_same_secret_are_another_namespace(kubectl: Kubectl, scenario: dict) -> None:
    """Other bytes under the same Secret and key: no spec change at all, and still a new namespace
    (read from the Secret the servers mount), within a status interval or two. The same prompts are
    then misses, stored anew in the new folder: recomputed, not read from files sealed otherwise."""
    ns, volume, b, env = scenario["ns"], scenario["volume"], scenario["b"], scenario["env"]
    bench_store(server_ip(kubectl, ns), 0, 4)
    stored = settled(volume / b)
    three = secrets.token_bytes(32)
    # Issue 39: the bytes rotated and the server container restarted (an OOM kill, a failed probe)
    # before its pod is rolled to the new namespace (the operator is down meanwhile, so nothing
    # rolls). The kubelet mounts the new bytes; the server refuses them and reads or removes nothing.
    stop(env.operator)
    put_secret(kubectl, ns, "key-two", three)
    env.runner.kill(f"{NAME}-lmcache-0")
    message = wait_for("the restarted server to refuse the rotated key", lambda: key_refusal(kubectl, ns), timeout=120)
    assert (f"key file fingerprint {key_fingerprint(three)}, namespace {b} expects {key_fingerprint(scenario['two'])}"
            in message), message
    assert files_state(volume / b) == stored  # on the previous main: every file read was deleted
    env.operator = start_operator(kubectl.kubeconfig, ns, env.log)
    c = ready_elsewhere(kubectl, ns, b)["namespaceId"]
    assert c != scenario["a"] and c == target_of(with_key_secret(ns, "key-two"), kubectl).namespace_id
    scenario["c"] = c
    assert status(kubectl, ns)["l2Key"]["fingerprint"] == key_fingerprint(three)
    assert files_state(volume / b) == stored
    assert any(b in m and c in m for m in events(kubectl, ns, "L2KeyChanged"))
    bench_store(server_ip(kubectl, ns), 0, 4)
    again = settled(volume / c)
    assert set(again) == set(stored)  # the same chunks (same names), written again under the new key ...
    assert all(again[name][2] != stored[name][2] for name in stored)  # ... as other bytes
    orphan_in_report(kubectl, ns, b, stored)
    # The old bytes back: the old namespace is served again, every chunk opened from its files.
    put_secret(kubectl, ns, "key-two", scenario["two"])
    ready_on(kubectl, ns, b)
    loaded, l2_hits = served_from_l2(kubectl, ns)
    assert (loaded, l2_hits) == (len(stored), BENCH_TOKENS), (loaded, l2_hits, len(stored))
    assert files_state(volume / b) == stored
    scenario["c"] = b  # what the resource serves now (the next test moves it elsewhere)


def test_a_generated_key_deleted_over_data_is_never_made_again(kubectl: Kubectl, scenario: dict) -> None:
    """The issue's reproduction: the generated key deleted and the operator restarted. The operator
    does not make another key over the stored data; the cache is off and the resource says what
    happened and what to do; gc refuses the namespace that waits for its key."""
    ns, volume, env = scenario["ns"], scenario["volume"], scenario["env"]
    generated = manifest(ns)  # keySecretRef dropped: the operator's own key (another key: another namespace)
    kubectl.apply(generated)
    previous = scenario.get("c")  # (absent when this test runs alone)
    d = (ready_elsewhere(kubectl, ns, previous) if previous else wait_for("Ready", lambda: status(kubectl, ns).get(
        "phase") == "Ready" and status(kubectl, ns), timeout=300, interval=1))["namespaceId"]
    server_on(kubectl, ns, d)
    made = status(kubectl, ns)["l2Key"]  # the operator's own key in use (status names it; no Event of its own)
    assert (made["secret"], made["generated"], made["namespaceId"]) == (KEY_SECRET, True, d), made
    bench_store(server_ip(kubectl, ns), 0, 4)
    stored = settled(volume / d)
    held = sum(v[0] for v in stored.values())
    wait_for("the inventory to count the stored data", lambda: (served_of(status(kubectl, ns).get("inventory"), d)
                                                                 or (None,))[0] == held, timeout=120, interval=1)
    backup = kubectl.get("secret", KEY_SECRET, ns)
    fingerprint = key_fingerprint(base64.b64decode(backup["data"]["master-key"]))

    stop(env.operator)
    kubectl.run("delete", "secret", KEY_SECRET, "-n", ns)
    env.operator = start_operator(kubectl.kubeconfig, ns, env.log)
    try:
        lost = wait_for("IdentityResolved L2KeyLost", lambda: (lambda c: c if c.get("reason") == "L2KeyLost" else None)(
            condition(status(kubectl, ns), "IdentityResolved")), timeout=120, interval=1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; now: {seen(kubectl, ns)}") from exc
    st = status(kubectl, ns)
    assert st["phase"] == "CacheDisabled" and condition(st, "L2Ready")["reason"] == "L2KeyLost"
    for part in (KEY_SECRET, fingerprint, d, f"{REPLACE_ANNOTATION}={fingerprint}", "Restore the Secret"):
        assert part in lost["message"], (part, lost["message"])
    assert st["l2Key"] == {"secret": KEY_SECRET, "generated": True, "fingerprint": fingerprint, "namespaceId": d}
    assert any(fingerprint in m and d in m for m in events(kubectl, ns, "L2KeyLost"))
    more_rounds(env.operator, ns, NAME)  # two more rounds and applies: still nothing made
    assert kubectl.run("get", "secret", KEY_SECRET, "-n", ns, check=False).returncode != 0
    assert kubectl.get("statefulset", f"{NAME}-lmcache", ns)["spec"]["replicas"] == 0  # nothing writes meanwhile
    assert files_state(volume / d) == stored
    refused = cli(kubectl, "gc", d, "-n", ns, "--no-dry-run")
    assert refused.returncode == 3 and "waiting for the L2 key" in refused.stderr, refused.stdout + refused.stderr
    scenario.update(d=d, stored_d=stored, backup=backup, fingerprint=fingerprint)


def test_the_key_restored_from_a_backup_brings_its_namespace_back(kubectl: Kubectl, scenario: dict) -> None:
    ns, volume, d, stored = scenario["ns"], scenario["volume"], scenario["d"], scenario["stored_d"]
    backup = scenario["backup"]
    meta = {k: v for k, v in backup["metadata"].items() if k in ("name", "namespace", "labels", "annotations")}
    kubectl.apply({"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "data": backup["data"]})
    ready_on(kubectl, ns, d)
    assert d == target_of(manifest(ns), kubectl).namespace_id  # the id follows the key back
    # The same prompts, on a server restarted with an empty L1: served from L2, every chunk opened
    # with the restored key (lmcache's own counters: L2 hit tokens, and the chunks it loaded into L1
    # whole; an object that failed authentication is no loaded chunk), and nothing written again.
    loaded, l2_hits = served_from_l2(kubectl, ns)
    assert (loaded, l2_hits) == (len(stored), BENCH_TOKENS), (loaded, l2_hits, len(stored))
    assert files_state(volume / d) == stored


def test_accepting_the_loss_makes_a_new_key_and_an_orphan(kubectl: Kubectl, scenario: dict) -> None:
    ns, volume, d, stored, fingerprint = (scenario[k] for k in ("ns", "volume", "d", "stored_d", "fingerprint"))
    kubectl.run("delete", "secret", KEY_SECRET, "-n", ns)
    wait_for("L2KeyLost again", lambda: condition(status(kubectl, ns), "IdentityResolved").get("reason") == "L2KeyLost",
             timeout=120, interval=1)
    # Accepting another key's loss covers nothing.
    kubectl.run("annotate", "kvns", NAME, "-n", ns, f"{REPLACE_ANNOTATION}={'0' * 16}")
    more_rounds(scenario["env"].operator, ns, NAME)
    assert kubectl.run("get", "secret", KEY_SECRET, "-n", ns, check=False).returncode != 0
    kubectl.run("annotate", "kvns", NAME, "-n", ns, "--overwrite", f"{REPLACE_ANNOTATION}={fingerprint}")
    try:
        e = target_of(manifest(ns), kubectl).namespace_id  # waits for the new Secret
    except AssertionError as exc:
        tail = "\n".join(scenario["env"].log.read_text(errors="replace").splitlines()[-40:])
        raise AssertionError(f"{exc}; now: {seen(kubectl, ns)}; annotations: "
                             f"{kubectl.get('kvns', NAME, ns)['metadata'].get('annotations')}; the operator's last lines:\n"
                             f"{tail}") from exc
    assert e != d
    st = ready_on(kubectl, ns, e)
    assert st["l2Key"]["fingerprint"] != fingerprint and st["l2Key"]["generated"]
    assert any(fingerprint in m and d in m and e in m for m in events(kubectl, ns, "L2KeyReplaced"))
    assert files_state(volume / d) == stored
    orphan_in_report(kubectl, ns, d, stored)
