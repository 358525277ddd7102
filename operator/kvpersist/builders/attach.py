"""Attach mode (spec.vllm.mode Attached): status.attach, what the kvpersist-attach admission policies
check a user's own vLLM pod against and add to it, from the functions that launch managed pods, so
both run with the same flags. Pure. The policies are static (kvpersist.api.attachpolicy) and read this
status as their params: the operator needs no right on admission objects, and pods are judged while it is down.
"""

from __future__ import annotations

from typing import Any

from kvpersist.api.attachpolicy import LABEL as ATTACH_LABEL
from kvpersist.api.identity import pin_field
from kvpersist.builders.target import NAMESPACE_ID_LABEL, SERVER, Target
from kvpersist.builders.vllm import FIXED_ENV, PIN_FLAGS, kv_events_args, kv_events_env, kv_transfer_config_json
from kvpersist.identity import image_digest

ATTACHED = "Attached"


def attached(target: Target) -> bool:
    return target.spec.vllm.mode == ATTACHED


def attach_status(target: Target, bypassed: str | None = None) -> dict[str, Any] | None:
    """status.attach (camelCase), or None (a pod labelled for the resource is then refused): not
    Attached, no namespace id, an unpinned image, or the id's route names held by another id.
    bypassed: why the cache is off for vLLM now; the policies then admit new pods without the
    connection; running pods are the user's to restart (the CacheBypassed condition says)."""
    digest = image_digest(target.spec.image)
    if not attached(target) or target.namespace_id is None or digest is None or not target.routes:
        return None
    pins = target.spec.identity.resolved()
    return {
        "namespaceId": target.namespace_id,
        "model": target.spec.identity.model_id,
        "imageDigest": digest,
        "pins": [{"flag": flag, "value": str(pins[attr]), "field": pin_field(attr)}
                 for attr, flag in PIN_FLAGS if pins[attr] is not None],
        "args": ["--kv-transfer-config", kv_transfer_config_json(target), *kv_events_args(target)],
        "env": [*({"name": name, "value": value} for name, value in FIXED_ENV),
                *({"name": name, "fieldPath": path} for name, path in kv_events_env(target))],
        "serverSelector": target.id_selector(SERVER),
        **({"bypassed": bypassed} if bypassed is not None else {}),
    }


def attached_peer(target: Target) -> dict[str, Any]:
    """The policy's ZMQ peer for attached pods: only pods the policies admitted for this resource and
    id carry both labels (checked on every change)."""
    return {"podSelector": {"matchLabels": {ATTACH_LABEL: target.name, NAMESPACE_ID_LABEL: str(target.namespace_id)}}}
