"""The operator's own Prometheus metrics, served as text on /metrics (standard library only).

Counts what costs the API server something (applies, status writes, events) so a scrape shows
whether an idle cluster really costs nothing, plus the resources per phase."""

from __future__ import annotations

import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler

from kvpersist.httpserver import BoundedHTTPServer

_lock = threading.Lock()
_counters: Counter[str] = Counter()
_phases: dict[tuple[str, str], str] = {}
_refreshes: Counter[tuple[str, str]] = Counter()

HELP = {
    "kvpersist_reconciles_total": "Reconciles of a KVCacheNamespace (create, spec update, resume).",
    "kvpersist_applies_total": "Objects applied with server-side apply.",
    "kvpersist_apply_errors_total": "Applies the API server refused.",
    "kvpersist_status_refreshes_total": "Status computations (periodic and after reconciles).",
    "kvpersist_status_writes_total": "Status patches written (only when something changed).",
    "kvpersist_events_total": "Kubernetes Events posted.",
}


def inc(name: str, n: int = 1) -> None:
    with _lock:
        _counters[name] += n


def set_phase(namespace: str, name: str, phase: str | None) -> None:
    """A resource's phase; None when it is gone (its series go too)."""
    with _lock:
        if phase is None:
            _phases.pop((namespace, name), None)
            _refreshes.pop((namespace, name), None)
        else:
            _phases[(namespace, name)] = phase


def refreshed(namespace: str, name: str, phase: str | None) -> None:
    """One status refresh of a resource, and the phase it found. Counted per resource too, so a
    scrape (and a test) can tell that a resource had another round, whatever it wrote: a "nothing
    happened" is only shown after the operator had its chance to make it happen."""
    with _lock:
        _counters["kvpersist_status_refreshes_total"] += 1
        _refreshes[(namespace, name)] += 1
    set_phase(namespace, name, phase)


def render() -> str:
    with _lock:
        lines = []
        for name, text in HELP.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} counter", f"{name} {_counters[name]}"]
        lines += ["# HELP kvpersist_resources KVCacheNamespaces by phase.", "# TYPE kvpersist_resources gauge"]
        for phase, count in sorted(Counter(_phases.values()).items()):
            lines.append(f'kvpersist_resources{{phase="{phase}"}} {count}')
        lines += ["# HELP kvpersist_resource_refreshes_total Status refreshes of one KVCacheNamespace (dropped when it is deleted).",
                  "# TYPE kvpersist_resource_refreshes_total counter"]
        for (namespace, name), count in sorted(_refreshes.items()):
            lines.append(f'kvpersist_resource_refreshes_total{{namespace="{namespace}",name="{name}"}} {count}')
    return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path != "/metrics":
            self.send_error(404)
            return
        body = render().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        return


def serve(host: str, port: int) -> BoundedHTTPServer:
    """/metrics on a daemon thread; bounded in connections, threads and time (kvpersist.httpserver):
    a scrape is one short GET, so two workers serve it."""
    server = BoundedHTTPServer((host, port), _Handler, workers=2, queue_size=8, name="metrics")
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
