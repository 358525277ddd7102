"""The pins a model's own files decide, derived as vLLM reads the same files (`kvpersist pins` prints
them; each pin's source: docs/design.md, "How `kvpersist pins` derives the pins"), and the pin check
of a resource's declared pins against them at the declared commits.

The chat template's digest is of its text, not a rendering (a rendering depends on the messages; the
same text always renders the same tokens); a --chat-template given to vLLM is not covered.
Every file is hostile: size bounds, malformed JSON and wrong types are a PinsError naming the file and field.

A mismatch turns the cache off (PinMismatch): KV stored under a wrong geometry or template would be
hits computed for other tokens or another layout. Anything else (Hub unreachable, a gated repository,
KVPERSIST_PIN_CHECK=off) is PinsVerified Unknown: the cache is withheld on evidence only. The same
files fill the pins a resource leaves unset (filled); until they are read the cache stays off
(PinsUnresolved), never a guess. The files at a commit never change: what they give is kept, also in
status.identity.files, so a restarted operator resolves the same pins without the Hub (reads bounded
through kvpersist.inventory.bucket's Hub client).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpersist.api.identity import Identity
from kvpersist.api.spec import KVCacheNamespaceSpec
from kvpersist.api.statusmodels import IdentityFiles
from kvpersist.status import Verdict

HEX40_RE = re.compile(r"[0-9a-f]{40}")
CONFIG = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_JINJA = "chat_template.jinja"
TEMPLATE_JSON = "chat_template.json"
# Bounds per file: configs are a few KB; a tokenizer_config with every added token spelled out
# reaches a few MB; a template is text a person wrote.
MAX_BYTES = {CONFIG: 4 << 20, TOKENIZER_CONFIG: 32 << 20, TEMPLATE_JINJA: 1 << 20, TEMPLATE_JSON: 2 << 20}
TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config")
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "torch.bfloat16": "bfloat16",
          "torch.float16": "float16"}

Fetch = Callable[[str, str, str], bytes | None]  # (repo, revision, filename) -> bytes, or None: no such file


class PinsError(ValueError):
    """A file that cannot give a pin: the message names the file and the field."""


@dataclass(frozen=True)
class Derived:
    """The pins the files decide (None where they say nothing), and notes for a person."""

    num_kv_heads: int
    head_size: int
    max_model_len: int | None
    dtype: str | None  # kvCacheDtype "auto" would follow: float16 / bfloat16, or None (float32, unsaid)
    chat_template_digest: str | None
    template_source: str | None  # which file the template came from
    notes: tuple[str, ...] = ()
    mla: bool = False  # latent attention: its block size is the attention backend's choice, not a default


def _decoded(name: str, data: bytes, what: str) -> str:
    """The file's text, within its MAX_BYTES (what: how the message names such a file)."""
    limit = MAX_BYTES.get(name, 4 << 20)
    if len(data) > limit:
        raise PinsError(f"{name}: {len(data)} bytes, more than the {limit} {what} may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PinsError(f"{name}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def parse_json(name: str, data: bytes) -> dict[str, Any]:
    """A JSON object from a file, bounded; PinsError naming the file otherwise."""
    text = _decoded(name, data, f"a {name}")  # outside the try: a PinsError is a ValueError too
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PinsError(f"{name}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise PinsError(f"{name}: nested too deeply to be a config") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise PinsError(f"{name}: not a usable JSON document ({str(exc)[:120]})") from None
    if not isinstance(value, dict):
        raise PinsError(f"{name}: a JSON object was expected, found {type(value).__name__}")
    return value


def _int(name: str, section: Mapping[str, Any], key: str, where: str) -> int | None:
    """A positive integer field, None when absent or null; PinsError for anything else."""
    value = section.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PinsError(f"{name}: {where}{key} must be a positive integer, found {json.dumps(value)[:80]}")
    return value


def _first(section: Mapping[str, Any], keys: tuple[str, ...], where: str) -> int | None:
    """The first of config.json's keys that is set, in vLLM's order (a bad one before it is an error)."""
    return next((value for key in keys if (value := _int(CONFIG, section, key, where)) is not None), None)


def text_config(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The language model's section of a config and its path prefix for messages."""
    for key in TEXT_CONFIG_KEYS:
        section = config.get(key)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise PinsError(f"{CONFIG}: {key} must be an object, found {type(section).__name__}")
        if "num_attention_heads" in section or "hidden_size" in section or "head_dim" in section:
            return section, f"{key}."
    return config, ""


def geometry(config: Mapping[str, Any]) -> tuple[int, int, list[str]]:
    """(numKVHeads, headSize, notes) from a parsed config.json."""
    section, where = text_config(config)
    notes: list[str] = []
    heads = _int(CONFIG, section, "num_attention_heads", where)
    lora = _int(CONFIG, section, "kv_lora_rank", where)
    if lora is not None:  # MLA: one latent head of kv_lora_rank + qk_rope_head_dim
        rope = _int(CONFIG, section, "qk_rope_head_dim", where)
        if rope is None:
            raise PinsError(f"{CONFIG}: {where}kv_lora_rank is set (MLA) but {where}qk_rope_head_dim is missing")
        notes.append(f"MLA attention ({where}kv_lora_rank): one latent KV head of kv_lora_rank + qk_rope_head_dim")
        return 1, lora + rope, notes
    kv_heads = _first(section, KV_HEAD_KEYS, where)
    if kv_heads is None and section.get("multi_query") is True:
        kv_heads = 1
    if kv_heads is None:
        if heads is None:
            raise PinsError(f"{CONFIG}: neither {where}num_key_value_heads nor {where}num_attention_heads is set")
        kv_heads = heads
    head_size = _int(CONFIG, section, "head_dim", where)
    if head_size is None:
        hidden = _int(CONFIG, section, "hidden_size", where)
        if hidden is None or heads is None:
            raise PinsError(f"{CONFIG}: no {where}head_dim, and no {where}hidden_size and {where}num_attention_heads "
                            "to divide")
        if hidden % heads:
            raise PinsError(f"{CONFIG}: {where}hidden_size {hidden} is not a multiple of {where}num_attention_heads "
                            f"{heads}, and there is no {where}head_dim")
        head_size = hidden // heads
    return kv_heads, head_size, notes


def max_model_len(config: Mapping[str, Any]) -> tuple[int | None, list[str]]:
    section, where = text_config(config)
    notes: list[str] = []
    found = _first(section, MAX_LEN_KEYS, where)
    scaling = section.get("rope_scaling") or section.get("rope_parameters")
    if isinstance(scaling, dict) and scaling.get("factor") is not None:
        kind = scaling.get("rope_type") or scaling.get("type")
        notes.append(f"the config declares rope scaling ({str(kind)[:40]}, factor {str(scaling.get('factor'))[:20]}): "
                     "vLLM may allow a longer --max-model-len than max_position_embeddings; maxModelLen is what you run")
    return found, notes


def config_dtype(config: Mapping[str, Any]) -> str | None:
    """The dtype kvCacheDtype "auto" follows: float16 or bfloat16; None when unsaid or float32."""
    section, where = text_config(config)
    for source, prefix in ((section, where), (config, "")):
        for key in ("dtype", "torch_dtype"):
            value = source.get(key)
            if value is None:
                continue
            if not isinstance(value, str):
                raise PinsError(f"{CONFIG}: {prefix}{key} must be a string, found {json.dumps(value)[:80]}")
            return DTYPES.get(value.strip().lower())
    return None


def chat_template(files: Mapping[str, bytes | None]) -> tuple[str, str] | None:
    """(template text, file) as transformers loads it for vLLM, or None when the tokenizer has none."""
    raw = files.get(TEMPLATE_JINJA)
    if raw is not None:
        return _decoded(TEMPLATE_JINJA, raw, "a template").replace("\r\n", "\n").replace("\r", "\n"), TEMPLATE_JINJA
    for name in (TEMPLATE_JSON, TOKENIZER_CONFIG):
        raw = files.get(name)
        if raw is None or (value := parse_json(name, raw).get("chat_template")) is None:
            continue
        if isinstance(value, str):
            return value, name
        if isinstance(value, list):
            for i, entry in enumerate(value):
                if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                        and isinstance(entry.get("template"), str)):
                    raise PinsError(f"{name}: chat_template[{i}] must be an object with string name and template")
            default = next((e["template"] for e in value if e["name"] == "default"), None)
            if default is None:
                raise PinsError(f"{name}: chat_template lists named templates but none named 'default'")
            return default, name
        raise PinsError(f"{name}: chat_template must be a string or a list of {{name, template}}, "
                        f"found {type(value).__name__}")
    return None


def derive(config_bytes: bytes, tokenizer_files: Mapping[str, bytes | None]) -> Derived:
    """The pins from config.json's bytes and the tokenizer repository's files (None: not there)."""
    config = parse_json(CONFIG, config_bytes)
    kv_heads, head_size, notes = geometry(config)
    length, length_notes = max_model_len(config)
    template = chat_template(tokenizer_files)
    return Derived(kv_heads, head_size, length, config_dtype(config),
                   "sha256:" + hashlib.sha256(template[0].encode("utf-8")).hexdigest() if template else None,
                   template[1] if template else None,
                   tuple(notes + length_notes), mla=any(n.startswith("MLA") for n in notes))


def check_revision(value: str, what: str) -> str:
    """A 40-hex commit, lower-cased; PinsError naming the field otherwise."""
    text = value.strip().lower()
    if not HEX40_RE.fullmatch(text):
        raise PinsError(f"{what} {value[:80]!r} is not a 40-character commit SHA: the identity pins a commit, since "
                        "branches and tags move (find it with `hf repo info` / the repository's commit history, "
                        "or pass --resolve to look it up)")
    return text


def fetch_derived(fetch: Fetch, model: str, revision: str, tokenizer: str, tokenizer_revision: str) -> Derived:
    """derive() from files fetch() reads: config.json from the model, the template from the tokenizer."""
    config = fetch(model, revision, CONFIG)
    if config is None:
        raise PinsError(f"{model}@{revision}: the repository has no {CONFIG}")
    files = {name: fetch(tokenizer, tokenizer_revision, name) for name in (TEMPLATE_JINJA, TEMPLATE_JSON, TOKENIZER_CONFIG)}
    return derive(config, files)


def cache_fetch(token: str | None = None, cache_dir: str | None = None, local_files_only: bool = False) -> Fetch:
    """A Fetch through hf_hub_download (its cache and HF_HUB_OFFLINE apply). A file the repository (offline:
    the cache) lacks is None, as transformers treats it; a file over its MAX_BYTES is an error."""

    def fetch(repo: str, revision: str, filename: str) -> bytes | None:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            path = hf_hub_download(repo, filename, revision=revision, token=token, cache_dir=cache_dir,
                                   local_files_only=local_files_only)
        except EntryNotFoundError:
            if filename == CONFIG:
                raise PinsError(f"{repo}@{revision}: no {CONFIG} at that revision (or, offline, not in the cache: "
                                "unset HF_HUB_OFFLINE once)") from None
            return None
        limit = MAX_BYTES.get(filename, 4 << 20)
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise PinsError(f"{filename}: more than the {limit} bytes a {filename} may have")
        return data

    return fetch


CONDITION = "PinsVerified"
MISMATCH = "PinMismatch"
UNRESOLVED = "PinsUnresolved"  # IdentityResolved's reason while unset pins wait for the files
BLOCK_SIZE = 16  # vLLM's --block-size default on GPUs (an MLA model's is its attention backend's: not filled)
TENSOR_PARALLEL = 1  # vLLM's --tensor-parallel-size default
# The pins the files decide (file_pins), then those filled from the spec: the order of messages.
FROM_FILES = ("num_kv_heads", "head_size", "chat_template_digest", "kv_cache_dtype", "max_model_len", "block_size")
FILLED = (*FROM_FILES, "tensor_parallel_size", "connector_build")
NOT_GIVEN = {  # why the files leave a pin unset: the user's to write
    "chat_template_digest": "the tokenizer has no chat template",
    "kv_cache_dtype": "config.json names no float16 or bfloat16 dtype",
    "max_model_len": "config.json names no max_position_embeddings",
    "block_size": "an MLA model's block size is its attention backend's choice",
    "connector_build": "spec.image is not named by digest",
}
CHECK_DEADLINE_S = 30.0  # one check, all its files
RETRY_S = 120.0  # after a check that could not read the files
WORKERS = 2
FIRST_READ_WAIT_S = 5.0  # how long an apply waits for a read in flight (PinFiles.wait)
ENV = "KVPERSIST_PIN_CHECK"

Key = tuple[str, str, str, str]  # model, revision, tokenizer, tokenizer revision


@dataclass(frozen=True)
class Unread:
    """Why the files could not be read (a retry may do better)."""

    reason: str
    message: str
    when: float
    final: bool = False  # the files were read and cannot give pins: no retry helps


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(ENV, "on").strip().lower() not in ("off", "false", "0", "no")


def key_of(identity: Identity) -> Key | None:
    """What to read for these pins, or None when there is nothing to check against (no revision)."""
    if not identity.model_revision:
        return None
    pins = identity.resolved()  # the tokenizer vLLM loads: the model's own unless set
    return identity.model_id, identity.model_revision.lower(), pins["tokenizer"], (pins["tokenizer_revision"] or "").lower()


def where(key: Key) -> str:
    """The files' commits as status.identity.files.at and messages name them."""
    model, revision, tokenizer, tok_rev = key
    return f"{model}@{revision}" + (f" {tokenizer}@{tok_rev}" if (tokenizer, tok_rev) != (model, revision) else "")


@dataclass(frozen=True)
class Facts:
    """What a resource's model files say: the pins they decide (None while unknown, with why), and PinMismatch's message."""

    at: str
    values: tuple[tuple[str, Any], ...] | None = None
    unread: str = ""
    mismatch: str | None = None


def file_pins(derived: Derived) -> dict[str, Any]:
    return {"num_kv_heads": derived.num_kv_heads, "head_size": derived.head_size,
            "chat_template_digest": derived.chat_template_digest, "kv_cache_dtype": derived.dtype,
            "max_model_len": derived.max_model_len, "block_size": None if derived.mla else BLOCK_SIZE}


def recorded(status: Mapping[str, Any] | None, at: str) -> tuple[tuple[str, Any], ...] | None:
    """The file pins status.identity.files keeps for the same commits (None: none, or malformed: status is untrusted)."""
    files = ((status or {}).get("identity") or {}).get("files")
    if not isinstance(files, dict) or files.get("at") != at:
        return None
    try:
        found = IdentityFiles.model_validate(files)
    except ValueError:
        return None
    return tuple((name, getattr(found, name)) for name in FROM_FILES)


def unset(identity: Identity) -> tuple[str, ...]:
    """The pins the operator fills for this identity: those left unset, once a revision names the files."""
    return tuple(f for f in FILLED if getattr(identity, f) is None) if identity.model_revision else ()


def filled(spec: KVCacheNamespaceSpec, facts: Facts | None) -> tuple[KVCacheNamespaceSpec, str | None]:
    """The spec with its unset pins filled from the files (and vLLM's defaults, the image's digest), and why any stays unset."""
    from kvpersist.identity import field_path, image_digest

    missing = unset(spec.identity)
    if not missing:
        return spec, None
    if facts is None or facts.values is None:
        why = facts.unread if facts is not None else f"{ENV}=off: no files are read"
        return spec, (f"{', '.join(map(field_path, missing))} unset: the operator takes them from the model's files, "
                      f"not read yet ({why}); the cache stays off until they are, or write them (`kvpersist pins "
                      "MODEL@REVISION` prints them)")
    values = {**dict(facts.values), "tensor_parallel_size": TENSOR_PARALLEL, "connector_build": image_digest(spec.image)}
    identity, left = spec.identity, []
    for name in missing:
        value = values.get(name)
        try:
            if value is None:
                raise ValueError(name)
            identity = Identity.model_validate({**identity.model_dump(by_alias=True, exclude_none=True),
                                                Identity.model_fields[name].alias or name: value})
        except ValueError:
            left.append(f"{field_path(name)} ({NOT_GIVEN.get(name, f'the files give {str(value)[:40]!r}, not a valid pin')})")
    spec = spec.model_copy(update={"identity": identity})
    return spec, (f"the files at {facts.at} do not decide " + ", ".join(left) + ": write them" if left else None)


def compare(identity: Identity, derived: Derived, key: Key) -> Verdict:
    """PinMismatch naming every declared pin the files contradict, else PinsMatch. Pure."""
    model, revision, tokenizer, tok_rev = key
    where = f"config.json at {model}@{revision}"
    wrong = [f"spec.identity.{field} is {mine} but {where} says {theirs}"
             for field, mine, theirs in (("numKVHeads", identity.num_kv_heads, derived.num_kv_heads),
                                         ("headSize", identity.head_size, derived.head_size))
             if mine is not None and mine != theirs]
    declared = (identity.chat_template_digest or "").lower() or None
    if declared is not None and tok_rev and declared != derived.chat_template_digest:
        found = (f"{derived.template_source} at {tokenizer}@{tok_rev} gives {derived.chat_template_digest}"
                 if derived.chat_template_digest else f"the tokenizer {tokenizer}@{tok_rev} has no chat template")
        wrong.append(f"spec.identity.chatTemplateDigest is {declared} but {found}")
    if wrong:
        return (False, MISMATCH, "; ".join(wrong) + ": delete them (the operator fills them from the files) or set them "
                f"to what the files say (`kvpersist pins {model}@{revision}"
                + (f" --tokenizer {tokenizer}@{tok_rev}" if tokenizer != model else "") + "` prints the block); "
                "the cache stays off meanwhile, since hits under wrong pins would be KV of another layout or template")
    checked = ["numKVHeads", "headSize"] + (["chatTemplateDigest"] if declared is not None and tok_rev else [])
    return (True, "PinsMatch", f"{', '.join(checked)} match the files at {model}@{revision}"
            + (f" and {tokenizer}@{tok_rev}" if "chatTemplateDigest" in checked and (tokenizer, tok_rev) != (model, revision)
               else ""))


def hub_fetch(endpoint: str | None, deadline: float, token: str | None = None) -> Fetch:
    """Reads a file from the Hub into memory (the operator's filesystem is read-only, and the result is
    kept), anonymously unless given a token. None: no such file at that commit; other answers: HubRefused."""
    from huggingface_hub import constants, get_session, hf_hub_url

    from kvpersist.inventory.bucket import bound_hub_client, hub_deadline

    bound_hub_client()

    def fetch(repo: str, revision: str, filename: str) -> bytes | None:
        url = hf_hub_url(repo, filename, revision=revision, endpoint=endpoint or constants.ENDPOINT)
        with hub_deadline(deadline):
            response = get_session().get(url, headers={"user-agent": "kvpersist-pin-check",
                                                       **({"authorization": f"Bearer {token}"} if token else {})})
        code = response.status_code
        error = response.headers.get("x-error-code", "")
        if code == 200:
            return response.content
        if code == 404 and error == "EntryNotFound":
            return None
        raise HubRefused(code, error)

    return fetch


class HubRefused(Exception):
    """The Hub answered, but not with the file: its args are (status code, X-Error-Code)."""


def _unread(exc: BaseException, key: Key, now: float, with_token: bool = False) -> Unread:
    from kvpersist.inventory.bucket import transport_error_text

    model, revision = key[0], key[1]
    if isinstance(exc, PinsError):
        return Unread("FilesUnusable", f"the files at {model}@{revision} give no pins ({exc}); not checked", now, final=True)
    if isinstance(exc, HubRefused):
        code, error = exc.args
        if error == "RevisionNotFound":
            return Unread("RevisionNotFound", f"the Hub has no revision {revision} of {model}: check "
                          "spec.identity.modelRevision and spec.identity.tokenizerRevision", now)
        if (with_token and code in (401, 403)) or error == "NoToken":
            return Unread("HubRefused", f"the Hub did not let spec.vllm.hfTokenSecretRef's token read {model} "
                          f"({code} {error or ''}): accept the model's terms on the Hub with that account, or "
                          "check the Secret's key".replace("  ", " "), now)
        if code in (401, 403) or error in ("RepoNotFound", "GatedRepo"):
            return Unread("HubRefused", f"the Hub did not let the operator read {model} anonymously ({code} "
                          f"{error or ''}): a gated or private model's files are read with the token of "
                          "spec.vllm.hfTokenSecretRef where the resource names one".replace("  ", " "), now)
        return Unread("HubError", f"the Hub answered {code} for the files of {model}@{revision}; retrying", now)
    return Unread("HubUnreachable", f"cannot reach the Hugging Face Hub to check the pins of {model}@{revision} "
                  f"({transport_error_text(exc)}); retrying in {RETRY_S:.0f}s", now)


# Who a read's answer is for: "" anonymous (any resource), or "<namespace>/<Secret>" read with a
# resource's spec.vllm.hfTokenSecretRef token (a gated model: that namespace's alone, never another tenant's).
Scope = str
TokenReader = Callable[[], str | None]


def scope_of(spec: KVCacheNamespaceSpec, namespace: str) -> Scope:
    ref = spec.vllm.hf_token_secret_ref
    return f"{namespace}/{ref.name}" if ref is not None else ""


class PinFiles:
    """What the files at each Key gave: Derived pins (kept for good), or Unread (retried after RETRY_S
    unless final). One check per Key and Scope at a time, in a pool of their own, shared by every
    resource that declares the same files; a model refused anonymously (gated) is read again with the
    resource's own token, under its Scope."""

    def __init__(self, fetcher: Callable[[float, str | None], Fetch] | None = None, workers: int = WORKERS) -> None:
        self._fetcher = fetcher
        self._lock = threading.Lock()
        self._found: dict[tuple[Key, Scope], Derived | Unread] = {}
        self._running: dict[tuple[Key, Scope], concurrent.futures.Future[None]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvp-pins")

    def get(self, key: Key, scope: Scope = "") -> Derived | Unread | None:
        """The anonymous answer, or the scope's own where the anonymous one was a refusal."""
        with self._lock:
            found = self._found.get((key, ""))
            if scope and not isinstance(found, Derived):
                found = self._found.get((key, scope)) or found
            return found

    def verdict(self, identity: Identity, scope: Scope = "", checking: bool = True) -> Verdict | None:
        """PinsVerified's (status, reason, message), no I/O: Unknown while the first check runs or when
        the check is off; None (no condition) when there is no revision to check against."""
        key = key_of(identity)
        if key is None:
            return None
        if not checking:
            return (None, "CheckDisabled", f"{ENV}=off: the pins are not checked against the Hub")
        found = self.get(key, scope)
        if isinstance(found, Derived):
            return compare(identity, found, key)
        if isinstance(found, Unread):
            return (None, found.reason, found.message)
        return (None, "Checking", "reading config.json and the tokenizer's files at the declared revisions")

    def facts(self, spec: KVCacheNamespaceSpec, namespace: str, status: Mapping[str, Any] | None,
              checking: bool) -> Facts | None:
        """What decide needs of these pins' files (no I/O): None when there is no revision to read."""
        identity = spec.identity
        key = key_of(identity)
        if key is None:
            return None
        at = where(key)
        found = self.get(key, scope_of(spec, namespace)) if checking else None
        if isinstance(found, Derived):
            verdict = compare(identity, found, key)
            return Facts(at, tuple(file_pins(found).items()), mismatch=verdict[2] if verdict[1] == MISMATCH else None)
        kept = recorded(status, at)
        if kept is not None:
            return Facts(at, kept)
        if not checking:
            return Facts(at, unread=f"{ENV}=off: no files are read")
        return Facts(at, unread=found.message if isinstance(found, Unread) else f"reading the files at {at}")

    def request(self, identity: Identity, on_done: Callable[[], None],
                token: tuple[Scope, TokenReader] | None = None) -> bool:
        """Starts a check of these pins' files unless one is known, runs or failed under RETRY_S ago:
        anonymous, then with token (its Scope, its reader) once the Hub refused. True if started."""
        key = key_of(identity)
        if key is None:
            return False
        now = time.monotonic()
        with self._lock:
            anonymous = self._found.get((key, ""))
            refused = isinstance(anonymous, Unread) and anonymous.reason == "HubRefused"
            slot = (key, token[0]) if token is not None and refused else (key, "")
            found = self._found.get(slot)
            if isinstance(anonymous, Derived) or isinstance(found, Derived) or slot in self._running:
                return False
            if isinstance(found, Unread) and (found.final or now - found.when < RETRY_S):
                return False
            reader = token[1] if slot[1] and token is not None else None
            self._running[slot] = self._pool.submit(self._check, slot, on_done, reader)
            return True

    def wait(self, identity: Identity, on_done: Callable[[], None], timeout: float = FIRST_READ_WAIT_S,
             token: tuple[Scope, TokenReader] | None = None) -> None:
        """Starts the read of these pins' files if due and waits for it, at most timeout: a new
        resource's first apply then renders its filled pins instead of rolling vLLM a moment later."""
        deadline = time.monotonic() + timeout
        for _ in range(2):  # anonymous, then (refused) with the token
            self.request(identity, on_done, token)
            key = key_of(identity)
            with self._lock:
                running = [f for (k, _s), f in self._running.items() if k == key]
            if time.monotonic() >= deadline:
                return
            if running:  # none: known, or already done (a quick refusal: the token's read is next)
                concurrent.futures.wait(running, timeout=max(0.0, deadline - time.monotonic()))

    def _check(self, slot: tuple[Key, Scope], on_done: Callable[[], None], reader: TokenReader | None) -> None:
        key = slot[0]
        try:
            deadline = time.monotonic() + CHECK_DEADLINE_S
            token = reader() if reader is not None else None
            if reader is not None and not token:
                raise HubRefused(401, "NoToken")
            fetch = (self._fetcher or (lambda d, t: hub_fetch(os.environ.get("HF_ENDPOINT"), d, t)))(deadline, token)
            result: Derived | Unread = fetch_derived(fetch, *key)
        except Exception as exc:  # every failure is a verdict (Unknown), never a crashed thread
            result = _unread(exc, key, time.monotonic(), with_token=reader is not None)
            if result.reason == "HubUnreachable":
                logging.getLogger("kvpersist").info("pin check of %s@%s: %s", key[0], key[1], result.message)
        with self._lock:
            self._found[slot] = result
            self._running.pop(slot, None)
        on_done()


def status_of(declared: Identity, full: Identity, facts: Facts | None) -> dict[str, Any]:
    """status.identity: the pins as rendered (full: the declared ones filled), the ones the operator
    filled, and what the files said where they were read (kept for a restart)."""
    out: dict[str, Any] = {"pins": full.model_dump(by_alias=True, exclude_none=True, mode="json")}
    mine = [Identity.model_fields[f].alias or f for f in unset(declared) if getattr(full, f) is not None]
    if mine:
        out["filled"] = sorted(mine)
    if facts is not None and facts.values is not None:
        out["files"] = {"at": facts.at, **{Identity.model_fields[k].alias or k: v
                                       for k, v in facts.values if v is not None}}
    return out
