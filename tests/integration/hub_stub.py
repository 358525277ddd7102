"""A local HTTP server standing in for the few Hugging Face Hub bucket routes the operator uses.
The Hub cannot be reached from these machines, so this is a stand-in for the Hub's API shapes, as
huggingface_hub's client sends and parses them (read from its source), not the Hub itself:

- GET  /api/buckets/<owner>/<bucket>                  bucket info (the preflight)
- POST /api/buckets/<owner>/<bucket>                  create the bucket (the preflight)
- GET  /api/buckets/<owner>/<bucket>/tree[/<prefix>]  recursive listing of in-memory objects:
  JSON list of {type: file, path, size, xetHash, mtime, uploadedAt}, the prefix URL-encoded
  and matched as a raw string (as the Hub does), pages of `page_size` chained by a Link
  rel="next" header (the Hub's cursor is opaque; here it is an index)
- POST /api/buckets/<owner>/<bucket>/batch            NDJSON operations; deleteFile removes an
  object; answers {"failed": [{path, error}]} with 200, or 422 when every operation failed

- GET  /<org>/<model>/resolve/<commit>/<file>          a model repository's file (the pin check:
  kvpersist.controller.pincheck), from `models[(repo, commit)][file]`, anonymously as for a
  public model; as the Hub answers: 404 EntryNotFound (no such file at that commit), 404
  RevisionNotFound, 401 RepoNotFound (unknown, or private), 401 GatedRepo (`gated`, without the valid token)

The bucket routes check the bearer token first (401 otherwise). Without `cas_dir`, no upload or
download is possible: addFile/copyFile operations are refused as failures, and the xetHash of
put() objects is a sha256 of the bytes, with no xet storage behind it.

With `cas_dir` the stand-in also serves the routes of the data path, and the bytes go to
xet-core's own local CAS (tests/integration/xet_local_cas.py), never through this server:
- GET  /api/buckets/<owner>/<bucket>/xet-{write,read}-token  the CAS connection: JSON
  {accessToken, exp, casUrl} and the X-Xet-* headers, casUrl `local://<cas_dir>` (what makes
  hf_xet use xet-core's LocalClient instead of the Hub's CAS servers), or `cas_url`
- POST /api/buckets/<owner>/<bucket>/paths-info             {"paths": [...]}: the entries that exist
- POST /api/buckets/<owner>/<bucket>/batch                  addFile {path, xetHash, mtime} recorded
  with the size the CAS's shards give that hash (a hash the CAS lacks fails, as on the Hub)
- HEAD /buckets/<owner>/<bucket>/resolve/<path>             X-Xet-Hash, the read-token route, the size
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote

from tests.integration.xet_local_cas import cas_file_sizes

GOOD_TOKEN = "hf_stub_valid_token_0123456789"


class HubStub:
    """Buckets in `existing`; `token` (GOOD_TOKEN by default) is the only valid token; namespace "readonly-org" refuses
    creation (403); bucket "slow/bucket" answers after `delay` seconds. `objects[bucket][path] = (bytes, mtime)`
    holds what the tree and batch routes list and delete (see put); `batches` records each batch's operations.
    With `cas_dir`, addFile operations land in `xet_files[bucket][path] = (xet hash, size, mtime)`."""

    def __init__(self, existing: set[str] | None = None, delay: float = 30.0, token: str = GOOD_TOKEN,
                 page_size: int = 2, cas_dir: Path | None = None, cas_url: str | None = None) -> None:
        self.existing = set(existing or ())
        self.visibility: dict[str, object] = {}  # bucket id -> the `visibility` its create asked for (None: not sent)
        self.token = token
        self.delay = delay
        self.page_size = page_size
        self.objects: dict[str, dict[str, tuple[bytes, float]]] = {}
        self.batches: list[list[dict]] = []
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        self.seen_tokens: list[str] = []
        self.models: dict[tuple[str, str], dict[str, bytes]] = {}
        self.gated: set[str] = set()
        self.cas_dir = cas_dir
        # The CAS the token routes hand out: hf_xet's in-process LocalClient by default, or the URL
        # of xet-core's local_cas_server serving cas_dir over HTTP (hf_xet's RemoteClient then).
        self.cas_url = cas_url or f"local://{cas_dir}"
        self.refuse_paths: set[str] = set()  # addFile of these fails, as one failed operation of a batch
        self.size_delta = 0  # added to every xet file's size in answers: a Hub at odds with its CAS
        self.xet_files: dict[str, dict[str, tuple[str, int, float]]] = {}
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                return

            def _send(self, code: int, body: dict | list, error_code: str | None = None, link: str | None = None,
                      headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                try:
                    self._write(code, data, body, error_code, link, headers or {})
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client gave up (the preflight's timeout test): nothing to answer

            def _write(self, code: int, data: bytes, body: dict | list, error_code: str | None, link: str | None,
                       headers: dict[str, str]) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                if error_code:
                    self.send_header("X-Error-Code", error_code)
                    self.send_header("X-Error-Message", body.get("error", "") if isinstance(body, dict) else "")
                if link:
                    self.send_header("Link", f'<{link}>; rel="next"')
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _route(self, method: str, body: bytes = b"") -> None:
                stub.requests.append((method, self.path))
                auth = self.headers.get("Authorization", "")
                stub.seen_tokens.append(auth.removeprefix("Bearer "))
                if method == "HEAD" and self.path.startswith("/buckets/") and stub.cas_dir is not None:
                    return self._bucket_resolve(auth)
                if method in ("GET", "HEAD") and "/resolve/" in self.path and not self.path.startswith("/api/"):
                    return self._resolve(unquote(self.path.partition("?")[0]), auth == f"Bearer {stub.token}")
                if not self.path.startswith("/api/buckets/"):
                    return self._send(404, {"error": "not found"})
                route, _, query = self.path.removeprefix("/api/buckets/").partition("?")
                parts = route.strip("/").split("/")
                bid, sub = "/".join(parts[:2]), parts[2:]
                if bid == "slow/bucket":
                    time.sleep(stub.delay)
                if auth != f"Bearer {stub.token}":
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
                if sub:
                    if bid not in stub.existing:
                        return self._send(404, {"error": "Bucket not found"}, "RepoNotFound")
                    if method == "GET" and sub[0] == "tree" and len(sub) <= 2:
                        return self._tree(bid, unquote(sub[1]) if len(sub) == 2 else "", parse_qs(query))
                    if method == "POST" and sub == ["batch"]:
                        return self._batch(bid, body)
                    if stub.cas_dir is not None and method == "GET" and sub in (["xet-write-token"], ["xet-read-token"]):
                        return self._xet_token()
                    if stub.cas_dir is not None and method == "POST" and sub == ["paths-info"]:
                        paths = json.loads(body)["paths"]
                        with stub.lock:
                            return self._send(200, [stub.entry(bid, p) for p in paths if stub.has(bid, p)])
                    return self._send(404, {"error": "not found"})
                if method == "GET":
                    if bid not in stub.existing:
                        return self._send(404, {"error": "Bucket not found"}, "RepoNotFound")
                    return self._send(200, {"id": bid, "private": True, "createdAt": "2026-11-30T00:00:00.000Z",
                                            "size": 0, "totalFiles": 0})
                if bid.startswith("readonly-org/"):
                    return self._send(403, {"error": "You don't have the rights to create a bucket under this namespace"})
                if bid in stub.existing:
                    return self._send(409, {"error": "You already created this bucket"})
                stub.existing.add(bid)
                stub.visibility[bid] = (json.loads(body) if body else {}).get("visibility")
                return self._send(200, {"url": f"http://127.0.0.1:{stub.port}/buckets/{bid}"})

            def _resolve(self, path: str, let_in: bool = False) -> None:
                repo, _, rest = path.strip("/").partition("/resolve/")
                revision, _, filename = rest.partition("/")
                if repo in stub.gated and not let_in:
                    return self._send(401, {"error": "Access to this model is restricted"}, "GatedRepo")
                if not any(r == repo for r, _ in stub.models):
                    return self._send(401, {"error": "Repository not found"}, "RepoNotFound")
                files = stub.models.get((repo, revision))
                if files is None:
                    return self._send(404, {"error": "Invalid rev id"}, "RevisionNotFound")
                if filename not in files:
                    return self._send(404, {"error": "Entry not found"}, "EntryNotFound")
                data = files[filename]
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                # What huggingface_hub's download (`kvpersist pins`) reads from the HEAD first.
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("X-Repo-Commit", revision)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _tree(self, bid: str, prefix: str, query: dict[str, list[str]]) -> None:
                if query.get("recursive", [""])[0].lower() != "true":
                    return self._send(400, {"error": "this stub serves recursive listings only"})
                with stub.lock:
                    held = {*stub.objects.get(bid, {}), *stub.xet_files.get(bid, {})}
                    paths = sorted(p for p in held if p.startswith(prefix))  # a raw string prefix
                    items = [stub.entry(bid, p) for p in paths]
                start = int(query.get("cursor", ["0"])[0])
                end = start + stub.page_size
                link = None
                if end < len(items):
                    link = f"{stub.url}{self.path.split('?')[0]}?recursive=true&cursor={end}"
                return self._send(200, items[start:end], link=link)

            def _batch(self, bid: str, body: bytes) -> None:
                ops = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                failed = []
                sizes = cas_file_sizes(stub.cas_dir) if stub.cas_dir is not None else {}
                with stub.lock:
                    stub.batches.append(ops)
                    held = stub.objects.setdefault(bid, {})
                    xet = stub.xet_files.setdefault(bid, {})
                    for op in ops:
                        path = op.get("path")
                        if op.get("type") == "addFile" and stub.cas_dir is not None:
                            if path in stub.refuse_paths:
                                failed.append({"path": path, "error": "refused by the stand-in"})
                            elif op.get("xetHash") not in sizes:
                                failed.append({"path": path, "error": "xet hash not found in storage"})
                            else:
                                xet[path] = (op["xetHash"], sizes[op["xetHash"]], op.get("mtime", 0) / 1000)
                        elif op.get("type") != "deleteFile":
                            failed.append({"path": path, "error": "this stub stores no uploads"})
                        elif held.pop(path, None) is None and xet.pop(path, None) is None:
                            failed.append({"path": path, "error": "File not found"})
                return self._send(422 if ops and len(failed) == len(ops) else 200, {"failed": failed})

            def _xet_token(self) -> None:
                exp = int(time.time()) + 3600
                cas = stub.cas_url
                return self._send(200, {"accessToken": "xet-stand-in", "exp": exp, "casUrl": cas},
                                  headers={"X-Xet-Cas-Url": cas, "X-Xet-Access-Token": "xet-stand-in",
                                           "X-Xet-Token-Expiration": str(exp)})

            def _bucket_resolve(self, auth: str) -> None:
                route = self.path.partition("?")[0].removeprefix("/buckets/")
                owner, name, _, path = route.split("/", 3)
                bid = f"{owner}/{name}"
                if auth != f"Bearer {stub.token}":
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
                with stub.lock:
                    found = stub.xet_files.get(bid, {}).get(unquote(path))
                if found is None:
                    return self._send(404, {"error": "Entry not found"}, "EntryNotFound")
                return self._send(200, {}, headers={"X-Xet-Hash": found[0], "X-Linked-Size": str(found[1] + stub.size_delta),
                                                    "X-Xet-Refresh-Route": f"{stub.url}/api/buckets/{bid}/xet-read-token"})

            def do_GET(self) -> None:
                self._route("GET")

            def do_HEAD(self) -> None:
                self._route("HEAD")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self._route("POST", self.rfile.read(length))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def put(self, bid: str, path: str, data: bytes, mtime: float) -> None:
        """An object as if uploaded at `mtime` (unix seconds); the bucket then exists."""
        with self.lock:
            self.existing.add(bid)
            self.objects.setdefault(bid, {})[path] = (data, mtime)

    def snapshot(self) -> dict[str, dict[str, tuple[bytes, float]]]:
        with self.lock:
            return {bid: dict(objs) for bid, objs in self.objects.items()}

    def has(self, bid: str, path: str) -> bool:
        return path in self.objects.get(bid, {}) or path in self.xet_files.get(bid, {})

    def entry(self, bid: str, path: str) -> dict:
        """A tree entry in the shape huggingface_hub's BucketFile parses."""
        if path in self.xet_files.get(bid, {}):
            xet_hash, size, mtime = self.xet_files[bid][path]
            size += self.size_delta
        else:
            data, mtime = self.objects[bid][path]
            xet_hash, size = hashlib.sha256(data).hexdigest(), len(data)
        when = datetime.fromtimestamp(mtime, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        return {"type": "file", "path": path, "size": size, "xetHash": xet_hash, "mtime": when, "uploadedAt": when}

    def __enter__(self) -> HubStub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
