"""Inventory from the data itself: grouping by namespace folder, orphans, ranking, the agent's
refusals, and the admin report built from status."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest

from kvpersist.admin import format_report, report_rows, users_of
from kvpersist.inventory.agent import Agent, make_server
from kvpersist.inventory.agentclient import fetch_inventory, request_gc
from kvpersist.inventory.cleanup import parse_request, refusal
from kvpersist.inventory.volume import group, remove_namespace, scan_volume, served_of, status_summary
from tests.fsstate import files_state

A, B, C = "kvp-" + "a" * 32, "kvp-" + "b" * 32, "kvp-" + "c" * 32
TOKEN = "t0ken" * 12  # the resource's agent token


def _write(root: Path, nsid: str, n: int, size: int, mtime: float) -> None:
    (root / nsid).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        f = root / nsid / f"m_0_0_{i:064x}.bin"
        f.write_bytes(os.urandom(size))
        os.utime(f, (mtime, mtime))


def _du_sb(path: Path) -> int:
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def test_group_by_namespace_folder() -> None:
    inv = group([(f"{A}/x.bin", 10, 5.0), (f"{A}/y.bin", 20, 7.0), (f"{B}/z.bin", 1, 1.0), ("README", 3, 1.0),
                 ("kvp-short/x.bin", 4, 1.0), (A, 9, 1.0)], "loc")
    assert [(n.namespace_id, n.bytes, n.objects, n.last_write) for n in inv.namespaces] == [(A, 30, 2, 7.0), (B, 1, 1, 1.0)]
    assert inv.other_bytes == 3 + 4 + 9  # not namespace folders: never counted, never deleted


def test_scan_volume_matches_du(tmp_path: Path) -> None:
    _write(tmp_path, A, 3, 4096 + 7, 1000.0)
    _write(tmp_path, B, 2, 100, 2000.0)
    (tmp_path / C).mkdir()  # a server started, nothing stored yet
    inv = scan_volume(tmp_path)
    by = {n.namespace_id: n for n in inv.namespaces}
    assert by[A].bytes == _du_sb(tmp_path / A) - _du_sb(tmp_path / C)  # du counts the folder itself too
    assert (by[A].objects, by[B].objects, by[C].objects) == (3, 2, 0) and by[B].last_write == 2000.0


def test_orphans_rank_biggest_then_oldest_first() -> None:
    inv = group([(f"{A}/1", 100, 50.0), (f"{B}/1", 500, 10.0), (f"{C}/1", 500, 5.0)], "v")
    summary = status_summary([("pvc/l2-x", "x-0", inv)], A, {A})
    assert (summary["orphanedNamespaces"], summary["orphanedBytes"]) == (2, 1000) and "currentBytes" not in summary
    assert served_of(summary, A) == (100, summary["volumes"][0]["namespaces"][-1]["objects"])
    assert [n["namespaceId"] for n in summary["volumes"][0]["namespaces"]] == [C, B, A]


def test_remove_namespace_touches_nothing_else(tmp_path: Path) -> None:
    _write(tmp_path, A, 2, 50, 1.0)
    _write(tmp_path, B, 2, 70, 1.0)
    before = files_state(tmp_path / A)
    held = remove_namespace(tmp_path, B)
    assert (held.bytes, held.objects) == (140, 2) and not (tmp_path / B).exists()
    assert files_state(tmp_path / A) == before
    with pytest.raises(ValueError):
        remove_namespace(tmp_path, "..")


def test_agent_over_http_refuses_its_own_namespace_and_deletes_an_orphan(tmp_path: Path) -> None:
    _write(tmp_path, A, 2, 1000, 1.0)
    _write(tmp_path, B, 3, 10, 1.0)
    server = make_server(Agent(tmp_path, serving=A, token=TOKEN), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        inv = fetch_inventory("127.0.0.1", port, token=TOKEN)
        assert inv is not None and {n.namespace_id: n.bytes for n in inv.namespaces} == {A: 2000, B: 30}
        # Without the resource's token, or with another, nothing is listed or deleted.
        assert fetch_inventory("127.0.0.1", port) is None and fetch_inventory("127.0.0.1", port, token="x" * 64) is None
        assert request_gc("127.0.0.1", port, B, dry_run=False)[0] == 401 and (tmp_path / B).exists()
        assert request_gc("127.0.0.1", port, B, dry_run=False, token=TOKEN[:-1])[0] == 401 and (tmp_path / B).exists()
        assert request_gc("127.0.0.1", port, A, dry_run=False, token=TOKEN)[0] == 409 and (tmp_path / A).exists()
        assert request_gc("127.0.0.1", port, "../etc", dry_run=False, token=TOKEN)[0] == 400
        assert request_gc("127.0.0.1", port, C, dry_run=False, token=TOKEN)[0] == 404
        code, body = request_gc("127.0.0.1", port, B, dry_run=True, token=TOKEN)
        assert code == 200 and body["bytes"] == 30 and not body["deleted"] and (tmp_path / B).exists()
        code, body = request_gc("127.0.0.1", port, B, dry_run=False, token=TOKEN)
        assert code == 200 and body["deleted"] and (body["bytes"], body["objects"]) == (30, 3) and not (tmp_path / B).exists()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/inventory", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert [n["namespaceId"] for n in json.loads(resp.read())["namespaces"]] == [A]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert fetch_inventory("127.0.0.1", port, timeout=1) is None


def test_gc_refusals() -> None:
    assert refusal(A, A, frozenset()) and "serves" in refusal(A, A, frozenset())
    assert refusal(B, A, frozenset({B})) and refusal("kvp-x", A, frozenset()) and refusal(C + "\n", A, frozenset())
    assert refusal(C, A, frozenset({A, B})) is None
    assert parse_request({"kvpersist.dev/gc-request": json.dumps({"requestId": "r1", "namespaceId": C})}) == {
        "requestId": "r1", "namespaceId": C}
    assert "error" in parse_request({"kvpersist.dev/gc-request": "delete everything"})
    assert parse_request({}) is None


def _resource(name: str, current: str, volumes: list[dict], budget: int | None = None) -> dict:
    status = {"namespaceId": current, "inventory": {"volumes": volumes}}
    if budget:
        status["budget"] = {"bytes": budget}
    return {"metadata": {"namespace": "ml", "name": name}, "spec": {}, "status": status}


def test_report_rows_rejudge_orphans_and_rank() -> None:
    vol = {"location": "pvc/l2-a-lmcache-0", "namespaces": [
        {"namespaceId": A, "bytes": 10, "objects": 1, "lastWrite": "2026-11-30T00:00:00Z"},
        {"namespaceId": B, "bytes": 900, "objects": 9, "lastWrite": "2026-11-29T00:00:00Z", "orphan": True},
        {"namespaceId": C, "bytes": 900, "objects": 9, "lastWrite": "2026-11-28T00:00:00Z", "orphan": True}]}
    rows = report_rows([_resource("a", A, [vol], budget=50)], frozenset({A, B}))  # B became live again
    assert [(r.namespace_id, r.orphan, r.current) for r in rows] == [(C, True, False), (B, False, False), (A, False, True)]
    assert rows[-1].budget_bytes == 50
    text = format_report(rows, now=1796083200.0)
    assert text.splitlines()[1].split()[1] == C and "orphan" in text.splitlines()[1]


def test_report_rows_oldest_first_among_equal_sizes() -> None:
    vol = {"location": "v", "namespaces": [{"namespaceId": B, "bytes": 5, "objects": 1, "lastWrite": "2026-11-29T00:00:00Z"},
                                           {"namespaceId": C, "bytes": 5, "objects": 1, "lastWrite": "2026-01-01T00:00:00Z"},
                                           {"namespaceId": A, "bytes": 99, "objects": 1}]}
    assert [r.namespace_id for r in report_rows([_resource("r", A, [vol])], frozenset({A}))] == [C, B, A]


def test_users_of_names_resources_and_pods() -> None:
    res = [{"metadata": {"namespace": "ml", "name": "a"}, "spec": {}, "status": {"namespaceId": A}}]
    pods = [{"metadata": {"namespace": "ml", "name": "a-lmcache-0", "labels": {"kvpersist.dev/namespace-id": A}}}]
    assert users_of(A, res, pods) == ["KVCacheNamespace ml/a", "pod ml/a-lmcache-0"]
    assert users_of(B, res, pods) == []


def test_an_earlier_namespace_sealed_with_a_lost_key_is_in_use_while_the_key_is_awaited() -> None:
    """After a pin change the generated key was deleted: IdentityResolved L2KeyLost. The earlier
    namespace sealed with that key (status.sealedNamespaces) is what a restored key would make
    readable again, so gc and the age limit must not take it; another key's namespace is an orphan."""
    fp, other = "a" * 16, "b" * 16
    status = {"namespaceId": None, "l2Key": {"secret": "a-l2-key", "generated": True, "fingerprint": fp, "namespaceId": B},
              "conditions": [{"type": "IdentityResolved", "status": "False", "reason": "L2KeyLost"}],
              "sealedNamespaces": [{"namespaceId": A, "fingerprint": fp, "secret": "a-l2-key"},
                                   {"namespaceId": C, "fingerprint": other, "secret": "mine"},
                                   {"namespaceId": B, "fingerprint": fp, "secret": "a-l2-key"}]}
    res = [{"metadata": {"namespace": "ml", "name": "a"}, "spec": {}, "status": status}]
    waiting = ["KVCacheNamespace ml/a (waiting for the L2 key its data needs)"]
    assert users_of(A, res, []) == waiting and users_of(B, res, []) == waiting
    assert users_of(C, res, []) == []
    status["conditions"] = [{"type": "IdentityResolved", "status": "True", "reason": "PinsComplete"}]  # key back
    assert users_of(A, res, []) == []


def test_gc_bucket_outcomes() -> None:
    from kvpersist.inventory.cleanup import gc_bucket
    from kvpersist.inventory.volume import NamespaceUsage

    req = {"requestId": "r", "namespaceId": C}
    assert gc_bucket(req, lambda n: NamespaceUsage(n, 10, 2), "hf://buckets/a/b")["outcome"] == "Deleted"
    assert gc_bucket(req, lambda n: NamespaceUsage(n), "hf://buckets/a/b")["outcome"] == "NotFound"

    def boom(_: str) -> NamespaceUsage:
        raise RuntimeError("Hub said no")
    out = gc_bucket(req, boom, "hf://buckets/a/b")
    assert out["outcome"] == "Failed" and "Hub said no" in out["message"]


def test_gc_volumes_through_real_agents(tmp_path: Path) -> None:
    from kvpersist.inventory.cleanup import gc_volumes

    servers, threads = [], []
    for i in range(2):
        root = tmp_path / f"v{i}"
        _write(root, A, 1, 10, 1.0)
        if i == 0:
            _write(root, B, 2, 100, 1.0)
        server = make_server(Agent(root, serving=A, token=TOKEN), "127.0.0.1", 0)
        threads.append(threading.Thread(target=server.serve_forever, daemon=True))
        threads[-1].start()
        servers.append(server)
    try:
        pods = [(f"p-{i}", "127.0.0.1") for i in range(2)]
        # one agent per port: call each separately, as the operator calls each pod's agent
        out = [gc_volumes({"requestId": "r", "namespaceId": B}, [pods[i]], s.server_address[1], TOKEN)
               for i, s in enumerate(servers)]
        assert out[0]["outcome"] == "Deleted" and (out[0]["bytes"], out[0]["objects"]) == (200, 2)
        assert out[1]["outcome"] == "NotFound"
        refused = gc_volumes({"requestId": "r", "namespaceId": A}, [pods[0]], servers[0].server_address[1], TOKEN)
        assert refused["outcome"] == "Failed" and "serves" in refused["message"] and (tmp_path / "v0" / A).exists()
        assert gc_volumes({"requestId": "r", "namespaceId": B}, [], 1)["outcome"] == "NotFound"
    finally:
        for s, t in zip(servers, threads, strict=True):
            s.shutdown()
            s.server_close()
            t.join(timeout=5)
