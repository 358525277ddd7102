"""kvpersist.inserver.serve: the serde the lmcache server runs for encrypted L2, and how it is shipped.

Its keys and header are lmcache 0.5.6's aesgcm, and lmcache's own frames (version 1) still open
(data lmcache wrote stays readable); its own frames (version 2) are sealed in segments that open
side by side; a changed byte, a moved or dropped segment, or another key must fail, never
decrypt; and the module must run in the server's image, which has no kvpersist. The real server
with this serde: tests/integration/test_datapath.py (corruption, other keys) and test_l2_serde.py.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from kvpersist.builders.lmcache import SERVE_ENV, serve_source, server_container
from kvpersist.inserver import serve
from tests.unit.test_builders import target

cryptography = pytest.importorskip("cryptography")
from cryptography.exceptions import InvalidTag  # noqa: E402

MASTER = bytes(range(32))


class Buffer:
    """A MemoryObj as the serde sees one: a byte_array, and the used size it may narrow."""

    def __init__(self, size: int, fill: bytes | None = None) -> None:
        self.raw = bytearray(fill if fill is not None else bytes(size))
        self.used: int | None = None

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self.raw)

    def set_used_size(self, n: int) -> None:
        self.used = n


class Key:
    def __init__(self, salt: str = "") -> None:
        self.cache_salt = salt


def frame_of(plaintext: bytes, salt: str = "", iv: bytes = b"\x07" * 12, master: bytes = MASTER) -> bytes:
    aead = serve.AeadKeys(master, 32).aead(salt)
    out = bytearray(serve.sealed_size(len(plaintext)))
    n = serve.seal(aead, iv, memoryview(plaintext), memoryview(out))
    assert n == len(out)
    return bytes(out)


def opened(frame: bytes | bytearray, n: int, salt: str = "", master: bytes = MASTER) -> bytes:
    out = bytearray(n)
    serve.open_frame(serve.AeadKeys(master, 32).aead(salt), memoryview(frame), memoryview(out))
    return bytes(out)


SEG = serve.SEGMENT_BYTES


@pytest.mark.parametrize("size", [0, 5, 64 * 1024 + 5, SEG, SEG + 1, 3 * SEG + 12345])
def test_a_frame_round_trips_and_pads_are_ignored(size: int) -> None:
    data = os.urandom(size)
    frame = frame_of(data)
    segments = max(1, -(-size // SEG))
    assert len(frame) == 13 + size + 16 * segments == serve.sealed_size(size)
    assert frame[0] == serve.VERSION_SEGMENTED and frame[1:13] == b"\x07" * 12 and (size < 16 or data[:16] not in frame)
    assert opened(frame + bytes(4096), size) == data  # the adapters pad files to whole pages


@pytest.mark.parametrize("where", [0, 5, 13, 1000, SEG + 13 + 7, -1])
def test_any_changed_byte_fails_and_never_decrypts(where: int) -> None:
    data = os.urandom(2 * SEG)
    frame = bytearray(frame_of(data))
    frame[where] ^= 0x01
    with pytest.raises((InvalidTag, serve.FrameError)):
        opened(frame, len(data))


def test_segments_cannot_be_swapped_dropped_or_taken_from_another_frame() -> None:
    """Each segment's nonce and associated data name its index and the count, under the frame's IV."""
    data = os.urandom(2 * SEG)
    frame = frame_of(data)
    first, second = frame[13:13 + SEG + 16], frame[13 + SEG + 16:]
    with pytest.raises(InvalidTag):
        opened(frame[:13] + second + first, len(data))  # swapped
    with pytest.raises((InvalidTag, serve.FrameError)):
        opened(frame[:13] + first, SEG)  # the second dropped, read as a one-segment frame
    other = frame_of(os.urandom(2 * SEG), iv=b"\x09" * 12)
    with pytest.raises(InvalidTag):
        opened(frame[:13] + first + other[13 + SEG + 16:], len(data))  # a segment of another frame


def test_another_key_or_salt_fails_and_a_short_frame_is_malformed() -> None:
    data = os.urandom(4096)
    frame = frame_of(data, salt="tenant-a")
    with pytest.raises(InvalidTag):
        opened(frame, len(data), "tenant-a", master=bytes(32))  # another master key
    with pytest.raises(InvalidTag):
        opened(frame, len(data), "tenant-b")  # another salt
    with pytest.raises(serve.FrameError):
        opened(frame[:-1], len(data), "tenant-a")
    with pytest.raises(serve.FrameError):
        opened(b"\x03" + frame[1:], len(data), "tenant-a")
    with pytest.raises(serve.FrameError):
        opened(b"", len(data), "tenant-a")


def test_keys_are_lmcaches_hkdf_keys() -> None:
    lmcache = pytest.importorskip("lmcache.v1.distributed.serde.aesgcm")
    from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider

    assert lmcache._HKDF_INFO_PREFIX == serve.HKDF_INFO_PREFIX  # the contract: lmcache's own key schedule
    assert (lmcache._VERSION, lmcache._IV_LEN, lmcache._TAG_LEN) == (serve.VERSION, serve.IV_LEN, serve.TAG_LEN)
    ours = serve.AeadKeys(MASTER, 32)
    theirs = HkdfKeyProvider(MASTER, key_len=32, info_prefix=serve.HKDF_INFO_PREFIX)
    for salt in ("", "tenant-a", "ünïcode"):
        assert ours.derive(salt) == theirs.get_key(salt)


def test_lmcaches_frames_open_and_ours_are_refused_by_lmcache(monkeypatch: pytest.MonkeyPatch) -> None:
    """What lmcache's own aesgcm serializer wrote (version 1) opens with ours; ours (version 2)
    is refused by lmcache's deserializer: a miss there, never wrong bytes."""
    lmcache = pytest.importorskip("lmcache.v1.distributed.serde.aesgcm")
    from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider

    provider = HkdfKeyProvider(MASTER, key_len=32, info_prefix=serve.HKDF_INFO_PREFIX)
    data = os.urandom(3 * 4096)
    theirs = Buffer(len(data) + serve.FRAME_OVERHEAD)
    written = lmcache.AesGcmSerializer(provider).serialize(Buffer(len(data), data), theirs, Key("s"))
    assert written == len(data) + serve.FRAME_OVERHEAD and theirs.raw[0] == serve.VERSION
    assert opened(theirs.raw + bytes(4096), len(data), "s") == data
    theirs.raw[100] ^= 1
    with pytest.raises(InvalidTag):
        opened(theirs.raw, len(data), "s")
    out = Buffer(len(data))
    with pytest.raises(ValueError, match="unknown version"):
        lmcache.AesGcmDeserializer(provider).deserialize(Buffer(0, frame_of(data, salt="s")), out, Key("s"))
    assert bytes(out.raw) == bytes(len(data))


def wait_result(query: Any, fd: int, task: int, timeout: float = 30.0) -> bool:
    """The processor's result for task, waiting on its eventfd (drained each time) up to timeout."""
    import select
    import time

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = query(task)
        if result is not None:
            return result
        if poller.poll(100):
            os.read(fd, 8)  # an eventfd's counter: read it, or poll never waits again
    raise AssertionError(f"task {task} never finished")


def test_the_processor_seals_and_opens_batches_all_or_nothing(tmp_path: Path) -> None:
    pytest.importorskip("lmcache")
    from lmcache.v1.distributed.serde.base import SerdeProcessor

    key_file = tmp_path / "master.key"
    key_file.write_bytes(MASTER)
    proc = serve.make_processor({"master_key_path": str(key_file), "aes_bits": 256, "max_workers": 3})
    assert isinstance(proc, SerdeProcessor)
    try:
        chunks = [os.urandom(16384) for _ in range(4)] + [os.urandom(2 * serve.SEGMENT_BYTES + 99)]  # one of 3 segments
        frames = [Buffer(serve.sealed_size(len(c)) + 4096) for c in chunks]  # oversized, as L1 temps are
        task = proc.submit_serialize([Buffer(len(c), c) for c in chunks], frames, [Key() for _ in chunks])
        assert wait_result(proc.query_serialize_result, proc.get_serialize_event_fd(), task) is True
        assert proc.query_serialize_result(task) is None  # reported once
        assert all(f.used == serve.sealed_size(len(c)) for f, c in zip(frames, chunks, strict=True))
        assert len({bytes(f.raw[1:13]) for f in frames}) == len(frames)  # a fresh IV for each object

        outs = [Buffer(len(c)) for c in chunks]
        task = proc.submit_deserialize(frames, outs, [Key() for _ in chunks])
        assert wait_result(proc.query_deserialize_result, proc.get_deserialize_event_fd(), task) is True
        assert [bytes(o.raw) for o in outs] == chunks

        frames[3].raw[500] ^= 0x80  # one bad object fails the whole batch: every key in it is a miss
        task = proc.submit_deserialize(frames, [Buffer(len(c)) for c in chunks], [Key() for _ in chunks])
        assert wait_result(proc.query_deserialize_result, proc.get_deserialize_event_fd(), task) is False
        assert proc.estimate_serialized_size(type("L", (), {"shapes": [(2, 3)], "dtypes": [type("D", (), {"itemsize": 2})]})) \
            == 12 + serve.FRAME_OVERHEAD
    finally:
        proc.close()


def test_batches_report_once_after_every_object_even_when_one_fails() -> None:
    done: list[tuple[int, bool, bool]] = []
    finished = threading.Event()

    def on_done(task: int, sealing: bool, ok: bool) -> None:
        done.append((task, sealing, ok))
        finished.set()

    ran: list[int] = []
    batches = serve.ObjectBatches(2, on_done)

    def job(i: int) -> Any:
        def run() -> None:
            ran.append(i)
            if i == 1:
                raise ValueError("bad object")
        return run

    try:
        batches.run(7, False, [job(i) for i in range(4)])
        assert finished.wait(10)
    finally:
        batches.close()
    assert done == [(7, False, False)] and sorted(ran) == [0, 1, 2, 3]
    batches = serve.ObjectBatches(1, on_done)
    batches.run(8, True, [])
    batches.close()
    assert done[-1] == (8, True, True)


class FakeBitmap:
    def __init__(self, n: int) -> None:
        self.bits = [False] * n

    def set(self, i: int) -> None:
        self.bits[i] = True

    def test(self, i: int) -> bool:
        return self.bits[i]


def test_chunk_loads_answer_once_when_every_chunk_has() -> None:
    """n loads of one chunk answered as one: None until the last answers (in any order), each
    chunk's bit from its own load, every answer taken once, ids apart from lmcache's own."""
    submitted: list[tuple[list, list]] = []
    answers: dict[int, FakeBitmap | None] = {}

    def submit_one(keys: list, objects: list) -> int:
        submitted.append((keys, objects))
        answers[len(submitted) - 1] = None
        return len(submitted) - 1

    def query_one(task: int) -> FakeBitmap | None:
        return answers.pop(task, None)  # popped when read, as lmcache does

    loads = serve.ChunkLoads(submit_one, query_one, FakeBitmap)
    task = loads.submit(["k0", "k1", "k2"], ["o0", "o1", "o2"])
    assert submitted == [(["k0"], ["o0"]), (["k1"], ["o1"]), (["k2"], ["o2"])]
    assert task >= serve.ChunkLoads.FIRST_ID and loads.owns(task) and not loads.owns(0)
    ok, failed = FakeBitmap(1), FakeBitmap(1)
    ok.set(0)
    answers[2] = ok
    assert loads.query(task) is None
    answers[0] = ok
    assert loads.query(task) is None and 2 not in answers  # chunk 2's answer kept, not asked again
    answers[1] = failed
    result = loads.query(task)
    assert result is not None and result.bits == [True, False, True] and not loads.owns(task)


def test_the_shipped_source_runs_in_an_image_without_kvpersist() -> None:
    """What the server container runs: the module's own source (SERVE_ENV), standard library,
    cryptography and lmcache only, nothing the kubelet would expand, and lmcache's own CLI."""
    source = serve_source()
    assert source == Path(serve.__file__).read_text()
    env = {e["name"]: e.get("value") for e in server_container(target())["env"]}
    assert env[SERVE_ENV] == source
    assert "$(" not in source  # the kubelet expands $(VAR) in env values
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) - {"__future__"} == {"cryptography", "lmcache"}, imported
    pytest.importorskip("lmcache")
    done = subprocess.run([sys.executable, "-I", "-c", source, "server", "--help"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
    assert done.returncode == 0 and "--l2-adapter" in done.stdout, done.stderr[-2000:]
