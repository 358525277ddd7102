"""lmcache's HFBucketL2Adapter itself, in this process: misses, a batch the Hub half refuses, and
a size the Hub gets wrong.

Real: lmcache 0.5.6's adapter and HFBucketClient, huggingface_hub's calls and error parsing, and
hf_xet into xet-core's local CAS. The stand-in: the Hub's bucket routes (tests/integration/hub_stub.py
with `cas_dir`), made here to refuse chosen uploads (`refuse_paths`, as the Hub lists failed
operations of a batch) or to answer every size one byte off (`size_delta`). These show what
lmcache does with such answers, not that the Hub gives them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.hub_stub import GOOD_TOKEN, HubStub

pytestmark = pytest.mark.datapath
BID = "acme-ml/kv-cache"
PREFIX = "prod/kvp-" + "e" * 32
CHUNK = 64 * 1024


@pytest.fixture()
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubStub]:
    from huggingface_hub import constants

    with HubStub(existing={BID}, cas_dir=tmp_path / "cas") as stub:
        monkeypatch.setattr(constants, "ENDPOINT", stub.url)  # what HF_ENDPOINT sets in the server
        monkeypatch.setenv("KVP_TEST_HF_TOKEN", GOOD_TOKEN)
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        yield stub


@pytest.fixture()
def adapter(hub: HubStub, tmp_path: Path) -> Iterator[Any]:
    from lmcache.v1.distributed.l2_adapters.hfbucket_l2_adapter import HFBucketL2Adapter, HFBucketL2AdapterConfig

    cfg = HFBucketL2AdapterConfig.from_dict({
        "type": "hfbucket", "bucket_handle": f"hf://buckets/{BID}/{PREFIX}", "token_env": "KVP_TEST_HF_TOKEN",
        "download_tmp_dir": str(tmp_path / "downloads"), "num_workers": 2, "max_capacity_gb": 1,
        "metadata_cache_ttl_secs": 0})  # no cached sizes: every lookup asks the Hub
    made = HFBucketL2Adapter(cfg)
    yield made
    made.close()


def _keys(n: int, start: int = 0) -> list[Any]:
    from lmcache.v1.distributed.api import ObjectKey

    return [ObjectKey(chunk_hash=bytes([i]) * 32, model_name="Qwen/Qwen2.5-7B-Instruct", kv_rank=0)
            for i in range(start, start + n)]


def _objects(blobs: list[bytes | bytearray]) -> list[Any]:
    from lmcache.v1.memory_management import BytesBufferMemoryObj

    return [BytesBufferMemoryObj(bytearray(b)) for b in blobs]


def _wait(poll: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = poll()
        if got is not None:
            return got
        time.sleep(0.05)
    raise AssertionError(f"the adapter's {what} did not finish in {timeout}s")


def _store(adapter: Any, keys: list[Any], blobs: list[bytes]) -> int:
    task = adapter.submit_store_task(keys, _objects(blobs))
    done: dict[int, Any] = {}

    def poll() -> Any:
        done.update(adapter.pop_completed_store_tasks())
        return done.get(task)

    return int(_wait(poll, "store"))


def _lookup(adapter: Any, keys: list[Any]) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(keys, {})
    bitmap = _wait(lambda: adapter.query_lookup_and_lock_result(task), "lookup")
    adapter.submit_unlock(keys)
    return [bool(bitmap.test(i)) for i in range(len(keys))]


def _load(adapter: Any, keys: list[Any]) -> tuple[list[bool], list[bytes]]:
    objs = _objects([bytes(CHUNK)] * len(keys))
    task = adapter.submit_load_task(keys, objs)
    bitmap = _wait(lambda: adapter.query_load_result(task), "load")
    return [bool(bitmap.test(i)) for i in range(len(keys))], [bytes(o.byte_array) for o in objs]


def test_stored_chunks_come_back_and_absent_ones_miss(adapter: Any, hub: HubStub) -> None:
    import os

    blobs = [os.urandom(CHUNK) for _ in range(3)]
    keys = _keys(3)
    assert _store(adapter, keys, blobs) == 3 * CHUNK
    absent = _keys(2, start=10)
    assert _lookup(adapter, keys + absent) == [True, True, True, False, False]
    ok, got = _load(adapter, [keys[1], absent[0], keys[2]])
    assert ok == [True, False, True]
    assert got[0] == blobs[1] and got[2] == blobs[2] and got[1] == bytes(CHUNK)  # the miss leaves its buffer alone
    assert all(p.startswith(f"{PREFIX}/") and p.count("/") == 2 for p in hub.xet_files[BID])


def test_a_half_refused_batch_is_a_failed_store_that_counts_what_landed(adapter: Any, hub: HubStub) -> None:
    import os

    from lmcache.v1.distributed.l2_adapters.hfbucket_l2_adapter import _object_key_to_bucket_path

    keys, blobs = _keys(4), [os.urandom(CHUNK) for _ in range(4)]
    refused = {_object_key_to_bucket_path(k, adapter._bucket_location) for k in keys[2:]}
    hub.refuse_paths = refused
    assert _store(adapter, keys, blobs) == -1  # L2StoreResult: a failure, though two objects landed
    status = adapter.report_status()
    assert status["stored_object_count"] == 2 and status["current_size_bytes"] == 2 * CHUNK
    assert _lookup(adapter, keys) == [True, True, False, False]
    assert set(hub.xet_files[BID]).isdisjoint(refused)


@pytest.mark.parametrize("delta", [1, -1])
def test_a_size_the_hub_gets_wrong_never_serves_wrong_bytes(adapter: Any, hub: HubStub, delta: int,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """hf_xet writes what the CAS reconstructs up to the Hub's size, then checks it; lmcache logs
    a download's error and keeps a file only when its size is the chunk's. So a size one byte too
    large still serves the CAS's (right) bytes, one too small is a miss: never wrong bytes."""
    import os

    keys, blobs = _keys(2), [os.urandom(CHUNK) for _ in range(2)]
    assert _store(adapter, keys, blobs) == 2 * CHUNK
    hub.size_delta = delta  # paths-info, the tree and the resolve HEAD now say CHUNK + delta
    assert _lookup(adapter, keys) == [True, True]  # a lookup reads only that the size is above 0
    ok, got = _load(adapter, keys)
    if delta > 0:  # hf_xet: "File size mismatch: expected 65537 bytes but downloaded 65536 bytes"
        assert ok == [True, True] and got == blobs and "Batch download from hfbucket raised" in caplog.text
    else:  # 65535 bytes written, no error from hf_xet; lmcache's size check refuses them
        assert ok == [False, False] and got == [bytes(CHUNK)] * 2 and "rejecting load" in caplog.text
