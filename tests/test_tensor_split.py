"""The tensor layout's rules, in process: which models split, what each rank holds."""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import pytest

from mlx_relay.coordinator.load_checks import check_loadable
from mlx_relay.coordinator.pipeline import in_flight
from mlx_relay.coordinator.requests import InvalidRequest
from mlx_relay.launch.serve import add_serve_options, serve_argv
from mlx_relay.model import memory, tensor_split
from mlx_relay.transport.tensor import (
    AUTO,
    TensorGroup,
    TensorLayoutError,
    check_grid_backend,
    check_layout,
    group_size,
    parse_tensor_parallel,
)


def _config(model) -> dict:
    return json.loads((model / "config.json").read_text())


def test_families_mlx_lm_shards_split_and_others_say_why(tiny_model):
    assert tensor_split.refusal(_config(tiny_model("llama", 2)), 2) is None
    assert tensor_split.refusal(_config(tiny_model("qwen3", 2)), 2) is None
    why = tensor_split.refusal(_config(tiny_model("gemma3_text", 2)), 2)
    assert why == "mlx-lm's gemma3_text has no shard(): its layers cannot be split"
    # (4 attention heads, 2 KV heads: 4 ranks cannot each take a whole KV head)
    why = tensor_split.refusal(_config(tiny_model("llama", 2)), 4)
    assert why == "llama's num_key_value_heads (2) does not divide by 4"


def test_a_load_on_a_grid_needs_a_layer_a_stage_not_a_rank(tiny_model):
    """LoadModel's check at run time is the start's (stage_count): a grid of 2 stages x 2
    ranks loads a 3-layer model; a pipeline of 4 ranks cannot, nor a grid of a family
    whose layers cannot split (it runs as a pipeline)."""
    llama = tiny_model("llama", 3)
    assert check_loadable(str(llama), None, 4, stages=2).num_layers == 3
    with pytest.raises(InvalidRequest, match="has 3 layers, fewer than the 4 ranks"):
        check_loadable(str(llama), None, 4)
    with pytest.raises(InvalidRequest, match="has 1 layers, fewer than the 2 pipeline stages"):
        check_loadable(str(tiny_model("llama", 1)), None, 4, stages=2)
    with pytest.raises(InvalidRequest, match="fewer than the 4 ranks"):
        check_loadable(str(tiny_model("gemma3_text", 3)), None, 4, stages=2)


def test_steps_in_flight_one_a_stage_for_a_split_and_one_a_rank_for_auto():
    """A split runs a step a stage unless told otherwise; `auto` keeps a pipeline's one a
    rank (0), which it needs where it chooses one: it ran one step at a time before."""
    world = mx.distributed.init()
    assert in_flight(0, None) == 0 and in_flight(3, None) == 3
    assert in_flight(0, TensorGroup(world, "ring")) == 1
    assert in_flight(0, TensorGroup(world, "mpi, stages of 2", stages=2)) == 2
    assert in_flight(4, TensorGroup(world, "mpi, stages of 2", stages=2)) == 4
    assert in_flight(0, TensorGroup(world, "world", auto=True)) == 0


def test_a_split_rank_counts_its_share_of_the_layers(tiny_model):
    model = tiny_model("llama", 4)
    layers = memory.shard_nbytes(model, 0, 4)
    ends = memory.shard_nbytes(model, 0, 4, ends=True) - layers
    assert memory.shard_nbytes(model, 0, 4, tensor=2) == (layers + 1) // 2
    assert memory.shard_nbytes(model, 0, 4, ends=True, tensor=2) == (layers + 1) // 2 + ends


@pytest.mark.parametrize(
    ("tensor", "ranks", "says"),
    [
        (-1, 2, "expected 1 or more"),
        (3, 2, "does not divide a cluster of 2 ranks"),
        (3, 4, "does not divide a cluster of 4 ranks"),
    ],
)
def test_layouts_not_built_are_refused_with_the_reason(tensor, ranks, says):
    with pytest.raises(TensorLayoutError, match=says):
        check_layout(tensor, ranks)


def test_a_grid_is_a_layout_where_the_backend_splits_groups_or_stages_are_pairs():
    """Stages of 2 on 4 ranks, or of 3 on 6, fit; stages of two run on any backend (a
    pair's all-sums are exchanges: transport/pairs.py), larger ones only where the
    ranks' backend splits groups (MPI, NCCL), else refused saying what can."""
    check_layout(2, 4)
    check_layout(3, 6)
    check_grid_backend(2, 4, "ring", splits=False)
    check_grid_backend(3, 6, "mpi", splits=True)
    check_grid_backend(4, 4, "ring", splits=False)  # (one stage: no split needed)
    with pytest.raises(TensorLayoutError, match="2 stages of 3: a stage of more than two") as e:
        check_grid_backend(3, 6, "ring", splits=False)
    assert "MLX's ring backend does not have" in str(e.value)
    assert '"backend": "mpi"' in str(e.value)


def test_a_split_refuses_hops_that_pair_ranks_for_payloads():
    for mode in ("collective", "adaptive"):
        with pytest.raises(TensorLayoutError, match=f"--hop-mode {mode} pairs ranks"):
            check_layout(2, 2, mode)
    check_layout(1, 2, "collective")  # (a pipeline may)


def test_a_split_refuses_a_layer_range_a_rank():
    """`--layers` with `--tensor-parallel N` would load as a pipeline with the split's
    settings (CUDA graphs off): refused before any rank starts. `auto` then runs the
    pipeline it was given, and a pipeline takes any --layers."""
    with pytest.raises(TensorLayoutError, match="--layers 3,5 gives each rank a range"):
        check_layout(2, 2, "eager", "3,5")
    with pytest.raises(TensorLayoutError, match="--layers balanced"):
        check_layout(2, 2, "auto", "balanced")
    check_layout(AUTO, 2, "auto", "3,5")
    check_layout(1, 2, "auto", "3,5")
    check_layout(2, 2, "auto", "")


def test_one_stage_and_plain_pipelines_are_layouts():
    for tensor, ranks in ((1, 1), (1, 3), (2, 2), (4, 4), (AUTO, 1), (AUTO, 3)):
        check_layout(tensor, ranks)


def test_tensor_parallel_takes_ranks_or_auto():
    assert parse_tensor_parallel("auto") == AUTO and parse_tensor_parallel("AUTO") == AUTO
    assert parse_tensor_parallel("2") == 2 and group_size(AUTO, 3) == 3 and group_size(2, 4) == 2
    for bad in ("0", "-2", "two"):
        with pytest.raises(ValueError, match="ranks, or auto|number of ranks or auto"):
            parse_tensor_parallel(bad)
    check_layout(AUTO, 2, "collective")  # (auto then runs a pipeline, and says why)


def test_auto_reaches_the_ranks_command_lines_as_auto():
    """A launcher passes `--tensor-parallel auto` on to its ranks as it was given."""
    parser = argparse.ArgumentParser()
    add_serve_options(parser)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(["--tensor-parallel", "auto"])
    argv = serve_argv(args)
    assert argv[argv.index("--tensor-parallel") + 1] == "auto"
    assert parser.parse_args(argv).tensor_parallel == AUTO
    with pytest.raises(SystemExit):
        parser.parse_args(["--tensor-parallel", "0"])


def test_the_split_projections_drop_their_training_hook(tiny_model):
    """Every AllToSharded projection gets the stand-in group of one, so its forward pass
    calls no mx.custom_function (the gradient hook, ~14 us of host time a projection
    here); the split's math is MLX's own (the cluster tests compare its tokens with
    mlx-lm's split generation). A group of one here: shard() builds the same layers."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    path = tiny_model("llama", 2)
    model, _ = load(str(path))
    tensor_split.split(model, json.loads((path / "config.json").read_text()), mx.distributed.init())
    hooked = [m for _, m in model.named_modules() if isinstance(m, tensor_split._GRADIENT_HOOKED)]
    assert hooked and all(m.group is tensor_split._NO_GRADIENT_SUM for m in hooked)
    assert not any(isinstance(m, nn.Linear) for _, m in model.model.layers[0].named_modules())
    out = model(mx.array([[1, 2, 3]]))
    assert out.shape[:2] == (1, 3)
