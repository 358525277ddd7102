"""The bucket token's Secret is read again only when the Secret watch cache shows it changed
(issue 46: with a Hub that kept failing, every resource re-read it on every retry, about 600
GETs a minute at 500 resources). Gone from the cache: no token, no read. No cache (a glob of
namespaces): read each time, as before."""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterator
from typing import Any

import pytest

from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.builders.target import Target
from kvpersist.controller import kube, l2runtime, runtime
from tests.cases.invalid_manifests import sample

KEY = ("ml", "r")


class Cache:
    def __init__(self) -> None:
        self.version: str | None = "1"

    def lookup(self, namespace: str, name: str) -> tuple[bool, dict[str, Any] | None]:
        return True, ({"metadata": {"name": name, "resourceVersion": self.version}} if self.version else None)


@pytest.fixture()
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    got: list[str] = []

    def get(api_version: str, kind: str, name: str, namespace: str) -> dict[str, Any]:
        got.append(name)
        return {"metadata": {"name": name, "resourceVersion": cache.version},
                "data": {"token": base64.b64encode(b"hf_abc").decode(), "other": "c2VjcmV0"}}

    cache = Cache()
    monkeypatch.setattr(kube, "get", get)
    monkeypatch.setattr(runtime.CONTROLLER, "secret_cache", cache)
    runtime.CONTROLLER.state(KEY)
    yield got
    runtime.CONTROLLER.forget(KEY)


def target() -> Target:
    spec = copy.deepcopy(sample("hf-bucket"))["spec"]
    return Target(KEY[1], KEY[0], KVCacheNamespaceSpec.model_validate(spec), None)


def token() -> str | None:
    return l2runtime.SecretOnce(target()).token()


def test_read_once_per_version_and_never_once_gone(reads: list[str]) -> None:
    assert [token() for _ in range(3)] == ["hf_abc"] * 3 and len(reads) == 1
    held = runtime.CONTROLLER.get(KEY).token_secret
    assert held is not None and set(held[1]["data"]) == {"token"}  # the one key it needs, nothing else of the Secret
    runtime.CONTROLLER.secret_cache.version = "2"  # type: ignore[union-attr]
    assert token() == "hf_abc" and len(reads) == 2
    runtime.CONTROLLER.secret_cache.version = None  # type: ignore[union-attr]
    assert token() is None and len(reads) == 2


def test_without_the_cache_each_refresh_reads_it(reads: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime.CONTROLLER, "secret_cache", None)
    assert [token() for _ in range(2)] == ["hf_abc"] * 2 and len(reads) == 2
