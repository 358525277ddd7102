#!/usr/bin/env bash
# Regenerates the images' hashed locks (needs the package index):
#   operator/requirements.lock        [project].dependencies and everything they pull in, every file's sha256
#   operator/build-requirements.lock  the build backend (setuptools), for `pip install --no-build-isolation .`
#   images/vllm-lmcache/requirements.lock
#                                     lmcache and nixl at that Dockerfile's versions, and every package they pull
#                                     in that vllm==VLLM_VERSION (the base image's own closure) does not
# The Dockerfiles install them with --require-hashes; tests/unit/test_supply_chain.py checks that the locks
# still satisfy pyproject.toml and the Dockerfile's versions. Run after changing a dependency or a version,
# and commit the files. `bash hack/lock.sh operator`, `bash hack/lock.sh vllm-lmcache` or `bash hack/lock.sh gpu-wheels` does one.
#   benchmarks/gpu-wheels.lock        benchmarks/gpu-wheels.in's versions: the wheels gpu_run.py --wheels installs on a GPU machine
# The vllm-lmcache lock is resolved by Python 3.12 (the vllm/vllm-openai image's): python3.12 must run.
set -euo pipefail
cd "$(dirname "$0")/.."
which="${1:-all}"
tools="$(mktemp -d)"
trap 'rm -rf "$tools"' EXIT
# Hashes from the package index only, never from a local wheel folder the machine may point pip at.
export PIP_FIND_LINKS="" CUSTOM_COMPILE_COMMAND="bash hack/lock.sh"
options=(-q --generate-hashes --strip-extras --no-emit-index-url --no-emit-find-links)

if [ "$which" = all ] || [ "$which" = operator ]; then
  python3.11 -m venv "$tools/venv"
  "$tools/venv/bin/pip" install -q "pip-tools==7.6.2"
  compile=("$tools/venv/bin/pip-compile" "${options[@]}")
  "${compile[@]}" --output-file operator/requirements.lock pyproject.toml
  python3 -c 'import re, tomllib; print(re.search(r"setuptools\S*", " ".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"])).group(0))' \
    > "$tools/build.in"
  "${compile[@]}" --allow-unsafe --output-file operator/build-requirements.lock "$tools/build.in"
  sed -i "s|$tools/build.in|pyproject.toml's [build-system].requires|" operator/build-requirements.lock
fi

if [ "$which" = all ] || [ "$which" = vllm-lmcache ]; then
  # The image installs this lock with --no-deps on top of vllm/vllm-openai (images/vllm-lmcache/Dockerfile
  # says why). pip's own resolver (a dry run: nothing is installed) picks lmcache, nixl
  # and their dependencies together with vllm==VLLM_VERSION, so the versions chosen fit vLLM's; then
  # every package of vllm's own closure (a second dry run of vllm alone) is left out: the base has it.
  # Each kept version gets the sha256 of every file the index's simple API (PEP 691 JSON, what pip
  # reads) lists for it, and the file the resolver chose must be among them with the same hash.
  image=images/vllm-lmcache
  read -r vllm lmcache nixl < <(sed -n -E 's/^ARG (VLLM|LMCACHE|NIXL)_VERSION=(\S+)$/\1 \2/p' "$image/Dockerfile" \
    | awk '{v[$1]=$2} END {print v["VLLM"], v["LMCACHE"], v["NIXL"]}')
  [ -n "$nixl" ] || { echo "lock.sh: $image/Dockerfile lacks an ARG VLLM_VERSION, LMCACHE_VERSION or NIXL_VERSION default" >&2; exit 1; }
  python3.12 -m venv "$tools/venv312"
  resolve=("$tools/venv312/bin/pip" install -q --dry-run --ignore-installed --only-binary=:all:)
  "${resolve[@]}" --report "$tools/base.json" "vllm==$vllm"
  "${resolve[@]}" --report "$tools/image.json" "vllm==$vllm" "lmcache==$lmcache" "nixl==$nixl"
  "$tools/venv312/bin/python" - "$tools/base.json" "$tools/image.json" "$image/requirements.lock" "$vllm" <<'PY'
import json, re, sys, urllib.request
from pip._vendor.packaging.utils import InvalidSdistFilename, InvalidWheelFilename, parse_sdist_filename, parse_wheel_filename
from pip._vendor.packaging.version import Version

base_path, image_path, out_path, vllm = sys.argv[1:]

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

base = {norm(i["metadata"]["name"]) for i in json.load(open(base_path))["install"]}
report = json.load(open(image_path))
chosen = {norm(i["metadata"]["name"]): i for i in report["install"]}
kept = sorted(name for name in chosen if name not in base)
# Who pulls each kept package in (a requirement's name, markers not evaluated): the lock's `# via`.
via = {name: sorted(other for other, i in chosen.items()
                    for req in i["metadata"].get("requires_dist", [])
                    if norm(re.match(r"[A-Za-z0-9_.\-]+", req).group(0)) == name
                    and "extra ==" not in req and other != name) for name in kept}
def file_version(filename):
    """The version a wheel's or sdist's file name carries; None for another kind of file."""
    try:
        return parse_wheel_filename(filename)[1] if filename.endswith(".whl") else parse_sdist_filename(filename)[1]
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None

lines = []
for name in kept:
    meta = chosen[name]["metadata"]
    version = meta["version"]
    request = urllib.request.Request(f"https://pypi.org/simple/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        files = json.load(answer)["files"]
    hashes = sorted({f["hashes"]["sha256"] for f in files if file_version(f["filename"]) == Version(version)})
    picked = chosen[name]["download_info"]["archive_info"]["hashes"]["sha256"]
    if picked not in hashes:
        sys.exit(f"lock.sh: {name}=={version}: the resolver's file (sha256 {picked}) is not among the index's files")
    lines.append(f"{name}=={version} \\\n" + " \\\n".join(f"    --hash=sha256:{h}" for h in hashes))
    who = (["the Dockerfile's version"] if name in ("lmcache", "nixl") else []) + via[name]
    lines.append("    # via " + ", ".join(who))
header = f"""#
# The packages images/vllm-lmcache/Dockerfile adds to vllm/vllm-openai:v{vllm}, installed with
# pip --require-hashes --no-deps: lmcache and nixl, resolved together with vllm=={vllm} (Python
# {report["environment"]["python_version"]}, {report["environment"]["sys_platform"]} {report["environment"]["platform_machine"]}), and every package they pull in that vllm=={vllm} does not
# (vllm's own closure is the base image's). Each version with the sha256 of every file the index lists.
# Generated by:
#
#    bash hack/lock.sh vllm-lmcache
#
"""
open(out_path, "w").write(header + "\n".join(lines) + "\n")
print(f"lock.sh: {out_path}: {len(kept)} packages", file=sys.stderr)
PY
fi

if [ "$which" = all ] || [ "$which" = gpu-wheels ]; then
  # benchmarks/gpu-wheels.in's versions, each with the sha256 of every file the index lists for it.
  python3 - benchmarks/gpu-wheels.in benchmarks/gpu-wheels.lock <<'PY'
import json, re, sys, urllib.request
src, out = sys.argv[1:]
lines = ["# benchmarks/gpu-wheels.in with every file's sha256 (pip --require-hashes). Generated by:", "#", "#    bash hack/lock.sh gpu-wheels", "#"]
for req in (l.split("#", 1)[0].strip() for l in open(src)):
    if not req:
        continue
    name, version = req.split("==")
    request = urllib.request.Request(f"https://pypi.org/simple/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        files = json.load(answer)["files"]
    stem = re.sub(r"[-_.]+", "_", name).lower() + "-" + version + "-"
    hashes = sorted({f["hashes"]["sha256"] for f in files
                     if f["filename"].endswith(".whl") and re.sub(r"[-_.]+", "_", f["filename"].split("-")[0]).lower() + "-"
                     + f["filename"].split("-")[1] + "-" == stem})
    if not hashes:
        sys.exit(f"lock.sh: {req}: no wheel on the index")
    lines.append(f"{name}=={version} \\\n" + " \\\n".join(f"    --hash=sha256:{h}" for h in hashes))
open(out, "w").write("\n".join(lines) + "\n")
print(f"lock.sh: {out}: {len(lines) - 4} packages", file=sys.stderr)
PY
fi
