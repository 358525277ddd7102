"""Which pods get the agent token and the vLLM API key (kvpersist.controller.indexes.trusted_pods): only
those whose controller ownerReference chain ends, by uid, at the resource's own StatefulSet or
Deployment; labels alone are anyone's to copy."""

from __future__ import annotations

from typing import Any

from kvpersist.api import v1alpha1 as api
from kvpersist.controller.indexes import trusted_pods, untrusted_message
from kvpersist.status.workloads import slim

OWNER = "uid-kvcachenamespace"
LABELS = {"app.kubernetes.io/name": "kvpersist", "app.kubernetes.io/instance": "demo",
          "app.kubernetes.io/component": "lmcache-server"}


def ref(kind: str, uid: str, controller: bool = True) -> dict[str, Any]:
    api_version = api.API_VERSION if kind == api.KIND else "apps/v1"
    return {"apiVersion": api_version, "kind": kind, "name": f"some-{kind.lower()}", "uid": uid, "controller": controller}


def obj(name: str, uid: str, *refs: dict[str, Any]) -> dict[str, Any]:
    """An object as the watch caches keep it (slim): its controller reference survives."""
    return slim({"metadata": {"name": name, "namespace": "team", "uid": uid, "labels": LABELS,
                              "ownerReferences": list(refs)}, "spec": {"containers": [{"name": "c"}]}})


SETS = [obj("demo-lmcache", "uid-sts", ref(api.KIND, OWNER))]
DEPLOYMENTS = [obj("demo-vllm", "uid-deploy", ref(api.KIND, OWNER))]
REPLICASETS = [obj("demo-vllm-new", "uid-rs-new", ref("Deployment", "uid-deploy")),
               obj("demo-vllm-old", "uid-rs-old", ref("Deployment", "uid-deploy"))]


def names(pods: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


def judge(*pods: dict[str, Any], sets: list[dict[str, Any]] = SETS,
          owner: str | None = OWNER) -> tuple[list[str], list[str]]:
    trusted, untrusted = trusted_pods(list(pods), REPLICASETS, sets, DEPLOYMENTS, owner)
    return names(trusted), names(untrusted)


def test_the_servers_and_vllm_pods_of_its_own_workloads_are_trusted() -> None:
    assert judge(obj("demo-lmcache-0", "p0", ref("StatefulSet", "uid-sts")),
                 obj("demo-vllm-new-x", "p1", ref("ReplicaSet", "uid-rs-new"))) == (
        ["demo-lmcache-0", "demo-vllm-new-x"], [])


def test_a_pod_of_an_old_replicaset_of_its_deployment_is_still_trusted() -> None:
    """Mid-rollout the old ReplicaSet's pods still serve: the canary and prewarm may ask them."""
    assert judge(obj("demo-vllm-old-y", "p2", ref("ReplicaSet", "uid-rs-old"))) == (["demo-vllm-old-y"], [])


def test_a_foreign_pod_with_the_same_labels_is_not_trusted() -> None:
    assert judge(obj("lookalike", "p3")) == ([], ["lookalike"])


def test_a_pod_of_a_look_alike_statefulset_of_another_uid_is_not_trusted() -> None:
    """The same name, labels, even a reference to the same resource by name: another uid."""
    other_set = obj("demo-lmcache", "uid-other-sts", ref(api.KIND, "uid-someone-else"))
    pod = obj("demo-lmcache-0", "p4", ref("StatefulSet", "uid-other-sts"))
    assert judge(pod, sets=[*SETS, other_set]) == ([], ["demo-lmcache-0"])
    # and a StatefulSet that is the resource's child in no way at all
    assert judge(obj("x-0", "p5", ref("StatefulSet", "uid-unknown"))) == ([], ["x-0"])


def test_a_pod_whose_owner_is_not_its_controller_is_not_trusted() -> None:
    """An ownerReference without controller: true (anyone may add one) does not make it ours."""
    assert judge(obj("demo-lmcache-9", "p6", ref("StatefulSet", "uid-sts", controller=False))) == ([], ["demo-lmcache-9"])
    assert judge(obj("demo-vllm-z", "p7", ref("ReplicaSet", "uid-rs-new", controller=False))) == ([], ["demo-vllm-z"])


def test_a_replicaset_of_another_deployment_does_not_vouch_for_its_pods() -> None:
    foreign_rs = obj("demo-vllm-evil", "uid-rs-evil", ref("Deployment", "uid-other-deploy"))
    pod = obj("demo-vllm-evil-a", "p8", ref("ReplicaSet", "uid-rs-evil"))
    trusted, untrusted = trusted_pods([pod], [*REPLICASETS, foreign_rs], SETS, DEPLOYMENTS, OWNER)
    assert (names(trusted), names(untrusted)) == ([], ["demo-vllm-evil-a"])


def test_with_no_resource_uid_nothing_is_trusted() -> None:
    assert judge(obj("demo-lmcache-0", "p0", ref("StatefulSet", "uid-sts")), owner=None) == ([], ["demo-lmcache-0"])


def test_the_log_line_names_the_pod_and_what_controls_it() -> None:
    message = untrusted_message(obj("lookalike", "p3", ref("StatefulSet", "uid-x")), "team/demo")
    assert "team/lookalike" in message and "StatefulSet uid uid-x" in message and "team/demo" in message
    assert "its controller is none (no controller ownerReference)" in untrusted_message(obj("bare", "p9"), "team/demo")


def test_a_resources_view_holds_only_its_own_pods(monkeypatch: Any, caplog: Any) -> None:
    """The wiring: every path that sends a credential (status, gc, the canary, prewarm) picks pods
    from Seen, which the indexes fill through trusted_pods; a left-out pod is named in the log once."""
    from kvpersist.controller import indexes, runtime

    key = ("team", "demo")
    foreign = obj("demo-lmcache-1", "p-foreign")  # a tenant's pod with the servers' labels
    own = obj("demo-lmcache-0", "p-own", ref("StatefulSet", "uid-sts"))
    monkeypatch.setattr(runtime.CONTROLLER, "indices", {
        "kvp_statefulsets": {key: SETS}, "kvp_deployments": {key: DEPLOYMENTS}, "kvp_replicasets": {key: REPLICASETS},
        "kvp_pods": {key: [own, foreign]}, "kvp_claims": {}})
    with caplog.at_level("WARNING", logger="kvpersist"):
        seen = indexes.seen_of(key, frozenset(), {}, owner_uid=OWNER)
        indexes.seen_of(key, frozenset(), {}, owner_uid=OWNER)
    assert names(seen.server_pods()) == ["demo-lmcache-0"]
    assert [r.getMessage() for r in caplog.records].count(untrusted_message(foreign, "team/demo")) == 1


def test_the_status_loop_hands_every_index_the_trust_check_reads_to_the_controller() -> None:
    """kopf passes each index to the startup handler by name, and `**_` would swallow a missing
    one: without the ReplicaSets' index every vLLM pod would be left out (no canary, no prewarm)."""
    import inspect

    from kvpersist.controller import status_loop

    params = inspect.signature(status_loop.start_status_loop).parameters
    assert {"kvp_statefulsets", "kvp_deployments", "kvp_replicasets", "kvp_pods"} <= set(params)
