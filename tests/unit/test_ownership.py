"""Ours or not ours (kvpersist.controller.ownership): what the operator makes counts as its own (in
this version and as earlier ones made it), anything else under its names is refused, and
knowing its own names costs no reads in a steady state. The API server is faked here;
tests/e2e/test_no_adoption.py is the real one."""

from __future__ import annotations

import asyncio
import base64
import copy
import logging
import re
import time
from typing import Any

import kopf
import pytest

from kvpersist.api.identity import NAMESPACE_ID_LABEL
from kvpersist.builders.all import build_all
from kvpersist.builders.retained import build_agent_token_secret, build_key_secret, retained_labels
from kvpersist.controller import agents, apply, decision, drift, kube, l2key, ownership, reading, runtime, status_loop, watchcache
from kvpersist.controller.state import Controller
from kvpersist.status.workloads import Seen
from tests.cases.invalid_manifests import sample

LOG = logging.getLogger("test")
UID = "uid-of-this-resource"


def _body(uid: str = UID) -> dict[str, Any]:
    body = copy.deepcopy(sample())
    body["metadata"].update(namespace="ml", uid=uid, generation=1)
    return body


def _ref(uid: str = UID, controller: bool | None = True, kind: str = "KVCacheNamespace",
         api_version: str = "kvpersist.dev/v1alpha1") -> dict[str, Any]:
    ref = {"apiVersion": api_version, "kind": kind, "name": "llama31-8b", "uid": uid}
    if controller is not None:
        ref["controller"] = controller
    return ref


@pytest.mark.parametrize(("refs", "ours"), [
    ([_ref()], True),
    ([_ref(api_version="kvpersist.dev/v1beta1")], True),  # a later version of the API: the same resource
    ([{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "x"}, _ref()], True),
    ([_ref(controller=False)], False),  # a reference only: not what the operator sets
    ([_ref(controller=None)], False),
    ([_ref(uid="uid-of-a-deleted-namesake")], False),  # the same name, made again: another resource
    ([_ref(kind="Deployment", api_version="apps/v1")], False),
    ([_ref(api_version="evil.example/v1alpha1")], False),
    ([], False),
    (None, False),
])
def test_a_child_is_ours_only_with_a_controller_reference_to_this_resource(refs, ours) -> None:
    meta = {"name": "llama31-8b-vllm", "labels": {"app.kubernetes.io/managed-by": "kvpersist"}}
    if refs is not None:
        meta["ownerReferences"] = refs
    assert ownership.is_own_child(meta, UID) is ours
    assert ownership.is_own_child(meta, None) is False  # a resource without uid owns nothing


def test_labels_alone_make_no_child_ours() -> None:
    """Every label the operator sets, copied onto a user's object: still not its own."""
    target, _ = reading.target_of(_body())
    for manifest in build_all(target):
        assert not ownership.is_own_child(manifest["metadata"], UID), manifest["kind"]


def test_what_the_operator_makes_is_its_own() -> None:
    """Every object the apply makes (with the owner reference it appends, as every version did),
    the agent token Secret, and the generated key Secret as built now."""
    body = _body()
    target, _ = reading.target_of(body, "f" * 16)
    made = [*build_all(target), build_agent_token_secret(target)]
    for manifest in made:
        by_kopf = copy.deepcopy(manifest)
        kopf.append_owner_reference(by_kopf, owner=body)  # what every earlier version wrote
        assert ownership.owned_by(manifest, body) == by_kopf == ownership.owned_by(manifest, body)  # the same, once
        assert ownership.is_own_child(manifest["metadata"], UID), manifest["kind"]
    key = build_key_secret(target)
    assert key is not None and "ownerReferences" not in key["metadata"]
    assert ownership.is_own_key_secret(key["metadata"], target.name)


OLD_KEY_LABELS = {"app.kubernetes.io/name": "kvpersist", "app.kubernetes.io/instance": "llama31-8b",
                  "app.kubernetes.io/component": "l2-key", "app.kubernetes.io/managed-by": "kvpersist"}


@pytest.mark.parametrize(("labels", "ours"), [
    (retained_labels("llama31-8b", "l2-key"), True),
    (OLD_KEY_LABELS, True),  # made before kvpersist.builders.retained (its tracking label not yet moved)
    ({**retained_labels("llama31-8b", "l2-key"), "kvpersist.dev/usable-by": "kvpersist"}, True),
    ({}, False),  # kubectl create secret generic llama31-8b-l2-key ...
    (None, False),
    (retained_labels("another", "l2-key"), False),
    ({**OLD_KEY_LABELS, "app.kubernetes.io/instance": "another"}, False),
    ({**retained_labels("llama31-8b", "l2-key"), "app.kubernetes.io/component": "agent-token"}, False),
    ({k: v for k, v in retained_labels("llama31-8b", "l2-key").items() if k != "app.kubernetes.io/managed-by"}, False),
])
def test_the_key_secret_is_ours_by_the_labels_every_version_gave_it(labels, ours) -> None:
    meta = {"name": "llama31-8b-l2-key"} if labels is None else {"name": "llama31-8b-l2-key", "labels": labels}
    assert ownership.is_own_key_secret(meta, "llama31-8b") is ours


def test_the_message_names_each_object_and_the_fix() -> None:
    message = ownership.taken_message("r", "ml", [("Secret", "r-agent-token"), ("ConfigMap", "r-connection")])
    assert "ConfigMap r-connection, Secret r-agent-token" in message
    assert "kubectl delete configmap r-connection -n ml" in message and "another name" in message


# ---------------------------------------------------------------- the apply, against a fake API server


class Api:
    """The objects under the resource's names (by (kind, name): metadata), and what is read and written."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, existing: dict[tuple[str, str], dict[str, Any]] | None = None) -> None:
        self.existing = existing or {}
        self.reads: list[tuple[str, str]] = []
        self.applied: list[dict[str, Any]] = []
        self.created: list[dict[str, Any]] = []
        self.deleted: list[tuple[str, str]] = []
        monkeypatch.setattr(runtime, "CONTROLLER", Controller())
        self.secrets: dict[str, dict[str, Any]] = {}  # what the operator created, as read back (L2's key)
        monkeypatch.setattr(kube, "get", lambda v, kind, name, ns: self.secrets.get(name) if kind == "Secret" else None)
        self.listed: list[tuple[str, str]] = []  # (kind, field selector) of each LIST by name (the route names)
        monkeypatch.setattr(kube, "list_all", self._list)  # no other user of its claim, no route in the way
        monkeypatch.setattr(kube, "named_metadata", self._named)
        monkeypatch.setattr(kube, "get_metadata", self._read)
        monkeypatch.setattr(kube, "apply", self._apply)
        monkeypatch.setattr(kube, "create_if_absent", self._create)
        monkeypatch.setattr(kube, "post_event", lambda *a: None)
        monkeypatch.setattr(kube, "delete", self._delete)

    def _read(self, api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        self.reads.append((kind, name))
        return self.existing.get((kind, name))

    def _named(self, api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        """A LIST by name: a route name's (8 hex of the id, looked at every apply) counted as listed."""
        if re.search(r"-lmcache-[0-9a-f]{8}$", name):
            self.listed.append((kind, f"metadata.name={name}"))
            return self.existing.get((kind, name))
        return self._read(api_version, kind, name, namespace)

    def _list(self, api_version: str, kind: str, namespace: str | None = None, label_selector: str | None = None,
              field_selector: str | None = None) -> list[dict[str, Any]]:
        if field_selector:
            self.listed.append((kind, field_selector))
        return []

    def _apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.applied.append(manifest)
        self.existing[(manifest["kind"], manifest["metadata"]["name"])] = manifest["metadata"]
        return manifest

    def _delete(self, api_version: str, kind: str, name: str, namespace: str) -> None:
        self.deleted.append((kind, name))
        self.existing.pop((kind, name), None)

    def _create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        if (manifest["kind"], manifest["metadata"]["name"]) in self.existing:
            return None
        self.created.append(manifest)
        made = {**manifest, "metadata": {**manifest["metadata"], "resourceVersion": "1"}}  # as the API server answers
        self.secrets[manifest["metadata"]["name"]] = made
        self.existing[(manifest["kind"], manifest["metadata"]["name"])] = made["metadata"]
        return made


class Cached:
    """A watch cache as its view keeps the objects, listed (synced) or not yet."""

    def __init__(self, objects: dict[str, dict[str, Any]], keep: Any, synced: bool = True) -> None:
        self.objects = {name: keep({"metadata": meta}) for name, meta in objects.items()}
        self.synced = synced

    def lookup(self, namespace: str, name: str) -> tuple[bool, dict[str, Any] | None]:
        return (True, self.objects.get(name)) if self.synced else (False, None)


def cache_names(objects: dict[tuple[str, str], dict[str, Any]], synced: bool = True) -> None:
    """Every watch cache the names check reads (Secrets, ConfigMaps, watchcache.NAMED_KINDS), holding
    objects (by (kind, name): metadata) as each cache's own view keeps them."""
    def of(kind: str, keep: Any) -> Cached:
        return Cached({name: meta for (k, name), meta in objects.items() if k == kind}, keep, synced)

    runtime.CONTROLLER.configmap_cache = of("ConfigMap", watchcache.names_view)  # type: ignore[assignment]
    runtime.CONTROLLER.secret_cache = of("Secret", watchcache.secrets(None).keep)  # type: ignore[assignment]
    runtime.CONTROLLER.name_caches = {kind: of(kind, watchcache.names(version, kind, None).keep)  # type: ignore[misc]
                                      for version, kind in watchcache.NAMED_KINDS}


@pytest.mark.parametrize("taken", [None, ("Secret", "llama31-8b-agent-token"), ("StatefulSet", "llama31-8b-lmcache"),
                                   ("Deployment", "llama31-8b-vllm")])
def test_the_names_an_apply_takes_are_judged_from_the_watch_caches(monkeypatch, taken) -> None:
    """Issue 58 item 6: the names check and the route names ask the API server nothing once the
    metadata-only caches of their kinds have listed; what the caches keep (the controller reference)
    still tells a user's object under a derived name from the resource's own."""
    users = {"name": taken and taken[1], "namespace": "ml", "uid": "theirs", "ownerReferences": [_ref(uid="another")]}
    api = Api(monkeypatch)
    cache_names({taken: users} if taken else {})
    body = _body()
    key = ("ml", body["metadata"]["name"])
    runtime.CONTROLLER.state(key).body = body
    assert apply.apply_workloads(body, LOG)
    assert api.reads == [] and api.listed == []  # no name looked up by request, the route names neither
    state = runtime.CONTROLLER.state(key)
    if taken is None:
        assert state.name_taken is None and any(m["kind"] == "StatefulSet" for m in api.applied)
    else:
        assert state.name_taken is not None and f"{taken[0]} {taken[1]}" in state.name_taken[1] and api.applied == []


def test_whose_route_name_it_is_is_seen_in_the_watch_cache(monkeypatch) -> None:
    """The Service and NetworkPolicy caches keep the labels that say which id an object routes for:
    this id's own routes are its own, another id's Service under the name leaves the routes out
    (RouteNameTaken); neither read by request."""
    api = Api(monkeypatch)
    cache_names({})
    body = _body()
    key = ("ml", body["metadata"]["name"])
    state = runtime.CONTROLLER.state(key)
    state.body = body
    assert apply.apply_workloads(body, LOG)
    route = state.applied[1].target.per_id_name(state.applied[1].target.namespace_id)
    cache_names({k: meta for k, meta in api.existing.items() if k[1] == route})  # as applied
    assert apply.apply_workloads(body, LOG) and state.route_taken is None
    other_id = {"name": route, "labels": {"kvpersist.dev/namespace-id": "0" * 16, "app.kubernetes.io/instance": "llama31-8b"}}
    cache_names({("Service", route): other_id})
    assert apply.apply_workloads(body, LOG)
    assert api.reads == [] and api.listed == [] and route in (state.route_taken or "")


def test_an_unlisted_names_cache_falls_back_to_the_request(monkeypatch) -> None:
    users = {"name": "llama31-8b-vllm", "ownerReferences": [_ref(uid="another")]}
    api = Api(monkeypatch, {("Deployment", "llama31-8b-vllm"): users})
    cache_names({("Deployment", "llama31-8b-vllm"): users}, synced=False)
    body = _body()
    key = ("ml", body["metadata"]["name"])
    runtime.CONTROLLER.state(key).body = body
    assert apply.apply_workloads(body, LOG)
    assert {kind for kind, _ in api.reads} == {"Secret", "StatefulSet", "Deployment"}
    assert sorted(kind for kind, _ in api.listed) == ["NetworkPolicy", "Service"]  # the route names
    assert "Deployment llama31-8b-vllm" in runtime.CONTROLLER.state(key).name_taken[1]


@pytest.mark.parametrize("taken", [("StatefulSet", "llama31-8b-lmcache"), ("Deployment", "llama31-8b-vllm"),
                                   ("Secret", "llama31-8b-agent-token")])
def test_an_object_it_did_not_make_stops_the_whole_apply_until_it_is_gone(monkeypatch, taken) -> None:
    users = {"name": taken[1], "labels": {"app.kubernetes.io/managed-by": "kvpersist"},  # our label, copied
             "ownerReferences": [_ref(controller=False)]}
    api = Api(monkeypatch, {taken: users})
    body = _body()
    key = ("ml", body["metadata"]["name"])
    runtime.CONTROLLER.state(key).body = body
    assert apply.apply_workloads(body, LOG)
    state = runtime.CONTROLLER.state(key)
    assert api.applied == [] and api.created == []  # nothing at all: not even the Secrets or policies
    assert state.name_taken is not None and state.name_taken[0] == ownership.NAME_TAKEN
    assert f"{taken[0]} {taken[1]}" in state.name_taken[1] and state.apply_error is None
    assert api.existing[taken] is users

    # Looked at again only after RETRY_S (a status refresh marks it), and still refused while there;
    # any other reason to apply (here: the key still to make, nothing made) waits for that moment too.
    assert apply.taken_recheck(key) == state.name_taken and not state.drifted
    now = time.monotonic()
    state.drifted = True
    assert not status_loop.may_apply(key, state, now) and status_loop.may_apply(key, state, now + ownership.RETRY_S)
    state.drifted = False
    state.name_taken_retry_at = 0.0
    assert apply.taken_recheck(key) is not None and state.drifted and status_loop.may_apply(key, state, now)
    assert apply.apply_workloads(body, LOG)
    assert api.applied == [] and state.name_taken_retry_at > now and not status_loop.may_apply(key, state, now)

    # Gone: the next apply makes everything, the operator's own.
    del api.existing[taken]
    assert apply.apply_workloads(body, LOG)
    assert state.name_taken is None and apply.taken_recheck(key) is None
    made = {(m["kind"], m["metadata"]["name"]) for m in api.applied + api.created}
    assert taken in made and ("StatefulSet", "llama31-8b-lmcache") in made


def test_its_own_names_are_read_once_then_never_in_a_steady_state(monkeypatch) -> None:
    api = Api(monkeypatch)
    body = _body()
    key = ("ml", body["metadata"]["name"])
    runtime.CONTROLLER.state(key).body = body
    assert apply.apply_workloads(body, LOG)  # first apply: every name looked up (all free), then made
    first = list(api.reads)
    assert ("Secret", "llama31-8b-agent-token") in first and ("StatefulSet", "llama31-8b-lmcache") in first
    api.reads.clear()
    assert apply.apply_workloads(body, LOG)
    assert api.reads == [] and runtime.CONTROLLER.state(key).name_taken is None

    # A restarted operator: what the drift watch lists (with the owner references) is known as its own.
    monkeypatch.setattr(runtime, "CONTROLLER", Controller())
    runtime.CONTROLLER.state(key).body = body
    for manifest in api.applied:
        meta = {**manifest["metadata"], "generation": 1}
        asyncio.run(drift.drift(event={"type": None}, body={"kind": manifest["kind"], "metadata": meta}))
    api.reads.clear()
    assert apply.apply_workloads(body, LOG)
    assert api.reads == [("Secret", "llama31-8b-agent-token")]  # Secrets are not watched: looked up once


def test_a_deleted_child_is_looked_up_again(monkeypatch) -> None:
    """Its DELETED event (or its label removed: the watch selects by label) forgets it as the
    operator's own: whatever holds the name next is looked at before an apply."""
    api = Api(monkeypatch)
    body = _body()
    key = ("ml", body["metadata"]["name"])
    runtime.CONTROLLER.state(key).body = body
    assert apply.apply_workloads(body, LOG)
    vllm = next(m for m in api.applied if m["metadata"]["name"] == "llama31-8b-vllm")
    asyncio.run(drift.drift(event={"type": "DELETED"}, body={"kind": "Deployment", "metadata": vllm["metadata"]}))
    api.existing[("Deployment", vllm["metadata"]["name"])] = {"name": vllm["metadata"]["name"]}  # a user's, made meanwhile
    api.reads.clear()
    api.applied.clear()
    assert apply.apply_workloads(body, LOG)
    assert api.reads == [("Deployment", vllm["metadata"]["name"])] and api.applied == []
    assert "Deployment llama31-8b-vllm" in runtime.CONTROLLER.state(key).name_taken[1]


# What an earlier version made and this one no longer writes (decision.RETIRED): every server's
# agent-port policy (now in each namespace id's policy), the connection ConfigMap and the headless Service.
EARLIER = [("NetworkPolicy", "llama31-8b-lmcache"), ("ConfigMap", "llama31-8b-connection"),
           ("Service", "llama31-8b-lmcache-metrics")]


def _listed(api: Api, refs: list[dict[str, Any]]) -> None:
    """EARLIER's objects as that version labelled them (the cache on: the id), listed by the drift watch."""
    for kind, name in EARLIER:
        meta = {"name": name, "namespace": "ml", "ownerReferences": refs,
                "labels": {"app.kubernetes.io/managed-by": "kvpersist", "app.kubernetes.io/instance": "llama31-8b",
                           NAMESPACE_ID_LABEL: "kvp-0123456789abcdef"}}
        api.existing[(kind, name)] = meta
        asyncio.run(drift.drift(event={"type": None}, body={"kind": kind, "metadata": meta}))


@pytest.mark.parametrize("listed_first", [True, False])
def test_an_earlier_versions_policy_and_configmap_are_deleted_once(monkeypatch, caplog, listed_first) -> None:
    """Upgraded: the resource's own are deleted by its first apply that knows them (watch events tell),
    and once only. Listed after that apply looked (the watches start side by side), the listing marks
    the resource for the apply that deletes them."""
    api = Api(monkeypatch)
    body = _body()
    state = runtime.CONTROLLER.state(("ml", "llama31-8b"))
    state.body = body
    if listed_first:
        _listed(api, [_ref()])
    with caplog.at_level(logging.INFO, logger="test"):
        assert apply.apply_workloads(body, LOG)
        if not listed_first:
            assert api.deleted == [] and not state.drifted
            _listed(api, [_ref()])
            assert state.drifted
            assert apply.apply_workloads(body, LOG)
    assert sorted(api.deleted) == sorted(EARLIER) and state.name_taken is None
    state.drifted = False
    for kind, name in EARLIER:  # the watch's DELETED events of the operator's own deletes: no drift, no apply again
        meta = {"name": name, "namespace": "ml", "ownerReferences": [_ref()],
                "labels": {"app.kubernetes.io/managed-by": "kvpersist", "app.kubernetes.io/instance": "llama31-8b"}}
        asyncio.run(drift.drift(event={"type": "DELETED"}, body={"kind": kind, "metadata": meta}))
    assert not state.drifted
    assert "deleted NetworkPolicy llama31-8b-lmcache: one NetworkPolicy per namespace id replaced it" in caplog.text
    assert "deleted ConfigMap llama31-8b-connection: no longer made: status.namespaceId shows" in caplog.text
    assert "deleted Service llama31-8b-lmcache-metrics: no longer made: nothing resolved the servers" in caplog.text
    assert [m["metadata"]["name"] for m in api.applied if m["kind"] == "NetworkPolicy"] == \
        [f"llama31-8b-lmcache-{state.applied[1].target.namespace_id[4:12]}"] * (1 if listed_first else 2)
    api.deleted.clear()
    assert apply.apply_workloads(body, LOG) and api.deleted == []


@pytest.mark.parametrize("refs", [[], [_ref(controller=False)], [_ref(uid="uid-of-a-deleted-namesake")]])
def test_a_users_object_under_an_earlier_versions_name_is_never_touched(monkeypatch, refs) -> None:
    """Labels copied, a reference that is no controller's, a deleted namesake's: not this resource's.
    Not a name this version writes either: no NameTaken, and no apply for its listing."""
    api = Api(monkeypatch)
    body = _body()
    state = runtime.CONTROLLER.state(("ml", "llama31-8b"))
    state.body = body
    _listed(api, refs)
    assert not state.drifted
    assert apply.apply_workloads(body, LOG)
    assert api.deleted == [] and state.name_taken is None and api.applied
    assert all((kind, name) in api.existing for kind, name in EARLIER)


def test_a_planted_key_secret_is_never_read_nor_patched(monkeypatch) -> None:
    planted = {"metadata": {"name": "llama31-8b-l2-key", "labels": {}},
               "data": {"master-key": base64.b64encode(b"p" * 32).decode()}}
    monkeypatch.setattr(runtime, "CONTROLLER", Controller())
    monkeypatch.setattr(kube, "get", lambda v, kind, name, ns: planted if kind == "Secret" else None)

    def never(*_a: Any) -> None:
        raise AssertionError("the planted Secret's bytes were read")

    monkeypatch.setattr(kube, "secret_value", never)
    target, _ = reading.target_of(_body())
    read = reading.read_key(target, fresh=True)
    assert read is not None and read.fingerprint is None and not read.absent
    assert read.problem is not None and read.problem[0] == l2key.KEY_NOT_OWNED and "llama31-8b-l2-key" in read.problem[1]
    assert read.metadata is None  # nothing for protect_retained to patch onto it
    # Not absent, so no key is generated over it either (kvpersist.controller.apply), and the cache is off.
    assert decision.used_key(decision.Snapshot(_body(), target.spec, key=read, server_claims=())) == (read, None, None)
    assert reading.target_of(_body(), read.fingerprint)[0].namespace_id is None


def test_a_planted_agent_token_is_never_sent_to_the_agents(monkeypatch) -> None:
    body = _body()
    token = {"metadata": {"name": "llama31-8b-agent-token"}, "data": {"token": base64.b64encode(b"users-token").decode()}}
    monkeypatch.setattr(runtime, "CONTROLLER", Controller())
    monkeypatch.setattr(kube, "get", lambda *a: token)
    runtime.CONTROLLER.state(("ml", "llama31-8b")).body = body
    target, _ = reading.target_of(body)
    assert agents.agent_token(target) is None
    token["metadata"]["ownerReferences"] = [_ref()]
    runtime.CONTROLLER.state(("ml", "llama31-8b")).agent_token = None
    assert agents.agent_token(target) == "users-token"  # the operator's own (the reference it sets)


class SecretsWatched:
    """The Secret watch cache, listed, showing the Secrets in the fake API as they are now."""

    def __init__(self, secrets: dict[str, dict[str, Any]]) -> None:
        self.secrets = secrets

    def lookup(self, namespace: str, name: str) -> tuple[bool, dict[str, Any] | None]:
        found = self.secrets.get(name)
        return True, (watchcache.secrets(None).keep(found) if found is not None else None)


def test_the_secrets_it_made_are_not_read_back(monkeypatch) -> None:
    """Issue 58 item 6: the key and agent token Secrets are known as the apply created them (the
    create answers with their version, and with any Secret under the name it fails): a refresh reads
    neither while the Secret watch cache shows that version. Made again by someone else (a new
    version), the token is read and judged, and not theirs, never used."""
    api = Api(monkeypatch)
    cache_names({})
    runtime.CONTROLLER.secret_cache = SecretsWatched(api.secrets)  # type: ignore[assignment]
    body = _body()
    state = runtime.CONTROLLER.state(("ml", body["metadata"]["name"]))
    state.body = body
    assert apply.apply_workloads(body, LOG)
    gets: list[str] = []
    monkeypatch.setattr(kube, "get", lambda v, kind, name, ns: gets.append(name) or api.secrets.get(name))
    target = state.applied[1].target
    made = base64.b64decode(api.secrets["llama31-8b-agent-token"]["data"]["token"]).decode()
    assert reading.read_key(target) == state.applied[1].key and agents.agent_token(target) == made and gets == []
    api.secrets["llama31-8b-agent-token"] = {"metadata": {"name": "llama31-8b-agent-token", "resourceVersion": "2"},
                                             "data": {"token": base64.b64encode(b"users-token").decode()}}
    assert agents.agent_token(target) is None and gets == ["llama31-8b-agent-token"]


def test_a_new_resource_has_no_stale_routes_to_look_for(monkeypatch) -> None:
    """Issue 58 item 6: the first apply of a resource that never had a namespace id leaves no route
    cleanup pending (two LISTs a new resource); a later apply, or one after a restart (the stored
    status names an id), does."""
    Api(monkeypatch)
    body = _body()
    key = ("ml", body["metadata"]["name"])
    runtime.CONTROLLER.state(key).body = body
    assert apply.apply_workloads(body, LOG)
    state = runtime.CONTROLLER.state(key)
    assert state.applied is not None and not state.routes_pending
    assert apply.apply_workloads(body, LOG) and state.routes_pending
    restarted = {**body, "status": {"namespaceId": "kvp-" + "a" * 32}}
    monkeypatch.setattr(runtime, "CONTROLLER", Controller())
    runtime.CONTROLLER.state(key).body = restarted
    assert apply.apply_workloads(restarted, LOG) and runtime.CONTROLLER.state(key).routes_pending


def test_only_its_own_stale_routes_are_deleted(monkeypatch) -> None:
    """clean_stale_routes deletes an old id's Service and policy only when the resource controls
    them: a user's object with the same labels and a per-id name is left alone."""
    monkeypatch.setattr(runtime, "CONTROLLER", Controller())
    body = _body()
    runtime.CONTROLLER.state(("ml", "llama31-8b")).body = body
    target, _ = reading.target_of(body, "f" * 16)
    old = "kvp-" + "a" * 32
    labels = {"app.kubernetes.io/instance": "llama31-8b", "app.kubernetes.io/component": "lmcache-server",
              "kvpersist.dev/namespace-id": old}
    own = {"metadata": {"name": target.per_id_name(old), "labels": labels, "ownerReferences": [_ref()]}}
    users = {"metadata": {"name": target.per_id_name(old), "labels": labels}}
    deleted: list[tuple[str, str]] = []
    listed = {"Service": [own], "NetworkPolicy": [users]}
    monkeypatch.setattr(kube, "list_all", lambda v, kind, ns, selector: listed[kind])
    monkeypatch.setattr(kube, "delete", lambda v, kind, name, ns: deleted.append((kind, name)))
    apply.clean_stale_routes(target, Seen(), LOG)
    assert deleted == [("Service", target.per_id_name(old))]
