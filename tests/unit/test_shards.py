"""The e2e tier's split into parallel shards (tests/shards.py, hack/test.sh): every module placed on
purpose, the real-vLLM modules together, the shards about equal, the same split everywhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import shards

E2E = Path(__file__).resolve().parents[1] / "e2e"
MODULES = sorted(p.name for p in E2E.glob("test_*.py"))


def test_every_e2e_module_has_a_measured_weight() -> None:
    assert sorted(set(MODULES) - set(shards.WEIGHTS)) == [], "add the new module's wall time to tests/shards.py WEIGHTS"
    assert sorted(set(shards.WEIGHTS) - set(MODULES)) == [], "a module in WEIGHTS is gone: drop it"


def test_the_modules_that_run_the_real_vllm_are_the_vllm_block() -> None:
    """A module that starts vLLM for real (kvpersist_env(..., vllm=...)) runs in the vLLM shard, so
    two vLLM processes never run at once."""
    starts_vllm = {p.name for p in E2E.glob("test_*.py") if re.search(r"kvpersist_env\(.*\bvllm=", p.read_text())}
    assert starts_vllm == set(shards.VLLM_MODULES)


def test_the_split_is_balanced_complete_and_stable() -> None:
    placed = shards.assign(MODULES, 2)
    assert set(placed) == set(MODULES) and set(placed.values()) == {1, 2}
    assert {m for m, k in placed.items() if m in shards.VLLM_MODULES} <= {m for m, k in placed.items() if k == 1}
    load = [sum(shards.WEIGHTS[m] for m, k in placed.items() if k == i) for i in (1, 2)]
    assert abs(load[0] - load[1]) <= 0.1 * sum(load), load
    assert shards.assign(list(reversed(MODULES)), 2) == placed  # the order modules are found in does not matter


@pytest.mark.parametrize("value", ["0/2", "3/2", "1", "a/b", "1/0", ""])
def test_a_malformed_shard_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="--shard"):
        shards.parse(value)
