"""The Secrets and ConfigMaps a spec names, and which of them do not exist (ReferencesFound):
the kubelet never starts a pod missing one (CreateContainerConfigError), and without this the
resource only says "0/1 pods ready". Read from metadata-only watch caches; unlisted: no claim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.l2backends import BACKENDS, backend_of

CONDITION = "ReferencesFound"
MISSING = "ReferenceMissing"
FOUND = "AllFound"
SECRET, CONFIGMAP = "Secret", "ConfigMap"
# What each missing object stops, for the message: a user fixes the one that blocks a pod first.
_EFFECT = {
    **{field: effect for backend in BACKENDS.values() for field, effect in backend.secret_effects},
    "spec.l2.encryption.keySecretRef": "the lmcache servers do not start (no L2 key)",
    "spec.vllm.hfTokenSecretRef": "the vLLM pods do not start",
    "spec.vllm.apiKeySecretRef": "the vLLM pods do not start",
    "spec.vllm.envFrom": "the vLLM pods do not start",
    "spec.imagePullSecrets": "images from a private registry cannot be pulled",
    "spec.prewarm.configMapRef": "its prompts are not warmed",
}


@dataclass(frozen=True)
class Reference:
    field: str
    kind: str  # SECRET or CONFIGMAP
    name: str


def named(spec: KVCacheNamespaceSpec) -> list[Reference]:
    """Every Secret and ConfigMap of the resource's namespace the spec names, in field order."""
    l2, vllm = spec.l2, spec.vllm
    secrets = (*backend_of(l2).secrets(l2),
               ("spec.l2.encryption.keySecretRef", l2.encryption.key_secret_ref if l2.encryption.enabled else None),
               ("spec.vllm.hfTokenSecretRef", vllm.hf_token_secret_ref),
               ("spec.vllm.apiKeySecretRef", vllm.api_key_secret_ref))
    out = [Reference(field, SECRET, ref.name) for field, ref in secrets if ref is not None]
    for i, source in enumerate(vllm.env_from):
        if source.secret_ref is not None:
            out.append(Reference(f"spec.vllm.envFrom[{i}].secretRef", SECRET, source.secret_ref.name))
        elif source.config_map_ref is not None:
            out.append(Reference(f"spec.vllm.envFrom[{i}].configMapRef", CONFIGMAP, source.config_map_ref.name))
    out += [Reference(f"spec.imagePullSecrets[{i}]", SECRET, s.name) for i, s in enumerate(spec.image_pull_secrets)]
    if spec.prewarm is not None and spec.prewarm.config_map_ref is not None:
        out.append(Reference("spec.prewarm.configMapRef", CONFIGMAP, spec.prewarm.config_map_ref.name))
    return out


def _effect(field: str) -> str:
    return _EFFECT.get(field.split("[", 1)[0].removesuffix(".secretRef").removesuffix(".configMapRef"), "")


def judge(refs: list[Reference], namespace: str,
          exists: Callable[[str, str], bool | None]) -> tuple[bool | None, str, str] | None:
    """(ok, reason, message) for ReferencesFound, or None when the spec names nothing. exists(kind,
    name): True/False, or None when the operator cannot tell yet (its cache has not listed); an
    unknown one is neither reported missing nor counted found."""
    if not refs:
        return None
    found = [exists(ref.kind, ref.name) for ref in refs]
    missing = [ref for ref, ok in zip(refs, found, strict=True) if ok is not None and not ok]
    if missing:
        parts = [f"{r.field} names {r.kind} {r.name}, which does not exist in {namespace}"
                 + (f" ({_effect(r.field)})" if _effect(r.field) else "") for r in missing]
        return False, MISSING, ("; ".join(parts) + ": create each in the resource's namespace, or correct the field; "
                                "the pods start once it exists")
    if None in found:
        return None, "NotChecked", "the operator has not listed Secrets and ConfigMaps yet"
    return True, FOUND, f"every Secret and ConfigMap the spec names exists ({len(refs)})"
