#!/usr/bin/env bash
# Builds the local cluster's binaries from the Go module proxy into a cache keyed by version.
# Release download sites are unreachable here, so everything comes from source modules.
# Usage: hack/build-cluster-bins.sh            (builds what is missing, prints the bin dir)
#        hack/build-cluster-bins.sh --bin-dir  (prints the bin dir only)
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.37.2}"
ETCD_VERSION="${ETCD_VERSION:-v3.7.3}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
CACHE="${KVPERSIST_CACHE:-$HOME/.cache/kvpersist}"
BIN="$CACHE/bin/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION"
[ "${1:-}" = "--bin-dir" ] && { echo "$BIN"; exit 0; }
export GOFLAGS="${GOFLAGS:--trimpath}"
export CGO_ENABLED=0

command -v go >/dev/null || { echo "error: go not found on PATH; install Go >= 1.26 to build the local cluster" >&2; exit 2; }
mkdir -p "$BIN"
log() { echo "[build-cluster-bins] $*" >&2; }

build_k8s() {
  local want=(kube-apiserver kube-controller-manager kube-scheduler kubectl) missing=0
  for b in "${want[@]}"; do [ -x "$BIN/$b" ] || missing=1; done
  [ "$missing" = 1 ] || return 0
  local mod="$CACHE/src/k8s-wrapper-$K8S_VERSION"
  mkdir -p "$mod"
  local minor="v0.${K8S_VERSION#v1.}"
  (
    cd "$mod"
    [ -f go.mod ] || go mod init kvpersist.local/k8s-wrapper >/dev/null 2>&1
    go mod edit -require="k8s.io/kubernetes@$K8S_VERSION"
    # k8s.io/kubernetes replaces its staging modules with ./staging paths, which the go command
    # ignores in a dependency; pin each one to the published tag of the same release instead.
    local kdir
    kdir="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')"
    # shellcheck disable=SC2013  # module paths: one word each
    for m in $(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$kdir/go.mod"); do
      go mod edit -replace="$m=$m@$minor"
    done
    cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
    go mod tidy -e >/dev/null 2>&1 || true
    for b in "${want[@]}"; do
      if [ ! -x "$BIN/$b" ]; then
        log "building $b $K8S_VERSION"
        go build -tags tools -o "$BIN/$b.tmp" "k8s.io/kubernetes/cmd/$b" && mv "$BIN/$b.tmp" "$BIN/$b"
      fi
    done
  )
}

build_etcd() {
  [ -x "$BIN/etcd" ] && return 0
  local mod="$CACHE/src/etcd-wrapper-$ETCD_VERSION"
  mkdir -p "$mod"
  (
    cd "$mod"
    [ -f go.mod ] || go mod init kvpersist.local/etcd-wrapper >/dev/null 2>&1
    go mod edit -require="go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    local edir
    edir="$(go mod download -json "go.etcd.io/etcd/server/v3@$ETCD_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')"
    # etcd's own replace directives point at sibling folders; pin those modules to the same tag.
    # shellcheck disable=SC2013  # module paths: one word each
    for m in $(sed -n 's#^\s*\(go.etcd.io/etcd/[a-z0-9/-]*\) => \.\./.*#\1#p' "$edir/go.mod"); do
      go mod edit -replace="$m=$m@$ETCD_VERSION"
    done
    printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' > tools.go
    go mod tidy -e >/dev/null 2>&1 || true
    log "building etcd $ETCD_VERSION"
    go build -tags tools -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3 && mv "$BIN/etcd.tmp" "$BIN/etcd"
  )
}

build_go_install() { # name module-path version
  [ -x "$BIN/$1" ] && return 0
  log "building $1 $3"
  GOBIN="$BIN" go install "$2@$3"
}

build_helm() {
  # With the ldflags of helm's own Makefile: its version (`helm version`, .Capabilities.HelmVersion)
  # and the Kubernetes version of its client-go (.Capabilities.KubeVersion, which `helm template`
  # and `helm lint` assume: 1.20 without them, below the chart's minimum). A helm in the folder
  # that reports another version (one built before these flags) is built again.
  if [ -x "$BIN/helm" ] && [ "$("$BIN/helm" version --template '{{.Version}}' 2>/dev/null)" = "$HELM_VERSION" ]; then
    return 0
  fi
  local pkg=helm.sh/helm/v3 hdir minor tmp
  hdir="$(cd "$CACHE" && go mod download -json "$pkg@$HELM_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')"
  minor="$(sed -n 's#^[[:space:]]*k8s.io/client-go v0\.\([0-9]*\)\..*#\1#p' "$hdir/go.mod")"
  [ -n "$minor" ] || { echo "error: no k8s.io/client-go version in $hdir/go.mod" >&2; exit 1; }
  log "building helm $HELM_VERSION (Kubernetes 1.$minor)"
  tmp="$(mktemp -d "$BIN/.helm-build.XXXXXX")"
  GOBIN="$tmp" go install -ldflags "-X $pkg/internal/version.version=$HELM_VERSION \
    -X $pkg/pkg/chartutil.k8sVersionMajor=1 -X $pkg/pkg/chartutil.k8sVersionMinor=$minor \
    -X $pkg/pkg/lint/rules.k8sVersionMajor=1 -X $pkg/pkg/lint/rules.k8sVersionMinor=$minor" "$pkg/cmd/helm@$HELM_VERSION"
  mv "$tmp/helm" "$BIN/helm"  # a rename: a helm running from the folder meanwhile keeps its file
  rmdir "$tmp"
}

kwok_stages() {
  # kwok ships no built-in stages; take the "fast" node, lease heartbeat and pod stages from
  # the same kwok module version that built the binary.
  [ -s "$BIN/kwok-stages.yaml" ] && return 0
  local kdir f
  kdir="$(cd "$CACHE" && go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    echo "---"; cat "$kdir/kustomize/stage/$f"
  done > "$BIN/kwok-stages.yaml.tmp"
  mv "$BIN/kwok-stages.yaml.tmp" "$BIN/kwok-stages.yaml"
}

build_etcd
build_go_install kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION"
build_helm
kwok_stages
build_k8s
echo "$BIN"
