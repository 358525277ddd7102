"""A local HTTP server that answers the few Hugging Face Hub bucket routes the operator's
preflight uses, the way the Hub does for each case. A stand-in for error handling ONLY, labelled
as such: no upload or download is faked, and the data path never talks to it."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

GOOD_TOKEN = "hf_stub_valid_token_0123456789"


class HubStub:
    """Buckets in `existing`; `token` (GOOD_TOKEN by default) is the only valid token; namespace "readonly-org" refuses
    creation (403); bucket "slow/bucket" answers after `delay` seconds."""

    def __init__(self, existing: set[str] | None = None, delay: float = 30.0, token: str = GOOD_TOKEN) -> None:
        self.existing = set(existing or ())
        self.token = token
        self.delay = delay
        self.requests: list[tuple[str, str]] = []
        self.seen_tokens: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                return

            def _send(self, code: int, body: dict, error_code: str | None = None) -> None:
                data = json.dumps(body).encode()
                try:
                    self._write(code, data, body, error_code)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client gave up (the preflight's timeout test): nothing to answer

            def _write(self, code: int, data: bytes, body: dict, error_code: str | None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if error_code:
                    self.send_header("X-Error-Code", error_code)
                    self.send_header("X-Error-Message", body.get("error", ""))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str) -> None:
                stub.requests.append((method, self.path))
                auth = self.headers.get("Authorization", "")
                stub.seen_tokens.append(auth.removeprefix("Bearer "))
                if not self.path.startswith("/api/buckets/"):
                    return self._send(404, {"error": "not found"})
                bid = self.path.removeprefix("/api/buckets/").split("?")[0].strip("/")
                if bid == "slow/bucket":
                    time.sleep(stub.delay)
                if auth != f"Bearer {stub.token}":
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
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

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                self._route("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubStub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
