"""Other namespaces' folders on a claim (issue 30, item 7): the capacity arithmetic, the bounded
scan, the L2SpaceAvailable threshold and its events, which folders the opt-in age limit may
remove, and the API field (not part of the namespace id)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.lmcache import agent_container
from kvpersist.builders.target import Target
from kvpersist.controller.transitions import events_for
from kvpersist.identity import key_fingerprint, resolve
from kvpersist.inventory.agent import Agent
from kvpersist.inventory.space import (
    DAY_S,
    claim_space_summary,
    effective_capacity,
    judge_expiry,
    others_bytes,
    used_bytes,
)
from kvpersist.inventory.volume import Inventory, NamespaceUsage, namespace_usage, scan_volume
from kvpersist.status.conditions import SPACE_CONDITION, space_condition
from tests.cases.invalid_manifests import sample

A, B, C, D = ("kvp-" + ch * 32 for ch in "abcd")
NOW = 1_800_000_000.0
GB = 10**9


def _files(root: Path, nsid: str, n: int, size: int, mtime: float) -> None:
    (root / nsid).mkdir(parents=True, exist_ok=True)
    for i in range(n):
        f = root / nsid / f"m_00000000_0_{i:064x}.bin"
        f.write_bytes(b"\0" * size)
        os.utime(f, (mtime, mtime))


# ---- capacity arithmetic

def test_effective_capacity_counts_what_else_the_claim_holds() -> None:
    # 100 GB claim, maxCapacity 90: alone, the capacity stands (95 GB of room is more).
    assert effective_capacity(90 * GB, 100 * GB, 0) == 90 * GB
    # An old namespace holds 30 GB: the served folder may keep 95 - 30 = 65 GB, not 90.
    assert effective_capacity(90 * GB, 100 * GB, 30 * GB) == 65 * GB
    # Old folders past the fill limit: the served folder keeps its newest 5% of its capacity, not
    # nothing (deleting all of it would free room for writes that cannot stay either).
    assert effective_capacity(90 * GB, 100 * GB, 99 * GB) == int(90 * GB * 0.05)
    assert effective_capacity(90 * GB, 100 * GB, 91 * GB) == int(90 * GB * 0.05)  # 4 GB of room, under the floor
    assert effective_capacity(90 * GB, 100 * GB, 90 * GB) == 5 * GB  # 5 GB of room, over the 4.5 GB floor
    # The claim's size unknown: the capacity alone.
    assert effective_capacity(90 * GB, None, 30 * GB) == 90 * GB


def test_others_and_used_bytes() -> None:
    inv = Inventory("pvc/x", [NamespaceUsage(A, 10), NamespaceUsage(B, 20), NamespaceUsage(C, 5)], other_bytes=3,
                    capacity_bytes=1000, free_bytes=990)
    assert others_bytes(inv, A) == 28
    assert used_bytes(inv) == 38  # the scan counts more than the filesystem says here
    inv.free_bytes = 900
    assert used_bytes(inv) == 100  # and less here (a bounded scan, filesystem overhead)


def test_status_l2_shows_the_largest_other_namespaces_and_carries_removals() -> None:
    inv = Inventory("pvc/x", [NamespaceUsage(A, 100, 1, NOW), NamespaceUsage(B, 700, 7, NOW - 40 * DAY_S),
                              NamespaceUsage(C, 50, 2, NOW - 1 * DAY_S)], capacity_bytes=1000, free_bytes=100,
                    effective_capacity_bytes=200)
    l2 = claim_space_summary([("pvc/x", "p-0", inv)], A, frozenset({A, C}), NOW,
                             {"orphansRemoved": 2, "orphansRemovedBytes": 10, "lastOrphanRemoved": D},
                             [{"namespaceId": D, "bytes": 5}])
    assert l2 is not None
    assert (l2["usedBytes"], l2["otherNamespacesBytes"], l2["otherNamespaces"]) == (900, 750, 2) and "usedPercent" not in l2
    assert [(o["namespaceId"], o["ageDays"], o["orphan"]) for o in l2["largestOtherNamespaces"]] == [(B, 40, True),
                                                                                                     (C, 1, False)]
    assert (l2["effectiveCapacityBytes"], l2["orphansRemoved"], l2["orphansRemovedBytes"]) == (200, 3, 15)
    # A claim shared by two pods (one existing claim) counts once.
    twice = claim_space_summary([("pvc/x", "p-0", inv), ("pvc/x", "p-1", inv)], A, frozenset({A}), NOW)
    assert twice is not None and (twice["claims"], twice["otherNamespacesBytes"]) == (1, 750)


# ---- the threshold condition and its events

def _l2(used: int, cap: int = 1000, others: bool = True) -> dict:
    inv = Inventory("pvc/data-x-0", [NamespaceUsage(A, used // 2, 1, NOW)]
                    + ([NamespaceUsage(B, used - used // 2, 3, NOW - 12 * DAY_S)] if others else []),
                    capacity_bytes=cap, free_bytes=cap - used)
    out = claim_space_summary([("pvc/data-x-0", "p-0", inv)], A, frozenset({A}), NOW)
    assert out is not None
    return out


def test_space_condition_turns_false_at_ninety_percent_and_names_the_fix() -> None:
    ok = space_condition(_l2(899), 3)
    assert ok is not None and (ok["type"], ok["status"], ok["reason"]) == (SPACE_CONDITION, "True", "ClaimHasRoom")
    full = space_condition(_l2(900), 3)
    assert full is not None and (full["status"], full["reason"], full["observedGeneration"]) == ("False", "ClaimNearlyFull", 3)
    assert B in full["message"] and "orphan" in full["message"] and "unwritten 12 days" in full["message"]
    assert f"kvpersist gc {B} --no-dry-run" in full["message"] and "orphanRetention.maxAgeDays" in full["message"]
    in_use = _l2(950)
    in_use["largestOtherNamespaces"][0]["orphan"] = False
    cond = space_condition(in_use, 3)
    assert cond is not None and "kvpersist gc" not in cond["message"] and "in use" in cond["message"]
    alone = space_condition(_l2(950, others=False), 3)
    assert alone is not None and alone["status"] == "False" and "maxCapacity" in alone["message"]
    assert space_condition(None, 3) is None
    unknown = _l2(500)
    unknown["capacityBytes"] = None
    assert space_condition(unknown, 3) is None


def test_an_event_on_each_transition_only() -> None:
    full = space_condition(_l2(950), 1)
    room = space_condition(_l2(100), 1)
    assert full is not None and room is not None
    was_ok = {"conditions": [room]}
    assert ("Warning", "ClaimNearlyFull", full["message"]) in events_for(was_ok, {}, [full])
    assert not [e for e in events_for({"conditions": [full]}, {}, [full]) if e[1] == "ClaimNearlyFull"]
    assert [e[:2] for e in events_for({"conditions": [full]}, {}, [room]) if e[1] == "ClaimHasRoom"] == [
        ("Normal", "ClaimHasRoom")]
    assert not [e for e in events_for({}, {}, [room]) if e[1] == "ClaimHasRoom"]  # first sight with room: no news


def test_namespace_resolved_names_an_id_replaced_never_a_first_one() -> None:
    """The id that strands data gets its Event; a new resource's first id is in status only (one
    write less for every new resource: issue 58)."""
    assert not [e for e in events_for({}, {"namespaceId": A}, []) if e[1] == "NamespaceResolved"]
    moved = [e for e in events_for({"namespaceId": A}, {"namespaceId": B}, []) if e[1] == "NamespaceResolved"]
    assert len(moved) == 1 and A in moved[0][2] and B in moved[0][2] and moved[0][0] == "Normal"


# ---- which folders the age limit removes

def test_judge_expiry_never_the_served_a_protected_a_recent_or_an_unsure_folder() -> None:
    old = NOW - 31 * DAY_S
    namespaces = [NamespaceUsage(A, 1, 1, old), NamespaceUsage(B, 1, 1, old), NamespaceUsage(C, 1, 1, NOW - 29 * DAY_S),
                  NamespaceUsage(D, 1, 1, old, complete=False), NamespaceUsage("kvp-" + "e" * 32, 0, 0, None),
                  NamespaceUsage("kvp-" + "f" * 32, 9, 3, old)]
    verdicts = {v.namespace.namespace_id: v for v in judge_expiry(namespaces, A, frozenset({B}), 30, NOW)}
    assert [i for i, v in verdicts.items() if v.removable] == ["kvp-" + "f" * 32]
    assert "serves" in verdicts[A].why and "live" in verdicts[B].why and "within 30" in verdicts[C].why
    assert "newest file is unknown" in verdicts[D].why and "no file" in verdicts["kvp-" + "e" * 32].why


# ---- the bounded, link-free scan

def test_scan_is_bounded_served_folder_first_and_never_follows_links(tmp_path: Path) -> None:
    _files(tmp_path, B, 5, 10, 1.0)
    _files(tmp_path, C, 5, 10, 1.0)
    _files(tmp_path, A, 3, 10, 1.0)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    _files(outside, D, 50, 1000, 1.0)
    os.symlink(outside / D, tmp_path / D)  # a link named like a namespace: not a folder of this claim
    (tmp_path / "we\nird \udcff name").write_bytes(b"x" * 7)  # a hostile name outside any folder
    whole = scan_volume(tmp_path)
    assert {n.namespace_id: (n.bytes, n.complete) for n in whole.namespaces} == {A: (30, True), B: (50, True),
                                                                                   C: (50, True)}
    assert not whole.truncated and whole.other_bytes == 7 + os.lstat(tmp_path / D).st_size
    cut = scan_volume(tmp_path, first=A, max_files=6)
    got = {n.namespace_id: (n.objects, n.complete) for n in cut.namespaces}
    assert cut.truncated and got[A] == (3, True) and got[B][1] is False and got[C] == (0, False)
    held = namespace_usage(tmp_path, B, max_files=4)
    assert held is not None and not held.complete
    assert namespace_usage(tmp_path, D) is None  # the link is no namespace folder


# ---- the agent's /expire refusals (in process; over HTTP in tests/integration/test_orphans.py)

def test_agent_expire_refuses_when_it_cannot_be_sure(tmp_path: Path) -> None:
    _files(tmp_path, A, 2, 10, NOW - 90 * DAY_S)
    _files(tmp_path, B, 2, 10, NOW - 90 * DAY_S)
    _files(tmp_path, C, 2, 10, NOW - 90 * DAY_S)
    agent = Agent(tmp_path, serving=A)
    assert agent.expire(30, None, [B], False, NOW)[0] == 400  # no protected ids: not sure what is in use
    assert agent.expire(30, [A, "../x"], [B], False, NOW)[0] == 400
    assert agent.expire(0, [], [B], False, NOW)[0] == 400 and agent.expire(True, [], [B], False, NOW)[0] == 400
    assert Agent(tmp_path, serving=None).expire(30, [], [B], False, NOW)[0] == 409
    code, body = agent.expire(30, [C], [A, B, C], True, NOW)
    assert code == 200 and [r["namespaceId"] for r in body["removed"]] == [B] and (tmp_path / B).exists()  # dry run
    assert {k["namespaceId"] for k in body["kept"]} == {A, C}
    code, body = agent.expire(30, [C], [A, B, C], False, NOW)
    assert code == 200 and [r["namespaceId"] for r in body["removed"]] == [B] and not (tmp_path / B).exists()
    assert (tmp_path / A).exists() and (tmp_path / C).exists()
    code, body = agent.expire(100, [], [C], False, NOW)  # within the limit: kept
    assert code == 200 and body["removed"] == [] and (tmp_path / C).exists()


# ---- the API field

def test_orphan_retention_is_off_by_default_validated_and_not_in_the_namespace_id() -> None:
    base = _sample()
    assert KVCacheNamespace.model_validate(base).spec.l2.orphan_retention is None
    with_age = _sample(orphanRetention={"maxAgeDays": 30})
    spec = KVCacheNamespace.model_validate(with_age).spec
    assert spec.l2.orphan_retention is not None and spec.l2.orphan_retention.max_age_days == 30
    with pytest.raises(ValidationError):
        KVCacheNamespace.model_validate(_sample(orphanRetention={"maxAgeDays": 0}))
    # Whether old folders are removed cannot change a byte of KV: the namespace id is the same, and
    # so are the pods (the agent judges ages when asked: no new args, no server restart).
    fp = key_fingerprint(b"k" * 32)
    targets = []
    for m in (base, with_age):
        s = KVCacheNamespace.model_validate(m).spec
        targets.append(Target("x", "ns", s, resolve(s.pins(fp)).namespace_id))
    assert targets[0].namespace_id is not None and targets[0].namespace_id == targets[1].namespace_id
    assert agent_container(targets[0], "img") == agent_container(targets[1], "img")


def _sample(**l2: object) -> dict:
    manifest = sample("nvme-minimal")
    manifest["spec"]["l2"].update(l2)
    return manifest
