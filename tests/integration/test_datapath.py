"""The data path with the real lmcache server (0.5.6, CPU), run with exactly the args the
operator renders: persistence across restarts, namespace isolation, corrupt files, disk full.

KV is driven by lmcache's own bench client (tests/integration/kvdriver.py), which clears the
destination before each retrieve and compares the bytes that come back with the source bytes.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpersist.status.usage import DIRECT, fetch_status
from tests.fsstate import files_state
from tests.integration.conftest import NO_SERDE, LocalServer, chunk_files, drive, expecting, make_target, other_key

pytestmark = pytest.mark.datapath

Servers = Callable[..., LocalServer]


@pytest.mark.parametrize("stop_signal", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "clean-stop"])
def test_restart_hits_everything_from_l2(servers: Servers, stop_signal: int) -> None:
    srv = servers(make_target())
    srv.start()
    stored = drive(srv, "store", "0:8")["summary"]
    assert stored["stored_chunks"] == stored["chunks"] == 16 and stored["hit_chunks"] == 0
    files_before = files_state(srv.l2_dir)
    assert len(files_before) == 16

    srv.stop(stop_signal)
    restart_s = srv.start()
    # The index starts empty: nothing is known until looked up, yet everything is on disk.
    assert srv.l2_objects() == 0
    again = drive(srv, "store", "0:8")
    summary = again["summary"]
    assert summary["hit_chunks"] == 16 and summary["stored_chunks"] == 0  # all hit, nothing stored again
    assert summary["wrong_bytes"] == 0 and summary["verified_chunks"] == 16
    assert files_state(srv.l2_dir) == files_before  # not rewritten
    first = again["sequences"][0]
    print(f"\n[datapath] restart after {signal.Signals(stop_signal).name}: healthy in {restart_s:.2f}s, "
          f"first L2 lookup {first['lookup_ms']:.1f} ms, retrieve {first['retrieve_ms']:.1f} ms, 16/16 chunks hit")


def test_two_namespaces_on_one_volume_never_share(servers: Servers) -> None:
    a = servers(make_target())
    b = servers(make_target(maxModelLen=16384))  # one pin differs
    assert a.target.namespace_id != b.target.namespace_id and a.volume == b.volume
    a.start()
    b.start()
    assert drive(a, "store", "0:4")["summary"]["stored_chunks"] == 8
    a_files = files_state(a.l2_dir)

    # Same token sequences through the other namespace: a full miss, then its own copies.
    b_first = drive(b, "store", "0:4")["summary"]
    assert b_first["hit_chunks"] == 0 and b_first["stored_chunks"] == 8
    assert files_state(a.l2_dir) == a_files  # the other namespace's files stay untouched
    assert len(files_state(b.l2_dir)) == 8

    # Each still sees all of its own data after both restart.
    a.stop(signal.SIGKILL)
    b.stop(signal.SIGKILL)
    a.start()
    b.start()
    for srv in (a, b):
        s = drive(srv, "verify", "0:4")["summary"]
        assert s["hit_chunks"] == 8 and s["wrong_bytes"] == 0 and s["verified_chunks"] == 8
    assert files_state(a.l2_dir) == a_files


def _corrupt(folder: Path, how: str, count: int) -> list[str]:
    names = [p.name for p in chunk_files(folder)][:count]
    for name in names:
        path = folder / name
        if how == "truncate":
            with path.open("r+b") as f:
                f.truncate(path.stat().st_size // 3)
        elif how == "empty":
            path.write_bytes(b"")
        elif how == "garble":
            path.write_bytes(os.urandom(path.stat().st_size))
        elif how == "flip":  # one bit, in the middle: what bit rot does
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x01
            path.write_bytes(bytes(data))
    return names


@pytest.mark.parametrize("how", ["truncate", "empty"])
def test_damaged_files_miss_and_recompute(servers: Servers, how: str) -> None:
    srv = servers(make_target())
    srv.start()
    assert drive(srv, "store", "0:6")["summary"]["stored_chunks"] == 12
    srv.stop(signal.SIGKILL)
    damaged = _corrupt(srv.l2_dir, how, 4)
    srv.start()

    after = drive(srv, "store", "0:6")["summary"]  # lookups, and stores of what missed: a recompute
    assert after["wrong_bytes"] == 0 and after["lookup_errors"] == 0
    assert after["hit_chunks"] < 12 and after["stored_chunks"] >= len(damaged)
    assert srv.healthy() and srv.proc is not None and srv.proc.poll() is None
    healed = drive(srv, "verify", "0:6")["summary"]  # the recomputed chunks are served now
    assert healed["hit_chunks"] == 12 and healed["wrong_bytes"] == 0


@pytest.mark.parametrize("how", ["garble", "flip"])
@pytest.mark.parametrize("encrypted", [True, False], ids=["aesgcm", "checked"])
def test_same_size_corruption_is_a_miss(servers: Servers, how: str, encrypted: bool) -> None:
    """lmcache keeps no checksum: only kvpersist's serde (encrypted, or checked with encryption off)
    makes a file of the right size with other bytes fail, as a miss. Without it this served wrong bytes."""
    srv = servers(make_target(encrypted=encrypted))
    srv.start()
    assert drive(srv, "store", "0:4")["summary"]["stored_chunks"] == 8
    srv.stop(signal.SIGKILL)
    damaged = _corrupt(srv.l2_dir, how, 2)
    srv.start()
    first = drive(srv, "verify", "0:4")["summary"]
    assert first["wrong_bytes"] == 0 and first["lookup_errors"] == 0
    assert first["hit_chunks"] <= 8 - len(damaged)  # the damaged ones (and what follows them in a prefix) miss
    assert first["hit_chunks"] > 0  # the rest is still served
    assert srv.healthy() and srv.proc is not None and srv.proc.poll() is None
    again = drive(srv, "verify", "0:4")["summary"]  # and it stays a miss, never turns into a hit of wrong bytes
    assert again["wrong_bytes"] == 0 and again["hit_chunks"] <= 8 - len(damaged)


def test_lmcaches_bare_read_serves_same_size_garbage(servers: Servers) -> None:
    """The control for the test above: lmcache 0.5.6's own read, with no serde (what encryption off
    rendered before every object was checked), serves a same-size file with other bytes as a hit."""
    srv = servers(make_target(encrypted=False))
    srv.serde_type = NO_SERDE
    srv.start()
    drive(srv, "store", "0:4")
    srv.stop(signal.SIGKILL)
    _corrupt(srv.l2_dir, "garble", 2)
    srv.start()
    assert drive(srv, "verify", "0:4")["summary"]["wrong_bytes"] > 0


def test_another_key_reads_as_misses(servers: Servers, tmp_path: Path) -> None:
    """A namespace's data under another master key (a Secret replaced, another cluster's) is a
    miss, never wrong bytes, and the server stays healthy. (Since the namespace id carries the
    key's fingerprint and a server refuses a key its id does not name, only a folder moved by hand
    meets another key; those objects are left as they are: tests/integration/test_l2_serde.py.)"""
    target = make_target()
    own = servers(target)
    own.start()
    assert drive(own, "store", "0:4")["summary"]["stored_chunks"] == 8
    own.stop(signal.SIGKILL)

    key = other_key(tmp_path / "other-key")
    other = servers(expecting(target, key), key_dir=key)
    other.start()
    wrong_key = drive(other, "verify", "0:4")["summary"]
    assert wrong_key["hit_chunks"] == 0 and wrong_key["wrong_bytes"] == 0 and wrong_key["lookup_errors"] == 0
    assert other.healthy() and other.proc is not None and other.proc.poll() is None
    again = drive(other, "verify", "0:4")["summary"]
    assert again["hit_chunks"] == 0 and again["wrong_bytes"] == 0


@pytest.fixture()
def small_volume(tmp_path: Path):
    """A 4 MiB tmpfs: room for 8 chunks of 512 KiB. Needs mount (root), as CI has."""
    mnt = tmp_path / "small-volume"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({out.stderr.strip()}): the disk-full case needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_fails_stores_keeps_serving_and_is_reported(servers: Servers, small_volume: Path) -> None:
    srv = servers(make_target(), volume=small_volume)
    srv.start()
    first = drive(srv, "store", "0:16")["summary"]  # 32 chunks, 16 MiB, into 4 MiB
    assert first["lookup_errors"] == 0
    assert len(chunk_files(srv.l2_dir)) < 32
    assert srv.healthy()
    served = drive(srv, "verify", "0:16")["summary"]  # L1 still serves what L2 could not take
    assert served["hit_chunks"] == 32 and served["wrong_bytes"] == 0
    # lmcache's own admin API (what the agent forwards in a pod): this test runs the server alone.
    report = fetch_status("srv-0", "127.0.0.1", srv.target.spec.lmcache_server.http_port, prefix=DIRECT)
    assert report.healthy  # lmcache's /status stays "healthy" ...
    assert report.l2_writes_failed and report.l2_writes_failed >= 32 - 8  # ... the operator still sees the failed writes
    assert report.l2_writes_submitted == 32
