#!/usr/bin/env python3
"""Which users the lmcache server pod's processes can run as: the measurement behind
docs/security.md ("Users"), with the real lmcache server and the real agent as rendered.

Each case runs the rendered `lmcache server` (L2 on a folder standing in for the claim as the
kubelet leaves it with the pod's fsGroup: root:2000, mode 2775), stores 8 sequences with lmcache's
own bench client, then runs the rendered agent and asks it to list and delete. Processes drop every
capability and set no_new_privs (setpriv), as the pod's securityContext does.

  server-root-umask002  the rendering: server root with umask 0002, agent uid 65532 in group 2000
  server-root-umask022  control: the same with the default umask (the agent's delete must fail)
  server-nonroot        server and client both uid 1000 (what a non-root server would need)
  server-nonroot-root-client  server uid 1000, client root as in vLLM's image (register must fail)

Needs root and setpriv, and the test venv readable by the other uids (they run its Python): where
it lives under /root (mode 0700), run `chmod o+x /root` for the measurement and undo it after.

    python3 hack/check_users.py [CASE ...]
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO), str(REPO / "hack")]

from tests.integration.conftest import make_target, write_key  # noqa: E402

from kubelet_runner import localize_args  # noqa: E402
from kvpersist.builders.lmcache import agent_container, server_args  # noqa: E402
from kvpersist.builders.security import AGENT_USER, DATA_GROUP  # noqa: E402
from kvpersist.builders.target import AGENT_TOKEN_MOUNT_PATH, L2_KEY_MOUNT_PATH, L2_MOUNT_PATH  # noqa: E402

VENV = Path(sys.executable).parent
TOKEN = "check-users-token"
CASES = {
    "server-root-umask002": {"server": None, "umask": "0002", "client": None},
    "server-root-umask022": {"server": None, "umask": "0022", "client": None},
    "server-nonroot": {"server": 1000, "umask": "0002", "client": 1000},
    "server-nonroot-root-client": {"server": 1000, "umask": "0002", "client": None},
}


def drop(uid: int | None, gid: int = DATA_GROUP) -> list[str]:
    """setpriv as the securityContext would: no capability, no_new_privs, and a user when given."""
    user = [f"--reuid={uid}", f"--regid={gid}", f"--groups={gid}"] if uid is not None else []
    return ["setpriv", *user, "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_pod_volume(path: Path, mode: int) -> None:
    os.chown(path, 0, DATA_GROUP)
    path.chmod(mode)


def run_case(name: str, case: dict, base: Path) -> dict:
    base.mkdir(parents=True)
    base.chmod(0o755)
    vol = base / "l2"
    vol.mkdir()
    as_pod_volume(vol, 0o2775)
    home = base / "home"
    home.mkdir()
    os.chown(home, case["server"] or 0, DATA_GROUP)
    key = write_key(base / "key")
    as_pod_volume(key, 0o750)
    as_pod_volume(key / "master.key", 0o440)
    tok = base / "tok"
    tok.mkdir()
    (tok / "token").write_text(TOKEN)
    as_pod_volume(tok, 0o750)
    as_pod_volume(tok / "token", 0o440)
    target = make_target(l1_gb=0.5, capacity_gb=1, encrypted=True)
    env = {"PATH": f"{VENV}:/usr/bin:/bin", "HOME": str(home), "NUMBA_CACHE_DIR": str(base / "numba"),
           "LMCACHE_DISABLE_BANNER": "1", "PYTHONPATH": f"{REPO / 'operator'}:{REPO}"}
    args = localize_args(server_args(target), {L2_MOUNT_PATH: vol, L2_KEY_MOUNT_PATH: key}, "127.0.0.1")
    argv = [*drop(case["server"]), "sh", "-c", f'umask {case["umask"]} && exec "$0" "$@"', str(VENV / "lmcache"), *args]
    out: dict = {"case": name}
    procs: list[subprocess.Popen] = []
    try:
        server = subprocess.Popen(argv, env=env, stdout=(base / "server.log").open("wb"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        procs.append(server)
        http = f"http://127.0.0.1:{target.spec.lmcache_server.http_port}"
        out["server_healthy"] = wait_healthy(http, server)
        if not out["server_healthy"]:
            out["server_log"] = (base / "server.log").read_text()[-800:]
            return out
        rpc = f"tcp://127.0.0.1:{target.spec.lmcache_server.port}"
        store = subprocess.run([*drop(case["client"]), sys.executable, "-m", "tests.integration.kvdriver", "store", "--rpc-url",
                                rpc, "--http-url", http, "--seqs", "0:8"], capture_output=True, text=True, timeout=300,
                               env=env, cwd=REPO)
        if store.returncode != 0:
            out["store"] = "failed: " + next((line for line in store.stderr.splitlines()[::-1] if "Error" in line), "?")
            return out
        out["store"] = json.loads(store.stdout)["summary"]
        folder = vol / str(target.namespace_id)
        out["written"] = sorted({f"{oct(p.stat().st_mode & 0o7777)} {p.stat().st_uid}:{p.stat().st_gid}"
                                 for p in [folder, *folder.iterdir()]})
        agent_port = free_port()
        spec = agent_container(target, "img")
        agent_args = localize_args(spec["args"], {L2_MOUNT_PATH: vol, AGENT_TOKEN_MOUNT_PATH: tok}, "127.0.0.1")
        agent_args[agent_args.index("--port") + 1] = str(agent_port)
        agent_args[agent_args.index("--server-url") + 1] = http
        agent_args[agent_args.index("--serving") + 1] = "kvp-" + "0" * 32  # another id: the stored one may go
        uid = spec["securityContext"]["runAsUser"]
        agent = subprocess.Popen([*drop(uid, spec["securityContext"]["runAsGroup"]), sys.executable, "-m", "kvpersist.cli",
                                  *agent_args], env=env, stdout=(base / "agent.log").open("wb"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
        procs.append(agent)
        out["agent_user"] = f"{uid}:{spec['securityContext']['runAsGroup']}"
        out["gc"] = ask_gc(agent_port, str(target.namespace_id), agent)
        out["gone"] = not folder.exists()
        return out
    finally:
        for proc in procs[::-1]:
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
                    proc.wait(10)


def wait_healthy(http: str, proc: subprocess.Popen, timeout: float = 180.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(http + "/healthcheck", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            time.sleep(0.5)
    return False


def ask_gc(port: int, namespace_id: str, agent: subprocess.Popen, timeout: float = 30.0) -> str:
    body = json.dumps({"namespaceId": namespace_id, "dryRun": False}).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and agent.poll() is None:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/gc", data=body, method="POST",
                                         headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return f"{resp.status}: deleted {json.loads(resp.read())['objects']} objects"
        except urllib.error.HTTPError as exc:
            return f"{exc.code}: {exc.read()[:200].decode(errors='replace')}"
        except OSError:
            time.sleep(0.5)  # not listening yet
    return "the agent did not answer"


def main() -> int:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        print("needs root and setpriv (util-linux)", file=sys.stderr)
        return 2
    probe = subprocess.run([*drop(AGENT_USER), sys.executable, "-c", "import kvpersist"], capture_output=True,
                           env={"PYTHONPATH": str(REPO / "operator")})
    if probe.returncode != 0:
        print(f"uid {AGENT_USER} cannot run {sys.executable} with {REPO}: make them traversable for the measurement "
              "(e.g. `chmod o+x /root`, undone after)", file=sys.stderr)
        return 2
    names = sys.argv[1:] or list(CASES)
    with tempfile.TemporaryDirectory(prefix="check-users-") as tmp:
        Path(tmp).chmod(0o755)
        for name in names:
            print(json.dumps(run_case(name, CASES[name], Path(tmp) / name)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
