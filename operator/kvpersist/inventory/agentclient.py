"""The operator's side of the inventory agent: bounded calls whose answers are checked before use,
since whatever answers on its port may be broken or hostile, and one bad pod must not stall or
crash a refresh."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool

from kvpersist import httpclient
from kvpersist.httpclient import Count, M, PeerError
from kvpersist.inventory import prefetch
from kvpersist.inventory.volume import NAMESPACE_ID_RE, Inventory, NamespaceUsage, parse_iso

log = logging.getLogger(__name__)

TIMEOUT_S = 2.0  # as for /status: a refresh must not hang on one pod (the whole call, body included)
GC_TIMEOUT_S = 120.0  # deleting a big namespace folder takes a while


def _unix_time(stamp: Any) -> float | None:
    """An RFC 3339 stamp as the agent writes it (volume.iso) -> unix seconds; None or "" -> None."""
    if stamp is not None and not isinstance(stamp, str):
        raise ValueError("not an RFC 3339 time")
    try:
        return parse_iso(stamp)
    except (ValueError, OverflowError, OSError):
        raise ValueError("not an RFC 3339 time") from None


def _namespace_id(value: str) -> str:
    if not NAMESPACE_ID_RE.fullmatch(value):
        raise ValueError("not a namespace id (kvp-<32 hex>)")
    return value


class NamespaceBody(BaseModel):
    """One namespace of an agent's /inventory."""

    namespace_id: Annotated[str, AfterValidator(_namespace_id)] = Field(alias="namespaceId")
    bytes: Count | None = None
    objects: Count | None = None
    last_write: Annotated[float | None, BeforeValidator(_unix_time)] = Field(None, alias="lastWrite")
    orphan: StrictBool | None = None
    complete: StrictBool = True


class InventoryBody(BaseModel):
    """The parts of an agent's /inventory the operator reads (serving, trimmed: ignored)."""

    location: str = ""
    namespaces: list[NamespaceBody] | None = None
    other_bytes: Count | None = Field(None, alias="otherBytes")
    capacity_bytes: Count | None = Field(None, alias="capacityBytes")
    free_bytes: Count | None = Field(None, alias="freeBytes")
    truncated: StrictBool = False
    effective_capacity_bytes: Count | None = Field(None, alias="effectiveCapacityBytes")

    def inventory(self) -> Inventory:
        return Inventory(self.location, [NamespaceUsage(n.namespace_id, n.bytes or 0, n.objects or 0, n.last_write, n.orphan,
                                                        n.complete) for n in self.namespaces or []],
                         self.other_bytes or 0, self.capacity_bytes, self.free_bytes, self.truncated,
                         self.effective_capacity_bytes)


class GcBody(BaseModel):
    """The fields of a /gc answer its callers read (cleanup.gc_volumes); the rest passes through."""

    model_config = ConfigDict(extra="allow")
    deleted: StrictBool | None = None
    bytes: Count | None = None
    objects: Count | None = None
    error: str | None = None


def auth(token: str | None) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {token}"} if token else None


def fetch_inventory(ip: str, port: int, timeout: float = TIMEOUT_S, token: str | None = None) -> Inventory | None:
    """The agent's last scan of its volume; None (the reason logged) unless it answers a well-formed one."""
    try:
        reply = httpclient.get(ip, port, "/inventory", timeout=timeout, headers=auth(token))
        if not reply.ok:
            raise PeerError(f"answered HTTP {reply.status}")
        return httpclient.parse(reply.body, InventoryBody).inventory()
    except PeerError as exc:
        log.warning("no inventory from the agent at %s:%s: %s", ip, port, exc)
        return None


class ExpireBody(BaseModel):
    """An agent's /expire answer: the folders it removed under the age limit, and those it kept."""

    removed: list[NamespaceBody] = Field(default_factory=list, max_length=4096)
    error: str | None = None


def _post(ip: str, port: int, path: str, body: dict[str, Any], model: type[M], timeout: float,
          token: str | None) -> tuple[int, M]:
    """(HTTP code, the checked answer or one with only `error` saying why) of one POST to the agent; code 0
    when it could not be reached. A malformed answer keeps the code."""
    try:
        reply = httpclient.post_json(ip, port, path, body, timeout=timeout, headers=auth(token))
    except PeerError as exc:
        return 0, model(error=f"agent at {ip}:{port} unreachable: {exc}")
    try:
        return reply.status, httpclient.parse(reply.body, model)
    except PeerError as exc:
        return reply.status, model(error=f"agent at {ip}:{port} answered HTTP {reply.status}, malformed: {exc}")


def request_expire(ip: str, port: int, max_age_days: int, protected: list[str], remove: list[str],
                   token: str | None = None, timeout: float = GC_TIMEOUT_S) -> tuple[int, ExpireBody]:
    """The agent's /expire (spec.l2.orphanRetention), as _post: a malformed answer removed nothing."""
    body = {"maxAgeDays": max_age_days, "protected": protected, "remove": remove, "dryRun": False}
    return _post(ip, port, "/expire", body, ExpireBody, timeout, token)


def request_gc(ip: str, port: int, namespace_id: str, dry_run: bool, timeout: float = GC_TIMEOUT_S,
               token: str | None = None) -> tuple[int, dict[str, Any]]:
    """The agent's /gc, as _post, its answer as a dict."""
    code, answer = _post(ip, port, "/gc", {"namespaceId": namespace_id, "dryRun": dry_run}, GcBody, timeout, token)
    return code, answer.model_dump(exclude_unset=True)


PREFETCH_TIMEOUT_S = prefetch.WAIT_S + prefetch.CALL_TIMEOUT_S + 5.0  # the agent's own bounds, and the transfer


def request_prefetch(ip: str, port: int, token_ids: list[int], token: str | None,
                     timeout: float = PREFETCH_TIMEOUT_S) -> tuple[int, prefetch.Answer]:
    """The agent's POST /server/prefetch (kvpersist.inventory.prefetch), as _post: 503 before any vLLM
    registered, 404 from an agent older than the route."""
    return _post(ip, port, prefetch.PATH, {"tokenIds": token_ids}, prefetch.Answer, timeout, token)
