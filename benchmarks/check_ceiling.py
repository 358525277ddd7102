#!/usr/bin/env python3
"""What a checked L2 read can reach on this machine, whatever the server does (issue 56).

datapath_bench measures the real lmcache server: there a checked read (encryption off, every
object checked) and an encrypted one run at 0.67-0.79x of the unchecked read when the folder
reads at memory speed. The server reads each object whole into a temporary L1 buffer, then the
serde opens it into the destination: one more pass over every byte. This bench asks what reading
each object straight into its destination and checking it there would give, before anyone
replaces lmcache's load path for it: the same chunk files, read cold by the same threads, five
ways, no server involved:

- `unchecked`: each file read whole into its destination (what fs_native does, with no serde);
  the baseline of every ratio;
- `temp+open`: each frame read whole into a temporary buffer, then opened into the destination
  (serve.open_frame, the server's serde): today's structure, one thread's share of it, with one
  temporary buffer per thread, used again for every chunk (it may stay in the CPU's last-level cache);
- `temps+open`: the same with a temporary buffer of its own for each chunk, as lmcache's wrapper
  takes one from L1 for each load (distinct memory: every byte crosses memory once more);
- `streamed`: each frame read in pieces of --piece-kib into a small buffer that stays in the CPU's
  cache and decrypted from there into the destination as it arrives (AES-GCM, the segments' own
  tags checked): the read-into-the-destination design for encryption on, no extra pass;
- `streamed-plain`: plaintext files whose segment tags trail the payload (a GMAC per 2 MiB
  segment under a public key, bound to the file's name as serve.object_binding binds a frame),
  read straight into the destination in pieces, each piece authenticated while still in cache:
  the design for encryption off.

Every tag is checked for real (a failed one stops the bench), every destination compared with the
plaintext by sha256 after each read. Page cache dropped before each read (needs root); the order
of the five rotates by trial; ratios per trial, medians printed. --ram-device N sets up an ext4 on
a loop device over /dev/shm (O_DIRECT, as the server reads in production) and removes it;
--dir DIR reads a folder you give (buffered; a tmpfs cannot take O_DIRECT).

    <venv>/bin/python benchmarks/check_ceiling.py --ram-device 6 [--size-gb 1] [--threads 1,2] [--trials 3]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import mmap
import os
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from kvpersist.inserver import serve

CHUNK_BYTES = 32 * 2**20  # datapath_bench's: a 256-token chunk of a 32-layer, 8-KV-head, 128-dim fp16 model
PAGE = 4096
READERS = ("unchecked", "temp+open", "temps+open", "streamed", "streamed-plain")
GMAC_LABEL = b"check_ceiling plain segment"
CHECKED_KEY = serve.CHECKED_KEY  # a public key: a checksum bound to the name, not a secret


def _aligned(size: int) -> mmap.mmap:
    """Page-aligned (O_DIRECT) and written once, as pinned L1 is: no page faults during a read."""
    buf = mmap.mmap(-1, max(size, PAGE))
    buf.write(b"\0" * len(buf))
    return buf


def _gcm(key: bytes, nonce: bytes, tag: bytes | None = None) -> object:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    cipher = Cipher(algorithms.AES(key), modes.GCM(nonce, tag))
    return cipher.decryptor() if tag is not None else cipher.encryptor()


def nonce(iv: bytes, i: int) -> bytes:
    """Segment i's nonce, as serve's frames make it (the IV plus i in its last 32 bits)."""
    return iv[:8] + ((int.from_bytes(iv[8:], "big") + i) % 2**32).to_bytes(4, "big")


def _binding(i: int) -> bytes:
    return GMAC_LABEL + struct.pack(">I", i)


def _plain_tags(key: bytes, iv: bytes, binding: bytes, payload: memoryview) -> bytes:
    """A GMAC per segment: the segment as associated data, its binding, index and count before it."""
    count, out = serve.segment_count(len(payload)), []
    for i in range(count):
        mac = _gcm(key, nonce(iv, i))
        mac.authenticate_additional_data(binding + struct.pack(">II", i, count))  # type: ignore[attr-defined]
        mac.authenticate_additional_data(payload[i * serve.SEGMENT_BYTES:(i + 1) * serve.SEGMENT_BYTES])  # type: ignore[attr-defined]
        mac.finalize()  # type: ignore[attr-defined]
        out.append(mac.tag)  # type: ignore[attr-defined]
    return b"".join(out)


class Files:
    """count chunks of plaintext, each stored twice: a version 3 frame (serve.seal, AES-256-GCM)
    and plaintext with an IV and its segment tags after it."""

    def __init__(self, folder: Path, count: int) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.key = AESGCM.generate_key(256)
        self.aead = AESGCM(self.key)
        self.fingerprint = os.urandom(serve.FINGERPRINT_LEN)
        self.frames, self.plains, self.digests = [], [], []
        frame = bytearray(serve.sealed_size(CHUNK_BYTES))
        for i in range(count):
            payload = memoryview(os.urandom(CHUNK_BYTES))
            n = serve.seal(self.aead, self.fingerprint, _binding(i), os.urandom(serve.IV_LEN), payload, memoryview(frame))
            iv = os.urandom(serve.IV_LEN)
            for path, data in ((folder / f"frame-{i}.data", [memoryview(frame)[:n]]),
                               (folder / f"plain-{i}.data", [payload, iv, _plain_tags(CHECKED_KEY, iv, _binding(i), payload)])):
                with open(path, "wb") as f:
                    for part in data:
                        f.write(part)
                    os.fsync(f.fileno())
            self.frames.append(folder / f"frame-{i}.data")
            self.plains.append(folder / f"plain-{i}.data")
            self.digests.append(hashlib.sha256(payload).digest())


def _read_into(fd: int, view: memoryview, offset: int) -> int:
    """Fills view from offset on (several preads: O_DIRECT may return less); the bytes read."""
    done = 0
    while done < len(view) and (n := os.preadv(fd, [view[done:]], offset + done)):
        done += n
    return done


class Reader:
    """One thread's memory: its destinations (touched, as pinned L1), a temp frame buffer and a
    piece buffer, all page-aligned for O_DIRECT."""

    def __init__(self, chunks: int, piece: int) -> None:
        self.frame = -(-serve.sealed_size(CHUNK_BYTES) // PAGE) * PAGE
        self.dest = _aligned(chunks * CHUNK_BYTES)
        self.temps = _aligned(chunks * self.frame)  # one per chunk (temps+open); temp+open reuses the first
        self.piece = _aligned(piece)
        self.slot = 0

    def close(self) -> None:
        for b in (self.dest, self.temps, self.piece):
            b.close()


def unchecked(files: Files, i: int, out: memoryview, r: Reader, flags: int) -> None:
    fd = os.open(files.frames[i], flags)
    try:
        _read_into(fd, out, 0)  # a frame's first CHUNK_BYTES, as many bytes as a plaintext: the same read
    finally:
        os.close(fd)


def temp_open(files: Files, i: int, out: memoryview, r: Reader, flags: int, slot: int = 0) -> None:
    fd = os.open(files.frames[i], flags)
    try:
        size = os.fstat(fd).st_size
        temp = memoryview(r.temps)[slot * r.frame:(slot + 1) * r.frame]
        _read_into(fd, temp, 0)
    finally:
        os.close(fd)
    serve.open_frame(files.aead, files.fingerprint, _binding(i), temp[:size], out)


def temps_open(files: Files, i: int, out: memoryview, r: Reader, flags: int) -> None:
    r.slot = (r.slot + 1) % (len(r.temps) // r.frame)
    temp_open(files, i, out, r, flags, r.slot)


def streamed(files: Files, i: int, out: memoryview, r: Reader, flags: int) -> None:
    """The frame's bytes as they arrive, piece by piece: header, then each segment's ciphertext
    decrypted into out and its tag checked."""
    fd = os.open(files.frames[i], flags)
    size = os.fstat(fd).st_size
    count = serve.segment_count(CHUNK_BYTES)
    piece, header, tag = memoryview(r.piece), bytearray(), bytearray()
    seg, done_in_seg, dec = 0, 0, None
    pos = 0
    try:
        while pos < size:
            got = _read_into(fd, piece, pos)
            data, pos = piece[:min(got, size - pos)], pos + got
            while len(data):
                if len(header) < serve.HEADER_LEN:
                    take = min(serve.HEADER_LEN - len(header), len(data))
                    header += data[:take]
                    data = data[take:]
                    continue
                seg_len = min(serve.SEGMENT_BYTES, CHUNK_BYTES - seg * serve.SEGMENT_BYTES)
                if dec is None:
                    dec = _Stream(files.key, bytes(header[1 + serve.FINGERPRINT_LEN:]), seg, count, _binding(i))
                if done_in_seg < seg_len:
                    take = min(seg_len - done_in_seg, len(data))
                    at = seg * serve.SEGMENT_BYTES + done_in_seg
                    dec.update(data[:take], out[at:at + take])
                    done_in_seg += take
                    data = data[take:]
                    continue
                take = min(serve.TAG_LEN - len(tag), len(data))
                tag += data[:take]
                data = data[take:]
                if len(tag) == serve.TAG_LEN:
                    dec.finalize(bytes(tag))
                    seg, done_in_seg, dec, tag = seg + 1, 0, None, bytearray()
    finally:
        os.close(fd)
    if seg != count:
        raise SystemExit(f"frame {i}: {seg} of {count} segments")


class _Stream:
    """One segment's AES-GCM decryption fed piece by piece. cryptography wants the tag before the
    first byte (GCM(nonce, tag)); the frame has it after the segment, so the decryption runs as
    AES-CTR plus GHASH in the GCM decryptor with the tag given late (finalize_with_tag)."""

    def __init__(self, key: bytes, iv: bytes, seg: int, count: int, binding: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self.dec = Cipher(algorithms.AES(key), modes.GCM(nonce(iv, seg))).decryptor()
        self.dec.authenticate_additional_data(binding + struct.pack(">II", seg, count))

    def update(self, data: memoryview, out: memoryview) -> None:
        self.dec.update_into(data, out)

    def finalize(self, tag: bytes) -> None:
        self.dec.finalize_with_tag(tag)


def streamed_plain(files: Files, i: int, out: memoryview, r: Reader, flags: int) -> None:
    """Plaintext read straight into out in pieces, each authenticated while in cache; then the
    trailer (IV and tags) and each segment's tag checked."""
    fd = os.open(files.plains[i], flags)
    count = serve.segment_count(CHUNK_BYTES)
    plen = len(r.piece)
    try:
        trailer = memoryview(r.piece)[:PAGE]
        got = _read_into(fd, trailer, CHUNK_BYTES)
        iv, tags = bytes(trailer[:serve.IV_LEN]), bytes(trailer[serve.IV_LEN:got])
        macs = []
        for seg in range(count):
            mac = _gcm(CHECKED_KEY, nonce(iv, seg), tags[seg * 16:(seg + 1) * 16])
            mac.authenticate_additional_data(_binding(i) + struct.pack(">II", seg, count))  # type: ignore[attr-defined]
            macs.append(mac)
        for at in range(0, CHUNK_BYTES, plen):
            part = out[at:at + plen]
            _read_into(fd, part, at)
            macs[at // serve.SEGMENT_BYTES].authenticate_additional_data(part)  # type: ignore[attr-defined]
        for mac in macs:
            mac.finalize()  # type: ignore[attr-defined]  # InvalidTag on any changed byte
    finally:
        os.close(fd)


READ: dict[str, Callable[[Files, int, memoryview, Reader, int], None]] = {
    "unchecked": unchecked, "temp+open": temp_open, "temps+open": temps_open, "streamed": streamed,
    "streamed-plain": streamed_plain}


def read_all(files: Files, how: str, threads: int, readers: list[Reader], direct: bool, cold: bool = True) -> float:
    """Every chunk read by `threads` threads (chunk j by thread j % threads), cold; GB/s of plaintext.
    Each destination is then checked against the plaintext's digest."""
    from benchmarks.datapath_bench import drop_caches  # the server bench's (needs root)

    if cold and not drop_caches():
        raise SystemExit("the page cache could not be dropped (needs root): the reads would not be cold")
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    count = len(files.frames)

    def work(t: int) -> None:
        view = memoryview(readers[t].dest)
        for slot, i in enumerate(range(t, count, threads)):
            READ[how](files, i, view[slot * CHUNK_BYTES:(slot + 1) * CHUNK_BYTES], readers[t], flags)

    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
    except Exception as exc:  # a failed tag (InvalidTag), a short read
        raise SystemExit(f"{how}: {type(exc).__name__}: {exc}") from exc
    elapsed = time.monotonic() - t0
    if how != "unchecked":  # unchecked reads frames: ciphertext, nothing to compare
        for t in range(threads):
            view = memoryview(readers[t].dest)
            for slot, i in enumerate(range(t, count, threads)):
                if hashlib.sha256(view[slot * CHUNK_BYTES:(slot + 1) * CHUNK_BYTES]).digest() != files.digests[i]:
                    raise SystemExit(f"{how}: chunk {i} read back other bytes")
    return count * CHUNK_BYTES / elapsed / 1e9


@contextlib.contextmanager
def folder(args: argparse.Namespace) -> Iterator[tuple[Path, bool]]:
    if args.ram_device:
        from benchmarks.datapath_bench import ram_device

        with ram_device(args.ram_device) as dev:
            yield dev.mount, True
    else:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            yield Path(d), False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--piece-kib", type=int, default=512)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--ram-device", type=int, metavar="SIZE_GB")
    where.add_argument("--dir")
    args = parser.parse_args()
    import signal

    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))  # finally blocks remove the device
    count = max(2, int(args.size_gb * 2**30) // CHUNK_BYTES)
    with folder(args) as (root, direct):
        files = Files(root, count)
        print(f"{count} chunks of {CHUNK_BYTES >> 20} MiB in {root} ({'O_DIRECT' if direct else 'buffered'}), pieces of "
              f"{args.piece_kib} KiB, {os.cpu_count()} cores", flush=True)
        for threads in (int(t) for t in args.threads.split(",")):
            readers = [Reader(-(-count // threads), args.piece_kib * 1024) for _ in range(threads)]
            rates: dict[str, list[float]] = {h: [] for h in READERS}
            for trial in range(args.trials):
                order = READERS[trial % len(READERS):] + READERS[:trial % len(READERS)]
                got = {h: read_all(files, h, threads, readers, direct) for h in order}
                for h in READERS:
                    rates[h].append(got[h])
                print(f"  {threads} thread(s), trial {trial + 1} ({', '.join(order)}): "
                      + ", ".join(f"{h} {got[h]:.2f}" for h in READERS), flush=True)
            for r in readers:
                r.close()
            base = rates["unchecked"]
            print(f"{threads} thread(s), medians GB/s: " + ", ".join(f"{h} {statistics.median(rates[h]):.2f}" for h in READERS))
            print(f"{threads} thread(s), over unchecked (per trial, median): " + ", ".join(
                f"{h} {statistics.median(a / b for a, b in zip(rates[h], base, strict=True)):.2f}" for h in READERS[1:]),
                flush=True)


if __name__ == "__main__":
    main()
