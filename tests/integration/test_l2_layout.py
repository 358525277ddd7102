"""What the inventory agent's trim may count, with the real lmcache server (0.5.6, CPU) and the
agent run from the args the operator renders (tests/integration/test_capacity.py's AgentProcess).

- Switching spec.l2.nvme.adapter (fs -> nixl_store_dynamic): the fs adapter's `*.data` files stayed
  in the folder the nixl server then wrote to, and the agent, trimming for nixl, counted them
  against the capacity while it may delete only `*.bin`: it deleted every live nixl chunk. The
  layout is now a pin (api.spec.l2_layout): the switch is a new namespace and folder, and the
  fs folder stays as it was (an orphan: switching back serves it again).
- A temp file of a write that died (`<final>.bin.tmp.<uuid hex>`, as lmcache's nixl agent names it)
  counted the same way; now an abandoned one is deleted, and a live one is not counted.
"""

from __future__ import annotations

import copy
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.target import Target
from kvpersist.identity import resolve
from kvpersist.inventory.volume import ABANDONED_TEMP_S
from tests.cases.invalid_manifests import sample
from tests.integration.conftest import LocalServer, drive, free_port
from tests.integration.test_capacity import TRIM_PERIOD_S, AgentProcess, settle

pytestmark = pytest.mark.datapath

MIB = 2**20
CAPACITY = 8 * MIB  # the nixl namespace's: 16 chunks of 512 KiB


def target(adapter: str, ports: tuple[int, int]) -> Target:
    """The sample with one adapter, L2 plain (the layout is what is under test, not the key)."""
    obj = copy.deepcopy(sample())
    obj["spec"]["l2"]["encryption"] = {"enabled": False}
    obj["spec"]["l1"]["size"] = "256Mi"
    obj["spec"]["l2"]["nvme"].update(size="10Gi", maxCapacity=str(CAPACITY), adapter=adapter)
    obj["spec"].setdefault("lmcacheServer", {})["port"] = ports[0]
    # The KV the driver sends (kvdriver.SHAPE: 2 KV heads of 64, float16): 512 KiB chunks, and the
    # L1 page (and so nixl's file size) the operator derives from these pins fits them.
    obj["spec"]["identity"].update(numKVHeads=2, headSize=64, kvCacheDtype="float16")
    spec = KVCacheNamespace.model_validate(obj).spec
    return Target(obj["metadata"]["name"], "test", spec, resolve(spec.pins()).namespace_id)


def files(folder: Path, suffix: str) -> set[str]:
    return {p.name for p in folder.rglob(f"*{suffix}")} if folder.is_dir() else set()


def wait_passes(agent: AgentProcess, passes: int = 3) -> None:
    """Lets the agent run a few trim passes (it trims every TRIM_PERIOD_S)."""
    time.sleep(passes * TRIM_PERIOD_S + 0.5)


def test_switching_the_adapter_never_lets_the_trim_delete_the_new_adapters_chunks(
        servers: Callable[..., LocalServer], agents: Callable[[LocalServer], AgentProcess]) -> None:
    ports = (free_port(), free_port())
    fs = servers(target("fs", ports))
    fs.start()
    assert drive(fs, "store", "0:12")["summary"]["stored_chunks"] == 24  # 12 MiB: fs declares no capacity
    settle(fs.l2_dir)
    fs_files = files(fs.l2_dir, ".data")
    assert len(fs_files) == 24
    fs.stop()

    nixl = servers(target("nixl_store_dynamic", ports), volume=fs.volume)  # the same claim, adapter switched
    assert nixl.target.namespace_id != fs.target.namespace_id and nixl.l2_dir != fs.l2_dir
    agent = agents(nixl)
    assert agent.capacity == CAPACITY
    nixl.start()
    assert drive(nixl, "store", "100:104")["summary"]["stored_chunks"] == 8  # 4 MiB, within the capacity
    settle(nixl.l2_dir)
    wait_passes(agent)
    assert len(files(nixl.l2_dir, ".bin")) == 8, agent.log.read_text()[-3000:]
    # Read from the files alone (restarted: L1 empty): the new adapter's KV is all there and right.
    nixl.stop(signal.SIGKILL)
    nixl.start()
    got = drive(nixl, "verify", "100:104")["summary"]
    assert got["hit_chunks"] == got["verified_chunks"] == 8 and got["wrong_bytes"] == 0, got
    assert files(fs.l2_dir, ".data") == fs_files  # the old adapter's folder untouched: an orphan, not lost
    nixl.stop()

    # Switching back is the old namespace again: its KV serves.
    back = servers(target("fs", ports), volume=fs.volume)
    assert back.l2_dir == fs.l2_dir
    back.start()
    again = drive(back, "verify", "0:12")["summary"]
    assert again["hit_chunks"] == again["verified_chunks"] == 24 and again["wrong_bytes"] == 0, again


def test_a_crashed_writes_temp_file_is_swept_and_never_costs_live_chunks(
        servers: Callable[..., LocalServer], agents: Callable[[LocalServer], AgentProcess]) -> None:
    srv = servers(target("nixl_store_dynamic", (free_port(), free_port())))
    srv.start()
    assert drive(srv, "store", "0:6")["summary"]["stored_chunks"] == 12  # 6 MiB of the 8
    settle(srv.l2_dir)
    chunks = sorted(files(srv.l2_dir, ".bin"))
    assert len(chunks) == 12
    # What a server killed mid-write leaves (file_dynamic_nixl_store_agent.dynamic_store): the
    # chunk's final name + .tmp.<uuid4 hex>, never renamed. 6 MiB of it, untouched for over an hour.
    dead = srv.l2_dir / f"{chunks[0][:-4]}-dead.bin.tmp.{os.urandom(16).hex()}"
    dead.write_bytes(b"\0" * (6 * MIB))
    aged = time.time() - ABANDONED_TEMP_S - 60
    os.utime(dead, (aged, aged))
    live = srv.l2_dir / f"{chunks[1][:-4]}-live.bin.tmp.{os.urandom(16).hex()}"  # a write in flight
    live.write_bytes(b"\0" * (4 * MIB))
    agent = agents(srv)
    wait_passes(agent)
    assert not dead.exists(), agent.log.read_text()[-3000:]
    assert live.exists()  # not the agent's to delete, and not counted: 6 MiB of chunks + 4 in flight, none trimmed
    assert sorted(files(srv.l2_dir, ".bin")) == chunks
    srv.stop(signal.SIGKILL)
    srv.start()
    got = drive(srv, "verify", "0:6")["summary"]
    assert got["hit_chunks"] == got["verified_chunks"] == 12 and got["wrong_bytes"] == 0, got
