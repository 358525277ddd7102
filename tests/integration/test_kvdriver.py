"""The KV driver's fork server (tests/integration/kvdriver.py ForkServer): a run that fails comes
back as the test's failure with its traceback, and the server goes on serving the next run; a run
that never answers is stopped at its timeout. Without the driver's own checks passing through
intact, every data-path test here would judge nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration import kvdriver


def test_a_failed_run_is_the_callers_failure_and_the_next_run_is_served(tmp_path: Path) -> None:
    server = kvdriver.ForkServer(tmp_path)
    try:
        for _ in range(2):  # the same server answers again after a failure
            with pytest.raises(AssertionError, match=r"(?s)kvdriver store failed: .*ValueError: invalid literal"):
                server.run(["store", "--rpc-url", "tcp://127.0.0.1:9", "--http-url", "http://127.0.0.1:9",
                            "--seqs", "not-a-range"], timeout=60)
        assert server.proc is not None and server.proc.poll() is None
    finally:
        server.stop()
    assert server.proc is None


def test_a_run_that_never_answers_is_stopped_at_its_timeout(tmp_path: Path) -> None:
    server = kvdriver.ForkServer(tmp_path)
    try:
        # Nothing listens on the RPC port: lmcache's client waits for its server, past the timeout.
        with pytest.raises(AssertionError, match="gave no answer in 3s"):
            server.run(["verify", "--rpc-url", "tcp://127.0.0.1:9", "--http-url", "http://127.0.0.1:9", "--seqs", "0:1"],
                       timeout=3)
        assert server.proc is None  # stopped with the hung run
    finally:
        server.stop()
