"""Every name of lmcache that kvpersist's lmcache server (kvpersist.inserver.serve) uses, each
checked here against the installed lmcache before the server starts: none of it is a
versioned API, and a change would not fail at start but silently stop removing unreadable objects,
or leave a new field of the object's name out of the frame's binding (docs/datapath.md "lmcache
internals"). Shipped with serve.py: standard library only at import, lmcache inside the checks.
"""

from __future__ import annotations

import dataclasses
import dis
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

# The lmcache releases the server was tested with (public versions: +cu128 is a build of one). Another
# refuses to start even when every check passes: the checks say what kvpersist uses, not what changed.
TESTED_LMCACHE = ("0.5.6",)
# kvpersist.builders.buildcheck's (the image has no kvpersist; a test checks they agree), so the
# operator reads this refusal as it reads the build check's.
MISMATCH_PREFIX = "kvpersist-build mismatch: "
EXIT_CODE = 78  # EX_CONFIG: restarting the same image will not help
MESSAGE_MAX = 1000  # the operator keeps 1024 characters of a termination message
VERSION = "lmcache version"  # the Mismatch of a release not in TESTED_LMCACHE (or none installed)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """An internal that is not as kvpersist uses it (or an lmcache version not tested)."""

    name: str
    problem: str

    def __str__(self) -> str:
        return f"{self.name}: {self.problem}"


class Missing(Exception):
    """A name that lmcache does not have (or not as expected); its message says what."""


def _get(module: str, path: str = "") -> Any:
    """lmcache's module, or a name inside it (dotted: a class's attribute)."""
    try:
        found: Any = importlib.import_module(module)
    except ImportError as exc:
        raise Missing(f"module {module} cannot be imported ({exc})") from None
    walked = module
    for part in path.split(".") if path else ():
        if not hasattr(found, part):
            raise Missing(f"{walked} has no {part}")
        found = getattr(found, part)
        walked = f"{walked}.{part}"
    return found


def _params(func: Any, what: str, expected: tuple[str, ...]) -> list[str]:
    """The parameters func is called with (after self), in this order; any more must have defaults."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return [f"{what}'s signature cannot be read"]
    names = [p.name for p in sig.parameters.values() if p.name != "self"
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    extra = [p.name for p in sig.parameters.values() if p.name not in ("self", *expected)
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is p.empty]
    if tuple(names[:len(expected)]) != expected or extra:
        return [f"{what} takes ({', '.join(names)}), kvpersist calls it with ({', '.join(expected)})"]
    return []


def _method(cls: Any, name: str, expected: tuple[str, ...]) -> list[str]:
    where = f"{cls.__qualname__}.{name}"
    if not callable(getattr(cls, name, None)):
        return [f"{where} is missing"]
    return _params(getattr(cls, name), where, expected)


def _abstract(cls: Any, expected: dict[str, tuple[str, ...]]) -> list[str]:
    """cls's abstract methods are exactly those kvpersist implements, with its parameters (one more
    and kvpersist's subclass cannot be made)."""
    found = set(getattr(cls, "__abstractmethods__", ()))
    problems = []
    if found != set(expected):
        more, fewer = sorted(found - set(expected)), sorted(set(expected) - found)
        problems.append(f"{cls.__qualname__}'s abstract methods differ (kvpersist does not implement: "
                        f"{', '.join(more) or 'none'}; no longer abstract: {', '.join(fewer) or 'none'})")
    for name, params in expected.items():
        problems += _method(cls, name, params)
    return problems


def _fields(cls: Any, expected: tuple[str, ...], exact: bool) -> list[str]:
    if not dataclasses.is_dataclass(cls):
        return [f"{cls.__qualname__} is no longer a dataclass"]
    names = tuple(f.name for f in dataclasses.fields(cls))
    if (set(names) != set(expected)) if exact else not set(expected) <= set(names):
        return [f"{cls.__qualname__} has fields ({', '.join(names)}), kvpersist expects ({', '.join(expected)})"]
    return []


def _check_serde_registry() -> list[str]:
    problems = _params(_get("lmcache.v1.distributed.serde", "register_serde_factory"), "register_serde_factory",
                       ("name", "factory"))
    problems += _params(_get("lmcache.v1.distributed.serde", "get_registered_serde_types"),
                        "get_registered_serde_types", ())
    problems += _fields(_get("lmcache.v1.distributed.serde", "SerdeConfig"), ("type", "kwargs"), exact=False)
    if not isinstance(_get("lmcache.v1.distributed.serde", "get_registered_serde_types")(), list):
        problems.append("get_registered_serde_types() no longer returns a list")
    return problems


SERDE_METHODS: dict[str, tuple[str, ...]] = {
    "get_serialize_event_fd": (), "get_deserialize_event_fd": (),
    "submit_serialize": ("src_objs", "dst_objs", "keys"), "submit_deserialize": ("src_objs", "dst_objs", "keys"),
    "query_serialize_result": ("task_id",), "query_deserialize_result": ("task_id",),
    "estimate_serialized_size": ("layout_desc",), "close": (),
}


def _check_event_notifier() -> list[str]:
    notifier = _get("lmcache.v1.platform", "create_event_notifier")()
    try:
        problems = [f"create_event_notifier()'s notifier has no {m}" for m in ("notify", "fileno", "close")
                    if not callable(getattr(notifier, m, None))]
        if not problems and not isinstance(notifier.fileno(), int):
            problems.append("create_event_notifier()'s fileno() is no file descriptor")
        return problems
    finally:
        if callable(getattr(notifier, "close", None)):
            notifier.close()


# Every field of ObjectKey: the frame binds them all (serve.object_binding), so one lmcache adds
# would be left out: this list must be exactly lmcache's.
OBJECT_KEY_FIELDS = ("chunk_hash", "model_name", "kv_rank", "object_group_id", "cache_salt")


def _check_memory_obj() -> list[str]:
    cls = _get("lmcache.v1.memory_management", "MemoryObj")
    problems = [] if isinstance(inspect.getattr_static(cls, "byte_array", None), property) else [
        "MemoryObj.byte_array is no longer a property"]
    return problems + _method(cls, "set_used_size", ("n",))


def _check_serde_wrapper() -> list[str]:
    cls = _get("lmcache.v1.distributed.storage_manager", "SerdeL2AdapterWrapper")
    problems = _method(cls, "__init__", ("inner", "serde", "l1_manager"))
    problems += _method(cls, "submit_load_task", ("keys", "objects"))
    problems += _method(cls, "query_load_result", ("task_id",))
    # The storage manager must build the wrapper by that module-level name, or replacing it
    # there does nothing: the name in _build_l2_adapter's globals, not an attribute of another module.
    build = _get("lmcache.v1.distributed.storage_manager", "StorageManager._build_l2_adapter")
    if not any(op.opname == "LOAD_GLOBAL" and op.argval == "SerdeL2AdapterWrapper" for op in dis.get_instructions(build)):
        problems.append("StorageManager._build_l2_adapter no longer builds the wrapper by the storage manager's "
                        "name SerdeL2AdapterWrapper, so replacing it would not take effect")
    return problems


def _check_wrapper_task_ids() -> list[str]:
    # lmcache's own class (the storage manager's name may be serve's subclass by now).
    init = _get("lmcache.v1.distributed.l2_adapters.serde_wrapper", "SerdeL2AdapterWrapper.__init__")
    if not re.search(r"self\._next_task_id\b[^=\n]*=\s*0\b", inspect.getsource(init)):
        return ["SerdeL2AdapterWrapper.__init__ no longer counts its task ids from 0 (self._next_task_id = 0), so "
                "kvpersist's own load ids (from 2**48) may collide with them"]
    return []


LISTENER_METHODS: dict[str, tuple[str, ...]] = {
    "on_l2_keys_stored": ("keys", "sizes"), "on_l2_keys_accessed": ("keys",), "on_l2_keys_deleted": ("keys",),
}


def _check_adapter_listener() -> list[str]:
    problems = _abstract(_get("lmcache.v1.distributed.internal_api", "L2AdapterListener"), LISTENER_METHODS)
    adapter = _get("lmcache.v1.distributed.l2_adapters.base", "L2AdapterInterface")
    return problems + _method(adapter, "register_listener", ("listener",)) + _method(adapter, "delete", ("keys",))


def _check_bitmap() -> list[str]:
    bitmap = _get("lmcache.lmcache_native", "Bitmap")(3)
    bitmap.set(1)
    if [bool(bitmap.test(i)) for i in range(3)] != [False, True, False]:
        return ["Bitmap(n).set(i) / test(i) no longer mark and read one key's bit"]
    return []


# Each internal's check by its name; where it is in lmcache, why kvpersist needs it and the upstream
# change that would make it unnecessary: docs/datapath.md's table, row by row.
INTERNALS: dict[str, Callable[[], list[str]]] = {
    "serde registry": _check_serde_registry,
    "SerdeProcessor": lambda: _abstract(_get("lmcache.v1.distributed.serde.base", "SerdeProcessor"), SERDE_METHODS),
    "create_event_notifier": _check_event_notifier,
    "ObjectKey": lambda: _fields(_get("lmcache.v1.distributed.api", "ObjectKey"), OBJECT_KEY_FIELDS, exact=True),
    "MemoryLayoutDesc": lambda: _fields(_get("lmcache.v1.distributed.api", "MemoryLayoutDesc"), ("shapes", "dtypes"), exact=False),
    "MemoryObj": _check_memory_obj,
    "SerdeL2AdapterWrapper": _check_serde_wrapper,
    "wrapper task ids": _check_wrapper_task_ids,
    "L2AdapterListener": _check_adapter_listener,
    "Bitmap": _check_bitmap,
    "init_logger": lambda: _params(_get("lmcache.logging", "init_logger"), "init_logger", ("name",)),
    "lmcache CLI": lambda: _params(_get("lmcache.cli.main", "main"), "lmcache.cli.main.main", ()),
}


def public_version(version: str) -> str:
    """The release a version names: the local label (+cu128, +cpu: a build of it) left out."""
    return version.strip().split("+", 1)[0]


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        return None


def check(internals: Mapping[str, Callable[[], list[str]]] = INTERNALS, version: str | None = None) -> list[Mismatch]:
    """What differs in the installed lmcache from what the server uses (its version when not
    tested, then every internal's problems); empty: the server may start."""
    version = installed_version() if version is None else version
    if version is None and importlib.util.find_spec("lmcache") is None:
        return [Mismatch(VERSION, "lmcache is not installed")]
    found = []
    if version is None:
        found.append(Mismatch(VERSION, "no installed lmcache distribution says its version"))
    elif public_version(version) not in TESTED_LMCACHE:
        found.append(Mismatch(VERSION, f"{version} is not one kvpersist's server was tested with "
                                       f"({', '.join(TESTED_LMCACHE)})"))
    for name, verify in internals.items():
        try:
            problems = verify()
        except Missing as exc:
            problems = [str(exc)]
        except Exception as exc:  # a check that cannot tell is no proof that the internal is there
            problems = [f"could not be checked ({type(exc).__name__}: {exc})"]
        found += [Mismatch(name, problem) for problem in problems]
    return found


def refusal_message(found: list[Mismatch], version: str | None = None) -> str:
    """The termination message of a server refusing over found, in the build check's form, within
    MESSAGE_MAX characters: the names of what differs first, then what each is."""
    version = installed_version() if version is None else version
    tested = ", ".join(TESTED_LMCACHE)
    head = f"{MISMATCH_PREFIX}lmcache {version or '(its version unknown)'} in this container"
    tail = (f"; kvpersist's server relies on these lmcache internals (kvpersist.inserver.lmcache_internals, "
            f"docs/datapath.md), so it does not start. Use an image with lmcache {tested} (images/vllm-lmcache) "
            "declared in spec.identity.connectorBuild, or a kvpersist release tested with this lmcache")
    structural = [m for m in found if m.name != VERSION]
    names = list(dict.fromkeys(m.name for m in structural))
    if not structural:
        head = (f"{head} is not a release kvpersist's server was tested with ({tested}), though the internals it "
                "uses check out" if version else f"{MISMATCH_PREFIX}{'; '.join(m.problem for m in found)} in this container")
    else:
        head += (f" differs from what kvpersist's server uses in {len(names)} internal(s) ({', '.join(names)}): "
                 + "; ".join(str(m) for m in structural))
    room = MESSAGE_MAX - len(tail)
    if len(head) > room:
        head = head[:room - 4] + " ..."
    return head + tail


# The accessors: serve.py reaches lmcache through these only (tests check it imports no lmcache).

def serde_processor() -> type:
    return _get("lmcache.v1.distributed.serde.base", "SerdeProcessor")


def event_notifier() -> Any:
    return _get("lmcache.v1.platform", "create_event_notifier")()


def register_serde(name: str, factory: Callable[[dict[str, object]], Any]) -> None:
    """Makes `"serde": {"type": name, ...}` known to lmcache, once per process."""
    if name not in _get("lmcache.v1.distributed.serde", "get_registered_serde_types")():
        _get("lmcache.v1.distributed.serde", "register_serde_factory")(name, factory)


def serde_wrapper() -> type:
    """The storage manager's SerdeL2AdapterWrapper now (lmcache's, or one that replaced it)."""
    return _get("lmcache.v1.distributed.storage_manager", "SerdeL2AdapterWrapper")


def replace_serde_wrapper(cls: type) -> None:
    """What the storage manager wraps an adapter with a serde in from now on."""
    _get("lmcache.v1.distributed.storage_manager").SerdeL2AdapterWrapper = cls


def adapter_listener() -> type:
    return _get("lmcache.v1.distributed.internal_api", "L2AdapterListener")


def bitmap_class() -> type:
    return _get("lmcache.lmcache_native", "Bitmap")


def logger(name: str) -> Any:
    """lmcache's logger (its format, level and handler); the standard library's without lmcache."""
    try:
        init_logger = _get("lmcache.logging", "init_logger")
    except Missing:
        return logging.getLogger(name)
    return init_logger(name)


def run_lmcache(argv: list[str]) -> int:
    """lmcache's own `lmcache` entry point, in this process, with argv after the program's name."""
    sys.argv = ["lmcache", *argv]
    return int(_get("lmcache.cli.main", "main")() or 0)
