"""Conditions and phase: pure functions from observations to the status a user reads."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

CONDITION_TYPES = ("IdentityResolved", "L2Ready", "LMCacheReady", "VLLMReady", "Ready")


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, ok: bool | None, reason: str, message: str = "", generation: int | None = None) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    out: dict[str, Any] = {"type": type_, "status": status, "reason": reason, "message": message}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def merge_conditions(old: Iterable[Mapping[str, Any]], new: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """New conditions keep the old lastTransitionTime unless their status changed."""
    previous = {c["type"]: c for c in old}
    merged = []
    for c in new:
        prior = previous.get(c["type"])
        stamp = prior.get("lastTransitionTime") if prior and prior.get("status") == c["status"] else None
        merged.append({**c, "lastTransitionTime": stamp or now()})
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(merged, key=lambda c: order.get(c["type"], len(order)))


def same_conditions(a: Iterable[Mapping[str, Any]], b: Iterable[Mapping[str, Any]]) -> bool:
    """Equal apart from timestamps: the test for 'status changed, write it'."""
    strip = lambda cs: sorted((c["type"], c["status"], c["reason"], c.get("message", ""), c.get("observedGeneration"))  # noqa: E731
                              for c in cs)
    return strip(a) == strip(b)
