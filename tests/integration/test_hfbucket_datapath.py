"""KV stored and served through lmcache's real hfbucket L2 adapter, with no Hub reachable.

What is real: `lmcache server` with the args the operator renders for the hf-bucket sample
(kvpersist's serde on the adapter, the token only in KVPERSIST_HF_TOKEN), lmcache's
HFBucketL2Adapter and HFBucketClient, huggingface_hub's bucket calls (create_bucket,
get_bucket_paths_info, batch_bucket_files, download_bucket_files, get_bucket_file_metadata) and
hf_xet's chunking, xorbs, shards and reconstruction, into xet-core's own local CAS (LocalClient,
compiled into the hf_xet wheel; tests/integration/xet_local_cas.py), and the operator's bucket
inventory and gc reading what lmcache wrote.

The stand-in: the Hub's bucket routes (tests/integration/hub_stub.py with `cas_dir`): bucket
creation, the Xet token routes, paths-info, the batch index of path -> xet hash, the tree
listing and the resolve HEAD. It decides nothing about the bytes, which never pass through it,
but it is our reading of the Hub, not the Hub: the Hub's own answers (token scopes, quotas,
rate limits, consistency between a batch and the next paths-info, latency) are only seen on a
real bucket (docs/hfbucket-checklist.md). With a `local://` CAS URL hf_xet never opens a
connection for the bytes; the `http` case (when KVPERSIST_XET_CAS_SERVER names xet-core's
`local_cas_server`, built by hack/xet_cas_server.sh) sends them through hf_xet's RemoteClient and
the CAS's HTTP protocol, to xet-core's own server over the same LocalClient storage.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

from kvpersist.inventory.bucket import preflight_bucket, remove_bucket_namespace, scan_bucket
from tests.conftest import NOT_RUN
from tests.integration.conftest import drive, free_port, make_target
from tests.integration.hub_stub import GOOD_TOKEN, HubStub
from tests.integration.xet_local_cas import cas_file_sizes

pytestmark = pytest.mark.datapath
BID = "acme-ml/kv-cache"  # the hf-bucket sample's bucket; its handle's prefix is "prod"
# lmcache 0.5.6 hfbucket_l2_adapter._object_key_to_string, quoted with safe="":
# <model>@<kv_rank, 8 hex>@<object group, hex>@<chunk hash, hex>[@<cache salt>]
LMCACHE_NAME = re.compile(r"[^@/]+@[0-9a-f]{8}@[0-9a-f]+@[0-9a-f]{64}(@[^@/]+)?")
# xet-core's own CAS server over HTTP (hack/xet_cas_server.sh builds it: a Rust build too long for
# CI), run as well when KVPERSIST_XET_CAS_SERVER names it; the in-process LocalClient always.
CAS_SERVER = os.environ.get("KVPERSIST_XET_CAS_SERVER", "")
CAS_MODES = ["local", "http"] if CAS_SERVER else ["local"]
if not CAS_SERVER:
    NOT_RUN.append("tests/integration/test_hfbucket_datapath.py: the `http` CAS mode (hf_xet's RemoteClient to xet-core's "
                   "local_cas_server): set KVPERSIST_XET_CAS_SERVER to the binary hack/xet_cas_server.sh builds (a 21-minute "
                   "Rust build, too long for CI); only the in-process `local` mode ran")


def test_shard_reader_agrees_with_hf_xet(tmp_path: Path) -> None:
    """The stand-in's sizes come from the CAS's shards: they must be what hf_xet itself reports."""
    import hf_xet

    session = hf_xet.XetSession()
    sizes = [1, 4095, 64 * 1024 + 7, 3 * 1024 * 1024 + 11]
    with session.new_upload_commit(endpoint=f"local://{tmp_path}") as commit:
        handles = [commit.start_upload_bytes(os.urandom(n), sha256=hf_xet.SKIP_SHA256) for n in sizes]
    reported = {h.result().xet_info.hash: h.result().xet_info.file_size for h in handles}
    assert sorted(reported.values()) == sizes
    assert cas_file_sizes(tmp_path) == reported


def _wait_objects(hub: HubStub, prefix: str, count: int, timeout: float = 120.0) -> dict[str, tuple[str, int, float]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with hub.lock:
            mine = {p: v for p, v in hub.xet_files.get(BID, {}).items() if p.startswith(prefix)}
        if len(mine) >= count:
            return mine
        time.sleep(0.5)
    raise AssertionError(f"{len(mine)} of {count} objects reached the bucket in {timeout}s")


@contextlib.contextmanager
def _cas(mode: str, cas: Path, log: Path) -> Iterator[str | None]:
    """The CAS URL the stand-in hands out: None for hf_xet's in-process LocalClient (local://), or
    a running xet-core local_cas_server over HTTP on loopback."""
    if mode == "local":
        yield None
        return
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen([CAS_SERVER, "--data-directory", str(cas), "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"local_cas_server did not come up: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.parametrize("cas_mode", CAS_MODES)
def test_kv_round_trip_through_the_real_adapter(servers, tmp_path: Path, cas_mode: str) -> None:
    cas = tmp_path / "cas"
    with _cas(cas_mode, cas, tmp_path / "cas.log") as cas_url, \
            HubStub(existing=set(), cas_dir=cas, cas_url=cas_url, page_size=3) as hub:
        target = make_target("hf-bucket")
        # The operator's preflight creates the bucket, private (createBucketIfMissing), before the servers
        # write: lmcache is never asked to (its create_bucket sends no visibility: a public bucket).
        made = preflight_bucket(target.spec.l2.hf_bucket.bucket_handle, GOOD_TOKEN, True, "hf-token", endpoint=hub.url)
        assert (made.ok, made.reason) == (True, "BucketCreated") and hub.visibility.get(BID) == "private"
        prefix = f"prod/{target.namespace_id}/"
        env = {"HF_ENDPOINT": hub.url, "KVPERSIST_HF_TOKEN": GOOD_TOKEN, "HF_XET_CACHE": str(tmp_path / "xet-cache"),
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}

        srv = servers(target)
        srv.env = env
        srv.start()
        stored = drive(srv, "store", "0:4")["summary"]
        assert stored["stored_chunks"] == stored["chunks"] == 8 and stored["hit_chunks"] == 0
        objects = _wait_objects(hub, prefix, 8)
        assert BID in hub.existing and [r for r in hub.requests if r == ("POST", f"/api/buckets/{BID}")] == [
            ("POST", f"/api/buckets/{BID}")]  # the preflight's create, and no other
        # Every object under the namespace's folder, one per chunk, named as lmcache names keys.
        assert len(objects) == 8
        assert all(LMCACHE_NAME.fullmatch(unquote(p.removeprefix(prefix))) for p in objects), sorted(objects)
        assert all(p.count("/") == 2 for p in objects)  # the key is quoted: nothing leaves the folder
        # Stored by kvpersist's serde: each object is its 512 KiB chunk plus the frame, in the CAS.
        chunk = 512 * 1024
        assert {size for _, size, _ in objects.values()} == {next(iter(objects.values()))[1]}
        assert chunk < next(iter(objects.values()))[1] <= chunk + 64 * 1024
        assert set(cas_file_sizes(cas)) >= {h for h, _, _ in objects.values()}
        # local:// lays the CAS out under xet/xorbs in the server's process; local_cas_server
        # keeps it at the top of its data directory: which one wrote shows who carried the bytes.
        assert (cas / "xet").is_dir() == (cas_mode == "local") and (cas / "shards").is_dir() == (cas_mode == "http")
        assert set(hub.seen_tokens) == {GOOD_TOKEN} and GOOD_TOKEN not in " ".join(srv.argv)

        # A new process: an empty L1 and an empty adapter index. Every chunk comes from the bucket.
        srv.stop(signal.SIGKILL)
        before = len(hub.requests)
        srv.start()
        served = drive(srv, "verify", "0:4")["summary"]
        assert served["hit_chunks"] == served["verified_chunks"] == 8, served
        assert served["wrong_bytes"] == 0 and served["lookup_errors"] == 0
        asked = [path for _, path in hub.requests[before:]]
        assert any(p.endswith("/paths-info") for p in asked)
        assert any(p.startswith(f"/buckets/{BID}/resolve/") for p in asked)  # download_bucket_files' metadata
        assert any(p.endswith("/xet-read-token") for p in asked)  # hf_xet's read token, then LocalClient

        # The operator's inventory reads what lmcache wrote, and gc deletes exactly that folder.
        inv = scan_bucket("hf://buckets/acme-ml/kv-cache/prod", GOOD_TOKEN, endpoint=hub.url)
        usage = next((n for n in inv.namespaces if n.namespace_id == str(target.namespace_id)), None)
        assert usage is not None and usage.objects == 8
        assert usage.bytes == sum(size for _, size, _ in objects.values())
        removed = remove_bucket_namespace("hf://buckets/acme-ml/kv-cache/prod", GOOD_TOKEN, str(target.namespace_id),
                                          endpoint=hub.url, dry_run=False)
        assert removed.objects == 8 and not any(p.startswith(prefix) for p in hub.xet_files[BID])
        assert [op["type"] for op in hub.batches[-1]] == ["deleteFile"] * 8
        srv.stop()


@pytest.mark.parametrize("model, salt", [
    ("Qwen/Qwen2.5-7B-Instruct", ""),  # a Hub model id: always a "/"
    ("/root/.cache/huggingface/hub/models--kvpersist--tiny-llama/snapshots/0123abcd", ""),  # vLLM offline: a path
    ("m", ".."),  # a cache salt is the user's text (lmcache refuses "/", "@", "\\" and NUL in it)
    ("a%2F..%2Fb", "%2F..%2Fkvp-" + "d" * 32),  # already-quoted text is quoted again, never decoded
])
def test_lmcache_names_never_leave_the_namespace_folder(model: str, salt: str) -> None:
    """lmcache's own naming (no stand-in): any model name or cache salt is one quoted segment under
    the handle's prefix, so the inventory's per-namespace split and gc's prefix delete hold."""
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters.hfbucket_l2_adapter import _object_key_to_bucket_path
    from lmcache.v1.storage_backend.connector.hfbucket_connector import decode_hfbucket_object_name, parse_hfbucket_handle

    ns = "kvp-" + "c" * 32
    location = parse_hfbucket_handle(f"hf://buckets/acme-ml/kv-cache/prod/{ns}")
    assert (location.bucket_id, location.object_prefix) == ("acme-ml/kv-cache", f"prod/{ns}")
    key = ObjectKey(chunk_hash=bytes(range(32)), model_name=model, kv_rank=1, object_group_id=0, cache_salt=salt)
    path = _object_key_to_bucket_path(key, location)
    folder, _, name = path.rpartition("/")
    assert folder == f"prod/{ns}"  # the whole key is one segment: "/" in it is quoted
    assert decode_hfbucket_object_name(name) == f"{model}@00000001@0@{bytes(range(32)).hex()}" + (f"@{salt}" if salt else "")
    with pytest.raises(ValueError, match="cache_salt"):
        ObjectKey(chunk_hash=bytes(32), model_name=model, kv_rank=1, cache_salt=f"../{ns}")


def test_a_bucket_path_pointed_at_another_object_is_a_miss(servers, tmp_path: Path) -> None:
    """Each object's frame binds its name: a bucket path pointed at another object's bytes (here
    the stand-in's path -> xet hash index swapped pairwise, as an edit of the bucket by hand or a
    copy under another name would leave it) is a miss, never the other chunk's bytes. Before, the
    frame authenticated under any name and was served (a wrong hit). The bucket's index is the
    stand-in's; the bytes and their reading are hf_xet's and lmcache's own."""
    cas = tmp_path / "cas"
    with HubStub(existing=set(), cas_dir=cas, page_size=3) as hub:
        target = make_target("hf-bucket")
        assert preflight_bucket(target.spec.l2.hf_bucket.bucket_handle, GOOD_TOKEN, True, "hf-token", endpoint=hub.url).ok
        prefix = f"prod/{target.namespace_id}/"
        srv = servers(target)
        srv.env = {"HF_ENDPOINT": hub.url, "KVPERSIST_HF_TOKEN": GOOD_TOKEN, "HF_XET_CACHE": str(tmp_path / "xet-cache"),
                   "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
        srv.start()
        assert drive(srv, "store", "0:4")["summary"]["stored_chunks"] == 8
        paths = sorted(_wait_objects(hub, prefix, 8))
        srv.stop(signal.SIGKILL)
        with hub.lock:
            index = hub.xet_files[BID]
            for a, b in zip(paths[0::2], paths[1::2], strict=True):
                assert index[a][1] == index[b][1]  # same size: only the bytes differ
                index[a], index[b] = index[b], index[a]
        srv.start()
        read = drive(srv, "verify", "0:4")["summary"]  # the driver compares what comes back with what was stored
        assert read["hit_chunks"] == 0 and read["wrong_bytes"] == 0 and read["lookup_errors"] == 0, read
        # Each object the server opened under the wrong name is a frame of its own key: removed from
        # the bucket (lmcache's batch delete), so the chunk is stored again when next computed.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(p in hub.xet_files[BID] for p in paths[0::2]):
            time.sleep(0.2)
        with hub.lock:
            assert not any(p in hub.xet_files[BID] for p in paths[0::2]), sorted(hub.xet_files[BID])
        srv.stop()
