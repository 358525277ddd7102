"""The Secrets the operator generates: L2's master key (no keySecretRef) and the agent's bearer token.

Created once, only if absent, never applied over: a new key makes every stored object unreadable. The
key has no owner, so deleting the resource keeps it with the data (re-created, the resource reads it
again); it refuses GitOps prunes (kvpersist.builders.retained): a pruned key is all of L2 unreadable."""

from __future__ import annotations

import base64
import secrets
from typing import Any

from kvpersist.builders.retained import retained_annotations, retained_labels
from kvpersist.builders.target import AGENT_TOKEN_KEY, L2_KEY_BYTES, Target

KEEP_ANNOTATION = "kvpersist.dev/keep"
L2_KEY_COMPONENT = "l2-key"


def build_key_secret(target: Target, key: bytes | None = None) -> dict[str, Any] | None:
    """The generated key Secret (random unless given); None when the user names one or L2 is not encrypted."""
    if not target.key_secret_generated or target.key_secret is None:
        return None
    name, item = target.key_secret
    return _secret({
        "name": name,
        "namespace": target.namespace,
        "labels": retained_labels(target.name, L2_KEY_COMPONENT),
        "annotations": {KEEP_ANNOTATION: "the master key of this resource's L2 data: without it the data is "
                        "unreadable; kept when the KVCacheNamespace is deleted", **retained_annotations()},
    }, item, key if key is not None else secrets.token_bytes(L2_KEY_BYTES))


def build_agent_token_secret(target: Target, token: str | None = None) -> dict[str, Any]:
    """The agents' token, random unless given; the resource owns it (worthless without the agents).
    Created once: a token changed under a running agent would lock the operator out."""
    return _secret(target.metadata(target.agent_token_secret, "agent-token", per_id=False), AGENT_TOKEN_KEY,
                   (secrets.token_hex(32) if token is None else token).encode())


def _secret(metadata: dict[str, Any], key: str, value: bytes) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata,
            "data": {key: base64.b64encode(value).decode()}}
