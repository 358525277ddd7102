"""Suite-wide options: `--shuffle-modules SEED` runs the modules in a seeded random order (tests
keep their order inside a module, where later tests may read what earlier ones captured), to
show that no module depends on what another left behind."""

from __future__ import annotations

import random

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shuffle-modules", metavar="SEED", default=None,
                     help="run test modules in a random order drawn from SEED ('random' draws a seed and prints it)")


def pytest_configure(config: pytest.Config) -> None:
    seed = config.getoption("--shuffle-modules")
    if seed == "random":
        config.option.shuffle_modules = str(random.SystemRandom().randrange(10**6))


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("--shuffle-modules")
    return f"module order shuffled with --shuffle-modules {seed}" if seed is not None else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seed = config.getoption("--shuffle-modules")
    if seed is None:
        return
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(modules)
    random.Random(seed).shuffle(order)
    items[:] = [item for module in order for item in modules[module]]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"module order (seed {seed}): " + " ".join(m.rsplit("/", 1)[-1] for m in order))
