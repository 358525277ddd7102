#!/usr/bin/env bash
# The whole chain on one GPU node, checked step by step (docs/gpu-cluster.md):
#   a. the lmcache server sees the node's GPUs, vLLM's among them (by UUID, as lmcache maps them);
#   b. vLLM registered its KV with the server (the server's /status);
#   c. a repeated long prompt hits;
#   d. after the vLLM pod is deleted, the new pod gets the prompt from the server;
#   e. after the server pod is deleted (vLLM re-registers), and then the vLLM pod, the prompt
#      comes from L2.
# Each step prints PASS, FAIL or SKIP; the first FAIL ends the run with exit 1 (2: bad usage or a
# resource that is not Ready). Every wait is bounded. d and e DELETE PODS: run it on a resource
# you may disrupt, or pass --skip-restarts (a-c only).
#
#   KUBECONFIG=... bash hack/gpu-smoke.sh NAME [NAMESPACE] [--skip-restarts] [--wait SECONDS]
#       [--words N] [--ipc-check [--ipc-namespace NS]]
#
# Needs kubectl and python3 on this machine; the images need python3 (both have it), and the
# servers' admin API is read from inside their pod (kubectl exec, loopback 127.0.0.1).
# On the project's local cluster (kwok nodes, hack/demo.sh) no container runs, so no kubectl exec
# either: there it reads the same URLs from this machine at the addresses hack/kubelet_runner.py
# gives the pods (a stand-in, said in the output), and step a is a SKIP: no GPU.
# --ipc-check also runs hack/gpu_ipc_check.py (lmcache's own CUDA IPC code, every pod layout) in a
# privileged pod with the server's image on the server's node; that namespace must admit
# privileged pods (--ipc-namespace, default the resource's).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

NAME="" NS="" SKIP_RESTARTS=0 WAIT_S=600 WORDS=1300 IPC_CHECK=0 IPC_NS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-restarts) SKIP_RESTARTS=1 ;;
    --wait) WAIT_S="${2:?--wait needs seconds}"; shift ;;
    --words) WORDS="${2:?--words needs a number}"; shift ;;
    --ipc-check) IPC_CHECK=1 ;;
    --ipc-namespace) IPC_NS="${2:?--ipc-namespace needs a namespace}"; shift ;;
    -h|--help) usage ;;
    -*) echo "unknown option $1" >&2; usage ;;
    *) if [ -z "$NAME" ]; then NAME="$1"; elif [ -z "$NS" ]; then NS="$1"; else usage; fi ;;
  esac
  shift
done
[ -n "$NAME" ] || usage
NS="${NS:-default}"
IPC_NS="${IPC_NS:-$NS}"
KUBECTL="${KUBECTL:-kubectl}"
for tool in "$KUBECTL" python3; do
  command -v "$tool" >/dev/null || { echo "gpu-smoke: $tool not found on PATH" >&2; exit 2; }
done

PASSED=0 SKIPPED=0
say() { echo "[gpu-smoke] $*"; }
info() { echo "      $*"; }
pass() { PASSED=$((PASSED + 1)); echo "PASS  $*"; }
skip() { SKIPPED=$((SKIPPED + 1)); echo "SKIP  $*"; }
fail() {
  echo "FAIL  $1"
  shift
  for line in "$@"; do info "$line"; done
  echo "gpu-smoke: $PASSED passed, 1 failed, $SKIPPED skipped (stopped at the first failure)"
  exit 1
}

# bounded SECONDS CMD...: CMD, killed after SECONDS (exit 124), with coreutils' timeout when there
# is one, else a watchdog of our own (macOS has no timeout).
if command -v timeout >/dev/null; then
  bounded() { timeout "$@"; }
else
  bounded() {
    local secs="$1" pid dog rc=0
    shift
    "$@" &
    pid=$!
    ( trap 'kill "$s" 2>/dev/null; exit 0' TERM; sleep "$secs" & s=$!; wait "$s"; kill -TERM "$pid" 2>/dev/null ) \
      >/dev/null 2>&1 &
    dog=$!
    wait "$pid" || rc=$?
    kill -TERM "$dog" 2>/dev/null || true
    wait "$dog" 2>/dev/null || true
    return "$rc"
  }
fi
k() { "$KUBECTL" -n "$NS" --request-timeout=30s "$@"; }

# pyj EXPR: evaluates EXPR over the JSON on stdin (bound to d) and prints the result (JSON for
# lists and dicts, plain text otherwise).
pyj() {
  python3 -c '
import json, sys
d = json.load(sys.stdin)
r = eval(sys.argv[1])
print(json.dumps(r) if isinstance(r, (list, dict, bool)) or r is None else r)' "$1"
}

# What runs inside the pods (or, on the local cluster, on this machine): standard library only,
# every request with a timeout. Subcommands: gpus | status URL | metrics URL | ask URL WORDS NONCE.
# shellcheck disable=SC2016  # Python source: nothing here is for the shell to expand
PROBE='
import json, random, subprocess, sys, time, urllib.request

def get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()

NAMES = ("vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
         "lmcache_mp_lookup_requested_tokens_total", "lmcache_mp_lookup_hit_l1_tokens_total",
         "lmcache_mp_lookup_hit_l2_tokens_total", "lmcache_mp_l2_store_submitted_objects_chunks_total",
         "lmcache_mp_l2_store_completed_objects_chunks_total")

def metrics(base):
    out = dict.fromkeys(NAMES, 0.0)
    for line in get(base + "/metrics").splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out and not line.startswith("#"):
            out[name] += float(line.rsplit(" ", 1)[1])
    return out

def gpus():
    info = {"count": None, "uuids": [], "smi": []}
    try:
        import torch
        info["count"] = torch.cuda.device_count()
        # What lmcache maps devices by (DeviceIPCWrapper._get_device_uuid).
        info["uuids"] = [str(torch.cuda.get_device_properties(i).uuid) for i in range(info["count"])]
    except Exception as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        info["smi"] = [l.split("UUID: ", 1)[1].rstrip(")") for l in out.splitlines() if "UUID: GPU-" in l]
    except Exception:
        pass
    return info

def status(base):
    s = json.loads(get(base + "/status"))
    ctl = (s.get("storage_manager") or {}).get("store_controller") or {}
    return {"healthy": s.get("is_healthy"), "gpu": [str(i) for i in s.get("registered_gpu_ids") or []],
            "cpu": [str(i) for i in s.get("registered_non_cuda_instance_ids") or []],
            "pending": (ctl.get("pending_keys_count") or 0) + (ctl.get("in_flight_task_count") or 0)}

def ask(base, words, nonce):
    rng = random.Random(nonce)
    syl = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    text = f"Run {nonce}. " + " ".join("".join(rng.choice(syl) for _ in range(rng.randint(1, 3))) for _ in range(int(words))) + "."
    model = json.loads(get(base + "/v1/models"))["data"][0]["id"]
    before = metrics(base)
    body = json.dumps({"model": model, "prompt": text, "max_tokens": 1, "temperature": 0.0}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        usage = json.loads(r.read())["usage"]
    secs = time.monotonic() - t0
    for _ in range(10):  # the counters follow the answer within a step or two of the engine
        after = metrics(base)
        ext = after["vllm:external_prefix_cache_hits_total"] - before["vllm:external_prefix_cache_hits_total"]
        own = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
        if ext or own:
            break
        time.sleep(0.5)
    return {"model": model, "prompt_tokens": usage["prompt_tokens"], "external": int(ext), "own": int(own),
            "seconds": round(secs, 2)}

cmd = sys.argv[1]
if cmd == "gpus":
    print(json.dumps(gpus()))
elif cmd == "status":
    print(json.dumps(status(sys.argv[2])))
elif cmd == "metrics":
    print(json.dumps(metrics(sys.argv[2])))
elif cmd == "ask":
    print(json.dumps(ask(sys.argv[2], sys.argv[3], sys.argv[4])))
'

# ---------------------------------------------------------------- the resource and its pods

KVNS="$(k get kvcachenamespaces "$NAME" -o json 2>&1)" || { echo "gpu-smoke: $KVNS" >&2; exit 2; }
PHASE="$(pyj 'd.get("status", {}).get("phase", "")' <<<"$KVNS")"
NSID="$(pyj 'd.get("status", {}).get("namespaceId") or ""' <<<"$KVNS")"
VLLM_PORT="$(pyj 'd["spec"].get("vllm", {}).get("port", 8000)' <<<"$KVNS")"
say "KVCacheNamespace $NS/$NAME: phase ${PHASE:-none}, namespace id ${NSID:-none}"
if [ "$PHASE" != "Ready" ]; then
  pyj '"\n".join("      %-16s %-7s %s: %s" % (c["type"], c["status"], c["reason"], c.get("message", ""))
                 for c in d.get("status", {}).get("conditions", []))' <<<"$KVNS" >&2
  echo "gpu-smoke: $NAME is not Ready: wait for it (kubectl get kvns $NAME -n $NS -w) or fix what its conditions say" >&2
  exit 2
fi
SEL="app.kubernetes.io/name=kvpersist,app.kubernetes.io/instance=$NAME"

# ready_pod COMPONENT [EXCLUDE...]: a Ready, not deleting pod of the component whose name is none
# of EXCLUDE (and, for the server, on NODE when set); waits at most WAIT_S.
ready_pod() {
  local component="$1" deadline=$((SECONDS + WAIT_S)) found
  shift
  while [ "$SECONDS" -lt "$deadline" ]; do
    found="$(k get pods -l "$SEL,app.kubernetes.io/component=$component" -o json 2>/dev/null | python3 -c '
import json, sys
node, exclude = sys.argv[1], sys.argv[2:]
for p in json.load(sys.stdin)["items"]:
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
    if ready and not p["metadata"].get("deletionTimestamp") and p["metadata"]["name"] not in exclude \
            and p["metadata"]["uid"] not in exclude and (not node or p["spec"].get("nodeName") == node):
        print(p["metadata"]["name"], p["metadata"]["uid"], p["status"]["podIP"], p["spec"]["nodeName"])
        break' "${NODE_FILTER:-}" "$@" || true)"
    if [ -n "$found" ]; then echo "$found"; return 0; fi
    sleep 2
  done
  return 1
}

read -r VLLM_POD _ VLLM_IP NODE < <(ready_pod vllm || true) || true
[ -n "${VLLM_POD:-}" ] || fail "no Ready vLLM pod of $NAME within ${WAIT_S}s" "kubectl get pods -n $NS -l $SEL"
read -r SRV_POD SRV_UID SRV_IP _ < <(NODE_FILTER="$NODE" ready_pod lmcache-server || true) || true
[ -n "${SRV_POD:-}" ] || fail "no Ready lmcache server of $NAME on $NODE (the vLLM pod's node) within ${WAIT_S}s"
say "vLLM pod $VLLM_POD and lmcache server $SRV_POD on node $NODE"
# lmcache's admin port, on the pod's loopback: as the operator rendered it (--http-port), not a field.
HTTP_PORT="$(k get pod "$SRV_POD" -o json | pyj '(a := next(c for c in d["spec"]["containers"] if c["name"] == "lmcache-server")["args"])[a.index("--http-port") + 1]')"

STANDIN=0
if [ -n "$("$KUBECTL" --request-timeout=30s get node "$NODE" -o jsonpath='{.metadata.annotations.kwok\.x-k8s\.io/node}')" ]; then
  STANDIN=1
  say "node $NODE is a kwok node (the local test cluster): no container runs there, so no kubectl exec;"
  say "  the server's admin API and vLLM are read from this machine at the pods' addresses (hack/kubelet_runner.py)"
fi

# The address of a pod's own loopback on the local cluster (hack/kubelet_runner.py pod_loopback).
standin_loopback() { python3 -c 'import sys; p = sys.argv[1].split("."); print(f"127.{(int(p[1]) + 100) % 256}.{p[2]}.{p[3]}")' "$1"; }

# in_server SUBCOMMAND [ARGS]: the probe inside the server container, its admin API on loopback.
in_server() {
  local sub="$1"
  shift
  if [ "$STANDIN" = 1 ]; then
    case "$sub" in
      status|metrics) bounded 60 python3 -c "$PROBE" "$sub" "http://$(standin_loopback "$SRV_IP"):$HTTP_PORT" ;;
      *) bounded 120 python3 -c "$PROBE" "$sub" "$@" ;;
    esac
  else
    case "$sub" in
      status|metrics) bounded 60 "$KUBECTL" -n "$NS" exec "$SRV_POD" -c lmcache-server -- \
        python3 -c "$PROBE" "$sub" "http://127.0.0.1:$HTTP_PORT" ;;
      *) bounded 120 "$KUBECTL" -n "$NS" exec "$SRV_POD" -c lmcache-server -- python3 -c "$PROBE" "$sub" "$@" ;;
    esac
  fi
}

# in_vllm SUBCOMMAND [ARGS]: the probe inside the vLLM container, vLLM on loopback.
in_vllm() {
  local sub="$1"
  shift
  if [ "$STANDIN" = 1 ]; then
    case "$sub" in
      ask) bounded 330 python3 -c "$PROBE" ask "http://$VLLM_IP:$VLLM_PORT" "$@" ;;
      *) bounded 120 python3 -c "$PROBE" "$sub" "$@" ;;
    esac
  else
    case "$sub" in
      ask) bounded 330 "$KUBECTL" -n "$NS" exec "$VLLM_POD" -c vllm -- python3 -c "$PROBE" ask "http://127.0.0.1:$VLLM_PORT" "$@" ;;
      *) bounded 120 "$KUBECTL" -n "$NS" exec "$VLLM_POD" -c vllm -- python3 -c "$PROBE" "$sub" "$@" ;;
    esac
  fi
}

# wait_registered EXCLUDE_JSON: waits (120 s at most) until the server lists an instance id not in
# EXCLUDE_JSON (a JSON list); prints the status JSON. Which transfer path it registered on is in
# .gpu (lmcache-driven, CUDA IPC) or .cpu (engine-driven: vLLM's CPU build).
wait_registered() {
  local exclude="$1" deadline=$((SECONDS + 120)) st=""
  while [ "$SECONDS" -lt "$deadline" ]; do
    st="$(in_server status 2>/dev/null || true)"
    if [ -n "$st" ] && [ "$(pyj "bool(set(d['gpu'] + d['cpu']) - set($exclude))" <<<"$st")" = "true" ]; then
      echo "$st"
      return 0
    fi
    sleep 2
  done
  [ -n "$st" ] || st='{}'
  echo "$st"
  return 1
}

# registration_detail STATUS_JSON: which path the registered vLLM instances took, and their ids.
registration_detail() {
  pyj '"GPU (CUDA IPC, isolated): " + ", ".join(d["gpu"]) if d["gpu"] else "engine-driven (no CUDA IPC): " + ", ".join(d["cpu"])' <<<"$1"
}

NONCE="$(date +%s)-$$"  # a prompt no earlier run has cached
ask_prompt() { in_vllm ask "$WORDS" "$NONCE"; }

# Steps d and e: delete the vLLM pod ($1 is the step), wait for its replacement, the server on its
# node, and its registration with that server (sets VLLM_POD, VLLM_IP, NODE, SRV_POD, SRV_UID, SRV_IP, ST).
replace_vllm() {
  local step="$1" why="$2" old="$VLLM_POD" before
  before="$(pyj 'd["gpu"] + d["cpu"]' <<<"$ST")"
  say "deleting vLLM pod $old $why"
  k delete pod "$old" --wait=false >/dev/null
  read -r VLLM_POD _ VLLM_IP NODE < <(ready_pod vllm "$old" || true) || true
  [ -n "${VLLM_POD:-}" ] || fail "$step. no new Ready vLLM pod within ${WAIT_S}s"
  read -r SRV_POD SRV_UID SRV_IP _ < <(NODE_FILTER="$NODE" ready_pod lmcache-server || true) || true
  [ -n "${SRV_POD:-}" ] || fail "$step. no Ready lmcache server on $NODE, the new vLLM pod's node"
  ST="$(wait_registered "$before")" || fail "$step. the new vLLM pod $VLLM_POD did not register with $SRV_POD within 120 s"
}

# The prompt again ($1 is the step), counting how far the server's counter $2 moved meanwhile:
# sets AGAIN (vLLM's answer), EXT (tokens from LMCache), SAID and COUNTED.
ask_counting() {
  local step="$1" counter="$2" m0 m1
  m0="$(in_server metrics)"
  AGAIN="$(ask_prompt 2>&1)" || fail "$step. the request to the new pod $VLLM_POD failed: $AGAIN"
  m1="$(in_server metrics)"
  COUNTED="$(python3 -c 'import json,sys; a,b=json.loads(sys.argv[1]),json.loads(sys.argv[2]); n=sys.argv[3]; print(int(b[n]-a[n]))' "$m0" "$m1" "$counter")"
  EXT="$(pyj 'd["external"]' <<<"$AGAIN")"
  SAID="$(pyj '"{external} of {prompt_tokens} tokens from LMCache, {seconds} s".format(**d)' <<<"$AGAIN")"
}

# ---------------------------------------------------------------- a. the server sees the GPU

HAS_GPU=1
if [ "$STANDIN" = 1 ]; then
  HAS_GPU=0
  skip "a. the server sees the GPU: stand-in, no GPU (node $NODE is a kwok node; its pods run vLLM's CPU build on this machine)"
else
  SRV_GPUS="$(in_server gpus 2>&1)" || fail "a. could not run python3 in $SRV_POD (container lmcache-server): $SRV_GPUS"
  VLLM_GPUS="$(in_vllm gpus 2>&1)" || fail "a. could not run python3 in $VLLM_POD (container vllm): $VLLM_GPUS"
  info "server $SRV_POD: $SRV_GPUS"
  info "vLLM   $VLLM_POD: $VLLM_GPUS"
  VLLM_SEES="$(pyj 'max(d["count"] or 0, len(d["smi"]))' <<<"$VLLM_GPUS")"
  if [ "$VLLM_SEES" = 0 ]; then
    HAS_GPU=0
    skip "a. the server sees the GPU: the vLLM pod sees no GPU either (node $NODE has none for it): nothing to compare"
  else
    SRV_COUNT="$(pyj 'd["count"] or 0' <<<"$SRV_GPUS")"
    RUNTIME="$(k get pod "$SRV_POD" -o jsonpath='{.spec.runtimeClassName}')"
    if [ "$SRV_COUNT" = 0 ]; then
      fail "a. the lmcache server sees no GPU (torch.cuda.device_count() == 0): it cannot open vLLM's KV" \
        "its pod's runtimeClassName: '${RUNTIME:-none}' (spec.lmcacheServer.runtimeClassName); kubectl get runtimeclass" \
        "with the NVIDIA runtime, an unprivileged container gets GPUs from NVIDIA_VISIBLE_DEVICES=all only when the" \
        "toolkit's accept-nvidia-visible-devices-envvar-when-unprivileged is true on $NODE: docs/gpu-cluster.md"
    fi
    MISSING="$(python3 -c '
import json, sys
norm = lambda u: u.lower().removeprefix("gpu-")
srv, vl = json.loads(sys.argv[1]), json.loads(sys.argv[2])
theirs = {norm(u) for u in srv["uuids"] + srv["smi"]}
print(" ".join(u for u in (vl["uuids"] or vl["smi"]) if norm(u) not in theirs))' "$SRV_GPUS" "$VLLM_GPUS")"
    [ -z "$MISSING" ] || fail "a. the server does not see vLLM's GPU(s) $MISSING: lmcache finds the KV's device by UUID" \
      "give the server every GPU of the node (NVIDIA_VISIBLE_DEVICES=all, as the operator renders it)"
    [ -n "$RUNTIME" ] || RUNTIME="none: the node's default runtime"
    pass "a. the lmcache server sees $SRV_COUNT GPU(s) (runtime class $RUNTIME), vLLM's GPU among them"
  fi
fi

# ---------------------------------------------------------------- b. vLLM registered its KV

ST="$(wait_registered '[]')" || fail "b. the server lists no registered vLLM within 120 s ($ST)" \
  "the server's log says why: kubectl logs -n $NS $SRV_POD -c lmcache-server | grep -i -E 'regist|error'" \
  "and vLLM's: kubectl logs -n $NS $VLLM_POD | grep -i lmcache"
DETAIL="$(registration_detail "$ST")"
if [ "$HAS_GPU" = 1 ] && [ "$(pyj 'bool(d["gpu"])' <<<"$ST")" != "true" ]; then
  fail "b. vLLM registered on the engine-driven path, not by CUDA IPC: $DETAIL"
fi
if [ "$STANDIN" = 0 ]; then
  LOGLINE="$(bounded 60 "$KUBECTL" -n "$NS" logs "$SRV_POD" -c lmcache-server --tail=2000 2>/dev/null \
    | grep -m1 -E 'Registered (KV cache|non-GPU context)' || true)"
  [ -z "$LOGLINE" ] || info "server log: $LOGLINE"
fi
pass "b. vLLM registered its KV with $SRV_POD: $DETAIL (server /status)"

# ---------------------------------------------------------------- c. a repeated prompt hits

FIRST="$(ask_prompt 2>&1)" || fail "c. the first request to $VLLM_POD failed: $FIRST"
info "first request: $(pyj '"{prompt_tokens} prompt tokens, {external} from LMCache, {own} from the vLLM pod own prefix cache, {seconds} s".format(**d)' <<<"$FIRST")"
SECOND="$(ask_prompt 2>&1)" || fail "c. the second request to $VLLM_POD failed: $SECOND"
HITS="$(pyj 'd["external"] + d["own"]' <<<"$SECOND")"
SAID="$(pyj '"{external} tokens from LMCache and {own} from the vLLM pod own prefix cache, of {prompt_tokens}, {seconds} s".format(**d)' <<<"$SECOND")"
[ "$HITS" -gt 0 ] || fail "c. the repeated prompt hit nothing: $SAID"
pass "c. the repeated prompt hit: $SAID"

if [ "$SKIP_RESTARTS" = 1 ]; then
  skip "d. a vLLM restart hits from the server (--skip-restarts)"
  skip "e. a server restart hits from L2 (--skip-restarts)"
else
# ---------------------------------------------------------------- d. vLLM restarted: from the server

  OLD_VLLM="$VLLM_POD"
  replace_vllm d "(the server keeps the KV)"
  ask_counting d lmcache_mp_lookup_hit_l1_tokens_total
  L1HIT="$COUNTED"
  [ "$EXT" -gt 0 ] || fail "d. the new vLLM pod $VLLM_POD got nothing from the cache: $SAID"
  pass "d. vLLM pod restarted ($OLD_VLLM -> $VLLM_POD): $SAID; the server counted $L1HIT tokens hit in L1"

# ---------------------------------------------------------------- e. server restarted: from L2

  DEADLINE=$((SECONDS + 120))  # L2 writes are asynchronous: let them land before the server goes
  while :; do
    PENDING="$(in_server status | pyj 'd["pending"]')"
    DONE="$(in_server metrics | pyj 'int(d["lmcache_mp_l2_store_completed_objects_chunks_total"])')"
    [ "$PENDING" = 0 ] && break
    [ "$SECONDS" -lt "$DEADLINE" ] || fail "e. L2 writes still pending after 120 s ($PENDING): the KV may not be on L2"
    sleep 2
  done
  info "L2 writes settled: $DONE chunk objects completed since the server started, none pending"
  say "deleting lmcache server pod $SRV_POD (L1 goes with it; L2 stays on its claim or bucket)"
  k delete pod "$SRV_POD" --wait=false >/dev/null
  OLD_SRV_UID="$SRV_UID"
  read -r SRV_POD SRV_UID SRV_IP _ < <(NODE_FILTER="$NODE" ready_pod lmcache-server "$OLD_SRV_UID" || true) || true
  [ -n "${SRV_POD:-}" ] || fail "e. no new Ready lmcache server on $NODE within ${WAIT_S}s"
  ST="$(wait_registered '[]')" || fail "e. vLLM pod $VLLM_POD did not re-register with the new server $SRV_POD within 120 s" \
    "vLLM re-registers on its heartbeat (lmcache.mp.heartbeat_interval, 2 s as the operator renders it)"
  info "vLLM pod $VLLM_POD re-registered with the new server $SRV_POD: $(registration_detail "$ST")"
  replace_vllm e "too (its own GPU prefix cache must not answer)"
  ask_counting e lmcache_mp_lookup_hit_l2_tokens_total
  L2HIT="$COUNTED"
  [ "$EXT" -gt 0 ] || fail "e. after the server restart vLLM got nothing from the cache: $SAID"
  [ "$L2HIT" -gt 0 ] || fail "e. vLLM got $EXT tokens from the cache but the new server counted no L2 hit" \
    "(lmcache_mp_lookup_hit_l2_tokens_total did not move): they did not come from L2"
  pass "e. server restarted, then vLLM: $SAID; the new server counted $L2HIT tokens hit in L2"
fi

# ---------------------------------------------------------------- --ipc-check

if [ "$IPC_CHECK" = 1 ]; then
  if [ "$HAS_GPU" = 0 ]; then
    skip "ipc-check: no GPU on node $NODE"
  else
    CHECK_POD="kvpersist-ipc-check-$$"
    cleanup_ipc() {
      "$KUBECTL" -n "$IPC_NS" --request-timeout=30s delete pod "$CHECK_POD" --ignore-not-found --wait=false >/dev/null 2>&1 || true
      "$KUBECTL" -n "$IPC_NS" --request-timeout=30s delete configmap "$CHECK_POD" --ignore-not-found >/dev/null 2>&1 || true
    }
    trap cleanup_ipc EXIT
    IMAGE="$(k get pod "$SRV_POD" -o jsonpath='{.spec.containers[?(@.name=="lmcache-server")].image}')"
    RUNTIME="$(k get pod "$SRV_POD" -o jsonpath='{.spec.runtimeClassName}')"
    TOLERATIONS="$(k get pod "$SRV_POD" -o json | pyj 'd["spec"].get("tolerations") or []')"
    "$KUBECTL" -n "$IPC_NS" --request-timeout=30s create configmap "$CHECK_POD" \
      --from-file=gpu_ipc_check.py=hack/gpu_ipc_check.py >/dev/null || fail "ipc-check: could not create ConfigMap $IPC_NS/$CHECK_POD"
    # Privileged: the check takes namespaces (unshare, mount) as pods would have them.
    POD_JSON="$(python3 - "$CHECK_POD" "$NODE" "$IMAGE" "$RUNTIME" "$TOLERATIONS" <<'PY'
import json, sys
name, node, image, runtime, tolerations = sys.argv[1:]
# The server pod's node and tolerations; its image (torch, lmcache) and runtime class.
spec = {"nodeName": node, "restartPolicy": "Never", "automountServiceAccountToken": False,
        "tolerations": json.loads(tolerations),
        "containers": [{"name": "check", "image": image, "command": ["python3", "/check/gpu_ipc_check.py"],
                        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                                {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"}],
                        "securityContext": {"privileged": True},
                        "volumeMounts": [{"name": "check", "mountPath": "/check"}]}],
        "volumes": [{"name": "check", "configMap": {"name": name}}]}
if runtime:
    spec["runtimeClassName"] = runtime
print(json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}))
PY
)"
    "$KUBECTL" -n "$IPC_NS" --request-timeout=30s apply -f - >/dev/null <<<"$POD_JSON" \
      || fail "ipc-check: pod $IPC_NS/$CHECK_POD refused (above)" \
      "its namespace must admit privileged pods: pass --ipc-namespace with one labelled pod-security.kubernetes.io/enforce=privileged"
    say "ipc-check: pod $IPC_NS/$CHECK_POD on $NODE runs hack/gpu_ipc_check.py (up to 8 minutes)"
    DEADLINE=$((SECONDS + 600))
    PHASE_NOW=""
    while [ "$SECONDS" -lt "$DEADLINE" ]; do
      PHASE_NOW="$("$KUBECTL" -n "$IPC_NS" --request-timeout=30s get pod "$CHECK_POD" -o jsonpath='{.status.phase}' 2>/dev/null || true)"
      case "$PHASE_NOW" in Succeeded|Failed) break ;; esac
      sleep 5
    done
    OUT="$(bounded 60 "$KUBECTL" -n "$IPC_NS" logs "$CHECK_POD" 2>&1 || true)"
    TABLE="$(sed -n '/^mode /,$p' <<<"$OUT")"
    [ -n "$TABLE" ] || fail "ipc-check: no result (pod phase ${PHASE_NOW:-unknown})" "$(tail -5 <<<"$OUT")"
    while IFS= read -r line; do info "$line"; done <<<"$TABLE"
    ISOLATED_OK="$(awk '$1 == "isolated" && $2 == "pods_no_hostipc" {print $3}' <<<"$TABLE")"
    [ "$ISOLATED_OK" = "True" ] || fail "ipc-check: isolated IPC between two pods without hostIPC does not work on $NODE"
    pass "ipc-check: isolated CUDA IPC works between two pods' namespaces on $NODE (table above)"
  fi
fi

echo "gpu-smoke: $PASSED passed, 0 failed, $SKIPPED skipped"
