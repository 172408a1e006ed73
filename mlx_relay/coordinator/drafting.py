"""Proposals for speculative decoding, made on rank 0: the tokens a verify step checks.

Two sources (speculation.py says how rounds use them):

- `NgramDrafter`, prompt lookup: the text so far often repeats itself (an edit, a
  summary quoting its source, code, a RAG answer), so the tokens that followed the
  latest earlier occurrence of the last few tokens are proposed. Host work only.
- `ModelDrafter`, a small model sharing the target's tokenizer, held whole on rank 0
  with a cache per sequence, run exactly as mlx-lm's speculative generator runs its
  draft (the same prefill chunks, one sampled token per step with the request's own
  sampler and key, the same cut back after each round), so a cluster gives mlx-lm's
  tokens for the same draft model, K and seed.

A drafter's per-sequence state lives in the sequence's `SpecState.draft`; `rewind`
keeps it in step with what the target kept, `drop` lets it go.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer
from numpy.lib.stride_tricks import sliding_window_view

from mlx_relay.coordinator.sampling import Sampler
from mlx_relay.coordinator.speculation import SpecConfig, SpecState
from mlx_relay.model import attention, memory
from mlx_relay.model.default_model import resolve_model

log = logging.getLogger("mlx_relay.drafting")

MAX_NGRAM = 4  # the longest suffix looked up (longer matches predict better)
MIN_NGRAM = 2  # the shortest (a single token repeats too often to predict much)
PREFILL_STEP = 512  # a draft model's prompt chunks: mlx-lm's prefill_step_size


class Drafter:
    """Proposes tokens to follow a sequence's next input; the base proposes none."""

    name = "none"

    def propose(
        self, spec: SpecState, sampler: Sampler, history: list[int], last: mx.array, k: int
    ) -> mx.array:
        """Up to `k` tokens (int32, maybe not computed yet) to follow `last` (1,), the
        step's input, whose value is `history[-1]` (`history`: the sequence's every
        token so far, the prompt's included)."""
        return mx.array([], dtype=mx.int32)

    def rewind(self, spec: SpecState, proposed: list[int], accepted: int, last: int) -> None:
        """A round came back: of the `proposed` tokens after input `last`, the first
        `accepted` were kept."""

    def drop(self, spec: SpecState) -> None:
        """The sequence ended or stopped speculating."""
        spec.draft = None


def lookup(
    history: list[int], k: int, longest: int = MAX_NGRAM, shortest: int = MIN_NGRAM
) -> list[int]:
    """Prompt lookup: the `k` tokens that followed the latest earlier occurrence of the
    history's last n tokens, for the longest n from `longest` down to `shortest` that
    occurs; [] when none does."""
    if k <= 0 or len(history) < shortest + 1:
        return []
    tokens = np.asarray(history, dtype=np.int64)
    end = len(tokens)
    for n in range(min(longest, end - 1), shortest - 1, -1):
        # windows starting at 0..end-1-n: each has at least one token after it
        windows = sliding_window_view(tokens[: end - 1], n)
        hits = np.flatnonzero((windows == tokens[end - n :]).all(axis=1))
        if hits.size:
            # What followed the match, copied on past the history's end as the match
            # predicts (a loop of period p, matched p back, goes round again).
            out, start = list(history), int(hits[-1]) + n
            for i in range(k):
                out.append(out[start + i])
            return out[end:]
    return []


class NgramDrafter(Drafter):
    """Prompt lookup decoding (no draft model)."""

    name = "ngram"

    def propose(
        self, spec: SpecState, sampler: Sampler, history: list[int], last: mx.array, k: int
    ) -> mx.array:
        return mx.array(lookup(history, k), dtype=mx.int32)


@dataclass
class _DraftCache:
    cache: list[Any]
    # Tokens before the next input that the draft model has not seen yet: the last
    # proposal after a round that kept them all, the inputs of rounds with none.
    unseen: list[int] = field(default_factory=list)


class ModelDrafter(Drafter):
    """A draft model on rank 0 (`--draft-model`), run as mlx-lm's speculative generator
    runs it."""

    name = "model"

    def __init__(self, model: Any) -> None:
        self.model = model

    @classmethod
    def load(cls, spec: str, tokenizer: Any, streams: int = 1, context: int = 0) -> ModelDrafter:
        """Load the draft model whole; refuse one whose vocabulary differs from the
        target's (its token ids would mean other tokens), or that with the caches of
        `streams` sequences of `context` tokens does not fit beside rank 0's shard."""
        path = resolve_model(spec)
        draft_tokenizer = load_tokenizer(path)
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                f"draft model {spec!r} does not share the served model's tokenizer "
                "(its vocabulary differs)"
            )
        memory.check_draft_fits(path, streams, context)
        model, _ = load_model(path)
        log.info("draft model %s loaded on rank 0", path)
        return cls(model)

    def propose(
        self, spec: SpecState, sampler: Sampler, history: list[int], last: mx.array, k: int
    ) -> mx.array:
        if spec.draft is None:  # the first round: the prompt before its last token
            spec.draft = _DraftCache(make_prompt_cache(self.model))
            self._prefill(spec.draft.cache, history[:-1])
        state: _DraftCache = spec.draft
        if k <= 0:
            return mx.array([], dtype=mx.int32)
        y = last.astype(mx.uint32).reshape(-1)
        if state.unseen:
            y = mx.concatenate([mx.array(state.unseen, dtype=mx.uint32), y])
            state.unseen = []
        drafts = []
        # (its first step may carry 2 tokens: on CUDA see model/attention.py)
        with attention.unfused(attention.wanted()):
            for _ in range(k):
                y = self._step(state.cache, sampler, y)
                mx.async_eval(y)
                drafts.append(y)
        return mx.concatenate(drafts).astype(mx.int32)

    def _prefill(self, cache: list[Any], tokens: list[int]) -> None:
        """mlx-lm's draft prefill: the tokens in chunks of PREFILL_STEP, each computed."""
        for start in range(0, len(tokens), PREFILL_STEP):
            self.model(mx.array(tokens[start : start + PREFILL_STEP])[None], cache=cache)
            mx.eval([c.state for c in cache])

    def _step(self, cache: list[Any], sampler: Sampler, y: mx.array) -> mx.array:
        """One draft token (1,): the last position's logits, log-softmax, the request's
        sampler (its key advances, as mlx-lm's global key does for the draft)."""
        logits = self.model(y[None], cache=cache)[:, -1, :]
        return sampler.sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def rewind(self, spec: SpecState, proposed: list[int], accepted: int, last: int) -> None:
        state: _DraftCache | None = spec.draft
        if state is None:
            return
        if not proposed:  # it saw nothing this round: the input waits with the next
            state.unseen.append(last)
        elif accepted == len(proposed):  # it never saw its own last proposal
            state.unseen = [proposed[-1]]
        else:  # it saw the input and all proposals but the last: keep the accepted
            trim_prompt_cache(state.cache, len(proposed) - 1 - accepted)


def make_drafter(config: SpecConfig, tokenizer: Any, context: int = 0) -> Drafter:
    """The drafter the server's settings name, for the model just loaded (`context`:
    the most tokens one of its sequences may hold)."""
    if config.source == "model":
        return ModelDrafter.load(config.draft_model, tokenizer, config.max_streams, context)
    return NgramDrafter()
