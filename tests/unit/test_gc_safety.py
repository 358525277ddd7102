"""gc's guards that need no cluster: "in use" is asked of the API server again right before each
deletion (an agent's /gc, a bucket batch), a bucket not marked exclusive to this cluster is never
deleted from, and the chart ships the same gc authorization policy as config/gc. The API server's
side of the policy is tests/e2e/test_admin.py."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.controller import agents, inuse, kube, l2runtime
from kvpersist.controller import gc as controller_gc
from kvpersist.identity import key_fingerprint, resolve
from kvpersist.inventory import bucket as inventory_bucket
from kvpersist.inventory import cleanup
from kvpersist.inventory.volume import NamespaceUsage
from kvpersist.status.workloads import Seen
from tests.cases.invalid_manifests import sample

ROOT = Path(__file__).resolve().parents[2]
ORPHAN = "kvp-" + "b" * 32
LOG = logging.getLogger("test")


def _body(name: str = "nvme-minimal", **hf_bucket: Any) -> dict[str, Any]:
    obj = sample(name)
    obj["metadata"].update(namespace="ml", uid="u1")
    if hf_bucket:
        obj["spec"]["l2"]["hfBucket"].update(hf_bucket)
    return obj


def _user_of(nsid: str) -> dict[str, Any]:
    """A KVCacheNamespace created meanwhile in another namespace, reporting nsid."""
    return {"metadata": {"name": "newcomer", "namespace": "other"}, "spec": {}, "status": {"namespaceId": nsid}}


class FakeCluster:
    """The API server and the agents as run_gc sees them, logging every call in order. After
    `appears_after` agent calls, a resource using ORPHAN exists."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, appears_after: int | None = None) -> None:
        self.calls: list[str] = []
        self.appears_after = appears_after
        self.status: dict[str, Any] = {}
        self.annotations: dict[str, Any] = {}
        self.list_error: int | None = None
        monkeypatch.setattr(kube, "list_all", self.list_all)
        monkeypatch.setattr(kube, "patch_status", lambda *a: self.status.update(a[-1]))
        monkeypatch.setattr(kube, "post_event", lambda *a: self.calls.append(f"event {a[2]}"))
        monkeypatch.setattr(kube, "patch_metadata", lambda *a: self.annotations.update(a[-1]["metadata"]["annotations"]))
        monkeypatch.setattr(agents, "agent_token", lambda target: "token")
        monkeypatch.setattr(cleanup, "request_gc", self.request_gc)

    def list_all(self, api_version: str, kind: str, namespace: str | None = None, label_selector: str | None = None) -> list:
        assert namespace is None, "the re-check lists every namespace"
        self.calls.append(f"list {kind}")
        if self.list_error:
            raise ApiException(status=self.list_error, reason="Forbidden")
        agent_calls = sum(c.startswith("gc ") for c in self.calls)
        if kind == "KVCacheNamespace" and self.appears_after is not None and agent_calls >= self.appears_after:
            return [_user_of(ORPHAN)]
        return []

    def request_gc(self, ip: str, port: int, nsid: str, dry_run: bool, token: str | None = None) -> tuple[int, dict]:
        self.calls.append(f"gc {ip}")
        return 200, {"deleted": True, "bytes": 100, "objects": 2}


def _servers(*ips: str) -> Seen:
    pods = [{"metadata": {"name": f"llama-lmcache-{i}", "labels": {"app.kubernetes.io/component": "lmcache-server"}},
             "status": {"phase": "Running", "podIP": ip}} for i, ip in enumerate(ips)]
    return Seen(pods=pods)


def test_each_agent_call_is_preceded_by_a_fresh_listing(monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeCluster(monkeypatch)
    controller_gc.run_gc(_body(), {"requestId": "r1", "namespaceId": ORPHAN}, _servers("10.0.0.1", "10.0.0.2"), LOG)
    assert api.calls[:6] == ["list KVCacheNamespace", "list Pod", "gc 10.0.0.1", "list KVCacheNamespace", "list Pod",
                             "gc 10.0.0.2"]
    assert api.status["gc"]["outcome"] == "Deleted" and api.status["gc"]["bytes"] == 200
    assert api.annotations == {cleanup.GC_ANNOTATION: None}


def test_a_resource_created_between_two_deletions_stops_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch caches (Seen.live_ids) do not know the newcomer; the listing right before the
    second agent's /gc does, and that agent is never asked."""
    api = FakeCluster(monkeypatch, appears_after=1)
    controller_gc.run_gc(_body(), {"requestId": "r1", "namespaceId": ORPHAN}, _servers("10.0.0.1", "10.0.0.2"), LOG)
    assert [c for c in api.calls if c.startswith("gc ")] == ["gc 10.0.0.1"]
    gc = api.status["gc"]
    assert gc["outcome"] == "Refused" and "KVCacheNamespace other/newcomer" in gc["message"], gc
    assert "llama-lmcache-1" in gc["message"] and "already deleted: llama-lmcache-0" in gc["message"]
    assert gc["bytes"] == 100 and "event GCRefused" in api.calls


def test_a_newcomer_before_the_first_deletion_deletes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeCluster(monkeypatch, appears_after=0)
    controller_gc.run_gc(_body(), {"requestId": "r1", "namespaceId": ORPHAN}, _servers("10.0.0.1"), LOG)
    assert not [c for c in api.calls if c.startswith("gc ")]
    assert api.status["gc"]["outcome"] == "Refused" and api.status["gc"]["bytes"] == 0


def test_an_unreadable_api_server_refuses_and_names_the_permission(monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeCluster(monkeypatch)
    api.list_error = 403
    controller_gc.run_gc(_body(), {"requestId": "r1", "namespaceId": ORPHAN}, _servers("10.0.0.1"), LOG)
    assert not [c for c in api.calls if c.startswith("gc ")]
    gc = api.status["gc"]
    assert gc["outcome"] == "Refused" and "403" in gc["message"] and "list on both cluster-wide" in gc["message"], gc


def test_refusal_now_sees_pods_and_resources_by_spec() -> None:
    current = "kvp-" + "a" * 32
    pod = {"metadata": {"name": "p", "namespace": "x", "labels": {"kvpersist.dev/namespace-id": ORPHAN}}}
    assert "pod x/p" in inuse.refusal_now(ORPHAN, current, [], [pod])
    body = _body()
    fp = key_fingerprint(b"k" * 32)
    nsid = resolve(KVCacheNamespace.model_validate(body).spec.pins(fp)).namespace_id
    # The spec's id needs its L2 key: read for a resource whose status records none, ...
    assert nsid and "KVCacheNamespace ml/" in inuse.refusal_now(nsid, current, [body], [], fingerprint=lambda r: fp)
    assert inuse.refusal_now(nsid, current, [body], []) is None  # (without the key: another namespace, if any)
    # ... else the fingerprint status records for the same Secret; and one waiting for its key holds its namespace.
    recorded = {**body, "status": {"l2Key": {"secret": "llama31-8b-l2-key", "fingerprint": fp}}}
    assert "KVCacheNamespace ml/" in inuse.refusal_now(nsid, current, [recorded], [])
    waiting = {**body, "status": {"l2Key": {"secret": "llama31-8b-l2-key", "fingerprint": fp, "namespaceId": ORPHAN}}}
    assert "waiting for the L2 key" in inuse.refusal_now(ORPHAN, current, [waiting], [])
    assert inuse.refusal_now(ORPHAN, ORPHAN, [], []) and inuse.refusal_now(ORPHAN, current, [], []) is None


# ------------------------------------------------------------------ buckets


def test_a_bucket_not_marked_exclusive_is_refused_before_any_request(monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeCluster(monkeypatch)

    def never(*_a: Any, **_k: Any) -> NamespaceUsage:
        raise AssertionError("the bucket must not be touched")

    monkeypatch.setattr(l2runtime, "remove_bucket_namespace", never)
    monkeypatch.setattr(l2runtime.SecretOnce, "token", lambda self: "hf_x")
    body = _body("hf-bucket")
    assert KVCacheNamespace.model_validate(body).spec.l2.hf_bucket.exclusive_to_this_cluster is False  # the default
    controller_gc.run_gc(body, {"requestId": "r1", "namespaceId": ORPHAN}, Seen(), LOG)
    gc = api.status["gc"]
    assert gc["outcome"] == "Refused" and "spec.l2.hfBucket.exclusiveToThisCluster" in gc["message"], gc
    assert "nothing was deleted" in gc["message"] and not [c for c in api.calls if c.startswith("list")]


def test_an_exclusive_bucket_is_deleted_with_a_recheck_before_each_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeCluster(monkeypatch, appears_after=None)
    objects = [inventory_bucket._Object(f"prod/{ORPHAN}/{i}.bin", f"{ORPHAN}/{i}.bin", 10, None) for i in range(2500)]
    monkeypatch.setattr(inventory_bucket, "_list", lambda *a: iter(objects))

    def delete_chunk(bid: str, paths: list[str], *_a: Any) -> None:
        api.calls.append(f"delete {len(paths)}")
        api.appears_after = 0  # a resource using the namespace is created after the first batch

    monkeypatch.setattr(inventory_bucket, "_delete_chunk", delete_chunk)
    monkeypatch.setattr(l2runtime.SecretOnce, "token", lambda self: "hf_x")
    controller_gc.run_gc(_body("hf-bucket", exclusiveToThisCluster=True), {"requestId": "r1", "namespaceId": ORPHAN}, Seen(), LOG)
    deletes = [i for i, c in enumerate(api.calls) if c.startswith("delete")]
    assert api.calls[:3] == ["list KVCacheNamespace", "list Pod", "delete 1000"]
    assert all(api.calls[i - 2:i] == ["list KVCacheNamespace", "list Pod"] for i in deletes)
    assert len(deletes) == 1  # the second batch's re-check saw the newcomer
    gc = api.status["gc"]
    assert gc["outcome"] == "Refused" and "other/newcomer" in gc["message"] and "1000 of 2500 objects" in gc["message"], gc
    assert (gc["bytes"], gc["objects"]) == (10_000, 1000)


def test_the_new_field_leaves_the_namespace_id_alone() -> None:
    plain = KVCacheNamespace.model_validate(_body("hf-bucket")).spec
    marked = KVCacheNamespace.model_validate(_body("hf-bucket", exclusiveToThisCluster=True)).spec
    assert marked.l2.hf_bucket.exclusive_to_this_cluster is True
    assert plain.pins() == marked.pins() and resolve(plain.pins()).namespace_id == resolve(marked.pins()).namespace_id


# ------------------------------------------------------------------ the policy


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_chart_ships_the_same_gc_policy_as_config() -> None:
    """The chart's template, rendered for release "kvpersist" (helm's own rendering is checked by
    tests/e2e/test_helm.py), equals the plain manifest apart from the chart's labels."""
    template = (ROOT / "charts/kvpersist/templates/gc-authorization.yaml").read_text()
    assert "{{- if .Values.gcAuthorization.enabled }}" in template
    rendered = re.sub(r"\{\{-? (if|end)[^}]*\}\}\n?", "", template)
    rendered = re.sub(r"\n *labels: \{\{-[^}]*\}\}", "", rendered)
    rendered = rendered.replace('{{ include "kvpersist.fullname" . }}', "kvpersist")
    rendered = rendered.replace('{{- include "kvpersist.bindingScope" . }}\n', "")  # empty without watchNamespaces
    assert "{{" not in rendered
    plain = _docs((ROOT / "config/gc/gc-authorization.yaml").read_text())
    assert _docs(rendered) == plain
    policy = plain[0]
    assert [d["kind"] for d in plain] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "ClusterRole"]
    check = policy["spec"]["validations"][0]["expression"]
    assert ".subresource('gc')" in check and ".check('update').allowed()" in check
    assert plain[2]["rules"] == [{"apiGroups": ["kvpersist.dev"], "resources": ["kvcachenamespaces/gc"], "verbs": ["update"]}]


def test_the_charts_gc_role_is_named_after_the_release_as_the_docs_say() -> None:
    """The chart's ClusterRole and policy are named after the release (two releases never collide
    on these cluster-scoped names); the policy's refusal names the role the release installed, and
    docs/admin.md gives the rule with both of these renderings."""
    from tests import rbac_needs

    helm = rbac_needs.helm_binary()
    if helm is None:
        pytest.skip("helm not built: python3 hack/localcluster.py build")
    admin = " ".join((ROOT / "docs" / "admin.md").read_text().split())
    for release, role in (("kvpersist", "kvpersist-gc"), ("ops", "ops-kvpersist-gc")):
        docs = rbac_needs.render(helm, "clusterwide", release=release)
        roles = [d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-gc")]
        assert roles == [role], roles
        policy = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"].endswith("-gc-request"))
        assert policy["metadata"]["name"] == f"{role}-request"
        assert f"bind the ClusterRole {role} to it" in policy["spec"]["validations"][0]["messageExpression"]
        assert f"`{role}` for `helm install {release} ...`" in admin, role
