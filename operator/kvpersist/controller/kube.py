"""The operator's access to the API server: server-side apply and the reads status needs."""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import kubernetes
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ConflictError, NotFoundError, ResourceNotFoundError
from kubernetes.watch.watch import iter_resp_lines

FIELD_MANAGER = "kvpersist"
REQUEST_TIMEOUT_S = 30


def load_config(kubeconfig: str | None = None, context: str | None = None) -> None:
    """In a pod: its ServiceAccount. Elsewhere: the kubeconfig (the argument, $KUBECONFIG or ~/.kube/config)."""
    if kubeconfig is None and context is None:
        try:
            kubernetes.config.load_incluster_config()
            return
        except kubernetes.config.ConfigException:
            pass
    kubernetes.config.load_kube_config(config_file=kubeconfig, context=context)


# Connections kept to the API server, one per thread that may call it at once: urllib3's default of 10
# discarded connections under load ("Connection pool is full"), each new one a TLS handshake.
POOL_SIZE = 32


@functools.cache
def client() -> DynamicClient:
    config = kubernetes.client.Configuration.get_default_copy()
    config.connection_pool_maxsize = POOL_SIZE
    return DynamicClient(kubernetes.client.ApiClient(config))


def _plain(_client: Any, data: Any) -> Any:
    """The decoded JSON as it is: the default serializer (ResourceInstance, then .to_dict() back)
    walked every field twice, at scale a tenth of the operator's CPU."""
    return data


def served(api_version: str, kind: str) -> bool:
    """Whether the API server serves a kind (discovery, which every user may read)."""
    try:
        client().resources.get(api_version=api_version, kind=kind)
    except ResourceNotFoundError:
        return False
    return True


def _resource(api_version: str, kind: str) -> Any:
    return client().resources.get(api_version=api_version, kind=kind)


def apply(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Server-side apply as the operator's field manager. force: the operator owns these fields;
    a hand edit of them is drift to undo, not a conflict to stop on."""
    res = _resource(manifest["apiVersion"], manifest["kind"])
    return res.server_side_apply(body=dict(manifest), field_manager=FIELD_MANAGER, force_conflicts=True,
                                 _request_timeout=REQUEST_TIMEOUT_S, serializer=_plain)


def create_if_absent(manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """Creates an object unless one of its name exists (never overwritten: a generated key): the
    object as the API server created it (what a read would return until its resourceVersion
    changes), or None when one existed."""
    meta = manifest["metadata"]
    try:
        return _resource(manifest["apiVersion"], manifest["kind"]).create(
            body=dict(manifest), namespace=meta.get("namespace"), _request_timeout=REQUEST_TIMEOUT_S, serializer=_plain)
    except ConflictError:
        return None


def secret_value(secret: Mapping[str, Any] | None, key: str) -> bytes | None:
    """One key of a Secret as read (base64 in data), decoded; None when the Secret or key is absent."""
    raw = ((secret or {}).get("data") or {}).get(key)
    return base64.b64decode(raw) if raw else None


def get(api_version: str, kind: str, name: str, namespace: str | None) -> dict[str, Any] | None:
    """One object, or None; namespace None: a cluster-scoped one."""
    try:
        return _resource(api_version, kind).get(name=name, namespace=namespace, _request_timeout=REQUEST_TIMEOUT_S,
                                                serializer=_plain)
    except NotFoundError:
        return None


METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"


def get_metadata(api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    """An object's metadata only (the API server answers PartialObjectMetadata), or None when it
    does not exist: a Secret's labels can be checked without its data reaching the operator."""
    res = _resource(api_version, kind)
    try:
        out = client().request("get", res.path(name=name, namespace=namespace), header_params={"Accept": METADATA_ONLY},
                               _request_timeout=REQUEST_TIMEOUT_S, serializer=_plain)
    except NotFoundError:
        return None
    return dict(out.get("metadata") or {})


METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
LIST_PAGE = 500


def list_page(api_version: str, kind: str, namespace: str | None, metadata_only: bool,
              field_selector: str | None = None, label_selector: str | None = None,
              keep: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None,
              page: int = LIST_PAGE) -> tuple[list[dict[str, Any]], str]:
    """Every object of a kind (namespace None: all) and the resourceVersion to watch from, listed in pages,
    each object cut down by keep as its page arrives. metadata_only: a Secret's data never reaches the operator."""
    res = _resource(api_version, kind)
    headers = {"Accept": METADATA_LIST} if metadata_only else {}
    items: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        out = client().request("get", res.path(namespace=namespace), header_params=dict(headers), limit=page,
                               _continue=token, serialize=False, _request_timeout=REQUEST_TIMEOUT_S,
                               field_selector=field_selector, label_selector=label_selector)
        body = json.loads(out.data)
        del out  # the raw page, before the next is read
        items += [keep(i) for i in body.get("items") or []] if keep else body.get("items") or []
        meta = body.get("metadata") or {}
        del body
        token = meta.get("continue")
        if not token:
            return items, meta.get("resourceVersion", "")


def watch_page(api_version: str, kind: str, namespace: str | None, resource_version: str, timeout_s: int,
               metadata_only: bool, stop: threading.Event, field_selector: str | None = None,
               label_selector: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(type, object) of each event of one watch from resource_version, until the API server ends it
    or stop is set. Raises ApiException on an ERROR event (410: the version expired, list again)."""
    res = _resource(api_version, kind)
    headers = {"Accept": METADATA_ONLY} if metadata_only else {}
    resp = client().request("get", res.path(namespace=namespace), watch=True, header_params=headers,
                            resource_version=resource_version, timeout_seconds=timeout_s, serialize=False,
                            _request_timeout=(REQUEST_TIMEOUT_S, timeout_s + REQUEST_TIMEOUT_S),
                            field_selector=field_selector, label_selector=label_selector)
    try:
        for line in iter_resp_lines(resp):
            if stop.is_set():
                return
            event = json.loads(line)
            obj = event.get("object") or {}
            if event.get("type") == "ERROR":
                raise kubernetes.client.exceptions.ApiException(status=obj.get("code"), reason=obj.get("message"))
            yield event.get("type", ""), obj
    finally:
        resp.close()
        resp.release_conn()


def named_metadata(api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    """One object's metadata by name through a metadata-only LIST (kinds the operator may list but not
    get), or None: whether a name is taken, without reading what the object holds."""
    res = _resource(api_version, kind)
    out = client().request("get", res.path(namespace=namespace), field_selector=f"metadata.name={name}",
                           header_params={"Accept": METADATA_LIST}, _request_timeout=REQUEST_TIMEOUT_S, serializer=_plain)
    items = [i for i in out.get("items") or [] if (i.get("metadata") or {}).get("name") == name]
    return dict(items[0].get("metadata") or {}) if items else None


def list_all(api_version: str, kind: str, namespace: str | None = None, label_selector: str | None = None,
             field_selector: str | None = None) -> list[dict[str, Any]]:
    """Every object of a kind, in one namespace or (None) all of them."""
    out = _resource(api_version, kind).get(namespace=namespace, label_selector=label_selector,
                                           field_selector=field_selector, _request_timeout=REQUEST_TIMEOUT_S,
                                           serializer=_plain)
    return list(out.get("items") or [])


def may(verb: str, group: str, resource: str, namespace: str | None = None) -> bool:
    """Whether this client's own account may do verb on resource (namespace None: in every namespace), by a
    SelfSubjectAccessReview (every authenticated user may ask). Raises ApiException."""
    attributes = kubernetes.client.V1ResourceAttributes(verb=verb, group=group, resource=resource, namespace=namespace)
    review = kubernetes.client.V1SelfSubjectAccessReview(
        spec=kubernetes.client.V1SelfSubjectAccessReviewSpec(resource_attributes=attributes))
    out = kubernetes.client.AuthorizationV1Api().create_self_subject_access_review(review, _request_timeout=REQUEST_TIMEOUT_S)
    return bool(out.status and out.status.allowed)


def delete(api_version: str, kind: str, name: str, namespace: str) -> None:
    """Deletes one object; one already gone is fine."""
    with contextlib.suppress(NotFoundError):
        _resource(api_version, kind).delete(name=name, namespace=namespace, _request_timeout=REQUEST_TIMEOUT_S)


def patch_metadata(api_version: str, kind: str, name: str, namespace: str, patch: Mapping[str, Any]) -> None:
    """JSON merge patch of an object's labels and annotations only (None removes one), never its data or
    spec: the key Secret and the claims are not the operator's to apply over (kvpersist.builders.retained)."""
    if set(patch) != {"metadata"} or not set(patch["metadata"]) <= {"labels", "annotations"}:
        raise ValueError("patch_metadata patches labels and annotations only")
    res = _resource(api_version, kind)
    client().request("patch", res.path(name=name, namespace=namespace), body=dict(patch),
                     content_type="application/merge-patch+json", _request_timeout=REQUEST_TIMEOUT_S)


def patch_status(api_version: str, kind: str, name: str, namespace: str, status: Mapping[str, Any]) -> None:
    """JSON merge patch of the status subresource (a None value removes a field)."""
    res = _resource(api_version, kind)
    client().request("patch", res.path(name=name, namespace=namespace) + "/status", body={"status": dict(status)},
                     content_type="application/merge-patch+json", _request_timeout=REQUEST_TIMEOUT_S)


def post_event(owner: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """A core/v1 Event on the owner, as `kubectl describe` shows them; best effort: a lost event must never fail a reconcile."""
    meta = owner["metadata"]
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    seconds = now.split(".")[0] + "Z"
    body = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"],
                           "namespace": meta["namespace"], **({"uid": meta["uid"]} if meta.get("uid") else {})},
        "type": type_, "reason": reason, "message": message[:1024],
        "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER, "reportingInstance": FIELD_MANAGER,
        "firstTimestamp": seconds, "lastTimestamp": seconds, "eventTime": now, "action": reason, "count": 1,
    }
    try:
        _resource("v1", "Event").create(body=body, namespace=meta["namespace"], _request_timeout=REQUEST_TIMEOUT_S)
    except kubernetes.client.exceptions.ApiException:
        logging.getLogger(__name__).warning("could not post event %s on %s/%s", reason, meta["namespace"], meta["name"])
