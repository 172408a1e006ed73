"""How a rank tells its launcher why it stopped: exit codes and one last line.

A rank's exit code and its last line on stderr are the only things a launcher (local,
`mlx.launch`, or a supervisor on another machine) reliably gets from a rank that ended,
so they are a wire format like the step header: the rank that writes them and the
launcher that reads them import them from here, and nowhere else defines them.
"""

from __future__ import annotations

import re
import sys

EXIT_USAGE = 2  # a rank: its options or model cannot work (serve); as argparse's
EXIT_CLUSTER_FAILED = 3  # rank 0: a worker failed or a step was overdue (api.server)
EXIT_RANK_FAILED = 4  # a launcher: a rank failed and the cluster was stopped
EXIT_LOAD_FAILED = 5  # rank 0: the model given at start did not load on some rank (api.server)
EXIT_RANK0_SILENT = 75  # a worker: rank 0 is gone or silent (transport.link)
EXIT_RING_BROKEN = 76  # a worker: its ring connection broke, a neighbour died (worker.loop)
EXIT_TENSOR_STEP_FAILED = (
    77  # a tensor peer: it could not take a step its group takes (worker.loop)
)

MEANINGS = {
    EXIT_USAGE: "bad options or model",
    EXIT_CLUSTER_FAILED: "the cluster failed",
    EXIT_RANK_FAILED: "a rank failed",
    EXIT_LOAD_FAILED: "the model did not load",
    EXIT_RANK0_SILENT: "rank 0 is gone or silent",
    EXIT_RING_BROKEN: "its ring connection broke",
    EXIT_TENSOR_STEP_FAILED: "it failed a tensor-parallel step",
}
# Exits that follow another rank's failure on purpose: not the cause of a cluster's end.
CONSEQUENCES = (EXIT_CLUSTER_FAILED, EXIT_RANK0_SILENT, EXIT_RING_BROKEN)
# Starting again would fail the same way: the options or the model must change first.
PERMANENT_EXITS = (EXIT_USAGE, EXIT_LOAD_FAILED)

_FATAL = re.compile(r"^mlx-relay serve: rank (\d+|\?): (.+)$")


def fatal_line(rank: int | str, cause: str) -> str:
    """The last line a rank writes when it stops for a reason it can name."""
    return f"mlx-relay serve: rank {rank}: {' '.join(cause.split())}"


def report_fatal(rank: int | str, cause: str) -> None:
    """Write `fatal_line` to stderr, where launchers look for it."""
    print(fatal_line(rank, cause), file=sys.stderr, flush=True)


def parse_fatal_line(line: str) -> tuple[int, str] | None:
    """(rank, cause) if `line` is a rank's `fatal_line` (rank -1 when it did not know
    its rank yet), else None."""
    match = _FATAL.match(line.strip())
    if not match:
        return None
    rank = int(match.group(1)) if match.group(1).isdigit() else -1
    return rank, match.group(2)
