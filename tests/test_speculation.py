"""Speculative decoding, without rank processes: proposals (prompt lookup, a draft
model), the adaptive round size, and the engine's verify steps against an in-process
pipeline (tests/fake_pipeline.py), whose tokens are single-process mlx-lm's. The
oracle: mlx-lm's own speculative generator for a draft model, plain greedy decoding for
prompt lookup. tests/test_speculation_cluster.py runs the same over real ranks."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))

from fake_pipeline import FakePipeline, engines  # noqa: E402
from oracle import mlx_lm_tokens, tokenizer_for  # noqa: E402
from scripted import script_model  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from mlx_relay.coordinator.drafting import lookup  # noqa: E402
from mlx_relay.coordinator.sampling import SamplingParams  # noqa: E402
from mlx_relay.coordinator.sequence import Chunk, Request  # noqa: E402
from mlx_relay.coordinator.speculation import (  # noqa: E402
    EMPTY_LIMIT,
    MISS_LIMIT,
    RoundCost,
    SpecConfig,
    SpecState,
    expected_tokens,
)
from mlx_relay.model import memory, sharding  # noqa: E402
from mlx_relay.protocol import header as hdr  # noqa: E402

SEEDED = {"temperature": 0.9, "top_p": 0.95}
TEXTS = ("The quick brown fox jumps over the lazy dog. The quick brown fox", "hello hello")


# --- rules ------------------------------------------------------------------------------
def test_lookup_proposes_what_followed_the_latest_longest_match():
    history = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 1, 2, 3]
    assert lookup(history, 3) == [7, 8, 4]  # (the later of the two [1, 2, 3])
    assert lookup(history, 1) == [7]
    assert lookup([5, 6, 5, 6, 5], 4) == [6, 5, 6, 5]  # (a loop goes round again)
    assert lookup([1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]
    assert lookup([1, 2, 3, 4], 3) == []  # nothing repeats
    assert lookup([1, 2, 1, 2], 0) == []


def test_round_size_adapts_to_acceptance():
    spec = SpecState(k=4, limit=4)
    spec.record(4, 4)
    assert spec.k == 4  # (at most the limit)
    spec.record(4, 1)
    assert spec.k == 3
    for _ in range(5):
        spec.record(spec.k, 0)
    assert spec.k == 1 and not spec.leaving
    for _ in range(MISS_LIMIT):
        spec.record(1, 0)
    assert spec.leaving and spec.wanted(10) == 0
    assert (spec.drafted, spec.accepted) == (4 + 4 + 3 + 2 + 1 + 1 + 1 + MISS_LIMIT, 5)
    fixed = SpecState(k=4, limit=4, adaptive=False)
    for _ in range(2 * MISS_LIMIT):
        fixed.record(4, 0)
    assert fixed.k == 4 and not fixed.leaving
    assert fixed.wanted(2) == 2  # (never more than may still be generated)


def test_a_sequence_the_drafter_has_nothing_for_stops_after_a_few_rounds():
    """Rounds with no proposal are plain decode steps that wait for their token on the
    host (a group's launch on tokens not yet read): after EMPTY_LIMIT in a row the
    sequence decodes in a group; a round with a proposal starts the count again."""
    spec = SpecState(k=4, limit=4)
    for _ in range(EMPTY_LIMIT - 1):
        spec.record(0, 0)
    spec.record(2, 0)  # (a proposal, refused: a miss, not an empty round)
    for _ in range(EMPTY_LIMIT - 1):
        spec.record(0, 0)
    assert not spec.leaving and spec.wanted(10) > 0
    spec.record(0, 0)
    assert spec.leaving and spec.wanted(10) == 0
    fixed = SpecState(k=4, limit=4, adaptive=False)  # (--draft-fixed: the user's K stays)
    for _ in range(2 * EMPTY_LIMIT):
        fixed.record(0, 0)
    assert not fixed.leaving and fixed.wanted(10) == 4


def test_round_size_follows_what_each_width_costs_here():
    """Where a wider verify step costs almost nothing more (a GPU reading its weights),
    every proposal pays; where each position costs compute (a CPU), fewer do; where a
    wider step is cheaper than a narrower one (MLX's CUDA quantized matmul: 8 rows
    cheaper than 5), the narrower is padded to it; where one position alone gives more,
    the sequence stops speculating."""
    assert expected_tokens(0, 0.9) == 1 and expected_tokens(2, 0.5) == pytest.approx(1.75)
    flat, steep, cuda = RoundCost(), RoundCost(), RoundCost()
    assert flat.best(0.8, 4) is None and flat.padded(3) == 3  # (nothing timed yet)
    flat.took(1, 0.0205)
    assert flat.padded(3) == 8  # (then each probe width once)
    for width in (1, 2, 3, 4, 5, 8, 16):
        flat.took(width, 0.020 + 0.0005 * width)
        steep.took(width, 0.010 + 0.010 * width)
    assert flat.best(0.8, 4) == 4
    assert steep.best(0.8, 4) == 2
    assert steep.best(0.3, 4) == 0  # (one position alone is best: stop speculating)
    for width, ms in ((1, 9.7), (2, 14.0), (3, 18.7), (5, 26.8), (8, 19.0), (16, 19.5)):
        cuda.took(width, ms / 1000)
    assert cuda.padded(5) == 8 and cuda.padded(2) == 2 and cuda.padded(8) == 8
    assert cuda.cost(4) == cuda.cost(3)  # (unmeasured: as the nearest narrower)
    assert cuda.best(0.9, 7) == 7  # (8 positions for the price of 2)
    spec = SpecState(k=4, limit=4)
    spec.record(4, 1, flat)
    assert spec.k == flat.best(spec.acceptance, 4) and spec.acceptance == pytest.approx(0.5)
    spec.record(4, 0, steep)
    assert spec.leaving


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="draft-model"):
        SpecConfig("model")
    with pytest.raises(ValueError, match="at least 1"):
        SpecConfig("ngram", num_draft_tokens=0)
    with pytest.raises(ValueError, match="unknown draft source"):
        SpecConfig("eagle")


# --- the engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", num_layers=2)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> Path:
    """A draft that mostly disagrees with the target: same tokenizer, other weights."""
    return make_tiny_model(tmp_path_factory.mktemp("draft"), "llama", num_layers=1, seed=7)


@pytest.fixture
def start(model):
    """start(speculation, **engine_args) -> (engine serving the model, its pipeline)."""
    with engines(model) as start_engine:
        yield lambda speculation, **kwargs: start_engine(speculation=speculation, **kwargs)


def request(model: Path, text: str, max_tokens: int = 24, **params) -> Request:
    tokens = tokenizer_for(model).encode(text)
    return Request(prompt_tokens=tokens, params=SamplingParams(max_tokens=max_tokens, **params))


def read(req: Request) -> tuple[list[int], Chunk]:
    whole = Chunk()
    for chunk in req.chunks():
        whole.add(chunk)
    return whole.token_ids, whole


def verify_steps(pipeline: FakePipeline) -> list[hdr.StepHeader]:
    return [h for h in pipeline.launched if h.flags & hdr.FLAG_ALL_POSITIONS]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("draft", ["self", "other"])
def test_draft_model_tokens_equal_mlx_lms_speculative_generator(
    model, other_draft, start, seeded, draft
):
    """With the same draft model, K and seed, the tokens are mlx-lm's own speculative
    generator's: high acceptance (the target drafting for itself) and low (another
    model), so both the kept-all and the cut-back paths run."""
    draft_path = model if draft == "self" else other_draft
    engine, pipeline = start(SpecConfig("model", 3, str(draft_path), adaptive=False))
    for i, text in enumerate(TEXTS):
        params = SEEDED | {"seed": 11 + i} if seeded else {}
        req = engine.submit(request(model, text, 20, **params))
        ids, whole = read(req)
        expected = mlx_lm_tokens(
            model,
            req.prompt_tokens,
            20,
            seed=params.get("seed"),
            sampler={"temp": 0.9, "top_p": 0.95} if seeded else None,
            draft=draft_path,
            num_draft_tokens=3,
        )
        assert ids == expected
        usage = whole.usage
        assert usage["draft_tokens"] > 0
        assert 0 <= usage["accepted_draft_tokens"] <= usage["draft_tokens"]
    assert verify_steps(pipeline)
    counts = engine.stats.rounds()
    assert counts.rounds > 0
    if draft == "self" and not seeded:
        assert counts.accepted == counts.proposed  # (it agrees with itself)


def test_prompt_lookup_gives_plain_greedy_tokens(tmp_path):
    """Prompt lookup (greedy) on a model that repeats a text its prompt holds (a tiny
    model scripted to say it: test_generation.script_model; a random one never repeats
    itself, and the default model costs ~0.14 s a token here: the cluster test asks it):
    the tokens of plain greedy decoding, most of them proposals kept, in fewer steps than
    tokens."""
    path = make_tiny_model(tmp_path, "llama", num_layers=2)
    start = load_tokenizer(path).encode("Repeat:")[-1]  # (not the oracle's: it keeps weights)
    chain = script_model(path, {start: ["the quick brown fox jumps over the lazy dog"]})[start]
    tokens = [*chain, start]  # (the text, then the token after which the model says it)
    with engines(path) as start_engine:
        engine, pipeline = start_engine(speculation=SpecConfig("ngram", 4, adaptive=False))
        req = engine.submit(Request(prompt_tokens=tokens, params=SamplingParams(max_tokens=40)))
        ids, whole = read(req)
        assert ids == mlx_lm_tokens(path, tokens, 40) == chain
        assert whole.usage["accepted_draft_tokens"] > len(ids) / 3
        assert len(verify_steps(pipeline)) < len(ids)


def test_penalties_logprobs_and_the_length_hold(model, start):
    """A round's positions are each sampled with the request's logits processors over
    the text before them; logprobs come for every token; max_tokens ends a round."""
    engine, _ = start(SpecConfig("model", 4, str(model), adaptive=False))
    plain, _ = start(None)
    for max_tokens in (3, 9):
        settings = {"repetition_penalty": 1.3, "logprobs": True, "top_logprobs": 2}
        got = read(engine.submit(request(model, TEXTS[0], max_tokens, **settings)))
        want = read(plain.submit(request(model, TEXTS[0], max_tokens, **settings)))
        assert got[0] == want[0] and len(got[0]) <= max_tokens
        assert got[1].finish_reason == want[1].finish_reason
        assert [e.token_id for e in got[1].logprobs] == got[0]
        for a, b in zip(got[1].logprobs, want[1].logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert [t[0] for t in a.top] == [t[0] for t in b.top]


def test_streams_beyond_the_limit_decode_in_groups(model, start):
    """With more requests than --draft-max-streams, the later ones decode in batched
    groups and the speculating ones join them; every stream keeps its greedy tokens,
    and a speculating stream can be cancelled."""
    # (fixed K: whether rounds pay, measured at load, is another test's; on a busy
    # machine that measure may turn drafting off, and this test would check nothing)
    engine, pipeline = start(SpecConfig("ngram", 4, adaptive=False, max_streams=1), max_active=4)
    texts = [TEXTS[0], "a b c a b c a b c", "Once upon a time", TEXTS[1]]
    reqs = [engine.submit(request(model, t, 30, ignore_eos=True)) for t in texts]
    for req in reqs:
        ids, _ = read(req)
        assert ids == mlx_lm_tokens(model, req.prompt_tokens, 30)
    assert any(h.lengths[0] > 1 for h in verify_steps(pipeline))  # (proposals, not rounds of none)
    assert any(h.group != hdr.NO_GROUP and len(h.slots) > 1 for h in pipeline.launched)
    cancelled = engine.submit(request(model, TEXTS[0], 500, ignore_eos=True))
    chunks = cancelled.chunks()
    next(chunks)
    cancelled.cancel()
    assert list(chunks)[-1].finish_reason == "cancelled"
    again = engine.submit(request(model, TEXTS[0], 12))  # (its parked cache, cut back)
    assert read(again)[0] == mlx_lm_tokens(model, again.prompt_tokens, 12)
    assert engine.scheduler.counts() == (0, 0)


def test_a_request_may_turn_it_off(model, start):
    engine, pipeline = start(SpecConfig("ngram", 4))
    req = engine.submit(request(model, TEXTS[0], 8, num_draft_tokens=0))
    ids, whole = read(req)
    assert ids == mlx_lm_tokens(model, req.prompt_tokens, 8)
    assert whole.usage["draft_tokens"] == 0 and not verify_steps(pipeline)


def test_a_model_whose_caches_cannot_be_cut_back_decodes_without_it(tmp_path):
    """A sliding-window model past its window cannot drop rejected positions: it is
    served without speculation, and says why."""
    path = make_tiny_model(tmp_path, "gemma3_text", num_layers=2, sliding_window=8)
    with engines(path) as start:
        engine, pipeline = start(speculation=SpecConfig("ngram", 4))
        assert "cannot be cut back" in engine.scheduler.speculator.blocked
        req = engine.submit(request(path, TEXTS[0], 8))
        assert read(req)[0] == mlx_lm_tokens(path, req.prompt_tokens, 8)
        assert not verify_steps(pipeline)


def test_a_draft_model_that_does_not_fit_beside_rank_0s_shard_is_refused(
    model, other_draft, start, monkeypatch
):
    """Rank 0 holds the draft whole beside its shard: its weights and the caches of
    `--draft-max-streams` sequences must fit in what rank 0 has left, or the load is
    refused with the numbers, before any of the draft is read."""
    layers = sharding.count_layers(json.loads((model / "config.json").read_text()))
    target = memory.shard_nbytes(model, 0, layers, ends=True)
    # (room for the target's weights, not for the draft beside them)
    limit = int(mx.get_active_memory()) + target + 1024
    monkeypatch.setenv(memory.MEMORY_LIMIT_ENV, str(limit))
    with pytest.raises(memory.ShardTooBig, match=r"the draft model \S+ needs .* rank 0 has"):
        start(SpecConfig("model", 3, str(other_draft)))
    monkeypatch.delenv(memory.MEMORY_LIMIT_ENV)
    memory.check_draft_fits(other_draft, 2, 2048)  # (no limit: it fits)


def test_never_pays_where_every_position_costs_a_step():
    """The load-time rule: drafting is off where even 95% of proposals kept would not
    beat plain decoding at the measured step costs, and says so; it stays on where a
    wider step costs less than its positions (a GPU, a small model's fixed costs)."""
    from mlx_relay.coordinator.speculation import never_pays

    linear = {1: 0.180, 5: 0.858, 8: 1.334, 16: 2.651}  # (this CPU, the default model)
    why = never_pays(linear, 4)
    assert "measured at load" in why and "single steps here" in why
    cuda = {1: 0.0074, 5: 0.0290, 8: 0.0185, 16: 0.0195}  # (an H100, the 8B shape)
    assert never_pays(cuda, 4) == ""
    fixed_costs = {1: 0.010, 5: 0.012}  # (a tiny model: the step's own costs dominate)
    assert never_pays(fixed_costs, 4) == ""
    assert never_pays({}, 4) == "" and never_pays({5: 1.0}, 4) == ""


def test_drafting_turns_itself_off_at_load_where_verify_steps_cost_their_width(
    model, start, monkeypatch
):
    """Verify-like steps of 1 and K + 1 positions are timed at load (on the CPU no wider
    ones: nothing is cheaper there); where each position costs about a step, as on a
    compute-bound device (here: every position of an all-positions step made to take
    300 ms more), drafting is off for the load, the status's reason says why, and
    requests decode plainly, their tokens mlx-lm's. (At 100 ms a position, a step's own
    cost past 14 ms made a round pay at 95% kept: a busy core did that; 300 ms allows 41.)"""
    launch = FakePipeline.launch_forward

    def compute_bound(self, slots, offsets, tokens, lengths, **kw):
        if kw.get("all_positions"):
            time.sleep(0.3 * lengths[0])
        return launch(self, slots, offsets, tokens, lengths, **kw)

    monkeypatch.setattr(FakePipeline, "launch_forward", compute_bound)
    engine, pipeline = start(SpecConfig("ngram", 4))
    timed = {h.lengths[0] for h in pipeline.at_load if h.flags & hdr.FLAG_ALL_POSITIONS}
    assert timed == {1, 5}
    assert "measured at load" in engine.scheduler.speculator.blocked
    req = engine.submit(request(model, TEXTS[0], 8))
    ids, whole = read(req)
    assert ids == mlx_lm_tokens(model, req.prompt_tokens, 8)
    assert whole.usage["draft_tokens"] == 0 and not verify_steps(pipeline)


def test_drafting_stays_on_where_a_round_pays(model, start):
    """The tiny model on the CPU: a step's own costs dominate, so a round of K + 1
    positions costs far less than K + 1 steps; drafting stays on, its round costs
    already measured."""
    engine, pipeline = start(SpecConfig("ngram", 4))
    speculator = engine.scheduler.speculator
    assert speculator.blocked == "" and set(speculator.round_cost.seconds) == {1, 5}
