"""`kvpersist plan -f FILE` (also `kubectl kvpersist plan`): what applying FILE would do to the
namespace id each KVCacheNamespace in it serves, before it is applied.

It reads the live object (its namespace and name from the file) and its status, and computes the
new id with the operator's own code (spec.pins, identity.resolve). The L2 key's fingerprint, a pin
while L2 is encrypted: when the new spec reads the key from the same Secret and key, the one
status.l2Key records (what the servers use now); from another Secret, that Secret is read, if the
user may (the key itself is never printed or kept: only its fingerprint); otherwise the new id
cannot be named and the plan says on which key it depends. It prints the old id -> the new one
(or unchanged), the fields that moved it (id_fields, the list the pin-change warning compares),
what the old id holds (status.usage.l2UsedBytes and l2Objects, the figure the pin-change warning
prints: the data that stops being served and stays in L2 as an orphan until `kvpersist gc`, unless another resource
serves the same id) and whether the new id already has data on this resource's L2 (a rollback:
served at once). Nothing is changed.

It also says what the operator would decide on applying it, by the operator's own decision
(kvpersist.controller.decision.decide) on what this command can read with your credentials: the
policy's refusals (allowedImages and secretLabel as KVPERSIST_ALLOWED_IMAGES and
KVPERSIST_SECRET_LABEL in your environment say them, none by default), an L2 claim under a derived
name it did not make (ClaimNotOwned), a claim or bucket prefix an older resource holds
(StorageInUse: the cache off), a route name another id holds (RouteNameTaken), an object it did not
make under one of its names (NameTaken), with the conditions the operator would write. What it
could not read (no right to) it names, unchecked.

Exit status: 0 the id stays, 2 it changes (to another id, or the cache turns on or off), 3 the
new id depends on a key this command cannot read, 4 the operator would refuse it (nothing
applied) or keep its cache off (StorageInUse), 1 an error (the file, an invalid spec, the API).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kvpersist import admin, cliflags
from kvpersist.api import v1alpha1 as api
from kvpersist.api.identity import changed_id_fields
from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.builders.target import L2_KEY_BYTES, SERVER, Target
from kvpersist.controller import decision as dec
from kvpersist.controller import kube, l2key, ownership, pincheck, sharing
from kvpersist.controller.policy import Policy, named_secrets
from kvpersist.controller.stale_routes import ROUTE_KINDS
from kvpersist.identity import key_fingerprint
from kvpersist.l2backends import backend_of
from kvpersist.pinscmd import hub_error
from kvpersist.status.usage import human_bytes
from kvpersist.status.users import fingerprint_in_status, users_of
from kvpersist.status.workloads import COMPONENT_LABEL, WATCH_SELECTOR

UNCHANGED, CHANGES, UNKNOWN, ERROR, REFUSED = 0, 2, 3, 1, 4


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
    unknown: bool = False  # the new id depends on a key or files this command could not read
    old_held: tuple[int, int] | None = None  # (bytes, objects) of old_id (status.usage); None: not measured
    old_hits: str | None = None  # status.hits.summary
    still_used_by: list[str] = field(default_factory=list)  # other resources that serve old_id
    new_held: tuple[int, int] | None = None  # of new_id on this resource's L2; None: not measured or no new id
    stale_status: bool = False  # status describes an older generation than the live spec
    # What the operator would decide (decide): the reason and message of a refusal (nothing applied),
    # of StorageInUse (the cache off) or RouteNameTaken (vLLM without it); whether it applies at all.
    verdict: str | None = None
    verdict_message: str | None = None
    applied: bool = True
    phase: str | None = None  # status.phase it would write for the verdict
    conditions: list[dict[str, Any]] = field(default_factory=list)  # the conditions it would write for it
    unchecked: list[str] = field(default_factory=list)  # what could not be read with these credentials

    @property
    def moves(self) -> bool:
        return self.unknown or self.old_id != self.new_id

    @property
    def refused(self) -> bool:
        return not self.applied or self.verdict == sharing.STORAGE_IN_USE

    @property
    def code(self) -> int:
        return REFUSED if self.refused else UNKNOWN if self.unknown else CHANGES if self.moves else UNCHANGED


def recorded_fingerprint(live: Mapping[str, Any] | None, new_source: tuple[str, str] | None) -> str | None:
    """The fingerprint status.l2Key records, when the new spec reads the key from the Secret and
    key the live one does (and status records that Secret): what the servers use now."""
    if live is None or new_source is None:
        return None
    try:
        live_spec = KVCacheNamespaceSpec.model_validate(live.get("spec") or {})
    except ValueError:
        return None
    meta = live.get("metadata") or {}
    if Target(meta.get("name", ""), meta.get("namespace", ""), live_spec, None).key_secret != new_source:
        return None
    return fingerprint_in_status(live.get("status"), new_source[0])


def pin_facts(spec: KVCacheNamespaceSpec, live: Mapping[str, Any] | None) -> pincheck.Facts | None:
    """What the operator fills the spec's unset pins from (kvpersist.controller.pincheck): the model's files as the live
    status keeps them, else read with huggingface_hub (its cache, HF_TOKEN, HF_ENDPOINT). None when nothing is unset."""
    key = pincheck.key_of(spec.identity)
    if key is None or not pincheck.unset(spec.identity):
        return None
    at = pincheck.where(key)
    kept = pincheck.recorded((live or {}).get("status"), at)
    if kept is not None:
        return pincheck.Facts(at, kept)
    try:
        derived = pincheck.fetch_derived(pincheck.cache_fetch(token=os.environ.get("HF_TOKEN") or None), *key)
    except pincheck.PinsError as exc:
        return pincheck.Facts(at, unread=str(exc))
    except Exception as exc:  # the Hub refused or is unreachable: which, never the token
        return pincheck.Facts(at, unread=hub_error(exc))
    return pincheck.Facts(at, tuple(pincheck.file_pins(derived).items()))


def compute(namespace: str, name: str, new_spec: KVCacheNamespaceSpec, live: Mapping[str, Any] | None,
            key: l2key.KeyRead | None = None, pins: pincheck.Facts | None = None) -> Plan:
    """The plan, pure: the live object as read (None: it does not exist), the key read from the new spec's Secret (used
    when status records none for it; None: not read) and what fills its unset pins (pin_facts). still_used_by is the
    caller's to fill (it lists other resources)."""
    stored_new = new_spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    source = Target(name, namespace, new_spec, None).key_secret
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
    resolution = dec.target_for(name, namespace, new_spec, fingerprint, pins)[1]  # as the operator resolves it
    unresolved = resolution.blocked is not None and resolution.blocked[0] == pincheck.UNRESOLVED
    if unresolved and pins is not None and pins.values is None:
        files = f"the model's files, which this command could not read: {resolution.reason}"
        reason = f"{reason}; and on {files}" if unknown else f"the new id depends on {files}"
        unknown = True
    new_id = None if unknown else resolution.namespace_id
    if not unknown and new_id is None:
        reason = f"the cache turns off: {resolution.reason}"
    if live is None:
        return Plan(namespace, name, False, None, new_id, [], reason, unknown)
    status = live.get("status") or {}
    meta = live.get("metadata") or {}
    try:
        stored_old = KVCacheNamespaceSpec.model_validate(live.get("spec") or {}).model_dump(
            by_alias=True, exclude_none=True, mode="json")
    except ValueError:
        stored_old = dict(live.get("spec") or {})
    old_id = status.get("namespaceId")
    plan = Plan(namespace, name, True, old_id, new_id, changed_id_fields(stored_old, stored_new), reason, unknown,
                old_hits=(status.get("hits") or {}).get("summary"),
                stale_status=status.get("observedGeneration") not in (None, meta.get("generation")))
    usage = status.get("usage") or {}  # as status.usage shows it, the figure the pin-change warning reads
    if old_id and plan.moves and usage.get("measuredAt") and usage.get("l2UsedBytes") is not None:
        plan.old_held = int(usage["l2UsedBytes"]), int(usage.get("l2Objects") or 0)
    if new_id and plan.moves:
        plan.new_held = l2key.held(status, new_id)
    return plan


def _amount(amount: tuple[int, int]) -> str:
    return f"{human_bytes(amount[0]) or '0B'} ({amount[0]} bytes) in {amount[1]} objects"


def format_plan(plan: Plan, wide: bool = False) -> str:
    """The plan in words; wide adds each condition's message."""
    lines = [f"KVCacheNamespace {plan.namespace}/{plan.name}"]

    def say(label: str, text: str) -> None:
        lines.append(f"  {label + ':':<17} {text}")

    old = plan.old_id or "none (the cache is off)"
    new = plan.new_id or ("unknown" if plan.unknown else "none")
    say("namespace id", f"{new} (not created yet: nothing is served now, nothing becomes an orphan)" if not plan.exists
        else f"{old} (unchanged)" if not plan.moves else f"{old} -> {new}")
    if plan.new_id_reason:
        say("why", plan.new_id_reason)
    if plan.exists:
        say("changed", ", ".join(plan.changed_fields) or "none of the fields that reach the id")
    if plan.stale_status:
        say("note", "status describes an older generation of the spec: the operator has not caught up; the id it "
                    "serves may move before this is applied")
    if plan.verdict is not None:
        how = ("refused, nothing applied" if not plan.applied else "applied with the cache off"
               if plan.verdict == sharing.STORAGE_IN_USE else "applied, vLLM without the cache")
        say("operator", f"{how} ({plan.verdict}): {plan.verdict_message}")
        shown = ", ".join(f"{c['type']}={c['status']} {c['reason']}" for c in plan.conditions)
        say("conditions", shown + (f"; phase {plan.phase}" if plan.phase else ""))
        if wide:
            for c in plan.conditions:
                say(f"  {c['type']}", str(c.get("message") or ""))
    else:
        say("operator", "applies it")
    if plan.unchecked:
        say("unchecked", "not readable with these credentials, so not checked: " + ", ".join(plan.unchecked))
    if not plan.exists or not plan.moves:
        return "\n".join(lines)
    if plan.old_id:
        hits = f", hit rate {plan.old_hits}" if plan.old_hits else ""
        size = _amount(plan.old_held) if plan.old_held is not None else "its size not measured yet"
        if plan.still_used_by:
            say("stays served", f"{plan.old_id}: {size}{hits}; still served by {', '.join(plan.still_used_by)}")
        else:
            say("orphaned", f"{plan.old_id}: {size}{hits}; no longer served, it stays in L2 as an orphan until "
                            f"`kvpersist gc {plan.old_id}`")
    if plan.new_id:
        data = ("not known (no inventory yet)" if plan.new_held is None
                else f"{_amount(plan.new_held)} already on this resource's L2: served at once (a rollback)"
                if plan.new_held[1] > 0 else "none on this resource's L2: it starts cold")
        say("new id's data", f"{plan.new_id}: {data}")
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict[str, Any]:
    out = asdict(plan)
    for key in ("old_held", "new_held"):
        out[key] = {"bytes": out[key][0], "objects": out[key][1]} if out[key] is not None else None
    out.update({"moves": plan.moves, "refused": plan.refused, "exitCode": plan.code})
    return {re.sub(r"_([a-z])", lambda m: m[1].upper(), k): v for k, v in out.items()}  # camelCase, as the API's


def exit_code(codes: list[int]) -> int:
    """An error over all; else a refusal over the id unknown over an id that moves over one that stays."""
    if ERROR in codes:
        return ERROR
    return max(codes, default=UNCHANGED)


# ------------------------------------------------------------------ the command (talks to the API)


def add_parser(sub: Any) -> None:
    cmd = sub.add_parser("plan", help="what applying FILE would do to each KVCacheNamespace's namespace id: old -> new id, "
                         "the fields that move it, the data that becomes an orphan, whether the new id has data",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.add_argument("-f", "--filename", required=True, help="the manifest to be applied (YAML or JSON; - for stdin)")
    cliflags.add_output_flag(cmd)
    # -n: for objects whose manifest names no namespace (one file: no -A).
    cliflags.add_cluster_flags(cmd, all_namespaces=False)
    cmd.set_defaults(fn=run)


def _read_key(target: Target) -> l2key.KeyRead:
    """The key Secret read with the user's credentials and judged as the operator judges it (ownership.judged_key)."""
    assert target.key_secret is not None
    try:
        secret = kube.get("v1", "Secret", target.key_secret[0], target.namespace)
    except ApiException as exc:
        return l2key.unreadable(*target.key_secret, target.key_secret_generated, exc.status)
    return ownership.judged_key(target, secret)


def _others_serving(namespace_id: str, namespace: str, name: str) -> list[str]:
    """Other resources that serve namespace_id (cluster-wide when allowed, else this namespace)."""
    try:
        every = kube.list_all(api.API_VERSION, api.KIND)
    except ApiException:
        try:
            every = kube.list_all(api.API_VERSION, api.KIND, namespace)
        except ApiException:
            return []
    others = [r for r in every if (r["metadata"]["namespace"], r["metadata"]["name"]) != (namespace, name)]
    return users_of(namespace_id, others, [])


def _readable(unchecked: list[str], what: str, default: Any, read: Any, *args: Any) -> Any:
    """read(*args), or default when these credentials may not (401/403: what is then said unchecked)."""
    try:
        return read(*args)
    except ApiException as exc:
        if exc.status not in (401, 403):
            raise
        unchecked.append(what)
        return default


def read_snapshot(doc: Mapping[str, Any], spec: KVCacheNamespaceSpec, live: Mapping[str, Any] | None, namespace: str,
                  key: l2key.KeyRead | None, pins: pincheck.Facts | None = None) -> tuple[dec.Snapshot, list[str]]:
    """What the operator's decide looks at, read with the user's credentials in the operator's order
    (kvpersist.controller.snapshot): the new spec on the live object's metadata and status. A generated key not made
    yet is offered a random one, as the operator makes it (only what decide concludes of its id is shown). Raises
    ApiException, and ValueError for a malformed KVPERSIST_ALLOWED_IMAGES or KVPERSIST_SECRET_LABEL."""
    unchecked: list[str] = []
    meta = (live or {}).get("metadata") or {}
    name = (doc.get("metadata") or {}).get("name") or ""
    body = {"apiVersion": api.API_VERSION, "kind": api.KIND, "spec": doc.get("spec") or {}, "status": (live or {}).get("status"),
            "metadata": {"name": name, "namespace": namespace, "uid": meta.get("uid"), "generation": meta.get("generation"),
                         "creationTimestamp": meta.get("creationTimestamp"),
                         "annotations": (doc.get("metadata") or {}).get("annotations") or meta.get("annotations")}}
    snap = dec.Snapshot(body=body, spec=spec, policy=Policy.from_env(os.environ), pins=pins)
    if snap.policy.secret_label is not None:
        labels = {n: _readable(unchecked, f"Secret {n}", None, kube.get_metadata, "v1", "Secret", n, namespace)
                  for _field, n in named_secrets(spec)}
        snap = replace(snap, named_secrets=labels)

    def claims(base: Target) -> dict[str, Any]:
        return {n: _readable(unchecked, f"PersistentVolumeClaim {n}", None, kube.get, "v1", "PersistentVolumeClaim", n,
                             namespace) for n in ownership.l2_claim_names(base)}

    def key_read(snap: dec.Snapshot, _base: Target) -> dec.Snapshot:
        offered = key_fingerprint(secrets.token_bytes(L2_KEY_BYTES)) if key is not None and key.absent and key.generated \
            else None
        return replace(snap, key=key, proposed_key=offered)

    def stores(_target: Target) -> tuple[tuple[sharing.User, ...], tuple[Any, ...]]:
        if backend_of(spec.l2).namespaced:
            bodies = _readable(unchecked, f"KVCacheNamespaces in {namespace}", [], kube.list_all, api.API_VERSION, api.KIND,
                               namespace)
            pods = _readable(unchecked, f"lmcache server pods in {namespace}", [], kube.list_all, "v1", "Pod", namespace,
                             f"{WATCH_SELECTOR},{COMPONENT_LABEL}={SERVER}")
        else:
            bodies = _readable([], "", None, kube.list_all, api.API_VERSION, api.KIND)
            if bodies is None:
                bodies = _readable(unchecked, "KVCacheNamespaces of other namespaces", [], kube.list_all, api.API_VERSION,
                                   api.KIND, namespace)
            pods = []
        return tuple(u for b in bodies if (u := sharing.user_of(b)) is not None), tuple(pods)

    def names(snap: dec.Snapshot) -> dec.Snapshot:
        routes = {k: v for k, (v, _kind) in zip(dec.route_keys(dec.written_target(snap)), ROUTE_KINDS, strict=False)}
        found: dict[Any, Any] = {}
        whole = None
        for _round in range(2):  # again for what another id's route names make decide write in their place
            manifests, token = dec.names_to_read(replace(snap, names=found))
            wanted = {dec.child_key(m): m["apiVersion"] for m in [*manifests, token]} | routes
            for (kind, ns, obj_name), api_version in wanted.items():
                if (kind, ns, obj_name) in found:
                    continue
                weights = kind == "PersistentVolumeClaim"  # the weights claim: whole (its spec is compared)
                got = _readable(unchecked, f"{kind} {obj_name}", False, kube.get if weights else kube.get_metadata,
                                api_version, kind, obj_name, namespace)
                if got is False:
                    continue
                if weights:
                    whole, got = got, dict(got.get("metadata") or {}) if got is not None else None
                found[kind, ns, obj_name] = got
        shared = spec.l2.nvme.existing_claim_name if spec.l2.nvme is not None and spec.l2.nvme.shared else None
        claim = _readable(unchecked, f"PersistentVolumeClaim {shared}", None, kube.get, "v1", "PersistentVolumeClaim",
                          shared, namespace) if shared else None
        return replace(snap, names=found, model_cache_claim=whole, named_claim=claim)

    return dec.staged(snap, dec.Reads(claims, key_read, stores, names)), unchecked


def plan_one(doc: Mapping[str, Any], default_namespace: str) -> Plan:
    """Reads what the plan needs from the API server; raises ValueError for an invalid spec."""
    meta = doc.get("metadata") or {}
    name, namespace = meta.get("name") or "", meta.get("namespace") or default_namespace
    if not name:
        raise ValueError("metadata.name: required")
    try:
        spec = KVCacheNamespaceSpec.model_validate(doc.get("spec") or {})
    except ValidationError as exc:
        raise ValueError(api.validation_message(exc)) from exc
    live = kube.get(api.API_VERSION, api.KIND, name, namespace)
    base = Target(name, namespace, spec, None)
    source = base.key_secret
    recorded_fp = recorded_fingerprint(live, source)
    # The key as status records it where the new spec reads the same Secret (the servers use it
    # now), else as read now: what compute names the id with and the operator's decide judges.
    key = (None if source is None else _read_key(base) if recorded_fp is None
           else l2key.KeyRead(source[0], source[1], base.key_secret_generated, fingerprint=recorded_fp))
    pins = pin_facts(spec, live)
    plan = compute(namespace, name, spec, live, key, pins)
    if plan.old_id and plan.moves:
        plan.still_used_by = _others_serving(plan.old_id, namespace, name)
    snap, unchecked = read_snapshot(doc, spec, live, namespace, key, pins)
    # What the operator would decide: the refusal (nothing applied), else StorageInUse or
    # RouteNameTaken (applied with the cache off, or vLLM without it), with their conditions.
    decision = dec.decide(snap)
    if decision.refusal is not None:
        plan.verdict, plan.verdict_message = decision.refusal
        plan.applied = False
    elif decision.storage_refused is not None:
        plan.verdict, plan.verdict_message = sharing.STORAGE_IN_USE, decision.storage_refused
    elif decision.route_taken is not None:
        plan.verdict, plan.verdict_message = decision.conditions[0]["reason"], decision.route_taken
    if plan.verdict is not None:
        plan.phase = decision.phase
        plan.conditions = [{k: c[k] for k in ("type", "status", "reason", "message")} for c in decision.conditions]
    plan.unchecked = sorted(set(unchecked) | {"/".join(k) for k in decision.unchecked})
    return plan


def run(args: argparse.Namespace) -> int:
    try:
        text = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text(encoding="utf-8")
        found = [d for d in yaml.safe_load_all(text) if d]
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        print(f"error: {args.filename}: {exc}", file=sys.stderr)
        return ERROR
    # The objects in the manifest, a List's items too.
    lists = [d.get("items") if isinstance(d, dict) and d.get("kind", "").endswith("List") else [d] for d in found]
    docs = [i for items in lists for i in items or [] if isinstance(i, dict)]
    ours = [d for d in docs if d.get("kind") == api.KIND and str(d.get("apiVersion", "")).startswith(api.GROUP + "/")]
    if not ours:
        print(f"error: {args.filename}: no {api.KIND} in it", file=sys.stderr)
        return ERROR
    try:
        kube.load_config(args.kubeconfig, args.context)
    except (kubernetes.config.ConfigException, OSError) as exc:
        print(admin.cluster_problem(exc), file=sys.stderr)
        return ERROR
    default_namespace = cliflags.namespace_of(args) or "default"
    plans, errors = [], 0
    for doc in ours:
        try:
            plans.append(plan_one(doc, default_namespace))
        except (ValueError, ApiException) as exc:
            meta = doc.get("metadata") or {}
            why = f"the API server answered {exc.status} {exc.reason}" if isinstance(exc, ApiException) else exc
            print(f"error: {api.KIND} {meta.get('namespace') or default_namespace}/{meta.get('name')}: {why}", file=sys.stderr)
            errors += 1
    print(cliflags.emit(args.output, [plan_json(p) for p in plans],
                        lambda wide: "\n\n".join(format_plan(p, wide) for p in plans), admin.kubectl_name))
    return exit_code([ERROR] * errors + [p.code for p in plans])
