"""kvpersist.inserver.lmcache_internals: every lmcache name kvpersist's server uses, checked against
the installed lmcache before the server starts; a difference (or an lmcache release not tested)
refuses to start the way the build check does, and the operator shows it as BuildVerified False.
The real server with the check passing: tests/integration/test_l2_serde.py, test_l2_bound.py and
test_build_check.py."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpersist.builders import buildcheck
from kvpersist.builders.lmcache import SERVE_ENV, server_container
from kvpersist.builders.target import SERVER
from kvpersist.inserver import PROGRAM_MODULES, lmcache_internals, module_source, program_source, serve
from kvpersist.inserver.lmcache_internals import EXIT_CODE, INTERNALS, MISMATCH_PREFIX, Mismatch, check
from kvpersist.status import build as buildstatus
from tests.unit.test_buildcheck import NID, build_conds, refused_pod
from tests.unit.test_builders import target

ROOT = Path(__file__).resolve().parents[2]
INSERVER = ROOT / "operator" / "kvpersist" / "inserver"
BUILD = "vllm-0.33.0+lmcache-0.5.6"


def lmcache_imports(path: Path) -> list[str]:
    """Where a module imports lmcache (anywhere in it), by line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [f"{path.name}:{node.lineno}" for n in names if n.split(".")[0] == "lmcache"]
    return found


def missing_names(message: str) -> list[str]:
    """The internals a refusal_message names."""
    return [name for name in INTERNALS if f"{name}: " in message]


def test_serve_reaches_lmcache_only_through_the_internals_module() -> None:
    """One place: serve.py imports no lmcache name itself, and every lmcache module the accessors
    reach is one a record names (so docs/datapath.md lists it)."""
    assert lmcache_imports(INSERVER / "serve.py") == []
    assert "lmcache_internals" in PROGRAM_MODULES and PROGRAM_MODULES[-1] == "serve"
    reached = set(re.findall(r'_get\("(lmcache[\w.]*)"', module_source("lmcache_internals")))
    assert reached, "the accessors reach lmcache through _get"
    named = internals_section()
    assert {m for m in reached if m not in named} == set()


def test_the_refusal_is_the_build_checks() -> None:
    """The operator reads the server's refusal with the build check's prefix and exit code
    (kvpersist.status.build); the server's image has no kvpersist, so they are copied there."""
    assert MISMATCH_PREFIX == buildcheck.MISMATCH_PREFIX and EXIT_CODE == buildcheck.EXIT_CODE
    assert serve.TERMINATION_LOG_ENV == buildcheck.TERMINATION_LOG_ENV


def internals_section() -> str:
    text = (ROOT / "docs" / "datapath.md").read_text()
    assert "## lmcache internals" in text
    return text.split("## lmcache internals", 1)[1].split("\n## ", 1)[0]


def test_the_docs_list_every_internal_with_where_why_and_its_upstream_change() -> None:
    assert "SerdeL2AdapterWrapper" in INTERNALS and "ObjectKey" in INTERNALS
    rows = {line.split("|")[1].strip().strip("`"): line for line in internals_section().splitlines() if line.startswith("| ")}
    assert set(INTERNALS) <= set(rows), sorted(set(INTERNALS) - set(rows))
    for name in INTERNALS:
        where, why, upstream = (cell.strip() for cell in rows[name].split("|")[2:5])
        assert where.strip("`").startswith("lmcache.") and len(why) > 20 and len(upstream) > 20, rows[name]
    for tested in lmcache_internals.TESTED_LMCACHE:
        assert tested in internals_section()


# ---------------------------------------------------------------- the message the operator reads


def test_the_refusal_message_names_what_differs_within_the_operators_bound() -> None:
    found = [Mismatch("SerdeL2AdapterWrapper", "lmcache.v1.distributed.storage_manager has no SerdeL2AdapterWrapper"),
             Mismatch("ObjectKey", "ObjectKey has fields (a, b), kvpersist expects (c)")]
    message = lmcache_internals.refusal_message(found, version="0.5.6")
    assert message.startswith(MISMATCH_PREFIX + "lmcache 0.5.6 in this container differs")
    assert "2 internal(s) (SerdeL2AdapterWrapper, ObjectKey)" in message
    assert missing_names(message) == ["ObjectKey", "SerdeL2AdapterWrapper"]
    assert "lmcache 0.5.6 (images/vllm-lmcache)" in message and "docs/datapath.md" in message
    # Many long problems: cut, but the names of what differs come first and the advice stays.
    many = [Mismatch(name, "x" * 300) for name in INTERNALS]
    long = lmcache_internals.refusal_message(many, version="0.5.6")
    assert len(long) <= lmcache_internals.MESSAGE_MAX and " ..." in long and long.endswith("tested with this lmcache")
    assert all(name in long for name in INTERNALS)
    # Only the version: said so.
    only = lmcache_internals.refusal_message(check({}, version="0.6.0"), version="0.6.0")
    assert only.startswith(MISMATCH_PREFIX + "lmcache 0.6.0 in this container is not a release kvpersist's server was "
                           "tested with (0.5.6)")


def test_a_refusing_server_is_build_verified_false_naming_the_missing_internal() -> None:
    """Through the operator's own reading of the pod (kvpersist.status.build, conditions)."""
    message = lmcache_internals.refusal_message(
        [Mismatch("SerdeL2AdapterWrapper", "lmcache.v1.distributed.storage_manager has no SerdeL2AdapterWrapper")],
        version="0.5.6")
    pod = refused_pod("r-lmcache-0", SERVER, "lmcache-server", message=message)
    found = tuple(buildstatus.refusals([pod], NID))
    assert [(r.pod, r.component) for r in found] == [("r-lmcache-0", SERVER)]
    phase, c = build_conds(buildstatus.BuildVerdict(BUILD, refusals=found))
    cond = c["BuildVerified"]
    assert (cond["status"], cond["reason"], phase) == ("False", "BuildMismatch", "Degraded")
    assert "r-lmcache-0 (lmcache-server)" in cond["message"]
    assert "storage_manager has no SerdeL2AdapterWrapper" in cond["message"]


# ---------------------------------------------------------------- against the installed lmcache


@pytest.fixture
def lm() -> Any:
    return pytest.importorskip("lmcache.v1.distributed.storage_manager")


def names(found: list[Mismatch]) -> list[str]:
    return [m.name for m in found]


def test_check_passes_on_the_installed_lmcache(lm: Any) -> None:
    assert lmcache_internals.public_version(lmcache_internals.installed_version() or "") in lmcache_internals.TESTED_LMCACHE
    assert check() == []


def test_another_release_refuses_even_when_every_internal_checks_out(lm: Any) -> None:
    assert [str(m) for m in check(version="0.5.7")] == [
        "lmcache version: 0.5.7 is not one kvpersist's server was tested with (0.5.6)"]
    assert check(version="0.5.6+cu128") == []  # a local build of the tested release
    assert names(check(version="0.5.6rc1")) == [lmcache_internals.VERSION]


def test_a_missing_class_is_reported(lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(lm, "SerdeL2AdapterWrapper")
    found = check()
    assert names(found) == ["SerdeL2AdapterWrapper"]
    assert "lmcache.v1.distributed.storage_manager has no SerdeL2AdapterWrapper" in found[0].problem


def test_a_replaced_method_with_another_signature_is_reported(lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def submit_load_task(self: Any, keys: list, objs: list) -> int:
        return 0

    monkeypatch.setattr(lm.SerdeL2AdapterWrapper, "submit_load_task", submit_load_task)
    found = check()
    assert names(found) == ["SerdeL2AdapterWrapper"]
    assert found[0].problem == ("SerdeL2AdapterWrapper.submit_load_task takes (keys, objs), kvpersist calls it with "
                                "(keys, objects)")


def test_a_constructor_with_a_new_required_parameter_is_reported(lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    original = lm.SerdeL2AdapterWrapper.__init__

    def __init__(self: Any, inner: Any, serde: Any, l1_manager: Any, metrics: Any) -> None:
        original(self, inner, serde, l1_manager)

    monkeypatch.setattr(lm.SerdeL2AdapterWrapper, "__init__", __init__)
    found = [m for m in check() if m.name == "SerdeL2AdapterWrapper"]
    assert [m.problem for m in found] == ["SerdeL2AdapterWrapper.__init__ takes (inner, serde, l1_manager, metrics), "
                                          "kvpersist calls it with (inner, serde, l1_manager)"]


def test_a_wrapper_built_by_another_name_is_reported(lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replacing the storage manager's name only works while it builds the wrapper by that name."""
    from lmcache.v1.distributed.l2_adapters import serde_wrapper

    def _build_l2_adapter(self: Any, config: Any) -> Any:
        return serde_wrapper.SerdeL2AdapterWrapper(inner=None, serde=None, l1_manager=None)

    monkeypatch.setattr(lm.StorageManager, "_build_l2_adapter", _build_l2_adapter)
    found = check()
    assert names(found) == ["SerdeL2AdapterWrapper"] and "would not take effect" in found[0].problem


def test_an_abstract_method_kvpersist_does_not_implement_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    base = pytest.importorskip("lmcache.v1.distributed.serde.base")
    monkeypatch.setattr(base.SerdeProcessor, "__abstractmethods__",
                        base.SerdeProcessor.__abstractmethods__ | {"flush"})
    found = check()
    assert names(found) == ["SerdeProcessor"] and "kvpersist does not implement: flush" in found[0].problem


def test_a_field_added_to_the_object_key_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frame binds every field of the key: one more would be left out of the binding."""
    api = pytest.importorskip("lmcache.v1.distributed.api")
    fields = [(f.name, f.type, f) for f in dataclasses.fields(api.ObjectKey)]
    wider = dataclasses.make_dataclass("ObjectKey", [*fields, ("tenant", str, dataclasses.field(default=""))],
                                       frozen=True)
    monkeypatch.setattr(api, "ObjectKey", wider)
    found = check()
    assert names(found) == ["ObjectKey"] and "tenant" in found[0].problem


def test_wrapper_task_ids_not_counted_from_zero_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper = pytest.importorskip("lmcache.v1.distributed.l2_adapters.serde_wrapper")

    def __init__(self: Any, inner: Any, serde: Any, l1_manager: Any) -> None:
        self._task_ids = iter(range(2**63))

    monkeypatch.setattr(wrapper.SerdeL2AdapterWrapper, "__init__", __init__)
    assert "wrapper task ids" in names(check())


def test_a_bitmap_that_reads_otherwise_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    native = pytest.importorskip("lmcache.lmcache_native")

    class Bitmap:
        def __init__(self, n: int) -> None:
            pass

        def set(self, i: int) -> None:
            pass

        def test(self, i: int) -> bool:
            return False

    monkeypatch.setattr(native, "Bitmap", Bitmap)
    assert names(check()) == ["Bitmap"]


def test_a_module_that_cannot_be_imported_is_reported(lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lmcache.cli.main", None)
    found = check()
    assert names(found) == ["lmcache CLI"] and "module lmcache.cli.main cannot be imported" in found[0].problem


def test_a_check_that_fails_is_a_mismatch_not_a_crash() -> None:
    def broken() -> list[str]:
        raise RuntimeError("boom")

    assert [str(m) for m in check({"odd": broken}, version="0.5.6")] == ["odd: could not be checked (RuntimeError: boom)"]


# ---------------------------------------------------------------- serve's entry point


def test_serve_refuses_before_it_registers_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """main: the check first; on a mismatch the build check's message and exit code, and no serde
    registered, no wrapper replaced, no lmcache run."""
    log = tmp_path / "termination-log"
    monkeypatch.setenv(serve.TERMINATION_LOG_ENV, str(log))
    monkeypatch.setattr(lmcache_internals, "check", lambda: [Mismatch("SerdeL2AdapterWrapper", "it is gone")])
    monkeypatch.setattr(lmcache_internals, "installed_version", lambda: "0.5.6")
    calls: list[str] = []
    monkeypatch.setattr(serve, "register", lambda: calls.append("register"))
    monkeypatch.setattr(lmcache_internals, "run_lmcache", lambda argv: calls.append("lmcache") or 0)

    class Exited(BaseException):
        pass

    def _exit(code: int) -> None:
        calls.append(f"exit {code}")
        raise Exited

    monkeypatch.setattr(serve.os, "_exit", _exit)
    with pytest.raises(Exited):
        serve.main(["server"])
    assert calls == [f"exit {buildcheck.EXIT_CODE}"]
    assert log.read_text().startswith(f"{MISMATCH_PREFIX}lmcache 0.5.6 in this container differs from what kvpersist's "
                                      "server uses in 1 internal(s) (SerdeL2AdapterWrapper): SerdeL2AdapterWrapper: it "
                                      "is gone")


def run_program(tmp_path: Path, preamble: str, *argv: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """The shipped program as the container runs it (isolated: no kvpersist importable), after
    preamble (a change to the installed lmcache), with its termination log."""
    program = tmp_path / "program.py"
    program.write_text(program_source())
    log = tmp_path / "termination-log"
    code = (f"{preamble}\nimport sys\nsource = open(sys.argv[1]).read()\nsys.argv = sys.argv[1:]\n"
            "exec(compile(source, '<program>', 'exec'), {'__name__': '__main__'})")
    done = subprocess.run([sys.executable, "-I", "-c", code, str(program), *argv], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**os.environ, serve.TERMINATION_LOG_ENV: str(log),
                                                          "LMCACHE_DISABLE_BANNER": "1"})
    return done, log.read_text() if log.exists() else ""


def test_the_shipped_program_without_lmcache_refuses_with_the_build_checks_exit_code(tmp_path: Path) -> None:
    done, message = run_program(tmp_path, "import sys\nsys.modules['lmcache'] = None", "server", "--help")
    assert done.returncode == EXIT_CODE, done.stderr[-2000:]
    assert message.startswith(MISMATCH_PREFIX) and message in done.stderr and "--l2-adapter" not in done.stdout


def test_the_shipped_program_refuses_on_a_missing_internal(tmp_path: Path) -> None:
    pytest.importorskip("lmcache.v1.distributed.storage_manager")
    done, message = run_program(
        tmp_path, "import lmcache.v1.distributed.storage_manager as m\ndel m.SerdeL2AdapterWrapper", "server", "--help")
    assert done.returncode == EXIT_CODE, done.stderr[-2000:]
    assert "--l2-adapter" not in done.stdout  # lmcache's CLI never ran
    assert missing_names(message) == ["SerdeL2AdapterWrapper"], message
    found = buildstatus.refusals([refused_pod("r-lmcache-0", SERVER, "lmcache-server", message=message)], NID)
    assert len(found) == 1 and "has no SerdeL2AdapterWrapper" in found[0].detail


# ---------------------------------------------------------------- how it is shipped


def test_the_program_carries_each_module_as_it_is_in_the_package() -> None:
    source = program_source()
    env = {e["name"]: e.get("value") for e in server_container(target())["env"]}
    assert env[SERVE_ENV] == source == program_source()
    shipped = [(node.args[0].value, node.args[1].value) for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_run"]
    assert shipped == [(name, module_source(name)) for name in PROGRAM_MODULES]
    assert "$(" not in source and "$$" not in source  # the kubelet expands both in env values
    # One argument of the exec (`"$0" -c "$KVPERSIST_LMCACHE_SERVE"`): Linux caps one at 128 KiB.
    assert len(source.encode()) < 128 * 1024


def test_the_shipped_modules_import_only_what_the_image_has() -> None:
    for name in PROGRAM_MODULES:
        imported = set()
        for node in ast.walk(ast.parse(module_source(name))):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported |= {f"{node.module}.{a.name}" for a in node.names}
        tops = {n.split(".")[0] for n in imported} - set(sys.stdlib_module_names) - {"__future__"}
        shipped = {n for n in imported if n.startswith("kvpersist")}
        assert shipped <= {f"kvpersist.inserver.{m}" for m in PROGRAM_MODULES[:PROGRAM_MODULES.index(name)]}, shipped
        assert tops - {"kvpersist"} <= ({"cryptography"} if name == "serve" else {"lmcache"}), (name, tops)


def test_the_program_is_made_once_a_process() -> None:
    """Issue 58: each StatefulSet build (every apply, every status refresh's decision) read the
    modules again and made a 56 KB string of its own; now every manifest shares one."""
    assert program_source() is program_source()
