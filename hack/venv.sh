#!/usr/bin/env bash
# Prints the path of a virtualenv with the project and its test/data-path extras installed.
# The venv lives outside the work tree, keyed by the dependency lists, so a second run (or CI on
# the same machine) reuses it; only the project itself is reinstalled, editable, from this tree.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${KVPERSIST_CACHE:-$HOME/.cache/kvpersist}"
EXTRAS="${KVPERSIST_EXTRAS:-dev,datapath,contract}"
key=$(python3 - "$EXTRAS" <<'PY'
import hashlib, json, sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = {"deps": p["dependencies"], "extras": {k: p["optional-dependencies"][k] for k in sys.argv[1].split(",")}}
print(hashlib.sha256(json.dumps(deps, sort_keys=True).encode()).hexdigest()[:12])
PY
)
VENV="$CACHE/venv-$key"
mkdir -p "$CACHE"
# One builder at a time: a second run must not delete a venv that the first is still filling.
exec 9>"$CACHE/venv-$key.lock"
flock -w 1800 9 || { echo "[venv] another run holds $CACHE/venv-$key.lock for 30 min" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
  echo "[venv] creating $VENV with extras $EXTRAS (first time: lmcache and vLLM pull in torch, about 10 GB and several minutes)" >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >&2
  "$VENV/bin/pip" install -q -e ".[$EXTRAS]" >&2
  touch "$VENV/.complete"
else
  "$VENV/bin/pip" install -q --no-deps -e . >&2
fi
echo "$VENV"
