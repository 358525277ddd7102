"""images/vllm-lmcache/check_build.py, the vllm-lmcache image's build-time check, run against the
test venv's vLLM and lmcache (the contract extra pins the pair the image's build args default to):
it passes on the declared pair, loading lmcache's own LMCacheMPConnector, and fails on another
declared lmcache version or a missing declaration."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.contract
REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "images" / "vllm-lmcache"


def check(**declared: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPERSIST_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # the venv's `lmcache` program
    return subprocess.run([sys.executable, str(RECIPE / "check_build.py")], env={**env, **declared},
                          capture_output=True, text=True, timeout=300)


def test_the_build_check_accepts_the_declared_pair_and_refuses_another() -> None:
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", (RECIPE / "Dockerfile").read_text(), flags=re.MULTILINE))
    assert importlib.metadata.version("vllm") == args["VLLM_VERSION"]
    assert importlib.metadata.version("lmcache") == args["LMCACHE_VERSION"]
    # nixl comes unpinned with the datapath extra here; the image pins it (NIXL_VERSION).
    declared = {"KVPERSIST_VLLM_VERSION": args["VLLM_VERSION"], "KVPERSIST_LMCACHE_VERSION": args["LMCACHE_VERSION"],
                "KVPERSIST_NIXL_VERSION": importlib.metadata.version("nixl")}
    done = check(**declared)
    assert done.returncode == 0, done.stderr
    assert "LMCacheMPConnector from lmcache" in done.stdout
    done = check(**{**declared, "KVPERSIST_LMCACHE_VERSION": "0.0.1"})
    assert done.returncode == 1
    assert f"lmcache {args['LMCACHE_VERSION']} is installed, the image declares 0.0.1" in done.stderr
    done = check(**{k: v for k, v in declared.items() if k != "KVPERSIST_VLLM_VERSION"})
    assert done.returncode == 1 and "KVPERSIST_VLLM_VERSION is not set" in done.stderr
