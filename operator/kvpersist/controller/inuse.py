"""Who uses a namespace id now, asked of the API server (never the watch caches): explicit gc
(kvpersist.controller.gc) and the age limit on old namespaces' folders (kvpersist.controller.retention,
spec.l2.orphanRetention) both ask it right before deleting."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from kvpersist.api import v1alpha1 as api
from kvpersist.builders.target import NAMESPACE_ID_LABEL, Target
from kvpersist.controller import kube, l2key, runtime
from kvpersist.inventory.cleanup import refusal
from kvpersist.status.users import users_of


def in_use_now(namespace_id: str, current: str | None) -> str | None:
    """Why namespace_id may not be deleted, from a LIST made now (never the watch caches) of every
    KVCacheNamespace and pod carrying a namespace id (runtime.listing_scopes): gc calls it right
    before each agent's /gc and each bucket batch. A failed read refuses too. Blocking."""
    where, scope = "all namespaces", "cluster-wide"
    try:
        scopes = runtime.listing_scopes()
        if scopes != runtime.ALL_NAMESPACES:
            where, scope = "the watched namespaces " + ", ".join(map(str, scopes)), "in each of them"
        resources = [r for ns in scopes for r in kube.list_all(api.API_VERSION, api.KIND, ns)]
        pods = [p for ns in scopes for p in kube.list_all("v1", "Pod", ns, NAMESPACE_ID_LABEL)]
    except ApiException as exc:
        return (f"could not check again who uses {namespace_id} (listing KVCacheNamespaces and pods in {where}, the "
                f"API server answered {exc.status}); the operator needs list on both {scope}")
    try:
        return refusal_now(namespace_id, current, resources, pods, fingerprint=_fingerprint_now)
    except ApiException as exc:
        return (f"could not check again who uses {namespace_id}: an L2 key Secret could not be read (the API server "
                f"answered {exc.status}), and a resource's namespace id needs its key")


def refusal_now(namespace_id: str, current: str | None, resources: Iterable[Mapping[str, Any]],
                pods: Iterable[Mapping[str, Any]],
                fingerprint: Callable[[Target], str | None] | None = None) -> str | None:
    """cleanup.refusal() judged from a fresh listing of KVCacheNamespaces and pods, naming who uses it.
    fingerprint: reads the L2 key of a resource whose status records none (users_of)."""
    why = refusal(namespace_id, current, frozenset())
    if why:
        return why
    users = users_of(namespace_id, resources, pods, fingerprint)
    if users:
        more = f" and {len(users) - 5} more" if len(users) > 5 else ""
        return f"{namespace_id} is now in use by {', '.join(users[:5])}{more} (checked again right before deleting)"
    return None


def _fingerprint_now(target: Target) -> str | None:
    """The fingerprint of the key a resource's servers would mount (it names a key Secret), read now
    from its Secret; None when the Secret or key is absent or short (it can use no namespace). Raises
    ApiException when unreadable."""
    assert target.key_secret is not None
    name, item = target.key_secret
    secret = kube.get("v1", "Secret", name, target.namespace)
    return l2key.read(secret, name, item, target.namespace, target.key_secret_generated,
                      kube.secret_value(secret, item)).fingerprint
