"""The output processor (coordinator/output.py) without rank processes: tokens read back
become chunks, and the finish reason, usage and held-back text come out as the engine
streams them."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402

from mlx_relay.coordinator.output import Chunk, OutputProcessor  # noqa: E402
from mlx_relay.coordinator.sampling import Sampler, SamplingParams  # noqa: E402
from mlx_relay.coordinator.sequence import Request, Sequence  # noqa: E402
from mlx_relay.text.markup import ChatMarkup  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(make_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen3", num_layers=1))


def sequence(tokenizer, prompt: list[int], **params) -> Sequence:
    request = Request(prompt_tokens=prompt, params=SamplingParams(**params))
    return Sequence(
        request=request,
        slot=0,
        sampler=Sampler(request.params),
        text=OutputProcessor(tokenizer, 0).stream(request, ChatMarkup.of(tokenizer)),
        pending=[],
        context=list(prompt),
    )


def stream(output: OutputProcessor, seq: Sequence, tokens: list[int]) -> list[Chunk]:
    """Feed tokens as the engine does until one ends the sequence; the last chunk finished."""
    chunks = []
    for token in tokens:
        seq.context.append(token)
        chunk, reason = output.token(seq, token, None)
        chunks.append(chunk)
        if reason:
            output.finish(seq, chunk, reason)
            break
    return chunks


def test_length_ends_the_sequence_with_usage(tokenizer):
    output = OutputProcessor(tokenizer, context_length=0)
    tokens = tokenizer.encode("hello world, hello again")
    seq = sequence(tokenizer, [1, 2, 3], max_tokens=3)
    chunks = stream(output, seq, tokens)
    assert len(chunks) == 3 and chunks[-1].finish_reason == "length"
    assert [c.finish_reason for c in chunks[:-1]] == [None, None]
    assert "".join(c.text for c in chunks) == tokenizer.decode(tokens[:3])
    assert chunks[-1].usage["prompt_tokens"] == 3 and chunks[-1].usage["completion_tokens"] == 3
    assert chunks[-1].timings["total_s"] >= 0


def test_eos_ends_with_an_empty_chunk_not_counted(tokenizer):
    output = OutputProcessor(tokenizer, context_length=0)
    eos = next(iter(tokenizer.eos_token_ids))
    first = tokenizer.encode("hello")[0]
    seq = sequence(tokenizer, [1], max_tokens=10)
    chunks = stream(output, seq, [first, eos])
    assert chunks[-1].finish_reason == "stop" and chunks[-1].token_ids == []
    assert chunks[-1].usage["completion_tokens"] == 1


def test_stop_string_is_cut_and_held_back_text_comes_out(tokenizer):
    output = OutputProcessor(tokenizer, context_length=0)
    tokens = tokenizer.encode("hello world again and again")
    seq = sequence(tokenizer, [1], max_tokens=50, stop=["again"])
    chunks = stream(output, seq, tokens)
    assert chunks[-1].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == "hello world "


def test_context_length_ends_the_sequence(tokenizer):
    output = OutputProcessor(tokenizer, context_length=4)
    tokens = tokenizer.encode("hello world again and again")
    seq = sequence(tokenizer, [1, 2], max_tokens=50)
    chunks = stream(output, seq, tokens)
    assert len(chunks) == 2 and chunks[-1].finish_reason == "length"


def test_logprobs_name_the_token_and_its_rivals(tokenizer):
    output = OutputProcessor(tokenizer, context_length=0)
    seq = sequence(tokenizer, [1], max_tokens=5, logprobs=True, top_logprobs=2)
    logprobs = mx.log(mx.softmax(mx.arange(tokenizer.vocab_size, dtype=mx.float32)))
    token = tokenizer.encode("hello")[0]
    chunk, reason = output.token(seq, token, logprobs)
    assert reason == "" and chunk.logprobs[0].token_id == token
    top = chunk.logprobs[0].top
    assert [t[0] for t in top] == [tokenizer.vocab_size - 1, tokenizer.vocab_size - 2]
