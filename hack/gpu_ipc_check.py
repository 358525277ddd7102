"""Which pod isolation LMCache's CUDA IPC survives, measured on one GPU node with lmcache's own code.

In lmcache's default lmcache_driven transfer mode the vLLM worker (the exporter) registers its KV
tensors with the lmcache server (the importer), which opens them through CUDA IPC and signals
through CUDA IPC events. lmcache 0.5.6 has two ways to do that:
- default: CudaIPCWrapper (torch's UntypedStorage._share_cuda_, whose reference counter lives in
  a /dev/shm file) with DefaultEventIPCBackend (CUDA interprocess event handles);
- --isolated-ipc: RawCudaIPCWrapper (cudaIpcGetMemHandle/cudaIpcOpenMemHandle only) with
  TimelineSemaphoreEventIPCBackend (events built on IPC memory).
Kubernetes pods differ in exactly what this script takes away from the importer: its own /dev/shm
(a memory emptyDir, or no hostIPC), its own IPC namespace (no hostIPC), its own PID namespace
(always, across pods), no visible GPU (a server pod without the NVIDIA runtime). Each case runs
two fresh processes: the exporter fills a KV-shaped tensor, records an event and sends lmcache's
serialized wrapper and event; the importer opens both, waits on the event, checks every byte,
writes the tensor (a retrieve), records its own event; the exporter waits on that and checks the
write. One JSON line per case, then a summary. Run as root (namespaces need it) on a GPU node:

    python3 hack/gpu_ipc_check.py [--out results.json]

lmcache must be importable (the lmcache server image has it; a pure-Python copy of the package
with msgspec is enough: nothing here calls lmcache's compiled kernels).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import subprocess
import sys
import time

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID = 0x00020000, 0x08000000, 0x20000000
MS_REC, MS_PRIVATE = 0x4000, 0x40000
CASE_TIMEOUT_S = 45
TOTAL_BUDGET_S = 420
SHAPE = (2, 64, 16, 8, 128)  # (K/V, blocks, block size, KV heads, head size), bf16: 4 MiB

# name -> (importer's namespaces, exporter's namespaces, importer sees no GPU)
CASES: dict[str, tuple[set[str], set[str], bool]] = {
    "shared": (set(), set(), False),
    "own_shm": ({"shm"}, set(), False),
    "own_ipc": ({"ipc"}, set(), False),
    "own_pid": ({"pid"}, set(), False),
    "pods_no_hostipc": ({"shm", "ipc", "pid"}, {"shm", "ipc", "pid"}, False),
    "pods_hostipc_own_shm": ({"pid"}, {"shm", "pid"}, False),
    "both_pid_1": ({"pid1"}, {"pid1"}, False),
    "server_no_gpu": (set(), set(), True),
}


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _enter(namespaces: set[str], role: str) -> None:
    """Take the namespaces a pod would not share, before CUDA or torch is touched."""
    new_pid = bool(namespaces & {"pid", "pid1"})
    flags = (CLONE_NEWNS if "shm" in namespaces or new_pid else 0) | (CLONE_NEWIPC if "ipc" in namespaces else 0)
    if new_pid:
        flags |= CLONE_NEWPID
    libc = _libc()
    if flags and libc.unshare(flags) != 0:  # os.unshare is Python 3.12+ only
        raise OSError(ctypes.get_errno(), f"unshare({flags:#x})")
    if flags & CLONE_NEWNS and libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    if "shm" in namespaces and libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, b"size=256m") != 0:
        raise OSError(ctypes.get_errno(), "mount tmpfs /dev/shm")
    if flags & CLONE_NEWPID:
        # Only children enter a new PID namespace, and the first one is its PID 1, as a pod's main
        # process is. "pid1" runs the worker as that PID 1; "pid" runs it as a later child whose
        # PID differs between the roles (the exporter's and the importer's PIDs must not be equal).
        _fork_and_wait()
        # A container's /proc shows its own PID namespace (the CUDA driver reads it).
        if libc.mount(b"proc", b"/proc", b"proc", 0, None) != 0:
            raise OSError(ctypes.get_errno(), "mount proc /proc")
        if "pid" in namespaces:
            for _ in range(3 if role == "exporter" else 5):
                child = os.fork()
                if child == 0:
                    os._exit(0)
                os.waitpid(child, 0)
            _fork_and_wait()


def _fork_and_wait() -> None:
    """Fork; the parent waits for the child and exits with its status, the child returns."""
    pid = os.fork()
    if pid:
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status))


def _send(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _recv() -> dict:
    line = sys.stdin.readline()
    if not line:
        raise EOFError("peer gone")
    return json.loads(line)


def _lmcache(isolated: bool):
    _contiguity_without_kernels()
    from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper
    from lmcache.v1.platform.devices.cuda import _select_event_ipc_backend, _select_ipc_wrapper_cls
    from lmcache.v1.platform.ipc_policy import set_isolated_ipc

    set_isolated_ipc(isolated)
    return DeviceIPCWrapper, _select_ipc_wrapper_cls(), _select_event_ipc_backend("cuda")


def _contiguity_without_kernels() -> None:
    """The wrappers import lmcache.v1.gpu_connector.kv_format.contiguity, whose package __init__s
    need lmcache's compiled ops. Without them (a pure-Python copy of lmcache), load those two
    packages as bare namespaces so the same contiguity module (pure torch) is what runs."""
    try:
        import lmcache.v1.gpu_connector.kv_format.contiguity
        return
    except ImportError:
        pass
    import types

    import lmcache

    root = os.path.dirname(lmcache.__file__)
    for name in ("lmcache.v1.gpu_connector", "lmcache.v1.gpu_connector.kv_format"):
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(root, *name.split(".")[1:])]
        sys.modules[name] = module


def exporter(isolated: bool) -> None:
    """The vLLM worker's side: a KV tensor from torch's caching allocator, as vLLM allocates it."""
    import torch

    wrapper_base, wrapper_cls, events = _lmcache(isolated)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    kv = (torch.arange(torch.Size(SHAPE).numel(), device=dev) % 251).to(torch.bfloat16).reshape(SHAPE)
    stream = torch.cuda.current_stream(dev)
    ev = events.create_event(dev)
    events.record_event(ev, stream)
    blob = wrapper_base.Serialize(wrapper_cls.wrap(kv))
    _send({"pid": os.getpid(), "wrapper": wrapper_cls.__name__, "events": type(events).__name__,
           "kv": blob.hex(), "event": events.export_event(ev, dev).hex()})
    reply = _recv()
    if not reply.get("ok"):
        _send({"done": True, "write_seen": None})
        return
    theirs = events.import_event(bytes.fromhex(reply["event"]), dev)
    events.wait_event(theirs, stream)
    torch.cuda.synchronize(dev)
    expected = ((torch.arange(kv.numel(), device=dev) % 251) + 1).to(torch.bfloat16).reshape(SHAPE)
    _send({"done": True, "write_seen": bool(torch.equal(kv, expected))})
    _recv()  # the importer has closed its mapping; only now may the exporter free the memory


def importer(isolated: bool) -> None:
    """The lmcache server's side: open the registered KV, read it, write a retrieve into it."""
    import torch

    info: dict = {"pid": os.getpid(), "cuda_devices": None}
    peer = _recv()
    try:
        wrapper_base, _, events = _lmcache(isolated)
        info["cuda_devices"] = torch.cuda.device_count()
        wrapper = wrapper_base.Deserialize(bytes.fromhex(peer["kv"]))
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        stream = torch.cuda.current_stream(dev)
        theirs = events.import_event(bytes.fromhex(peer["event"]), dev)
        events.wait_event(theirs, stream)
        t = wrapper.to_tensor()
        expected = (torch.arange(t.numel(), device=t.device) % 251).to(torch.bfloat16).reshape(SHAPE)
        info["read_ok"] = bool(torch.equal(t, expected))
        t.add_(1)
        mine = events.create_event(dev)
        events.record_event(mine, stream)
        _send({"ok": True, "event": events.export_event(mine, dev).hex()})
    except Exception as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"[:600]
        _send({"ok": False})
        print(json.dumps(info), file=sys.stderr, flush=True)
        return
    _recv()  # the exporter checked the write
    try:
        del t
        wrapper.close()
        torch.cuda.synchronize(dev)
        info["closed"] = True
    except Exception as exc:
        info["close_error"] = f"{type(exc).__name__}: {exc}"[:600]
    _send({"closed": True})
    print(json.dumps(info), file=sys.stderr, flush=True)


def _worker(role: str, namespaces: str, isolated: bool, no_gpu: bool) -> None:
    _enter(set(filter(None, namespaces.split(","))), role)
    if no_gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    (exporter if role == "exporter" else importer)(isolated)


class _Proc:
    """A worker with bounded line reads."""

    def __init__(self, role: str, namespaces: set[str], isolated: bool, no_gpu: bool) -> None:
        args = [sys.executable, os.path.abspath(__file__), "--role", role, "--ns", ",".join(sorted(namespaces))]
        args += ["--isolated"] if isolated else []
        args += ["--no-gpu"] if no_gpu else []
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)

    def read(self, deadline: float) -> dict:
        assert self.p.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer in time")
            ready, _, _ = select.select([self.p.stdout], [], [], left)
            if ready:
                line = self.p.stdout.readline()
                if not line:
                    raise EOFError(f"exited {self.p.poll()}")
                if line.startswith("{"):
                    return json.loads(line)

    def write(self, obj: dict) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def finish(self, deadline: float) -> str:
        try:
            _, err = self.p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, 9)
            _, err = self.p.communicate(timeout=10)
        return err


def run_case(name: str, isolated: bool) -> dict:
    imp_ns, exp_ns, no_gpu = CASES[name]
    result: dict = {"case": name, "isolated_ipc": isolated, "importer_ns": sorted(imp_ns), "exporter_ns": sorted(exp_ns),
                    "importer_sees_gpu": not no_gpu}
    deadline = time.monotonic() + CASE_TIMEOUT_S
    exp = _Proc("exporter", exp_ns, isolated, False)
    imp = _Proc("importer", imp_ns, isolated, no_gpu)
    try:
        offer = exp.read(deadline)
        result.update(wrapper=offer["wrapper"], events=offer["events"], exporter_pid=offer["pid"])
        imp.write(offer)
        answer = imp.read(deadline)
        exp.write(answer)
        done = exp.read(deadline)
        result["write_seen_by_exporter"] = done["write_seen"]
        if answer.get("ok"):
            imp.write({"checked": True})
            imp.read(deadline)
            exp.write({"closed": True})
    except Exception as exc:
        result["harness_error"] = f"{type(exc).__name__}: {exc}"
    for proc, who in ((exp, "exporter"), (imp, "importer")):
        err = proc.finish(deadline)
        result[f"{who}_exit"] = proc.p.returncode
        lines = [ln for ln in err.splitlines() if ln.startswith("{")]
        if who == "importer" and lines:
            result["importer"] = json.loads(lines[-1])
        tail = [ln for ln in err.splitlines() if ("Error" in ln or "error" in ln) and not ln.startswith("{")]
        if tail:
            result[f"{who}_stderr"] = tail[-3:]
    imp_info = result.get("importer", {})
    result["works"] = bool(imp_info.get("read_ok") and result.get("write_seen_by_exporter") and imp_info.get("closed")
                           and result["exporter_exit"] == 0 and result["importer_exit"] == 0)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["exporter", "importer"])
    ap.add_argument("--ns", default="")
    ap.add_argument("--isolated", action="store_true")
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    if a.role:
        _worker(a.role, a.ns, a.isolated, a.no_gpu)
        return 0
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}
    try:
        import lmcache

        env["lmcache"] = lmcache.__version__
    except Exception as exc:
        env["lmcache"] = f"not importable: {exc}"
    print(json.dumps({"env": env}), flush=True)
    results = []
    stop_at = time.monotonic() + TOTAL_BUDGET_S
    for isolated in (False, True):
        for name in a.cases.split(","):
            if time.monotonic() + CASE_TIMEOUT_S > stop_at:
                print(json.dumps({"case": name, "isolated_ipc": isolated, "skipped": "out of time"}), flush=True)
                continue
            r = run_case(name, isolated)
            results.append(r)
            print(json.dumps(r), flush=True)
    print("\nmode       case                  works  detail")
    for r in results:
        imp = r.get("importer", {})
        detail = (imp.get("error") or imp.get("close_error") or (r.get("exporter_stderr") or [""])[-1]
                  or r.get("harness_error") or "")
        print(f"{'isolated' if r['isolated_ipc'] else 'default':10} {r['case']:21} {r['works']!s:6} {detail[:110]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
