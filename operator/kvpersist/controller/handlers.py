"""The operator's entry module: importing it registers every kopf handler. `kvpersist run` imports
it, and tests/rbac_needs.py derives the operator's RBAC from what it reaches.

One module per role, each importing only those below it (runtime, reading, drift, indexes, apply,
refresh, gc, tracking, reconcile, status_loop). Thin on purpose: parsing, hashing, manifests and
status judgement live in kvpersist.api, .identity, .builders and .status.conditions.
"""

from __future__ import annotations

from kvpersist.controller import (  # noqa: F401  (imported for the handlers they register)
    apply,
    drift,
    gc,
    indexes,
    reading,
    reconcile,
    refresh,
    runtime,
    status_loop,
    tracking,
)
