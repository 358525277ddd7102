"""benchmarks/check_ceiling.py measures real checks, not stand-ins: each way of reading returns the
plaintext of the server's own frames (serve.seal), and a changed byte of a file stops the checked
ways (InvalidTag)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("cryptography")
from benchmarks import check_ceiling  # a namespace package: the repository's root is on the path


@pytest.fixture
def bench() -> ModuleType:
    return check_ceiling


@pytest.fixture
def small(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setattr(bench, "CHUNK_BYTES", 5 * 2**20 + 4096)  # three segments, the last one short
    return bench


def test_every_way_reads_the_plaintext_with_one_and_two_threads(small: ModuleType, tmp_path: Path) -> None:
    files = small.Files(tmp_path, 3)
    for threads in (1, 2):
        readers = [small.Reader(-(-3 // threads), 64 * 1024) for _ in range(threads)]  # chunk j by thread j % threads
        for how in small.READERS:
            assert small.read_all(files, how, threads, readers, direct=False, cold=False) > 0


@pytest.mark.parametrize("how", ["temp+open", "temps+open", "streamed", "streamed-plain"])
def test_a_changed_byte_stops_each_checked_way(small: ModuleType, tmp_path: Path, how: str) -> None:
    files = small.Files(tmp_path, 2)
    target = files.plains[1] if how == "streamed-plain" else files.frames[1]
    data = bytearray(target.read_bytes())
    data[3 * 2**20 + 5] ^= 1  # inside the second segment
    target.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="InvalidTag"):
        small.read_all(files, how, 1, [small.Reader(2, 64 * 1024)], direct=False, cold=False)


def test_the_bench_derives_nonces_as_the_server_does(bench: ModuleType) -> None:
    from kvpersist.inserver import serve

    iv = bytes(8) + (2**32 - 1).to_bytes(4, "big")  # the counter wraps, as the server's
    assert all(bench.nonce(iv, i) == serve._nonce(iv, i) for i in range(3))
