"""Suite-wide options.

`--shuffle SEED` runs the modules in a seeded random order and the tests of each module in a
seeded random order too: for the unit tier, whose tests must not depend on what another left
behind (hack/test.sh runs it so, with a fresh seed it prints). `--shuffle-modules SEED` shuffles
the modules only (tests keep their order inside a module, where a later e2e test may read what an
earlier one captured). 'random' draws a seed; the header prints it, so a failure replays with the
same SEED.

With KVPERSIST_SKIPS_FAIL=1 (hack/test.sh sets it for the full-venv runs) a skipped test is a
failure that says why it would have skipped: the suite's venv has every extra and CI runs as
root, so a skip there is a check that silently did not run. An expected failure (xfail) is one
too: a test marked so passes whether or not its feature works. Cases a module leaves out of the
run on purpose (an opt-in peer this machine does not build) add a line to NOT_RUN, printed at the
end, so the summary says what the suite did not show.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest

from tests import shards

SKIPS_FAIL_ENV = "KVPERSIST_SKIPS_FAIL"
SHUFFLES = ("--shuffle", "--shuffle-modules")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shuffle", metavar="SEED", default=None,
                     help="run modules, and the tests inside each, in a random order drawn from SEED ('random' draws one)")
    parser.addoption("--shuffle-modules", metavar="SEED", default=None,
                     help="run test modules in a random order drawn from SEED ('random' draws a seed and prints it)")
    parser.addoption("--shard", metavar="K/N", default=None,
                     help="run only the modules of shard K of N (tests/shards.py: balanced by measured time, the "
                          "real-vLLM modules together); hack/test.sh runs the e2e tier so, each shard on its own cluster")


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


def _keep_shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    value = config.getoption("--shard")
    if value is None:
        return
    k, n = shards.parse(value)
    placed = shards.assign(sorted({item.path.name for item in items}), n)
    keep = [item for item in items if placed[item.path.name] == k]
    dropped = [item for item in items if placed[item.path.name] != k]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"shard {k}/{n}: " + " ".join(sorted({item.path.name for item in keep})))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _keep_shard(config, items)
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
    if os.environ.get(SKIPS_FAIL_ENV) != "1":
        return
    if hasattr(report, "wasxfail"):  # xfailed, or xpassed (not strict): either way nothing was shown
        report.outcome = "failed"
        report.longrepr = f"marked xfail where skips fail ({SKIPS_FAIL_ENV}=1): {report.wasxfail or 'no reason given'}"
        return
    if not report.skipped:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped where skips fail ({SKIPS_FAIL_ENV}=1): {reason}"


# What the modules collected leave out of the run on purpose, one line each ("module: what, and how
# to run it"), printed in the terminal summary.
NOT_RUN: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if NOT_RUN:
        terminalreporter.section("not run in this suite (opt-in)")
        for line in NOT_RUN:
            terminalreporter.write_line(line)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    _skip_fails(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A whole module skipped at import (pytest.importorskip) counts as well."""
    outcome = yield
    _skip_fails(outcome.get_result())
