"""The pin check: a resource's declared numKVHeads, headSize and chatTemplateDigest against the
model's and tokenizer's files at the declared commits (kvpersist.hubpins), read from the Hub.

A mismatch turns the cache off (the IdentityResolved and PinsVerified conditions say
PinMismatch, naming the field, both values and the fix): KV stored under a wrong geometry or
template would be hits computed for other tokens or another layout. Anything else (Hub
unreachable, a gated or private repository, unreadable files, the check turned off) is
PinsVerified Unknown and changes nothing: the check only ever withholds the cache on evidence.

The files at a commit never change, so what they give is kept for the operator's lifetime per
(model, revision, tokenizer, tokenizer revision); a failed read is tried again after RETRY_S.
Reads are anonymous (no token: a gated model's pins are not checked), in a small pool of their
own, each bounded by CHECK_DEADLINE_S through the operator's Hub client (deadline, body cap,
proxy, no telemetry: kvpersist.inventory.hfbucket). KVPERSIST_PIN_CHECK=off turns it off.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpersist import hubpins
from kvpersist.api import v1alpha1 as api

CONDITION = "PinsVerified"
MISMATCH = "PinMismatch"
CHECK_DEADLINE_S = 30.0  # one check, all its files
RETRY_S = 120.0  # after a check that could not read the files
WORKERS = 2
ENV = "KVPERSIST_PIN_CHECK"

Key = tuple[str, str, str, str]  # model, revision, tokenizer, tokenizer revision
Verdict = tuple[bool | None, str, str]  # (status, reason, message), as condition() takes them


@dataclass(frozen=True)
class Unread:
    """Why the files could not be read (a retry may do better)."""

    reason: str
    message: str
    when: float
    final: bool = False  # the files were read and cannot give pins: no retry helps


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(ENV, "on").strip().lower() not in ("off", "false", "0", "no")


def key_of(identity: api.Identity) -> Key | None:
    """What to read for these pins, or None when there is nothing to check against (no revision)."""
    if not identity.model_revision:
        return None
    pins = identity.resolved()  # the tokenizer vLLM loads: the model's own unless set
    return identity.model_id, identity.model_revision.lower(), pins["tokenizer"], (pins["tokenizer_revision"] or "").lower()


def compare(identity: api.Identity, derived: hubpins.Derived, key: Key) -> Verdict:
    """PinMismatch naming every declared pin the files contradict, else PinsMatch. Pure."""
    model, revision, tokenizer, tok_rev = key
    where = f"config.json at {model}@{revision}"
    wrong = []
    if identity.num_kv_heads is not None and identity.num_kv_heads != derived.num_kv_heads:
        wrong.append(f"spec.identity.numKVHeads is {identity.num_kv_heads} but {where} says {derived.num_kv_heads}")
    if identity.head_size is not None and identity.head_size != derived.head_size:
        wrong.append(f"spec.identity.headSize is {identity.head_size} but {where} says {derived.head_size}")
    declared = (identity.chat_template_digest or "").lower() or None
    if declared is not None and tok_rev and declared != derived.chat_template_digest:
        found = (f"{derived.template_source} at {tokenizer}@{tok_rev} gives {derived.chat_template_digest}"
                 if derived.chat_template_digest else f"the tokenizer {tokenizer}@{tok_rev} has no chat template")
        wrong.append(f"spec.identity.chatTemplateDigest is {declared} but {found}")
    if wrong:
        return (False, MISMATCH, "; ".join(wrong) + f": set them to what the files say (`kvpersist pins {model}@{revision}"
                + (f" --tokenizer {tokenizer}@{tok_rev}" if tokenizer != model else "") + "` prints the block); "
                "the cache stays off meanwhile, since hits under wrong pins would be KV of another layout or template")
    checked = ["numKVHeads", "headSize"] + (["chatTemplateDigest"] if declared is not None and tok_rev else [])
    return (True, "PinsMatch", f"{', '.join(checked)} match the files at {model}@{revision}"
            + (f" and {tokenizer}@{tok_rev}" if "chatTemplateDigest" in checked and (tokenizer, tok_rev) != (model, revision)
               else ""))


def hub_fetch(endpoint: str | None, deadline: float) -> hubpins.Fetch:
    """Reads a file from the Hub's resolve route into memory (the operator's filesystem is read-only,
    and no cache is needed: the result is kept), anonymously, through the bounded Hub client. None:
    the repository has no such file at that commit. Other answers raise HubRefused."""
    from huggingface_hub import constants, get_session, hf_hub_url

    from kvpersist.inventory.hfbucket import bound_hub_client, hub_deadline

    bound_hub_client()

    def fetch(repo: str, revision: str, filename: str) -> bytes | None:
        url = hf_hub_url(repo, filename, revision=revision, endpoint=endpoint or constants.ENDPOINT)
        with hub_deadline(deadline):
            response = get_session().get(url, headers={"user-agent": "kvpersist-pin-check"})
        code = response.status_code
        error = response.headers.get("x-error-code", "")
        if code == 200:
            return response.content
        if code == 404 and error == "EntryNotFound":
            return None
        raise HubRefused(code, error)

    return fetch


class HubRefused(Exception):
    """The Hub answered, but not with the file: (status code, X-Error-Code)."""

    def __init__(self, code: int, error: str) -> None:
        super().__init__(code, error)
        self.code = code
        self.error = error


def _unread(exc: BaseException, key: Key, now: float) -> Unread:
    from kvpersist.inventory.hfbucket import transport_error_text

    model, revision = key[0], key[1]
    if isinstance(exc, hubpins.PinsError):
        return Unread("FilesUnusable", f"the files at {model}@{revision} give no pins ({exc}); not checked", now, final=True)
    if isinstance(exc, HubRefused):
        if exc.error == "RevisionNotFound":
            return Unread("RevisionNotFound", f"the Hub has no revision {revision} of {model}: check "
                          "spec.identity.modelRevision and spec.identity.tokenizerRevision", now)
        if exc.code in (401, 403) or exc.error in ("RepoNotFound", "GatedRepo"):
            return Unread("HubRefused", f"the Hub did not let the operator read {model} anonymously ({exc.code} "
                          f"{exc.error or ''}): a gated or private model's pins are not checked".replace("  ", " "), now)
        return Unread("HubError", f"the Hub answered {exc.code} for the files of {model}@{revision}; retrying", now)
    return Unread("HubUnreachable", f"cannot reach the Hugging Face Hub to check the pins of {model}@{revision} "
                  f"({transport_error_text(exc)}); retrying in {RETRY_S:.0f}s", now)


class PinFiles:
    """What the files at each Key gave: Derived pins (kept for good), or Unread (retried after
    RETRY_S unless final). Checks run in a pool of their own, one per Key at a time, shared by
    every resource that declares the same files; on_done is called when one ends (to refresh)."""

    def __init__(self, fetcher: Callable[[float], hubpins.Fetch] | None = None, workers: int = WORKERS) -> None:
        self._fetcher = fetcher
        self._lock = threading.Lock()
        self._found: dict[Key, hubpins.Derived | Unread] = {}
        self._running: set[Key] = set()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._workers = workers

    def get(self, key: Key) -> hubpins.Derived | Unread | None:
        with self._lock:
            return self._found.get(key)

    def verdict(self, identity: api.Identity) -> Verdict | None:
        """The last verdict for these pins (no I/O): None while none is known or nothing to check."""
        key = key_of(identity)
        if key is None:
            return None
        found = self.get(key)
        if isinstance(found, hubpins.Derived):
            return compare(identity, found, key)
        if isinstance(found, Unread):
            return (None, found.reason, found.message)
        return None

    def mismatch(self, identity: api.Identity) -> str | None:
        """The PinMismatch message for these pins, when the files contradict them. No I/O."""
        got = self.verdict(identity)
        return got[2] if got is not None and got[1] == MISMATCH else None

    def request(self, identity: api.Identity, on_done: Callable[[], None]) -> bool:
        """Starts a check of these pins' files unless one is known (or runs, or failed under
        RETRY_S ago); True if started (on_done is then called when it ends)."""
        key = key_of(identity)
        if key is None:
            return False
        now = time.monotonic()
        with self._lock:
            found = self._found.get(key)
            if isinstance(found, hubpins.Derived) or key in self._running:
                return False
            if isinstance(found, Unread) and (found.final or now - found.when < RETRY_S):
                return False
            self._running.add(key)
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="kvp-pins")
            self._pool.submit(self._check, key, on_done)
            return True

    def _check(self, key: Key, on_done: Callable[[], None]) -> None:
        try:
            deadline = time.monotonic() + CHECK_DEADLINE_S
            fetch = (self._fetcher or (lambda d: hub_fetch(os.environ.get("HF_ENDPOINT"), d)))(deadline)
            result: hubpins.Derived | Unread = hubpins.fetch_derived(fetch, *key)
        except Exception as exc:  # every failure is a verdict (Unknown), never a crashed thread
            result = _unread(exc, key, time.monotonic())
            if result.reason == "HubUnreachable":
                logging.getLogger("kvpersist").info("pin check of %s@%s: %s", key[0], key[1], result.message)
        with self._lock:
            self._found[key] = result
            self._running.discard(key)
        on_done()


def condition_of(verdict: Verdict | None, identity: api.Identity, checking: bool) -> Verdict | None:
    """PinsVerified's (status, reason, message): the verdict; Unknown while the first check runs or
    when the check is off; None (no condition) when there is no revision to check against."""
    if key_of(identity) is None:
        return None
    if not checking:
        return (None, "CheckDisabled", f"{ENV}=off: the pins are not checked against the Hub")
    return verdict or (None, "Checking", "reading config.json and the tokenizer's files at the declared revisions")


def apply_mismatch(resolution: Any, message: str | None) -> Any:
    """The resolution with the cache off for a pin mismatch (kvpersist.identity.Resolution.blocked)."""
    import dataclasses

    if message is None or resolution.namespace_id is None:
        return resolution
    return dataclasses.replace(resolution, namespace_id=None, blocked=(MISMATCH, message))

