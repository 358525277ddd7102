"""Several lmcache servers on one namespace folder (spec.l2.nvme.shared): what docs/design.md's
"Several writers on one folder" says, measured with real `lmcache server` processes (0.5.6, CPU)
run with the args the operator renders, the same namespace id, key and folder for both, as the
servers of one resource on two nodes over one ReadWriteMany claim.

What lmcache does that this rests on (nixl_store_dynamic): a store writes `<name>.tmp.<hex>` and
renames it (readers see a whole file or none); a lookup that misses the server's index stats the
file and indexes it (so a server finds what another wrote after it started); a key already indexed
is never stored again.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpersist.api.spec import GIB
from tests.fsstate import files_state
from tests.integration.conftest import LocalServer, drive, make_target
from tests.integration.test_capacity import CAPACITY, folder_bytes, settle

pytestmark = pytest.mark.datapath

Servers = Callable[..., LocalServer]
GRACE_S = 15.0  # the trimmer's grace, shorter than the rendered one (l2backends.nvme.SHARED_TRIM_GRACE_S)


def shared_target(**kw: Any) -> Any:
    """A resource's target with spec.l2.nvme.shared: every server renders the same args."""
    return make_target(nvme={"shared": True, "adapter": "nixl_store_dynamic"}, **kw)


def test_a_server_reads_what_another_wrote_after_it_started(servers: Servers) -> None:
    b = servers(shared_target())
    a = servers(shared_target())
    assert a.target.namespace_id == b.target.namespace_id and a.l2_dir == b.l2_dir
    b.start()  # B is up before A has written anything
    a.start()
    assert drive(a, "store", "0:4")["summary"]["stored_chunks"] == 8
    written = files_state(a.l2_dir)
    assert len(written) == 8 and not any(".tmp." in n for n in written)

    # B never saw these keys: its lookups miss its index, stat the files, and serve them from L2.
    on_b = drive(b, "store", "0:4")["summary"]
    assert on_b["hit_chunks"] == 8 and on_b["stored_chunks"] == 0, on_b
    assert on_b["wrong_bytes"] == 0 and on_b["verified_chunks"] == 8
    assert files_state(b.l2_dir) == written  # B wrote nothing over A's files

    # B's stores land where A finds them just the same.
    assert drive(b, "store", "4:6")["summary"]["stored_chunks"] == 4
    on_a = drive(a, "verify", "4:6")["summary"]
    assert on_a["hit_chunks"] == 4 and on_a["wrong_bytes"] == 0 and on_a["verified_chunks"] == 4


def test_two_writers_of_one_key_leave_one_whole_file_either_reads(servers: Servers, tmp_path: Path) -> None:
    """The same KV under the same key, sealed by two servers: the file names are the same, the
    bytes differ (a random IV per object), and either file opens right under the one key. So the
    second rename over the first (what two servers storing one prefix at once do) is harmless."""
    a = servers(shared_target())
    other = servers(shared_target(), volume=tmp_path / "other-volume")  # same key (the fixture's), its own folder
    a.start()
    other.start()
    assert drive(a, "store", "0:2")["summary"]["stored_chunks"] == 4
    assert drive(other, "store", "0:2")["summary"]["stored_chunks"] == 4
    mine, theirs = files_state(a.l2_dir), files_state(other.l2_dir)
    assert sorted(mine) == sorted(theirs)
    assert all(mine[n][0] == theirs[n][0] and mine[n][2] != theirs[n][2] for n in mine)  # same size, other bytes
    a.stop()
    for name in mine:  # the other writer's rename, as lmcache's os.rename does it
        os.replace(other.l2_dir / name, a.l2_dir / name)
    a.start()
    s = drive(a, "verify", "0:2")["summary"]
    assert s["hit_chunks"] == 4 and s["wrong_bytes"] == 0 and s["verified_chunks"] == 4


def test_two_servers_storing_one_prefix_at_once(servers: Servers) -> None:
    a, b = servers(shared_target()), servers(shared_target())
    a.start()
    b.start()
    results: dict[str, Any] = {}

    def store(name: str, srv: LocalServer) -> None:
        results[name] = drive(srv, "store", "0:6")["summary"]

    threads = [threading.Thread(target=store, args=(n, s)) for n, s in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert set(results) == {"a", "b"}
    names = sorted(p.name for p in a.l2_dir.iterdir())
    assert len(names) == 12 and not any(".tmp." in n for n in names), names  # one file per key, no temp left
    for srv in (a, b):
        s = drive(srv, "verify", "0:6")["summary"]
        assert s["hit_chunks"] == 12 and s["wrong_bytes"] == 0 and s["verified_chunks"] == 12
    print(f"\n[shared] stored at once: a {results['a']['stored_chunks']}, b {results['b']['stored_chunks']} chunks "
          f"(12 keys; a key found on disk first is not stored again)")


def test_a_file_deleted_under_another_servers_index_is_a_miss_never_wrong_bytes(servers: Servers) -> None:
    """One server's eviction (or the folder's trimmer) deletes a file another server has indexed:
    that server's load fails and the chunk is a miss, recomputed; never wrong bytes."""
    a, b = servers(shared_target()), servers(shared_target())
    a.start()
    b.start()
    assert drive(a, "store", "0:4")["summary"]["stored_chunks"] == 8
    assert drive(b, "verify", "0:4")["summary"]["verified_chunks"] == 8  # B has indexed all 8
    # B keeps what it read in L1 (--l2-prefetch-policy retain): cleared, so the next read is L2's.
    req = urllib.request.Request(b.http_url + "/cache/clear", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
    gone = sorted(a.l2_dir.glob("*.bin"))[:3]
    for p in gone:
        p.unlink()
    after = drive(b, "verify", "0:4")["summary"]
    assert after["wrong_bytes"] == 0 and after["lookup_errors"] == 0
    assert after["verified_chunks"] <= 8 - len(gone), after
    assert "Dynamic NIXL load failed" in b.log.read_text()  # still indexed by B, its file gone: a failed load
    assert b.healthy()


def test_one_agent_trims_the_shared_folder_and_spares_what_is_young(servers: Servers, agents: Callable[..., Any]) -> None:
    """Two servers each within their own capacity fill the one folder past it (each lmcache counts
    only what it indexed). Only the agent of ordinal 0 trims; the other reports the same folder;
    no file younger than the grace goes; the newest KV still reads back right."""
    t = shared_target(capacity_gb=CAPACITY / GIB)
    a, b = servers(t), servers(shared_target(capacity_gb=CAPACITY / GIB))
    a.start()
    b.start()
    grace = {"--trim-grace": str(GRACE_S)}
    reporter = agents(b, pod_name=f"{t.name}-lmcache-1", flags=grace)
    trimmer = agents(a, pod_name=f"{t.name}-lmcache-0", flags=grace)
    assert drive(a, "store", "0:6")["summary"]["stored_chunks"] == 12
    assert drive(b, "store", "6:12")["summary"]["stored_chunks"] == 12
    settle(a.l2_dir)
    before = {p.name: p.stat().st_mtime for p in a.l2_dir.glob("*.bin")}
    assert sum(p.stat().st_size for p in a.l2_dir.glob("*.bin")) > trimmer.capacity  # two writers, one folder

    trimmer.more_passes(2)
    checked = time.time()
    gone = set(before) - {p.name for p in a.l2_dir.glob("*.bin")}
    assert all(before[n] < checked - GRACE_S for n in gone), "the trimmer deleted a file younger than its grace"

    inv = trimmer.wait_within(a.l2_dir, trimmer.capacity)  # once the grace has passed
    assert inv["trims"] is True and inv["trimmed"] is not None
    report = reporter.get("/inventory?fresh=1")
    assert report is not None and report["trims"] is False and report["trimPasses"] == 0 and report["trimmed"] is None
    mine = next(n for n in report["namespaces"] if n["namespaceId"] == t.namespace_id)
    assert mine["bytes"] == folder_bytes(a.l2_dir)  # the same folder, seen from the other pod
    newest = drive(b, "verify", "10:12")["summary"]
    assert newest["hit_chunks"] == 4 and newest["wrong_bytes"] == 0 and newest["verified_chunks"] == 4
