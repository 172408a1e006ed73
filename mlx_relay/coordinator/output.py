"""What a client sees of a sequence: each token read back turned into a chunk of text,
reasoning, tool calls and logprobs, and the last chunk's finish reason, usage and timings.

The engine decides what runs, samples, and reads tokens back; it hands every token to
the `OutputProcessor` of the loaded model and only acts on the answer (stream the chunk,
or end the sequence), so output rules change here without touching the engine's loop.
The text itself is the text layer's: each sequence's `TextStream` (text/stream.py)
turns its token ids into text, reasoning and tool calls and finds its stop strings.
`Chunk` and `TokenLogprob` are the request model's (sequence.py); the doors import
them from here.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from mlx_relay.coordinator.sequence import Chunk, Request, Sequence, TokenLogprob
from mlx_relay.text.markup import ChatMarkup
from mlx_relay.text.postprocess import Delta, OutputParser
from mlx_relay.text.stream import TextStream


class OutputProcessor:
    """The output rules for one loaded model (its tokenizer and context length)."""

    def __init__(self, tokenizer: Any, context_length: int) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.special_ids: set[int] = set(tokenizer.all_special_ids or [])

    def stream(self, request: Request, markup: ChatMarkup | None) -> TextStream:
        """A new sequence's text stream: its detokenizer, and its parser set up by what
        the request asked for (tools, stop strings, a prompt that opened a think block
        or a tool call)."""
        parser = OutputParser(
            markup,
            tools=request.tools,
            parse_tools=request.parse_tools,
            starts_in_reasoning=request.starts_in_reasoning,
            opens_tool_call=request.opens_tool_call,
            stop=request.params.stop,
        )
        return TextStream(self.tokenizer.detokenizer, parser, self.special_ids)

    def token(self, seq: Sequence, token: int, logprobs: mx.array | None) -> tuple[Chunk, str]:
        """The chunk for one token read back, and why it ends the sequence ('' if not).

        EOS ends it with an empty chunk and is not counted as generated.
        """
        params = seq.request.params
        if token in self.tokenizer.eos_token_ids and not params.ignore_eos:
            return Chunk(), "stop"
        seq.generated.append(token)
        chunk = Chunk(token_ids=[token])
        if params.logprobs and logprobs is not None:
            chunk.logprobs.append(self._logprob_entry(token, logprobs, params.top_logprobs))
        was_reasoning = seq.text.in_reasoning
        _add(chunk, seq.text.add(token))
        if was_reasoning or seq.text.in_reasoning:
            seq.reasoning_tokens += 1
        if seq.text.stopped:
            return chunk, "stop"
        if len(seq.generated) >= params.max_tokens:
            return chunk, "length"
        if self.context_length and len(seq.context) >= self.context_length:
            return chunk, "length"
        return chunk, ""

    def finish(self, seq: Sequence, last: Chunk, reason: str | None) -> None:
        """Make `last` the sequence's last chunk: the text held back (a possible stop
        string's start, an open tool call), the finish reason, usage and timings."""
        final = seq.text.finish(flush=reason in ("stop", "length"), cut=reason == "length")
        _add(last, final)
        last.malformed_tool_call = final.malformed_tool_call
        last.unknown_tools = list(final.unknown_tools)
        if reason == "stop" and seq.text.saw_tool_calls:
            reason = "tool_calls"
        last.finish_reason = reason
        last.stop_sequence = seq.text.stop_string
        request = seq.request
        last.usage = {
            "prompt_tokens": len(request.prompt_tokens),
            "completion_tokens": len(seq.generated),
            "reasoning_tokens": seq.reasoning_tokens,
            "total_tokens": len(request.prompt_tokens) + len(seq.generated),
            "cached_tokens": seq.cached_tokens,
            "draft_tokens": seq.draft_tokens,
            "accepted_draft_tokens": seq.accepted_draft_tokens,
        }
        last.timings = timings(seq)

    def _logprob_entry(self, token: int, logprobs: mx.array, top: int) -> TokenLogprob:
        decode = self.tokenizer.decode
        entry = TokenLogprob(token, decode([token]), float(logprobs[token].item()))
        if top > 0:
            ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
            values = logprobs[ids]
            for i in mx.argsort(-values).tolist():
                tid = int(ids[i].item())
                entry.top.append((tid, decode([tid]), float(values[i].item())))
        return entry


def _add(chunk: Chunk, delta: Delta) -> None:
    chunk.text += delta.content
    chunk.reasoning += delta.reasoning
    chunk.tool_calls += delta.tool_calls


def timings(seq: Sequence) -> dict[str, float]:
    """Time to first token and the prompt and decode rates, as of now."""
    now = time.perf_counter()
    first = seq.first_token_at
    ttft = (first - seq.request.created) if first else 0.0
    decoded = len(seq.generated) - 1
    decode_s = now - first if first else 0.0
    return {
        "time_to_first_token_s": ttft,
        "prompt_tokens_per_s": len(seq.request.prompt_tokens) / ttft if ttft > 0 else 0.0,
        "decode_tokens_per_s": decoded / decode_s if decoded > 0 and decode_s > 0 else 0.0,
        "total_s": now - seq.request.created,
    }
