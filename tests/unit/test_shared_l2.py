"""spec.l2.nvme.shared: one ReadWriteMany claim and one namespace folder for all the lmcache
servers of a resource (docs/design.md, "Several writers on one folder"). Builders, the API's
rules, the status read of the claim, and the decisions of the agents and the inventory."""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvpersist.api.crd import build_crd
from kvpersist.api.spec import SHARED_FIXED
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.lmcache import (
    POD_NAME_ENV,
    agent_container,
    build_lmcache_statefulset,
    build_shared_claim,
    l2_adapter_config,
)
from kvpersist.builders.target import Target
from kvpersist.controller import sharing
from kvpersist.identity import key_fingerprint, resolve
from kvpersist.inventory.agent import Agent, trimmer_of
from kvpersist.inventory.volume import Inventory, NamespaceUsage, choose_oldest, one_per_location, served_of, status_summary
from kvpersist.l2backends.nvme import SHARED_TRIM_GRACE_S
from kvpersist.status.conditions import Observation, compute_status
from kvpersist.status.workloads import slim
from tests.cases.invalid_manifests import sample

FP = key_fingerprint(b"k" * 32)
NSID = "kvp-" + "a" * 32


def shared_obj(nvme: dict[str, Any] | None = None, replicas: int = 2) -> dict[str, Any]:
    obj = copy.deepcopy(sample())
    obj["spec"]["l2"]["nvme"] = {"size": "2Ti", "maxCapacity": "1000Gi", "shared": True,
                                 "adapter": "nixl_store_dynamic", "storageClassName": "nfs", **(nvme or {})}
    obj["spec"].setdefault("lmcacheServer", {})["replicas"] = replicas
    return obj


def target_of(obj: dict[str, Any]) -> Target:
    spec = KVCacheNamespace.model_validate(obj).spec
    return Target(obj["metadata"]["name"], "ml", spec, resolve(spec.pins(FP)).namespace_id)


# ---- the API

def test_shared_is_off_by_default_and_not_a_pin() -> None:
    """The KV bytes are the same on one claim or many: the namespace id must not move."""
    off = sample()
    off["spec"]["l2"]["nvme"]["adapter"] = "nixl_store_dynamic"  # the one shared takes
    plain = KVCacheNamespace.model_validate(off).spec
    assert plain.l2.nvme is not None and plain.l2.nvme.shared is False
    on = copy.deepcopy(off)
    on["spec"]["l2"]["nvme"]["shared"] = True
    shared = KVCacheNamespace.model_validate(on).spec
    assert shared.pins(FP) == plain.pins(FP)
    assert resolve(shared.pins(FP)).namespace_id == resolve(plain.pins(FP)).namespace_id


def test_an_existing_claim_serves_several_servers_only_when_shared() -> None:
    users = {"existingClaimName": "lustre-kv", "maxCapacity": "1000Gi"}
    refused = shared_obj({**users, "shared": False, "size": None, "storageClassName": None})
    for key in ("size", "storageClassName"):
        refused["spec"]["l2"]["nvme"].pop(key)
    with pytest.raises(ValidationError, match=r"spec\.lmcacheServer\.replicas"):
        KVCacheNamespace.model_validate(refused)
    allowed = copy.deepcopy(refused)
    allowed["spec"]["l2"]["nvme"]["shared"] = True
    assert KVCacheNamespace.model_validate(allowed).spec.lmcache_server.replicas == 2


def test_shared_needs_nixl_store_dynamic() -> None:
    with pytest.raises(ValidationError, match=r"spec\.l2\.nvme\.shared"):
        KVCacheNamespace.model_validate(shared_obj({"adapter": "fs"}))


def _nvme_rules() -> list[dict[str, str]]:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema["properties"]["spec"]["properties"]["l2"]["properties"]["nvme"]["x-kubernetes-validations"]


def _spec_rules() -> list[dict[str, str]]:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema["properties"]["spec"]["x-kubernetes-validations"]


def test_the_crd_fixes_shared_once_set_and_lets_a_shared_claim_serve_several() -> None:
    fixed = [r for r in _nvme_rules() if r["rule"] == "self.shared == oldSelf.shared"]
    assert fixed and fixed[0]["message"] == SHARED_FIXED and "new KVCacheNamespace" in SHARED_FIXED
    assert fixed[0]["fieldPath"] == ".shared"
    replicas = [r for r in _spec_rules() if "existingClaimName" in r["rule"] and "replicas" in r["rule"]]
    assert len(replicas) == 1 and "self.l2.nvme.shared" in replicas[0]["rule"]
    assert any("oldSelf.reclaimPolicy" in r["rule"] and "self.shared" in r["rule"] for r in _nvme_rules())


# ---- the builders

def test_shared_size_makes_one_readwritemany_claim_and_no_claim_template() -> None:
    t = target_of(shared_obj())
    sts = build_lmcache_statefulset(t)["spec"]
    assert "volumeClaimTemplates" not in sts and "persistentVolumeClaimRetentionPolicy" not in sts
    assert sts["replicas"] == 2
    pod = sts["template"]["spec"]
    assert {"name": "l2", "persistentVolumeClaim": {"claimName": "l2-llama31-8b-lmcache-shared"}} in pod["volumes"]
    assert pod["securityContext"]["fsGroup"] == 2000  # the operator's claim: the agent deletes through the group
    claim = build_shared_claim(t)
    assert claim is not None
    assert claim["metadata"]["name"] == "l2-llama31-8b-lmcache-shared" == t.shared_claim
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "2Ti"}},
                             "storageClassName": "nfs"}
    # Outlives the resource like the StatefulSet's claims: no tracking label, no owner here (the
    # controller adds one for reclaimPolicy Delete only), and it is indexed as a server claim.
    labels = claim["metadata"]["labels"]
    assert "app.kubernetes.io/instance" not in labels and labels["kvpersist.dev/instance"] == "llama31-8b"
    assert labels["app.kubernetes.io/component"] == "lmcache-server" and "ownerReferences" not in claim["metadata"]
    # Every server writes into the same folder: the one namespace id's.
    assert l2_adapter_config(t)["backend_params"]["file_path"] == f"/var/lib/kvpersist/l2/{t.namespace_id}"


def test_shared_users_claim_is_mounted_by_every_server_and_no_claim_is_made() -> None:
    obj = shared_obj({"existingClaimName": "lustre-kv"})
    for key in ("size", "storageClassName"):
        obj["spec"]["l2"]["nvme"].pop(key)
    t = target_of(obj)
    assert build_shared_claim(t) is None and t.shared_claim == "lustre-kv"
    sts = build_lmcache_statefulset(t)["spec"]
    assert "volumeClaimTemplates" not in sts
    assert {"name": "l2", "persistentVolumeClaim": {"claimName": "lustre-kv"}} in sts["template"]["spec"]["volumes"]
    assert "fsGroup" not in sts["template"]["spec"]["securityContext"]  # a user's volume is never re-owned


def test_without_shared_nothing_changes() -> None:
    t = target_of(sample())
    assert build_shared_claim(t) is None and t.shared_claim is None
    assert "volumeClaimTemplates" in build_lmcache_statefulset(t)["spec"]
    agent = agent_container(t, "img:1")
    assert "--shared-folder" not in agent["args"] and "env" not in agent


def test_shared_agents_know_their_pod_and_the_grace() -> None:
    agent = agent_container(target_of(shared_obj()), "img:1")
    args = agent["args"]
    assert "--shared-folder" in args and args[args.index("--trim-grace") + 1] == str(SHARED_TRIM_GRACE_S)
    assert "--capacity-bytes" in args  # the folder's capacity, trimmed by one of them
    assert {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in agent["env"]


# ---- who shares what

def test_the_servers_of_one_resource_share_its_claim_another_resource_is_refused() -> None:
    holder = sharing.user("ml", "llama31-8b", "2026-01-01T00:00:00Z", target_of(shared_obj()).spec, NSID)
    intruder_obj = shared_obj({"existingClaimName": "l2-llama31-8b-lmcache-shared"})
    for key in ("size", "storageClassName"):
        intruder_obj["spec"]["l2"]["nvme"].pop(key)
    intruder = sharing.user("ml", "other", "2026-02-01T00:00:00Z", target_of(intruder_obj).spec, NSID)
    why = sharing.refusal(intruder, [holder])
    assert why is not None and "l2-llama31-8b-lmcache-shared" in why and "ml/llama31-8b" in why
    # Its own server pods mounting the claim never hold it back.
    pods = [{"metadata": {"name": f"llama31-8b-lmcache-{i}", "namespace": "ml",
                          "labels": {"app.kubernetes.io/instance": "llama31-8b",
                                     "app.kubernetes.io/component": "lmcache-server"}},
             "spec": {"volumes": [{"name": "l2", "persistentVolumeClaim": {"claimName": "l2-llama31-8b-lmcache-shared"}}]}}
            for i in range(2)]
    assert sharing.refusal(holder, [intruder], pods) is None
    assert sharing.mounted_elsewhere(intruder, pods) != []


# ---- status: the claim's access modes, one claim expected

def _obs(claims: list[dict[str, Any]], shared: bool = True, **kw: Any) -> Observation:
    return Observation(generation=1, namespace_id=NSID, identity_reason="", l2_kind="nvme", server_desired=2,
                       vllm_desired=1, claims=claims, shared=shared, **kw)


def _claim(name: str, modes: list[str], phase: str = "Bound") -> dict[str, Any]:
    return slim({"metadata": {"name": name, "namespace": "ml", "labels": {}},
                 "spec": {"accessModes": modes}, "status": {"phase": phase, "accessModes": modes}})


def _l2(obs: Observation) -> dict[str, Any]:
    return next(c for c in compute_status(obs)[1] if c["type"] == "L2Ready")


def test_a_shared_claim_that_is_not_readwritemany_is_said_in_l2ready() -> None:
    l2 = _l2(_obs([_claim("kv-data", ["ReadWriteOnce"])], existing_claim="kv-data"))
    assert (l2["status"], l2["reason"]) == ("False", "ClaimNotShared")
    assert "spec.l2.nvme.existingClaimName" in l2["message"] and "ReadWriteOnce" in l2["message"]
    assert "ReadWriteMany" in l2["message"]
    ok = _l2(_obs([_claim("kv-data", ["ReadWriteMany"])], existing_claim="kv-data"))
    assert (ok["status"], ok["reason"]) == ("True", "ClaimsBound")
    # Said before it binds too: a claim asking for ReadWriteOnce will not be shareable once bound.
    pending = slim({"metadata": {"name": "kv-data", "namespace": "ml", "labels": {}},
                    "spec": {"accessModes": ["ReadWriteOnce"]}, "status": {"phase": "Pending"}})
    assert _l2(_obs([pending], existing_claim="kv-data"))["reason"] == "ClaimNotShared"


def test_a_shared_resource_waits_for_one_claim_not_one_per_server() -> None:
    assert _l2(_obs([_claim("l2-x-lmcache-shared", ["ReadWriteMany"])]))["status"] == "True"
    missing = _l2(_obs([]))
    assert (missing["reason"], missing["status"]) == ("ClaimMissing", "False") and "0/1" in missing["message"]
    # Not shared: one per server, as before.
    assert _l2(_obs([_claim("l2-x-lmcache-0", ["ReadWriteOnce"])], shared=False))["reason"] == "ClaimMissing"


# ---- the inventory: the folder counted once

def test_a_shared_folder_is_counted_once_in_status() -> None:
    def scan() -> Inventory:
        return Inventory("pvc", [NamespaceUsage(NSID, 300, 3, 1.0), NamespaceUsage("kvp-" + "b" * 32, 50, 1, 1.0)])

    volumes = [("pvc/l2-x-lmcache-shared", "x-lmcache-0", scan()), ("pvc/l2-x-lmcache-shared", "x-lmcache-1", scan())]
    out = status_summary(one_per_location(volumes), NSID, {NSID})
    assert (served_of(out, NSID), out["orphanedBytes"]) == ((300, 3), 50)
    assert [v["pod"] for v in out["volumes"]] == ["x-lmcache-0"]
    own = [("pvc/l2-x-lmcache-0", "x-lmcache-0", scan()), ("pvc/l2-x-lmcache-1", "x-lmcache-1", scan())]
    assert served_of(status_summary(one_per_location(own), NSID, {NSID}), NSID) == (600, 6)  # two claims: both count


# ---- one trimmer per folder, and its grace

@pytest.mark.parametrize(("pod", "ordinal"), [("x-lmcache-0", 0), ("x-lmcache-1", 1), ("a-b-lmcache-12", 12),
                                              ("x-lmcache-01", None), ("node-a", None), ("", None), (None, None)])
def test_the_ordinal_comes_from_the_pod_name(pod: str | None, ordinal: int | None) -> None:
    assert trimmer_of(pod) is (ordinal == 0)


def _fill(folder: Path, ages_s: list[float], size: int = 1000) -> list[Path]:
    folder.mkdir(parents=True)
    now = time.time()
    out = []
    for i, age in enumerate(ages_s):
        p = folder / f"m_01000100_0_{i:064x}.bin"
        p.write_bytes(b"x" * size)
        os.utime(p, (now - age, now - age))
        out.append(p)
    return out


def test_only_the_trimmer_trims_and_never_a_file_within_the_grace(tmp_path: Path) -> None:
    folder = tmp_path / NSID
    files = _fill(folder, [3600, 1800, 600, 60, 5])  # 5 files of 1000 bytes, oldest first
    reporter = Agent(tmp_path, NSID, capacity_bytes=1000, trims=False, trim_grace_s=120)
    assert reporter.trimming is False and reporter.trim_once() is None
    assert all(p.exists() for p in files)
    trimmer = Agent(tmp_path, NSID, capacity_bytes=1000, trims=True, trim_grace_s=120)
    trimmed = trimmer.trim_once()
    assert trimmed is not None and trimmed.objects == 3  # the three older than the grace
    assert [p.exists() for p in files] == [False, False, False, True, True]  # over capacity, yet the young stay


def test_choose_oldest_spares_what_was_written_after_the_grace_began() -> None:
    from kvpersist.inventory.volume import ChunkFile

    files = [ChunkFile(f"/f{i}", 10, float(t), i) for i, t in enumerate([100, 200, 300])]
    assert [f.path for f in choose_oldest(files, 30, 0)] == ["/f0", "/f1", "/f2"]
    assert [f.path for f in choose_oldest(files, 30, 0, spare_after=200)] == ["/f0"]
    assert choose_oldest(files, 30, 30, spare_after=0) == []


def test_a_users_claim_not_readwritemany_runs_one_server_not_one_per_node() -> None:
    """The servers on other nodes could never mount a ReadWriteOnce claim: one runs (L2Ready says
    ClaimNotShared), as many as the spec says once the claim can be shared (decided from the claim
    as the snapshot read it: kvpersist.controller.decision)."""
    from kvpersist.controller import l2key
    from kvpersist.controller.decision import Snapshot, decide

    def replicas(obj: dict[str, Any], claim: dict[str, Any] | None) -> int:
        body = {**obj, "metadata": {**obj["metadata"], "namespace": "ml", "uid": "u-1"}}
        spec = KVCacheNamespace.model_validate(obj).spec
        key = l2key.KeyRead(f"{obj['metadata']['name']}-l2-key", "master-key", True, fingerprint=FP)
        decision = decide(Snapshot(body=body, spec=spec, key=key, l2_claims={}, stores=(), named_claim=claim))
        assert decision.applies and decision.target.cache_enabled, decision.refusal
        return next(m for m in decision.manifests if m["kind"] == "StatefulSet")["spec"]["replicas"]

    obj = shared_obj({"existingClaimName": "kv-data"})
    for key in ("size", "storageClassName"):
        obj["spec"]["l2"]["nvme"].pop(key)
    claims = {"rwo": _claim("kv-data", ["ReadWriteOnce"]), "rwx": _claim("kv-data", ["ReadWriteMany"]), "none": None}
    for kind, want in (("rwo", 1), ("rwx", 2), ("none", 2)):
        assert replicas(obj, claims[kind]) == want, kind
    # The operator's own claim is ReadWriteMany: never capped, whatever a claim of that name says.
    assert replicas(shared_obj(), claims["rwo"]) == 2


def test_usage_and_budget_count_a_shared_folder_once() -> None:
    """Each server of a shared folder counts what it stored and what it found of the others':
    the folder's L2 is the largest count, not the sum; L1 stays per server, summed."""
    from kvpersist.status.conditions import budget_status
    from kvpersist.status.usage import ServerReport, summarize

    reports = [ServerReport(f"x-lmcache-{i}", True, l1_used=10, l1_capacity=100, l2_used=used, l2_capacity=1000,
                            l2_objects=objs) for i, (used, objs) in enumerate(((600, 6), (400, 4)))]
    shared = summarize(reports, "t", shared=True)
    assert (shared["l2UsedBytes"], shared["l2CapacityBytes"], shared["l2Objects"]) == (600, 1000, 6)
    assert shared["l1UsedBytes"] == 20 and shared["l1CapacityBytes"] == 200
    own = summarize(reports, "t")
    assert (own["l2UsedBytes"], own["l2CapacityBytes"], own["l2Objects"]) == (1000, 2000, 10)
    budget = budget_status(_obs([], reports=reports, budget_bytes=900))
    assert budget is not None and budget["state"] == "Available" and budget["_shown"].startswith("600B/")
    assert budget_status(_obs([], shared=False, reports=reports, budget_bytes=900))["state"] == "Exhausted"
