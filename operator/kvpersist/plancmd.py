"""`kvpersist plan -f FILE` (also `kubectl kvpersist plan`): what applying FILE would do to the
namespace id each KVCacheNamespace in it serves, before it is applied.

It reads the live object (its namespace and name from the file) and its status, and computes the
new id with the operator's own code (spec.pins, identity.resolve). The L2 key's fingerprint, a pin
while L2 is encrypted: when the new spec reads the key from the same Secret and key, the one
status.l2Key records (what the servers use now); from another Secret, that Secret is read, if the
user may (the key itself is never printed or kept: only its fingerprint); otherwise the new id
cannot be named and the plan says on which key it depends. It prints the old id -> the new one
(or unchanged), the fields that moved it (id_fields, the list the pin-change warning compares),
what the old id holds by the last inventory (status.inventory: bytes and objects, the data that
stops being served and stays in L2 as an orphan until `kvpersist gc`, unless another resource
serves the same id) and whether the new id already has data on this resource's L2 (a rollback:
served at once). Nothing is changed.

Exit status: 0 the id stays, 2 it changes (to another id, or the cache turns on or off), 3 the
new id depends on a key this command cannot read, 1 an error (the file, an invalid spec, the API).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpersist.api import v1alpha1 as api
from kvpersist.builders.target import Target
from kvpersist.controller.l2key import KeyRead, held
from kvpersist.identity import resolve
from kvpersist.status.usage import human_bytes
from kvpersist.status.users import recorded

UNCHANGED, CHANGES, UNKNOWN, ERROR = 0, 2, 3, 1


@dataclass
class Plan:
    """One KVCacheNamespace's plan: the id it serves now and the one the new spec names."""

    namespace: str
    name: str
    exists: bool
    old_id: str | None  # status.namespaceId: what its servers serve now
    new_id: str | None
    changed_fields: list[str] = field(default_factory=list)
    # Why the new spec names no id: the cache turns off (a missing pin), or the key cannot be read.
    new_id_reason: str | None = None
    unknown: bool = False  # the new id depends on a key this command could not read
    old_held: tuple[int, int] | None = None  # (bytes, objects) of old_id by the last inventory; None: not measured
    old_hits: str | None = None  # status.hits.summary
    still_used_by: list[str] = field(default_factory=list)  # other resources that serve old_id
    new_held: tuple[int, int] | None = None  # of new_id on this resource's L2; None: not measured or no new id
    stale_status: bool = False  # status describes an older generation than the live spec

    @property
    def moves(self) -> bool:
        return self.unknown or self.old_id != self.new_id

    @property
    def code(self) -> int:
        return UNKNOWN if self.unknown else CHANGES if self.moves else UNCHANGED


def key_source(spec: api.KVCacheNamespaceSpec, name: str, namespace: str) -> tuple[str, str] | None:
    """(Secret, key) the servers would read L2's master key from; None with L2 not encrypted."""
    return Target(name, namespace, spec, None).key_secret


def recorded_fingerprint(live: Mapping[str, Any] | None, new_source: tuple[str, str] | None) -> str | None:
    """The fingerprint status.l2Key records, when the new spec reads the key from the Secret and
    key the live one does (and status records that Secret): what the servers use now."""
    if live is None or new_source is None:
        return None
    try:
        live_spec = api.KVCacheNamespaceSpec.model_validate(live.get("spec") or {})
    except ValueError:
        return None
    meta = live.get("metadata") or {}
    record = recorded(live.get("status"))
    if key_source(live_spec, meta.get("name", ""), meta.get("namespace", "")) != new_source:
        return None
    return record.get("fingerprint") if record.get("secret") == new_source[0] else None


def compute(namespace: str, name: str, new_spec: api.KVCacheNamespaceSpec, live: Mapping[str, Any] | None,
            key: KeyRead | None = None) -> Plan:
    """The plan, pure: the live object as read (None: it does not exist) and the key read from the
    new spec's Secret when status records none for it (None: not read). still_used_by is the
    caller's to fill (it lists other resources)."""
    source = key_source(new_spec, name, namespace)
    fingerprint = recorded_fingerprint(live, source)
    unknown, reason = False, None
    if source is not None and fingerprint is None:
        if key is not None and key.fingerprint is not None:
            fingerprint = key.fingerprint
        else:
            unknown = True
            why = key.problem[1] if key is not None and key.problem else "it was not read"
            reason = (f"the new id depends on L2's key in Secret {source[0]} key {source[1]}, which this command cannot "
                      f"read: {why}")
    resolution = resolve(new_spec.pins(fingerprint))
    new_id = None if unknown else resolution.namespace_id
    if not unknown and new_id is None:
        reason = f"the cache turns off: {resolution.reason}"
    stored_new = new_spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    if live is None:
        return Plan(namespace, name, False, None, new_id, [], reason, unknown)
    status = live.get("status") or {}
    meta = live.get("metadata") or {}
    try:
        stored_old = api.KVCacheNamespaceSpec.model_validate(live.get("spec") or {}).model_dump(
            by_alias=True, exclude_none=True, mode="json")
    except ValueError:
        stored_old = dict(live.get("spec") or {})
    old_id = status.get("namespaceId")
    plan = Plan(namespace, name, True, old_id, new_id, api.changed_id_fields(stored_old, stored_new), reason, unknown,
                old_hits=(status.get("hits") or {}).get("summary"),
                stale_status=status.get("observedGeneration") not in (None, meta.get("generation")))
    if old_id and plan.moves:
        plan.old_held = held(status, old_id)
    if new_id and plan.moves:
        plan.new_held = held(status, new_id)
    return plan


def _amount(amount: tuple[int, int]) -> str:
    return f"{human_bytes(amount[0]) or '0B'} ({amount[0]} bytes) in {amount[1]} objects"


def format_plan(plan: Plan) -> str:
    lines = [f"KVCacheNamespace {plan.namespace}/{plan.name}"]

    def say(label: str, text: str) -> None:
        lines.append(f"  {label + ':':<17} {text}")

    old = plan.old_id or "none (the cache is off)"
    new = plan.new_id or ("unknown" if plan.unknown else "none")
    if not plan.exists:
        say("namespace id", f"{new} (not created yet: nothing is served now, nothing becomes an orphan)")
    elif not plan.moves:
        say("namespace id", f"{old} (unchanged)")
    else:
        say("namespace id", f"{old} -> {new}")
    if plan.new_id_reason:
        say("why", plan.new_id_reason)
    if plan.exists:
        say("changed", ", ".join(plan.changed_fields) or "none of the fields that reach the id")
    if plan.stale_status:
        say("note", "status describes an older generation of the spec: the operator has not caught up; the id it "
                    "serves may move before this is applied")
    if not plan.exists or not plan.moves:
        return "\n".join(lines)
    if plan.old_id:
        hits = f", hit rate {plan.old_hits}" if plan.old_hits else ""
        size = _amount(plan.old_held) if plan.old_held is not None else "its size not measured yet (no inventory)"
        if plan.still_used_by:
            say("stays served", f"{plan.old_id}: {size}{hits}; still served by {', '.join(plan.still_used_by)}")
        else:
            say("orphaned", f"{plan.old_id}: {size}{hits}; no longer served, it stays in L2 as an orphan until "
                            f"`kvpersist gc {plan.old_id}`")
    if plan.new_id:
        if plan.new_held is None:
            say("new id's data", f"{plan.new_id}: not known (no inventory yet)")
        elif plan.new_held[1] > 0:
            say("new id's data", f"{plan.new_id}: {_amount(plan.new_held)} already on this resource's L2: served at "
                                 "once (a rollback)")
        else:
            say("new id's data", f"{plan.new_id}: none on this resource's L2: it starts cold")
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict[str, Any]:
    out = asdict(plan)
    for key in ("old_held", "new_held"):
        out[key] = {"bytes": out[key][0], "objects": out[key][1]} if out[key] is not None else None
    out.update({"moves": plan.moves, "exitCode": plan.code})
    return {_camel(k): v for k, v in out.items()}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)


def exit_code(codes: list[int]) -> int:
    """An error over all; else the id unknown over an id that moves over one that stays."""
    if ERROR in codes:
        return ERROR
    return max(codes, default=UNCHANGED)


# ------------------------------------------------------------------ the command (talks to the API)


def add_parser(sub: Any) -> None:
    cmd = sub.add_parser("plan", help="what applying FILE would do to each KVCacheNamespace's namespace id: old -> new id, "
                         "the fields that move it, the data that becomes an orphan, whether the new id has data",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.add_argument("-f", "--filename", required=True, help="the manifest to be applied (YAML or JSON; - for stdin)")
    cmd.add_argument("-n", "--namespace", help="namespace of objects whose manifest names none (default: the context's)")
    cmd.add_argument("-o", "--output", choices=("table", "json"), default="table")
    cmd.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    cmd.add_argument("--context", default=None, help="kubeconfig context")
    cmd.set_defaults(fn=run)


def _documents(path: str) -> list[dict[str, Any]]:
    """The objects in a manifest (a List's items too); raises OSError or yaml.YAMLError."""
    import yaml

    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    docs = [d for d in yaml.safe_load_all(text) if d]
    out = []
    for d in docs:
        items = d.get("items") if isinstance(d, dict) and d.get("kind", "").endswith("List") else [d]
        out += [i for i in items or [] if isinstance(i, dict)]
    return out


def _context_namespace(kubeconfig: str | None, context: str | None) -> str:
    import kubernetes

    try:
        contexts, active = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)
    except (kubernetes.config.ConfigException, OSError):
        return "default"
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
    return ((chosen or {}).get("context") or {}).get("namespace") or "default"


def _read_key(source: tuple[str, str], namespace: str, generated: bool) -> KeyRead:
    from kubernetes.client.exceptions import ApiException

    from kvpersist.controller import kube, l2key

    try:
        secret = kube.get("v1", "Secret", source[0], namespace)
    except ApiException as exc:
        return l2key.unreadable(source[0], source[1], generated, exc.status)
    return l2key.read(secret, source[0], source[1], namespace, generated, kube.secret_value(secret, source[1]))


def _others_serving(namespace_id: str, namespace: str, name: str) -> list[str]:
    """Other resources that serve namespace_id (cluster-wide when allowed, else this namespace)."""
    from kubernetes.client.exceptions import ApiException

    from kvpersist.controller import kube
    from kvpersist.status.users import users_of

    try:
        every = kube.list_all(api.API_VERSION, api.KIND)
    except ApiException:
        try:
            every = kube.list_all(api.API_VERSION, api.KIND, namespace)
        except ApiException:
            return []
    others = [r for r in every if (r["metadata"]["namespace"], r["metadata"]["name"]) != (namespace, name)]
    return users_of(namespace_id, others, [])


def plan_one(doc: Mapping[str, Any], default_namespace: str) -> Plan:
    """Reads what the plan needs from the API server; raises ValueError for an invalid spec."""
    from pydantic import ValidationError

    from kvpersist.controller import kube

    meta = doc.get("metadata") or {}
    name, namespace = meta.get("name") or "", meta.get("namespace") or default_namespace
    if not name:
        raise ValueError("metadata.name: required")
    try:
        spec = api.KVCacheNamespaceSpec.model_validate(doc.get("spec") or {})
    except ValidationError as exc:
        raise ValueError(api.validation_message(exc)) from exc
    live = kube.get(api.API_VERSION, api.KIND, name, namespace)
    source = key_source(spec, name, namespace)
    key = None
    if source is not None and recorded_fingerprint(live, source) is None:
        key = _read_key(source, namespace, Target(name, namespace, spec, None).key_secret_generated)
    old_id = ((live or {}).get("status") or {}).get("namespaceId")
    plan = compute(namespace, name, spec, live, key)
    if old_id and plan.moves:
        plan.still_used_by = _others_serving(old_id, namespace, name)
    return plan


def run(args: argparse.Namespace) -> int:
    import kubernetes
    import yaml
    from kubernetes.client.exceptions import ApiException

    from kvpersist.controller import kube

    try:
        docs = _documents(args.filename)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        print(f"error: {args.filename}: {exc}", file=sys.stderr)
        return ERROR
    ours = [d for d in docs if d.get("kind") == api.KIND and str(d.get("apiVersion", "")).startswith(api.GROUP + "/")]
    if not ours:
        print(f"error: {args.filename}: no {api.KIND} in it", file=sys.stderr)
        return ERROR
    try:
        kube.load_config(args.kubeconfig, args.context)
    except (kubernetes.config.ConfigException, OSError) as exc:
        print(f"error: no cluster to ask: {exc}", file=sys.stderr)
        return ERROR
    default_namespace = args.namespace or _context_namespace(args.kubeconfig, args.context)
    plans, codes = [], []
    for doc in ours:
        where = f"{(doc.get('metadata') or {}).get('namespace') or default_namespace}/{(doc.get('metadata') or {}).get('name')}"
        try:
            plan = plan_one(doc, default_namespace)
        except ValueError as exc:
            print(f"error: {api.KIND} {where}: {exc}", file=sys.stderr)
            codes.append(ERROR)
            continue
        except ApiException as exc:
            print(f"error: {api.KIND} {where}: the API server answered {exc.status} {exc.reason}", file=sys.stderr)
            codes.append(ERROR)
            continue
        plans.append(plan)
        codes.append(plan.code)
    if args.output == "json":
        print(json.dumps([plan_json(p) for p in plans], indent=2))
    else:
        print("\n\n".join(format_plan(p) for p in plans))
    return exit_code(codes)
