"""What the Hub stand-in needs to know about files in xet-core's own local CAS: their sizes.

hf_xet (the wheel huggingface_hub installs) carries xet-core's `LocalClient`, the CAS that
xet-core's own tests run on: when the Hub's token route answers with a CAS URL starting
`local://<dir>`, hf_xet chunks, deduplicates, packs xorbs and writes shards exactly as for the
Hub's CAS servers, into `<dir>/xet/xorbs/{xorbs,shards}`, and reconstructs files from there.
The bytes of the round trip therefore go through xet-core's real code; what is not real is the
Hub, whose bucket index (path -> xet hash, size) tests/integration/hub_stub.py stands in for.

The Hub learns a file's size from the shard the client registered, not from the client's batch
call (huggingface_hub sends only `path`, `xetHash`, `mtime`). The stand-in does the same: it
reads the file-info section of the shards LocalClient wrote (xet-core
`xet_core_structures/src/metadata_shard/{shard_format,file_structs}.rs`: a 48-byte header, then
per file a 48-byte header {file_hash, flags, n, unused} and n 48-byte segments whose
`unpacked_segment_bytes` add up to the file's size, optional verification and metadata entries,
and a bookend of all-ones hashes). It cannot open the CAS through hf_xet itself: LocalClient
holds an exclusive lock on its redb index while the server's process uses it.
`tests/integration/test_hfbucket_datapath.py::test_shard_reader_agrees_with_hf_xet` checks this
reader against the sizes hf_xet reports for its own uploads.
"""

from __future__ import annotations

import struct
from pathlib import Path

ENTRY = 48
_VERIFICATION = 1 << 31
_METADATA_EXT = 1 << 30
_BOOKEND = b"\xff" * 32


def xet_hex(raw: bytes) -> str:
    """xet-core's MerkleHash hex: four little-endian u64 words, each printed as 16 hex digits."""
    return "".join(f"{word:016x}" for word in struct.unpack("<4Q", raw))


def shard_file_sizes(data: bytes) -> dict[str, int]:
    """{xet file hash: size} for every file a serialized shard describes."""
    sizes: dict[str, int] = {}
    at = ENTRY  # MDBShardFileHeader: tag[32], version u64, footer_size u64
    while at + ENTRY <= len(data):
        file_hash, flags, n = data[at:at + 32], *struct.unpack_from("<II", data, at + 32)
        if file_hash == _BOOKEND:
            break
        at += ENTRY
        sizes[xet_hex(file_hash)] = sum(struct.unpack_from("<I", data, at + i * ENTRY + 36)[0] for i in range(n))
        at += ENTRY * (n * (2 if flags & _VERIFICATION else 1) + (1 if flags & _METADATA_EXT else 0))
    return sizes


def cas_file_sizes(cas_dir: Path) -> dict[str, int]:
    """Every file the local CAS holds, from its shards: `<cas_dir>/xet/xorbs/shards` for hf_xet's
    `local://<cas_dir>`, `<cas_dir>/shards` for xet-core's `local_cas_server --data-directory <cas_dir>`."""
    sizes: dict[str, int] = {}
    shards = [*(cas_dir / "xet" / "xorbs" / "shards").glob("*.mdb"), *(cas_dir / "shards").glob("*.mdb")]
    for shard in sorted(shards):
        try:
            sizes.update(shard_file_sizes(shard.read_bytes()))
        except (OSError, struct.error):
            continue  # a shard being written: the next call sees it whole
    return sizes
