"""kvpersist.controller.watchcache.trim: malloc_trim where the C library is glibc, nothing elsewhere."""

from __future__ import annotations

import ctypes
import platform

import pytest

from kvpersist.controller import watchcache


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trims_under_glibc() -> None:
    assert watchcache.trim() is True


def test_nothing_to_trim_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_glibc(name: str) -> ctypes.CDLL:
        raise OSError(f"{name}: cannot open shared object file")

    watchcache._libc.cache_clear()
    monkeypatch.setattr(ctypes, "CDLL", no_glibc)
    try:
        assert watchcache.trim() is False
    finally:
        watchcache._libc.cache_clear()
