"""Suite-wide options.

`--shuffle SEED` runs the modules in a seeded random order and the tests of each module in a
seeded random order too: for the unit tier, whose tests must not depend on what another left
behind (hack/test.sh runs it so, with a fresh seed it prints). `--shuffle-modules SEED` shuffles
the modules only (tests keep their order inside a module, where a later e2e test may read what an
earlier one captured). 'random' draws a seed; the header prints it, so a failure replays with the
same SEED.

With KVPERSIST_SKIPS_FAIL=1 (hack/test.sh sets it for the full-venv runs) a skipped test is a
failure that says why it would have skipped: the suite's venv has every extra and CI runs as
root, so a skip there is a check that silently did not run.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest

SKIPS_FAIL_ENV = "KVPERSIST_SKIPS_FAIL"
SHUFFLES = ("--shuffle", "--shuffle-modules")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shuffle", metavar="SEED", default=None,
                     help="run modules, and the tests inside each, in a random order drawn from SEED ('random' draws one)")
    parser.addoption("--shuffle-modules", metavar="SEED", default=None,
                     help="run test modules in a random order drawn from SEED ('random' draws a seed and prints it)")


def pytest_configure(config: pytest.Config) -> None:
    for flag in SHUFFLES:
        if config.getoption(flag) == "random":
            setattr(config.option, flag.lstrip("-").replace("-", "_"), str(random.SystemRandom().randrange(10**6)))


def _shuffle(config: pytest.Config) -> tuple[str, str, bool] | None:
    """(flag, seed, whether tests inside a module are shuffled too), or None."""
    for flag in SHUFFLES:
        seed = config.getoption(flag)
        if seed is not None:
            return flag, seed, flag == "--shuffle"
    return None


def pytest_report_header(config: pytest.Config) -> str | None:
    shuffle = _shuffle(config)
    return f"order shuffled: replay with {shuffle[0]} {shuffle[1]}" if shuffle else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shuffle = _shuffle(config)
    if shuffle is None:
        return
    flag, seed, within = shuffle
    rng = random.Random(seed)
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(modules)
    rng.shuffle(order)
    if within:
        for module in order:
            rng.shuffle(modules[module])
    items[:] = [item for module in order for item in modules[module]]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"module order ({flag} {seed}): " + " ".join(m.rsplit("/", 1)[-1] for m in order))


def _skip_fails(report: pytest.TestReport | pytest.CollectReport) -> None:
    if os.environ.get(SKIPS_FAIL_ENV) != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped where skips fail ({SKIPS_FAIL_ENV}=1): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    _skip_fails(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A whole module skipped at import (pytest.importorskip) counts as well."""
    outcome = yield
    _skip_fails(outcome.get_result())
