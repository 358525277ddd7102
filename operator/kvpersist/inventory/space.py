"""What a claim can hold once the folders of other namespaces are counted (an identity change leaves
the old folder there until `kvpersist gc`, and the agent trims only the one it serves), and which
of them an opted-in age limit may remove. Pure: the agent and the operator both judge with these.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvpersist.inventory.volume import NAMESPACE_ID_RE, Inventory, NamespaceUsage, iso

# The agent keeps the served folder within this share of the claim minus what else it holds;
# L2SpaceAvailable turns False earlier, at NEARLY_FULL, so a person hears before the folder shrinks.
TRIM_FILL = 0.95
MIN_SHARE = 0.05  # the served folder's watermark never goes below this share of its capacity
NEARLY_FULL = 0.9
LARGEST_SHOWN = 5  # status.l2.largestOtherNamespaces
DAY_S = 86400.0


def effective_capacity(capacity_bytes: int, claim_bytes: int | None, others_bytes: int, fill: float = TRIM_FILL) -> int:
    """The served namespace's trim watermark: its capacity, lowered to what the claim has left beside
    everything else on it; the capacity alone when the claim's size is unknown. Never below MIN_SHARE:
    where old folders alone fill the claim, deleting every served chunk would trade its hits for
    writes that cannot stay either; the newest chunks keep hitting."""
    if claim_bytes is None or claim_bytes <= 0:
        return capacity_bytes
    return min(capacity_bytes, max(int(capacity_bytes * MIN_SHARE), int(claim_bytes * fill) - others_bytes))


def others_bytes(inv: Inventory, serving: str | None) -> int:
    """Bytes on the volume that are not the served namespace's: other folders and stray files."""
    return inv.other_bytes + sum(n.bytes for n in inv.namespaces if n.namespace_id != serving)


def used_bytes(inv: Inventory) -> int:
    """The claim's fill: the larger of what the (maybe cut short) scan counted and the filesystem's."""
    scanned = inv.other_bytes + sum(n.bytes for n in inv.namespaces)
    fs_used = inv.capacity_bytes - inv.free_bytes if inv.capacity_bytes is not None and inv.free_bytes is not None else 0
    return max(scanned, fs_used)


@dataclass
class Verdict:
    """One folder judged for the age limit: removable, or why it stays."""

    namespace: NamespaceUsage
    removable: bool
    why: str = ""


def judge_expiry(namespaces: Iterable[NamespaceUsage], serving: str | None, protected: frozenset[str],
                 max_age_days: int, now: float) -> list[Verdict]:
    """Which folders of OTHER namespaces the age limit removes: those whose newest file is older than
    max_age_days; never the served one, one in protected (used by a live resource or server), one whose
    walk was cut short (its newest file unknown), nor one with no file (no age to judge)."""
    out = []
    for n in namespaces:
        nsid = n.namespace_id
        why = ("not a namespace id" if not NAMESPACE_ID_RE.fullmatch(nsid)
               else "the namespace this server serves" if nsid == serving
               else "used by a live resource or server" if nsid in protected
               else "too many files to walk in one scan: its newest file is unknown" if not n.complete
               else "no file in it" if n.last_write is None
               else f"written {int((now - n.last_write) // DAY_S)} day(s) ago, within {max_age_days}"
               if now - n.last_write <= max_age_days * DAY_S else "")
        out.append(Verdict(n, not why, why))
    return out


def claim_summary(location: str, inv: Inventory, serving: str | None, live: frozenset[str], now: float) -> dict[str, Any]:
    """One claim's space as status.l2 shows it: size, fill, what the other namespaces' folders hold (the
    largest few too), and the served namespace's watermark."""
    others = sorted((n for n in inv.namespaces if n.namespace_id != serving), key=lambda n: (-n.bytes, n.namespace_id))
    out: dict[str, Any] = {
        "location": location,
        "capacityBytes": inv.capacity_bytes,
        "usedBytes": used_bytes(inv),
        "otherNamespacesBytes": sum(n.bytes for n in others),
        "otherNamespaces": len(others),
        "largestOtherNamespaces": [
            {"namespaceId": n.namespace_id, "bytes": n.bytes, "objects": n.objects, "lastWrite": iso(n.last_write),
             **({"ageDays": int(max(0.0, now - n.last_write) // DAY_S)} if n.last_write is not None else {}),
             "orphan": n.namespace_id not in live}
            for n in others[:LARGEST_SHOWN]],
    }
    if inv.effective_capacity_bytes is not None:
        out["effectiveCapacityBytes"] = inv.effective_capacity_bytes
    if inv.truncated:
        out["scanComplete"] = False
    return out


def fraction(claim: dict[str, Any]) -> float | None:
    cap = claim.get("capacityBytes")
    return claim["usedBytes"] / cap if cap else None


def claim_space_summary(volumes: list[tuple[str, str | None, Inventory]], serving: str | None, live: frozenset[str],
                        now: float, old: dict[str, Any] | None = None,
                        removed: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """status.l2 from the agents' scans, each (location, pod, inventory): the fullest claim's figures (it
    fills first), the other namespaces' bytes over all claims, and the age limit's removals so far
    (the old status.l2's plus this pass's)."""
    if not volumes:
        return None
    distinct = {loc: claim_summary(loc, inv, serving, live, now) for loc, _pod, inv in volumes}
    fullest = max(distinct.values(), key=lambda c: (fraction(c) or 0.0, c["location"]))
    old = old or {}
    removed = removed or []
    out = {**fullest, "claims": len(distinct), "otherNamespacesBytes": sum(c["otherNamespacesBytes"] for c in distinct.values()),
           "orphansRemoved": int(old.get("orphansRemoved") or 0) + len(removed),
           "orphansRemovedBytes": int(old.get("orphansRemovedBytes") or 0) + sum(int(r.get("bytes") or 0) for r in removed)}
    last = removed[-1]["namespaceId"] if removed else old.get("lastOrphanRemoved")
    if last:
        out["lastOrphanRemoved"] = last
    return out
