#!/usr/bin/env bash
# The main job on a fresh machine: local cluster up, CRD installed, operator running, a sample
# applied, `kubectl get kvcachenamespaces` printed. Leaves it all running for you to explore;
# `bash hack/demo.sh down` stops the operator and the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${KVPERSIST_CLUSTER_DIR:-${KVPERSIST_CACHE:-$HOME/.cache/kvpersist}/cluster}"

stop_pidfile() { # stops the process group a pid file names, bounded
  local f="$STATE/$1.pid"
  if [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null; then
    kill -TERM -- "-$(cat "$f")" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$(cat "$f")" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$(cat "$f")" 2>/dev/null || true
  fi
  rm -f "$f"
}

if [ "${1:-}" = "down" ]; then
  stop_pidfile operator
  stop_pidfile lmcache-runner
  python3 hack/localcluster.py down
  exit 0
fi

VENV="$(bash hack/venv.sh)"
BIN="$(python3 hack/localcluster.py build)"
export PATH="$VENV/bin:$BIN:$PATH"
export KUBECONFIG="$(python3 hack/localcluster.py up)"

kubectl apply --server-side -f crds/
kubectl wait --for condition=established --timeout=60s crd/kvcachenamespaces.kvpersist.dev
kubectl apply -f hack/dev/local-nvme.yaml

stop_pidfile operator
stop_pidfile lmcache-runner
mkdir -p "$STATE/logs"
setsid kvpersist run --standalone --namespace default >"$STATE/logs/operator.log" 2>&1 < /dev/null &
echo $! > "$STATE/operator.pid"
echo "operator running (pid $(cat "$STATE/operator.pid"), log $STATE/logs/operator.log)"
# kwok runs no containers: this starts the real lmcache server for each lmcache-server pod, on
# the pod's loopback IP, with L1 capped to what this machine can hold.
setsid python3 hack/kwok_lmcache_runner.py --namespace default --max-l1-gb 1 \
  --workdir "$STATE/kwok-pods" >"$STATE/logs/lmcache-runner.log" 2>&1 < /dev/null &
echo $! > "$STATE/lmcache-runner.pid"

kubectl apply -f config/samples/nvme-minimal.yaml
for _ in $(seq 1 120); do
  [ "$(kubectl get kvns llama31-8b -o jsonpath='{.status.phase}' 2>/dev/null)" = "Ready" ] && break
  sleep 1
done
kubectl get kvcachenamespaces
echo
echo "KUBECONFIG=$KUBECONFIG   stop everything with: bash hack/demo.sh down"
