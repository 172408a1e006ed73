"""Families whose own forward scales embeddings and/or logits by config multipliers
around the layers (granite, minicpm, cohere, afmoe, gear, muse_glimmer ...): rank 0's
embed and head apply exactly what each model's `__call__` does, so clusters give
single-process mlx-lm's tokens at 1, 2 and 3 uneven ranks, greedy and seeded.

One cluster per rank count; each family is loaded into it in turn (Free, LoadModel),
which is much cheaper than starting rank processes per family.
"""

from __future__ import annotations

import threading

import pytest
from conftest import assert_gone, start_cluster
from test_families import _oracle, _request
from tiny_models import MULTIPLIER_FAMILIES

from mlx_relay.protocol import relay_pb2 as pb

NUM_LAYERS = 6
LAYERS = {1: None, 2: "2,4", 3: "1,3,2"}  # uneven
PROMPTS = [("Tell me about the sea.", None), ("Write add(a, b) in Python.", 21)]


@pytest.fixture(scope="module")
def models(tiny_model):
    return {family: tiny_model(family, NUM_LAYERS) for family in MULTIPLIER_FAMILIES}


def _generate_concurrently(client) -> list[object]:
    results: list[object] = [None] * len(PROMPTS)

    def run(i: int) -> None:
        try:
            results[i] = list(client.generate(_request(*PROMPTS[i])).token_ids)
        except Exception as e:  # noqa: BLE001 - reported by the caller's assert
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


@pytest.mark.cluster
@pytest.mark.parametrize("ranks", sorted(LAYERS))
def test_clusters_equal_mlx_lm(models, tmp_path, ranks):
    layers = LAYERS[ranks]
    families = list(models)
    running = start_cluster(models[families[0]], ranks, tmp_path / "logs", layers=layers)
    try:
        client = running.client
        for i, family in enumerate(families):
            path = models[family]
            if i:
                client.stub.Free(pb.FreeRequest(), timeout=60)
                load = pb.LoadModelRequest(model=str(path), layers=layers or "")
                client.stub.LoadModel(load, timeout=120)
            got = _generate_concurrently(client)
            for (text, seed), tokens in zip(PROMPTS, got, strict=True):
                assert tokens == _oracle(path, text, seed), f"{family} at {ranks} ranks, {seed=}"
        status = client.status()
        assert status.active_requests == 0 and status.queued_requests == 0
    finally:
        running.stop()
        assert_gone(running.pids)
