"""The operator's side of the inventory agent (kvpersist.agent): bounded HTTP calls."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from kvpersist.inventory import Inventory

TIMEOUT_S = 2.0  # as for /status: a refresh must not hang on one pod
GC_TIMEOUT_S = 120.0  # deleting a big namespace folder takes a while


def fetch_inventory(ip: str, port: int, timeout: float = TIMEOUT_S) -> Inventory | None:
    """The agent's last scan of its volume; None when it does not answer (status keeps the last)."""
    try:
        with urllib.request.urlopen(f"http://{ip}:{port}/inventory", timeout=timeout) as resp:
            return Inventory.from_json(json.loads(resp.read()))
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return None


def request_gc(ip: str, port: int, namespace_id: str, dry_run: bool, timeout: float = GC_TIMEOUT_S) -> tuple[int, dict[str, Any]]:
    """(HTTP code, body) of the agent's /gc; code 0 when it could not be reached."""
    body = json.dumps({"namespaceId": namespace_id, "dryRun": dry_run}).encode()
    req = urllib.request.Request(f"http://{ip}:{port}/gc", data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {"error": str(exc)}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return 0, {"error": f"agent at {ip}:{port} unreachable: {getattr(exc, 'reason', exc)}"}
