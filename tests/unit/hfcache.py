"""A Hugging Face cache on disk, in huggingface_hub's layout (models--org--name/snapshots/<commit>/,
refs/<branch>), written by the tests: what `hf download` leaves, so hf_hub_download (offline, or
for a commit already there) reads the files from it and never the network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QWEN_REV = "0123456789abcdef0123456789abcdef01234567"
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
CONFIG: dict[str, Any] = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
                          "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
                          "torch_dtype": "bfloat16"}


def write_repo(cache: Path, repo: str, revision: str, files: dict[str, bytes | str | dict[str, Any]],
               branch: str | None = "main") -> Path:
    """The snapshot folder of repo at revision, holding files (a dict is written as JSON)."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        data = json.dumps(content).encode() if isinstance(content, dict) else (
            content.encode() if isinstance(content, str) else content)
        (snapshot / name).write_bytes(data)
    if branch:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / branch).write_text(revision)
    return snapshot
