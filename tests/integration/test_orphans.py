"""Old namespaces' folders on a claim (issue 30, item 7), with the real agent code over HTTP on a
temp folder laid out like a claim (nixl-named chunk files, one folder per namespace id): the agent
reports them, its trim counts them in what the claim holds, the operator's status and condition
follow from its answer, and the opt-in age limit removes only what it may.

Stand-in, named: the claim's size. A temp folder sits on the machine's disk, so the filesystem's
size is replaced by a 10 MB claim (kvpersist.inventory.volume's disk_usage); everything else is
the agent's own code and files on disk. No lmcache server runs here: the trim's effect on
lmcache's lookups is tests/integration/test_capacity.py's (a trimmed file is a miss, never wrong
bytes); what is new is only which watermark the trim uses.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.target import Target
from kvpersist.controller import inuse, kube, retention
from kvpersist.inventory import agent as agent_module
from kvpersist.inventory import volume
from kvpersist.inventory.agent import Agent, make_server
from kvpersist.inventory.agentclient import fetch_inventory, request_expire
from kvpersist.inventory.space import DAY_S, claim_space_summary
from kvpersist.status.conditions import space_condition
from kvpersist.status.workloads import Seen
from tests.cases.invalid_manifests import sample
from tests.fsstate import files_state

SERVED, OLD, OLDER, SHARED = ("kvp-" + ch * 32 for ch in "abcd")
TOKEN = "orphan-token-" * 5
CLAIM = 10_000_000  # the stand-in claim: 10 MB
CHUNK = 256 * 1024


def _chunks(root: Path, nsid: str, n: int, mtime: float) -> None:
    (root / nsid).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        path = root / nsid / f"tiny-llama_01000100_0_{i:064x}.bin"
        path.write_bytes(os.urandom(CHUNK))
        os.utime(path, (mtime + i, mtime + i))


@pytest.fixture
def claim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "l2"
    root.mkdir()
    real = shutil.disk_usage

    def claim_usage(path: Any) -> Any:  # the stand-in claim size: used is what lies in the folder
        if Path(path) != root:
            return real(path)
        used = sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
        return SimpleNamespace(total=CLAIM, used=used, free=CLAIM - used)

    monkeypatch.setattr(volume.shutil, "disk_usage", claim_usage)
    return root


@pytest.fixture
def agent(claim: Path) -> Iterator[tuple[Agent, int]]:
    a = Agent(claim, serving=SERVED, token=TOKEN, capacity_bytes=9_000_000, trim_period_s=3600)
    server = make_server(a, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield a, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_old_folders_count_in_what_the_claim_holds(claim: Path, agent: tuple[Agent, int]) -> None:
    a, port = agent
    now = time.time()
    _chunks(claim, OLD, 16, now - 40.5 * DAY_S)  # 4 MiB an identity change left behind
    _chunks(claim, SERVED, 21, now - 3600)  # 5.25 MiB: within its 9 MB capacity, not beside the old folder
    old_before = files_state(claim / OLD)
    # On main the trim assumed the whole claim (9 MB) and deleted nothing: the claim at 9.7 of 10 MB.
    trimmed = a.trim_once()
    assert trimmed is not None
    # 95% of 10 MB less the old folder's 4 MiB: the served folder keeps at most 5,305,696 bytes.
    assert a.effective_capacity == int(CLAIM * 0.95) - 16 * CHUNK
    assert trimmed.objects == 1 and len(list((claim / SERVED).iterdir())) == 20  # its oldest chunk went
    assert not (claim / SERVED / f"tiny-llama_01000100_0_{0:064x}.bin").exists()
    assert files_state(claim / OLD) == old_before  # never another namespace's file

    inv = fetch_inventory("127.0.0.1", port, token=TOKEN)
    assert inv is not None and inv.effective_capacity_bytes == a.effective_capacity and not inv.truncated
    l2 = claim_space_summary([("pvc/l2-x-0", "x-0", inv)], SERVED, frozenset({SERVED}), now)
    assert l2 is not None and l2["otherNamespacesBytes"] == 16 * CHUNK
    assert [(o["namespaceId"], o["ageDays"], o["orphan"]) for o in l2["largestOtherNamespaces"]] == [(OLD, 40, True)]
    cond = space_condition(l2, 1)
    assert cond is not None and cond["status"] == "False" and cond["reason"] == "ClaimNearlyFull"  # 9.4 of 10 MB
    assert OLD in cond["message"] and f"kvpersist gc {OLD}" in cond["message"]


def test_the_age_limit_removes_only_old_unprotected_folders(claim: Path, agent: tuple[Agent, int],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _a, port = agent
    now = time.time()
    for nsid in (SERVED, OLD, OLDER, SHARED):
        _chunks(claim, nsid, 2, now - 60 * DAY_S)
    _chunks(claim, "kvp-" + "e" * 32, 2, now - 2 * DAY_S)  # written two days ago: within the limit
    # No protected ids: the agent cannot be sure what is in use, and removes nothing.
    code, answer = request_expire("127.0.0.1", port, 30, None, [OLD], token=TOKEN)  # type: ignore[arg-type]
    assert code == 400 and "protected" in (answer.error or "") and (claim / OLD).exists()
    assert request_expire("127.0.0.1", port, 30, [], [OLD])[0] == 401 and (claim / OLD).exists()  # no token

    # Through the operator's pass: SHARED is served by another live resource (the watch caches),
    # OLDER is found in use by the fresh listing right before; only OLD goes, with an Event.
    manifest = sample("nvme-minimal")
    manifest["spec"]["l2"]["orphanRetention"] = {"maxAgeDays": 30}
    manifest["spec"].setdefault("lmcacheServer", {})["agentPort"] = port
    target = Target("x", "ml", KVCacheNamespace.model_validate(manifest).spec, SERVED)
    inv = fetch_inventory("127.0.0.1", port, token=TOKEN)
    assert inv is not None
    events: list[tuple[str, str, str]] = []
    listed: list[str] = []
    monkeypatch.setattr(kube, "post_event", lambda _body, type_, reason, message: events.append((type_, reason, message)))
    monkeypatch.setattr(inuse, "in_use_now", lambda nsid, _cur: listed.append(nsid) or (
        "now in use by ml/y" if nsid == OLDER else None))
    body = {"metadata": {"name": "x", "namespace": "ml"}}
    removed = retention.expire_orphans(body, target, [("pvc/l2-x-0", "x-0", inv)], [("x-0", "127.0.0.1")], TOKEN,
                                       Seen(live_ids=frozenset({SHARED})))
    assert [r["namespaceId"] for r in removed] == [OLD] and not (claim / OLD).exists()
    assert sorted(listed) == [OLD, OLDER]  # neither the served, the shared nor the recent one was a candidate
    assert all((claim / n).exists() for n in (SERVED, OLDER, SHARED, "kvp-" + "e" * 32))
    assert [(t, r) for t, r, _m in events] == [("Normal", "OrphanExpired")] and OLD in events[0][2]
    l2 = claim_space_summary([("pvc/l2-x-0", "x-0", inv)], SERVED, frozenset({SERVED}), now, None, removed)
    assert l2 is not None and (l2["orphansRemoved"], l2["orphansRemovedBytes"], l2["lastOrphanRemoved"]) == (
        1, 2 * CHUNK, OLD)


def _agents_on_one_port(roots: list[Path], stack: ExitStack) -> tuple[list[str], int]:
    """One real agent per claim, on 127.0.0.1, 127.0.0.2, ... and one port, as the servers of a
    resource in a cluster (the operator asks every pod on spec.lmcacheServer.agentPort); retried
    when that port is taken on some address."""
    for _ in range(10):
        servers: list[Any] = []
        try:
            for i, root in enumerate(roots):
                port = servers[0].server_address[1] if servers else 0
                servers.append(make_server(Agent(root, serving=SERVED, token=TOKEN, trim_period_s=3600),
                                           f"127.0.0.{i + 1}", port))
        except OSError:
            for server in servers:
                server.server_close()
            continue
        for server in servers:
            thread = threading.Thread(target=server.serve_forever, daemon=True)
            thread.start()
            stack.callback(thread.join, 10)
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
        return [f"127.0.0.{i + 1}" for i in range(len(roots))], servers[0].server_address[1]
    raise AssertionError("no port free on all the loopback addresses")


def test_each_folder_is_checked_for_use_again_right_before_it_goes(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39: the pass listed who uses each candidate once, before every agent's removals. Two
    servers, each with its own claim and agent, both holding the old folders OLD and OLDER: right
    after the first folder goes (OLD from x-0's claim), resource ml/y switches back to OLD and a pod
    starts on OLDER. Both then stay wherever they still are: OLDER on x-0's claim (later in the same
    agent's pass) and both on x-1's (a later agent's pass). On the previous main all four went."""
    now = time.time()
    roots = [tmp_path / "l2-x-0", tmp_path / "l2-x-1"]
    for root in roots:
        for nsid in (SERVED, OLD, OLDER):
            _chunks(root, nsid, 2, now - 60 * DAY_S)
    in_use: dict[str, str] = {}
    real_remove = agent_module.remove_namespace

    def remove_then_switch(root: Path, nsid: str) -> Any:  # the world moves while the first folder goes
        held = real_remove(root, nsid)
        in_use.update({OLD: "the namespace id of ml/y (its pin changed back)", OLDER: "pod ml/y-lmcache-0 serves it"})
        return held

    monkeypatch.setattr(agent_module, "remove_namespace", remove_then_switch)
    listed: list[str] = []
    monkeypatch.setattr(inuse, "in_use_now", lambda nsid, _cur: listed.append(nsid) or in_use.get(nsid))
    events: list[str] = []
    monkeypatch.setattr(kube, "post_event", lambda _body, _type, reason, message: events.append(message))
    with ExitStack() as stack:
        ips, port = _agents_on_one_port(roots, stack)
        manifest = sample("nvme-minimal")
        manifest["spec"]["l2"]["orphanRetention"] = {"maxAgeDays": 30}
        manifest["spec"].setdefault("lmcacheServer", {})["agentPort"] = port
        target = Target("z", "ml", KVCacheNamespace.model_validate(manifest).spec, SERVED)
        pods = [f"z-lmcache-{i}" for i in range(len(roots))]
        scans = [fetch_inventory(ip, port, token=TOKEN) for ip in ips]
        volumes = [(f"pvc/l2-{pod}", pod, inv) for pod, inv in zip(pods, scans, strict=True) if inv is not None]
        assert [{n.namespace_id for n in inv.namespaces} for _loc, _pod, inv in volumes] == [{SERVED, OLD, OLDER}] * 2
        second_before = files_state(roots[1])
        removed = retention.expire_orphans({"metadata": {"name": "z", "namespace": "ml"}}, target, volumes,
                                           list(zip(pods, ips, strict=True)), TOKEN, Seen())
    assert [r["namespaceId"] for r in removed] == [OLD] and not (roots[0] / OLD).exists()
    assert (roots[0] / OLDER).exists() and files_state(roots[1]) == second_before
    assert listed == [OLD, OLDER, OLD]  # before each request; OLDER on x-1 was known in use by then
    assert len(events) == 1 and OLD in events[0] and pods[0] in events[0]
