"""Whether the Secrets and ConfigMaps a spec names exist, for ReferencesFound
(kvpersist.status.references judges). From the metadata-only watch caches: no request per round
while they have listed, never an object's data; without a cache (a glob among the watched
namespaces) by a metadata-only request, as the Secret label check does. Blocking.
"""

from __future__ import annotations

from kubernetes.client.exceptions import ApiException

from kvpersist.builders.target import Target
from kvpersist.controller import runtime
from kvpersist.controller.reading import watched_metadata
from kvpersist.status import references


def exists(namespace: str, kind: str, name: str) -> bool | None:
    """True/False, or None when it cannot be told (a cache not listed yet, the API server refusing)."""
    cache = runtime.CONTROLLER.secret_cache if kind == references.SECRET else runtime.CONTROLLER.configmap_cache
    if cache is not None:
        synced, found = cache.lookup(namespace, name)
        return (found is not None) if synced else None
    try:  # no cache: by request, as watched_metadata reads without one
        return watched_metadata(kind, name, namespace) is not None
    except ApiException:
        return None


def condition_of(target: Target) -> tuple[bool | None, str, str] | None:
    """ReferencesFound's (ok, reason, message), or None when the spec names none."""
    return references.judge(references.named(target.spec), target.namespace,
                            lambda kind, name: exists(target.namespace, kind, name))
