"""benchmarks/gpu_wheels.py: the wheels carried to a GPU machine are pinned and hashed, kept in step
with the images' own versions, and installed offline only when their hashes match (issue 56 item 5).
The install is shown with pip itself on a wheel made here; the real set in a clean Python 3.12 with
torch alone is `python3 benchmarks/gpu_wheels.py check` (benchmarks/RESULTS.md)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_wheels_under_test", ROOT / "benchmarks" / "gpu_wheels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lock_pins_and_hashes_what_the_list_names() -> None:
    gw = _module()
    entries = gw.lock_entries()
    lines = (x.split("#", 1)[0].strip() for x in (ROOT / "benchmarks" / "gpu-wheels.in").read_text().splitlines())
    listed = {gw.norm(line.split("==")[0]): line.split("==")[1].strip() for line in lines if line}
    assert {n: re.search(r"==(\S+)", r).group(1) for n, r in entries.items()} == listed  # `bash hack/lock.sh gpu-wheels` is run
    dockerfile = (ROOT / "images" / "vllm-lmcache" / "Dockerfile").read_text()
    assert listed["lmcache"] == re.search(r"ARG LMCACHE_VERSION=(\S+)", dockerfile).group(1)
    operator_lock = (ROOT / "operator" / "requirements.lock").read_text()
    assert listed["pydantic"] == re.search(r"^pydantic==(\S+)", operator_lock, re.M).group(1)
    assert "cryptography" in listed and "torch" not in listed and "nixl" not in listed


def _wheel(folder: Path, name: str, body: str) -> Path:
    """A minimal pure-Python wheel of one module, as pip builds them."""
    dist = f"{name}-1.0.dist-info"
    files = {f"{name}.py": body.encode(), f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}\n"
                     for p, b in files.items()) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, b in files.items():
            z.writestr(p, b)
        z.writestr(f"{dist}/RECORD", record)
    return path


def test_install_takes_only_wheels_whose_hash_the_lock_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gw = _module()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    good = _wheel(wheels, "kvp_carried", "VALUE = 'carried'\n")
    lock = tmp_path / "gpu-wheels.lock"
    lock.write_text(f"kvp-carried==1.0 \\\n    --hash=sha256:{hashlib.sha256(good.read_bytes()).hexdigest()}\n")
    monkeypatch.setattr(gw, "LOCK", lock)
    facts = gw.install([wheels], tmp_path / "site")
    assert facts["installed"] == ["kvp-carried"]
    env = gw.with_target(tmp_path / "site")
    out = subprocess.run([sys.executable, "-c", "import kvp_carried; print(kvp_carried.VALUE)"],
                         capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "carried", out.stderr

    # Another wheel under the same name and version (a changed file): refused, nothing installed.
    good.unlink()
    _wheel(wheels, "kvp_carried", "VALUE = 'swapped'\n")
    with pytest.raises(subprocess.CalledProcessError):
        gw.install([wheels], tmp_path / "site2")
    assert not (tmp_path / "site2" / "kvp_carried.py").exists()
