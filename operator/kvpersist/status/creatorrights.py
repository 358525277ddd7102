"""Whether the creator-rights ValidatingAdmissionPolicy and its binding are there to enforce
anything (issue 42 item 9): without them any user who may create a KVCacheNamespace gets pods of
the image they name onto GPU nodes, with any Secret or claim of the namespace, and nothing else says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CONDITION = "CreatorRightsEnforced"
ENFORCED = "PolicyBound"
ABSENT = "PolicyMissing"
UNBOUND = "PolicyNotBound"
NOT_SERVED = "AdmissionPolicyAPIMissing"
UNREADABLE = "PolicyNotReadable"
FIX = ("install it: `helm upgrade ... --set creatorRights.enabled=true`, or `kubectl apply -f "
       "config/creator-rights/creator-rights.yaml` (docs/security.md, \"What creating a KVCacheNamespace reaches\")")
RISK = ("any user who may create a KVCacheNamespace gets lmcache and vLLM pods of the images it names onto GPU nodes, "
        "with any Secret, ConfigMap and claim of its namespace, whatever their own rights")


def judge(name: str, served: bool, policy: Mapping[str, Any] | None, binding: Mapping[str, Any] | None,
          refused: str | None = None) -> tuple[bool | None, str, str]:
    """(ok, reason, message). served: the API server serves admissionregistration.k8s.io/v1
    ValidatingAdmissionPolicy (Kubernetes >= 1.30); policy and binding: the objects of that name
    as read, None when absent; refused: why they could not be read (then nothing is claimed)."""
    if refused is not None:
        return None, UNREADABLE, (f"the operator could not read ValidatingAdmissionPolicy {name} ({refused}), so it cannot "
                                  "tell whether KVCacheNamespaces are checked against their creator's rights")
    if not served:
        return False, NOT_SERVED, (f"the API server does not serve ValidatingAdmissionPolicy (Kubernetes >= 1.30), so the "
                                   f"creator-rights policy {name} cannot run: {RISK}. Upgrade the cluster, or refuse "
                                   "KVCacheNamespaces from users without those rights with your own admission control")
    if policy is None:
        return False, ABSENT, f"ValidatingAdmissionPolicy {name} does not exist: {RISK}. Fix: {FIX}"
    spec = (binding or {}).get("spec") or {}
    if binding is None or spec.get("policyName") != name or "Deny" not in (spec.get("validationActions") or []):
        found = ("does not exist" if binding is None else f"binds {spec.get('policyName')!r} with "
                 f"{spec.get('validationActions') or []}")
        return False, UNBOUND, (f"ValidatingAdmissionPolicyBinding {name} {found}, so policy {name} refuses nothing "
                                f"(it needs policyName {name} and validationActions [Deny]): {RISK}. Fix: {FIX}")
    return True, ENFORCED, (f"ValidatingAdmissionPolicy {name} and its binding (Deny) exist: a KVCacheNamespace is "
                            "admitted only from a user who holds the rights its pods will")
