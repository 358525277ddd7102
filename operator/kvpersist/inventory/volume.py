"""What each compatibility namespace holds on an L2 volume or bucket, read from the data itself:
every namespace's files live under a folder or prefix named by its id (kvp-<32 hex>), so the data
is its own record, with nothing to drift.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

NAMESPACE_ID_RE = re.compile(r"kvp-[0-9a-f]{32}")  # always fullmatch: `$` would let a trailing newline in


@dataclass
class NamespaceUsage:
    """One namespace's share of a volume or bucket."""

    namespace_id: str
    bytes: int = 0
    objects: int = 0
    last_write: float | None = None  # unix seconds of the newest object
    orphan: bool | None = None  # None until compared with what is live
    complete: bool = True  # False: the bounded scan stopped inside (or before) this folder

    def add(self, size: int, mtime: float | None) -> None:
        self.bytes += size
        self.objects += 1
        if mtime is not None and (self.last_write is None or mtime > self.last_write):
            self.last_write = mtime

    def add_all(self, files: Iterable[tuple[int, float | None]]) -> NamespaceUsage:
        for size, mtime in files:
            self.add(size, mtime)
        return self

    def to_json(self) -> dict[str, Any]:
        out = {"namespaceId": self.namespace_id, "bytes": self.bytes, "objects": self.objects, "lastWrite": iso(self.last_write),
               "orphan": self.orphan, "complete": self.complete}
        return {k: v for k, v in out.items() if (k, v) not in (("orphan", None), ("complete", True))}


@dataclass
class Inventory:
    """All namespaces found on one volume or bucket prefix, plus what else sits there."""

    location: str
    namespaces: list[NamespaceUsage] = field(default_factory=list)
    other_bytes: int = 0  # files outside any namespace folder (never touched by gc)
    capacity_bytes: int | None = None
    free_bytes: int | None = None
    truncated: bool = False  # the scan stopped at its bound (MAX_SCAN_FILES): some folders are undercounted
    effective_capacity_bytes: int | None = None  # the served folder's trim watermark, as the agent reports it

    def to_json(self) -> dict[str, Any]:
        out = {"location": self.location, "namespaces": [n.to_json() for n in self.namespaces], "otherBytes": self.other_bytes,
               "capacityBytes": self.capacity_bytes, "freeBytes": self.free_bytes}
        return {**out, "truncated": True} if self.truncated else out


def iso(ts: float | None) -> str | None:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if ts is not None else None


def parse_iso(stamp: str | None) -> float | None:
    """iso()'s inverse: unix seconds, or None."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None


def human_bytes(n: int | None) -> str | None:
    if n is None:
        return None
    for unit, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= size:
            return f"{n / size:.1f}{unit}".replace(".0" + unit, unit)
    return f"{n}B"


def group(entries: Iterable[tuple[str, int, float | None]], location: str) -> Inventory:
    """(relative path, size, mtime) entries, grouped by the namespace folder they sit in."""
    by_id: dict[str, NamespaceUsage] = {}
    other = 0
    for path, size, mtime in entries:
        first = path.lstrip("/").split("/", 1)[0]
        if NAMESPACE_ID_RE.fullmatch(first) and "/" in path.lstrip("/"):
            by_id.setdefault(first, NamespaceUsage(first)).add(size, mtime)
        else:
            other += size
    return Inventory(location, sorted(by_id.values(), key=lambda n: n.namespace_id), other)


# A claim may hold millions of files: one scan lstat()s at most this many (about a second per
# 100,000), served folder first; folders it did not finish are incomplete and never expire (space.py).
MAX_SCAN_FILES = 1_000_000


@dataclass
class _Budget:
    left: int  # files a walk may still lstat; shared by the folders of one scan


def _walk(top: Path, budget: _Budget | None = None) -> Iterator[tuple[str, str, os.stat_result]]:
    """(path, name, lstat) of every file under top (links not followed, vanished files skipped) until budget is spent."""
    if budget is not None and budget.left <= 0:
        return  # not even listed: a folder of millions of names takes a while to list
    for dirpath, _dirs, names in os.walk(top):
        for name in names:
            if budget is not None:
                if budget.left <= 0:
                    return
                budget.left -= 1
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            yield path, name, st


def _folder_usage(name: str, folder: Path, budget: _Budget | None) -> NamespaceUsage:
    """What the files under folder hold (apparent sizes, as `du -sb` counts them); complete False when
    budget ran out in it or before it (or exactly on its last file: not sure either way)."""
    held = NamespaceUsage(name).add_all((st.st_size, st.st_mtime) for _path, _name, st in _walk(folder, budget))
    held.complete = budget is None or budget.left > 0
    return held


def scan_volume(root: Path, first: str | None = None, max_files: int = MAX_SCAN_FILES) -> Inventory:
    """Walk an L2 mount, at most max_files files, the served folder (first) before the others; a folder
    the bound cut short, or never reached, is listed with complete False."""
    budget = _Budget(max_files)
    inv = Inventory(str(root))
    try:
        children = sorted(os.scandir(root), key=lambda e: (e.name != first, e.name)) if root.is_dir() else []
    except OSError:
        children = []
    for child in children:
        try:
            st = child.stat(follow_symlinks=False)
        except OSError:  # gone since the listing
            continue
        if not stat.S_ISDIR(st.st_mode):
            inv.other_bytes += st.st_size
        elif NAMESPACE_ID_RE.fullmatch(child.name):  # listed even when empty (a server started, nothing stored)
            inv.namespaces.append(_folder_usage(child.name, Path(child.path), budget))
        else:
            inv.other_bytes += _folder_usage(child.name, Path(child.path), budget).bytes
    inv.namespaces.sort(key=lambda n: n.namespace_id)
    inv.truncated = budget.left <= 0  # a folder left incomplete spent it
    usage = shutil.disk_usage(root)
    inv.capacity_bytes, inv.free_bytes = usage.total, usage.free
    return inv


def namespace_usage(root: Path, namespace_id: str, max_files: int | None = None) -> NamespaceUsage | None:
    """What one namespace folder holds (walking only it); None when there is none. Refuses a non-id, so no
    other path is ever walked. With max_files, a folder holding more comes back with complete False."""
    folder = _served_folder(root, namespace_id)
    if folder is None:
        return None
    return _folder_usage(namespace_id, folder, _Budget(max_files) if max_files is not None else None)


def remove_namespace(root: Path, namespace_id: str) -> NamespaceUsage:
    """Delete one namespace's folder (the caller refused live ones; this refuses any other path); returns what it held."""
    held = namespace_usage(root, namespace_id)
    if held is None:
        return NamespaceUsage(namespace_id)
    shutil.rmtree(root / namespace_id)
    return held


class ChunkFile(NamedTuple):
    """One committed chunk file in a namespace folder, as lstat saw it."""

    path: str
    size: int
    mtime: float
    ino: int


# lmcache 0.5.6's nixl_store_dynamic writes `<final>.bin.tmp.<uuid4 hex>` and renames it to `<final>.bin`;
# a crash in between leaves the temp file (nixl removes it only at a clean shutdown). fs_native writes
# `<stem>.tmp` beside `<stem>.data` (`<model>@0x<rank>@<group>@<hash>[@<salt>]`) and renames it.
TEMP_MARK = ".tmp."
# Per adapter: its committed chunk suffix and temp-file names, the only files the trim counts and deletes.
# Anything else must not count: bytes it may not delete would make it delete live chunks in their place.
TRIMMED_ADAPTERS = {"nixl_store_dynamic": (".bin", re.compile(r".+\.bin\.tmp\.[0-9a-f]{32}")),
                    "fs_native": (".data", re.compile(r".+@0x[0-9a-f]+@[0-9a-f]+@[0-9a-f]+(@.*)?\.tmp"))}
DEFAULT_TRIMMED = "nixl_store_dynamic"  # an agent rendered before fs_native names none
# A temp file untouched this long is abandoned: lmcache writes and renames a chunk in one go, so a live one
# is seconds old; an hour leaves a slow disk its time. Deleting one being written only fails that store.
ABANDONED_TEMP_S = 3600.0


def is_chunk_name(name: str, adapter: str = DEFAULT_TRIMMED) -> bool:
    """A committed chunk file of adapter's: never an in-flight temp file, never anything lmcache did not name."""
    return name.endswith(TRIMMED_ADAPTERS[adapter][0]) and TEMP_MARK not in name


def choose_oldest(files: Sequence[ChunkFile], total_bytes: int, target_bytes: int,
                  spare_after: float | None = None) -> list[ChunkFile]:
    """The oldest files (by mtime, then path) whose removal brings total_bytes to target_bytes or below:
    write age is the only order the agent sees (lmcache's LRU lives in its memory). spare_after: never a
    file written at or after that time (a shared folder's grace), even if the folder stays above target."""
    chosen: list[ChunkFile] = []
    excess = total_bytes - target_bytes
    for f in sorted(files, key=lambda f: (f.mtime, f.path)):
        if excess <= 0 or (spare_after is not None and f.mtime >= spare_after):
            break
        chosen.append(f)
        excess -= f.size
    return chosen


def _served_folder(root: Path, namespace_id: str) -> Path | None:
    """<root>/<namespace_id> when it is a real directory (not a link); refuses a non-id."""
    if not NAMESPACE_ID_RE.fullmatch(namespace_id):
        raise ValueError(f"{namespace_id!r} is not a namespace id (kvp-<32 hex>)")
    folder = root / namespace_id
    try:
        return folder if stat.S_ISDIR(os.lstat(folder).st_mode) else None
    except (FileNotFoundError, NotADirectoryError):  # none there, or the root itself is no folder
        return None


def trim_namespace(root: Path, namespace_id: str, capacity_bytes: int, grace_s: float = 0.0, adapter: str = DEFAULT_TRIMMED,
                   settled: Callable[[int], bool] | None = None,
                   now: float | None = None) -> tuple[NamespaceUsage, NamespaceUsage]:
    """(swept, trimmed) of one pass over a namespace folder, a real directory, walked once for all the
    agent may ever delete there. Its abandoned temp files go first (by their exact name, untouched for
    ABANDONED_TEMP_S: the writer is gone, so no rename will commit them), then its oldest committed chunk
    files until they hold at most capacity_bytes. grace_s: no chunk younger goes. settled: asked with the
    chunks' total whether an excess may go now (the agent's settle time)."""
    folder = _served_folder(root, namespace_id)
    if folder is None:
        return NamespaceUsage(namespace_id), NamespaceUsage(namespace_id)
    now = time.time() if now is None else now
    chunks: list[ChunkFile] = []
    temps: list[ChunkFile] = []
    for path, name, st in _walk(folder):
        if not stat.S_ISREG(st.st_mode):
            continue
        f = ChunkFile(path, st.st_size, st.st_mtime, st.st_ino)
        if is_chunk_name(name, adapter):
            chunks.append(f)
        elif TRIMMED_ADAPTERS[adapter][1].fullmatch(name) and now - st.st_mtime > ABANDONED_TEMP_S:
            temps.append(f)
    swept = _unlink_unchanged(namespace_id, temps)
    total = sum(f.size for f in chunks)
    if settled is not None and not settled(total):
        return swept, NamespaceUsage(namespace_id)
    spare_after = now - grace_s if grace_s > 0 else None
    return swept, _unlink_unchanged(namespace_id, choose_oldest(chunks, total, capacity_bytes, spare_after))


def _unlink_unchanged(namespace_id: str, files: Iterable[ChunkFile]) -> NamespaceUsage:
    """What of files went: each deleted only if it is still the file chosen (lmcache may have renamed a
    fresh write onto its name)."""
    gone = NamespaceUsage(namespace_id)
    for f in files:
        try:
            st = os.lstat(f.path)
            if stat.S_ISREG(st.st_mode) and (st.st_ino, st.st_mtime) == (f.ino, f.mtime):
                os.unlink(f.path)
                gone.add(f.size, f.mtime)
        except FileNotFoundError:
            pass
    return gone


def one_per_location(volumes: list[tuple[str, str | None, Inventory]]) -> list[tuple[str, str | None, Inventory]]:
    """The first scan of each location: spec.l2.nvme.shared's servers mount one claim, whose bytes count once."""
    first: dict[str, tuple[str, str | None, Inventory]] = {}
    for volume in volumes:
        first.setdefault(volume[0], volume)
    return list(first.values())


def status_summary(volumes: list[tuple[str, str | None, Inventory]], current: str | None, live: set[str]) -> dict[str, Any]:
    """status.inventory: each (location, pod, inventory) with orphans marked, and what orphans hold.
    The served namespace's own share is status.usage's (served_of), not repeated here."""
    out_volumes = []
    orphaned_bytes = 0
    orphaned: set[str] = set()
    for location, pod, inv in volumes:
        for n in inv.namespaces:
            n.orphan = n.namespace_id not in live
            if n.namespace_id != current and n.orphan:
                orphaned.add(n.namespace_id)
                orphaned_bytes += n.bytes
        # Orphans first, largest (then longest unwritten) first; live namespaces last, largest first.
        ranked = sorted(inv.namespaces, key=lambda n: (not n.orphan, -n.bytes, n.last_write or 0.0))
        vol: dict[str, Any] = {"location": location, "namespaces": [n.to_json() for n in ranked]}
        # Not the filesystem's free space: it moves with every write anywhere on the disk, and status
        # is written only when something changed.
        vol.update({k: v for k, v in (("pod", pod), ("otherBytes", inv.other_bytes or None)) if v is not None})
        out_volumes.append(vol)
    return {"orphanedNamespaces": len(orphaned), "orphanedBytes": orphaned_bytes, "volumes": out_volumes}


def served_of(inventory: Mapping[str, Any] | None, namespace_id: str | None) -> tuple[int, int] | None:
    """(bytes, objects) of namespace_id over a status.inventory's volumes, or None without an inventory."""
    if not inventory or namespace_id is None:
        return None
    shares = [n for v in inventory.get("volumes") or [] for n in v.get("namespaces") or []
              if n.get("namespaceId") == namespace_id]
    return sum(int(n.get("bytes") or 0) for n in shares), sum(int(n.get("objects") or 0) for n in shares)
