"""The real `lmcache server` through the command the operator renders (kvpersist.builders.buildcheck): the
build check runs first in the same `sh -c` wrapper as the umask, then `exec "$0" "$@"` starts the
server with its args unchanged when the installed lmcache is the declared one (0.5.6 here); when
connectorBuild declares another it refuses, with exit code 78 and a termination message, and no
server starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvpersist.builders.buildcheck import EXIT_CODE, MISMATCH_PREFIX, PREFIX, TERMINATION_LOG_ENV
from kvpersist.builders.lmcache import server_container
from kvpersist.builders.target import L2_KEY_MOUNT_PATH, L2_MOUNT_PATH, Target
from tests.integration.conftest import LMCACHE, START_TIMEOUT_S, localize_args, make_target, write_key

pytestmark = pytest.mark.datapath


def run_rendered(target: Target, work: Path) -> tuple[subprocess.Popen, Path, Path]:
    """The server container's command, env and args as a kubelet would run them here: `$0` is the
    python3 beside this machine's lmcache (the image's), running the in-server launcher from the
    rendered env; mounts are temp folders."""
    assert LMCACHE, "lmcache not on PATH: run through hack/test.sh (installs the datapath extra)"
    container = server_container(target)
    mounts = {L2_MOUNT_PATH: work / "l2", L2_KEY_MOUNT_PATH: write_key(work / "key")}
    command = container["command"]
    assert command[:2] == ["sh", "-c"] and command[3] == "python3"
    argv = [*command[:3], str(Path(LMCACHE).parent / "python3"), *localize_args(container["args"], mounts, "127.0.0.1")]
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e},
           "PATH": f"{Path(LMCACHE).parent}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
           "NUMBA_CACHE_DIR": str(work / "numba"), TERMINATION_LOG_ENV: str(work / "termination-log")}
    log = work / "server.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log, work / "termination-log"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_the_declared_lmcache_starts_through_the_wrapper(tmp_path: Path) -> None:
    target = make_target(connectorBuild="vllm-0.33.0+lmcache-0.5.6")
    proc, log, termination = run_rendered(target, tmp_path)
    url = f"http://127.0.0.1:{target.spec.lmcache_server.http_port}/healthcheck"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        healthy = False
        while time.monotonic() < deadline and not healthy:
            assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    healthy = r.status == 200
            except OSError:
                time.sleep(0.25)
        assert healthy, log.read_text()[-3000:]
    finally:
        stop(proc)
    text = log.read_text()
    assert f'{PREFIX} {{"expected": {{"lmcache": "0.5.6"}}, "mismatch": []' in text, text[:2000]
    assert not termination.exists()


def test_another_declared_lmcache_refuses_to_start(tmp_path: Path) -> None:
    target = make_target(connectorBuild="vllm-0.33.0+lmcache-0.5.5")
    proc, log, termination = run_rendered(target, tmp_path)
    try:
        assert proc.wait(timeout=60) == EXIT_CODE, log.read_text()[-3000:]
    finally:
        stop(proc)
    message = termination.read_text()
    assert message.startswith(MISMATCH_PREFIX) and "lmcache 0.5.6 is installed" in message, message
    assert "declares lmcache 0.5.5" in message
    # lmcache never ran: the check's two lines are all the container said.
    assert [line.split(" ", 1)[0] for line in log.read_text().splitlines() if line.strip()] == [PREFIX, PREFIX]
