"""hack/gpu-smoke.sh parses (shellcheck: tests/unit/test_shell_scripts.py), refuses bad input
before touching a cluster, and its in-pod probe reads lmcache's /status and vLLM's counters as
they are spelled; docs/gpu-cluster.md names only chart values and spec/status fields that exist
(the chart's values.yaml and the generated CRD)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import stat
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.serving import in_thread

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "gpu-smoke.sh"
DOC = ROOT / "docs" / "gpu-cluster.md"
VALUES = ROOT / "charts" / "kvpersist" / "values.yaml"
CRD = ROOT / "crds" / "kvcachenamespaces.kvpersist.dev.yaml"


# ---------------------------------------------------------------- the script


def _run(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env)


def test_usage_without_a_name_exits_2() -> None:
    out = _run([])
    assert out.returncode == 2
    assert "KUBECONFIG=... bash hack/gpu-smoke.sh NAME [NAMESPACE]" in out.stderr


def test_a_resource_that_is_not_ready_stops_before_any_step(tmp_path: Path) -> None:
    """A stand-in kubectl answers the one read the script makes first; the script must print the
    conditions and exit 2 without running a step (and without calling kubectl again)."""
    body = {"spec": {"identity": {"modelId": "m"}}, "status": {"phase": "Progressing", "namespaceId": "kvp-" + "0" * 32,
            "conditions": [{"type": "LMCacheReady", "status": "False", "reason": "ServersStarting",
                            "message": "0/1 servers ready"}]}}
    calls = tmp_path / "calls"
    fake = tmp_path / "kubectl"
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\ncat <<'EOF'\n{json.dumps(body)}\nEOF\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = _run(["tiny", "ml"], {"KUBECTL": str(fake)})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "LMCacheReady" in out.stderr and "ServersStarting: 0/1 servers ready" in out.stderr
    assert "PASS" not in out.stdout and "FAIL" not in out.stdout
    assert calls.read_text().splitlines() == ["-n ml --request-timeout=30s get kvcachenamespaces tiny -o json"]


# ---------------------------------------------------------------- the probe it runs in the pods


def _probe_source() -> str:
    text = SCRIPT.read_text()
    match = re.search(r"^PROBE='\n(.*?)^'$", text, re.M | re.S)
    assert match, "PROBE='...' not found in the script"
    return match.group(1)


class _Stub(BaseHTTPRequestHandler):
    """A STAND-IN for lmcache's admin API and vLLM's OpenAI server, answering with the shapes
    lmcache 0.5.6 and vLLM use: /status (MPCacheServer.report_status with the engine-driven
    module's keys), /metrics (Prometheus text with labels), /v1/models, /v1/completions."""

    completions = 0

    def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/status":
            self._send(200, json.dumps({
                "is_healthy": True, "chunk_size": 256, "registered_gpu_ids": [],
                "registered_non_cuda_instance_ids": [1378796116056158149],
                "storage_manager": {"is_healthy": True, "store_controller": {"pending_keys_count": 1,
                                                                             "in_flight_task_count": 2}}}))
        elif self.path == "/metrics":
            hits = 2304 * _Stub.completions
            self._send(200, "\n".join([
                "# HELP vllm:external_prefix_cache_hits_total External prefix cache hits",
                "# TYPE vllm:external_prefix_cache_hits_total counter",
                f'vllm:external_prefix_cache_hits_total{{engine="0",model_name="m"}} {float(hits)}',
                'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0',
                'vllm:external_prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9',
                f'lmcache_mp_lookup_hit_l2_tokens_total{{cache_salt="",model_name="m"}} {hits}',
                f'lmcache_mp_lookup_hit_l2_tokens_total{{cache_salt="x",model_name="m"}} {hits}',
            ]) + "\n", "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"data": [{"id": "kvpersist/tiny-llama"}]}))
        else:
            self._send(404, "{}")

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        request = json.loads(self.rfile.read(length))
        assert request["model"] == "kvpersist/tiny-llama" and request["max_tokens"] == 1
        _Stub.completions += 1
        self._send(200, json.dumps({"usage": {"prompt_tokens": 2413, "completion_tokens": 1}}))

    def log_message(self, *args: Any) -> None:
        pass


def _probe(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _probe_source(), *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_probe_reads_status_metrics_and_counts_a_requests_hits() -> None:
    _Stub.completions = 0
    with in_thread(ThreadingHTTPServer(("127.0.0.1", 0), _Stub)) as port:
        base = f"http://127.0.0.1:{port}"
        assert _probe("status", base) == {"healthy": True, "gpu": [], "cpu": ["1378796116056158149"], "pending": 3}
        metrics = _probe("metrics", base)
        assert metrics["vllm:external_prefix_cache_hits_total"] == 0.0
        assert metrics["lmcache_mp_lookup_hit_l2_tokens_total"] == 0.0
        answer = _probe("ask", base, "50", "run-1")
        assert answer["model"] == "kvpersist/tiny-llama" and answer["prompt_tokens"] == 2413
        assert answer["external"] == 2304 and answer["own"] == 0  # _created is not a hit counter
        assert _probe("metrics", base)["lmcache_mp_lookup_hit_l2_tokens_total"] == 2 * 2304.0  # summed over labels


def _package_dir(name: str) -> Path:
    """Where an installed package's source is, without importing it (vLLM's import is slow)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        pytest.skip(f"{name} is not installed here")
    return Path(spec.origin).parent


def test_the_probe_names_what_lmcache_and_vllm_export() -> None:
    """The probe's metric and status names are the ones the pinned lmcache and vLLM define, where
    they are installed (the test venv); each name must be found in their source."""
    probe = _probe_source()
    lm_root = _package_dir("lmcache")
    status_keys = ("registered_gpu_ids", "registered_non_cuda_instance_ids", "pending_keys_count", "in_flight_task_count")
    sources = "\n".join(p.read_text(errors="replace") for p in (lm_root / "v1").rglob("*.py"))
    for key in status_keys:
        assert key in probe and f'"{key}"' in sources, key
    # lmcache's OTel instruments (`lmcache_mp.lookup_hit_l1`, unit tokens) reach Prometheus as
    # name + "_" + unit + "_total", dots as underscores.
    instruments = set(re.findall(r'"lmcache_mp\.([a-z0-9_]+)"', sources))
    for name in re.findall(r'"lmcache_mp_([a-z0-9_]+)_total"', probe):
        base, _, unit = name.rpartition("_")
        assert base in instruments and unit.isalpha(), name
    loggers = (_package_dir("vllm") / "v1" / "metrics" / "loggers.py").read_text()
    for name in re.findall(r'"(vllm:[a-z_]+)_total"', probe):
        assert f'name="{name}"' in loggers, name


# ---------------------------------------------------------------- the doc names only what exists


def _values_paths() -> set[str]:
    out: set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, sub in node.items():
                path = f"{prefix}.{key}" if prefix else str(key)
                out.add(path)
                walk(sub, path)

    walk(yaml.safe_load(VALUES.read_text()), "")
    return out


def _schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _schema_has(schema: dict[str, Any], path: list[str]) -> bool:
    node = schema
    for part in path:
        if node.get("type") == "array":
            node = node.get("items", {})
        if part in node.get("properties", {}):
            node = node["properties"][part]
        elif isinstance(node.get("additionalProperties"), dict) or node.get("additionalProperties") is True:
            node = node["additionalProperties"] if isinstance(node["additionalProperties"], dict) else {}
        else:  # a free-form object takes any key below it
            return bool(node.get("x-kubernetes-preserve-unknown-fields"))
    return True


def _yaml_keys(node: Any, prefix: list[str]) -> list[list[str]]:
    out = []
    if isinstance(node, dict):
        for key, sub in node.items():
            out.append([*prefix, str(key)])
            out += _yaml_keys(sub, [*prefix, str(key)])
    elif isinstance(node, list):
        for item in node:
            out += _yaml_keys(item, prefix)
    return out


FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
CHART_MARK = "# kvpersist chart values"


def unknown_names(text: str) -> list[str]:
    """Every chart value, spec field and status field the text names that does not exist:
    - `spec.a.b` / `status.a.b` in backticks, and `kubectl explain kvcachenamespace.spec.a`;
    - keys of a ```yaml block holding `kind: KVCacheNamespace` (under spec and metadata);
    - `--set a.b=...` of a helm command, keys of a ```yaml block whose first line is
      `# kvpersist chart values`, and prose of the form chart value `a.b`."""
    schema, values = _schema(), _values_paths()
    bad: list[str] = []
    for ref in re.findall(r"`((?:spec|status)\.[A-Za-z0-9_.]+)`", text) + \
            re.findall(r"kvcachenamespace\.((?:spec|status)\.[A-Za-z0-9_.]+)", text):
        if not _schema_has(schema, ref.rstrip(".").split(".")):
            bad.append(ref)
    for lang, block in FENCE.findall(text):
        if lang in ("yaml", "yml") and block.startswith(CHART_MARK):
            for path in _yaml_keys(yaml.safe_load(block), []):
                if ".".join(path) not in values:
                    bad.append("values: " + ".".join(path))
        elif lang in ("yaml", "yml") and re.search(r"^kind: KVCacheNamespace$", block, re.M):
            for doc in yaml.safe_load_all(block):
                for path in _yaml_keys(doc.get("spec", {}), ["spec"]):
                    if not _schema_has(schema, path):
                        bad.append(".".join(path))
    for key in re.findall(r"--set(?:-string)? ([A-Za-z0-9_.\[\]]+)=", text) + \
            re.findall(r"chart value `([A-Za-z0-9_.]+)`", text):
        if re.sub(r"\[\d+\]", "", key) not in values:
            bad.append("values: " + key)
    return bad


def test_the_checker_finds_names_that_do_not_exist() -> None:
    text = ("`spec.lmcacheServer.gpuCount` and `status.hits.hitTokens`, chart value `cacheFallbackSecs`, "
            "`helm install x --set allowedImage[0]=a`\n```yaml\nkind: KVCacheNamespace\nspec:\n  l2:\n"
            "    nvme: {sizeGB: 1}\n```\n```yaml\n# kvpersist chart values\nmetrics:\n  prot: 1\n```\n")
    assert unknown_names(text) == ["spec.lmcacheServer.gpuCount", "spec.l2.nvme.sizeGB", "values: metrics.prot",
                                   "values: allowedImage[0]", "values: cacheFallbackSecs"]


def test_the_gpu_cluster_doc_names_only_what_exists() -> None:
    text = DOC.read_text()
    # It does name them (a doc that named nothing would pass vacuously).
    assert len(re.findall(r"`spec\.", text)) >= 10 and re.search(r"chart value `", text) and CHART_MARK in text
    assert unknown_names(text) == []


def test_the_gpu_cluster_doc_links_what_exists() -> None:
    text = DOC.read_text()
    for target in re.findall(r"\]\(((?!https?:)[^)#]+)(?:#[^)]*)?\)", text):
        assert (DOC.parent / target).resolve().exists(), target
    for match in re.finditer(r"`((?:hack|config/samples|images|charts|benchmarks|docs|operator)/[\w./-]+\.\w+)`", text):
        elsewhere = re.match(r"\s+in\s+(the\s+LMCache\s+repository|NVIDIA/)", text[match.end():])
        assert elsewhere or (ROOT / match.group(1)).exists(), match.group(1)
