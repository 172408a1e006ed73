"""How many tokens a request may generate: one `max_tokens` policy for every door.

`max_tokens` (OpenAI's `max_tokens`/`max_completion_tokens`, Anthropic's `max_tokens`,
the Responses API's `max_output_tokens`, Ollama's `num_predict`, LocalAI's `Tokens`, the
gRPC `SamplingParams.max_tokens`) is a ceiling, never a demand: a request asking for more
than the prompt leaves of a limit is served, and its answer ends there with finish
reason `length` (Anthropic: `max_tokens`, Ollama: done_reason `length`), as Ollama,
llama.cpp (LocalAI) and mlx-lm's server end it at the context. Only a prompt that leaves
no room for one token is refused. The limits, each on prompt + output: the model's
context, `--max-context` (what every rank checked its memory for) and a door's own cap
(LocalAI's `ContextSize`). An unset `max_tokens` is `--default-max-tokens`, cut the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_relay.coordinator.requests import InvalidRequest


@dataclass(frozen=True)
class Limit:
    """At most `tokens` tokens, prompt and output together (0: no limit), set by `what`
    (how the refusal names it)."""

    tokens: int
    what: str


def cap(max_tokens: int, prompt: int, limits: list[Limit]) -> int:
    """`max_tokens` (the request's, or the default) cut to the room the tightest limit
    leaves a prompt of `prompt` tokens; InvalidRequest where a limit leaves none."""
    for limit in limits:
        if limit.tokens and prompt >= limit.tokens:
            raise InvalidRequest(f"the prompt is {prompt} tokens; {limit.what} is {limit.tokens}")
    return min([max_tokens, *(limit.tokens - prompt for limit in limits if limit.tokens)])
