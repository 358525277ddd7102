"""Property-based fuzzing of the spec, against the pydantic models and the real API server.

Each example is a sample with a few fields replaced by arbitrary values (wrong types, out of
range, empty, missing). The API server refuses it naming a field, or accepts it; then the
operator must reconcile it (a status at the current generation) without crashing or looping,
and where its own model disagrees with the schema it says so in a condition naming the field.
Pydantic, on its own, refuses with a path or accepts."""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvpersist.api.v1alpha1 import KVCacheNamespace, validation_message
from tests.cases.invalid_manifests import sample
from tests.e2e.kube import Kubectl, wait_for
from tests.e2e.operator_env import start_operator, stop

pytestmark = pytest.mark.e2e
MAX_EXAMPLES = 60


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append((*prefix, k))
            out += _paths(v, (*prefix, k))
    return out


BASE = {name: sample(name) for name in ("nvme-minimal", "hf-bucket", "tp2-fp8")}
PATHS = {name: [p for p in _paths(obj["spec"]) if p] for name, obj in BASE.items()}


def _leaf_values(node: Any) -> dict[str, list]:
    out: dict[str, list] = {}
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, dict):
                for kk, vv in _leaf_values(v).items():
                    out.setdefault(kk, []).extend(vv)
            else:
                out.setdefault(k, []).append(v)
    return out


# Plausible values per field name, from every sample, and their numeric neighbours: so that a
# good share of examples is valid and gets as far as the operator.
PLAUSIBLE: dict[str, list] = {}
for _obj in BASE.values():
    for _key, _vals in _leaf_values(_obj["spec"]).items():
        PLAUSIBLE.setdefault(_key, [])
        for _v in _vals:
            PLAUSIBLE[_key].append(_v)
            if isinstance(_v, (int, float)) and not isinstance(_v, bool):
                PLAUSIBLE[_key] += [type(_v)(_v * 2), type(_v)(max(_v // 2 if isinstance(_v, int) else _v / 2, 1))]
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-10, 70000), st.floats(-2, 5000, allow_nan=False, allow_infinity=False),
    st.sampled_from(["", "auto", "fp8", "main", "LRU", "noop", "500Gi", "lots", "a" * 41, "0" * 40, "sha256:" + "f" * 64,
                     "--kv-cache-dtype=fp8", "hf://buckets/a/b", "kvp-x"]),
    st.text(max_size=12), st.lists(st.text(max_size=5), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


@st.composite
def specs(draw: st.DrawFn) -> dict:
    base = draw(st.sampled_from(sorted(BASE)))
    obj = copy.deepcopy(BASE[base])
    for path in draw(st.lists(st.sampled_from(PATHS[base]), min_size=1, max_size=3, unique=True)):
        node = obj["spec"]
        for key in path[:-1]:
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            if isinstance(node, dict):
                plausible = PLAUSIBLE.get(path[-1], [])
                value = draw(st.sampled_from(plausible)) if plausible and draw(st.booleans()) else draw(VALUES)
                if value is None:
                    node.pop(path[-1], None)
                else:
                    node[path[-1]] = value
    return obj


STATE: dict[str, Any] = {"accepted": [], "refused": 0, "pydantic_refused": 0, "disagree": 0}


@pytest.fixture(scope="module")
def fuzz_env(kubectl: Kubectl, crd: None, tmp_path_factory: pytest.TempPathFactory):
    ns = f"e2e-fuzz-{uuid.uuid4().hex[:6]}"
    kubectl.run("create", "namespace", ns)
    log = tmp_path_factory.mktemp("fuzz") / "operator.log"
    op = start_operator(kubectl.kubeconfig, ns, log)
    yield {"ns": ns, "op": op, "log": log}
    stop(op)
    kubectl.run("delete", "namespace", ns, "--wait=false", check=False)


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(obj=specs())
def test_fuzzed_specs_are_refused_naming_a_field_or_reconciled(kubectl: Kubectl, fuzz_env: dict, obj: dict) -> None:
    name = f"f{uuid.uuid4().hex[:10]}"
    obj = copy.deepcopy(obj)
    obj["metadata"] = {"name": name, "namespace": fuzz_env["ns"]}
    try:
        KVCacheNamespace.model_validate(obj)
        model_ok = True
    except ValidationError as exc:
        model_ok = False
        STATE["pydantic_refused"] += 1
        assert any(part in validation_message(exc) for part in ("spec", "metadata")), validation_message(exc)
    out = kubectl.apply(obj, check=False)
    if out.returncode != 0:
        STATE["refused"] += 1
        assert "spec." in out.stderr or "spec:" in out.stderr or 'unknown field "spec' in out.stderr, out.stderr
    else:
        STATE["accepted"].append(name)
        STATE["disagree"] += int(not model_ok)


def test_operator_reconciled_every_accepted_spec_and_survived(kubectl: Kubectl, fuzz_env: dict, fault_log) -> None:
    ns, accepted = fuzz_env["ns"], STATE["accepted"]
    assert STATE["refused"] + len(accepted) >= MAX_EXAMPLES // 2

    def all_observed() -> bool:
        items = {o["metadata"]["name"]: o for o in kubectl.get("kvns", namespace=ns)["items"]}
        return all((items[n].get("status") or {}).get("observedGeneration") == items[n]["metadata"]["generation"]
                   for n in accepted)

    wait_for("every accepted spec reconciled", all_observed, timeout=180)
    failed = []
    for n in accepted:
        status = kubectl.get("kvns", n, ns)["status"]
        if status.get("phase") == "Failed":
            cond = next(c for c in status["conditions"] if c["type"] == "Ready")
            assert "spec" in cond["message"], cond
            failed.append(n)
    assert fuzz_env["op"].poll() is None, "the operator died"
    log = Path(fuzz_env["log"]).read_text()
    assert "Traceback" not in log, log[-3000:]
    fault_log(f"{STATE['refused'] + len(accepted)} fuzzed specs (hypothesis: wrong types, ranges, empties, removals)",
              f"{STATE['refused']} refused at apply time naming a spec field; {len(accepted)} accepted, all reconciled "
              f"(status at their generation), {len(failed)} of them marked Failed by the operator with the field named; "
              f"the models refused {STATE['pydantic_refused']}; the operator never crashed or logged a traceback")
