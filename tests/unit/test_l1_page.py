"""The lmcache server's L1 page (--l1-align-bytes) for nixl_store_dynamic: up to a sixteenth of
one layer of a chunk, so its files move in few large transfers and L1 wastes nothing; part of the
namespace id, since another page size is another file size. Measured effect: benchmarks/RESULTS.md."""

from __future__ import annotations

import pytest

from kvpersist.api.spec import DEFAULT_L1_PAGE, MAX_L1_PAGE, chunk_layer_bytes, l1_page_bytes
from kvpersist.builders.lmcache import server_args
from kvpersist.identity import resolve
from kvpersist.l2backends.nvme import framed_disk_share
from tests.unit.test_builders import target


def _with(encrypted: bool = True, **identity: object):
    """nvme-minimal on nixl_store_dynamic (the adapter whose page this is) with these pins."""
    def mutate(o: dict) -> None:
        o["spec"]["identity"].update(identity)
        o["spec"]["l2"]["nvme"]["adapter"] = "nixl_store_dynamic"
        o["spec"]["l2"]["encryption"] = {"enabled": encrypted}
    return target("nvme-minimal", mutate=mutate)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("encrypted", [True, False], ids=["aesgcm", "checked"])
@pytest.mark.parametrize(("heads", "head_size", "tp", "dtype", "page"), [
    (8, 128, 1, "bfloat16", 2**16),  # Llama-3.1-8B: a sixteenth of its 1 MiB layer (256 x 2 x 8 x 128 x 2)
    (8, 128, 2, "fp8_e4m3", 2**14),  # 4 heads per rank, 1 byte: 256 KiB a layer
    (8, 128, 16, "bfloat16", 2**13),  # heads replicated past TP = heads: 1 per rank, 128 KiB
    (2, 64, 1, "float16", 2**13),  # the integration tests' driver shape: 128 KiB / 16
    (5, 96, 1, "bfloat16", 2**14),  # 491,520 / 16 = 30,720: the power of two below it, which divides the layer
    (64, 128, 1, "bfloat16", 2**19),  # 8 MiB a layer: a sixteenth, 512 KiB, under the 1 MiB cap
    (1, 2, 1, "fp8_e5m2", DEFAULT_L1_PAGE),  # 1 KiB a layer: never below lmcache's default
])
def test_the_page_is_at_most_a_sixteenth_of_a_layer(heads: int, head_size: int, tp: int, dtype: str, page: int,
                                                    encrypted: bool) -> None:
    """Every object is a frame (encrypted, or checked with encryption off), its file its chunk and
    one page (the frame's few bytes spill into it), so the page is kept small beside a layer: the
    disk share lmcache is given loses at most 1/17."""
    t = _with(encrypted, numKVHeads=heads, headSize=head_size, tensorParallelSize=tp, kvCacheDtype=dtype)
    layer = chunk_layer_bytes(t.spec)
    assert layer == 256 * 2 * max(1, heads // tp) * head_size * {"bfloat16": 2, "float16": 2}.get(dtype, 1)
    got = l1_page_bytes(t.spec)
    assert got == page <= MAX_L1_PAGE
    if got > DEFAULT_L1_PAGE:
        assert layer % got == 0 and got * 16 <= layer
        assert framed_disk_share(t.spec) == layer / (layer + got) >= 16 / 17
    assert flag(server_args(t), "--l1-align-bytes") == str(got)


def test_other_adapters_and_unknown_element_sizes_keep_lmcaches_default() -> None:
    assert l1_page_bytes(target("hf-bucket").spec) == DEFAULT_L1_PAGE
    for adapter in ("fs", "fs_native"):  # one read per file: no page to move it in
        other = target(mutate=lambda o, a=adapter: o["spec"]["l2"]["nvme"].update(adapter=a))
        assert l1_page_bytes(other.spec) == DEFAULT_L1_PAGE
        assert other.spec.pins("0" * 16)["l2_layout"].split("/")[0] == adapter
    assert l1_page_bytes(_with(kvCacheDtype="nvfp4").spec) == DEFAULT_L1_PAGE  # packed with scales: bytes unknown
    assert l1_page_bytes(_with(numKVHeads=None).spec) == DEFAULT_L1_PAGE  # the cache is off anyway


def test_another_page_is_another_namespace() -> None:
    """A file written with one page size is not readable with another (a frame fills one page more
    than its chunk, and nixl reads whole pages). The page follows from pins already in the id, but
    the rule may change (it did: 4 KiB before, and a whole layer with encryption off before every
    object was framed), so it is in l2_layout: the same pins under another page rule are another
    namespace."""
    pins = _with(numKVHeads=8).spec.pins("0" * 16)
    assert pins["l2_layout"] == "nixl_store_dynamic/page=65536"
    assert _with(False, numKVHeads=8).spec.pins(None)["l2_layout"] == "nixl_store_dynamic/page=65536"
    old_rule = {**pins, "l2_layout": f"nixl_store_dynamic/page={DEFAULT_L1_PAGE}"}
    assert resolve(pins).namespace_id != resolve(old_rule).namespace_id
