#!/usr/bin/env bash
# Regenerates the operator image's hashed locks from pyproject.toml (needs the package index):
#   operator/requirements.lock        [project].dependencies and everything they pull in, every file's sha256
#   operator/build-requirements.lock  the build backend (setuptools), for `pip install --no-build-isolation .`
# operator/Dockerfile installs them with --require-hashes; tests/unit/test_supply_chain.py checks that
# the lock still satisfies pyproject.toml. Run after changing a dependency, and commit both files.
set -euo pipefail
cd "$(dirname "$0")/.."
tools="$(mktemp -d)"
trap 'rm -rf "$tools"' EXIT
python3.11 -m venv "$tools/venv"
"$tools/venv/bin/pip" install -q "pip-tools==7.6.2"
export CUSTOM_COMPILE_COMMAND="bash hack/lock.sh"
compile=("$tools/venv/bin/pip-compile" -q --generate-hashes --strip-extras --no-emit-index-url --no-emit-find-links)
"${compile[@]}" --output-file operator/requirements.lock pyproject.toml
python3 -c 'import re, tomllib; print(re.search(r"setuptools\S*", " ".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"])).group(0))' \
  > "$tools/build.in"
"${compile[@]}" --allow-unsafe --output-file operator/build-requirements.lock "$tools/build.in"
sed -i "s|$tools/build.in|pyproject.toml's [build-system].requires|" operator/build-requirements.lock
