"""kvpersist.controller.pincheck's derivation and `kvpersist pins`: the pins derived from a model's config.json and its
tokenizer's files, read from a Hugging Face cache the test writes in huggingface_hub's layout
(tests/unit/hfcache.py), with HF_HUB_OFFLINE=1: no network."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvpersist.api.identity import Identity
from kvpersist.controller import pincheck
from tests.unit.hfcache import CONFIG, QWEN_REV, TEMPLATE, write_repo

ROOT = Path(__file__).resolve().parents[2]


def digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def derive(config: dict | bytes, **files: bytes | str | dict | None) -> pincheck.Derived:
    raw = {k.replace("_json", ".json").replace("_jinja", ".jinja"): (
        json.dumps(v).encode() if isinstance(v, dict) else v.encode() if isinstance(v, str) else v) for k, v in files.items()}
    return pincheck.derive(config if isinstance(config, bytes) else json.dumps(config).encode(), raw)


def test_geometry_and_template_of_a_plain_config() -> None:
    got = derive(CONFIG, tokenizer_config_json={"chat_template": TEMPLATE})
    assert (got.num_kv_heads, got.head_size, got.max_model_len, got.dtype) == (8, 128, 40960, "bfloat16")
    assert got.chat_template_digest == digest(TEMPLATE) and got.template_source == "tokenizer_config.json"


@pytest.mark.parametrize(("config", "heads", "size"), [
    ({"hidden_size": 4096, "num_attention_heads": 32}, 32, 128),  # no num_key_value_heads: MHA
    ({"hidden_size": 5120, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None}, 8, 160),  # head_dim null
    ({"hidden_size": 4544, "num_attention_heads": 71, "multi_query": True}, 1, 64),  # falcon
    ({"text_config": {"hidden_size": 2560, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
      "vision_config": {"hidden_size": 1152, "num_attention_heads": 16}}, 4, 256),  # multimodal: the text model's
    ({"num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "hidden_size": 7168}, 1, 576),  # MLA
])
def test_geometry_as_vllm_reads_it(config: dict, heads: int, size: int) -> None:
    got = derive(config)
    assert (got.num_kv_heads, got.head_size) == (heads, size)


def test_the_template_sources_in_transformers_order() -> None:
    jinja = "{{ messages[0]['content'] }}\r\n"
    files = {"chat_template_jinja": jinja, "chat_template_json": {"chat_template": "json one"},
             "tokenizer_config_json": {"chat_template": "config one"}}
    # chat_template.jinja first, read as text (\r\n -> \n) as transformers reads it
    assert derive(CONFIG, **files).chat_template_digest == digest("{{ messages[0]['content'] }}\n")
    assert derive(CONFIG, **{**files, "chat_template_jinja": None}).chat_template_digest == digest("json one")
    named = {"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]}
    got = derive(CONFIG, tokenizer_config_json=named)
    assert got.chat_template_digest == digest("plain")
    assert derive(CONFIG, tokenizer_config_json={"model_max_length": 8}).chat_template_digest is None


@pytest.mark.parametrize(("config", "files", "says"), [
    (b"{not json", {}, "config.json: not valid JSON"),
    (b"[1, 2]", {}, "config.json: a JSON object was expected, found list"),
    (b"\xff\xfe", {}, "config.json: not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, {}, "config.json: nested too deeply"),
    (b'{"num_attention_heads": 1' + b"0" * 5000 + b"}", {}, "config.json: not a usable JSON document"),
    (b" " * (4 << 20) + b"{}", {}, "more than the 4194304 a config.json may have"),
    (json.dumps({"num_attention_heads": "32", "hidden_size": 4096}).encode(), {}, "num_attention_heads must be a positive integer"),
    (json.dumps({"num_attention_heads": 32, "num_key_value_heads": True, "hidden_size": 4096}).encode(), {},
     "config.json: num_key_value_heads must be a positive integer, found true"),
    (json.dumps({"text_config": {"num_attention_heads": 0, "hidden_size": 8}}).encode(), {},
     "config.json: text_config.num_attention_heads must be a positive integer, found 0"),
    (json.dumps({"text_config": []}).encode(), {}, "config.json: text_config must be an object"),
    (json.dumps({"hidden_size": 100, "num_attention_heads": 3}).encode(), {}, "not a multiple of num_attention_heads"),
    (json.dumps({"vocab_size": 5}).encode(), {}, "neither num_key_value_heads nor num_attention_heads"),
    (json.dumps({**CONFIG, "torch_dtype": 16}).encode(), {}, "config.json: torch_dtype must be a string"),
    (json.dumps(CONFIG).encode(), {"tokenizer_config.json": b'{"chat_template": 7}'},
     "tokenizer_config.json: chat_template must be a string or a list"),
    (json.dumps(CONFIG).encode(), {"tokenizer_config.json": b'{"chat_template": [{"name": "x"}]}'},
     "tokenizer_config.json: chat_template[0] must be an object with string name and template"),
    (json.dumps(CONFIG).encode(), {"tokenizer_config.json": b'{"chat_template": [{"name": "x", "template": "t"}]}'},
     "none named 'default'"),
    (json.dumps(CONFIG).encode(), {"chat_template.json": b"]"}, "chat_template.json: not valid JSON"),
    (json.dumps(CONFIG).encode(), {"chat_template.jinja": b"\xc3("}, "chat_template.jinja: not UTF-8"),
    (json.dumps(CONFIG).encode(), {"chat_template.jinja": b"x" * ((1 << 20) + 1)}, "chat_template.jinja: 1048577 bytes"),
])
def test_hostile_files_are_refused_naming_the_file_and_field(config: bytes, files: dict, says: str) -> None:
    with pytest.raises(pincheck.PinsError) as err:
        pincheck.derive(config, files)
    assert says in str(err.value)


def test_rope_scaling_is_noted_never_applied() -> None:
    got = derive({**CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert got.max_model_len == 40960 and any("rope scaling (yarn, factor 4.0)" in n for n in got.notes)


@pytest.mark.parametrize("revision", ["main", "v1.0", "0123456789abcdef", "Z" * 40])
def test_a_revision_must_be_a_commit(revision: str) -> None:
    with pytest.raises(pincheck.PinsError, match="not a 40-character commit SHA"):
        pincheck.check_revision(revision, "MODEL's revision")


def test_hub_fetch_reads_a_local_cache_and_treats_absent_files_as_absent(tmp_path: Path) -> None:
    write_repo(tmp_path, "Qwen/Qwen3-8B", QWEN_REV, {"config.json": CONFIG, "tokenizer_config.json": {"chat_template": TEMPLATE}})
    fetch = pincheck.cache_fetch(cache_dir=str(tmp_path), local_files_only=True)
    got = pincheck.fetch_derived(fetch, "Qwen/Qwen3-8B", QWEN_REV, "Qwen/Qwen3-8B", QWEN_REV)
    assert (got.num_kv_heads, got.head_size, got.chat_template_digest) == (8, 128, digest(TEMPLATE))
    with pytest.raises(pincheck.PinsError, match=r"no config\.json at that revision"):
        pincheck.fetch_derived(fetch, "Qwen/Other", QWEN_REV, "Qwen/Other", QWEN_REV)


def pins_cli(tmp_path: Path, *argv: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path), HF_HOME=str(tmp_path / "home"),
               PYTHONPATH=f"{ROOT / 'operator'}{os.pathsep}{ROOT}")
    if token:
        env["HF_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "kvpersist.cli", "pins", *argv], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_the_cli_prints_an_identity_block_that_validates(tmp_path: Path) -> None:
    write_repo(tmp_path, "Qwen/Qwen3-8B", QWEN_REV, {"config.json": CONFIG, "chat_template.jinja": TEMPLATE})
    secret = "hf_" + "s3cr3t" * 6
    done = pins_cli(tmp_path, f"Qwen/Qwen3-8B@{QWEN_REV}", "--block-size", "16", "--connector-build",
                    "vllm-0.33.0+lmcache-0.5.6", token=secret)
    assert done.returncode == 0, done.stderr
    assert secret not in done.stdout + done.stderr
    identity = yaml.safe_load(done.stdout)["identity"]
    # The model's own tokenizer at its revision is the default: not written.
    assert identity == {"modelId": "Qwen/Qwen3-8B", "modelRevision": QWEN_REV, "numKVHeads": 8, "headSize": 128, "maxModelLen": 40960,
                        "kvCacheDtype": "bfloat16", "blockSize": 16, "tensorParallelSize": 1,
                        "connectorBuild": "vllm-0.33.0+lmcache-0.5.6",
                        "chatTemplateDigest": digest(TEMPLATE)}
    Identity.model_validate(identity)  # what it prints is a valid spec.identity


def test_the_cli_marks_the_pins_it_cannot_know(tmp_path: Path) -> None:
    tok_rev = "f" * 40
    write_repo(tmp_path, "org/model", QWEN_REV, {"config.json": {**CONFIG, "torch_dtype": "float32"}})
    write_repo(tmp_path, "org/tok", tok_rev, {"tokenizer_config.json": {"chat_template": "t"}})
    done = pins_cli(tmp_path, f"org/model@{QWEN_REV}", "--tokenizer", f"org/tok@{tok_rev}")
    assert done.returncode == 0, done.stderr
    assert "# connectorBuild: SET ME" in done.stdout and "# blockSize: SET ME" in done.stdout
    assert "# kvCacheDtype: SET ME" in done.stdout  # float32 is no KV dtype vLLM's auto would name here
    identity = yaml.safe_load(done.stdout)["identity"]
    assert identity["tokenizer"] == "org/tok" and identity["tokenizerRevision"] == tok_rev
    assert identity["chatTemplateDigest"] == digest("t") and "connectorBuild" not in identity


def test_the_cli_refuses_a_branch_and_resolves_it_when_asked(tmp_path: Path) -> None:
    write_repo(tmp_path, "Qwen/Qwen3-8B", QWEN_REV, {"config.json": CONFIG})
    done = pins_cli(tmp_path, "Qwen/Qwen3-8B@main")
    assert done.returncode == 2 and "'main' is not a 40-character commit SHA" in done.stderr
    done = pins_cli(tmp_path, "Qwen/Qwen3-8B")
    assert done.returncode == 2 and "give the revision as MODEL@<40-hex commit>" in done.stderr
    done = pins_cli(tmp_path, "Qwen/Qwen3-8B@main", "--resolve")
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout)["identity"]["modelRevision"] == QWEN_REV


def test_a_model_id_yaml_would_read_as_another_type_is_quoted(tmp_path: Path) -> None:
    write_repo(tmp_path, "yes", QWEN_REV, {"config.json": CONFIG})
    done = pins_cli(tmp_path, f"yes@{QWEN_REV}")
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout)["identity"]["modelId"] == "yes"


def test_the_cli_names_the_hostile_file_and_refuses_bad_flags(tmp_path: Path) -> None:
    write_repo(tmp_path, "org/bad", QWEN_REV, {"config.json": b'{"num_attention_heads": "many"}'})
    done = pins_cli(tmp_path, f"org/bad@{QWEN_REV}")
    assert done.returncode == 2 and "config.json: num_attention_heads must be a positive integer" in done.stderr
    write_repo(tmp_path, "org/good", QWEN_REV, {"config.json": CONFIG})
    done = pins_cli(tmp_path, f"org/good@{QWEN_REV}", "--kv-cache-dtype", "auto")
    assert done.returncode == 2 and "kvCacheDtype" in done.stderr
    done = pins_cli(tmp_path, f"org/missing@{QWEN_REV}")
    assert done.returncode == 2 and "no config.json at that revision" in done.stderr
