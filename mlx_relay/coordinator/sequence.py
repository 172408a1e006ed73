"""The request model: what a client asked for, what it reads back, and the engine's state
of it while it runs.

A `Request` is made by a front door and submitted; the scheduler turns it into a
`Sequence` when it takes a slot; each token read back becomes a `Chunk` on the request's
queue. These types live apart from the engine and the output rules so that both can use
them without importing each other.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_relay.coordinator.sampling import Sampler, SamplingParams
from mlx_relay.coordinator.slots import Taken
from mlx_relay.coordinator.speculation import SpecState
from mlx_relay.model import vision
from mlx_relay.model.step_inputs import PromptInputs
from mlx_relay.text.matchers import GrammarMatcher, StopMatcher
from mlx_relay.text.postprocess import ToolCall


class EngineError(Exception):
    """A request cannot be served; `kind` maps to a gRPC status in the servicer."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "invalid", "unavailable", "exhausted", "internal", "cancelled"


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass
class Chunk:
    """A piece of one request's output stream; the last one has a finish_reason."""

    text: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    timings: dict[str, float] | None = None
    malformed_tool_call: bool = False
    unknown_tools: list[str] = field(default_factory=list)
    stop_sequence: str = ""  # the stop string that ended it (finish_reason "stop")

    def add(self, later: Chunk) -> None:
        """Fold the stream's next chunk into this one: a stream folded from an empty
        Chunk is the whole answer (every door's non-streaming response)."""
        self.text += later.text
        self.reasoning += later.reasoning
        self.token_ids += later.token_ids
        self.tool_calls += later.tool_calls
        self.logprobs += later.logprobs
        if later.finish_reason is not None:
            self.finish_reason = later.finish_reason
            self.usage, self.timings = later.usage, later.timings
            self.malformed_tool_call = later.malformed_tool_call
            self.unknown_tools = list(later.unknown_tools)
            self.stop_sequence = later.stop_sequence


@dataclass
class Request:
    prompt_tokens: list[int]
    params: SamplingParams
    request_id: str = ""
    tools: list[dict] | None = None
    parse_tools: bool = True
    starts_in_reasoning: bool = False
    opens_tool_call: str = ""  # tool_choice forced a call: the prompt ends in its marker
    constraint: GrammarMatcher | None = None  # a grammar the output must follow
    # A vision-language request's preprocessed images (prompt_tokens then hold one image
    # token per image feature): rank 0 merges them into the prompt's embeddings.
    pixel_values: Any = None
    created: float = field(default_factory=time.perf_counter)
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Tenants whose prompts must not share cached prefixes give different salts (vLLM's
    # `cache_salt`): parked caches are matched only within one salt (slots.py), and the
    # prompt store's block keys start from it (prefix_index.py).
    cache_salt: str = ""
    # An image prompt's tokens as the prompt cache compares them (image_keys.py).
    image_keyed: list[int] | None = None
    # The scheduler's cancellation queue, once submitted: it reads them once a step.
    cancels: queue.SimpleQueue | None = field(default=None, repr=False, compare=False)

    def cache_tokens(self) -> list[int]:
        """The prompt as the prompt cache compares it: its ids, an image prompt's
        placeholders keyed by its images (image_keys.py)."""
        return self.image_keyed if self.image_keyed is not None else self.prompt_tokens

    def cancel(self) -> None:
        """From any thread; a no-op once finished (the scheduler no longer runs it)."""
        self.cancelled.set()
        if self.cancels is not None:
            self.cancels.put(self)

    def chunks(self) -> Iterator[Chunk]:
        """Blocking iterator over the stream; raises EngineError if the request failed."""
        while True:
            item = self.out.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finish_reason is not None:
                return


@dataclass(eq=False)
class Sequence:
    """Engine-thread state of one active request (compared by identity: a sequence is
    looked up in lists of the running ones)."""

    request: Request
    slot: int
    sampler: Sampler
    text: StopMatcher  # token ids to text, stop strings cut (text/stream.py)
    pending: list[int]  # prompt tokens still to prefill
    position: int = 0  # tokens fed to the KV caches (sent round the ring)
    context: list[int] = field(default_factory=list)  # prompt + sampled tokens read so far
    generated: list[int] = field(default_factory=list)
    # The token sampled last, still on the device: the next decode step's input.
    next_input: mx.array | None = None
    cached_tokens: int = 0  # prompt tokens found in a parked cache; the first step reuses it
    taken: Taken | None = None  # how the slot was taken, until the first step launches
    restoring: bool = False  # its slot's stored blocks are being loaded: no step yet
    restored: bool = False  # its cached tokens came from stored blocks (disk), not a slot
    reasoning_tokens: int = 0
    group: int | None = None
    first_token_at: float | None = None
    # An image request's merged prompt embeddings, from its first prefill chunk on.
    embeddings: PromptInputs | None = None
    # Speculative decoding (speculation.py): set while it decodes by verify steps.
    spec: SpecState | None = None
    draft_tokens: int = 0  # proposals its verify steps carried
    accepted_draft_tokens: int = 0  # of them kept
    finished: bool = False  # it ended: what its steps still in flight return is ignored

    @property
    def prefilling(self) -> bool:
        """Prompt tokens left to send: known in advance, so several chunks may be in flight."""
        return self.first_token_at is None and bool(self.pending)

    def cache_context(self) -> list[int]:
        """What its caches hold, as the prompt cache compares it (`Request.cache_tokens`
        for the prompt's part): the tokens a park records."""
        prompt = self.request.cache_tokens()
        if self.position <= len(prompt):
            return prompt[: self.position]
        return prompt + self.context[len(prompt) : self.position]

    @property
    def has_images(self) -> bool:
        return self.request.pixel_values is not None

    @property
    def constraint(self) -> GrammarMatcher | None:
        return self.request.constraint

    def image_inputs(self, model: Any, position: int, n: int) -> PromptInputs | None:
        """For an image request, its prompt's merged embeddings (and multimodal rope
        positions) for the `n` prompt positions from `position` (`model`'s vision tower
        and projector run once, at the first chunk); else None."""
        if self.request.pixel_values is None:
            return None
        if self.embeddings is None:
            prompt = self.request.prompt_tokens
            self.embeddings = vision.prompt_inputs(model, prompt, self.request.pixel_values)
        out = self.embeddings.chunk(position, n)
        if position + n >= len(self.request.prompt_tokens):
            self.embeddings = None  # the prompt is all sent; decode embeds tokens
        return out
