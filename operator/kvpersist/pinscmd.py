"""`kvpersist pins MODEL@REVISION`: the spec.identity block, derived from the model's config.json and
its tokenizer's files at those commits (kvpersist.controller.pincheck), ready to paste. Only those small files
are fetched, through huggingface_hub (its cache, HF_HOME, HF_HUB_OFFLINE and HF_ENDPOINT apply);
a token comes from HF_TOKEN (or `hf auth login`) and is never printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvpersist.api import v1alpha1 as api
from kvpersist.api.identity import Identity
from kvpersist.controller import pincheck


def add_parser(sub: Any) -> None:
    cmd = sub.add_parser("pins", help="print the spec.identity block for MODEL@REVISION, derived from its Hub files",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd.add_argument("model", metavar="MODEL@REVISION", help="e.g. Qwen/Qwen3-8B@<40-hex commit>")
    cmd.add_argument("--tokenizer", metavar="TOKENIZER@REVISION", help="tokenizer repository (default: the model's)")
    cmd.add_argument("--resolve", action="store_true",
                     help="accept a branch or tag and print the commit it names now (the identity pins the commit)")
    cmd.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's --tensor-parallel-size (default 1)")
    cmd.add_argument("--block-size", type=int, default=None, help="vLLM's --block-size")
    cmd.add_argument("--kv-cache-dtype", default=None, help="vLLM's --kv-cache-dtype (default: the config's dtype)")
    cmd.add_argument("--max-model-len", type=int, default=None,
                     help="vLLM's --max-model-len (default: the config's max_position_embeddings)")
    cmd.add_argument("--connector-build", default=None, help="the connector and vLLM build, e.g. vllm-0.33.0+lmcache-0.5.6")
    cmd.add_argument("--cache-dir", default=None, help="huggingface_hub cache (default: HF_HUB_CACHE / HF_HOME)")
    cmd.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml",
                     help="yaml (default): the block to paste, with a comment on each pin it cannot tell; json: "
                          "{identity, unknown, notes} for scripts")
    cmd.set_defaults(fn=run)


def _split(value: str, what: str) -> tuple[str, str]:
    repo, at, revision = value.rpartition("@")
    if not at or not repo or not revision:
        raise pincheck.PinsError(f"{what} {value[:120]!r}: give the revision as {what}@<40-hex commit>")
    return repo, revision


def run(args: argparse.Namespace) -> int:
    token = os.environ.get("HF_TOKEN") or None
    fetch = pincheck.cache_fetch(token=token, cache_dir=args.cache_dir)
    try:
        model, revision = _split(args.model, "MODEL")
        tokenizer, tokenizer_revision = _split(args.tokenizer, "TOKENIZER") if args.tokenizer else (model, revision)
        revision = _commit(model, revision, "MODEL", args.resolve, token, args.cache_dir)
        tokenizer_revision = _commit(tokenizer, tokenizer_revision, "TOKENIZER", args.resolve, token, args.cache_dir)
        derived = pincheck.fetch_derived(fetch, model, revision, tokenizer, tokenizer_revision)
    except pincheck.PinsError as exc:
        print(f"kvpersist pins: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the Hub refused or was unreachable: say which, never the token
        print(f"kvpersist pins: {hub_error(exc)}", file=sys.stderr)
        return 1
    dtype = args.kv_cache_dtype or derived.dtype
    identity: dict[str, Any] = {
        "modelId": model, "modelRevision": revision,
        # The model's own tokenizer at its revision is the default: written only when it is another.
        **({"tokenizer": tokenizer, "tokenizerRevision": tokenizer_revision}
           if (tokenizer, tokenizer_revision) != (model, revision) else {}),
        "numKVHeads": derived.num_kv_heads, "headSize": derived.head_size,
        "maxModelLen": args.max_model_len or derived.max_model_len, "kvCacheDtype": dtype,
        "blockSize": args.block_size, "tensorParallelSize": args.tensor_parallel_size,
        "connectorBuild": args.connector_build, "chatTemplateDigest": derived.chat_template_digest,
    }
    given = {k: v for k, v in identity.items() if v is not None}
    try:
        Identity.model_validate(given)
    except ValidationError as exc:
        print(f"kvpersist pins: {api.validation_message(exc)}", file=sys.stderr)
        return 2
    if args.output == "json":
        unknown = {k: UNKNOWN[k] for k, v in identity.items() if v is None}
        print(json.dumps({"identity": given, "unknown": unknown, "notes": list(derived.notes)}, indent=2))
    else:
        sys.stdout.write(render(identity, derived))
    return 0


def _commit(repo: str, revision: str, what: str, resolve: bool, token: str | None, cache_dir: str | None) -> str:
    """The 40-hex commit revision is (a PinsError naming what otherwise); with resolve, a branch or tag is the commit it
    names now: the snapshot folder huggingface_hub files its config.json under."""
    if resolve and not pincheck.HEX40_RE.fullmatch(revision.strip().lower()):
        from huggingface_hub import hf_hub_download

        parts = Path(hf_hub_download(repo, pincheck.CONFIG, revision=revision, token=token, cache_dir=cache_dir)).parts
        revision = pincheck.check_revision(parts[parts.index("snapshots") + 1] if "snapshots" in parts else "", "resolved revision")
    return pincheck.check_revision(revision, f"{what}'s revision")


UNKNOWN = {
    "blockSize": "vLLM's --block-size as you run it (16 on most CUDA backends): pass --block-size",
    "connectorBuild": "the vLLM + LMCache build of your image, e.g. vllm-0.33.0+lmcache-0.5.6: pass --connector-build",
    "kvCacheDtype": "the config names no float16/bfloat16 dtype: pass --kv-cache-dtype",
    "maxModelLen": "the config names no max_position_embeddings: pass --max-model-len",
    "chatTemplateDigest": "the tokenizer has no chat template: leave it out only if you serve none "
                          "(a --chat-template given to vLLM is yours to digest)",
}


def render(identity: dict[str, Any], derived: pincheck.Derived) -> str:
    """The YAML block, each value as YAML writes it (a model id such as `1e5` or `yes` comes out quoted)."""
    lines = [f"# kvpersist pins: from {pincheck.CONFIG} at {identity['modelId']}@{identity['modelRevision']}"
             + (f" and {derived.template_source} at {identity.get('tokenizer', identity['modelId'])}"
                f"@{identity.get('tokenizerRevision', identity['modelRevision'])}"
                if derived.template_source else ""),
             "# numKVHeads, headSize and chatTemplateDigest come from those files (the operator checks them);",
             "# maxModelLen and kvCacheDtype are defaults from the config: change them to what vLLM runs with.",
             *(f"# note: {n}" for n in derived.notes),
             "identity:"]
    lines += [f"  # {key}: SET ME ({UNKNOWN[key]})" if value is None
              else "  " + yaml.safe_dump({key: value}, sort_keys=False, width=1 << 16).strip() for key, value in identity.items()]
    return "\n".join(lines) + "\n"


def hub_error(exc: BaseException) -> str:
    """What went wrong with the Hub, by kind: the status code and the fix, never a header or the token."""
    from huggingface_hub import errors as hf

    for kind, why in (
            (hf.GatedRepoError, "the repository is gated: accept its terms on the Hub and set HF_TOKEN to a token with access"),
            (hf.RepositoryNotFoundError,
             "no such repository, or it is private: check the id, or set HF_TOKEN to a token that can read it"),
            (hf.RevisionNotFoundError, "no such revision in the repository: give a commit it has"),
            (hf.OfflineModeIsEnabled, "HF_HUB_OFFLINE is set and the files are not in the cache: unset it once to fetch them")):
        if isinstance(exc, kind):  # the first that fits: a gated repository is also one not found
            return why
    if isinstance(exc, hf.HfHubHTTPError):
        return f"the Hub answered {exc.response.status_code if exc.response is not None else None}"
    return f"cannot read the files from the Hub ({type(exc).__name__}): check the network, HF_ENDPOINT and the proxy"
