"""The lmcache server as the operator runs it: kvpersist's L2 serdes registered, then lmcache's own
entry point in the same process (its `--server-module` loads after the L2 serdes are built). Our own
serde seals with no copy in 2 MiB segments over a thread pool, each bound to the object's whole name,
and the replaced SerdeL2AdapterWrapper loads chunks one by one and removes what is unreadable.
The frame, the key checks and the measurements: docs/datapath.md. lmcache is reached only through
lmcache_internals, which main checks first.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import hashlib
import hmac
import math
import os
import re
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

from kvpersist.inserver import lmcache_internals

SERDE_TYPE = "kvpersist-aesgcm"
# lmcache 0.5.6's aesgcm: its frame `[1][12 IV][ciphertext][16 tag]` (version 1, refused here) and
# its key schedule (ours too): one AES key per cache_salt by HKDF-SHA256 with this info prefix.
LMCACHE_VERSION = 1
IV_LEN = 12
TAG_LEN = 16
HKDF_INFO_PREFIX = b"lmcache-l2-aesgcm-v1"
# Ours: segments of SEGMENT_BYTES, each its own GCM message, so one chunk opens on several cores.
# Segment i's nonce is the frame's IV plus i in its last 32 bits; its associated data is the
# object's binding then i and the count, so segments cannot be swapped, dropped or moved between
# frames, nor frames between names.
VERSION = 3
FINGERPRINT_LEN = 8
HEADER_LEN = 1 + FINGERPRINT_LEN + IV_LEN
SEGMENT_BYTES = 2 * 2**20
BINDING_LABEL = b"kvpersist-aesgcm v3 object"
# Encryption off: the same frames under a public key, a checksum bound to the object's name, not a
# secret (anyone who may write the folder can forge one). AES-GCM rather than a GMAC over the
# plaintext: opening is one pass, where checking then copying out of lmcache's buffer is two.
CHECKED_TYPE = "kvpersist-checked"
CHECKED_KEY = hashlib.sha256(b"kvpersist-checked: a public key, for a checksum and not a secret").digest()
DEFAULT_WORKERS = 4
MAX_SALT_KEYS = 256  # derived AES keys kept, least recently used out first: salts may be per user
KEY_FINGERPRINT_MESSAGE = b"kvpersist l2 key fingerprint v1"
FINGERPRINT_RE = re.compile(r"[0-9a-f]{16}")
# A key file other than the namespace id's: this termination message (the operator reads it back)
# and exit code (EX_CONFIG, as builders.buildcheck). The file: TERMINATION_LOG_ENV, else the kubelet's.
KEY_MISMATCH_PREFIX = "kvpersist-aesgcm key mismatch: "
KEY_MISMATCH_FORMAT = (KEY_MISMATCH_PREFIX + "key file fingerprint {found}, namespace {namespace} expects {expected}: "
                       "refusing to start (no object is read or removed)")
KEY_MISMATCH_EXIT_CODE = lmcache_internals.EXIT_CODE
CHECKED_SETTINGS_MISSING = ("kvpersist-checked: the serde settings name no namespace id (namespace_id) to bind the "
                            "frames to: refusing to start (no object is read or removed)")
SETTINGS_MISSING = ("kvpersist-aesgcm: the serde settings name no key fingerprint or namespace id to check the key "
                    "file against (key_fingerprint, namespace_id): refusing to start (no object is read or removed)")
TERMINATION_LOG_ENV = "KVPERSIST_TERMINATION_LOG"
TERMINATION_LOG = "/dev/termination-log"


class FrameError(ValueError):
    """A stored object that is not a frame this server can open (a miss). removable: a version 3
    frame of this key that cannot be this object, or all zeros; any other stays."""

    def __init__(self, message: str, removable: bool = False) -> None:
        super().__init__(message)
        self.removable = removable


def key_fingerprint(key: bytes) -> str:
    """kvpersist.identity.key_fingerprint (the namespace id's), here: the server's image has no kvpersist."""
    return hmac.new(key, KEY_FINGERPRINT_MESSAGE, hashlib.sha256).hexdigest()[:16]


def _bytes_view(buffer: Any) -> memoryview:
    """A MemoryObj's byte_array as flat bytes (its `<B` view takes no slice assignment uncast)."""
    return memoryview(buffer).cast("B")


def segment_count(n: int) -> int:
    return max(1, -(-n // SEGMENT_BYTES))


def sealed_size(n: int) -> int:
    return HEADER_LEN + n + TAG_LEN * segment_count(n)


def _nonce(iv: bytes, i: int) -> bytes:
    return iv[:8] + ((int.from_bytes(iv[8:], "big") + i) % 2**32).to_bytes(4, "big")


def object_binding(fingerprint: bytes, namespace_id: str, key: Any) -> bytes:
    """What every segment's associated data of key's frame starts with: the label, then the key's
    fingerprint, the namespace id and each field of lmcache's ObjectKey, each length-prefixed
    (integers in decimal), so no two names give the same bytes."""
    fields = (fingerprint, namespace_id.encode("utf-8"), str(key.model_name).encode("utf-8"),
              str(int(key.kv_rank)).encode("ascii"), str(int(key.object_group_id)).encode("ascii"),
              bytes(key.chunk_hash), str(key.cache_salt).encode("utf-8"))
    return BINDING_LABEL + b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _zero(view: memoryview) -> None:
    """Zeroes view with the GIL released where it can (a ctypes call), else under it."""
    with contextlib.suppress(TypeError):
        ctypes.memset(ctypes.addressof((ctypes.c_char * len(view)).from_buffer(view)), 0, len(view))
        return
    view[:] = bytes(len(view))


def _open_segment(aead: Any, nonce: bytes, sealed: memoryview, aad: bytes, out: memoryview) -> None:
    """One segment out of a frame into out. On a failed tag out holds no byte of it: AES-GCM
    decrypts before it checks the tag (cryptography 51 clears it itself; older ones need not)."""
    try:
        aead.decrypt_into(nonce, sealed, aad, out)
    except BaseException:
        _zero(out)
        raise


def _segment_jobs(run: Callable[..., None], iv: bytes, binding: bytes, plaintext: memoryview, frame: memoryview,
                  sealing: bool) -> list[Callable[[], None]]:
    """One job per segment: run(nonce, source, associated data, destination), from plaintext into
    frame when sealing, else back."""
    n, count = len(plaintext), segment_count(len(plaintext))

    def job(i: int) -> Callable[[], None]:
        lo, hi = i * SEGMENT_BYTES, min(n, (i + 1) * SEGMENT_BYTES)
        at = HEADER_LEN + lo + i * TAG_LEN
        part, sealed = plaintext[lo:hi], frame[at:at + hi - lo + TAG_LEN]
        src, dst = (part, sealed) if sealing else (sealed, part)
        return functools.partial(run, _nonce(iv, i), src, binding + struct.pack(">II", i, count), dst)

    return [job(i) for i in range(count)]


def seal_jobs(aead: Any, fingerprint: bytes, binding: bytes, iv: bytes, plaintext: memoryview,
              out: memoryview) -> tuple[int, list[Callable[[], None]]]:
    """Writes the header of plaintext's frame into out and returns the frame's length and one job
    per segment, each sealing its segment in place (no copy): they may run side by side."""
    if len(iv) != IV_LEN or len(fingerprint) != FINGERPRINT_LEN or len(out) < sealed_size(len(plaintext)):
        raise ValueError("seal: the IV, the fingerprint or the destination has the wrong size")
    out[:HEADER_LEN] = bytes([VERSION]) + fingerprint + iv
    return sealed_size(len(plaintext)), _segment_jobs(aead.encrypt_into, iv, binding, plaintext, out, sealing=True)


def open_jobs(aead: Any, fingerprint: bytes, binding: bytes, frame: memoryview, out: memoryview) -> list[Callable[[], None]]:
    """The jobs that authenticate and decrypt a frame (maybe padded: the adapters store whole
    pages) into out, whose length is the plaintext's, one per segment. Raises FrameError now for
    anything but a version 3 frame of this key of the right length (FrameError says if removable);
    a job raises InvalidTag for any changed byte or another name, leaving none of its segment in out."""
    n = len(out)
    if len(frame) == 0:
        raise FrameError("kvpersist-aesgcm: an empty object")
    if frame[0] != VERSION:
        zeros = frame[0] == 0 and not frame.tobytes().strip(b"\0")
        raise FrameError(f"kvpersist-aesgcm: a version {frame[0]} frame (this server opens version {VERSION} only)"
                         + (", all zeros" if zeros else ""), removable=zeros)
    if len(frame) < HEADER_LEN:
        raise FrameError(f"kvpersist-aesgcm: {len(frame)} bytes, too short to tell whose frame it is")
    if bytes(frame[1:1 + FINGERPRINT_LEN]) != fingerprint:
        raise FrameError(f"kvpersist-aesgcm: a frame of another key (fingerprint {bytes(frame[1:1 + FINGERPRINT_LEN]).hex()})")
    if len(frame) < sealed_size(n):
        raise FrameError(f"kvpersist-aesgcm: a frame of this key, {len(frame)} bytes for {sealed_size(n)}", removable=True)
    iv = bytes(frame[1 + FINGERPRINT_LEN:HEADER_LEN])
    return _segment_jobs(functools.partial(_open_segment, aead), iv, binding, out, frame, sealing=False)


def seal(aead: Any, fingerprint: bytes, binding: bytes, iv: bytes, plaintext: memoryview, out: memoryview) -> int:
    n, jobs = seal_jobs(aead, fingerprint, binding, iv, plaintext, out)
    for run in jobs:
        run()
    return n


def open_frame(aead: Any, fingerprint: bytes, binding: bytes, frame: memoryview, out: memoryview) -> None:
    for run in open_jobs(aead, fingerprint, binding, frame, out):
        run()


def _raise(exc: BaseException) -> None:
    raise exc


class AeadKeys:
    """One AESGCM per cache_salt, its key derived from the master key as lmcache does; the
    max_salts most recently used kept (a derivation is cheap, memory for every salt ever seen is not)."""

    def __init__(self, master_key: bytes, key_len: int, max_salts: int = MAX_SALT_KEYS) -> None:
        if len(master_key) == 0:
            raise ValueError("kvpersist-aesgcm: the master key file is empty")
        self._master_key = master_key
        self._key_len = key_len
        self._max_salts = max(1, max_salts)
        self._aeads: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.fingerprint = bytes.fromhex(key_fingerprint(master_key))  # what every frame's header carries

    def derive(self, cache_salt: str) -> bytes:
        from cryptography.hazmat.primitives.hashes import SHA256
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        return HKDF(algorithm=SHA256(), length=self._key_len, salt=None,
                    info=HKDF_INFO_PREFIX + cache_salt.encode("utf-8")).derive(self._master_key)

    def aead(self, cache_salt: str) -> Any:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        with self._lock:
            if cache_salt not in self._aeads:
                self._aeads[cache_salt] = AESGCM(self.derive(cache_salt))
            self._aeads.move_to_end(cache_salt)
            while len(self._aeads) > self._max_salts:
                self._aeads.popitem(last=False)
            return self._aeads[cache_salt]


class PublicKey:
    """AeadKeys' interface over CHECKED_KEY: one key for every salt (the salt is in the binding)."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(CHECKED_KEY)
        self.fingerprint = bytes.fromhex(key_fingerprint(CHECKED_KEY))

    def aead(self, cache_salt: str) -> Any:
        return self._aead


class ObjectBatches:
    """Runs each submitted batch's jobs side by side on a thread pool and reports the batch once,
    when its last job is done: all or nothing, as lmcache's serde contract has it."""

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
            try:
                job()
            except Exception as exc:  # a failed object is a miss, never a dead worker
                state["ok"] = False  # only ever cleared: read by the last job, after the lock below
                with contextlib.suppress(Exception):  # nor a batch never reported: lmcache would wait on it
                    _log_failure(task_id, sealing, exc)
            with self._lock:
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                self._on_done(task_id, sealing, bool(state["ok"]))

        for job in jobs:
            self._pool.submit(one, job)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def removable(exc: BaseException) -> bool:
    """Whether an object whose opening raised exc may be deleted: a version 3 frame of this
    server's key that failed authentication (InvalidTag is raised only for those) or is short."""
    from cryptography.exceptions import InvalidTag  # main refuses to start without a working cryptography

    if isinstance(exc, FrameError):
        return exc.removable
    return isinstance(exc, InvalidTag)


def _log_failure(task_id: int, sealing: bool, exc: BaseException) -> None:
    if sealing:
        _logger().warning("kvpersist-aesgcm: sealing of an object in task %d failed (%s): the batch is a miss", task_id,
                          type(exc).__name__)
        return
    why = f": {exc}" if isinstance(exc, FrameError) else ""
    _logger().warning("kvpersist-aesgcm: opening of an object in task %d failed (%s)%s: the batch is a miss; the object "
                      "is %s", task_id, type(exc).__name__, why,
                      "removed (a frame of this key under another name, or damaged)" if removable(exc)
                      else "left as it is")


def refuse_to_start(message: str) -> NoReturn:
    """Writes message to the termination message and stderr, then ends the process at once:
    whatever lmcache would make of a serde factory's exception, this server must not run."""
    with contextlib.suppress(OSError), open(os.environ.get(TERMINATION_LOG_ENV) or TERMINATION_LOG, "w") as out:
        out.write(message)
    with contextlib.suppress(Exception):
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
    os._exit(KEY_MISMATCH_EXIT_CODE)  # lmcache_internals.EXIT_CODE: every refusal here is EX_CONFIG


def check_key(master_key: bytes, kwargs: dict[str, object]) -> tuple[str, str]:
    """(the expected fingerprint, the namespace id) from the serde settings, once the key file's
    fingerprint is the expected one; else the process ends before any object is read or removed
    (a rotated Secret would make every object unreadable)."""
    expected = str(kwargs.get("key_fingerprint") or "").strip().lower()
    namespace = str(kwargs.get("namespace_id") or "").strip()
    if not FINGERPRINT_RE.fullmatch(expected) or not namespace:
        refuse_to_start(SETTINGS_MISSING)
    found = key_fingerprint(master_key)
    if not hmac.compare_digest(found, expected):
        refuse_to_start(KEY_MISMATCH_FORMAT.format(found=found, namespace=namespace, expected=expected))
    return expected, namespace


def make_processor(kwargs: dict[str, object]) -> Any:
    """The serde factory lmcache calls with the adapter's `serde` settings: master_key_path,
    key_fingerprint and namespace_id (check_key), aes_bits (128 or 256) and max_workers."""
    aes_bits = int(kwargs.get("aes_bits", 256))  # type: ignore[call-overload]
    if aes_bits not in (128, 256):
        raise ValueError(f"kvpersist-aesgcm: aes_bits must be 128 or 256, not {aes_bits}")
    path = str(kwargs.get("master_key_path") or "")
    if not path:
        raise ValueError("kvpersist-aesgcm: master_key_path is required")
    with open(path, "rb") as f:
        master_key = f.read()
    expected, namespace = check_key(master_key, kwargs)
    return _processor_class()(AeadKeys(master_key, aes_bits // 8), namespace, kwargs, f"kvpersist-aesgcm: AES-{aes_bits}-GCM, "
                              f"frames of 2 MiB segments bound to their names, key {expected}")


def make_checked_processor(kwargs: dict[str, object]) -> Any:
    """kvpersist-checked's factory (frames under CHECKED_KEY, no key file): namespace_id, which
    the frames are bound to (refuses to start without it), and max_workers."""
    namespace = str(kwargs.get("namespace_id") or "").strip()
    if not namespace:
        refuse_to_start(CHECKED_SETTINGS_MISSING)
    return _processor_class()(PublicKey(), namespace, kwargs, "kvpersist-checked: frames of 2 MiB segments bound to their "
                              "names under a public key (a checksum, not a secret)")


@functools.cache
def _processor_class() -> type:
    """ParallelAesGcm, made on first use: its base is lmcache's, which the operator (importing
    this module for SERDE_TYPE) does not have."""
    class ParallelAesGcm(lmcache_internals.serde_processor()):  # type: ignore[misc]
        """lmcache's SerdeProcessor contract (submit, eventfd, each result queried once) over
        ObjectBatches: every segment of a batch sealed or opened on its own worker."""

        def __init__(self, keys: AeadKeys | PublicKey, namespace_id: str, settings: dict[str, object], described: str) -> None:
            """settings: the serde's (max_workers); described: what the log says of its frames and key."""
            workers = int(settings.get("max_workers", DEFAULT_WORKERS))  # type: ignore[call-overload]
            _logger().info("%s, namespace %s, %d workers", described, namespace_id, workers)
            self._keys = keys
            self._namespace_id = namespace_id
            self._efds = {True: lmcache_internals.event_notifier(), False: lmcache_internals.event_notifier()}
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

        def _binding(self, key: Any) -> bytes:
            return object_binding(self._keys.fingerprint, self._namespace_id, key)

        def _seal_jobs(self, src: Any, dst: Any, key: Any) -> list[Callable[[], None]]:
            n, jobs = seal_jobs(self._keys.aead(key.cache_salt), self._keys.fingerprint, self._binding(key),
                                os.urandom(IV_LEN), _bytes_view(src.byte_array), _bytes_view(dst.byte_array))
            dst.set_used_size(n)  # the adapter stores exactly the frame (every MemoryObj has it: lmcache_internals)
            return jobs

        def _open_jobs(self, src: Any, dst: Any, key: Any) -> list[Callable[[], None]]:
            jobs = open_jobs(self._keys.aead(key.cache_salt), self._keys.fingerprint, self._binding(key),
                             _bytes_view(src.byte_array), _bytes_view(dst.byte_array))
            return [functools.partial(self._opened, key, run) for run in jobs]

        def _opened(self, key: Any, run: Callable[[], None]) -> None:
            try:
                run()
            except Exception as exc:
                if removable(exc) and self.on_unreadable is not None:  # only a frame of this key
                    self.on_unreadable([key])
                raise

        def _submit(self, sealing: bool, src_objs: list, dst_objs: list, keys: list) -> int:
            with self._lock:
                self._next += 1
                task_id = self._next
            make = self._seal_jobs if sealing else self._open_jobs
            jobs: list[Callable[[], None]] = []
            for s, d, k in zip(src_objs, dst_objs, keys, strict=True):
                try:
                    jobs += make(s, d, k)
                except Exception as exc:  # e.g. a destination too small: this batch fails, not the server
                    failed = functools.partial(_raise, exc)  # a frame refused at once may still be removable
                    jobs.append(failed if sealing else functools.partial(self._opened, k, failed))
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
            """The frame of the chunk's tensors (torch dtypes know their item size)."""
            return sealed_size(sum(math.prod(int(dim) for dim in shape) * int(dtype.itemsize)
                                   for shape, dtype in zip(layout_desc.shapes, layout_desc.dtypes, strict=True)))

        def close(self) -> None:
            self._batches.close()
            for efd in self._efds.values():
                efd.close()

    return ParallelAesGcm


class UnreadableObjects:
    """Removes removable objects that failed authentication from their adapter, so they can be
    stored again. nixl_store_dynamic skips the delete of a still pinned key, so each is asked again
    every RETRY_S until the adapter reports it deleted to this, its listener, for at most GIVE_UP_S;
    fs_native reports only what this process stored, so a key is also done once a new object is
    stored under its name (asking again then would delete the new one)."""

    RETRY_S = 0.2
    GIVE_UP_S = 30.0

    def __init__(self, adapter: Any) -> None:
        self._adapter = adapter
        self._pending: dict[Any, float] = {}  # key -> when it failed
        self._lock = threading.Lock()
        self._wake = threading.Event()
        threading.Thread(target=self._loop, name="kvpersist-unreadable", daemon=True).start()

    def add(self, keys: list) -> None:
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._pending.setdefault(key, now)
        self._wake.set()

    def on_l2_keys_deleted(self, keys: list) -> None:
        """The adapter's word that keys are gone (evicted, or removed by us)."""
        with self._lock:
            for key in keys:
                self._pending.pop(key, None)

    def on_l2_keys_stored(self, keys: list, sizes: list) -> None:
        self.on_l2_keys_deleted(keys)  # a new object under the name: not to be removed

    def on_l2_keys_accessed(self, keys: list) -> None:
        pass

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
                log.info("kvpersist-aesgcm: no word from the adapter in %.0f s that an unreadable object is removed "
                         "(fs_native says so only of what this process stored); if it is still there it stays a miss: %s",
                         self.GIVE_UP_S, key)
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
        """The whole load's bitmap once every chunk's load has answered, else None (each answer
        is kept here: lmcache's results are popped when read)."""
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


@functools.cache
def _logger() -> Any:
    """lmcache's logger (its format, level and handler), made once: init_logger resets handlers."""
    return lmcache_internals.logger("kvpersist.inserver.serve")


def register() -> None:
    """Registers both serdes, then replaces the storage manager's SerdeL2AdapterWrapper by a subclass
    that hands our serde the inner adapter's delete (UnreadableObjects) and loads one chunk per load
    (ChunkLoads), so the decryption overlaps the reads; other serdes are left alone."""
    lmcache_internals.register_serde(SERDE_TYPE, make_processor)
    lmcache_internals.register_serde(CHECKED_TYPE, make_checked_processor)
    base = lmcache_internals.serde_wrapper()
    if getattr(base, "kvpersist_wired", False):
        return
    bitmap = lmcache_internals.bitmap_class()

    class Listening(UnreadableObjects, lmcache_internals.adapter_listener()):  # type: ignore[misc]
        """UnreadableObjects as lmcache's listener type, which the adapter is handed."""

    class WiredSerdeL2AdapterWrapper(base):  # type: ignore[misc, valid-type]
        kvpersist_wired = True

        def __init__(self, inner: Any, serde: Any, l1_manager: Any) -> None:
            super().__init__(inner=inner, serde=serde, l1_manager=l1_manager)
            self.kvpersist_chunks: ChunkLoads | None = None
            if hasattr(serde, "on_unreadable"):
                unreadable = Listening(inner)
                inner.register_listener(unreadable)
                serde.on_unreadable = unreadable.add
                self.kvpersist_chunks = ChunkLoads(super().submit_load_task, super().query_load_result, bitmap)
                _logger().info("kvpersist-aesgcm: wired into the L2 wrapper: one load per chunk, unreadable objects of "
                               "this key removed")

        def submit_load_task(self, keys: list, objects: list) -> int:
            if self.kvpersist_chunks is None or len(keys) < 2:
                return super().submit_load_task(keys, objects)
            return self.kvpersist_chunks.submit(keys, objects)

        def query_load_result(self, task_id: int) -> Any:
            if self.kvpersist_chunks is None or not self.kvpersist_chunks.owns(task_id):
                return super().query_load_result(task_id)
            return self.kvpersist_chunks.query(task_id)

    lmcache_internals.replace_serde_wrapper(WiredSerdeL2AdapterWrapper)


def cryptography_problem() -> str | None:
    """What is wrong with the installed cryptography for the serde (encrypt_into and decrypt_into
    came in 43), or None: a frame under a random key and under CHECKED_KEY seals and opens, and a
    changed byte fails its tag and leaves nothing in the destination."""
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        for key in (AESGCM.generate_key(256), CHECKED_KEY):
            aead, fingerprint, plaintext = AESGCM(key), bytes(FINGERPRINT_LEN), b"kvpersist"
            frame = bytearray(sealed_size(len(plaintext)))
            seal(aead, fingerprint, b"self-test", os.urandom(IV_LEN), memoryview(plaintext), memoryview(frame))
            out = bytearray(len(plaintext))
            open_frame(aead, fingerprint, b"self-test", memoryview(frame), memoryview(out))
            if bytes(out) != plaintext:
                return "a frame opened to other bytes"
            frame[HEADER_LEN] ^= 1
            out = bytearray(len(plaintext))
            try:
                open_frame(aead, fingerprint, b"self-test", memoryview(frame), memoryview(out))
            except InvalidTag:
                if any(out):
                    return "a failed tag left bytes in the destination"
                continue
            return "a changed byte of a frame passed its tag"
    except Exception as exc:  # anything it raises is the answer
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv: list[str]) -> int:
    """lmcache's server with our serde, once the installed lmcache is a tested release with every
    internal as used here and cryptography does what the serde calls; else it refuses to start
    (the build check's message and exit code) before anything is registered or read."""
    found = lmcache_internals.check()
    if found:
        refuse_to_start(lmcache_internals.refusal_message(found))
    problem = cryptography_problem()
    if problem:
        refuse_to_start(f"{lmcache_internals.MISMATCH_PREFIX}cryptography in this container cannot do what kvpersist's "
                        f"L2 serde calls ({problem}): use an image with cryptography 43 or later (images/vllm-lmcache)")
    _logger().info("kvpersist: lmcache %s has the %d internals kvpersist's server uses, as it uses them "
                   "(kvpersist.inserver.lmcache_internals)", lmcache_internals.installed_version(),
                   len(lmcache_internals.INTERNALS))
    register()
    return lmcache_internals.run_lmcache(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
