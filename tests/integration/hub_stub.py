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

Every route checks the bearer token first (401 otherwise). No upload or download is faked:
addFile/copyFile operations are refused as failures, there is no xet storage behind the
xetHash (a sha256 of the bytes here, not a real xet hash), and the data path never talks to it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote

GOOD_TOKEN = "hf_stub_valid_token_0123456789"


class HubStub:
    """Buckets in `existing`; `token` (GOOD_TOKEN by default) is the only valid token; namespace "readonly-org" refuses
    creation (403); bucket "slow/bucket" answers after `delay` seconds. `objects[bucket][path] = (bytes, mtime)`
    holds what the tree and batch routes list and delete (see put); `batches` records each batch's operations."""

    def __init__(self, existing: set[str] | None = None, delay: float = 30.0, token: str = GOOD_TOKEN,
                 page_size: int = 2) -> None:
        self.existing = set(existing or ())
        self.token = token
        self.delay = delay
        self.page_size = page_size
        self.objects: dict[str, dict[str, tuple[bytes, float]]] = {}
        self.batches: list[list[dict]] = []
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        self.seen_tokens: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                return

            def _send(self, code: int, body: dict | list, error_code: str | None = None, link: str | None = None) -> None:
                data = json.dumps(body).encode()
                try:
                    self._write(code, data, body, error_code, link)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client gave up (the preflight's timeout test): nothing to answer

            def _write(self, code: int, data: bytes, body: dict | list, error_code: str | None, link: str | None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if error_code:
                    self.send_header("X-Error-Code", error_code)
                    self.send_header("X-Error-Message", body.get("error", "") if isinstance(body, dict) else "")
                if link:
                    self.send_header("Link", f'<{link}>; rel="next"')
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str, body: bytes = b"") -> None:
                stub.requests.append((method, self.path))
                auth = self.headers.get("Authorization", "")
                stub.seen_tokens.append(auth.removeprefix("Bearer "))
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
                return self._send(200, {"url": f"http://127.0.0.1:{stub.port}/buckets/{bid}"})

            def _tree(self, bid: str, prefix: str, query: dict[str, list[str]]) -> None:
                if query.get("recursive", [""])[0].lower() != "true":
                    return self._send(400, {"error": "this stub serves recursive listings only"})
                with stub.lock:
                    paths = sorted(p for p in stub.objects.get(bid, {}) if p.startswith(prefix))  # a raw string prefix
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
                with stub.lock:
                    stub.batches.append(ops)
                    held = stub.objects.setdefault(bid, {})
                    for op in ops:
                        if op.get("type") != "deleteFile":
                            failed.append({"path": op.get("path"), "error": "this stub stores no uploads"})
                        elif held.pop(op.get("path"), None) is None:
                            failed.append({"path": op.get("path"), "error": "File not found"})
                return self._send(422 if ops and len(failed) == len(ops) else 200, {"failed": failed})

            def do_GET(self) -> None:
                self._route("GET")

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

    def entry(self, bid: str, path: str) -> dict:
        """A tree entry in the shape huggingface_hub's BucketFile parses."""
        data, mtime = self.objects[bid][path]
        when = datetime.fromtimestamp(mtime, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        return {"type": "file", "path": path, "size": len(data), "xetHash": hashlib.sha256(data).hexdigest(),
                "mtime": when, "uploadedAt": when}

    def __enter__(self) -> HubStub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
