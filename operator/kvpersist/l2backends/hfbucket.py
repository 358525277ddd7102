"""spec.l2.hfBucket: a Hugging Face bucket written by LMCache's hfbucket adapter under
`<bucketHandle>/<namespace id>`, with a token from a Secret that reaches the server only as a variable."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpersist.api.spec import L2, SecretKeyRef
from kvpersist.builders.target import HF_TOKEN_ENV, Target
from kvpersist.l2backends.backend import L2Backend

TOKEN_FIELD = "spec.l2.hfBucket.tokenSecretRef"
ROOT = "hf://buckets"  # a handle's scheme and root, before the bucket's owner


class HFBucket(L2Backend):
    field, adapter = "hfBucket", "hfbucket"
    secret_effects = ((TOKEN_FIELD, "the lmcache servers cannot reach the bucket"),)

    def adapter_config(self, target: Target, eviction: dict[str, Any], io_workers: int) -> dict[str, Any]:
        bucket = self.settings(target.spec.l2)
        return {
            "type": "hfbucket", "bucket_handle": f"{bucket.bucket_handle.rstrip('/')}/{target.namespace_id}",
            "token_env": HF_TOKEN_ENV,
            # Never lmcache: its create_bucket sets no visibility (public unless the org defaults to
            # private). The operator's preflight creates it private; a write before that is a failed store.
            "create_bucket_if_missing": False,
            "num_workers": bucket.num_workers, "metadata_cache_ttl_secs": bucket.metadata_cache_ttl_seconds,
            "max_capacity_gb": bucket.max_capacity_gb, "shared": True, "eviction": eviction,
        }

    def server_env(self, target: Target) -> list[dict[str, Any]]:
        """The token reaches the server only through the environment, from the Secret."""
        ref = self.settings(target.spec.l2).token_secret_ref
        return [{"name": HF_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]

    def secrets(self, l2: L2) -> list[tuple[str, SecretKeyRef]]:
        return [(TOKEN_FIELD, self.settings(l2).token_secret_ref)]

    def store(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The handle's path: under it and the namespace id the servers write."""
        handle = settings.get("bucketHandle")
        path = handle.removeprefix(f"{ROOT}/").split("/") if isinstance(handle, str) and handle else None
        return {"prefix": None if path is None else (ROOT, *(p for p in path if p)), "field": "spec.l2.hfBucket.bucketHandle"}
