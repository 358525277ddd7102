"""What the roles read of one resource before they act on it: the builders' view of it (target_of),
its L2 key (read from the Secret and judged, or as last known without a read) and why the
operator's policy refuses it. Shared by apply, the status refresh, gc and tracking.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kvpersist.api import v1alpha1 as api
from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.builders.target import Target
from kvpersist.controller import kube, l2key, ownership, pincheck, runtime
from kvpersist.controller.decision import target_for, unreadable_secret
from kvpersist.controller.policy import Refusal, secret_refusal
from kvpersist.controller.runtime import STATUS_INTERVAL_S
from kvpersist.identity import Resolution
from kvpersist.status import Verdict, references

# Parsed specs by (name, the spec as canonical JSON): the models are frozen and parsing is pure, so
# the status rounds of an unchanged resource parse it once, not every round (parsing was a fifth
# of the operator's CPU at 500 resources). Bounded: emptied when full.
_PARSED: dict[tuple[str, str], api.KVCacheNamespace] = {}
PARSED_MAX = 4096


def parsed_model(name: str, spec: Any) -> api.KVCacheNamespace:
    """The model of a spec (raises ValidationError, never cached)."""
    try:
        key = (name, json.dumps(spec, sort_keys=True, separators=(",", ":")))
    except (TypeError, ValueError):  # not JSON (a test's object): parsed as it is
        return api.KVCacheNamespace.model_validate({"spec": spec, "metadata": {"name": name}})
    found = _PARSED.get(key)
    if found is None:
        found = api.KVCacheNamespace.model_validate({"spec": spec, "metadata": {"name": name}})
        if len(_PARSED) >= PARSED_MAX:
            _PARSED.clear()
        _PARSED[key] = found
    return found


def target_of(body: Mapping[str, Any], fingerprint: str | None = None) -> tuple[Target, Resolution]:
    """The builders' view of the object and the reason its identity is incomplete (if it is).
    fingerprint: of the L2 key its servers mount (kvpersist.controller.l2key); without it an
    encrypted resource has no namespace id, so a Target for names and policy only. Raises
    ValidationError for a spec the operator cannot read."""
    meta = body["metadata"]
    spec = body.get("spec")
    # The last answer for this resource stands while its spec is the same object (the watch keeps
    # an unchanged spec's object across status events: tracking.remember) and the key and pin
    # verdict are the same: an idle round neither parses nor hashes again.
    state = runtime.CONTROLLER.get((meta.get("namespace", ""), meta["name"]))
    memo = state.target_memo if state is not None else None
    obj = memo[1] if memo is not None and memo[0] is spec else parsed_model(meta["name"], spec)
    pins = runtime.CONTROLLER.pin_files.facts(obj.spec, meta.get("namespace", ""), body.get("status"), pincheck.enabled())
    if memo is not None and memo[1] is obj and memo[2] == (fingerprint, pins):
        found = memo[3]
    else:  # the model's files fill the unset pins, or turn the cache off by contradicting one (no I/O here)
        found = target_for(meta["name"], meta.get("namespace", ""), obj.spec, fingerprint, pins)
    if state is not None and state.body is not None and spec is state.body.get("spec"):  # its own copy, never edited
        state.target_memo = (spec, obj, (fingerprint, pins), found)
    found, res = found
    domain = runtime.CONTROLLER.policy.cluster_domain
    return (dataclasses.replace(found, cluster_domain=domain) if domain else found), res


def hub_token(spec: KVCacheNamespaceSpec, namespace: str) -> tuple[pincheck.Scope, pincheck.TokenReader] | None:
    """The token of spec.vllm.hfTokenSecretRef, as the pin check reads a gated model's files with it
    (read when needed, in the check's own thread; kept nowhere). Only for a resource the policy
    lets use its Secrets."""
    ref = spec.vllm.hf_token_secret_ref
    if ref is None:
        return None

    def read() -> str | None:
        value = kube.secret_value(kube.get("v1", "Secret", ref.name, namespace), ref.key)
        return value.decode("utf-8", "replace").strip() if value else None

    return pincheck.scope_of(spec, namespace), read


KEY_READ_TTL_S = STATUS_INTERVAL_S  # the key Secret is read at most this often per resource (a rotation shows within it)


def read_key(target: Target, fresh: bool = False) -> l2key.KeyRead | None:
    """The key Secret the servers mount, judged (kvpersist.controller.l2key), or None when L2 is not
    encrypted; read at most every KEY_READ_TTL_S unless fresh. A failed read keeps the last
    fingerprint read from the same Secret (the Secret is there, the API server did not answer):
    a blip must not turn the cache off. The key's bytes are hashed here and kept nowhere. Blocking."""
    if target.key_secret is None:
        return None
    name, item = target.key_secret
    state = runtime.CONTROLLER.held((target.namespace, target.name))
    now = time.monotonic()
    cached = state.key_read
    same = cached is not None and (cached[1].secret, cached[1].item, cached[1].generated) == (name, item, target.key_secret_generated)
    synced, version = secret_version(target.namespace, name)
    if not fresh and same and (state.key_read_version == version if synced else now - cached[0] < KEY_READ_TTL_S):  # type: ignore[index]
        return cached[1]  # type: ignore[index]
    try:
        secret = kube.get("v1", "Secret", name, target.namespace)
    except ApiException as exc:
        if same and cached[1].fingerprint:  # type: ignore[index]
            return cached[1]  # type: ignore[index]
        return l2key.unreadable(name, item, target.key_secret_generated, exc.status)
    key = ownership.judged_key(target, secret)
    state.key_read = (now, key)
    state.key_read_version = ((secret or {}).get("metadata") or {}).get("resourceVersion")
    return key


def secret_version(namespace: str, name: str) -> tuple[bool, str | None]:
    """(whether the Secret watch cache knows, the Secret's resourceVersion or None when there is
    none): a read of its data stands while this stays the same."""
    cache = runtime.CONTROLLER.secret_cache
    if cache is None:
        return False, None
    synced, found = cache.lookup(namespace, name)
    return synced, (found["metadata"].get("resourceVersion") or "") if found is not None else None


def watched_metadata(kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    """A Secret's or ConfigMap's metadata as its watch cache keeps it (who it is, its controller, the
    labels read), from the cache when it has listed, else by request (metadata only either way: the
    data is never read for this). Blocking."""
    synced, found = cached_name(kind, name, namespace)
    if synced:
        return found
    if kind == "Secret":  # the kinds spelled out: tests/rbac_needs.py tells from them which right each call needs
        return kube.get_metadata("v1", "Secret", name, namespace)
    return kube.get_metadata("v1", "ConfigMap", name, namespace)


def references_found(target: Target) -> Verdict | None:
    """ReferencesFound (kvpersist.status.references judges), None when the spec names nothing: from the
    metadata-only watch caches, without one (a glob among the watched namespaces) by request. Blocking."""
    caches = {references.SECRET: runtime.CONTROLLER.secret_cache, references.CONFIGMAP: runtime.CONTROLLER.configmap_cache}

    def exists(kind: str, name: str) -> bool | None:
        """True/False, or None when it cannot be told (a cache not listed yet, the API server refusing)."""
        cache = caches[kind]
        if cache is not None:
            synced, found = cache.lookup(target.namespace, name)
            return (found is not None) if synced else None
        try:
            return watched_metadata(kind, name, target.namespace) is not None
        except ApiException:
            return None

    return references.judge(references.named(target.spec), target.namespace, exists)


def cached_name(kind: str, name: str, namespace: str) -> tuple[bool, dict[str, Any] | None]:
    """(whether kind's metadata-only watch cache has listed, the metadata it keeps of what holds the
    name or None): (False, None) when there is no such cache, or it has not listed, and the caller
    asks the API server. Never blocks."""
    caches = {"Secret": runtime.CONTROLLER.secret_cache, "ConfigMap": runtime.CONTROLLER.configmap_cache}
    cache = caches[kind] if kind in caches else runtime.CONTROLLER.name_caches.get(kind)
    if cache is None:
        return False, None
    synced, found = cache.lookup(namespace, name)
    return synced, (dict(found["metadata"]) if found is not None else None)


def named_claim(name: str, namespace: str) -> dict[str, Any] | None:
    """A claim the user named (existingClaimName), from the watch cache when it has listed, else
    by request. Blocking."""
    cache = runtime.CONTROLLER.claim_cache
    if cache is not None:
        synced, found = cache.lookup(namespace, name)
        if synced:
            return found
    return kube.get("v1", "PersistentVolumeClaim", name, namespace)


def l2_claims(target: Target) -> dict[str, dict[str, Any] | None]:
    """The L2 claims under derived names (ownership.l2_claim_names), each as it exists or None: the
    claim watch cache's when it has listed, else one LIST of the namespace's claims. Blocking."""
    names = ownership.l2_claim_names(target)
    if not names:
        return {}
    cache = runtime.CONTROLLER.claim_cache
    if cache is not None:
        found = {n: cache.lookup(target.namespace, n) for n in names}
        if all(synced for synced, _ in found.values()):
            return {n: claim for n, (_, claim) in found.items()}
    listed = {(c.get("metadata") or {}).get("name"): c for c in kube.list_all("v1", "PersistentVolumeClaim", target.namespace)}
    return {n: listed.get(n) for n in names}


def known_fingerprint(body: Mapping[str, Any]) -> str | None:
    """The key fingerprint without reading the Secret (in the event loop, for gc): the last read,
    else what status records for the same Secret."""
    meta = body["metadata"]
    state = runtime.CONTROLLER.get((meta["namespace"], meta["name"]))
    try:
        base, _ = target_of(body)
    except ValidationError:
        return None
    if base.key_secret is None:
        return None
    if state is not None and state.key_read is not None and state.key_read[1].secret == base.key_secret[0]:
        return state.key_read[1].fingerprint
    return l2key.fingerprint_in_status(body.get("status"), base.key_secret[0])


def named_secret_refusal(field: str, name: str, namespace: str) -> Refusal | None:
    """SecretNotAllowed when secretLabel is set and the Secret a user named lacks it, or None.
    Reads the Secret's metadata only. Blocking."""
    policy = runtime.CONTROLLER.policy
    if policy.secret_label is None:
        return None
    try:
        metadata = watched_metadata("Secret", name, namespace)
    except ApiException as exc:
        return unreadable_secret(field, name, exc.status)
    return secret_refusal(field, name, namespace, metadata, policy.secret_label)
