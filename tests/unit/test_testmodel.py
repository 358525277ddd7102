"""hack/testmodel.py: the offline test model resolves like a pinned Hub download, and its pins come from its files."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("torch")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[2]


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("testmodel", ROOT / "hack" / "testmodel.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModuleType, Path, dict]:
    tm = load()
    home = tmp_path_factory.mktemp("hf")
    return tm, home, tm.ensure("tiny", home)


def test_layout_is_a_hub_cache_entry(generated: tuple[ModuleType, Path, dict]) -> None:
    _, home, pins = generated
    repo = home / "hub" / "models--kvpersist--tiny-llama"
    rev = pins["modelRevision"]
    assert len(rev) == 40 and int(rev, 16) >= 0
    assert (repo / "refs" / "main").read_text() == rev
    snap = repo / "snapshots" / rev
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        f = snap / name
        assert f.is_symlink() and f.resolve().parent == (repo / "blobs").resolve()
        assert f.resolve().name == hashlib.sha256(f.read_bytes()).hexdigest()


def test_pins_are_read_from_the_files(generated: tuple[ModuleType, Path, dict]) -> None:
    tm, home, pins = generated
    snap = home / "hub" / "models--kvpersist--tiny-llama" / "snapshots" / pins["modelRevision"]
    config = json.loads((snap / "config.json").read_text())
    template = json.loads((snap / "tokenizer_config.json").read_text())["chat_template"]
    assert pins == {
        "modelId": "kvpersist/tiny-llama",
        "modelRevision": pins["modelRevision"],
        "tokenizer": "kvpersist/tiny-llama",
        "tokenizerRevision": pins["modelRevision"],
        "numKVHeads": config["num_key_value_heads"],
        "headSize": config["hidden_size"] // config["num_attention_heads"],
        "maxModelLen": 8192,
        "chatTemplateDigest": "sha256:" + hashlib.sha256(template.encode()).hexdigest(),
        "hfHome": str(home),
    }
    files = {p.name: p.read_bytes() for p in snap.iterdir()}
    assert tm.revision_of(files) == pins["modelRevision"]


def test_second_call_reuses_and_generation_is_deterministic(generated: tuple[ModuleType, Path, dict], tmp_path: Path) -> None:
    tm, home, pins = generated
    blob = next((home / "hub" / "models--kvpersist--tiny-llama" / "blobs").iterdir())
    before = blob.stat().st_mtime_ns
    assert tm.ensure("tiny", home) == pins
    assert blob.stat().st_mtime_ns == before
    again = tm.ensure("tiny", tmp_path)
    assert again["modelRevision"] == pins["modelRevision"]


def test_resolves_offline_with_huggingface_hub(generated: tuple[ModuleType, Path, dict]) -> None:
    hub = pytest.importorskip("huggingface_hub")
    _, home, pins = generated
    path = hub.try_to_load_from_cache("kvpersist/tiny-llama", "config.json", cache_dir=home / "hub", revision=pins["modelRevision"])
    assert isinstance(path, str) and json.loads(Path(path).read_text())["model_type"] == "llama"


def test_a_variant_is_another_revision_with_only_other_weights(generated: tuple[ModuleType, Path, dict]) -> None:
    """What tests/e2e/test_canary.py plants: another identity under the same model id, whose prompt
    tokens (and so lmcache's file names) are the same and whose KV is not."""
    tm, home, pins = generated
    repo = home / "hub" / "models--kvpersist--tiny-llama"
    base = {p.name: p.read_bytes() for p in (repo / "snapshots" / pins["modelRevision"]).iterdir()}
    variant = tm.ensure("tiny", home, variant=1)
    assert variant == {**pins, "modelRevision": variant["modelRevision"], "tokenizerRevision": variant["modelRevision"]}
    assert variant["modelRevision"] != pins["modelRevision"]
    files = {p.name: p.read_bytes() for p in (repo / "snapshots" / variant["modelRevision"]).iterdir()}
    assert tm.revision_of(files) == variant["modelRevision"]
    assert {n for n in files if files[n] != base[n]} == {"model.safetensors"}
    assert (repo / "refs" / "main").read_text() == pins["modelRevision"]  # the base entry is untouched
    assert {p.name: p.read_bytes() for p in (repo / "snapshots" / pins["modelRevision"]).iterdir()} == base
    assert tm.ensure("tiny", home, variant=1) == variant
