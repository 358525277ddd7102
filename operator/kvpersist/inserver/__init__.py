"""Code that runs inside the lmcache server's container, not in the operator: the image has lmcache
but not kvpersist, so each module here is standalone (standard library, lmcache, cryptography, and
the modules before it) and is rendered into the pod as one `python3 -c` program (program_source),
an environment variable's value: nothing here may hold `$(` or `$$` (the kubelet expands both).
"""

from __future__ import annotations

import functools
from importlib import resources

# The modules the server's program is made of, in order: each may import the ones before it (as
# kvpersist.inserver.<name>); the last runs as the program (its `__name__ == "__main__"`).
PROGRAM_MODULES = ("lmcache_internals", "serve")

# Stand-ins for the kvpersist packages (the image has neither), and _run, which program_source calls per module.
_LOADER = '''\
"""kvpersist's lmcache server program (kvpersist.inserver.program_source): its modules, then serve."""
import sys
import types


for _name in ("kvpersist", "kvpersist.inserver"):
    if _name not in sys.modules:
        sys.modules[_name] = types.ModuleType(_name)
        sys.modules[_name].__path__ = []


def _run(name, source, main=False):
    module = types.ModuleType("__main__" if main else "kvpersist.inserver." + name)
    module.__file__ = "kvpersist/inserver/" + name + ".py"
    if not main:
        sys.modules[module.__name__] = module
        setattr(sys.modules["kvpersist.inserver"], name, module)
    exec(compile(source, module.__file__, "exec"), module.__dict__)
'''


def module_source(name: str) -> str:
    return (resources.files(__name__) / f"{name}.py").read_text(encoding="utf-8")


@functools.cache
def program_source() -> str:
    """The server container's program (python3 -c): every module of PROGRAM_MODULES as source,
    the last run as the program, so serve.py imports its siblings as it does in the operator. Made
    once a process: every build of a StatefulSet (each apply, each status refresh's decision) read
    the files again and made a 56 KB string of its own (4 ms each; issue 58)."""
    *modules, main = PROGRAM_MODULES
    runs = [f"_run({name!r}, {module_source(name)!r})" for name in modules]
    runs.append(f"_run({main!r}, {module_source(main)!r}, main=True)")
    return _LOADER + "\n".join(runs) + "\n"
