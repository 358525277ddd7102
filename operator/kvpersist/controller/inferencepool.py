"""Whether the API server serves InferencePool (Gateway API Inference Extension), for
spec.vllm.inferencePool: discovery asked afresh at most once a CACHE_S (not at every apply; the
dynamic client's own cache outlives a deleted CRD). Meanwhile a Warning event says why no pool."""

from __future__ import annotations

import time

from kvpersist.builders.vllm import POOL_API_GROUP, POOL_API_VERSION, POOL_KIND
from kvpersist.controller import kube

CACHE_S = 60.0
API_MISSING = "InferencePoolAPIMissing"  # the Warning event's reason
_answer: tuple[float, bool] | None = None  # (when asked, served); replaced whole, so read without a lock


def served(now: float | None = None) -> bool:
    """Whether inference.networking.k8s.io/v1 InferencePool is served, as last asked (CACHE_S)."""
    global _answer
    now = time.monotonic() if now is None else now
    if _answer is not None and now - _answer[0] < CACHE_S:
        return _answer[1]
    # The dynamic client keeps discovery in a file every process shares (tempdir, osrcp-*.json): it
    # may still list a CRD deleted since. Asked afresh: the server's groups and this one group.
    kube.client().resources.invalidate_cache()
    found = kube.served(POOL_API_VERSION, POOL_KIND)
    _answer = (now, found)
    return found


def missing_message(name: str) -> str:
    return (f"spec.vllm.inferencePool is set but the InferencePool API (Gateway API Inference Extension, {POOL_API_GROUP}/v1) "
            f"is not installed in this cluster: no InferencePool {name} was made. Install the extension's CRDs; the "
            f"operator makes the pool within {CACHE_S:.0f} s")
