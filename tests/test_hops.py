"""How hops are timed (`--hop-mode`): the automatic choice, and eager hops end to end."""

from __future__ import annotations

import pytest

from mlx_relay.transport.ring import AUTO, EAGER, READY, choose_hop_mode


@pytest.mark.parametrize(
    ("backend", "on_gpu", "cores", "ranks_here", "expected"),
    [
        ("ring", False, 16, 2, EAGER),  # a CPU with cores to spare for a spinning receive
        ("ring", False, 16, 3, EAGER),
        ("ring", False, 2, 2, READY),  # the CI box: spinning would take the compute's cores
        ("ring", False, 4, 2, READY),
        ("ring", True, 16, 1, READY),  # a GPU rank: eager stalled on CUDA, untried on Metal
        ("ring", True, 16, 2, READY),
        ("jaccl", True, 8, 1, READY),
        ("mpi", False, 64, 1, READY),  # receives on their own thread: not under plain MPI_Init
    ],
)
def test_auto_picks_eager_hops_only_where_they_cost_nothing(
    backend, on_gpu, cores, ranks_here, expected
):
    assert (
        choose_hop_mode(AUTO, backend, on_gpu=on_gpu, cores=cores, ranks_here=ranks_here)
        == expected
    )


def test_an_explicit_mode_is_kept_and_a_bad_one_is_refused_clearly():
    assert choose_hop_mode(EAGER, "ring", on_gpu=True, cores=2, ranks_here=3) == EAGER
    assert choose_hop_mode(READY, "ring", on_gpu=False, cores=64, ranks_here=1) == READY
    with pytest.raises(ValueError, match="not mpi"):
        choose_hop_mode(EAGER, "mpi", on_gpu=False, cores=64, ranks_here=1)
    with pytest.raises(ValueError, match="expected auto, eager or ready"):
        choose_hop_mode("fast", "ring", on_gpu=False, cores=64, ranks_here=1)
