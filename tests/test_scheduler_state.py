"""The scheduler's state and its typed actions (coordinator/scheduler.py), with no engine
thread and no pipeline: what it asks to launch, and what it answers as tokens come back."""

from __future__ import annotations

import sys
from collections import deque
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402

from mlx_relay.coordinator.output import OutputProcessor  # noqa: E402
from mlx_relay.coordinator.policy import PROBE_CHUNK  # noqa: E402
from mlx_relay.coordinator.sampling import SamplingParams  # noqa: E402
from mlx_relay.coordinator.scheduler import (  # noqa: E402
    DecodeGroup,
    Free,
    Park,
    PrefillChunk,
    Scheduler,
)
from mlx_relay.coordinator.sequence import Chunk, EngineError, Request  # noqa: E402
from mlx_relay.model import sharding  # noqa: E402
from mlx_relay.text.markup import ChatMarkup  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("sched"), "llama", num_layers=1)
    return load_tokenizer(path), sharding.load_shard(path, 0, 1, has_ends=True)


def scheduler(loaded, **kwargs) -> Scheduler:
    tokenizer, shard = loaded
    args = {"max_active": 2, "max_queue": 4, "prefill_chunk": 512, "groups": 1} | kwargs
    s = Scheduler(**args)
    s.load(OutputProcessor(tokenizer, 0), ChatMarkup.of(tokenizer), shard, 64, None)
    return s


def request(n: int, max_tokens: int = 2) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(prompt_tokens=list(range(10, 10 + n)), params=params)


def run_prompt(s: Scheduler):
    """Schedule a prompt's chunks to its last token; return the sequence."""
    while True:
        action = s.schedule()
        assert isinstance(action, PrefillChunk)
        assert s.launched(action).slots == []
        if action.want_logits:
            return action.seq


def park_one(s: Scheduler, n: int):
    """A prompt of `n` tokens that ends at its first token, parked; its sequence."""
    s.add(request(n, max_tokens=1))
    s.admit()
    seq = run_prompt(s)
    s.sampled([seq], mx.array([7]))
    assert s.update_from_output([seq], [7], [None]).slots == [Park(seq.slot)]
    return seq


def test_a_prompt_goes_in_chunks_then_decodes_in_a_group_and_parks(loaded):
    s = scheduler(loaded)
    req = request(40)
    s.add(req)
    assert s.admit().emit == []
    first = s.schedule()
    assert isinstance(first, PrefillChunk) and len(first.tokens) == PROBE_CHUNK
    assert not first.want_logits
    s.launched(first)
    rest = s.schedule()  # all but the last token, whose step gives token 1
    assert len(rest.tokens) == 40 - PROBE_CHUNK - 1 and not rest.want_logits
    s.launched(rest)
    last = s.schedule()
    assert len(last.tokens) == 1 and last.want_logits
    s.launched(last)
    assert s.schedule() is None  # nothing runnable until token 1 is sampled
    seq = last.seq
    s.sampled([seq], mx.array([5]))
    update = s.update_from_output([seq], [5], [None])
    assert [(r, c.token_ids) for r, c in update.emit] == [(req, [5])] and not update.finished
    step = s.schedule()
    assert isinstance(step, DecodeGroup) and step.members == [seq]
    s.launched(step)
    s.sampled([seq], mx.array([6]))
    update = s.update_from_output([seq], [6], [None])
    assert update.finished == [seq] and update.emit[-1][1].finish_reason == "length"
    assert update.slots == [Park(seq.slot)]
    assert s.slots.stats() == (1, 41)  # the prompt and the token fed back


def test_the_next_turn_starts_from_the_parked_cache(loaded):
    s = scheduler(loaded)
    seq = park_one(s, 40)
    s.add(request(60))
    s.admit()
    nxt = s.schedule()
    assert nxt.reuse_from == seq.slot and nxt.seq.cached_tokens == 40


def test_a_full_queue_cancelled_and_failed_requests(loaded):
    s = scheduler(loaded, max_active=1, max_queue=1, prompt_cache=False)
    running, queued = request(20), request(20)
    s.add(running)
    s.admit()
    s.add(queued)
    with pytest.raises(EngineError, match="server busy"):
        s.add(request(20))
    running.cancel()
    update = s.reap_cancelled()
    assert update.emit[0][1].finish_reason == "cancelled" and update.slots == [Free(0)]
    queued.cancel()
    assert s.admit().emit == [(queued, Chunk(finish_reason="cancelled"))]
    assert s.running == [] and s.waiting == deque()


def test_a_failed_step_forgets_the_parked_caches_on_its_slots(loaded):
    s = scheduler(loaded)
    seq = park_one(s, 40)
    assert s.slots.stats()[0] == 1
    update = s.step_failed([seq.slot], [], "rank 1: gone wrong")
    assert update.slots == [Free(seq.slot)] and s.slots.stats() == (0, 0)
