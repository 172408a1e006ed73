"""Each rank's process title (mlx_relay/proctitle.py), in a fresh process of its own.

(Not in the test process: setproctitle finds the command line's memory beside the
environment the process started with, which pytest-xdist's workers have already replaced.
A rank sets its first title before it changes its environment; a zygote's child has
setproctitle find it before the environment is replaced.)
"""

from __future__ import annotations

import subprocess
import sys

import psutil

# The child: each step on a line of its stdin, its title shown after each.
CHILD = """
import sys
from mlx_relay import proctitle
steps = [
    lambda: proctitle.name_rank(2),
    lambda: proctitle.name_rank(2, 3, address="0.0.0.0:50051"),
    lambda: proctitle.show_layers(11, 20),
    lambda: proctitle.show_layers(None),
]
for step in steps:
    sys.stdin.readline()
    step()
    print(proctitle.title(), flush=True)
sys.stdin.readline()
"""


def test_a_rank_shows_its_number_then_its_layers_and_keeps_its_short_name():
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        shown = []
        for _ in range(4):
            child.stdin.write("\n")
            child.stdin.flush()
            said = child.stdout.readline().strip()
            shown.append((said, " ".join(psutil.Process(child.pid).cmdline()).strip()))
        name = psutil.Process(child.pid).name()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
    # What ps shows is the title the module says it set, at every step.
    assert shown == [
        ("mlx-relay rank 2 (starting)",) * 2,
        ("mlx-relay rank 2/3 (starting) :50051",) * 2,
        ("mlx-relay rank 2/3 layers 11-19 :50051",) * 2,
        ("mlx-relay rank 2/3 (no model) :50051",) * 2,
    ]
    if sys.platform == "linux":  # (what launchers and tests find ranks by)
        assert name == "mlx-relay-r2"
