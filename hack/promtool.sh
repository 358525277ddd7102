#!/usr/bin/env bash
# Prints a folder holding promtool (Prometheus's rule checker), for tests/unit/test_alert_rules.py.
# From Debian's prometheus package (this project's machines reach Debian's archive, not GitHub's
# releases), pinned by version and by the .deb's sha256: a changed file fails here. Only the
# promtool binary is extracted (dpkg-deb -x): nothing is installed or started. Cached outside the
# work tree, keyed by the version.
set -euo pipefail
VERSION="2.42.0+ds-5+deb12u1"
SHA256="81d59a24fce84f7fbe97a45a4f2914b6a5881b5cd1db2a6a0e129e515e1a5f55"
DIR="${KVPERSIST_CACHE:-$HOME/.cache/kvpersist}/promtool-$VERSION"
if [ ! -x "$DIR/promtool" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && apt-get download -q "prometheus=$VERSION" >&2)
  deb="$(ls "$work"/prometheus_*.deb)"
  echo "$SHA256  $deb" | sha256sum -c --quiet - >&2 || { echo "[promtool] $deb: sha256 differs from $SHA256" >&2; exit 1; }
  dpkg-deb -x "$deb" "$work/x"
  mkdir -p "$DIR"
  install -m 0755 "$work/x/usr/bin/promtool" "$DIR/promtool.part"
  mv "$DIR/promtool.part" "$DIR/promtool"
fi
echo "$DIR"
