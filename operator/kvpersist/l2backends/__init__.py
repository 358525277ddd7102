"""The L2 backends, one module each behind kvpersist.l2backends.backend.L2Backend, keyed by the member
of spec.l2's union they serve. A new one: docs/design.md, "Adding an L2 backend"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpersist.api.spec import L2
from kvpersist.l2backends.backend import L2Backend
from kvpersist.l2backends.hfbucket import HFBucket
from kvpersist.l2backends.nvme import NVMe

BACKENDS: dict[str, L2Backend] = {b.field: b for b in (NVMe(), HFBucket())}


def backend_of(l2: L2) -> L2Backend:
    """The backend of the one member set (the API admits exactly one)."""
    return BACKENDS[l2.kind]


def stored_backend(l2: Mapping[str, Any]) -> tuple[L2Backend, Mapping[str, Any]] | None:
    """The backend and its settings of a stored spec.l2 (never parsed); None when it names none."""
    return next(((b, s) for b in BACKENDS.values() if isinstance(s := l2.get(b.field), Mapping)), None)
