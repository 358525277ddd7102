"""The watch caches keep only what status is computed from, under the owning resource's key."""

from __future__ import annotations

from kvpersist.builders.target import Target
from kvpersist.status.conditions import _rollout_done
from kvpersist.status.workloads import Seen, index_entry, owner_key, pod_ready, slim

POD = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": "a-lmcache-0", "namespace": "ns", "generation": 1, "uid": "u", "managedFields": [{"big": 1}],
                 "labels": {"app.kubernetes.io/instance": "a", "app.kubernetes.io/component": "lmcache-server",
                            "kvpersist.dev/namespace-id": "kvp-x", "controller-revision-hash": "h"}},
    "spec": {"nodeName": "gpu-0", "containers": [{"name": "lmcache", "args": ["--l1-size-gb", "1"] * 50}]},
    "status": {"phase": "Running", "podIP": "127.16.0.5", "hostIP": "10.0.0.1",
               "conditions": [{"type": "PodScheduled", "status": "True"},
                              {"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-30T00:00:00Z"}],
               "containerStatuses": [{"name": "lmcache", "ready": True, "restartCount": 2},
                                     {"name": "inventory-agent", "ready": True, "restartCount": 1}]},
}
STS = {"metadata": {"name": "a-lmcache", "namespace": "ns", "generation": 3, "labels": {"app.kubernetes.io/instance": "a"}},
       "spec": {"replicas": 1}, "status": {"observedGeneration": 3, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1,
                                           "currentRevision": "r"}}


def test_slim_keeps_what_status_reads_and_drops_the_rest() -> None:
    pod = slim(POD)
    assert "managedFields" not in pod["metadata"] and "hostIP" not in pod["status"]
    # Its node, uid and container starts, and nothing else of its spec (spec.prewarm's schedule).
    assert pod["spec"] == {"nodeName": "gpu-0"} and pod["metadata"]["uid"] == "u" and pod["status"]["restarts"] == 3
    assert pod["status"]["conditions"] == [{"type": "Ready", "status": "True"}]
    assert pod_ready(pod) and pod_ready(POD)
    assert pod["status"]["podIP"] == "127.16.0.5" and pod["metadata"]["labels"]["app.kubernetes.io/component"] == "lmcache-server"
    assert _rollout_done(slim(STS), 1) == _rollout_done(STS, 1) == (True, 1)
    assert len(repr(pod)) < len(repr(POD)) / 3


def test_index_entry_is_keyed_by_owner() -> None:
    assert owner_key(POD) == ("ns", "a")
    assert index_entry(POD) == {("ns", "a"): slim(POD)}
    assert index_entry({"metadata": {"name": "x", "namespace": "ns", "labels": {}}}) is None


def test_seen_picks_by_name_and_component() -> None:
    other_pod = {"metadata": {"name": "a-vllm-x", "labels": {"app.kubernetes.io/component": "vllm"}}, "status": {}}
    seen = Seen(statefulsets=[slim(STS)], pods=[other_pod, slim(POD)])
    target = Target("a", "ns", None, "kvp-x")  # type: ignore[arg-type]  # names only
    assert seen.statefulset(target)["metadata"]["generation"] == 3
    assert seen.deployment(target) is None
    assert [p["metadata"]["name"] for p in seen.server_pods()] == ["a-lmcache-0"]
