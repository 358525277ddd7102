"""Build-time check of the vllm-lmcache image (its Dockerfile runs it): the installed vLLM, lmcache
and nixl are exactly the versions the image declares (KVPERSIST_*_VERSION, set from the build
args), the `lmcache` program the server container runs is on PATH, and lmcache's own
LMCacheMPConnector imports. The last matters because vLLM, when that import fails, falls back
without an error to a builtin copy of the connector, which need not match the server's protocol.

Standard library only until the connector import, so a version mismatch is reported before
anything heavy loads. Exits non-zero with one line per problem."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
import sys

# distribution -> the environment variable that declares its version
DECLARED = {"vllm": "KVPERSIST_VLLM_VERSION", "lmcache": "KVPERSIST_LMCACHE_VERSION", "nixl": "KVPERSIST_NIXL_VERSION"}
CONNECTOR = ("lmcache.integration.vllm.lmcache_mp_connector", "LMCacheMPConnector")


def version_problems(env: dict[str, str]) -> list[str]:
    """Each declared distribution that is missing or installed at another version."""
    problems = []
    for dist, var in DECLARED.items():
        want = env.get(var)
        if not want:
            problems.append(f"{var} is not set: the image does not declare its {dist} version")
            continue
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{dist} is not installed ({var}={want})")
            continue
        if have != want:
            problems.append(f"{dist} {have} is installed, the image declares {want} ({var})")
    return problems


def main() -> int:
    problems = version_problems(dict(os.environ))
    if shutil.which("lmcache") is None:
        problems.append("no `lmcache` program on PATH (the lmcache-server container runs it)")
    if not problems:
        module, name = CONNECTOR
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{name} does not import ({exc!r}): vLLM would use its builtin connector")
    for problem in problems:
        print(f"check_build: {problem}", file=sys.stderr)
    if not problems:
        print("check_build: " + ", ".join(f"{d} {os.environ[v]}" for d, v in DECLARED.items()) + ", LMCacheMPConnector from lmcache")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
