"""The user guide's path (docs/user-guide.md, sections 1 and 2), each command as written, on the
local cluster: a step the guide changes is a step this test runs, so the page cannot drift from
what the chart, the CLI and the operator do.

Run as written (bash -e, from the repository root, the local cluster's kubectl and helm): the
namespace and its Pod Security label, `helm install`, the token Secret, the two-pin manifest, and
`kubectl apply` of it. What cannot run here, and what stands in:
- step 1 (`pipx install .`): this venv's kvpersist is on PATH;
- step 2 (docker build and push): no docker or registry here; REG, OPERATOR_DIGEST and IMAGE are set
  to what the step leaves (made-up digests: kwok runs no container, so nothing pulls them);
- the Hugging Face Hub: tests/integration/hub_stub.py (a stand-in serving the model's config.json
  and tokenizer_config.json at the guide's commit, gated as Llama is: only to the token step 5
  stores), as HF_ENDPOINT;
- the chart's operator pod is kwok's (Ready, running nothing): the operator runs as a process with
  the chart's ServiceAccount and the Deployment's own environment, as tests/e2e/test_helm.py does;
- `--set crds.enabled=false` is added to `helm install`: the CRD is this session's, no release's;
- steps 7 and 8 need GPU nodes (marked so in the guide): step 7's `kubectl apply` runs, its
  `kubectl get -w` is a bounded wait for the cache to be on instead (Ready needs vLLM on a GPU);
  step 8 is not run, but what it names (the Service and port, the pod labels, the request body)
  is checked against what the operator made.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.kube import REPO, Kubectl, bin_dir, wait_for
from tests.e2e.operator_env import start_operator, stop
from tests.integration.hub_stub import HubStub

pytestmark = pytest.mark.e2e
GUIDE = REPO / "docs" / "user-guide.md"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def steps(text: str) -> dict[int, tuple[str, list[str]]]:
    """Step number -> (its heading, its sh blocks), from sections 1 and 2 of the guide."""
    path = text[text.index("## 1. "):text.index("## 3. ")]
    found: dict[int, tuple[str, list[str]]] = {}
    for m in re.finditer(r"^\*\*Step (\d+)([^*]*)\*\*(.*?)(?=^\*\*Step |\Z)", path, re.S | re.M):
        found[int(m.group(1))] = (m.group(2), re.findall(r"^```sh\n(.*?)^```", m.group(3), re.S | re.M))
    return found


def test_the_guide_lists_its_steps_in_order_and_marks_the_gpu_ones() -> None:
    found = steps(GUIDE.read_text())
    assert list(found) == list(range(1, 9)), list(found)
    assert [n for n, (head, _) in found.items() if "(GPU nodes)" in head] == [7, 8]
    assert all(blocks for _, blocks in found.values()), "a step without its commands"


def _bash(script: str, env: dict[str, str], timeout: float = 300) -> str:
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{script}\n--- exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_the_first_resource_as_the_guide_walks_it(kubectl: Kubectl, crd: None, tmp_path: Path) -> None:
    found = steps(GUIDE.read_text())
    reg = "registry.example.com/kvpersist"
    image = f"{reg}/vllm-lmcache:vllm-0.33.0-lmcache-0.5.6@sha256:{'ab' * 32}"
    env = {**os.environ, "PATH": f"{bin_dir()}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "KUBECONFIG": str(kubectl.kubeconfig), "REG": reg, "OPERATOR_DIGEST": f"sha256:{'cd' * 32}", "IMAGE": image,
           "HOME": str(tmp_path)}  # no one's kubeconfig or Hugging Face login
    work = tmp_path / "checkout"
    operator = None
    with HubStub(token="hf_...") as hub:  # the token step 5 stores, as the guide writes it
        hub.gated.add("meta-llama/Llama-3.1-8B-Instruct")
        hub.models[("meta-llama/Llama-3.1-8B-Instruct", "0e9e39f249a16976918f6564b8830bc894c89659")] = {
            "config.json": json.dumps({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                                       "head_dim": 128, "max_position_embeddings": 131072,
                                       "torch_dtype": "bfloat16"}).encode(),
            "tokenizer_config.json": json.dumps({"chat_template": TEMPLATE}).encode()}
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"))
        env.pop("HF_HUB_OFFLINE", None)  # the tests' default; a user's pins read the Hub (here, its stand-in)
        try:
            ran = []
            for number in (3, 4, 5, 6):
                for block in found[number][1]:
                    if number == 4:
                        block = block.replace("helm install kvpersist charts/kvpersist",
                                              "helm install kvpersist charts/kvpersist --set crds.enabled=false")
                        assert "crds.enabled=false" in block, block
                    if number == 6:  # the manifest is written into a scratch folder, not the checkout
                        work.mkdir(exist_ok=True)
                        block = block.replace("> llama31-8b.yaml", f"> {work}/llama31-8b.yaml").replace(
                            ">> llama31-8b.yaml", f">> {work}/llama31-8b.yaml")
                    ran.append((number, _bash(block, env)))
            written = yaml.safe_load((work / "llama31-8b.yaml").read_text())
            assert sorted(written["spec"]) == ["identity", "image", "l1", "l2", "vllm"], written
            assert sorted(written["spec"]["identity"]) == ["modelId", "modelRevision"], written

            # The operator as the chart runs it: its ServiceAccount, its Deployment's environment.
            deployment = kubectl.get("deployment", "kvpersist", "kvpersist-system")
            [container] = deployment["spec"]["template"]["spec"]["containers"]
            chart_env = {e["name"]: e["value"] for e in container.get("env", []) if e.get("value")}
            sa = kubectl.as_service_account("kvpersist-system", "kvpersist", tmp_path / "sa.kubeconfig").kubeconfig
            operator = start_operator(sa, "ml", tmp_path / "operator.log",
                                      {**chart_env, "HF_ENDPOINT": hub.url, "KVPERSIST_OPERATOR_NAMESPACE": "kvpersist-system"})

            # Step 7 (GPU nodes): the apply runs; the watch is a bounded wait for the cache to be on.
            [apply_block] = found[7][1]
            applies = [line for line in apply_block.splitlines() if line.startswith("kubectl apply")]
            assert applies == ["kubectl apply -n ml -f llama31-8b.yaml"], apply_block
            _bash(f"cd {shlex.quote(str(work))} && {applies[0]}", env)
            status = wait_for("the cache on: IdentityResolved True with a namespace id", lambda: (
                lambda s: s if s.get("namespaceId") and any(c["type"] == "IdentityResolved" and c["status"] == "True"
                                                            for c in s.get("conditions", [])) else None)(
                kubectl.get("kvns", "llama31-8b", "ml").get("status") or {}), timeout=180,
                explain=lambda: json.dumps(kubectl.get("kvns", "llama31-8b", "ml").get("status"))[:2000])
            assert re.fullmatch(r"kvp-[0-9a-f]{32}", status["namespaceId"])
            digest = "sha256:" + hashlib.sha256(TEMPLATE.encode()).hexdigest()
            assert status["identity"]["pins"] == {**written["spec"]["identity"], "numKVHeads": 8, "headSize": 128,
                                                  "chatTemplateDigest": digest, "maxModelLen": 131072,
                                                  "kvCacheDtype": "bfloat16", "blockSize": 16, "tensorParallelSize": 1,
                                                  "connectorBuild": image.partition("@")[2]}, status["identity"]

            # Step 8 (GPU nodes) is not run: what it names is what the operator made.
            [ask_block] = found[8][1]
            service = kubectl.get("service", "llama31-8b-vllm", "ml")
            assert "svc/llama31-8b-vllm 8000:8000" in ask_block and [p["port"] for p in service["spec"]["ports"]] == [8000]
            pod_labels = kubectl.get("deployment", "llama31-8b-vllm", "ml")["spec"]["template"]["metadata"]["labels"]
            for selector in re.findall(r"-l (\S+)", ask_block):
                assert all(pod_labels.get(k) == v for k, v in (kv.split("=") for kv in selector.split(","))), selector
            body = re.search(r"-d \"(\{.*\})\"", ask_block).group(1)  # type: ignore[union-attr]
            request = json.loads(body.replace('\\"', '"').replace("$PROMPT", "1 2 3"))
            assert request["model"] == "meta-llama/Llama-3.1-8B-Instruct" and request["temperature"] == 0
            [vllm] = kubectl.get("deployment", "llama31-8b-vllm", "ml")["spec"]["template"]["spec"]["containers"][:1]
            assert vllm["image"] == image and "--kv-transfer-config" in vllm["args"]
        finally:
            if operator is not None:
                stop(operator)
            subprocess.run([str(bin_dir() / "helm"), "uninstall", "kvpersist", "-n", "kvpersist-system", "--kubeconfig",
                            str(kubectl.kubeconfig)], capture_output=True, timeout=120)
            for ns in ("ml", "kvpersist-system"):
                kubectl.run("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)
