"""A store-and-retrieve round trip through a real Hugging Face bucket, with the calls lmcache's hfbucket adapter makes.

It cannot run in this project's tests or CI (no Hugging Face endpoint is reachable there); run
it from a machine that reaches the Hub, with a token that can write the bucket, before relying
on a bucket as L2 (docs/hfbucket-checklist.md):

    export HF_TOKEN=hf_...            # read from the environment only, never from the command line
    python3 hack/hfbucket_roundtrip.py --bucket hf://buckets/acme-ml/kv-cache/prod [--create] \
        [--objects 8] [--size-mib 4] [--keep]

The calls are those of lmcache 0.5.6's HFBucketClient (lmcache/v1/storage_backend/connector/
hfbucket_connector.py), in the adapter's order: create_bucket(exist_ok) when --create, else
bucket_info; batch_bucket_files(add=[(bytes, path)]) for a store; get_bucket_paths_info for a
lookup; download_bucket_files for a load; list_bucket_tree(prefix, recursive) for the listing
kvpersist's inventory reads; batch_bucket_files(delete=[...]) as eviction and `kvpersist gc` do.
Objects are named as lmcache names them (`<model>@<kv rank, 8 hex>@<group>@<chunk hash>`,
quoted with safe="") under `<prefix>/kvpersist-roundtrip-<utc time>-<random>/`, a folder no
namespace id can be, and removed at the end unless --keep.

Prints one JSON object: each step's seconds, MB/s for the store and the load, and `ok`; on an
error, the step (`failed_step`) and the Hub's answer (`error`). Exits 1 when any step failed or
any byte differed. The token is read from --token-env (HF_TOKEN by
default) and never printed: every error text is scrubbed of it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TextIO
from urllib.parse import quote

HANDLE_PREFIX = "hf://buckets/"
MAX_OBJECTS = 1000  # one batch call, as the adapter sends one per store task
MAX_SIZE_MIB = 512


class BucketClient(Protocol):
    """The seven calls of lmcache's HFBucketClient."""

    def create_bucket(self, bucket_id: str) -> None: ...
    def bucket_info(self, bucket_id: str) -> object: ...
    def get_paths_info(self, bucket_id: str, paths: Sequence[str]) -> list[object]: ...
    def list_tree(self, bucket_id: str, prefix: str) -> list[object]: ...
    def upload_files(self, bucket_id: str, add: Sequence[tuple[bytes, str]]) -> None: ...
    def download_files(self, bucket_id: str, files: Sequence[tuple[str, str]]) -> None: ...
    def delete_files(self, bucket_id: str, delete: Sequence[str]) -> None: ...


@dataclass(frozen=True)
class Args:
    bucket_id: str
    prefix: str
    token_env: str
    create: bool
    objects: int
    size_bytes: int
    keep: bool


def parse_args(argv: Sequence[str]) -> Args:
    """The flags, checked; errors name the flag and what it takes."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--bucket", required=True, help="hf://buckets/<namespace>/<bucket>[/<prefix>], as spec.l2.hfBucket.bucketHandle")
    p.add_argument("--token-env", default="HF_TOKEN", help="environment variable holding the token (default HF_TOKEN)")
    p.add_argument("--create", action="store_true", help="create the bucket if missing (createBucketIfMissing)")
    p.add_argument("--objects", type=int, default=8, help=f"objects in the batch, 1..{MAX_OBJECTS} (default 8)")
    p.add_argument("--size-mib", type=float, default=4.0, help="size of each object in MiB (default 4: a chunk of a "
                   "small model; Llama-3.1-8B's 256-token chunk is 32 MiB)")
    p.add_argument("--keep", action="store_true", help="leave the objects in the bucket")
    ns = p.parse_args(list(argv))
    if not ns.bucket.startswith(HANDLE_PREFIX):
        p.error(f"--bucket must start with {HANDLE_PREFIX}, got {ns.bucket!r}")
    parts = [s for s in ns.bucket[len(HANDLE_PREFIX):].split("/") if s]
    if len(parts) < 2:
        p.error(f"--bucket needs a namespace and a bucket name: {HANDLE_PREFIX}<namespace>/<bucket>[/<prefix>]")
    if not 1 <= ns.objects <= MAX_OBJECTS:
        p.error(f"--objects must be 1..{MAX_OBJECTS}, got {ns.objects}")
    if not 0 < ns.size_mib <= MAX_SIZE_MIB:
        p.error(f"--size-mib must be above 0 and at most {MAX_SIZE_MIB}, got {ns.size_mib}")
    if not ns.token_env or ns.token_env.startswith("hf_"):
        p.error("--token-env takes the NAME of an environment variable (e.g. HF_TOKEN), not a token")
    return Args("/".join(parts[:2]), "/".join(parts[2:]), ns.token_env, ns.create, ns.objects,
                int(ns.size_mib * 1024 * 1024), ns.keep)


def run_folder(prefix: str, now: datetime, tag: str) -> str:
    """The run's own folder under the handle's prefix: never a `kvp-` namespace folder."""
    name = f"kvpersist-roundtrip-{now.strftime('%Y%m%dT%H%M%SZ')}-{tag}"
    return f"{prefix}/{name}" if prefix else name


def object_name(index: int) -> str:
    """A key in lmcache's hfbucket format (hfbucket_l2_adapter._object_key_to_string), quoted as it quotes."""
    chunk_hash = hashlib.sha256(f"kvpersist-roundtrip-{index}".encode()).hexdigest()
    return quote(f"kvpersist-roundtrip@{0:08x}@0@{chunk_hash}", safe="")


def scrub(text: str, token: str | None) -> str:
    return text.replace(token, "<token>") if token else text


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def _mbps(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e6, 2) if seconds > 0 else None


def round_trip(client: BucketClient, args: Args, workdir: Path, now: datetime | None = None) -> dict[str, Any]:
    """The steps, each adding its result to the report; the first that raises ends the run
    (`failed_step`, `error`), and what the run wrote is deleted all the same unless --keep."""
    folder = run_folder(args.prefix, now or datetime.now(UTC), secrets.token_hex(4))
    paths = [f"{folder}/{object_name(i)}" for i in range(args.objects)]
    blobs = [os.urandom(args.size_bytes) for _ in paths]
    total = sum(len(b) for b in blobs)
    report: dict[str, Any] = {"bucket": args.bucket_id, "folder": folder, "objects": len(paths), "bytes": total,
                              "steps": {}, "ok": False}
    steps = report["steps"]
    step = "create_bucket" if args.create else "bucket_info"
    try:
        if args.create:
            _, steps["create_bucket_s"] = _timed(lambda: client.create_bucket(args.bucket_id))
        else:
            _, steps["bucket_info_s"] = _timed(lambda: client.bucket_info(args.bucket_id))
        step = "store"
        _, steps["store_s"] = _timed(lambda: client.upload_files(args.bucket_id, list(zip(blobs, paths, strict=True))))
        steps["store_MBps"] = _mbps(total, steps["store_s"])
        step = "lookup"
        infos, steps["lookup_s"] = _timed(lambda: client.get_paths_info(args.bucket_id, paths))
        sizes = {getattr(i, "path", None): getattr(i, "size", None) for i in infos}
        steps["lookup_found"] = sum(1 for p, b in zip(paths, blobs, strict=True) if sizes.get(p) == len(b))
        missing, steps["lookup_missing_s"] = _timed(lambda: client.get_paths_info(args.bucket_id, [f"{folder}/absent"]))
        steps["missing_is_empty"] = list(missing) == []
        step = "load"
        local = [workdir / f"{i}.bin" for i in range(len(paths))]
        _, steps["load_s"] = _timed(lambda: client.download_files(
            args.bucket_id, [(p, str(dst)) for p, dst in zip(paths, local, strict=True)]))
        steps["load_MBps"] = _mbps(total, steps["load_s"])
        steps["load_equal"] = sum(1 for dst, b in zip(local, blobs, strict=True) if dst.exists() and dst.read_bytes() == b)
        step = "list"
        listed, steps["list_s"] = _timed(lambda: client.list_tree(args.bucket_id, folder))
        steps["listed"] = sum(1 for i in listed if getattr(i, "path", None) in set(paths))
        report["ok"] = (steps["lookup_found"] == steps["load_equal"] == steps["listed"] == len(paths)
                        and steps["missing_is_empty"])
    except Exception as exc:  # the Hub's answer is the output (scrubbed of the token by main)
        report.update(failed_step=step, error=f"{type(exc).__name__}: {exc}")
    if "store_s" in steps or step == "store":  # a failed batch may still have written some objects
        if args.keep:
            return report
        try:
            _, steps["delete_s"] = _timed(lambda: client.delete_files(args.bucket_id, paths))
            steps["left_after_delete"] = len(list(client.get_paths_info(args.bucket_id, paths)))
            report["ok"] = report["ok"] and steps["left_after_delete"] == 0
        except Exception as exc:  # reported: the objects stay, the report says where
            steps["delete_error"] = f"{type(exc).__name__}: {exc}"
            report["ok"] = False
    return report


def hf_client(token: str) -> BucketClient:
    """lmcache's own HFBucketClient when lmcache is installed, else the same calls on huggingface_hub."""
    try:
        from lmcache.v1.storage_backend.connector.hfbucket_connector import HFBucketClient

        return HFBucketClient(token=token)
    except ImportError:
        from huggingface_hub import HfApi

        api = HfApi(token=token)

        class _Same:
            create_bucket = staticmethod(lambda b: api.create_bucket(b, exist_ok=True))
            bucket_info = staticmethod(api.bucket_info)
            get_paths_info = staticmethod(lambda b, ps: list(api.get_bucket_paths_info(b, list(ps))) if ps else [])
            list_tree = staticmethod(lambda b, pre: list(api.list_bucket_tree(b, recursive=True, prefix=pre)))
            upload_files = staticmethod(lambda b, add: api.batch_bucket_files(b, add=list(add)))
            download_files = staticmethod(lambda b, fs: api.download_bucket_files(b, files=list(fs)))
            delete_files = staticmethod(lambda b, ds: api.batch_bucket_files(b, delete=list(ds)))

        return _Same()


def main(argv: Sequence[str] | None = None, client_factory: Callable[[str], BucketClient] = hf_client,
         out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    token = os.environ.get(args.token_env, "")
    if not token:
        err.write(f"{args.token_env} is empty: export a token that can write the bucket (see docs/hfbucket-checklist.md)\n")
        return 2
    try:
        client = client_factory(token)
    except Exception as exc:  # e.g. huggingface_hub too old for buckets: said, scrubbed
        err.write(scrub(f"no bucket client: {type(exc).__name__}: {exc}\n", token))
        return 1
    with tempfile.TemporaryDirectory(prefix="hfbucket-roundtrip-") as work:
        report = round_trip(client, args, Path(work))
    out.write(scrub(json.dumps(report, indent=2), token) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
