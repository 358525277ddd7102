"""L2's master key as the namespace id sees it (named by its fingerprint), and what to do when it changes or goes.

Objects sealed under one key fail authentication under another: misses, forever. So the key is part of
the identity (pin l2_key_fingerprint): another key is another namespace, and the old one's data stays,
an orphan (readable again if that key comes back). A key that cannot be read names no namespace: the
cache is off. The operator never generates a new key over data sealed under a lost one: the cache stays
off until the user restores the Secret or accepts the loss (REPLACE_ANNOTATION). Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from kvpersist.builders.retained import KEY_FINGERPRINT_ANNOTATION, PROTECTED_ANNOTATIONS
from kvpersist.builders.target import L2_KEY_BYTES
from kvpersist.identity import key_fingerprint
from kvpersist.inventory.volume import served_of
from kvpersist.status.usage import human_bytes
from kvpersist.status.users import KEY_LOST, fingerprint_in_status, recorded  # noqa: F401  (fingerprint_in_status: read as l2key's)

# Set by the user to accept that the data under the named key is lost: its value is that key's
# fingerprint, so it never covers a later loss of another key.
REPLACE_ANNOTATION = "kvpersist.dev/replace-l2-key"

# Reasons of IdentityResolved and L2Ready (both False, the cache off) when the key cannot be used.
KEY_NOT_FOUND = "KeySecretNotFound"
KEY_MISSING = "KeySecretKeyMissing"
KEY_TOO_SHORT = "KeyTooShort"
KEY_UNREADABLE = "KeySecretUnreadable"
KEY_PENDING = "L2KeyPending"  # the generated Secret does not exist yet: the next apply makes it
# KEY_LOST (L2KeyLost): the generated Secret is gone and data sealed under it exists: not made again
KEY_NOT_OWNED = "KeySecretNotOwned"  # <name>-l2-key exists but is not the operator's: never used, never replaced
KeyReason = Literal["KeySecretNotFound", "KeySecretKeyMissing", "KeyTooShort", "KeySecretUnreadable", "L2KeyPending",
                    "L2KeyLost", "KeySecretNotOwned"]
KEY_REASONS: tuple[KeyReason, ...] = get_args(KeyReason)
# Events.
KEY_CHANGED = "L2KeyChanged"  # Warning: another key, so another namespace; the old data is an orphan
KEY_REPLACED = "L2KeyReplaced"  # Normal: a new key after the user accepted the loss (REPLACE_ANNOTATION)


@dataclass(frozen=True)
class KeyRead:
    """One read of the key Secret the servers mount: its fingerprint, or why it cannot serve."""

    secret: str
    item: str
    generated: bool  # the operator's own <name>-l2-key
    fingerprint: str | None = None
    problem: tuple[str, str] | None = None  # (reason, message)
    absent: bool = False  # the Secret does not exist
    # The Secret's labels and the prune-related annotations, as read: nothing else of its metadata
    # (kubectl's last-applied annotation of a Secret holds its data, the key).
    metadata: Mapping[str, Any] | None = None


def read(secret: Mapping[str, Any] | None, name: str, item: str, namespace: str, generated: bool,
         value: bytes | None, not_owned: str | None = None) -> KeyRead:
    """Judges a Secret as the API server returned it (None: not found) with its item's bytes.
    not_owned: why an existing generated Secret is not the operator's own (then nothing of it is kept)."""
    field = "the generated Secret" if generated else "spec.l2.encryption.keySecretRef: Secret"
    where = f"{field} {name} key {item}"
    if secret is not None and not_owned is not None:
        return KeyRead(name, item, generated, problem=(KEY_NOT_OWNED, not_owned))
    if secret is None:
        if generated:
            return KeyRead(name, item, True, problem=(KEY_PENDING, f"{where} does not exist yet: the operator creates it "
                                                      "on its next apply"), absent=True)
        return KeyRead(name, item, False, absent=True, problem=(KEY_NOT_FOUND, (
            f"{where} not found in namespace {namespace}: create it with {L2_KEY_BYTES} random bytes, e.g. head -c "
            f"{L2_KEY_BYTES} /dev/urandom > key && kubectl create secret generic {name} --from-file={item}=key")))
    meta = secret.get("metadata") or {}
    metadata = {"labels": dict(meta.get("labels") or {}),
                "annotations": {k: v for k, v in (meta.get("annotations") or {}).items() if k in PROTECTED_ANNOTATIONS}}
    if not value:
        return KeyRead(name, item, generated, problem=(KEY_MISSING, f"{where}: the Secret has no such key; "
                                                       + ("restore it" if generated else "set keySecretRef.key")),
                       metadata=metadata)
    if len(value) < L2_KEY_BYTES:
        return KeyRead(name, item, generated, problem=(KEY_TOO_SHORT, f"{where}: the key has fewer than {L2_KEY_BYTES} "
                                                       f"bytes; use {L2_KEY_BYTES} random bytes"), metadata=metadata)
    return KeyRead(name, item, generated, fingerprint=key_fingerprint(value), metadata=metadata)


def unreadable(name: str, item: str, generated: bool, status: int | None) -> KeyRead:
    """The API server did not answer the read (a 403, a 5xx, no answer)."""
    return KeyRead(name, item, generated, problem=(KEY_UNREADABLE, f"Secret {name} key {item}: the API server answered "
                                                   f"{status} to reading it; retrying"))


def held(status: Mapping[str, Any] | None, namespace_id: str | None) -> tuple[int, int] | None:
    """(bytes, objects) of a namespace by the last inventory in status, or None when nothing says: no
    inventory yet (the servers' own counts start empty after a restart), or no namespace."""
    if not namespace_id:
        return None
    inventory = (status or {}).get("inventory")
    if not inventory or not inventory.get("measuredAt"):
        return None
    return served_of(inventory, namespace_id)


# status.sealedNamespaces: the namespaces the resource served under each key, newest last, at most
# this many (the oldest dropped): what a lost key makes unreadable, beyond the one served now.
SEALED_MAX = 16


def sealed(status: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """status.sealedNamespaces as stored: {namespaceId, fingerprint, secret}, newest last."""
    return [dict(e) for e in (status or {}).get("sealedNamespaces") or [] if e.get("namespaceId") and e.get("fingerprint")]


def sealed_after(status: Mapping[str, Any] | None, *records: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """status.sealedNamespaces with each record (status.l2Key's form) added or moved to the end, at most SEALED_MAX."""
    out = sealed(status)
    for record in records:
        if not record or not record.get("namespaceId") or not record.get("fingerprint"):
            continue
        entry = {"namespaceId": record["namespaceId"], "fingerprint": record["fingerprint"], "secret": record.get("secret")}
        out = [e for e in out if (e["namespaceId"], e["fingerprint"]) != (entry["namespaceId"], entry["fingerprint"])]
        out.append({k: v for k, v in entry.items() if v is not None})
    return out[-SEALED_MAX:]


Held = tuple[int, int] | None  # (bytes, objects) by the inventory; None: unknown


@dataclass(frozen=True)
class Loss:
    """The generated key is gone while data sealed under it may exist."""

    secret: str
    fingerprint: str
    namespaces: tuple[tuple[str | None, Held], ...]  # each namespace sealed with it that may hold data (None: unnamed)
    evidence: str  # where the record comes from


def _lost_key(status: Mapping[str, Any] | None, secret: str) -> tuple[str | None, list[str]]:
    """The fingerprint of the key the Secret last held, by status, and the namespaces recorded as
    sealed with it (the one served last, then the older ones, newest first)."""
    record = recorded(status)
    history = [e for e in sealed(status) if e.get("secret") == secret]
    fingerprint = record.get("fingerprint") if record.get("secret") == secret else None
    if fingerprint is None and history:  # another Secret (or none) since: the last key this Secret held
        fingerprint = history[-1]["fingerprint"]
    if fingerprint is None:
        return None, []
    ids = [record["namespaceId"]] if record.get("fingerprint") == fingerprint and record.get("namespaceId") else []
    ids += [e["namespaceId"] for e in reversed(history) if e["fingerprint"] == fingerprint and e["namespaceId"] not in ids]
    return fingerprint, ids


def loss(status: Mapping[str, Any] | None, key: KeyRead, annotations: Mapping[str, str] | None,
         claims: list[Mapping[str, Any]] | None = None) -> Loss | None:
    """Whether a new key now would make stored data unreadable without the user asking: the generated Secret is absent;
    status or a claim records the key it held; the inventory does not show every namespace sealed with it empty (a pin
    change leaves the old namespace's data on its storage); and the user has not accepted losing exactly that key."""
    if not key.generated or not key.absent:
        return None
    fingerprint, ids = _lost_key(status, key.secret)
    found: Loss | None = None
    if fingerprint is not None:
        amounts = [(i, held(status, i)) for i in ids] or [(None, None)]
        holding = tuple((i, a) for i, a in amounts if a is None or a[1] > 0)
        if holding:
            found = Loss(key.secret, fingerprint, holding, "status.l2Key" if recorded(status).get("fingerprint") ==
                         fingerprint else "status.sealedNamespaces")
    elif not recorded(status).get("fingerprint"):
        for claim in claims or []:
            if fp := ((claim.get("metadata") or {}).get("annotations") or {}).get(KEY_FINGERPRINT_ANNOTATION):
                found = Loss(key.secret, fp, ((None, None),), f"claim {claim['metadata'].get('name')}")
                break
    if found is None or (annotations or {}).get(REPLACE_ANNOTATION) == found.fingerprint:
        return None
    return found


def _amount(amount: tuple[int, int] | None) -> str:
    if amount is None:
        return "an unknown amount of data (not measured yet)"
    return f"{human_bytes(amount[0]) or '0B'} in {amount[1]} objects"


def _where(found: Loss) -> str:
    named = [(i, a) for i, a in found.namespaces if i]
    if not named:
        return f"the L2 data ({found.evidence}) holds {_amount(found.namespaces[0][1] if found.namespaces else None)}"
    if len(named) == 1:
        return f"namespace {named[0][0]} holds {_amount(named[0][1])}"
    return "namespaces " + ", ".join(f"{i} ({_amount(a)})" for i, a in named) + " hold data"


def loss_message(found: Loss, name: str, namespace: str) -> str:
    """What happened, what it costs and what the user can do: for the condition and the event."""
    return (f"Secret {found.secret} with L2's master key (fingerprint {found.fingerprint}) is gone, and {_where(found)} "
            "sealed with it: unreadable without that key. No new key is generated over it (that "
            "would turn it into misses for good), and the cache stays off meanwhile (vLLM runs without it). Restore "
            f"the Secret from a backup (the same bytes under key master-key, with its labels): the namespace comes back "
            "by itself. Or "
            f"accept the loss: kubectl annotate kvcachenamespace {name} -n {namespace} {REPLACE_ANNOTATION}="
            f"{found.fingerprint} (a new key and namespace; the old data is then an orphan for `kvpersist gc`)")


def events(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None,
           annotations: Mapping[str, str] | None) -> list[tuple[str, str, str]]:
    """(type, reason, message) when the key in use changed: the data under the old one stays, unreadable with the new key."""
    before, after = recorded(old), recorded(new)
    if not before.get("fingerprint") or not after.get("fingerprint") or before["fingerprint"] == after["fingerprint"]:
        return []
    amount = _amount(held(old, before.get("namespaceId"))) if before.get("namespaceId") else "its data"
    what = (f"L2's key changed (Secret {before.get('secret')} fingerprint {before['fingerprint']} -> Secret "
            f"{after.get('secret')} fingerprint {after['fingerprint']}): namespace {after.get('namespaceId')} replaces "
            f"{before.get('namespaceId')}, whose data ({amount}) stays where it is, unreadable with the new key: an orphan "
            "for `kvpersist report` and `kvpersist gc`, served again if the old key comes back")
    if (annotations or {}).get(REPLACE_ANNOTATION) == before["fingerprint"]:
        return [("Normal", KEY_REPLACED, f"as asked ({REPLACE_ANNOTATION}): {what}")]
    return [("Warning", KEY_CHANGED, what)]
