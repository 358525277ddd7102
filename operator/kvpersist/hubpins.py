"""The identity pins a model's own files decide, derived from them as vLLM reads the same files:
`kvpersist pins` prints them, and kvpersist.controller.pincheck compares a resource's declared pins
with them. Pure: the files come in as bytes (hub_fetch reads them). Each pin's source: docs/design.md,
"How `kvpersist pins` derives the pins".

The chat template's digest is of its text, not a rendering (a rendering depends on the messages; the
same text always renders the same tokens); a --chat-template given to vLLM is not covered.
Every file is hostile: size bounds, malformed JSON and wrong types are a PinsError naming the file and field.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

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


def hub_fetch(token: str | None = None, cache_dir: str | None = None, local_files_only: bool = False) -> Fetch:
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
