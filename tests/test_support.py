"""The shared test helpers' own promises (tests/support.py)."""

from __future__ import annotations

import time

import pytest
from support import meanwhile


def test_meanwhile_waits_for_its_work_even_when_the_block_fails():
    """A cluster the thread starts reaches its fixture's list before the teardown, however
    the test's own part ended: the `with` block's end waits for the work."""
    started: list[str] = []

    def start_a_cluster() -> str:
        time.sleep(0.5)  # (a start that outlasts the failing block below)
        started.append("cluster")
        return "answer"

    with pytest.raises(RuntimeError, match="the oracle failed"), meanwhile(start_a_cluster):
        raise RuntimeError("the oracle failed")
    assert started == ["cluster"]
    with meanwhile(start_a_cluster) as asked:
        pass
    assert asked.result(timeout=0) == "answer"
