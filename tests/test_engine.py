"""The engine driven without rank processes: admission, cancellation, the prompt cache
and failure paths, against an in-process pipeline (tests/fake_pipeline.py) whose tokens
are single-process mlx-lm's."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_pipeline import engines  # noqa: E402
from oracle import mlx_lm_tokens, tokenizer_for  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from mlx_relay.coordinator.sampling import SamplingParams  # noqa: E402
from mlx_relay.coordinator.sequence import Chunk, EngineError, Request  # noqa: E402
from mlx_relay.model.memory import MEMORY_LIMIT_ENV  # noqa: E402
from mlx_relay.protocol import header as hdr  # noqa: E402

SEEDED = {"temperature": 0.9, "top_p": 0.95}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("engine"), "llama", num_layers=2)


@pytest.fixture
def start(model):
    """start(**engine_args) -> (engine serving the model, its FakePipeline); stopped after."""
    with engines(model) as start_engine:
        yield start_engine


def prompt(model: Path, text: str) -> list[int]:
    return tokenizer_for(model).encode(text)


def request(tokens: list[int], max_tokens: int = 12, **params) -> Request:
    return Request(
        prompt_tokens=list(tokens), params=SamplingParams(max_tokens=max_tokens, **params)
    )


def read(req: Request) -> tuple[list[int], Chunk]:
    """Every token id of the stream, and its last chunk."""
    ids, last = [], None
    for chunk in req.chunks():
        ids += chunk.token_ids
        last = chunk
    return ids, last


def oracle(model: Path, req: Request) -> list[int]:
    p = req.params
    sampler = {"temp": p.temperature, "top_p": p.top_p} if p.temperature else None
    return mlx_lm_tokens(model, req.prompt_tokens, p.max_tokens, seed=p.seed, sampler=sampler)


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_concurrent_streams_equal_mlx_lm(model, start):
    """Greedy and seeded requests of different lengths, decoded together in groups with
    two steps in flight, each give mlx-lm's tokens; a long prompt goes in chunks."""
    engine, pipeline = start(prefill_chunk=16)
    texts = ["The quick brown fox", "Once upon a time " * 6, "hello", "Numbers: 1 2 3 4 5"]
    reqs = [
        request(prompt(model, text), 10 + i, **(SEEDED | {"seed": i} if i % 2 else {}))
        for i, text in enumerate(texts)
    ]
    for req in reqs:
        engine.submit(req)
    for req in reqs:
        ids, last = read(req)
        assert ids == oracle(model, req)
        assert last.finish_reason == "length"
        assert last.usage["completion_tokens"] == len(ids)
    assert any(h.group != hdr.NO_GROUP and len(h.slots) > 1 for h in pipeline.launched)
    assert engine.scheduler.counts() == (0, 0)


def test_a_full_queue_refuses_and_the_rest_run(model, start):
    engine, pipeline = start(max_active=1, max_queue=1)
    pipeline.gate.clear()  # the first request's step holds the ring
    first = engine.submit(request(prompt(model, "first"), 4))
    second = engine.submit(request(prompt(model, "second"), 4))
    with pytest.raises(EngineError) as refused:
        engine.submit(request(prompt(model, "third"), 4))
    assert refused.value.kind == "exhausted" and "queued" in str(refused.value)
    pipeline.gate.set()
    for req in (first, second):
        assert read(req)[0] == oracle(model, req)


def test_cancelled_while_queued_runs_nothing(model, start):
    engine, pipeline = start(max_active=1)
    pipeline.gate.clear()
    first = engine.submit(request(prompt(model, "first"), 4))
    queued = engine.submit(request(prompt(model, "queued"), 4))
    wait_for(lambda: engine.scheduler.counts() == (1, 1))
    queued.cancel()
    pipeline.gate.set()
    assert read(queued) == ([], Chunk(finish_reason="cancelled"))
    assert read(first)[0] == oracle(model, first)


def test_cancelled_while_decoding_ends_and_frees_its_slot(model, start):
    engine, pipeline = start(max_active=2, prompt_cache=False)
    long = engine.submit(request(prompt(model, "a long story"), 500, ignore_eos=True))
    chunks = long.chunks()
    for _ in range(3):
        next(chunks)
    long.cancel()
    rest = list(chunks)
    assert rest[-1].finish_reason == "cancelled"
    wait_for(lambda: engine.scheduler.counts() == (0, 0))
    assert pipeline.frees and not pipeline.frees[-1][1]  # freed, not parked
    after = engine.submit(request(prompt(model, "after the cancel"), 8))
    assert read(after)[0] == oracle(model, after)


def test_a_shared_prefix_is_served_from_the_parked_cache(model, start):
    """A second turn reuses the first's parked caches: fewer tokens prefilled, the reuse
    flag on its first step, and mlx-lm's tokens all the same."""
    engine, pipeline = start()
    system = prompt(model, "You are a helpful assistant. " * 4)
    first = engine.submit(request(system + prompt(model, " Hi"), 6))
    ids, _ = read(first)
    wait_for(lambda: engine.scheduler.cached_prompts()[0] == 1)
    second = engine.submit(request(first.prompt_tokens + ids + prompt(model, " More"), 6))
    ids2, last = read(second)
    assert ids2 == oracle(model, second)
    assert last.usage["cached_tokens"] >= len(first.prompt_tokens)
    assert any(h.flags & hdr.FLAG_REUSE for h in pipeline.launched)
    third = engine.submit(request(system + prompt(model, " Another conversation"), 6))
    ids3, last = read(third)
    assert ids3 == oracle(model, third)
    assert last.usage["cached_tokens"] >= 16


def test_the_prompt_cache_keeps_to_its_budget(model, start):
    """Beyond --prompt-cache-tokens the oldest parked caches go (the newest stays)."""
    engine, pipeline = start(prompt_cache_tokens=40)
    for text in ("Alpha beta gamma delta " * 3, "Zeta eta theta iota " * 3):
        read(engine.submit(request(prompt(model, text), 4)))
    wait_for(lambda: engine.scheduler.counts() == (0, 0))
    assert engine.scheduler.cached_prompts()[0] == 1
    assert [park for _, park in pipeline.frees] == [True, True, False]  # parked, evicted


def test_the_prompt_cache_keeps_to_its_budget_in_bytes(model, start):
    """--prompt-cache-bytes: the parked caches' budget is what fits that many bytes at the
    model's bytes per token (its caches as mlx-lm makes them), the oldest go first."""
    import math

    from mlx_relay.model import memory

    per_token = memory.cache_nbytes(model, 0, 2, 16384) / 16384
    engine, pipeline = start(prompt_cache_bytes=math.ceil(40 * per_token))
    assert engine.scheduler._slot_steps.budget == 40
    for text in ("Alpha beta gamma delta " * 3, "Zeta eta theta iota " * 3):
        read(engine.submit(request(prompt(model, text), 4)))
    wait_for(lambda: engine.scheduler.counts() == (0, 0))
    assert engine.scheduler.cached_prompts()[0] == 1
    assert [park for _, park in pipeline.frees] == [True, True, False]  # parked, evicted


def test_without_the_prompt_cache_nothing_is_parked(model, start):
    engine, pipeline = start(prompt_cache=False)
    text = "You are a helpful assistant. " * 4
    for _ in range(2):
        _, last = read(engine.submit(request(prompt(model, text), 4)))
        assert last.usage["cached_tokens"] == 0
    assert engine.scheduler.cached_prompts() == (0, 0)
    assert not any(park for _, park in pipeline.frees)


def test_a_rank_failing_a_step_fails_only_its_request(model, start):
    engine, pipeline = start()
    pipeline.fail_step(1, "out of memory in layer 3")
    failed = engine.submit(request(prompt(model, "unlucky"), 6))
    with pytest.raises(EngineError) as e:
        read(failed)
    assert e.value.kind == "internal" and "rank 1" in str(e.value)
    assert "out of memory in layer 3" in str(e.value)
    assert engine.state == "serving"
    after = engine.submit(request(prompt(model, "unlucky"), 6))
    assert read(after)[0] == oracle(model, after)


def test_a_failed_decode_step_fails_its_group_only(model, start):
    """A rank fails one decode step: its sequences end with the rank named, and a parked
    cache on its slots is not reused (it may differ between ranks)."""
    engine, pipeline = start()
    pipeline.fail_step(1, "bad step", lambda s: s.header.group != hdr.NO_GROUP)
    failed = engine.submit(request(prompt(model, "You are a helpful assistant. " * 4), 6))
    with pytest.raises(EngineError, match="rank 1: bad step"):
        read(failed)
    wait_for(lambda: engine.scheduler.counts() == (0, 0))
    assert engine.scheduler.cached_prompts() == (0, 0)
    after = engine.submit(request(failed.prompt_tokens, 6))
    ids, last = read(after)
    assert ids == oracle(model, after) and last.usage["cached_tokens"] == 0


def test_rank_0_failing_at_launch_fails_that_request(model, start):
    engine, pipeline = start()
    pipeline.fail_launch("bad input")
    with pytest.raises(EngineError, match="rank 0: bad input") as e:
        read(engine.submit(request(prompt(model, "first"), 4)))
    assert e.value.kind == "internal"
    after = engine.submit(request(prompt(model, "second"), 4))
    assert read(after)[0] == oracle(model, after)


def test_a_broken_ring_fails_everything_and_names_the_rank(model, start):
    engine, pipeline = start(max_active=1)
    pipeline.break_ring(2, "connection reset")
    running = engine.submit(request(prompt(model, "first"), 4))
    queued = engine.submit(request(prompt(model, "second"), 4))
    for req in (running, queued):
        with pytest.raises(EngineError, match="cluster failed: rank 2: connection reset") as e:
            read(req)
        assert e.value.kind == "unavailable"
    engine.join(10)
    assert engine.state == "failed" and "rank 2" in engine.error
    with pytest.raises(EngineError, match="not serving"):
        engine.submit(request(prompt(model, "third"), 4))


def test_fail_from_another_thread_answers_every_request(model, start):
    """rank 0's watchdog: the engine thread may be stuck in a step; fail() answers."""
    engine, pipeline = start()
    pipeline.gate.clear()  # the engine thread waits inside a step
    req = engine.submit(request(prompt(model, "stuck"), 4))
    wait_for(lambda: engine.scheduler.counts() == (1, 0))
    engine.fail("rank 1 (host): heartbeat lost")
    with pytest.raises(EngineError, match="heartbeat lost"):
        read(req)
    assert engine.state == "failed"
    pipeline.gate.set()
    engine.join(10)
    assert not engine.running


def test_not_enough_memory_waits_for_running_then_refuses(model, start, monkeypatch):
    engine, pipeline = start()
    pipeline.gate.clear()
    running = engine.submit(request(prompt(model, "running"), 4))
    wait_for(lambda: engine.scheduler.counts() == (1, 0))
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "1KB")
    waiting = engine.submit(request(prompt(model, "waiting"), 4))
    time.sleep(0.2)
    assert engine.scheduler.counts() == (1, 1)  # it waits for the running one to end
    pipeline.gate.set()
    assert read(running)[0] == oracle(model, running)
    with pytest.raises(EngineError, match="not enough memory") as e:
        read(waiting)
    assert e.value.kind == "exhausted"


def test_load_failure_and_draining(model, start, tmp_path):
    engine, _ = start()
    with pytest.raises(Exception, match="missing"):
        engine.load(str(tmp_path / "missing")).result(60)
    assert engine.state == "unloaded"
    with pytest.raises(EngineError, match="not serving") as e:
        engine.submit(request([1, 2, 3], 4))
    assert e.value.kind == "unavailable"
    engine.load(str(model)).result(60)
    running = engine.submit(request(prompt(model, "before the drain"), 6))
    engine.drain()
    with pytest.raises(EngineError, match="draining"):
        engine.submit(request([1, 2, 3], 4))
    assert read(running)[0] == oracle(model, running)


def test_a_load_cancels_what_runs(model, start):
    engine, pipeline = start()
    pipeline.gate.clear()
    req = engine.submit(request(prompt(model, "replaced"), 50, ignore_eos=True))
    wait_for(lambda: engine.scheduler.counts() == (1, 0))
    loading = engine.load(str(model))
    pipeline.gate.set()
    with pytest.raises(EngineError, match="being replaced"):
        read(req)
    loading.result(60)
    after = engine.submit(request(prompt(model, "after"), 6))
    assert read(after)[0] == oracle(model, after)


def test_a_warm_up_at_load_runs_a_first_prompts_steps_then_exact_tokens(model, start):
    """`--warm-up on`: at load, full chunks of a prompt, a decode step, a verify step
    of K + 1 positions (with speculation), an odd-length last chunk and a last token
    alone, and one more chunk, timed warm, on one slot,
    which is then dropped; then (warmup.warm_batches) prompts of 2, 3, ... tokens on
    `--max-active` slots and decode groups of 2, 4 ... of them, each member at its own
    offset, fed what the step before sampled; those slots dropped. The pacer starts
    from the chunk's pace, so a first prompt goes in full chunks instead of a probe
    chunk; the tokens stay mlx-lm's."""
    from mlx_relay.coordinator.policy import PROBE_CHUNK
    from mlx_relay.coordinator.speculation import SpecConfig

    chunk = 2 * PROBE_CHUNK
    spec = SpecConfig("ngram", num_draft_tokens=3, adaptive=False)  # (no widths timed)
    engine, pipeline = start(prefill_chunk=chunk, warm_up="on", speculation=spec, max_active=6)
    steps = [(h.slots, h.offsets, h.lengths, h.flags) for h in pipeline.at_load]
    verify = hdr.FLAG_WANT_OUTPUT | hdr.FLAG_ALL_POSITIONS
    assert [s[:3] for s in steps[:7]] == [
        ([0], [0], [chunk]),
        ([0], [chunk], [chunk]),
        ([0], [2 * chunk], [1]),
        ([0], [2 * chunk + 1], [4]),
        ([0], [2 * chunk - chunk // 2 - 1], [chunk // 2 + 1]),  # (an odd last chunk,
        ([0], [2 * chunk], [1]),  # then the last token alone, as a prompt ends)
        ([0], [0], [chunk]),
    ]
    assert steps[3][3] & verify == verify and pipeline.at_load[2].group == 0
    assert steps[4][3] & hdr.FLAG_REUSE and steps[5][3] & hdr.FLAG_WANT_OUTPUT
    assert [s[:3] for s in steps[7:]] == [
        *(([slot], [0], [2 + slot]) for slot in range(6)),  # (prompts of 2 ... 7 tokens)
        ([0, 1], [2, 3], [1, 1]),
        ([0, 1, 2, 3], [3, 4, 4, 5], [1] * 4),
        ([0, 1, 2, 3, 4, 5], [4, 5, 5, 6, 6, 7], [1] * 6),
    ]
    assert all(h.group == 0 and h.flags & hdr.FLAG_WANT_OUTPUT for h in pipeline.at_load[-3:])
    assert pipeline.frees_at_load == [([0], False), ([0, 1, 2, 3, 4, 5], False)]
    assert engine.scheduler.policy.pacer.prefill_unit_s > 0
    req = request(prompt(model, "Once upon a time " * 20), 8, num_draft_tokens=0)
    assert read(engine.submit(req))[0] == oracle(model, req)
    assert pipeline.launched[0].lengths == [chunk]  # (not a probe chunk of PROBE_CHUNK)


def test_no_warm_up_on_the_cpu_by_default(start):
    """`auto` warms up on a GPU only: on the CPU nothing compiles per shape, and a load
    runs no step."""
    _, pipeline = start()
    assert pipeline.at_load == [] and pipeline.frees_at_load == []


def test_the_decode_groups_warmed_at_load_reach_the_largest_a_group_holds():
    """Powers of two below the largest group, then the largest (capped at the step
    header's MAX_SEQS); nothing to warm for groups of one."""
    from mlx_relay.coordinator.warmup import batch_sizes

    assert batch_sizes(16) == [2, 4, 8, 16]
    assert batch_sizes(6) == [2, 4, 6]
    assert batch_sizes(2) == [2]
    assert batch_sizes(1) == []
