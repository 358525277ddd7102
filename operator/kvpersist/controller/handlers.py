"""The operator's entry module: importing it registers every kopf handler. `kvpersist run` imports
it, and tests/rbac_needs.py derives the operator's RBAC from what it reaches.
"""

from __future__ import annotations

from kvpersist.controller import (  # noqa: F401  (imported for the handlers they register)
    apply,
    drift,
    gc,
    indexes,
    reading,
    refresh,
    runtime,
    status_loop,
    tracking,
)
