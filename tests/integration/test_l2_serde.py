"""kvpersist's L2 serde (kvpersist.inserver.serve) in the real lmcache server (0.5.6, CPU), run
exactly as rendered: it is the one that runs; lmcache's own aesgcm frames and ours are misses to
each other (never wrong bytes); an object of the server's own key that fails authentication is
removed so its prefix is stored again, instead of staying a miss forever (issue 27, item 4), while
another key's objects are left as they are (issue 39). Corruption and other keys in general:
test_datapath.py; names and the key check: test_l2_bound.py.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpersist.inserver.serve import HEADER_LEN
from tests.fsstate import files_state
from tests.integration.conftest import LocalServer, chunk_files, drive, expecting, make_target, other_key

pytestmark = pytest.mark.datapath

Servers = Callable[..., LocalServer]


def wait_until(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def judged(srv: LocalServer, verdict: str) -> int:
    """How many opening failures the server logged with this verdict: the serde hands an object to
    the removal, or not, before it logs the line, so a line saying "left as it is" is the decision."""
    return len(re.findall(r"kvpersist-aesgcm: opening of an object in task \d+ failed .*" + verdict, srv.log.read_text()))


def test_the_rendered_serde_is_kvpersists_and_says_so(servers: Servers) -> None:
    srv = servers(make_target())
    srv.start()
    assert drive(srv, "store", "0:2")["summary"]["stored_chunks"] == 4
    log = srv.log.read_text()
    assert "kvpersist-aesgcm: AES-256-GCM" in log and "kvpersist-aesgcm: wired into the L2 wrapper" in log
    assert srv.status()["storage_manager"]["l2_adapters"][0].get("serde_wrapped") is True


def test_lmcaches_aesgcm_frames_are_misses_left_as_they_are_and_ours_are_misses_to_it(servers: Servers) -> None:
    """Same folder, same key: what lmcache's own serde stored (version 1 frames, no name bound) is
    a miss to ours, never wrong bytes, and left byte for byte (not ours to remove); what ours
    stored (version 3) is a miss to lmcache's. Through the operator the two never meet: the frame
    version is in the namespace id (api.spec.L2_SERDE)."""
    target = make_target()
    theirs = servers(target)
    theirs.serde_type = "aesgcm"
    theirs.start()
    assert drive(theirs, "store", "0:4")["summary"]["stored_chunks"] == 8
    theirs.stop(signal.SIGKILL)
    files = files_state(theirs.l2_dir)
    ours = servers(target)
    ours.start()
    read = drive(ours, "verify", "0:4")["summary"]
    assert read["hit_chunks"] == 0 and read["wrong_bytes"] == 0 and ours.healthy()
    # Each object read was judged (the removal is handed what fails before this line is logged) and left.
    wait_until("the server's verdict on what it read", lambda: judged(ours, r"a version 1 frame .*left as it is") >= 1)
    assert judged(ours, "is removed") == 0
    assert files_state(ours.l2_dir) == files
    assert drive(ours, "store", "10:12")["summary"]["stored_chunks"] == 4  # new objects, ours
    wait_until("our 4 objects written", lambda: len(chunk_files(ours.l2_dir)) == 12)
    ours.stop()
    again = servers(target)
    again.serde_type = "aesgcm"
    again.start()
    mixed = drive(again, "verify", "10:12")["summary"]
    assert mixed["hit_chunks"] == 0 and mixed["wrong_bytes"] == 0 and again.healthy()


def _garble(folder: Path, count: int) -> list[str]:
    """Other bytes after the header (ours: version 3 and the server's key fingerprint), as bit rot
    in the sealed body; a header of another key or version is left as it is (test_l2_bound.py)."""
    names = [p.name for p in chunk_files(folder)][:count]
    for name in names:
        path = folder / name
        data = path.read_bytes()
        path.write_bytes(data[:HEADER_LEN] + os.urandom(len(data) - HEADER_LEN))
    return names


def test_a_corrupt_object_is_removed_and_stored_again(servers: Servers) -> None:
    """Before: lmcache kept the corrupt file and its index entry, skipped every store of the key,
    and the prefix missed forever. Now the failed object is deleted and the next store writes it;
    after a restart (so nothing comes from L1) every chunk is an L2 hit with the right bytes."""
    srv = servers(make_target())
    srv.start()
    assert drive(srv, "store", "0:4")["summary"]["stored_chunks"] == 8
    srv.stop(signal.SIGKILL)
    before = files_state(srv.l2_dir)
    damaged = _garble(srv.l2_dir, 2)
    srv.start()
    missed = drive(srv, "verify", "0:4")["summary"]
    assert missed["wrong_bytes"] == 0 and missed["hit_chunks"] <= 8 - len(damaged)
    wait_until("the unreadable objects' removal", lambda: not any((srv.l2_dir / n).exists() for n in damaged))
    assert re.search(r"kvpersist-aesgcm: opening of an object in task \d+ failed \(InvalidTag\): the batch is a miss; the "
                     r"object is removed", srv.log.read_text())
    again = drive(srv, "store", "0:4")["summary"]  # vLLM's recompute, stored as usual
    assert again["wrong_bytes"] == 0
    wait_until("the damaged chunks written again", lambda: all((srv.l2_dir / n).exists() for n in damaged))
    after = files_state(srv.l2_dir)
    assert {n for n in after if after[n] != before[n]} == set(damaged)  # only the damaged ones were rewritten
    srv.stop(signal.SIGKILL)
    srv.start()
    healed = drive(srv, "verify", "0:4")["summary"]
    assert healed["hit_chunks"] == 8 and healed["verified_chunks"] == 8 and healed["wrong_bytes"] == 0


def test_objects_under_another_key_are_misses_left_as_they_are(servers: Servers, tmp_path: Path) -> None:
    """A folder's objects under a key its server does not hold (with the key's fingerprint in the
    namespace id, and the server refusing a key its id does not name, this takes a folder moved by
    hand): misses, never wrong bytes, and never removed, since they may be all there is of another
    key's data. Before, every one the server read was deleted."""
    target = make_target()
    own = servers(target)
    own.start()
    assert drive(own, "store", "0:4")["summary"]["stored_chunks"] == 8
    own.stop(signal.SIGKILL)
    old = files_state(own.l2_dir)

    key = other_key(tmp_path / "other-key")
    other = servers(expecting(target, key), key_dir=key)
    other.start()
    wrong_key = drive(other, "verify", "0:4")["summary"]
    assert wrong_key["hit_chunks"] == 0 and wrong_key["wrong_bytes"] == 0 and other.healthy()
    wait_until("the server's verdict on what it read", lambda: judged(other, r"a frame of another key .*left as it is") >= 1)
    assert judged(other, "is removed") == 0
    assert files_state(other.l2_dir) == old
    other.stop(signal.SIGKILL)
    back = servers(target)  # the folder's own key: everything still there
    back.start()
    final = drive(back, "verify", "0:4")["summary"]
    assert final["hit_chunks"] == final["verified_chunks"] == 8 and final["wrong_bytes"] == 0


def _tier_hits(srv: LocalServer) -> tuple[int, int]:
    """lmcache's own L1 and L2 hit-token counters."""
    import urllib.request

    from kvpersist.status.usage import LOOKUP_HIT_L1, LOOKUP_HIT_L2, parse_exposition

    with urllib.request.urlopen(srv.http_url + "/metrics", timeout=10) as r:
        m = parse_exposition(r.read().decode()) or {}
    return int(m.get(LOOKUP_HIT_L1, 0)), int(m.get(LOOKUP_HIT_L2, 0))


@pytest.mark.parametrize("encrypted", [True, False], ids=["aesgcm", "plain"])
def test_an_l2_hit_stays_in_l1_for_the_next_request(servers: Servers, encrypted: bool) -> None:
    """After a server restart the first request of a prefix is an L2 hit and the next ones are L1
    hits (the rendered --l2-prefetch-policy retain). lmcache's default dropped what it loaded from
    L2 after each request, so every repeat read L2 again (the slow "server restarted" TTFT)."""
    srv = servers(make_target(encrypted=encrypted))
    srv.start()
    assert drive(srv, "store", "0:4")["summary"]["stored_chunks"] == 8
    srv.stop(signal.SIGKILL)
    srv.start()
    first = drive(srv, "verify", "0:4")["summary"]
    assert first["hit_chunks"] == 8 and first["wrong_bytes"] == 0
    l1, l2 = _tier_hits(srv)
    assert (l1, l2) == (0, 8 * 256)
    again = drive(srv, "verify", "0:4")["summary"]
    assert again["hit_chunks"] == 8 and again["verified_chunks"] == 8 and again["wrong_bytes"] == 0
    assert _tier_hits(srv) == (8 * 256, 8 * 256)  # all from L1 this time, nothing more from L2
