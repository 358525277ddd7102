"""spec.vllm's environment against vLLM itself (0.33.0 in the test venv, and the 0.32.0 CPU build the
e2e tests run, KVPERSIST_VLLM_VENV): each VLLM_* name the API lets a user set is a variable vLLM
reads (a misspelt allow-list entry would let nothing through and say nothing), the refused ones
the API names are real vLLM variables too, and VLLM_API_KEY, which spec.vllm.apiKeySecretRef
renders instead of an --api-key flag, turns on vLLM's bearer-token check for the operator's own
launch line, parsed by vLLM's `vllm serve` parser."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvpersist.api.spec import VLLM_ENV_ALLOWED
from kvpersist.api.v1alpha1 import KVCacheNamespace
from kvpersist.builders.target import Target
from kvpersist.builders.vllm import API_KEY, vllm_args
from kvpersist.identity import key_fingerprint, resolve
from tests.cases.invalid_manifests import sample
from tests.contract.test_extra_args_oracle import interpreters

pytestmark = pytest.mark.contract

PROBE = r'''
import json, sys
from argparse import Namespace
import vllm.platforms
from vllm.platforms.cpu import CpuPlatform
vllm.platforms._current_platform = CpuPlatform()
import vllm.envs as envs
from fastapi import FastAPI
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(parser.add_subparsers(required=False, dest="subparser"))
args = parser.parse_args(json.loads(sys.argv[1]))
app = FastAPI()
init_entrypoints_middleware(args, app, ("generate",))
tokens = [m.kwargs.get("tokens") for m in app.user_middleware if m.cls.__name__ == "AuthenticationMiddleware"]
print(json.dumps({"variables": sorted(envs.environment_variables), "api_key_arg": args.api_key, "tokens": tokens}))
'''


@pytest.mark.parametrize("python", interpreters())
def test_the_env_allow_list_and_the_api_key_are_vllms_own(python: str) -> None:
    obj = sample()
    obj["spec"]["vllm"]["apiKeySecretRef"] = {"name": "vllm-api"}
    spec = KVCacheNamespace.model_validate(obj).spec
    args = vllm_args(Target("m", "ml", spec, resolve(spec.pins(key_fingerprint(b"k" * 32))).namespace_id))
    key = "sk-contract-" + os.urandom(4).hex()
    out = subprocess.run([python, "-c", PROBE, json.dumps(args)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", API_KEY: key})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    variables = set(seen["variables"])
    assert set(VLLM_ENV_ALLOWED) <= variables, set(VLLM_ENV_ALLOWED) - variables
    # Refused names vLLM does read: the model's source, where the KV lives (the IPC), the API key's own field.
    assert {"VLLM_USE_MODELSCOPE", "VLLM_ENABLE_V1_MULTIPROCESSING", API_KEY} <= variables
    # No --api-key in the operator's line, and the key from the environment guards the API.
    assert seen["api_key_arg"] in (None, [])
    assert seen["tokens"] == [[key]], seen["tokens"]
