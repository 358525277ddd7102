"""The lmcache server as the operator runs it: kvpersist's L2 serde registered, then lmcache's own
entry point (`lmcache server ...`) in the same process.

Why a serde of our own: lmcache 0.5.6's `aesgcm` serde copies each whole chunk three times around
one AES-GCM call (`bytes(src.byte_array)`, a new plaintext or ciphertext, a copy into the
destination) and works through a batch one chunk at a time, so an encrypted L2 read ran at a
fifth of the disk (benchmarks/RESULTS.md). This one seals with no copy (`AESGCM.encrypt_into` /
`decrypt_into` straight between the two buffers lmcache hands it), in segments of 2 MiB spread
over a thread pool (cryptography releases the GIL), and the wrapper below loads a request's chunks
one by one, so each is opened while the next ones are still being read.

The keys are lmcache's own (one AES key per cache_salt by HKDF-SHA256 from the master key file,
lmcache's info prefix) and so is the header (`[1 version][12 IV]`). Version 2 frames (ours) are
segmented; version 1 frames (lmcache's `[ciphertext][16 tag]` after the header) still open, so
data lmcache's aesgcm wrote stays readable (tests/integration/test_l2_serde.py); lmcache's serde
refuses ours (a miss, never wrong bytes). The namespace id moved anyway with this version
(identity schema 3: the L1 page and the key's fingerprint), so no old object meets this serde
through the operator.

An object that fails authentication is removed from L2 (the adapter's own delete), so the prefix
is stored again on its next computation. lmcache 0.5.6 otherwise keeps such an object: its index
(or, for fs, the file itself) says the key is stored, so every store of it is skipped and the
prefix stays a miss forever. In a namespace folder every object was written under the folder's
key (the namespace id carries the key's fingerprint), so one that fails is damaged, never
another key's data. The removal needs the adapter, which the serde is not given: the storage
manager's SerdeL2AdapterWrapper is replaced by a subclass that only wires the two together.

lmcache offers `register_serde_factory`, but its `--server-module` hook loads after the storage
manager (and so the L2 adapters and their serdes) is built: too late. Hence this launcher, run as
`python3 -c "$KVPERSIST_LMCACHE_SERVE" server ...`. Standard library, lmcache and cryptography
only: the server image has no kvpersist. Nothing here may contain a dollar sign followed by an
opening parenthesis (the kubelet would expand it in the variable's value).
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

SERDE_TYPE = "kvpersist-aesgcm"
# lmcache 0.5.6's aesgcm frame (version 1) and key schedule (lmcache/v1/distributed/serde/aesgcm.py):
# `[1][12 IV][ciphertext][16 tag]`, one AES key per cache_salt by HKDF-SHA256 with this info prefix.
VERSION = 1
IV_LEN = 12
TAG_LEN = 16
HEADER_LEN = 1 + IV_LEN
FRAME_OVERHEAD = HEADER_LEN + TAG_LEN
HKDF_INFO_PREFIX = b"lmcache-l2-aesgcm-v1"
# Ours (version 2): the same header and keys, the chunk sealed in segments of SEGMENT_BYTES, each
# its own GCM message (`[ciphertext][16 tag]` per segment), so one chunk opens on several cores at
# once: with one GCM message per chunk the last chunk of a read was opened on one core after the
# reads were done (benchmarks/RESULTS.md). Segment i's nonce is the frame's random IV plus i in
# its last 32 bits, and its associated data names i and the count, so segments cannot be
# swapped, dropped or moved between frames. Version 1 frames (lmcache's) still open.
VERSION_SEGMENTED = 2
SEGMENT_BYTES = 2 * 2**20
SEGMENT_AAD = b"kvpersist-aesgcm v2 segment"
DEFAULT_WORKERS = 4


class FrameError(ValueError):
    """A stored object that is not one of our frames (short, or another version): a miss."""


def _bytes_view(buffer: Any) -> memoryview:
    """A writable flat byte view of a MemoryObj's byte_array (a ctypes-backed `<B` memoryview,
    which does not take slice assignment until cast)."""
    return memoryview(buffer).cast("B")


def segment_count(n: int) -> int:
    return max(1, -(-n // SEGMENT_BYTES))


def sealed_size(n: int) -> int:
    """The frame of n plaintext bytes: header, the ciphertext, a tag per segment."""
    return HEADER_LEN + n + TAG_LEN * segment_count(n)


def _nonce(iv: bytes, i: int) -> bytes:
    return iv[:8] + ((int.from_bytes(iv[8:], "big") + i) % 2**32).to_bytes(4, "big")


def _aad(i: int, count: int) -> bytes:
    return SEGMENT_AAD + struct.pack(">II", i, count)


def seal_jobs(aead: Any, iv: bytes, plaintext: memoryview, out: memoryview) -> tuple[int, list[Callable[[], None]]]:
    """Writes the header of plaintext's frame into out and returns the frame's length and one job
    per segment, each sealing its segment in place (no copy): they may run side by side."""
    n, count = len(plaintext), segment_count(len(plaintext))
    if len(iv) != IV_LEN or len(out) < sealed_size(n):
        raise ValueError("seal: the IV or the destination has the wrong size")
    out[0] = VERSION_SEGMENTED
    out[1:HEADER_LEN] = iv

    def job(i: int) -> Callable[[], None]:
        lo, hi = i * SEGMENT_BYTES, min(n, (i + 1) * SEGMENT_BYTES)
        at = HEADER_LEN + lo + i * TAG_LEN
        return lambda: aead.encrypt_into(_nonce(iv, i), plaintext[lo:hi], _aad(i, count), out[at:at + hi - lo + TAG_LEN])

    return sealed_size(n), [job(i) for i in range(count)]


def open_jobs(aead: Any, frame: memoryview, out: memoryview) -> list[Callable[[], None]]:
    """The jobs that authenticate and decrypt a frame into out, whose length is the plaintext's
    (the frame may be padded, as the adapters store whole pages): one per segment of ours, one for
    lmcache's version 1. Raises FrameError now for a short frame or an unknown version; a job
    raises cryptography's InvalidTag for any changed byte or another key, and the caller then
    reports the object as not loaded, so nothing written into out is served."""
    n = len(out)
    version = frame[0] if len(frame) else None
    if version == VERSION and len(frame) >= HEADER_LEN + n + TAG_LEN:
        iv = bytes(frame[1:HEADER_LEN])
        return [lambda: aead.decrypt_into(iv, frame[HEADER_LEN:HEADER_LEN + n + TAG_LEN], None, out)]
    if version != VERSION_SEGMENTED or len(frame) < sealed_size(n):
        raise FrameError("kvpersist-aesgcm: malformed frame or unknown version")
    iv, count = bytes(frame[1:HEADER_LEN]), segment_count(n)

    def job(i: int) -> Callable[[], None]:
        lo, hi = i * SEGMENT_BYTES, min(n, (i + 1) * SEGMENT_BYTES)
        at = HEADER_LEN + lo + i * TAG_LEN
        return lambda: aead.decrypt_into(_nonce(iv, i), frame[at:at + hi - lo + TAG_LEN], _aad(i, count), out[lo:hi])

    return [job(i) for i in range(count)]


def seal(aead: Any, iv: bytes, plaintext: memoryview, out: memoryview) -> int:
    """seal_jobs, run here one after the other; the frame's length."""
    n, jobs = seal_jobs(aead, iv, plaintext, out)
    for run in jobs:
        run()
    return n


def open_frame(aead: Any, frame: memoryview, out: memoryview) -> None:
    """open_jobs, run here one after the other."""
    for run in open_jobs(aead, frame, out):
        run()


def _raise(exc: BaseException) -> None:
    raise exc


def plaintext_bytes(shapes: Any, dtypes: Any) -> int:
    """The bytes of a chunk's tensors (torch dtypes know their item size): sealed_size of these
    is the frame's."""
    total = 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        count = 1
        for dim in shape:
            count *= int(dim)
        total += count * int(dtype.itemsize)
    return total


class AeadKeys:
    """One AESGCM object per cache_salt, its key derived from the master key as lmcache does."""

    def __init__(self, master_key: bytes, key_len: int) -> None:
        if len(master_key) == 0:
            raise ValueError("kvpersist-aesgcm: the master key file is empty")
        self._master_key = master_key
        self._key_len = key_len
        self._aeads: dict[str, Any] = {}
        self._lock = threading.Lock()

    def derive(self, cache_salt: str) -> bytes:
        from cryptography.hazmat.primitives.hashes import SHA256
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        return HKDF(algorithm=SHA256(), length=self._key_len, salt=None,
                    info=HKDF_INFO_PREFIX + cache_salt.encode("utf-8")).derive(self._master_key)

    def aead(self, cache_salt: str) -> Any:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        with self._lock:
            found = self._aeads.get(cache_salt)
            if found is None:
                found = self._aeads[cache_salt] = AESGCM(self.derive(cache_salt))
            return found


class ObjectBatches:
    """Runs the objects of each submitted batch side by side on a thread pool and reports each
    batch once, when its last object is done: all or nothing, as lmcache's serde contract has it
    (one failed object fails the batch, so every key in it is a miss)."""

    def __init__(self, workers: int, on_done: Callable[[int, bool, bool], None]) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="kvpersist-serde")
        self._on_done = on_done
        self._lock = threading.Lock()

    def run(self, task_id: int, sealing: bool, jobs: list[Callable[[], None]]) -> None:
        if not jobs:
            self._on_done(task_id, sealing, True)
            return
        state = {"left": len(jobs), "ok": True}

        def one(job: Callable[[], None]) -> None:
            ok = True
            try:
                job()
            except Exception as exc:  # a failed object is a miss, never a dead worker
                ok = False
                with contextlib.suppress(Exception):  # nor a batch never reported: lmcache would wait on it
                    _log_failure(task_id, sealing, exc)
            with self._lock:
                state["ok"] = state["ok"] and ok
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                self._on_done(task_id, sealing, bool(state["ok"]))

        for job in jobs:
            self._pool.submit(one, job)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _log_failure(task_id: int, sealing: bool, exc: BaseException) -> None:
    _logger().warning("kvpersist-aesgcm: %s of an object in task %d failed (%s): the batch is a miss",
                                  "sealing" if sealing else "opening", task_id, type(exc).__name__)


def make_processor(kwargs: dict[str, object]) -> Any:
    """The serde factory lmcache calls with the adapter's `serde` settings: master_key_path,
    aes_bits (128 or 256) and max_workers. Fails (and the server with it) without a key file."""
    aes_bits = int(kwargs.get("aes_bits", 256))  # type: ignore[call-overload]
    if aes_bits not in (128, 256):
        raise ValueError(f"kvpersist-aesgcm: aes_bits must be 128 or 256, not {aes_bits}")
    path = str(kwargs.get("master_key_path") or "")
    if not path:
        raise ValueError("kvpersist-aesgcm: master_key_path is required")
    with open(path, "rb") as f:
        keys = AeadKeys(f.read(), aes_bits // 8)
    workers = int(kwargs.get("max_workers", DEFAULT_WORKERS))  # type: ignore[call-overload]
    _logger().info("kvpersist-aesgcm: AES-%d-GCM, frames of 2 MiB segments (lmcache's open too), %d workers", aes_bits, workers)
    return _processor_class()(keys, workers)


_PROCESSOR: list[type] = []


def _processor_class() -> type:
    """ParallelAesGcm, made on first use: its base is lmcache's, which the operator (importing
    this module for SERDE_TYPE) does not have."""
    if _PROCESSOR:
        return _PROCESSOR[0]
    from lmcache.v1.distributed.serde.base import SerdeProcessor
    from lmcache.v1.platform import create_event_notifier

    class ParallelAesGcm(SerdeProcessor):
        """lmcache's SerdeProcessor contract (submit, eventfd, each result queried once) over
        ObjectBatches: every chunk of a batch sealed or opened on its own worker."""

        def __init__(self, keys: AeadKeys, workers: int) -> None:
            self._keys = keys
            self._efds = {True: create_event_notifier(), False: create_event_notifier()}
            self._done: dict[bool, dict[int, bool]] = {True: {}, False: {}}
            self._lock = threading.Lock()
            self._next = 0
            self._batches = ObjectBatches(workers, self._finish)
            # Told of each object that failed authentication (UnreadableObjects.add), when wired.
            self.on_unreadable: Callable[[list], None] | None = None

        def _finish(self, task_id: int, sealing: bool, ok: bool) -> None:
            with self._lock:
                self._done[sealing][task_id] = ok
            with contextlib.suppress(OSError, ValueError):  # closed at shutdown
                self._efds[sealing].notify()

        def _task_id(self) -> int:
            with self._lock:
                self._next += 1
                return self._next

        def _seal_jobs(self, src: Any, dst: Any, key: Any) -> list[Callable[[], None]]:
            n, jobs = seal_jobs(self._keys.aead(key.cache_salt), os.urandom(IV_LEN), _bytes_view(src.byte_array),
                                _bytes_view(dst.byte_array))
            if hasattr(dst, "set_used_size"):
                dst.set_used_size(n)  # the adapter stores exactly the frame
            return jobs

        def _open_jobs(self, src: Any, dst: Any, key: Any) -> list[Callable[[], None]]:
            from cryptography.exceptions import InvalidTag

            def unreadable(run: Callable[[], None]) -> Callable[[], None]:
                def checked() -> None:
                    try:
                        run()
                    except (InvalidTag, FrameError):
                        if self.on_unreadable is not None:
                            self.on_unreadable([key])
                        raise
                return checked

            try:
                jobs = open_jobs(self._keys.aead(key.cache_salt), _bytes_view(src.byte_array), _bytes_view(dst.byte_array))
            except FrameError as exc:
                jobs = [functools.partial(_raise, exc)]
            return [unreadable(run) for run in jobs]

        def _submit(self, sealing: bool, src_objs: list, dst_objs: list, keys: list) -> int:
            """One job per segment of every object: the batch's work spread over the workers."""
            task_id = self._task_id()
            make = self._seal_jobs if sealing else self._open_jobs
            jobs: list[Callable[[], None]] = []
            for s, d, k in zip(src_objs, dst_objs, keys, strict=True):
                try:
                    jobs += make(s, d, k)
                except Exception as exc:  # e.g. a destination too small: this batch fails, not the server
                    jobs.append(functools.partial(_raise, exc))
            self._batches.run(task_id, sealing, jobs)
            return task_id

        def get_serialize_event_fd(self) -> int:
            return self._efds[True].fileno()

        def get_deserialize_event_fd(self) -> int:
            return self._efds[False].fileno()

        def submit_serialize(self, src_objs: list, dst_objs: list, keys: list) -> int:
            return self._submit(True, src_objs, dst_objs, keys)

        def submit_deserialize(self, src_objs: list, dst_objs: list, keys: list) -> int:
            return self._submit(False, src_objs, dst_objs, keys)

        def query_serialize_result(self, task_id: int) -> bool | None:
            with self._lock:
                return self._done[True].pop(task_id, None)

        def query_deserialize_result(self, task_id: int) -> bool | None:
            with self._lock:
                return self._done[False].pop(task_id, None)

        def estimate_serialized_size(self, layout_desc: Any) -> int:
            return sealed_size(plaintext_bytes(layout_desc.shapes, layout_desc.dtypes))

        def close(self) -> None:
            self._batches.close()
            for efd in self._efds.values():
                efd.close()

    _PROCESSOR.append(ParallelAesGcm)
    return ParallelAesGcm


class UnreadableObjects:
    """Removes objects that failed authentication from their adapter, so they can be stored again.

    The adapter skips a delete of a key that is still pinned (the prefetch that found it unlocks
    it right after the failed load), so each key is asked again every RETRY_S until the adapter
    reports it deleted (through its listener), for at most GIVE_UP_S."""

    RETRY_S = 0.2
    GIVE_UP_S = 30.0

    def __init__(self, adapter: Any) -> None:
        self._adapter = adapter
        self._pending: dict[Any, float] = {}  # key -> when it failed
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvpersist-unreadable", daemon=True)
        self._thread.start()

    def add(self, keys: list) -> None:
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._pending.setdefault(key, now)
        self._wake.set()

    def deleted(self, keys: list) -> None:
        with self._lock:
            for key in keys:
                self._pending.pop(key, None)

    def pending(self) -> list:
        with self._lock:
            return list(self._pending)

    def _loop(self) -> None:
        log = _logger()
        while True:
            self._wake.wait(self.RETRY_S)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                expired = [k for k, t in self._pending.items() if now - t > self.GIVE_UP_S]
                for key in expired:
                    del self._pending[key]
                keys = list(self._pending)
            for key in expired:
                log.warning("kvpersist-aesgcm: could not remove an unreadable object in %.0f s (still in use); it stays a "
                            "miss: %s", self.GIVE_UP_S, key)
            if keys:
                try:
                    self._adapter.delete(keys)
                except Exception as exc:  # the thread must outlive any one attempt
                    log.warning("kvpersist-aesgcm: removing %d unreadable objects failed (%s); retrying", len(keys), exc)


class ChunkLoads:
    """One load of n chunks as n loads of one, answered as one: its id (from a range of its own)
    is done when every chunk's load is, and its bitmap has chunk i's bit from load i. Each chunk
    still goes through lmcache's own wrapper (temp buffer, inner load, our serde), only sooner."""

    FIRST_ID = 1 << 48  # above any id lmcache's wrapper hands out

    def __init__(self, submit_one: Callable[[list, list], int], query_one: Callable[[int], Any],
                 bitmap: Callable[[int], Any]) -> None:
        self._submit_one, self._query_one, self._bitmap = submit_one, query_one, bitmap
        self._loads: dict[int, tuple[list[int], dict[int, bool]]] = {}  # id -> (chunk loads, their results)
        self._lock = threading.Lock()
        self._next = self.FIRST_ID

    def submit(self, keys: list, objects: list) -> int:
        loads = [self._submit_one([k], [o]) for k, o in zip(keys, objects, strict=True)]
        with self._lock:
            task_id, self._next = self._next, self._next + 1
            self._loads[task_id] = (loads, {})
        return task_id

    def owns(self, task_id: int) -> bool:
        with self._lock:
            return task_id in self._loads

    def query(self, task_id: int) -> Any:
        """The whole load's bitmap once every chunk's load has answered, else None (each
        answer is taken once and kept here, as lmcache's results are popped when read)."""
        with self._lock:
            loads, results = self._loads[task_id]
            for i, one in enumerate(loads):
                if i not in results:
                    got = self._query_one(one)
                    if got is not None:
                        results[i] = bool(got.test(0))
            if len(results) < len(loads):
                return None
            del self._loads[task_id]
        bitmap = self._bitmap(len(loads))
        for i, ok in results.items():
            if ok:
                bitmap.set(i)
        return bitmap


_LOGGER: list[Any] = []


def _logger() -> Any:
    """lmcache's logger (its format, level and handler), made once: init_logger resets handlers."""
    if not _LOGGER:
        try:
            from lmcache.logging import init_logger
        except ImportError:  # outside a server (the unit tests' lowest versions): the standard logger
            import logging

            _LOGGER.append(logging.getLogger("kvpersist.inserver.serve"))
        else:
            _LOGGER.append(init_logger("kvpersist.inserver.serve"))
    return _LOGGER[0]


def install_unreadable_removal() -> bool:
    """Replaces the storage manager's SerdeL2AdapterWrapper by a subclass that hands our serde
    the inner adapter's delete (UnreadableObjects); other serdes are left alone. False, and
    unreadable objects stay misses as in lmcache, where lmcache no longer has that name."""
    from lmcache.lmcache_native import Bitmap
    from lmcache.v1.distributed import storage_manager
    from lmcache.v1.distributed.internal_api import L2AdapterListener

    base = getattr(storage_manager, "SerdeL2AdapterWrapper", None)
    if base is None or getattr(base, "kvpersist_wired", False):
        if base is None:
            _logger().warning("kvpersist-aesgcm: lmcache has no SerdeL2AdapterWrapper; unreadable L2 objects are not removed")
        return base is not None

    class Deletions(L2AdapterListener):
        """The adapter's word that keys are gone (evicted, or removed by us)."""

        def __init__(self, unreadable: UnreadableObjects) -> None:
            self._unreadable = unreadable

        def on_l2_keys_stored(self, keys: list, sizes: list) -> None:
            pass

        def on_l2_keys_accessed(self, keys: list) -> None:
            pass

        def on_l2_keys_deleted(self, keys: list) -> None:
            self._unreadable.deleted(keys)

    class WiredSerdeL2AdapterWrapper(base):  # type: ignore[misc, valid-type]
        """lmcache's wrapper, with two additions for our serde only: unreadable objects are
        removed (UnreadableObjects), and a load of several chunks runs as one load per chunk
        (ChunkLoads), so each chunk is opened as soon as it is read while the next ones are still
        being read: the decryption overlaps the reads instead of following them."""

        kvpersist_wired = True

        def __init__(self, inner: Any, serde: Any, l1_manager: Any) -> None:
            super().__init__(inner=inner, serde=serde, l1_manager=l1_manager)
            self.kvpersist_chunks: ChunkLoads | None = None
            if hasattr(serde, "on_unreadable"):
                unreadable = UnreadableObjects(inner)
                inner.register_listener(Deletions(unreadable))
                serde.on_unreadable = unreadable.add
                self.kvpersist_unreadable = unreadable
                self.kvpersist_chunks = ChunkLoads(super().submit_load_task, super().query_load_result, Bitmap)
                _logger().info("kvpersist-aesgcm: wired into the L2 wrapper: one load per chunk, unreadable objects removed")

        def submit_load_task(self, keys: list, objects: list) -> int:
            if self.kvpersist_chunks is None or len(keys) < 2:
                return super().submit_load_task(keys, objects)
            return self.kvpersist_chunks.submit(keys, objects)

        def query_load_result(self, task_id: int) -> Any:
            if self.kvpersist_chunks is None or not self.kvpersist_chunks.owns(task_id):
                return super().query_load_result(task_id)
            return self.kvpersist_chunks.query(task_id)

    storage_manager.SerdeL2AdapterWrapper = WiredSerdeL2AdapterWrapper
    return True


def register() -> None:
    """Makes `"serde": {"type": "kvpersist-aesgcm", ...}` known to lmcache, once per process, and
    wires unreadable objects' removal."""
    from lmcache.v1.distributed.serde import get_registered_serde_types, register_serde_factory

    if SERDE_TYPE not in get_registered_serde_types():
        register_serde_factory(SERDE_TYPE, make_processor)
    install_unreadable_removal()


def main(argv: list[str]) -> int:
    register()
    from lmcache.cli.main import main as lmcache_main

    sys.argv = ["lmcache", *argv]
    return int(lmcache_main() or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
