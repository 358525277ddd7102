"""Per-namespace inventory and explicit cleanup of a Hugging Face bucket L2 (kvpersist.inventory.bucket).

No Hugging Face endpoint is reachable from these machines: the listing and deletion go through
huggingface_hub's real client to tests/integration/hub_stub.py, a local stand-in for the Hub's
bucket API shapes (tree listing with Link paging, NDJSON batch deletes), never the Hub itself."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from kvpersist.inventory import bucket as inventory_bucket
from kvpersist.inventory.bucket import BucketInventoryError, remove_bucket_namespace, scan_bucket
from tests.integration.hub_stub import GOOD_TOKEN, HubStub

BID = "acme-ml/kv-cache"
HANDLE = f"hf://buckets/{BID}/prod"
NS_A = "kvp-" + "a" * 32
NS_B = "kvp-" + "b" * 32
T0 = 1_785_000_000.0  # unix seconds; the stub keeps milliseconds, so fractions of 1/8 s compare exactly
BAD_TOKEN = "hf_wrong_token_abcdef0123456789"

# (path, size, mtime): what lmcache's hfbucket adapter would have written, plus neighbours it must not touch.
OBJECTS = [
    (f"prod/{NS_A}/vllm%40m%401%400%40aaa01", 4096, T0 + 10.5),
    (f"prod/{NS_A}/vllm%40m%401%400%40aaa02", 4096, T0 + 30.25),
    (f"prod/{NS_A}/vllm%40m%401%400%40aaa03", 1000, T0 + 20.0),
    (f"prod/{NS_B}/vllm%40m%401%400%40bbb01", 2048, T0 + 5.125),
    (f"prod/{NS_B}/vllm%40m%401%400%40bbb02", 777, T0 + 7.0),
    ("prod/README.md", 123, T0),  # under the prefix, outside any namespace folder
    (f"prod-old/{NS_A}/vllm%40m%401%400%40old01", 555, T0),  # another prefix ("prod" matches it as a raw string) ...
    (f"staging/{NS_A}/vllm%40m%401%400%40stg01", 321, T0),  # ... and another, holding the same namespace id
]


@pytest.fixture()
def hub() -> Iterator[HubStub]:
    with HubStub(existing={BID}, delay=5.0, page_size=2) as stub:  # 2 per page: the listing must follow the Link pages
        for i, (path, size, mtime) in enumerate(OBJECTS):
            stub.put(BID, path, bytes([i]) * size, mtime)
        yield stub


def _expected(ns: str) -> tuple[int, int, float]:
    mine = [(s, m) for p, s, m in OBJECTS if p.startswith(f"prod/{ns}/")]
    return sum(s for s, _ in mine), len(mine), max(m for _, m in mine)


def test_scan_reports_each_namespace(hub: HubStub) -> None:
    inv = scan_bucket(HANDLE, GOOD_TOKEN, endpoint=hub.url)
    assert inv.location == HANDLE
    assert [n.namespace_id for n in inv.namespaces] == [NS_A, NS_B]
    for ns in (NS_A, NS_B):
        usage = next((n for n in inv.namespaces if n.namespace_id == ns), None)
        assert usage is not None
        assert (usage.bytes, usage.objects, usage.last_write) == _expected(ns)
    assert inv.other_bytes == 123  # README.md only: prod-old/ and staging/ are not under the prefix
    assert sum(1 for m, p in hub.requests if m == "GET" and "/tree/" in p) >= 4  # 6 objects, 2 a page
    assert all(m == "GET" for m, _ in hub.requests) and set(hub.seen_tokens) == {GOOD_TOKEN}


def test_scan_without_prefix_groups_at_bucket_root(hub: HubStub) -> None:
    inv = scan_bucket(f"hf://buckets/{BID}", GOOD_TOKEN, endpoint=hub.url)
    assert inv.namespaces == []  # every namespace folder sits one level down, under prod/, prod-old/, staging/
    assert inv.other_bytes == sum(s for _, s, _ in OBJECTS)


def test_dry_run_deletes_nothing(hub: HubStub) -> None:
    before = hub.snapshot()
    usage = remove_bucket_namespace(HANDLE, GOOD_TOKEN, NS_A, endpoint=hub.url)  # dry_run defaults to True
    assert (usage.namespace_id, usage.bytes, usage.objects, usage.last_write) == (NS_A, *_expected(NS_A))
    assert hub.snapshot() == before
    assert hub.batches == [] and not any(m == "POST" for m, _ in hub.requests)


def test_removal_deletes_exactly_that_namespace(hub: HubStub) -> None:
    before = hub.snapshot()
    usage = remove_bucket_namespace(HANDLE, GOOD_TOKEN, NS_A, endpoint=hub.url, dry_run=False)
    assert (usage.bytes, usage.objects, usage.last_write) == _expected(NS_A)
    gone = {p for p, _, _ in OBJECTS if p.startswith(f"prod/{NS_A}/")}
    after = hub.snapshot()
    assert after == {BID: {p: v for p, v in before[BID].items() if p not in gone}}
    assert [sorted(op["path"] for op in batch) for batch in hub.batches] == [sorted(gone)]
    assert all(op["type"] == "deleteFile" for batch in hub.batches for op in batch)
    inv = scan_bucket(HANDLE, GOOD_TOKEN, endpoint=hub.url)
    assert [n.namespace_id for n in inv.namespaces] == [NS_B] and inv.other_bytes == 123
    # Removing it again finds nothing and sends no deletion.
    again = remove_bucket_namespace(HANDLE, GOOD_TOKEN, NS_A, endpoint=hub.url, dry_run=False)
    assert (again.bytes, again.objects, again.last_write) == (0, 0, None) and len(hub.batches) == 1


def test_bad_namespace_id_refused(hub: HubStub) -> None:
    before = hub.snapshot()
    for bad in ["kvp-xyz", "", "prod", "..", f"{NS_A}/x", "kvp-" + "A" * 32, f"../{NS_A}", f" {NS_A}", f"{NS_A}\n"]:
        for dry_run in (True, False):
            with pytest.raises(ValueError, match="not a namespace id"):
                remove_bucket_namespace(HANDLE, GOOD_TOKEN, bad, endpoint=hub.url, dry_run=dry_run)
    assert hub.requests == [] and hub.snapshot() == before  # refused before any request


def _chain_text(exc: BaseException) -> str:
    parts = []
    seen: BaseException | None = exc
    while seen is not None:
        parts += [str(seen), repr(seen)]
        seen = seen.__cause__ or seen.__context__
    return "\n".join(parts)


def test_bad_token_error_never_contains_it(hub: HubStub, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    before = hub.snapshot()
    with pytest.raises(BucketInventoryError) as scan_err:
        scan_bucket(HANDLE, BAD_TOKEN, endpoint=hub.url)
    with pytest.raises(BucketInventoryError) as remove_err:
        remove_bucket_namespace(HANDLE, BAD_TOKEN, NS_A, endpoint=hub.url, dry_run=False)
    for err in (scan_err.value, remove_err.value):
        assert err.reason == "TokenRejected" and BID in str(err)
        assert BAD_TOKEN not in _chain_text(err) and GOOD_TOKEN not in _chain_text(err)
    assert BAD_TOKEN not in caplog.text
    assert set(hub.seen_tokens) == {BAD_TOKEN}  # it went to the Hub, and only there
    assert hub.snapshot() == before and hub.batches == []


def test_missing_bucket_is_a_reason(hub: HubStub) -> None:
    with pytest.raises(BucketInventoryError) as err:
        scan_bucket("hf://buckets/acme-ml/missing/prod", GOOD_TOKEN, endpoint=hub.url)
    assert err.value.reason == "BucketNotFound" and "acme-ml/missing" in str(err.value)


def test_unanswered_listing_is_bounded(hub: HubStub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inventory_bucket, "PREFLIGHT_TIMEOUT_S", 1.0)
    monkeypatch.setattr(inventory_bucket, "_client_bounded", False)
    hub.existing.add("slow/bucket")
    t0 = time.monotonic()
    with pytest.raises(BucketInventoryError) as err:
        scan_bucket("hf://buckets/slow/bucket/prod", GOOD_TOKEN, endpoint=hub.url)
    assert time.monotonic() - t0 < 4.0
    assert err.value.reason == "HubUnreachable"
    monkeypatch.setattr(inventory_bucket, "_client_bounded", False)  # the next user re-binds with the real bound


def test_deadline_stops_before_any_request(hub: HubStub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inventory_bucket, "BUCKET_DEADLINE_S", -1.0)
    with pytest.raises(BucketInventoryError) as err:
        remove_bucket_namespace(HANDLE, GOOD_TOKEN, NS_A, endpoint=hub.url, dry_run=False)
    assert err.value.reason == "HubTimeout" and hub.requests == [] and hub.batches == []
