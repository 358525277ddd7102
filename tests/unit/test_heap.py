"""kvpersist.controller.heap: malloc_trim where the C library is glibc, nothing elsewhere."""

from __future__ import annotations

import ctypes
import platform

import pytest

from kvpersist.controller import heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trims_under_glibc() -> None:
    assert heap.trim() is True


def test_nothing_to_trim_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_glibc(name: str) -> ctypes.CDLL:
        raise OSError(f"{name}: cannot open shared object file")

    heap._libc.cache_clear()
    monkeypatch.setattr(ctypes, "CDLL", no_glibc)
    try:
        assert heap.trim() is False
    finally:
        heap._libc.cache_clear()
