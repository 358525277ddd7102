"""Property-based fuzzing of the spec, against the pydantic models and the real API server.

Each example is a sample with a few fields replaced by arbitrary values (wrong types, out of
range, empty, missing, a control or format character in a string). The oracle, per example:
- the models and the API server give the same verdict: both refuse it or both accept it (the
  models evaluate the CRD's own CEL rules, kvpersist.api.celrules: no rule is written twice);
- the API server refuses it naming a field the example changed (or one a rule ties to it), or
  accepts it, and what it stores holds no control or format character (kvpersist.api.text);
- the models, refusing, name a path;
- an accepted one is reconciled (a status at its generation) without the operator crashing or
  looping; the models accept what was stored too, and it is never InvalidSpec; no condition
  message carries a control character."""

from __future__ import annotations

import copy
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvpersist.api.v1alpha1 import KVCacheNamespace, validation_message
from tests.cases.invalid_manifests import sample
from tests.cases.oracles import forbidden
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
                     "--kv-cache-dtype=fp8", "hf://buckets/a/b", "kvp-x",
                     # hostile quantities and prefixes (issue 29): an overflow, a sign, a walk out of the prefix
                     "1e309", "9e99", "-500Gi", "99999999999999999999Ei", "hf://buckets/a/b/../c", "hf://buckets/a/b//c",
                     # control and format characters in free strings (issue 29): a bidi override, a NUL, a line
                     # break, a zero-width space, a byte order mark, a tag character
                     "qwen\u202egnp.exe", "a\x00b", "/v1\nINFO: ok", "vllm\u200b", "\ufeffgpu", "x\U000e0041"]),
    st.text(max_size=12), st.lists(st.text(max_size=5), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


REFUSED_CHARS = st.sampled_from(["\u202e", "\u2067", "\x00", "\n", "\r", "\t", "\x1b", "\x85", "\u200b", "\ufeff",
                                 "\u2028", "\U000e0041"])


@st.composite
def specs(draw: st.DrawFn) -> tuple[dict, list[str]]:
    """A sample with a few fields changed, and those fields' paths ("spec.l1.size")."""
    base = draw(st.sampled_from(sorted(BASE)))
    obj = copy.deepcopy(BASE[base])
    changed = []
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
                if isinstance(value, str) and draw(st.integers(0, 4)) == 0:  # a plausible string, one character hostile
                    at = draw(st.integers(0, len(value)))
                    value = value[:at] + draw(REFUSED_CHARS) + value[at:]
                if value is None:
                    node.pop(path[-1], None)
                else:
                    node[path[-1]] = value
                changed.append(".".join(("spec", *path)))
    return obj, changed


FIELD = re.compile(r"\bspec(?:\.[A-Za-z0-9_]+|\[\d+\])*")


def named_fields(text: str) -> set[str]:
    """The spec field paths a message names, list indexes dropped ("spec.vllm.extraArgs")."""
    return {re.sub(r"\[\d+\]", "", m) for m in FIELD.findall(text)}


def names_a_changed_field(text: str, changed: list[str]) -> bool:
    """Whether a refusal names what the example changed: the field itself, a field inside it, the
    object holding it (a rule over its members, such as "set exactly one of nvme or hfBucket"),
    a sibling whose rule's message names it too ("spec.l2.nvme.maxCapacity: ... or raise size"),
    or, in a rule's own words, the field as the rule writes it ("identity.tensorParallelSize": two
    parts at least, a bare "vllm" would match any message)."""
    named = {n for n in named_fields(text) if n != "spec"}
    for path in changed:
        if any(n == path or n.startswith(path + ".") or path.startswith(n + ".") for n in named):
            return True
        parent, _, last = path.rpartition(".")
        if parent != "spec" and any(n.rpartition(".")[0] == parent for n in named) and re.search(rf"\b{re.escape(last)}\b", text):
            return True
        rest = path.removeprefix("spec.")
        if "." in rest and rest in text:
            return True
    return False


def _strings(node: Any) -> list[str]:
    """Every string in node, map keys included."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return []


def _values(obj: dict, paths: list[str]) -> dict[str, Any]:
    """What the stored object holds at each changed path ("spec.l2.nvme.size"): a CI log of a
    resource left behind then says which values the operator choked on."""
    out: dict[str, Any] = {}
    for path in paths:
        node: Any = obj
        for key in path.split("."):
            node = node.get(key, "<unset>") if isinstance(node, dict) else "<unset>"
        out[path] = node
    return out


STATE: dict[str, Any] = {"accepted": [], "changed": {}, "refused": 0}


@pytest.fixture(scope="module")
def fuzz_env(kubectl: Kubectl, crd: None, tmp_path_factory: pytest.TempPathFactory):
    ns = f"e2e-fuzz-{uuid.uuid4().hex[:6]}"
    kubectl.run("create", "namespace", ns)
    log = tmp_path_factory.mktemp("fuzz") / "operator.log"
    op = start_operator(kubectl.kubeconfig, ns, log)
    yield {"ns": ns, "op": op, "log": log}
    stop(op)
    kubectl.run("delete", "namespace", ns, "--wait=false", check=False)


def _too_large_size() -> tuple[dict, list[str]]:
    """In every run: a claim size past what a Kubernetes quantity holds. The schema once took it
    and only the models refused it (such a resource once crashed every status refresh, and only a
    random example found it); now the one rule (QUANTITY_RULE) refuses it in both."""
    obj = copy.deepcopy(BASE["nvme-minimal"])
    obj["spec"]["l2"]["nvme"]["size"] = "99999999999999999999Ei"
    return obj, ["spec.l2.nvme.size"]


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@example(example=_too_large_size())
@given(example=specs())
def test_fuzzed_specs_are_refused_naming_a_field_or_reconciled(kubectl: Kubectl, fuzz_env: dict,
                                                                example: tuple[dict, list[str]]) -> None:
    name = f"f{uuid.uuid4().hex[:10]}"
    obj, changed = copy.deepcopy(example[0]), example[1]
    obj["metadata"] = {"name": name, "namespace": fuzz_env["ns"]}
    models_say = "accepted"
    try:
        KVCacheNamespace.model_validate(obj)
    except ValidationError as exc:
        models_say = validation_message(exc)
        assert any(part in models_say for part in ("spec", "metadata")), models_say
    out = kubectl.apply(obj, check=False)
    server_says = "accepted" if out.returncode == 0 else out.stderr.strip()
    assert (models_say == "accepted") == (server_says == "accepted"), \
        f"the models and the API server disagree on {_values(obj, changed)}: models: {models_say}; API server: {server_says}"
    if out.returncode != 0:
        STATE["refused"] += 1
        assert "is invalid" in out.stderr or "unknown field" in out.stderr, out.stderr  # refused by validation, not a fault
        assert names_a_changed_field(out.stderr, changed), (changed, out.stderr)
    else:
        STATE["accepted"].append(name)
        STATE["changed"][name] = changed


def test_operator_reconciled_every_accepted_spec_and_survived(kubectl: Kubectl, fuzz_env: dict, fault_log) -> None:
    ns, accepted = fuzz_env["ns"], STATE["accepted"]
    assert STATE["refused"] + len(accepted) >= MAX_EXAMPLES // 2

    def all_observed() -> bool:
        items = {o["metadata"]["name"]: o for o in kubectl.get("kvns", namespace=ns)["items"]}
        return all((items[n].get("status") or {}).get("observedGeneration") == items[n]["metadata"]["generation"]
                   for n in accepted)

    def behind() -> str:
        """Which accepted resources lack a status at their generation, what they show, and the
        operator's last lines: what a CI log needs to tell a slow operator from a stuck one."""
        items = {o["metadata"]["name"]: o for o in kubectl.get("kvns", namespace=ns)["items"]}
        late = []
        for n in accepted:
            obj = items.get(n) or {"metadata": {}}
            st = obj.get("status") or {}
            if st.get("observedGeneration") != obj["metadata"].get("generation"):
                reasons = [f"{c.get('type')}={c.get('reason')}" for c in st.get("conditions") or []]
                late.append(f"{n} (generation {obj['metadata'].get('generation')}, observed {st.get('observedGeneration')}, "
                            f"phase {st.get('phase')}, {reasons}, changed {_values(obj, STATE['changed'].get(n) or [])})")
        tail = Path(fuzz_env["log"]).read_text(errors="replace").splitlines()[-40:]
        return f"{len(late)} of {len(accepted)} behind: {late}; operator alive: {fuzz_env['op'].poll() is None}; " \
               f"its log's last lines:\n" + "\n".join(tail)

    wait_for("every accepted spec reconciled", all_observed, timeout=180, explain=behind)
    failed = []
    for n in accepted:
        stored = kubectl.get("kvns", n, ns)
        hostile = [ascii(t) for t in _strings(stored["spec"]) if any(forbidden(ch) for ch in t)]
        assert hostile == [], f"{n}: the API server stored control or format characters: {hostile}"
        status = stored["status"]
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        try:  # as stored: the defaults the API server applied change no verdict
            KVCacheNamespace.model_validate(stored)
        except ValidationError as exc:
            raise AssertionError(f"{n}: the API server stored what the models refuse: {validation_message(exc)}") from None
        assert ready["reason"] != "InvalidSpec", (n, ready)
        assert not any(forbidden(ch) for c in status["conditions"] for ch in c.get("message", "")), (n, status)
        if status["phase"] == "Failed":
            failed.append(f"{n}: {ready['reason']}")
    assert fuzz_env["op"].poll() is None, "the operator died"
    log = Path(fuzz_env["log"]).read_text()
    assert "Traceback" not in log, log[-3000:]
    print(f"\n[fuzz] {STATE['refused']} refused by the API server and the models, {len(accepted)} accepted by both; "
          f"Failed: {failed}")
    fault_log(f"{STATE['refused'] + len(accepted)} fuzzed specs (hypothesis: wrong types, ranges, empties, removals)",
              f"the models and the API server gave the same verdict on every one; {STATE['refused']} refused at apply time "
              f"naming a field the example changed; {len(accepted)} accepted, all reconciled (status at their generation), "
              f"none InvalidSpec, the models accepting each as stored; the operator never crashed or logged a traceback")
