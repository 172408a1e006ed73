"""A cluster from one machine's copy (--stage-weights): real ranks, each worker with a
cache of its own, served by rank 0 alone, checked against single-process mlx-lm."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from launching import MLX_RELAY
from oracle import chat_tokens, mlx_lm_tokens

from mlx_relay.launch.local import free_ports
from mlx_relay.model import checkpoint
from mlx_relay.protocol import exits
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = pytest.mark.cluster

MESSAGES = [{"role": "user", "content": "Name three rivers of Europe."}]
LAYERS = "2,2,2"


def _answer(running) -> list[int]:
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES],
        params=pb.SamplingParams(max_tokens=24),
    )
    return list(running.client.generate(request).token_ids)


def _share(model: Path, start: int, end: int) -> int:
    return sum(
        nbytes
        for name, nbytes in checkpoint.tensor_bytes(model).items()
        if (layer := checkpoint.layer_of(name)) is not None and start <= layer < end
    )


def _store(cache: Path) -> Path:
    return cache / "shards" / "blobs"


def test_workers_serve_from_what_rank_0_shipped_them(tiny_model, tmp_path, cluster_factory):
    model = tiny_model("llama", 6)
    expected = mlx_lm_tokens(model, chat_tokens(model, MESSAGES), 24)
    caches = {rank: tmp_path / f"cache-of-rank-{rank}" for rank in (1, 2)}
    env = {rank: {"MLX_RELAY_CACHE": str(cache)} for rank, cache in caches.items()}

    def launch() -> dict[int, pb.RankStaging]:
        running = cluster_factory(model, 3, "--stage-weights", layers=LAYERS, rank_env=env)
        assert _answer(running) == expected
        status = running.client.status()
        running.stop()
        assert {r.rank: dict(r.versions) for r in status.ranks}[1] == dict(status.ranks[0].versions)
        return {r.rank: r.staging for r in status.ranks if r.rank}

    # Empty caches: each worker gets its own layers and nothing else.
    first = launch()
    for rank, staging in first.items():
        start, end = 2 * rank, 2 * rank + 2
        assert staging.state == "staged" and staging.reused_bytes == 0
        assert staging.fetched_bytes == staging.total_bytes > 0
        held = sum(f.stat().st_size for f in _store(caches[rank]).iterdir())
        share = _share(model, start, end)
        assert abs(held - share) <= 0.05 * share, (rank, held, share)
    # Again: nothing moves.
    again = launch()
    assert all(s.fetched_bytes == 0 and s.reused_bytes == s.total_bytes for s in again.values())
    # A flipped byte in one of rank 2's files: that file is fetched again, nothing else.
    victim = sorted(_store(caches[2]).iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    mended = launch()
    assert mended[1].fetched_bytes == 0 and mended[2].fetched_bytes == len(data)


def test_a_worker_without_room_is_refused_by_name(tiny_model, tmp_path):
    model = tiny_model("llama", 6)
    address = f"127.0.0.1:{free_ports(1)[0]}"
    env = {**os.environ, "MLX_RELAY_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [*MLX_RELAY, "local", "--model", str(model), "-n", "3", "--grpc-address", address]
        + ["--stage-weights", "--stage-keep-free", "1000TB", "--restarts", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stderr + result.stdout
    assert result.returncode == exits.EXIT_RANK_FAILED, out
    last = out.strip().splitlines()[-1]
    assert "rank 1" in last and "its shard needs" in last and "keeping 1000" in last, last
    assert "Traceback" not in out
