"""What outlives a KVCacheNamespace, and how it stays out of GitOps prunes.

The generated L2 key Secret and the L2 claims have no owner on purpose: deleting the resource
must keep the data and the key without which it is unreadable. Unowned, they are what a GitOps
tool may prune: Argo CD (label tracking) takes every unowned object whose
`app.kubernetes.io/instance` names an Application as that Application's, and prunes it when git
lacks it (gitops-engine pkg/cache/cluster.go GetManagedLiveObjs: managed, and no ownerReferences);
`kubectl apply --prune -l app.kubernetes.io/instance=NAME` deletes what the selector matches and
carries kubectl's last-applied annotation (a Secret restored with `kubectl apply` does). So these
objects carry the resource's name under a label of the operator's own instead, and the
annotations the tools honour: Argo CD's `sync-options: Prune=false,Delete=false` and
`compare-options: IgnoreExtraneous`, Flux's `kustomize.toolkit.fluxcd.io/prune: disabled`.

A StatefulSet's claims get its selector's labels whatever the template says (the StatefulSet
controller copies them in), and a StatefulSet's selector and volumeClaimTemplates cannot change
once created: so the claims are fixed where they are, by a metadata patch, for existing
resources as for new ones (protect_patch; kvpersist.controller.retention applies it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TRACKING_LABEL = "app.kubernetes.io/instance"  # Argo CD's default tracking label, also a common prune selector
INSTANCE_LABEL = "kvpersist.dev/instance"  # the resource's name on what outlives it (kvpersist.status.workloads reads it)
ARGOCD_SYNC_OPTIONS = "argocd.argoproj.io/sync-options"
ARGOCD_COMPARE_OPTIONS = "argocd.argoproj.io/compare-options"
FLUX_PRUNE = "kustomize.toolkit.fluxcd.io/prune"
# The key the L2 data on a claim was last written under (a fingerprint, never the key): what tells
# the operator there is data a new key would make unreadable, when the resource's status is gone.
KEY_FINGERPRINT_ANNOTATION = "kvpersist.dev/l2-key-fingerprint"
PROTECTED_ANNOTATIONS = (ARGOCD_SYNC_OPTIONS, ARGOCD_COMPARE_OPTIONS, FLUX_PRUNE, KEY_FINGERPRINT_ANNOTATION)


def _options(value: str | None, drop: tuple[str, ...], add: tuple[str, ...]) -> str:
    """A comma-separated option list with `add` in it and other values of the same names out;
    what else a user put there stays."""
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
    """The JSON merge patch that makes an existing object (a claim the StatefulSet made, a key
    Secret made before this version or restored from a backup) safe from prunes, and records the
    key fingerprint its data needs when given; None when it is so already."""
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    want = retained_annotations(annotations)
    if fingerprint is not None:
        want[KEY_FINGERPRINT_ANNOTATION] = fingerprint
    label_patch: dict[str, str | None] = {}
    if TRACKING_LABEL in labels:
        label_patch[TRACKING_LABEL] = None
    if labels.get(INSTANCE_LABEL) != owner:
        label_patch[INSTANCE_LABEL] = owner
    annotation_patch = {k: v for k, v in want.items() if annotations.get(k) != v}
    patch = {key: value for key, value in (("labels", label_patch), ("annotations", annotation_patch)) if value}
    return {"metadata": patch} if patch else None
