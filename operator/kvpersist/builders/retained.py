"""What outlives a KVCacheNamespace, and how it stays out of GitOps prunes.

The generated L2 key Secret and the L2 claims have no owner on purpose: deleting the resource must
keep the data and its key. Unowned, a GitOps tool may prune them: Argo CD takes an unowned object whose
`app.kubernetes.io/instance` names an Application as its own (gitops-engine GetManagedLiveObjs), and
`kubectl apply --prune -l app.kubernetes.io/instance=NAME` deletes what matches. So they carry the
resource's name under a label of the operator's own, and the annotations the tools honour.

A StatefulSet's claims get its selector's labels whatever the template says, and its selector and
volumeClaimTemplates are immutable: so claims are fixed in place by a metadata patch (protect_patch,
applied by kvpersist.controller.retention).

The Secrets the operator generates are here too: L2's master key (no keySecretRef) and the agent's bearer
token, created once, only if absent, never applied over: a new key makes every stored object unreadable."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping
from typing import Any

from kvpersist.builders.target import AGENT_TOKEN_KEY, L2_KEY_BYTES, Target

TRACKING_LABEL = "app.kubernetes.io/instance"  # Argo CD's default tracking label, also a common prune selector
INSTANCE_LABEL = "kvpersist.dev/instance"  # the resource's name on what outlives it (kvpersist.status.workloads reads it)
ARGOCD_SYNC_OPTIONS = "argocd.argoproj.io/sync-options"
ARGOCD_COMPARE_OPTIONS = "argocd.argoproj.io/compare-options"
FLUX_PRUNE = "kustomize.toolkit.fluxcd.io/prune"
# The key fingerprint L2 data on a claim was last written under: tells the operator, with the
# resource's status gone, that there is data a new key would make unreadable.
KEY_FINGERPRINT_ANNOTATION = "kvpersist.dev/l2-key-fingerprint"
KEEP_ANNOTATION = "kvpersist.dev/keep"
L2_KEY_COMPONENT = "l2-key"
PROTECTED_ANNOTATIONS = (ARGOCD_SYNC_OPTIONS, ARGOCD_COMPARE_OPTIONS, FLUX_PRUNE, KEY_FINGERPRINT_ANNOTATION)


def _options(value: str | None, drop: tuple[str, ...], add: tuple[str, ...]) -> str:
    """A comma-separated option list with `add` in it and other values of its names out; the rest stays."""
    kept = [o.strip() for o in (value or "").split(",") if o.strip() and o.strip().split("=")[0] not in drop]
    return ",".join([*kept, *(a for a in add if a not in kept)])


def retained_annotations(existing: Mapping[str, str] | None = None) -> dict[str, str]:
    """The prune-refusing annotations, merged into whatever options an object already carries."""
    existing = existing or {}
    return {
        ARGOCD_SYNC_OPTIONS: _options(existing.get(ARGOCD_SYNC_OPTIONS), ("Prune", "Delete"), ("Prune=false", "Delete=false")),
        ARGOCD_COMPARE_OPTIONS: _options(existing.get(ARGOCD_COMPARE_OPTIONS), (), ("IgnoreExtraneous",)),
        FLUX_PRUNE: "disabled",
    }


def retained_labels(name: str, component: str) -> dict[str, str]:
    """Labels of an object that outlives the resource: no tracking label, the name under ours."""
    return {"app.kubernetes.io/name": "kvpersist", INSTANCE_LABEL: name, "app.kubernetes.io/component": component,
            "app.kubernetes.io/managed-by": "kvpersist"}


def protect_patch(metadata: Mapping[str, Any], owner: str, fingerprint: str | None = None) -> dict[str, Any] | None:
    """The JSON merge patch that makes an existing object (a StatefulSet's claim, an older or restored
    key Secret) safe from prunes and records the given key fingerprint; None when it is so already."""
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    want = retained_annotations(annotations)
    if fingerprint is not None:
        want[KEY_FINGERPRINT_ANNOTATION] = fingerprint
    # Label values are strings: a tracking label present is one to remove (None), ours one to set.
    label_patch = {k: v for k, v in ((TRACKING_LABEL, None), (INSTANCE_LABEL, owner)) if labels.get(k) != v}
    annotation_patch = {k: v for k, v in want.items() if annotations.get(k) != v}
    patch = {key: value for key, value in (("labels", label_patch), ("annotations", annotation_patch)) if value}
    return {"metadata": patch} if patch else None


def build_key_secret(target: Target, key: bytes | None = None) -> dict[str, Any] | None:
    """The generated key Secret (random unless given); None when the user names one or L2 is not encrypted. No
    owner: deleting the resource keeps it with the data (re-created, the resource reads it again)."""
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
