#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs (virtualenv, cluster binaries),
# runs lint, unit, integration and e2e tests (the e2e fixtures start the local cluster and stop
# it), and exits non-zero on any failure, including pytest's "no tests ran".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(bash hack/venv.sh)"
BIN="$(python3 hack/localcluster.py build)"
export PATH="$VENV/bin:$BIN:$PATH"
trap 'python3 hack/localcluster.py down >/dev/null 2>&1 || true' EXIT

ruff check .
pytest -p no:cacheprovider --durations=15 "$@" tests
