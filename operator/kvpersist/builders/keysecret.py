"""The Secrets the operator generates: L2's master key (spec.l2.encryption with no keySecretRef)
and the inventory agent's bearer token.

Created once, only if absent, and never applied over: a new key makes every stored object
unreadable (misses, never wrong bytes). It carries no owner reference, so deleting the resource
keeps it, as it keeps the data; re-creating the resource under the same name reads the data
again. Deleting it is the user's call (`kubectl delete secret <name>-l2-key`). Unowned, it carries
no tracking label and refuses GitOps prunes (kvpersist.builders.retained): a pruned key is all of
L2 unreadable."""

from __future__ import annotations

import base64
import secrets
from typing import Any

from kvpersist.builders.retained import retained_annotations, retained_labels
from kvpersist.builders.target import AGENT_TOKEN_KEY, L2_KEY_BYTES, MANAGED_BY, Target

KEEP_ANNOTATION = "kvpersist.dev/keep"
L2_KEY_COMPONENT = "l2-key"


def build_key_secret(target: Target, key: bytes | None = None) -> dict[str, Any] | None:
    """The generated key Secret (random bytes unless given), or None when the user names one or L2
    is not encrypted."""
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
    """The agent's token (every server pod has an agent), random unless given. Unlike the key,
    the resource owns it (the handler adds the reference): worthless once the agents are gone.
    Created once; a token that changed under a running agent would lock the operator out of it."""
    return _secret({
        "name": target.agent_token_secret,
        "namespace": target.namespace,
        "labels": {**target.selector("agent-token"), "app.kubernetes.io/managed-by": MANAGED_BY},
    }, AGENT_TOKEN_KEY, (secrets.token_hex(32) if token is None else token).encode())


def _secret(metadata: dict[str, Any], key: str, value: bytes) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata,
            "data": {key: base64.b64encode(value).decode()}}
