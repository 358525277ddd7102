"""kvpersist.inserver.serve: the serde the lmcache server runs for encrypted L2, and how it is shipped.

Its keys are lmcache 0.5.6's aesgcm keys; its frames (version 3) carry the key's fingerprint and
are sealed in segments that open side by side, each bound to the object's name and namespace; a
changed byte, a moved or dropped segment, another name, namespace, key or version must fail, never
decrypt; only a frame of the server's own key is ever handed to the removal; a key file other than
the one the namespace id names stops the server; and the module must run in the server's image,
which has no kvpersist. The real server with this serde: tests/integration/test_l2_serde.py and
test_datapath.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from kvpersist.api.spec import L2_SERDE
from kvpersist.builders.lmcache import SERVE_ENV, server_container
from kvpersist.identity import key_fingerprint, resolve
from kvpersist.inserver import program_source, serve
from tests.unit.test_builders import target

MASTER = bytes(range(32))
NS = "kvp-" + "a" * 32


@dataclasses.dataclass(frozen=True)
class Key:
    """lmcache 0.5.6's ObjectKey, field for field (test_the_binding_covers_lmcaches_whole_object_key)."""

    chunk_hash: bytes = bytes(32)
    model_name: str = "Qwen/Qwen2.5-7B-Instruct"
    kv_rank: int = 0x01000100
    object_group_id: int = 0
    cache_salt: str = ""


def test_the_key_fingerprint_is_the_identitys() -> None:
    """The server checks its key file with the fingerprint the namespace id was computed with."""
    for key in (MASTER, b"k" * 32, os.urandom(32), b"x"):
        assert serve.key_fingerprint(key) == key_fingerprint(key)
    assert serve.AeadKeys(MASTER, 32).fingerprint == bytes.fromhex(key_fingerprint(MASTER))


def test_the_kubelet_expands_nothing_in_the_shipped_source() -> None:
    assert "$(" not in program_source()


def test_the_frame_version_is_in_the_namespace_id() -> None:
    """A new frame is a new namespace: data of older frames (which bind no name) becomes an orphan
    rather than misses in a folder the server shares with them. Bumping serve.VERSION without the
    pin fails here."""
    spec = target().spec
    fingerprint = key_fingerprint(MASTER)
    pins = spec.pins(fingerprint)
    assert pins["l2_serde"] == L2_SERDE == f"kvpersist-aesgcm-256/v{serve.VERSION}"
    older = resolve({**pins, "l2_serde": "kvpersist-aesgcm-256/v2"}).namespace_id
    assert older is not None and resolve(pins).namespace_id not in (None, older)


cryptography = pytest.importorskip("cryptography")
from cryptography.exceptions import InvalidTag  # noqa: E402


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


def binding(key: Key = Key(), ns: str = NS, master: bytes = MASTER) -> bytes:
    return serve.object_binding(bytes.fromhex(key_fingerprint(master)), ns, key)


def frame_of(plaintext: bytes, key: Key = Key(), iv: bytes = b"\x07" * 12, master: bytes = MASTER, ns: str = NS) -> bytes:
    keys = serve.AeadKeys(master, 32)
    out = bytearray(serve.sealed_size(len(plaintext)))
    n = serve.seal(keys.aead(key.cache_salt), keys.fingerprint, binding(key, ns, master), iv, memoryview(plaintext),
                   memoryview(out))
    assert n == len(out)
    return bytes(out)


def opened(frame: bytes | bytearray, n: int, key: Key = Key(), master: bytes = MASTER, ns: str = NS) -> bytes:
    out = bytearray(n)
    keys = serve.AeadKeys(master, 32)
    serve.open_frame(keys.aead(key.cache_salt), keys.fingerprint, binding(key, ns, master), memoryview(frame), memoryview(out))
    return bytes(out)


SEG = serve.SEGMENT_BYTES
H = serve.HEADER_LEN  # 21: version, fingerprint, IV


@pytest.mark.parametrize("size", [0, 5, 64 * 1024 + 5, SEG, SEG + 1, 3 * SEG + 12345])
def test_a_frame_round_trips_and_pads_are_ignored(size: int) -> None:
    data = os.urandom(size)
    frame = frame_of(data)
    segments = max(1, -(-size // SEG))
    assert H == 21 and len(frame) == H + size + 16 * segments == serve.sealed_size(size)
    assert frame[0] == serve.VERSION == 3 and frame[1:9] == bytes.fromhex(key_fingerprint(MASTER))
    assert frame[9:21] == b"\x07" * 12 and (size < 16 or data[:16] not in frame)
    assert opened(frame + bytes(4096), size) == data  # the adapters pad files to whole pages


@pytest.mark.parametrize("where", [0, 5, 13, 21, 1000, SEG + 21 + 7, -1])
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
    first, second = frame[H:H + SEG + 16], frame[H + SEG + 16:]
    with pytest.raises(InvalidTag):
        opened(frame[:H] + second + first, len(data))  # swapped
    with pytest.raises((InvalidTag, serve.FrameError)):
        opened(frame[:H] + first, SEG)  # the second dropped, read as a one-segment frame
    other = frame_of(os.urandom(2 * SEG), iv=b"\x09" * 12)
    with pytest.raises(InvalidTag):
        opened(frame[:H] + first + other[H + SEG + 16:], len(data))  # a segment of another frame


@pytest.mark.parametrize("other", [
    {"chunk_hash": bytes(31) + b"\x01"}, {"model_name": "Qwen/Qwen2.5-7B-Instruct2"}, {"kv_rank": 0x01000101},
    {"object_group_id": 1}, {"cache_salt": "tenant-b"}], ids=lambda o: next(iter(o)))
def test_a_frame_read_under_another_name_fails(other: dict[str, Any]) -> None:
    """A file copied or renamed over another chunk's: any field of lmcache's ObjectKey differs, so
    it fails authentication (before, the associated data named only the segment: it opened)."""
    data = os.urandom(SEG + 5)
    frame = frame_of(data, Key(cache_salt="tenant-a") if "cache_salt" in other else Key())
    with pytest.raises(InvalidTag):
        opened(frame, len(data), dataclasses.replace(Key(), **other))


def test_a_frame_read_in_another_namespace_fails_and_the_binding_is_unambiguous() -> None:
    data = os.urandom(4096)
    frame = frame_of(data)
    assert opened(frame, len(data)) == data
    with pytest.raises(InvalidTag):
        opened(frame, len(data), ns="kvp-" + "b" * 32)  # copied into another namespace's folder, same key
    # Length-prefixed fields: moving bytes from one field to the next is another binding.
    a = binding(Key(model_name="ab", cache_salt="c"))
    assert a != binding(Key(model_name="a", cache_salt="bc"))
    assert binding(Key(), ns="kvp-1") != binding(Key(model_name="1" + Key().model_name), ns="kvp-")
    assert binding(Key(kv_rank=1, object_group_id=12)) != binding(Key(kv_rank=11, object_group_id=2))


def test_the_binding_covers_lmcaches_whole_object_key() -> None:
    """Every field lmcache 0.5.6's ObjectKey has is in the binding (a field lmcache adds fails
    here, so it is bound on purpose or not at all); our stand-in Key has the same fields."""
    api = pytest.importorskip("lmcache.v1.distributed.api")
    fields = [f.name for f in dataclasses.fields(api.ObjectKey)]
    assert sorted(fields) == sorted(f.name for f in dataclasses.fields(Key)) == sorted(
        ["chunk_hash", "model_name", "kv_rank", "object_group_id", "cache_salt"])
    theirs = api.ObjectKey(chunk_hash=bytes(range(32)), model_name="m/x", kv_rank=3, object_group_id=2, cache_salt="s")
    ours = Key(chunk_hash=bytes(range(32)), model_name="m/x", kv_rank=3, object_group_id=2, cache_salt="s")
    assert binding(theirs) == binding(ours)
    for name in fields:
        changed = {"chunk_hash": bytes(32), "model_name": "m/y", "kv_rank": 4, "object_group_id": 1, "cache_salt": "t"}[name]
        assert binding(dataclasses.replace(theirs, **{name: changed})) != binding(theirs), name


def test_another_key_version_or_a_short_frame_is_refused_and_only_our_own_is_removable() -> None:
    data = os.urandom(4096)
    frame = frame_of(data, Key(cache_salt="tenant-a"))
    salt_a = Key(cache_salt="tenant-a")
    with pytest.raises(serve.FrameError, match="another key") as other_key:
        opened(frame, len(data), salt_a, master=bytes(32))  # another master key: told by the header, not opened
    assert not other_key.value.removable
    with pytest.raises(InvalidTag) as bad:
        opened(frame, len(data), Key(cache_salt="tenant-b"))  # another salt, our key
    assert serve.removable(bad.value)
    with pytest.raises(serve.FrameError) as short:
        opened(frame[:-1], len(data), salt_a)
    assert short.value.removable  # ours (version 3, our fingerprint), damaged
    for version in (1, 2, 4):
        with pytest.raises(serve.FrameError, match=f"version {version}") as older:
            opened(bytes([version]) + frame[1:], len(data), salt_a)
        assert not older.value.removable
    for tiny in (b"", frame[:5], frame[:20]):
        with pytest.raises(serve.FrameError) as unknown:
            opened(tiny, len(data), salt_a)
        assert not unknown.value.removable


# Known answers: the frames of one fixed object under a fixed key, IV, name and namespace, spelled
# out from the format (docs/datapath.md) with cryptography's primitives, and pinned by digest. A
# change to the frame, the binding or the key schedule fails here: it would make every stored
# object unreadable (and, being a frame of the server's own key, removable), so it must come with
# a new L2 serde pin (api.spec.L2_SERDE, identity.CHECKED_SERDE), not silently.
KAT_PLAINTEXT = bytes(range(256)) * 40 + b"kvpersist"  # 10,249 bytes: one segment
KAT_IV = bytes.fromhex("000102030405060708090a0b")
KAT_NAME = Key(chunk_hash=bytes.fromhex("11" * 32), cache_salt="tenant-a")
KAT_DIGESTS = {"aesgcm": "6bc4190b9f1eb9bdd148b568494f41f95c46fa15290f736ac689f297cf7595eb",
               "checked": "2557fbea5ac73dfb3660e2af3b57061b31badb9335d8dd905758e8c69d218e00"}


def _spelled_out(aes_key: bytes, fingerprint: bytes) -> bytes:
    """The version 3 frame of KAT_PLAINTEXT under KAT_NAME, from the format alone."""
    import struct

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    def field(value: bytes) -> bytes:
        return struct.pack(">I", len(value)) + value

    name = KAT_NAME
    aad = (b"kvpersist-aesgcm v3 object" + field(fingerprint) + field(NS.encode()) + field(name.model_name.encode())
           + field(str(name.kv_rank).encode()) + field(str(name.object_group_id).encode()) + field(name.chunk_hash)
           + field(name.cache_salt.encode()) + struct.pack(">II", 0, 1))
    return bytes([3]) + fingerprint + KAT_IV + AESGCM(aes_key).encrypt(KAT_IV, KAT_PLAINTEXT, aad)


@pytest.mark.parametrize("mode", ["aesgcm", "checked"])
def test_the_frame_is_pinned_by_known_answers(mode: str) -> None:
    import hashlib as _h

    from cryptography.hazmat.primitives.hashes import SHA256
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    keys = serve.AeadKeys(MASTER, 32) if mode == "aesgcm" else serve.PublicKey()
    out = bytearray(serve.sealed_size(len(KAT_PLAINTEXT)))
    serve.seal(keys.aead(KAT_NAME.cache_salt), keys.fingerprint, serve.object_binding(keys.fingerprint, NS, KAT_NAME),
               KAT_IV, memoryview(KAT_PLAINTEXT), memoryview(out))
    if mode == "aesgcm":  # lmcache's key schedule: HKDF-SHA256 of the master key, info = prefix + salt
        aes_key = HKDF(algorithm=SHA256(), length=32, salt=None,
                       info=b"lmcache-l2-aesgcm-v1" + KAT_NAME.cache_salt.encode()).derive(MASTER)
        fingerprint = bytes.fromhex(key_fingerprint(MASTER))
    else:  # the public key of encryption off, for every salt
        aes_key = _h.sha256(b"kvpersist-checked: a public key, for a checksum and not a secret").digest()
        fingerprint = bytes.fromhex(key_fingerprint(aes_key))
    assert bytes(out) == _spelled_out(aes_key, fingerprint)
    assert _h.sha256(out).hexdigest() == KAT_DIGESTS[mode]


def test_checked_frames_are_bound_and_never_open_under_a_key() -> None:
    """Encryption off: the same frames under the public key. A changed byte or another name is a
    miss (InvalidTag, removable: it is this mode's frame); a checked frame in an encrypted folder,
    or an encrypted one in a checked folder, is another key's: a miss left as it is."""
    public = serve.PublicKey()
    data = os.urandom(3 * SEG + 5)
    frame = bytearray(serve.sealed_size(len(data)))
    seal_under = serve.object_binding(public.fingerprint, NS, Key())
    serve.seal(public.aead(""), public.fingerprint, seal_under, os.urandom(12), memoryview(data), memoryview(frame))

    def open_checked(raw: bytes | bytearray, name: Key = Key()) -> bytes:
        out = bytearray(len(data))
        serve.open_frame(public.aead(""), public.fingerprint, serve.object_binding(public.fingerprint, NS, name),
                         memoryview(raw), memoryview(out))
        return bytes(out)

    assert open_checked(frame) == data and data[:64] not in frame  # sealed, not plaintext on disk
    for damaged in (frame[:SEG] + bytes([frame[SEG] ^ 1]) + frame[SEG + 1:], frame[:-1]):
        with pytest.raises((InvalidTag, serve.FrameError)) as err:
            open_checked(damaged)
        assert serve.removable(err.value)
    with pytest.raises(InvalidTag):
        open_checked(frame, Key(chunk_hash=b"\x01" * 32))
    with pytest.raises(serve.FrameError, match="another key") as theirs:
        opened(bytes(frame), len(data))  # read by an encrypted namespace's server
    assert not theirs.value.removable
    with pytest.raises(serve.FrameError, match="another key"):
        open_checked(frame_of(data))


def test_an_all_zero_object_is_removable_and_nothing_else_of_no_version() -> None:
    """A file zeroed whole (the rename reached the disk, the data did not: writes are not synced) is
    nothing's data: removable in any folder, so the chunk is stored again. A zero first byte before
    other bytes may be another tool's: left as it is."""
    with pytest.raises(serve.FrameError, match="all zeros") as zeros:
        opened(bytes(serve.sealed_size(4096) + 4096), 4096)
    assert zeros.value.removable
    with pytest.raises(serve.FrameError) as other:
        opened(bytes(1) + os.urandom(serve.sealed_size(4096)), 4096)
    assert not other.value.removable


def test_the_server_refuses_a_cryptography_that_cannot_do_what_the_serde_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    assert serve.cryptography_problem() is None
    from cryptography.hazmat.primitives.ciphers import aead

    real = aead.AESGCM

    class Old:  # cryptography before 43: encrypt and decrypt, no *_into
        def __init__(self, key: bytes) -> None:
            self._aead = real(key)
            self.encrypt, self.decrypt = self._aead.encrypt, self._aead.decrypt

        @staticmethod
        def generate_key(bits: int) -> bytes:
            return real.generate_key(bits)

    monkeypatch.setattr(aead, "AESGCM", Old)
    assert "encrypt_into" in (serve.cryptography_problem() or "")

    class Leaky(Old):  # a decrypt_into that leaves what it decrypted when the tag fails
        def encrypt_into(self, nonce: bytes, data: Any, associated_data: Any, buf: Any) -> None:
            self._aead.encrypt_into(nonce, data, associated_data, buf)

        def decrypt_into(self, nonce: bytes, data: Any, associated_data: Any, buf: Any) -> None:
            try:
                self._aead.decrypt_into(nonce, data, associated_data, buf)
            except InvalidTag:
                buf[:] = b"\x01" * len(buf)
                raise

    monkeypatch.setattr(aead, "AESGCM", Leaky)
    assert serve.cryptography_problem() is None  # the serde zeroes what a failed segment left
    monkeypatch.setattr(serve, "_zero", lambda view: None)  # without that
    assert serve.cryptography_problem() == "a failed tag left bytes in the destination"


def test_the_checked_serde_needs_a_namespace_and_no_key(tmp_path: Path) -> None:
    pytest.importorskip("lmcache")
    proc = serve.make_checked_processor({"namespace_id": NS, "max_workers": 2})
    try:
        data = os.urandom(8192)
        frame = Buffer(serve.sealed_size(len(data)))
        task = proc.submit_serialize([Buffer(len(data), data)], [frame], [Key()])
        assert wait_result(proc.query_serialize_result, proc.get_serialize_event_fd(), task) is True
        out = Buffer(len(data))
        task = proc.submit_deserialize([frame], [out], [Key()])
        assert wait_result(proc.query_deserialize_result, proc.get_deserialize_event_fd(), task) is True
        assert bytes(out.raw) == data and bytes(frame.raw[1:9]) == serve.PublicKey().fingerprint
    finally:
        proc.close()
    log = tmp_path / "termination-log"
    code = "from kvpersist.inserver import serve; serve.make_checked_processor({}); print('started')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, serve.TERMINATION_LOG_ENV: str(log)})
    assert done.returncode == serve.KEY_MISMATCH_EXIT_CODE and "started" not in done.stdout
    assert log.read_text() == serve.CHECKED_SETTINGS_MISSING


def test_encryption_off_is_a_keyless_serde_pin() -> None:
    from kvpersist.identity import CHECKED_SERDE, KEYLESS_SERDES, encrypted

    assert CHECKED_SERDE in KEYLESS_SERDES and not encrypted({"l2_serde": CHECKED_SERDE}) and encrypted({"l2_serde": L2_SERDE})


def test_keys_are_lmcaches_hkdf_keys() -> None:
    lmcache = pytest.importorskip("lmcache.v1.distributed.serde.aesgcm")
    from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider

    assert lmcache._HKDF_INFO_PREFIX == serve.HKDF_INFO_PREFIX  # the contract: lmcache's own key schedule
    assert (lmcache._VERSION, lmcache._IV_LEN, lmcache._TAG_LEN) == (serve.LMCACHE_VERSION, serve.IV_LEN, serve.TAG_LEN)
    ours = serve.AeadKeys(MASTER, 32)
    theirs = HkdfKeyProvider(MASTER, key_len=32, info_prefix=serve.HKDF_INFO_PREFIX)
    for salt in ("", "tenant-a", "ünïcode"):
        assert ours.derive(salt) == theirs.get_key(salt)


def test_the_salt_keys_kept_are_bounded_and_least_recently_used_go() -> None:
    """One AES key per cache_salt: salts may be per user, so only the most recent are kept (before,
    every salt ever seen stayed in memory); one that went is derived again, the same key. The kept
    salts, least recently used first, are its _aeads'."""
    keys = serve.AeadKeys(MASTER, 32, max_salts=3)
    data = os.urandom(100)
    first = keys.aead("s0")
    sealed = first.encrypt(b"\0" * 12, data, None)
    for salt in ("s1", "s2", "s0", "s3"):  # s0 used again: s1 is the least recent
        keys.aead(salt)
    assert list(keys._aeads) == ["s2", "s0", "s3"]
    for i in range(1000):
        keys.aead(f"user-{i}")
    assert len(list(keys._aeads)) == 3
    again = keys.aead("s0")
    assert again is not first and again.decrypt(b"\0" * 12, sealed, None) == data
    assert list(serve.AeadKeys(MASTER, 32)._aeads) == [] and serve.MAX_SALT_KEYS == 256
    default = serve.AeadKeys(MASTER, 32)
    for i in range(serve.MAX_SALT_KEYS + 50):
        default.aead(f"user-{i}")
    assert len(list(default._aeads)) == serve.MAX_SALT_KEYS


def test_lmcaches_frames_and_ours_are_misses_to_each_other() -> None:
    """What lmcache's own aesgcm serializer wrote (version 1: no name bound) is refused by ours and
    never removable; ours is refused by lmcache's deserializer: a miss both ways, never wrong bytes."""
    lmcache = pytest.importorskip("lmcache.v1.distributed.serde.aesgcm")
    from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider

    provider = HkdfKeyProvider(MASTER, key_len=32, info_prefix=serve.HKDF_INFO_PREFIX)
    data = os.urandom(3 * 4096)
    theirs = Buffer(len(data) + 1 + serve.IV_LEN + serve.TAG_LEN)
    lmcache.AesGcmSerializer(provider).serialize(Buffer(len(data), data), theirs, Key(cache_salt="s"))
    assert theirs.raw[0] == serve.LMCACHE_VERSION
    with pytest.raises(serve.FrameError, match="version 1") as refused:
        opened(theirs.raw + bytes(4096), len(data), Key(cache_salt="s"))
    assert not refused.value.removable
    out = Buffer(len(data))
    with pytest.raises(ValueError, match="unknown version"):
        lmcache.AesGcmDeserializer(provider).deserialize(Buffer(0, frame_of(data, Key(cache_salt="s"))), out, Key(cache_salt="s"))
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


def settings(key_file: Path, **more: Any) -> dict[str, object]:
    """The serde settings as builders.lmcache.l2_serde renders them, for this key file."""
    return {"master_key_path": str(key_file), "aes_bits": 256, "max_workers": 3, "namespace_id": NS,
            "key_fingerprint": key_fingerprint(key_file.read_bytes()), **more}


def test_the_processor_seals_and_opens_batches_all_or_nothing(tmp_path: Path) -> None:
    pytest.importorskip("lmcache")
    from lmcache.v1.distributed.serde.base import SerdeProcessor

    key_file = tmp_path / "master.key"
    key_file.write_bytes(MASTER)
    proc = serve.make_processor(settings(key_file))
    assert isinstance(proc, SerdeProcessor)
    try:
        chunks = [os.urandom(16384) for _ in range(4)] + [os.urandom(2 * serve.SEGMENT_BYTES + 99)]  # one of 3 segments
        names = [Key(chunk_hash=bytes([i]) * 32) for i in range(len(chunks))]
        frames = [Buffer(serve.sealed_size(len(c)) + 4096) for c in chunks]  # oversized, as L1 temps are
        task = proc.submit_serialize([Buffer(len(c), c) for c in chunks], frames, names)
        assert wait_result(proc.query_serialize_result, proc.get_serialize_event_fd(), task) is True
        assert proc.query_serialize_result(task) is None  # reported once
        assert all(f.used == serve.sealed_size(len(c)) for f, c in zip(frames, chunks, strict=True))
        assert len({bytes(f.raw[9:21]) for f in frames}) == len(frames)  # a fresh IV for each object
        assert all(bytes(f.raw[1:9]) == bytes.fromhex(key_fingerprint(MASTER)) for f in frames)
        assert all(opened(f.raw, len(c), k) == c for f, c, k in zip(frames, chunks, names, strict=True))  # bound as rendered

        outs = [Buffer(len(c)) for c in chunks]
        task = proc.submit_deserialize(frames, outs, names)
        assert wait_result(proc.query_deserialize_result, proc.get_deserialize_event_fd(), task) is True
        assert [bytes(o.raw) for o in outs] == chunks

        frames[3].raw[500] ^= 0x80  # one bad object fails the whole batch: every key in it is a miss
        task = proc.submit_deserialize(frames, [Buffer(len(c)) for c in chunks], names)
        assert wait_result(proc.query_deserialize_result, proc.get_deserialize_event_fd(), task) is False
        frames[3].raw[500] ^= 0x80
        swapped = [names[1], names[0], *names[2:]]  # two objects each read under the other's name
        task = proc.submit_deserialize(frames, [Buffer(len(c)) for c in chunks], swapped)
        assert wait_result(proc.query_deserialize_result, proc.get_deserialize_event_fd(), task) is False
        assert proc.estimate_serialized_size(type("L", (), {"shapes": [(2, 3)], "dtypes": [type("D", (), {"itemsize": 2})]})) \
            == 12 + serve.HEADER_LEN + serve.TAG_LEN
    finally:
        proc.close()


def test_only_a_frame_of_the_servers_own_key_is_handed_to_the_removal(tmp_path: Path) -> None:
    """The removal deletes what fails: only a version 3 frame under this server's key fingerprint
    (damaged, or another name's) may reach it. A frame of another key, an older version or one too
    short to tell is a miss left as it is (before, every failure was handed to the removal)."""
    pytest.importorskip("lmcache")
    key_file = tmp_path / "master.key"
    key_file.write_bytes(MASTER)
    proc = serve.make_processor(settings(key_file))
    handed: list[Any] = []
    proc.on_unreadable = handed.extend
    data = os.urandom(8192)
    mine = frame_of(data)
    cases = {
        "another key": (frame_of(data, master=os.urandom(32)), False),
        "version 2": (bytes([2]) + mine[1:], False),
        "version 1": (bytes([1]) + mine[1:], False),
        "too short to tell": (mine[:serve.HEADER_LEN - 1], False),
        "empty": (b"", False),
        "ours, damaged": (mine[:100] + bytes([mine[100] ^ 1]) + mine[101:], True),
        "ours, truncated": (mine[:-1], True),
        "ours, another name": (frame_of(data, Key(chunk_hash=b"\x05" * 32)), True),
        "ours, another namespace": (frame_of(data, ns="kvp-" + "b" * 32), True),
    }
    try:
        for what, (frame, removed) in cases.items():
            handed.clear()
            key = Key()  # every frame read under the name `mine` was sealed for
            out = Buffer(len(data))
            task = proc.submit_deserialize([Buffer(0, frame)], [out], [key])
            assert wait_result(proc.query_deserialize_result, proc.get_deserialize_event_fd(), task) is False, what
            assert handed == ([key] if removed else []), what
            assert bytes(out.raw) == bytes(len(data)), what  # nothing unauthenticated left in the destination
    finally:
        proc.close()


def _processor_exit(tmp_path: Path, key: bytes, extra: dict[str, object]) -> tuple[int, str, str]:
    """make_processor in a process of its own (it ends the process): exit code, termination message, stderr."""
    key_file = tmp_path / "master.key"
    key_file.write_bytes(key)
    log = tmp_path / "termination-log"
    log.unlink(missing_ok=True)
    code = ("import json, sys; from kvpersist.inserver import serve; "
            "serve.make_processor(json.loads(sys.argv[1])); print('started')")
    import json

    done = subprocess.run([sys.executable, "-c", code, json.dumps({**settings(key_file), **extra})], capture_output=True,
                          text=True, timeout=120, env={**os.environ, serve.TERMINATION_LOG_ENV: str(log)})
    return done.returncode, log.read_text() if log.exists() else "", done.stdout + done.stderr


def test_a_key_file_of_another_fingerprint_stops_the_server_before_anything_is_read(tmp_path: Path) -> None:
    """The fingerprint the id was computed with, against the key file mounted now (a Secret's bytes
    rotated before the pod was rolled): exit 78 and exactly this termination message (the operator
    parses it). Before, the server started and removed every object it could not open."""
    pytest.importorskip("lmcache")
    expected = key_fingerprint(MASTER)
    other = os.urandom(32)
    code, message, out = _processor_exit(tmp_path, other, {"key_fingerprint": expected})
    assert code == serve.KEY_MISMATCH_EXIT_CODE == 78, out
    assert message == (f"kvpersist-aesgcm key mismatch: key file fingerprint {key_fingerprint(other)}, namespace {NS} "
                       f"expects {expected}: refusing to start (no object is read or removed)")
    assert message.startswith(serve.KEY_MISMATCH_PREFIX) and message in out and "started" not in out
    code, message, out = _processor_exit(tmp_path, other, {"key_fingerprint": None})
    assert (code, message) == (78, serve.SETTINGS_MISSING), out
    code, message, out = _processor_exit(tmp_path, other, {"namespace_id": ""})
    assert (code, message) == (78, serve.SETTINGS_MISSING), out
    code, message, out = _processor_exit(tmp_path, MASTER, {"key_fingerprint": expected.upper()})
    assert (code, message) == (0, "") and "started" in out, out


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
    """What the server container runs: the module's own source (SERVE_ENV) with the one it imports
    (kvpersist.inserver.program_source; each module's imports: test_lmcache_internals), nothing
    the kubelet would expand, and lmcache's own CLI, in a python where kvpersist is not importable."""
    source = program_source()
    assert repr(Path(serve.__file__).read_text()) in source
    env = {e["name"]: e.get("value") for e in server_container(target())["env"]}
    assert env[SERVE_ENV] == source
    assert "$(" not in source  # the kubelet expands $(VAR) in env values
    pytest.importorskip("lmcache")
    done = subprocess.run([sys.executable, "-I", "-c", source, "server", "--help"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
    assert done.returncode == 0 and "--l2-adapter" in done.stdout, done.stderr[-2000:]
