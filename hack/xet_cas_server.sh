#!/usr/bin/env bash
# Builds xet-core's own CAS server (`local_cas_server`, crate xet-client with the `simulation`
# feature, the version of the hf_xet wheel in use) for the opt-in HTTP case of
# tests/integration/test_hfbucket_datapath.py, and prints the path to give it:
#
#   KVPERSIST_XET_CAS_SERVER="$(bash hack/xet_cas_server.sh)" pytest tests/integration/test_hfbucket_datapath.py
#
# A Rust build of about 300 crates from crates.io (cargo, cmake and a C compiler needed): tens of
# minutes on two cores, which is why CI runs only the in-process local:// case. Cached under
# ~/.cache/kvpersist/bin; KVPERSIST_CARGO_JOBS (default 1) and nice keep it out of other work's way.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("hf-xet"))')"
ROOT="${HOME}/.cache/kvpersist/bin/xet-cas-${VERSION}"
BIN="${ROOT}/bin/local_cas_server"
if [ ! -x "$BIN" ]; then
  command -v cargo >/dev/null || { echo "xet_cas_server: cargo not found (rustup, or apt-get install cargo)" >&2; exit 2; }
  nice -n 19 cargo install xet-client --version "$VERSION" --locked --features simulation --bin local_cas_server \
    --root "$ROOT" -j "${KVPERSIST_CARGO_JOBS:-1}" >&2
fi
echo "$BIN"
