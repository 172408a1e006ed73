"""What each rank is called in `ps`, `top` and Activity Monitor.

Ranks that `mlx-relay local` forks from its zygote share its command line, and ranks that
`mlx.launch` starts share one another's, so an operator could not tell rank 1 from rank 2.
Each rank therefore rewrites its process title (setproctitle, which does this portably on
Linux and macOS) as it learns more about itself:

    mlx-relay rank 0/3 layers 0-10 :50051
    mlx-relay rank 1/3 layers 11-19
    mlx-relay rank 2/3 (no model)

The short name the kernel keeps (`ps -o comm`, psutil's `name()`) stays `mlx-relay-rN`:
launchers and tests find ranks by it, and setproctitle would otherwise overwrite it with
the title's first 15 characters. Under OpenMPI's mpirun only the short name is set (see
`_show`).
"""

from __future__ import annotations

import os
import sys

import setproctitle

# What each rank's short name starts with (`mlx-relay-r0`, `-r1`, ...).
SHORT_NAME_PREFIX = "mlx-relay-r"
_PR_SET_NAME = 15  # prctl's option for the short name (Linux)

# The parts of this process's title, filled in as the rank learns them: the title is
# process-wide state, so it is kept once here.
_title: dict[str, str] = {}


def name_rank(rank: int | str, size: int | None = None, address: str = "") -> None:
    """Call this process rank `rank` of `size` (serving clients at `address`: rank 0)."""
    _title["rank"] = f"rank {rank}" if size is None else f"rank {rank}/{size}"
    _title.setdefault("layers", "(starting)")
    if address:
        _title["address"] = ":" + address.rsplit(":", 1)[-1]
    _show(rank)


def show_layers(start: int | None, end: int | None = None) -> None:
    """The layers this rank holds, [start, end) (None: no model loaded)."""
    _title["layers"] = "(no model)" if start is None or end is None else f"layers {start}-{end - 1}"
    _show(None)


def title() -> str:
    """The title as `ps` shows it."""
    parts = [_title.get("rank", "rank ?"), _title.get("layers", ""), _title.get("address", "")]
    return " ".join(["mlx-relay", *(p for p in parts if p)])


def _show(rank: int | str | None) -> None:
    # Not under OpenMPI's mpirun: its libraries keep pointers into the memory where the
    # command line and environment began, which setproctitle reuses for the title, and
    # rank 0 then exited 1 at MPI_Finalize (tests/test_mpi.py). The short name still tells
    # the ranks apart there.
    if "OMPI_COMM_WORLD_RANK" not in os.environ:
        setproctitle.setproctitle(title())
    if rank is not None:
        _title["short"] = f"{SHORT_NAME_PREFIX}{rank}"
    short = _title.get("short")
    if short and sys.platform == "linux":  # (macOS keeps the executable's name)
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_NAME, short.encode()[:15], 0, 0, 0)
