"""The soak, short: mixed concurrent load on a tiny model for ~10 s, and on until 20
requests completed and one was cut short however long a busy machine takes (tests/soak.py;
bench/bench_soak.py runs it for as long as asked and says what it checks)."""

from __future__ import annotations

import pytest
from soak import SoakSettings, soak


@pytest.mark.cluster
def test_a_short_soak_is_exact_leaks_nothing_and_keeps_memory_flat():
    report = soak(SoakSettings(seconds=10, clients=8, warmup=4, pool=22, seed=1, at_least=20))
    print(f"\nshort soak: {report}")
    assert report["mismatches"] == 0, report["mismatch_examples"]
    assert report["completed"] >= 20 and report["cancelled"] + report["disconnected"] > 0, report
    assert report["checks"] == {
        "outputs_equal_solo": True,
        "no_errors": True,
        "idle_after": True,
        "rss_flat": True,
        "ranks_alive": True,
    }, report
