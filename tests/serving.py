"""A test HTTP server on a thread of its own, stopped and joined however the test ends."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def in_thread(server: socketserver.BaseServer) -> Iterator[int]:
    """Serves server until the block ends; yields its port."""
    thread = threading.Thread(target=server.serve_forever, name="test-server", daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
