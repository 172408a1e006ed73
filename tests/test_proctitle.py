"""Each rank's process title (mlx_relay/proctitle.py), in this process."""

from __future__ import annotations

import sys

import psutil
import pytest

from mlx_relay import proctitle


@pytest.fixture
def restored():
    """This test process's own title and short name, put back afterwards."""
    me = psutil.Process()
    name, title = me.name(), dict(proctitle._title)
    yield me
    proctitle._title.clear()
    proctitle._title.update(title)
    import setproctitle

    setproctitle.setproctitle(" ".join([sys.executable, *sys.argv]))
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)


def test_a_rank_shows_its_number_then_its_layers_and_keeps_its_short_name(restored):
    proctitle._title.clear()
    proctitle.name_rank(2)
    assert _shown(restored) == "mlx-relay rank 2 (starting)"
    proctitle.name_rank(2, 3, address="0.0.0.0:50051")
    proctitle.show_layers(11, 20)
    assert _shown(restored) == "mlx-relay rank 2/3 layers 11-19 :50051"
    proctitle.show_layers(None)
    assert proctitle.title() == "mlx-relay rank 2/3 (no model) :50051"
    if sys.platform == "linux":  # (what launchers and tests find ranks by)
        assert restored.name() == "mlx-relay-r2"


def _shown(process: psutil.Process) -> str:
    """The title as `ps` shows it (setproctitle pads the old command line's room with spaces)."""
    return " ".join(process.cmdline()).strip()
