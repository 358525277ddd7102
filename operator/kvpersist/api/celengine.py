"""The CEL library's Rust extension, loaded without its package: `import cel` runs the package's
__init__, which imports the library's REPL (typer, rich, prompt_toolkit, pygments), 27 MiB of every
process that validates a spec, the operator's RSS included, and never used (issue 58).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = "cel"
EXTENSION = "cel.cel"  # the name the package itself imports it by: one module, whichever loads it first


def _extension_path() -> Path | None:
    """The extension's file inside the installed package, found without running the package."""
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(folder) / f"{EXTENSION.rsplit('.', 1)[1]}{suffix}"
            if path.is_file():
                return path
    return None


def extension() -> ModuleType:
    """compile, Context, Program: the extension alone, or through the package where its layout is
    another (a release that moved the extension). It initialises once a process (a second time it
    panics): whoever loads it first, the package or this, the other finds it in sys.modules."""
    loaded = sys.modules.get(EXTENSION)
    if loaded is not None:
        return loaded
    path = _extension_path()
    if path is None:
        return importlib.import_module(PACKAGE)
    loader = importlib.machinery.ExtensionFileLoader(EXTENSION, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(EXTENSION, loader))
    loader.exec_module(module)
    sys.modules[EXTENSION] = module
    return module
