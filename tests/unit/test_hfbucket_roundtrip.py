"""hack/hfbucket_roundtrip.py's own logic: its flags, its names, its verdict, and that it never prints the token.

The round trip itself needs a real bucket and cannot run here. Where a client is needed, `FakeBucket`
stands in for the Hub (a dict of path -> bytes): it shows only what the script does with the answers.
"""

from __future__ import annotations

import io
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "hack"))
import hfbucket_roundtrip as rt  # noqa: E402

TOKEN = "hf_secretTOKENvalue0123456789abcdef"


def test_parse_args_splits_the_handle_as_lmcache_does() -> None:
    a = rt.parse_args(["--bucket", "hf://buckets/acme-ml/kv-cache/prod/eu", "--objects", "3", "--size-mib", "0.5"])
    assert (a.bucket_id, a.prefix, a.objects, a.size_bytes, a.token_env, a.create, a.keep) == (
        "acme-ml/kv-cache", "prod/eu", 3, 512 * 1024, "HF_TOKEN", False, False)
    assert rt.parse_args(["--bucket", "hf://buckets/acme-ml/kv-cache"]).prefix == ""


@pytest.mark.parametrize("argv, flag", [
    (["--bucket", "s3://x/y"], "--bucket"),
    (["--bucket", "hf://buckets/only-namespace"], "--bucket"),
    (["--bucket", "hf://buckets/a/b", "--objects", "0"], "--objects"),
    (["--bucket", "hf://buckets/a/b", "--size-mib", "0"], "--size-mib"),
    (["--bucket", "hf://buckets/a/b", "--token-env", TOKEN], "--token-env"),
])
def test_bad_flags_are_refused_naming_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        rt.parse_args(argv)
    err = capsys.readouterr().err
    assert flag in err and TOKEN not in err


def test_names_stay_in_the_run_folder_and_are_lmcache_keys() -> None:
    folder = rt.run_folder("prod", datetime(2026, 12, 2, 3, 4, 5, tzinfo=UTC), "ab12")
    assert folder == "prod/kvpersist-roundtrip-20261202T030405Z-ab12"
    assert not folder.split("/")[-1].startswith("kvp-")  # never a namespace folder the inventory or gc would take
    name = rt.object_name(7)
    assert "/" not in name and name.startswith("kvpersist-roundtrip%4000000000%400%40")


class FakeBucket:
    """Stands in for the Hub: paths -> bytes; `fail_on` names a call that raises an error quoting the token."""

    def __init__(self, fail_on: str = "", corrupt: bool = False) -> None:
        self.objects: dict[str, bytes] = {}
        self.fail_on = fail_on
        self.corrupt = corrupt
        self.calls: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail_on:
            raise RuntimeError(f"401 Client Error for url (Authorization: Bearer {TOKEN})")

    def create_bucket(self, bucket_id: str) -> None:
        self._call("create_bucket")

    def bucket_info(self, bucket_id: str) -> object:
        self._call("bucket_info")
        return SimpleNamespace(id=bucket_id)

    def get_paths_info(self, bucket_id: str, paths: list[str]) -> list[object]:
        self._call("get_paths_info")
        return [SimpleNamespace(path=p, size=len(self.objects[p])) for p in paths if p in self.objects]

    def list_tree(self, bucket_id: str, prefix: str) -> list[object]:
        self._call("list_tree")
        return [SimpleNamespace(path=p) for p in self.objects if p.startswith(prefix)]

    def upload_files(self, bucket_id: str, add: list[tuple[bytes, str]]) -> None:
        self._call("upload_files")
        self.objects.update({path: data for data, path in add})

    def download_files(self, bucket_id: str, files: list[tuple[str, str]]) -> None:
        self._call("download_files")
        for path, local in files:
            data = self.objects[path]
            # flip every bit of the last byte: replacing it with a constant was a no-op when the random byte already was it
            Path(local).write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]) if self.corrupt else data)

    def delete_files(self, bucket_id: str, delete: list[str]) -> None:
        self._call("delete_files")
        for path in delete:
            self.objects.pop(path, None)


def _main(bucket: FakeBucket, monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple[int, str, str]:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    out, err = io.StringIO(), io.StringIO()
    code = rt.main(["--bucket", "hf://buckets/acme-ml/kv-cache/prod", "--objects", "3", "--size-mib", "0.01", *extra],
                   client_factory=lambda token: bucket, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_a_good_round_trip_reports_ok_and_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = FakeBucket()
    code, out, err = _main(bucket, monkeypatch)
    report = json.loads(out)
    assert code == 0 and report["ok"] and err == ""
    steps = report["steps"]
    assert (steps["lookup_found"], steps["load_equal"], steps["listed"], steps["left_after_delete"]) == (3, 3, 3, 0)
    assert steps["missing_is_empty"] and bucket.objects == {}
    assert bucket.calls == ["bucket_info", "upload_files", "get_paths_info", "get_paths_info", "download_files",
                            "list_tree", "delete_files", "get_paths_info"]
    assert TOKEN not in out + err


def test_a_changed_byte_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # every payload ends in b"x": the fake once "corrupted" by writing b"x" there, a no-op 3 runs in 256 (CI, stop 37)
    monkeypatch.setattr(rt.os, "urandom", lambda n: b"x" * n)
    code, out, _ = _main(FakeBucket(corrupt=True), monkeypatch, "--keep", "--create")
    report = json.loads(out)
    assert code == 1 and not report["ok"] and report["steps"]["load_equal"] == 0
    assert "create_bucket_s" in report["steps"] and "delete_s" not in report["steps"]


@pytest.mark.parametrize("call, step", [("bucket_info", "bucket_info"), ("upload_files", "store"),
                                        ("download_files", "load"), ("delete_files", None)])
def test_the_token_is_never_printed(call: str, step: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = FakeBucket(fail_on=call)
    code, out, err = _main(bucket, monkeypatch)
    assert code == 1 and TOKEN not in out + err and "<token>" in out + err
    report = json.loads(out)
    assert report.get("failed_step") == step and not report["ok"]
    if call == "download_files":
        assert bucket.objects == {}  # a failed step still removes what the run wrote
    if call == "delete_files":
        assert "delete_error" in report["steps"] and len(bucket.objects) == 3  # said, and left


def test_no_token_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KV_BUCKET_TOKEN", raising=False)
    err = io.StringIO()
    code = rt.main(["--bucket", "hf://buckets/a/b", "--token-env", "KV_BUCKET_TOKEN"], client_factory=FakeBucket, err=err)
    assert code == 2 and "KV_BUCKET_TOKEN is empty" in err.getvalue()
