#!/usr/bin/env bash
# The main job on a fresh machine: local cluster up, CRD installed, operator running, a sample
# applied, `kubectl get kvcachenamespaces` printed. Leaves it all running for you to explore;
# `bash hack/demo.sh down` stops the operator and the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${KVPERSIST_CLUSTER_DIR:-${KVPERSIST_CACHE:-$HOME/.cache/kvpersist}/cluster}"
OPERATOR_PID="$STATE/operator.pid"

stop_operator() {
  if [ -f "$OPERATOR_PID" ] && kill -0 "$(cat "$OPERATOR_PID")" 2>/dev/null; then
    kill -TERM -- "-$(cat "$OPERATOR_PID")" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$(cat "$OPERATOR_PID")" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$(cat "$OPERATOR_PID")" 2>/dev/null || true
  fi
  rm -f "$OPERATOR_PID"
}

if [ "${1:-}" = "down" ]; then
  stop_operator
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

stop_operator
mkdir -p "$STATE/logs"
setsid kvpersist run --standalone --namespace default >"$STATE/logs/operator.log" 2>&1 < /dev/null &
echo $! > "$OPERATOR_PID"
echo "operator running (pid $(cat "$OPERATOR_PID"), log $STATE/logs/operator.log)"

kubectl apply -f config/samples/nvme-minimal.yaml
for _ in $(seq 1 60); do
  [ -n "$(kubectl get kvns llama31-8b -o jsonpath='{.status.phase}' 2>/dev/null)" ] && break
  sleep 1
done
kubectl get kvcachenamespaces
echo
echo "KUBECONFIG=$KUBECONFIG   stop everything with: bash hack/demo.sh down"
