"""The operator's entry module: importing it registers every kopf handler. `kvpersist run` imports
it, and tests/rbac_needs.py derives the operator's RBAC from what it reaches.

The handlers live in one module per role, each importing only those below it: runtime (the one
Controller, kopf's settings, the active replica), reading (one resource's Target, L2 key and policy
refusal), drift, indexes (the watch caches), apply, refresh (one resource's status), gc, tracking
(each resource's events), reconcile and status_loop. Thin on purpose: parsing lives in
kvpersist.api, hashing in kvpersist.identity, manifests in kvpersist.builders, status judgement in
kvpersist.status.conditions; the handlers order those and talk to the API server.
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
