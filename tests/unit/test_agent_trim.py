"""The agent's capacity trim: which files it picks (oldest first, just enough), what it never
touches (temp files, links, other namespaces, anything outside the served folder), its thread and
report, its flags, and the builder rendering them."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvpersist.api.spec import GIB
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.lmcache import agent_container
from kvpersist.builders.target import Target
from kvpersist.identity import key_fingerprint, resolve
from kvpersist.inventory.agent import Agent, _period, _positive_int, make_server
from kvpersist.inventory.volume import ChunkFile, _unlink_unchanged, choose_oldest, is_chunk_name, trim_namespace
from tests.cases.invalid_manifests import sample

A, B = "kvp-" + "a" * 32, "kvp-" + "b" * 32
KIB = 1024


def _f(name: str, size: int, mtime: float) -> ChunkFile:
    return ChunkFile(name, size, mtime, 0)


def _chunk(folder: Path, i: int, size: int, mtime: float, suffix: str = "", stage: Path | None = None) -> Path:
    """A chunk file of that size and time. stage: a folder on the same filesystem outside the
    agent's root, where it is written and given its time before it is moved in whole, so that a
    trimming thread never sees it with the time of its writing (the oldest file there, and so the
    first deleted: a CI flake)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"m_00000000_0_{i:064x}.bin{suffix}"
    staged = path if stage is None else stage / path.name
    staged.write_bytes(b"\0" * size)
    os.utime(staged, (mtime, mtime))
    if stage is not None:
        os.replace(staged, path)
    return path


def _sizes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


# ---- the pure choice

def test_choose_oldest_takes_just_enough_oldest_first() -> None:
    files = [_f("c", 10, 3.0), _f("a", 10, 1.0), _f("b", 10, 2.0), _f("d", 10, 4.0)]
    assert [f.path for f in choose_oldest(files, 40, 25)] == ["a", "b"]  # 40 -> 20
    assert [f.path for f in choose_oldest(files, 40, 30)] == ["a"]  # exactly at the target is enough
    assert choose_oldest(files, 40, 40) == [] and choose_oldest(files, 40, 1000) == []


def test_choose_oldest_breaks_mtime_ties_by_path_and_may_take_everything() -> None:
    files = [_f("y", 5, 1.0), _f("x", 5, 1.0), _f("z", 5, 0.5)]
    assert [f.path for f in choose_oldest(files, 15, 6)] == ["z", "x"]
    # More bytes than the files hold: everything given goes, no more.
    assert [f.path for f in choose_oldest(files, 100, 0)] == ["z", "x", "y"]


def test_chunk_names_exclude_lmcache_temp_files() -> None:
    assert is_chunk_name("test-model_01000100_0_" + "ab" * 32 + ".bin")
    assert is_chunk_name("m_00000000_0_" + "ab" * 32 + "@salt.bin")
    assert not is_chunk_name("m_00000000_0_" + "ab" * 32 + ".bin.tmp.0ab817bf43904236acf250ca11e1a499")
    assert not is_chunk_name("README") and not is_chunk_name("x.bin.partial")


# ---- the trim on a folder

def test_trim_deletes_the_oldest_chunks_of_the_served_folder_only(tmp_path: Path) -> None:
    served, other = tmp_path / A, tmp_path / B
    for i in range(10):
        _chunk(served, i, 100 * KIB, 1000.0 + i)
        _chunk(other, i, 100 * KIB, 1.0 + i)  # older than everything served: must stay anyway
    other_before = sorted(p.name for p in other.iterdir())
    trimmed = trim_namespace(tmp_path, A, 650 * KIB)[1]
    assert (trimmed.objects, trimmed.bytes, trimmed.last_write) == (4, 400 * KIB, 1003.0)
    assert sorted(p.name for p in served.iterdir()) == [f"m_00000000_0_{i:064x}.bin" for i in range(4, 10)]
    assert sorted(p.name for p in other.iterdir()) == other_before
    assert trim_namespace(tmp_path, A, 650 * KIB)[1].objects == 0  # under capacity: nothing more


def test_trim_neither_counts_nor_deletes_temp_and_foreign_files(tmp_path: Path) -> None:
    """Bytes the trim may not delete are not counted either: counted, they made it delete live
    chunks in their place (800 KiB held, 400 of them not chunk files: 3 of 4 chunks went)."""
    served = tmp_path / A
    tmp_file = _chunk(served, 99, 300 * KIB, time.time(), suffix=".tmp.0ab817bf43904236acf250ca11e1a499")  # in flight
    foreign = served / "notes.txt"
    foreign.write_bytes(b"x" * 100 * KIB)
    os.utime(foreign, (1.0, 1.0))
    for i in range(4):
        _chunk(served, i, 100 * KIB, 100.0 + i)
    assert trim_namespace(tmp_path, A, 500 * KIB)[1].objects == 0  # 400 KiB of chunks: within capacity
    assert tmp_file.exists() and foreign.exists() and len(list(served.glob("*.bin"))) == 4
    trimmed = trim_namespace(tmp_path, A, 250 * KIB)[1]  # over it: the chunks alone come down to it
    assert (trimmed.objects, trimmed.bytes) == (2, 200 * KIB) and tmp_file.exists() and foreign.exists()


def _fs_file(folder: Path, i: int, size: int, mtime: float, suffix: str = ".data") -> Path:
    """A file as lmcache 0.5.6's fs adapter names it (fs_l2_adapter._object_key_to_filename)."""
    path = folder / f"m@0x00000000@0@{i:064x}{suffix}"
    path.write_bytes(b"\0" * size)
    os.utime(path, (mtime, mtime))
    return path


def test_another_adapters_files_never_make_the_trim_delete_every_chunk(tmp_path: Path) -> None:
    """A folder the fs adapter filled (*.data) and nixl_store_dynamic then wrote to (*.bin): the
    agent trims for nixl and may delete only *.bin. Counting the fs files (2 MiB against a 1 MiB
    capacity) made it delete every nixl chunk, the newest KV included, and still be over."""
    served = tmp_path / A
    served.mkdir()
    fs_files = [_fs_file(served, i, 256 * KIB, 10.0 + i) for i in range(8)]
    chunks = [_chunk(served, i, 100 * KIB, 1000.0 + i) for i in range(4)]
    assert trim_namespace(tmp_path, A, 1024 * KIB)[1].objects == 0
    assert all(p.exists() for p in fs_files + chunks)


def test_the_fs_native_trim_counts_only_its_own_files(tmp_path: Path) -> None:
    """The same for an agent trimming fs_native's folder (*.data): nixl's *.bin neither count nor go,
    fs_native's own oldest chunks go first until the folder is within the capacity."""
    served = tmp_path / A
    served.mkdir()
    nixl = [_chunk(served, i, 256 * KIB, 10.0 + i) for i in range(8)]
    own = [_fs_file(served, i, 100 * KIB, 1000.0 + i) for i in range(4)]
    assert trim_namespace(tmp_path, A, 1024 * KIB, adapter="fs_native")[1].objects == 0
    assert trim_namespace(tmp_path, A, 250 * KIB, adapter="fs_native")[1].objects == 2
    assert all(p.exists() for p in nixl) and [p.exists() for p in own] == [False, False, True, True]


def test_abandoned_fs_native_temp_files_are_swept(tmp_path: Path) -> None:
    """fs_native writes `<stem>.tmp` and renames it to `<stem>.data`; one untouched for an hour
    is a write that died with its server."""
    from kvpersist.inventory.volume import ABANDONED_TEMP_S

    served = tmp_path / A
    served.mkdir()
    now = time.time()
    dead = _fs_file(served, 1, 300 * KIB, now - ABANDONED_TEMP_S - 60, suffix=".tmp")
    live = _fs_file(served, 2, 300 * KIB, now - 5, suffix=".tmp")
    chunk = _fs_file(served, 3, 10, now - ABANDONED_TEMP_S - 60)
    assert trim_namespace(tmp_path, A, 2**30, adapter="fs_native", now=now)[0].objects == 1
    assert not dead.exists() and live.exists() and chunk.exists()


def test_an_excess_is_trimmed_only_once_it_has_lasted(tmp_path: Path) -> None:
    """A burst of writes overshoots the capacity until lmcache's own eviction catches up (fs_native
    evicts after writing, a few rounds a second apart): the agent trims only an excess that has
    lasted settle_s, so the two never delete twice what must go; one that lasts (lmcache counting
    from zero after a restart) is trimmed."""
    (tmp_path / A).mkdir()
    chunks = [_fs_file(tmp_path / A, i, 100 * KIB, 100.0 + i) for i in range(4)]
    agent = Agent(tmp_path, A, capacity_bytes=250 * KIB, adapter="fs_native", settle_s=0.3)
    assert agent.trim_once().objects == 0 and all(p.exists() for p in chunks)  # seen over: the clock starts
    chunks[0].unlink()
    chunks[1].unlink()  # lmcache evicted meanwhile: under again, the clock stops
    assert agent.trim_once().objects == 0
    more = [_fs_file(tmp_path / A, i, 100 * KIB, 200.0 + i) for i in range(4, 6)]
    assert agent.trim_once().objects == 0  # over again: a new excess, not yet lasted
    time.sleep(0.35)
    assert agent.trim_once().objects == 2  # it lasted: the oldest two go
    assert [p.exists() for p in chunks[2:] + more] == [False, False, True, True]


def test_abandoned_nixl_temp_files_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    from kvpersist.inventory.volume import ABANDONED_TEMP_S

    served = tmp_path / A
    now = time.time()
    old = now - ABANDONED_TEMP_S - 60
    hexid = "0ab817bf43904236acf250ca11e1a499"
    abandoned = _chunk(served, 1, 300 * KIB, old, suffix=f".tmp.{hexid}")
    sharded = _chunk(served / "ab" / "cd", 2, 10 * KIB, old, suffix=f".tmp.{hexid}")
    live = _chunk(served, 3, 300 * KIB, now - 5, suffix=f".tmp.{hexid}")  # being written
    unknown = _chunk(served, 4, 10, old, suffix=".tmp.not-a-uuid")  # not lmcache's name: not ours
    fs_tmp = _fs_file(served, 5, 10, old, suffix=".tmp")  # the fs adapter's, reused by its next store
    chunk = _chunk(served, 6, 10, old)
    swept = trim_namespace(tmp_path, A, 2**30, now=now)[0]
    assert (swept.objects, swept.bytes) == (2, 310 * KIB)
    assert not abandoned.exists() and not sharded.exists()
    assert live.exists() and unknown.exists() and fs_tmp.exists() and chunk.exists()
    assert trim_namespace(tmp_path, B, 2**30)[0].objects == 0  # no such folder
    with pytest.raises(ValueError):
        trim_namespace(tmp_path, "..", 2**30)


def test_the_agents_trim_pass_sweeps_abandoned_temp_files_first(tmp_path: Path) -> None:
    from kvpersist.inventory.volume import ABANDONED_TEMP_S

    old = time.time() - ABANDONED_TEMP_S - 60
    crashed = _chunk(tmp_path / A, 9, 500 * KIB, old, suffix=".tmp.0ab817bf43904236acf250ca11e1a499")
    kept = [_chunk(tmp_path / A, i, 100 * KIB, 100.0 + i) for i in range(3)]
    agent = Agent(tmp_path, A, capacity_bytes=300 * KIB)
    assert agent.trim_once().objects == 0  # the chunks fit; the dead write's file is gone
    assert not crashed.exists() and all(p.exists() for p in kept)


def test_trim_reaches_sharded_subfolders(tmp_path: Path) -> None:
    for i in range(4):
        _chunk(tmp_path / A / "ab" / f"{i:02x}", i, 100 * KIB, 10.0 + i)
    assert trim_namespace(tmp_path, A, 200 * KIB)[1].objects == 2
    assert _sizes(tmp_path / A) == 200 * KIB


def test_trim_never_follows_links(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    victim = _chunk(outside, 1, 500 * KIB, 1.0)
    _chunk(tmp_path / B, 2, 500 * KIB, 1.0)
    served = tmp_path / "vol" / A
    for i in range(3):
        _chunk(served, 10 + i, 100 * KIB, 50.0 + i)
    (served / victim.name).symlink_to(victim)  # an old-looking chunk name, pointing outside
    (served / "linked-dir").symlink_to(tmp_path / B, target_is_directory=True)
    trimmed = trim_namespace(tmp_path / "vol", A, 200 * KIB)[1]
    assert trimmed.objects == 1  # links neither counted nor deleted: 300 KiB of real files -> 200
    assert victim.exists() and len(list((tmp_path / B).iterdir())) == 1
    assert (served / victim.name).is_symlink()


def test_a_linked_namespace_folder_is_not_trimmed(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    for i in range(3):
        _chunk(real, i, 100 * KIB, 1.0 + i)
    (tmp_path / "vol").mkdir()
    (tmp_path / "vol" / A).symlink_to(real, target_is_directory=True)
    assert trim_namespace(tmp_path / "vol", A, 0)[1].objects == 0
    assert len(list(real.iterdir())) == 3
    assert trim_namespace(tmp_path / "vol", B, 0)[1].objects == 0  # no folder at all


def test_trim_refuses_what_is_not_a_namespace_id(tmp_path: Path) -> None:
    for bad in ("..", "", "kvp-short", A + "/..", A + "\n"):
        with pytest.raises(ValueError):
            trim_namespace(tmp_path, bad, 0)


def test_a_file_rewritten_since_the_scan_is_not_deleted(tmp_path: Path) -> None:
    """lmcache renames a fresh write onto the same name: the chosen (old) file is gone, the new one stays."""
    path = _chunk(tmp_path, 1, 10, 1.0)
    st = path.stat()
    stale = ChunkFile(str(path), st.st_size, st.st_mtime, st.st_ino)
    fresh = _chunk(tmp_path / "new", 1, 10, 2.0)
    os.rename(fresh, path)
    assert _unlink_unchanged(A, [stale]).objects == 0 and path.exists()
    st = path.stat()
    assert _unlink_unchanged(A, [ChunkFile(str(path), st.st_size, st.st_mtime, st.st_ino)]).objects == 1 and not path.exists()
    assert _unlink_unchanged(A, [ChunkFile(str(path), 10, 2.0, st.st_ino)]).objects == 0  # already gone: not counted


# ---- the agent

def test_no_capacity_no_trim(tmp_path: Path) -> None:
    for i in range(3):
        _chunk(tmp_path / A, i, 100 * KIB, 1.0 + i)
    for agent in (Agent(tmp_path, A), Agent(tmp_path, None, capacity_bytes=1)):
        assert agent.trim_once() is None
        agent.start_trimming()
        assert agent._thread is None
    assert len(list((tmp_path / A).iterdir())) == 3


def test_agent_thread_keeps_the_folder_within_capacity_and_reports_the_last_trim(tmp_path: Path) -> None:
    agent = Agent(tmp_path, A, capacity_bytes=300 * KIB, trim_period_s=0.05)
    server = make_server(agent, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/inventory?fresh=1"
    try:
        agent.start_trimming()
        with urllib.request.urlopen(url, timeout=5) as r:
            assert json.loads(r.read())["trimmed"] is None  # nothing trimmed yet
        stage = tmp_path.parent / f"{tmp_path.name}-stage"
        stage.mkdir(exist_ok=True)
        for i in range(8):  # a writer, newer files each time
            _chunk(tmp_path / A, i, 100 * KIB, time.time() + i, stage=stage)
        passes = agent.trim_passes
        deadline = time.monotonic() + 10
        while (agent.trim_passes < passes + 2 or _sizes(tmp_path / A) > 300 * KIB) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _sizes(tmp_path / A) == 300 * KIB
        assert sorted(p.name for p in (tmp_path / A).iterdir()) == [f"m_00000000_0_{i:064x}.bin" for i in range(5, 8)]
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
        assert body["trimmed"]["capacityBytes"] == 300 * KIB and body["trimmed"]["at"].endswith("Z")
        assert body["trimmed"]["objects"] >= 1 and body["namespaces"][0]["bytes"] == 300 * KIB
    finally:
        agent.stop()
        server.shutdown()
        server.server_close()
    assert agent._thread is not None and not agent._thread.is_alive()


def test_flags_are_bounded() -> None:
    assert _positive_int("1048576") == 1048576 and _period("0.5") == 0.5 and _period("3600") == 3600
    for bad in ("0", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _positive_int(bad)
    for bad in ("0", "-1", "3601", "inf", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            _period(bad)


# ---- the builder

def _target(mutate=None, enabled: bool = True) -> Target:
    obj = sample("nvme-minimal")
    if mutate:
        mutate(obj)
    spec = KVCacheNamespace.model_validate(obj).spec
    nsid = resolve(spec.pins(key_fingerprint(b"k" * 32))).namespace_id if enabled else None  # the L2 key's pin too
    return Target(obj["metadata"]["name"], "ml", spec, nsid)


def _capacity_arg(t: Target) -> str | None:
    args = agent_container(t, "img:1")["args"]
    return args[args.index("--capacity-bytes") + 1] if "--capacity-bytes" in args else None


def test_builder_renders_the_adapter_capacity_for_fs_native_and_nixl() -> None:
    assert _capacity_arg(_target()) == str(450 * GIB)  # 90% of the 500Gi claim
    args = agent_container(_target(), "img:1")["args"]
    assert args[args.index("--adapter") + 1] == "fs_native"  # its *.data files are what the trim counts
    assert _capacity_arg(_target(lambda o: o["spec"]["l2"]["nvme"].update(maxCapacity="512Mi"))) == str(GIB // 2)
    budget = _target(lambda o: o["spec"]["l2"]["nvme"].update(budget="200Gi", adapter="nixl_store_dynamic"))
    assert _capacity_arg(budget) == str(200 * GIB)
    args = agent_container(budget, "img:1")["args"]
    assert args[args.index("--adapter") + 1] == "nixl_store_dynamic"
    assert _capacity_arg(_target(lambda o: o["spec"]["l2"]["nvme"].update(adapter="fs"))) is None
    assert _capacity_arg(_target(enabled=False)) is None  # no namespace served, nothing to hold to a capacity


def test_agent_without_a_token_file_refuses_gc_and_rereads_a_changed_token(tmp_path: Path) -> None:
    """No token configured: /gc is off (403), whoever asks. A token file changed in place (the
    kubelet updates a Secret volume) is read again, so a re-created Secret does not lock out."""
    from kvpersist.inventory.agent import TokenFile
    from kvpersist.inventory.agentclient import request_gc

    (tmp_path / B).mkdir()
    (tmp_path / B / "x.bin").write_bytes(b"x")
    server = make_server(Agent(tmp_path, A), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert request_gc("127.0.0.1", server.server_address[1], B, dry_run=False, token="anything")[0] == 403
        assert (tmp_path / B / "x.bin").exists()
    finally:
        server.shutdown()
        server.server_close()
    token = tmp_path / "token"
    token.write_text("first\n")
    tf = TokenFile(token)
    assert tf.value == "first"
    time.sleep(0.01)
    token.write_text("second")
    os.utime(token, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert tf.value == "second"
    token.unlink()
    assert tf.value == "second"  # a file gone for a moment keeps the last token
