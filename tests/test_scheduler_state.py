"""The scheduler's two calls (coordinator/scheduler.py) with real sequences, no engine
thread and no pipeline: the typed `StepPlan` that `schedule()` hands out, and what
`update_from_output(StepResult)` answers as tokens come back (plan.py). The test plays
the engine: it "launches" each forward step, samples (sets the next input, as the
engine does on the device) and reports the values read."""

from __future__ import annotations

import dataclasses
import sys
from collections import deque
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402

from mlx_relay.coordinator.config import EngineConfig  # noqa: E402
from mlx_relay.coordinator.model_context import ModelContext  # noqa: E402
from mlx_relay.coordinator.plan import (  # noqa: E402
    DecodeGroup,
    Free,
    Outputs,
    Park,
    PrefillChunk,
    StepResult,
    Verify,
)
from mlx_relay.coordinator.policy import PROBE_CHUNK, StepOutput  # noqa: E402
from mlx_relay.coordinator.sampling import SamplingParams  # noqa: E402
from mlx_relay.coordinator.scheduler import Scheduler  # noqa: E402
from mlx_relay.coordinator.sequence import Chunk, EngineError, Request  # noqa: E402
from mlx_relay.coordinator.speculation import SpecConfig  # noqa: E402
from mlx_relay.coordinator.stats import EngineStats, RoundCount  # noqa: E402
from mlx_relay.model import sharding  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("sched"), "llama", num_layers=1)
    return load_tokenizer(path), sharding.load_shard(path, 0, 1, has_ends=True)


def scheduler(loaded, stats: EngineStats | None = None, **kwargs) -> Scheduler:
    tokenizer, shard = loaded
    config = EngineConfig(**({"max_active": 2, "max_queue": 4} | kwargs))
    s = Scheduler(config, groups=1, stats=stats)
    s.load(ModelContext.of(tokenizer, shard, 64))
    return s


def request(n: int, max_tokens: int = 2, prompt: list[int] | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(prompt_tokens=prompt or list(range(10, 10 + n)), params=params)


def sampled(forward, tokens: list[int]) -> StepResult:
    """The engine's part after a step with logits: each row's token is its sequence's
    next input (on the device), then the values read back are the step's result."""
    for seq, token in zip(forward.seqs, tokens, strict=True):
        seq.next_input = mx.array([token])
    return StepResult(forward, list(forward.seqs), tokens, [None] * len(tokens))


def run_prompt(s: Scheduler):
    """Plan a prompt's chunks to its last token; return that last chunk (within 10,000
    chunks: the prompts here are a few hundred tokens at most, one a chunk at least)."""
    for _ in range(10_000):
        forward = s.schedule().forward
        assert isinstance(forward, PrefillChunk)
        if forward.want_logits:
            return forward
        assert s.update_from_output(StepResult(forward)) == Outputs()
    raise AssertionError("the prompt's last chunk was never planned in 10,000 chunks")


def park_one(s: Scheduler, n: int):
    """A prompt of `n` tokens that ends at its first token, parked; its sequence."""
    s.add(request(n, max_tokens=1))
    last = run_prompt(s)
    assert s.update_from_output(sampled(last, [7])).slots == [Park(last.seq.slot)]
    return last.seq


def test_a_prompt_goes_in_chunks_then_decodes_in_a_group_and_parks(loaded):
    s = scheduler(loaded)
    req = request(40)
    s.add(req)
    plan = s.schedule()  # admitted, and its first chunk planned
    first = plan.forward
    assert plan.before == Outputs() and plan.after == []
    assert isinstance(first, PrefillChunk) and len(first.tokens) == PROBE_CHUNK
    assert first.position == 0 and not first.want_logits
    rest = s.schedule().forward  # all but the last token, whose step gives token 1
    assert len(rest.tokens) == 40 - PROBE_CHUNK - 1 and not rest.want_logits
    assert rest.position == PROBE_CHUNK
    last = s.schedule().forward
    assert len(last.tokens) == 1 and last.want_logits and last.position == 39
    assert s.schedule().forward is None  # nothing runnable until token 1 is sampled
    seq = last.seq
    out = s.update_from_output(sampled(last, [5]))
    assert [(r, c.token_ids) for r, c in out.emit] == [(req, [5])] and not out.finished
    step = s.schedule().forward
    assert isinstance(step, DecodeGroup) and step.members == [seq] and step.positions == [40]
    assert s.schedule().forward is None  # its token is in flight
    out = s.update_from_output(sampled(step, [6]))
    assert out.finished == [seq] and out.emit[-1][1].finish_reason == "length"
    assert out.slots == [Park(seq.slot)] and seq.finished
    assert s.cached_prompts() == (1, 41)  # the prompt and the token fed back
    assert s.counts() == (0, 0)


def test_the_next_turn_starts_from_the_parked_cache(loaded):
    s = scheduler(loaded)
    seq = park_one(s, 40)
    s.add(request(60))
    nxt = s.schedule().forward
    assert nxt.reuse_from == seq.slot and nxt.seq.cached_tokens == 40 and nxt.position == 40


def test_a_full_queue_and_cancellations_through_the_queue(loaded):
    s = scheduler(loaded, max_active=1, max_queue=1, prompt_cache=False)
    running, queued = request(20), request(20)
    s.add(running)
    first = s.schedule().forward
    s.add(queued)
    with pytest.raises(EngineError, match="server busy"):
        s.add(request(20))
    running.cancel()  # from another thread: read at the next call
    assert s.has_work()
    out = s.update_from_output(StepResult(first))  # its chunk back: ignored, it ended
    assert out.emit[0][1].finish_reason == "cancelled" and out.slots == [Free(0)]
    queued.cancel()
    plan = s.schedule()
    assert plan.before.emit == [(queued, Chunk(finish_reason="cancelled"))]
    assert plan.forward is None and s.running == [] and s.waiting == deque()


def test_a_step_failed_on_rank_0_ends_its_sequence_and_frees_its_slot(loaded):
    s = scheduler(loaded, prompt_cache=False)
    req = request(8)
    s.add(req)
    forward = s.schedule().forward
    out = s.update_from_output(StepResult(forward, failed="rank 0: broken"))
    assert [(r, type(e), e.kind) for r, e in out.emit] == [(req, EngineError, "internal")]
    assert out.slots == [Free(forward.seq.slot)] and s.running == []


def test_a_failed_step_forgets_the_parked_caches_on_its_slots(loaded):
    s = scheduler(loaded)
    seq = park_one(s, 40)
    assert s.cached_prompts()[0] == 1
    failed = StepResult(None, failed="rank 1: gone wrong", lost_slots=[seq.slot])
    out = s.update_from_output(failed)
    assert out.slots == [Free(seq.slot)] and s.cached_prompts() == (0, 0)


def test_a_speculative_round_keeps_the_agreeing_proposals(loaded):
    """Prompt lookup proposes what followed the prompt's last tokens before; the round's
    tokens keep the proposals up to the first that differs, then the sampled one, and
    the sequence's position goes back to what its caches truly hold."""
    stats = EngineStats()
    s = scheduler(loaded, stats, speculation=SpecConfig("ngram", 4, adaptive=False))
    prompt = [10, 11, 12, 10, 11, 12, 10, 11]
    s.add(request(0, max_tokens=8, prompt=prompt))
    chunk = s.schedule().forward
    assert isinstance(chunk, PrefillChunk) and chunk.tokens == prompt[:-1]
    s.update_from_output(StepResult(chunk))
    verify = s.schedule().forward  # the prompt's last token, with the first proposals
    assert isinstance(verify, Verify) and verify.position == 7 and verify.width == 5
    assert verify.proposed.tolist() == [12, 10, 11, 12]
    seq = verify.seq
    out = s.update_from_output(StepResult(verify, [seq], [12, 10, 99, 1, 2], [None] * 5))
    assert [c.token_ids for _, c in out.emit] == [[12], [10], [99]]
    assert seq.position == 7 + 5 - (5 - 1 - 2)  # the refused proposals are cut back
    assert seq.next_input.tolist() == [99] and stats.rounds() == RoundCount(1, 4, 2)
    again = s.schedule().forward
    assert isinstance(again, Verify) and again.position == seq.position - again.width


def test_what_a_step_took_paces_the_next_chunk(loaded):
    """A prompt's first chunk is a probe; once it says what it took (a result of its
    own), the next is sized by that pace: here fast, so the rest goes in one chunk."""
    s = scheduler(loaded, prefill_chunk=512)
    s.add(request(400, max_tokens=1))
    probe = s.schedule().forward
    assert len(probe.tokens) == PROBE_CHUNK
    took = StepOutput("prefill", seconds=1e-4, tokens=PROBE_CHUNK, units=PROBE_CHUNK)
    assert (
        s.update_from_output(StepResult(probe, took=dataclasses.replace(took, want_logits=False)))
        == Outputs()
    )
    assert len(s.schedule().forward.tokens) == 400 - PROBE_CHUNK - 1
