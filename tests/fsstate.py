"""What a folder of KV files looks like, to show that something left it untouched."""

from __future__ import annotations

import hashlib
from pathlib import Path


def files_state(folder: Path) -> dict[str, tuple[int, int, str]]:
    """name -> (size, mtime_ns, sha256) for every file in folder."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.glob("*")) if p.is_file()}
