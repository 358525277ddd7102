"""An L2 object is valid only under its own name, and only for the key its namespace names (issue
39), and in every mode (issue 56: with encryption off too), with the real lmcache server (0.5.6,
CPU) run with the args the operator renders.

- A server given another key than the one its namespace id was computed with (a Secret's bytes
  rotated, the server container restarted before its pod was rolled) refuses to start: exit 78,
  the termination message, every file byte for byte as it was. Before, it started, failed to open
  every object and removed each one it read.
- An object's frame binds its name (lmcache's whole ObjectKey) and the namespace id: a file copied
  over another chunk's name, or into another namespace's folder under the same key, is a miss.
  Before, it authenticated and was served as the other chunk (a wrong hit).
- With encryption off (spec.l2.encryption.enabled false) an object is a checked frame (version 4:
  the plaintext and a GMAC per segment, bound to the name): a copy under another name, a zeroed
  file, one flipped bit or a truncation is a miss, as encrypted. Before, the first three were
  served as hits with wrong bytes. The damaged objects that the serde reads are removed (frames of
  the server's own key and version, or all zeros), so the chunk is stored again when next computed.
The bucket adapter's case (a path pointed at another object): test_hfbucket_datapath.py.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpersist.identity import key_fingerprint
from tests.fsstate import files_state
from tests.integration.conftest import (
    STAND_IN_FINGERPRINT,
    STAND_IN_KEY,
    LocalServer,
    chunk_files,
    drive,
    make_target,
    other_key,
    write_key,
)
from tests.integration.test_capacity import settle
from tests.integration.test_l2_serde import _tier_hits, wait_until

pytestmark = pytest.mark.datapath

Servers = Callable[..., LocalServer]


def test_a_server_given_another_key_refuses_to_start_and_leaves_every_file(servers: Servers, tmp_path: Path) -> None:
    key = write_key(tmp_path / "l2-key")  # the key the namespace id names
    srv = servers(make_target(), key_dir=key)
    srv.start()
    assert drive(srv, "store", "0:4")["summary"]["stored_chunks"] == 8
    settle(srv.l2_dir)
    srv.stop()
    before = files_state(srv.l2_dir)
    assert len(before) == 8

    other_key(key)  # the Secret's bytes rotated; the pod not rolled yet
    rotated = key_fingerprint((key / "master.key").read_bytes())
    termination = tmp_path / "termination-log"
    code = srv.start_to_exit({"KVPERSIST_TERMINATION_LOG": str(termination)})
    assert code == 78, srv.log.read_text()[-3000:]
    assert termination.read_text() == (
        f"kvpersist-aesgcm key mismatch: key file fingerprint {rotated}, namespace {srv.target.namespace_id} expects "
        f"{STAND_IN_FINGERPRINT}: refusing to start (no object is read or removed)")
    assert files_state(srv.l2_dir) == before  # nothing read, nothing removed

    write_key(key, STAND_IN_KEY)  # the first key back: every chunk served from L2, right bytes
    srv.start()
    back = drive(srv, "verify", "0:4")["summary"]
    assert back["hit_chunks"] == back["verified_chunks"] == 8 and back["wrong_bytes"] == 0, back
    assert _tier_hits(srv) == (0, 8 * 256)  # lmcache's own counters: all 2048 tokens from L2
    assert files_state(srv.l2_dir) == before


def _swap_pairs(folder: Path) -> list[str]:
    """Every object's file copied over another's name (pairs swapped): same size, same key."""
    names = [p.name for p in chunk_files(folder)]
    for a, b in zip(names[0::2], names[1::2], strict=True):
        pa, pb = folder / a, folder / b
        da, db = pa.read_bytes(), pb.read_bytes()
        assert len(da) == len(db)
        pa.write_bytes(db)
        pb.write_bytes(da)
    return names


@pytest.mark.parametrize("encrypted", [True, False], ids=["aesgcm", "checked"])
def test_an_object_under_another_name_is_a_miss_never_the_other_chunks_bytes(servers: Servers, encrypted: bool) -> None:
    srv = servers(make_target(encrypted=encrypted))
    srv.start()
    assert drive(srv, "store", "0:4")["summary"]["stored_chunks"] == 8
    settle(srv.l2_dir)
    srv.stop(signal.SIGKILL)
    swapped = _swap_pairs(srv.l2_dir)
    assert len(swapped) == 8
    srv.start()
    read = drive(srv, "verify", "0:4")["summary"]  # the driver compares what comes back with what was stored
    assert read["wrong_bytes"] == 0 and read["hit_chunks"] == 0, read
    assert srv.healthy()
    # Each object the server opened under the wrong name is a frame of its own key: removed.
    wait_until("the misplaced objects' removal", lambda: not any((srv.l2_dir / n).exists() for n in swapped[::2]))


def _damage(folder: Path, how: str) -> list[str]:
    """Damages two chunk files as a disk or a person would: another chunk's file copied over the
    name (copy), the file zeroed whole (what a crash leaves when the rename reached the disk and
    the data did not: writes are not synced), one bit flipped mid-file (bit rot), cut to a third."""
    files = chunk_files(folder)
    victims = files[1:3]
    for path in victims:
        size = path.stat().st_size
        if how == "copy":
            path.write_bytes(files[0].read_bytes())
        elif how == "zero":
            path.write_bytes(bytes(size))
        elif how == "flip":
            data = bytearray(path.read_bytes())
            data[size // 2] ^= 0x01
            path.write_bytes(bytes(data))
        elif how == "truncate":
            with path.open("r+b") as f:
                f.truncate(size // 3)
    return [p.name for p in victims]


@pytest.mark.parametrize("how", ["copy", "zero", "flip", "truncate"])
@pytest.mark.parametrize("encrypted", [True, False], ids=["aesgcm", "checked"])
def test_a_damaged_object_is_a_miss_in_every_mode(servers: Servers, encrypted: bool, how: str) -> None:
    """Each damage is a miss of those chunks (and of what follows them in their prefix), never
    wrong bytes; the rest is served. What the serde opened and found damaged is removed (the
    folder then holds nothing unreadable under those names); a truncated file fails the adapter's
    own read before the serde sees it, and is left (a miss while it is there)."""
    srv = servers(make_target(encrypted=encrypted))
    srv.start()
    assert drive(srv, "store", "0:4")["summary"]["stored_chunks"] == 8
    settle(srv.l2_dir)
    srv.stop(signal.SIGKILL)
    damaged = _damage(srv.l2_dir, how)
    srv.start()
    read = drive(srv, "verify", "0:4")["summary"]
    assert read["wrong_bytes"] == 0 and read["lookup_errors"] == 0, read
    assert 0 < read["hit_chunks"] <= 8 - len(damaged), read
    assert srv.healthy()
    if how != "truncate":
        wait_until(f"the {how} objects' removal", lambda: not any((srv.l2_dir / n).exists() for n in damaged))
    again = drive(srv, "verify", "0:4")["summary"]  # never turns into a hit of wrong bytes
    assert again["wrong_bytes"] == 0, again


def test_an_object_copied_into_another_namespace_of_the_same_key_is_a_miss(servers: Servers) -> None:
    a = servers(make_target())
    b = servers(make_target(maxModelLen=16384))  # another pin: another namespace, the same key (the resource's)
    assert a.target.namespace_id != b.target.namespace_id and a.target.key_fingerprint == b.target.key_fingerprint
    a.start()
    assert drive(a, "store", "0:4")["summary"]["stored_chunks"] == 8
    settle(a.l2_dir)
    a.stop(signal.SIGKILL)
    shutil.copytree(a.l2_dir, b.l2_dir)  # by hand, under the same names
    assert set(files_state(b.l2_dir)) == set(files_state(a.l2_dir))
    b.start()
    read = drive(b, "verify", "0:4")["summary"]
    assert read["hit_chunks"] == 0 and read["wrong_bytes"] == 0, read
