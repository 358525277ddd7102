"""`kvpersist status | report | gc` (also `kubectl kvpersist ...`), with kubectl's -n, -A and -o (kvpersist.cliflags).

Everything comes from the resources' status on the API server. `gc` never deletes by itself: it asks
the operator (annotation kvpersist.dev/gc-request), which refuses any namespace still in use and
records the outcome in status.gc and an Event. Dry run unless --no-dry-run.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from kvpersist import cliflags
from kvpersist.api import v1alpha1 as api
from kvpersist.controller import kube
from kvpersist.inventory.cleanup import GC_ANNOTATION, bucket_refusal
from kvpersist.inventory.volume import NAMESPACE_ID_RE, parse_iso
from kvpersist.status.usage import human_bytes
from kvpersist.status.users import ref as _ref
from kvpersist.status.users import resolved_id, users_of
from kvpersist.status.workloads import live_ids

SERVER_SELECTOR = "app.kubernetes.io/component=lmcache-server,app.kubernetes.io/managed-by=kvpersist"
# The chart's operator Deployment carries these labels (charts/kvpersist/templates/_helpers.tpl).
OPERATOR_SELECTOR = "app.kubernetes.io/name=kvpersist-operator"


def cluster_problem(exc: BaseException) -> str | None:
    """One line for an error on the way to the API server (no kubeconfig, no answer, a refusal; urllib3 is the client's
    transport), naming the fix (no traceback); None for any other error."""
    if isinstance(exc, kubernetes.client.exceptions.ApiException):
        return f"error: the API server answered {exc.status} {exc.reason}"
    if isinstance(exc, kubernetes.config.ConfigException):
        return (f"error: no cluster to ask ({str(exc).strip() or type(exc).__name__}): set KUBECONFIG or --kubeconfig "
                "to a kubeconfig file, or --context to one of its contexts")
    if not isinstance(exc, OSError) and type(exc).__module__.split(".")[0] != "urllib3":
        return None
    first = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"error: {type(exc).__name__}: {first} (is the API server of the kubeconfig's context reachable?)"


def operator_versions(kubeconfig: str | None, context: str | None) -> tuple[list[dict[str, str]], str | None]:
    """(the operator Deployments: namespace, name, chart appVersion, image; why none could be read, or None)."""
    try:
        kube.load_config(kubeconfig, context)
        found = kubernetes.client.AppsV1Api().list_deployment_for_all_namespaces(
            label_selector=OPERATOR_SELECTOR, _request_timeout=10)
    except Exception as exc:
        if (problem := cluster_problem(exc)) is None:
            raise
        return [], problem.removeprefix("error: ")  # the client's own version still prints
    return [{"namespace": d.metadata.namespace, "name": d.metadata.name,
             "version": (d.metadata.labels or {}).get("app.kubernetes.io/version", "unknown"),
             "image": d.spec.template.spec.containers[0].image} for d in found.items], None


@dataclass
class Row:
    """One namespace on one volume or bucket, as `report` prints it."""

    location: str
    resource: str
    namespace_id: str
    bytes: int
    objects: int
    last_write: str | None
    orphan: bool
    current: bool
    budget_bytes: int | None = None


def report_rows(resources: Iterable[Mapping[str, Any]], live: frozenset[str]) -> list[Row]:
    """Rows from every resource's status.inventory, orphans re-judged against what is live now; a volume shared by
    several resources (one existing claim) is listed once. Orphans first: the one whose deletion frees most at the top,
    then the longest unwritten; in-use namespaces after them, largest first."""
    rows: dict[tuple[str, str], Row] = {}
    for r in resources:
        status = r.get("status") or {}
        current = status.get("namespaceId")
        budget = (status.get("budget") or {}).get("bytes")
        for vol in (status.get("inventory") or {}).get("volumes") or []:
            where = vol["location"] if vol["location"].startswith("hf://") else f"{r['metadata']['namespace']}/{vol['location']}"
            for n in vol.get("namespaces") or []:
                key = (where, n["namespaceId"])
                row = Row(where, _ref(r), n["namespaceId"], int(n.get("bytes") or 0), int(n.get("objects") or 0), n.get("lastWrite"),
                          n["namespaceId"] not in live, n["namespaceId"] == current, budget if n["namespaceId"] == current else None)
                if key not in rows or row.current:
                    rows[key] = row
    return sorted(rows.values(), key=lambda r: (not r.orphan, -r.bytes, parse_iso(r.last_write) or 0.0, r.location, r.namespace_id))


def _ago(stamp: str | None, now: float) -> str:
    if not stamp:
        return "-"
    s = max(0, int(now - (parse_iso(stamp) or 0.0)))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=False)).rstrip() for line in [header, *rows])


def format_report(rows: list[Row], now: float, wide: bool = False) -> str:
    """The report's table; wide adds each last write's own time stamp."""
    header = ["LOCATION", "NAMESPACE-ID", "BYTES", "SIZE", "OBJECTS", "LAST-WRITE", "STATE", "BUDGET", "RESOURCE"]
    header += ["LAST-WRITE-AT"] if wide else []
    body = [[r.location, r.namespace_id, str(r.bytes), human_bytes(r.bytes) or "0B", str(r.objects), _ago(r.last_write, now),
             "orphan" if r.orphan else ("current" if r.current else "in use"),
             human_bytes(r.budget_bytes) if r.budget_bytes else "-", r.resource]
            + ([r.last_write or "-"] if wide else []) for r in rows]
    return table(header, body)


def format_status(resources: Iterable[Mapping[str, Any]], wide: bool = False) -> str:
    """The status table; wide adds Ready's reason, the vLLM replicas and the hit rate."""
    header = ["NAMESPACE", "NAME", "PHASE", "NAMESPACE-ID", "L1", "L2", "SERVERS", "ORPHANED", "BUDGET"]
    header += ["REASON", "VLLM", "HIT"] if wide else []
    body = []
    for r in sorted(resources, key=_ref):
        st = r.get("status") or {}
        usage, inv, budget = st.get("usage") or {}, st.get("inventory") or {}, st.get("budget") or {}
        servers = st.get("servers") or []
        row = [r["metadata"]["namespace"], r["metadata"]["name"], st.get("phase") or "-", st.get("namespaceId") or "-",
               usage.get("l1Used") or "-", usage.get("l2Used") or "-",
               f"{sum(1 for s in servers if s.get('healthy'))}/{len(servers)} healthy",
               f"{inv.get('orphanedNamespaces', 0)} ({human_bytes(inv.get('orphanedBytes', 0)) or '0B'})" if inv else "-",
               budget.get("state") or "-"]
        if wide:
            ready = next((c for c in st.get("conditions") or [] if isinstance(c, Mapping) and c.get("type") == "Ready"), {})
            row += [ready.get("reason") or "-", str(st.get("replicas") or "-"), (st.get("hits") or {}).get("summary") or "-"]
        body.append(row)
    return table(header, body)


# ------------------------------------------------------------------ commands (talk to the API)


def _live(resources: list[dict[str, Any]], namespace: str | None
          ) -> tuple[frozenset[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """Live ids over the whole cluster when allowed (a namespace elsewhere may share the volume)."""
    try:
        every = kube.list_all(api.API_VERSION, api.KIND) if namespace else resources
        pods = kube.list_all("v1", "Pod", None, SERVER_SELECTOR)
    except ApiException:
        every, pods = resources, kube.list_all("v1", "Pod", namespace, SERVER_SELECTOR)
    return live_ids(every, [resolved_id(r) for r in every], pods), every, pods


def kubectl_name(item: Mapping[str, Any]) -> str:
    """What `kubectl get -o name` prints for the resource an output item names."""
    return f"{api.KIND.lower()}.{api.GROUP}/{item['name']}"


def cmd_status(namespace: str | None, output: str) -> int:
    """-o table|wide: format_status; json|yaml|jsonpath: each resource's namespace, name and status; name."""
    resources = kube.list_all(api.API_VERSION, api.KIND, namespace)
    data = [{"namespace": r["metadata"]["namespace"], "name": r["metadata"]["name"], **(r.get("status") or {})}
            for r in resources]
    if output in ("table", "wide") and not resources:
        print("No KVCacheNamespaces found.")
    elif text := cliflags.emit(output, data, lambda wide: format_status(resources, wide), kubectl_name):
        print(text)  # -o name or jsonpath with nothing to print: no blank line, as kubectl
    return 0


def cmd_report(namespace: str | None, output: str) -> int:
    """-o table|wide: format_report and the first orphan to reclaim; json|yaml|jsonpath: the rows; name: their ids
    (what `kvpersist gc` takes)."""
    resources = kube.list_all(api.API_VERSION, api.KIND, namespace)
    live, _, _ = _live(resources, namespace)
    rows = report_rows(resources, live)
    table = output in ("table", "wide")
    if table and not rows:
        print("No inventory yet: the operator reports one within a minute of a server starting.")
    elif text := cliflags.emit(output, [r.__dict__ for r in rows], lambda wide: format_report(rows, time.time(), wide),
                               lambda row: row["namespace_id"]):
        print(text)  # -o name or jsonpath with nothing to print: no blank line, as cmd_status and kubectl
        orphans = [r for r in rows if r.orphan]
        if table and orphans:
            print(f"\n{len(orphans)} orphaned namespace(s), {human_bytes(sum(r.bytes for r in orphans)) or '0B'} reclaimable. "
                  f"First to delete: kvpersist gc {orphans[0].namespace_id} --no-dry-run")
    return 0


def cmd_gc(namespace_id: str, namespace: str | None, dry_run: bool, timeout: float) -> int:
    """Exit 0 deleted (or dry run), 1 no data or not deleted, 2 malformed id, 3 refused (in use, or
    a bucket not marked exclusive), 4 the API server refused the request (no gc permission)."""
    if not NAMESPACE_ID_RE.fullmatch(namespace_id):
        print(f"error: {namespace_id!r} is not a namespace id (kvp-<32 hex>); `kvpersist report` lists them", file=sys.stderr)
        return 2
    resources = kube.list_all(api.API_VERSION, api.KIND, namespace)
    live, every, pods = _live(resources, namespace)
    if namespace_id in live:
        print(f"refused: {namespace_id} is in use by {', '.join(users_of(namespace_id, every, pods))}; only orphaned "
              "namespaces can be deleted", file=sys.stderr)
        return 3
    holders = [r for r in report_rows(resources, live) if r.namespace_id == namespace_id]
    if not holders:
        print(f"{namespace_id}: no data in any volume or bucket the operator reports (`kvpersist report`)", file=sys.stderr)
        return 1
    shared = [h for h in holders if h.location.startswith("hf://") and not _exclusive_bucket(resources, h.resource)]
    if shared:
        for h in shared:
            print(f"refused: {h.resource}: {bucket_refusal(h.location, False)}", file=sys.stderr)
        return 3
    for h in holders:
        verb = "would delete" if dry_run else "deleting"
        print(f"{verb} {namespace_id} from {h.location}: {h.bytes} bytes ({human_bytes(h.bytes) or '0B'}) in {h.objects} objects")
    if dry_run:
        print("dry run: nothing deleted; add --no-dry-run to delete")
        return 0
    failed = 0
    for ref in dict.fromkeys(h.resource for h in holders):  # a resource once, however many of its volumes hold it
        ns, name = ref.split("/", 1)
        request = str(uuid.uuid4())
        try:
            kube.patch_metadata(api.API_VERSION, api.KIND, name, ns, {"metadata": {"annotations": {
                GC_ANNOTATION: json.dumps({"requestId": request, "namespaceId": namespace_id})}}})
        except ApiException as exc:
            if exc.status not in (401, 403):
                raise
            print(f"{ref}: not allowed to request gc: {_api_message(exc)}", file=sys.stderr)
            return 4
        outcome = _wait_gc(ns, name, request, timeout)
        if outcome is None:
            print(f"{ref}: no answer from the operator within {timeout:.0f}s; the request stays on the resource "
                  f"(annotation {GC_ANNOTATION}) and runs when the operator does", file=sys.stderr)
            failed += 1
            continue
        print(f"{ref}: {outcome['outcome']}: {outcome.get('message', '')}")
        failed += outcome["outcome"] != "Deleted"
    return 1 if failed else 0


def _exclusive_bucket(resources: Iterable[Mapping[str, Any]], ref: str) -> bool:
    """Whether the resource ref (ns/name) marks its bucket spec.l2.hfBucket.exclusiveToThisCluster."""
    obj = next((r for r in resources if _ref(r) == ref), None)
    bucket = (((obj or {}).get("spec") or {}).get("l2") or {}).get("hfBucket") or {}
    return bucket.get("exclusiveToThisCluster") is True


def _api_message(exc: Any) -> str:
    """The API server's own words (a ValidatingAdmissionPolicy's message names the permission)."""
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return f"the API server answered {exc.status} {exc.reason}"


def _wait_gc(ns: str, name: str, request: str, timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = kube.get(api.API_VERSION, api.KIND, name, ns)
        gc = ((obj or {}).get("status") or {}).get("gc") or {}
        if gc.get("requestId") == request:
            return gc
        time.sleep(1.0)
    return None
