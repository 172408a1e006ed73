"""The one request every door builds: typed, checked in one place, the engine's only input.

Each door converts its own wire format (the gRPC `GenerateRequest`, OpenAI's, Anthropic's
and Ollama's JSON, LocalAI's `PredictOptions`) into a `GenerationRequest` with an adapter
of its own, and nothing else: no door checks a range or parses a tool. The checks are
here (`check_sampling`) and in `requests.render_prompt` (messages, tools, tool_choice),
and every refusal is one error type, `InvalidRequest`, naming the field; each door maps
it to its own error shape (INVALID_ARGUMENT, an HTTP 400 in the API's own body).

Sampling options are the engine's own `SamplingParams` (one definition of each option:
its type, its default and its range, `sampling.RANGES`), so a new option is a field
there, its use in the sampler, and its spelling on the doors that expose it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from mlx_relay.coordinator.sampling import RANGES, SamplingParams
from mlx_relay.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
INT32 = 2**31  # the integer options are 32-bit on the gRPC wire; every door holds to that
SEED_LIMIT = 2**63  # MLX random keys are unsigned; the wire's seed is an int64


@dataclass(frozen=True)
class ToolCall:
    """A call an earlier assistant turn made."""

    name: str
    arguments: str = ""  # the arguments object as JSON text ('' : none)
    id: str = ""
    type: str = "function"


@dataclass(frozen=True)
class Message:
    """One chat message. `images` are image files shown with it, `image_offsets` where
    each stands in `content` (code points; empty: every image before the text)."""

    role: str  # system, developer, user, assistant, tool (checked by render_prompt)
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""
    reasoning: str = ""
    images: tuple[bytes, ...] = ()
    image_offsets: tuple[int, ...] = ()

    def __post_init__(self) -> None:  # the adapters may hand lists; the request keeps tuples
        for name in ("tool_calls", "images", "image_offsets"):
            object.__setattr__(self, name, tuple(getattr(self, name)))


@dataclass(frozen=True)
class Tool:
    """A function the model may call, as the client defined it: OpenAI's shape
    ({"type": "function", "function": {"name", "description", "parameters"}}) or the bare
    function. Chat templates, tool grammars and parsers read `definition` as given."""

    definition: Mapping[str, Any]

    @property
    def function(self) -> Mapping[str, Any]:
        inner = self.definition.get("function")
        return inner if isinstance(inner, Mapping) else self.definition

    @property
    def name(self) -> str:
        """The function's name ('' when it has none: render_prompt refuses that)."""
        name = self.function.get("name")
        return name if isinstance(name, str) else ""


def tools(values: Any) -> tuple[Tool, ...]:
    """A request's tool definitions (a list of objects) as `Tool`s; InvalidRequest for
    one that is not an object (one without a name is refused by render_prompt)."""
    out = []
    for i, value in enumerate(values or ()):
        if not isinstance(value, Mapping):
            raise InvalidRequest(f"tools[{i}] has no function name")
        out.append(Tool(value))
    return tuple(out)


@dataclass(frozen=True)
class GenerationRequest:
    """What a client asks the engine for, whichever door it came through.

    Exactly one of `prompt` (raw text, or bytes checked as UTF-8) and `messages`.
    `max_tokens` is the client's ceiling (None: the server's default; api/budget.py cuts
    it to the room left); the other sampling options are `sampling`'s, at their defaults
    where the client left them. `tool_choice`: 'auto' (''), 'none', 'required', a tool's
    name, or OpenAI's object naming one. `response_format` is OpenAI's object
    ({"type": "json_object"}, {"type": "json_schema", "json_schema": {...}}); `grammar`
    a GBNF grammar; at most one of them.
    """

    prompt: str | bytes = ""
    messages: tuple[Message, ...] = ()
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tools: tuple[Tool, ...] = ()
    tool_choice: str | Mapping[str, Any] = ""
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    response_format: Mapping[str, Any] | None = None
    grammar: str = ""
    request_id: str = ""
    cache_salt: str = ""  # prompts with other salts share no cached prefix with it

    def with_seed(self, seed: int) -> GenerationRequest:
        """The same request sampled with another seed (OpenAI's `n` copies)."""
        return replace(self, sampling=replace(self.sampling, seed=seed))


def sampling(**options: Any) -> SamplingParams:
    """`SamplingParams` from the options a client set (None: left at the default), by
    the engine's names; a name it does not have is the door's bug, not the client's.
    Numbers are 32-bit floats on every door, as the gRPC wire carries them, so the same
    ask samples the same tokens whichever door it came through."""
    out = {}
    for name, value in options.items():
        if value is None:
            continue
        if isinstance(value, float):
            value = float32(value)
        elif name == "logit_bias":
            value = {token: float32(float(bias)) for token, bias in value.items()}
        out[name] = value
    return SamplingParams(**out)


def float32(value: float) -> float:
    """`value` rounded to a 32-bit float (beyond its range: infinite, refused later)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def check_sampling(
    request: GenerationRequest, *, vocab_size: int, default_max_tokens: int
) -> SamplingParams:
    """The request's sampling options, checked, with its `max_tokens` (or the default)
    in; InvalidRequest naming the first field out of range."""
    p = request.sampling
    if request.max_tokens is not None and request.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {request.max_tokens}")
    if request.max_tokens is not None and request.max_tokens >= INT32:
        raise InvalidRequest(f"max_tokens must be a 32-bit integer, got {request.max_tokens}")
    for f in fields(p):
        value = getattr(p, f.name)
        if isinstance(value, float):
            _finite(value, f.name)
        elif isinstance(value, int) and not isinstance(value, bool) and f.name != "seed":
            if not -INT32 <= value < INT32:
                raise InvalidRequest(f"{f.name} must be a 32-bit integer, got {value}")
    for name, (low, high) in RANGES.items():
        value = getattr(p, name)
        if value is not None and not low <= value <= high:
            bound = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
            raise InvalidRequest(f"{name} must be {bound}, got {value}")
    if not 0 <= p.top_k < vocab_size:
        raise InvalidRequest(f"top_k must be in [0, {vocab_size}), got {p.top_k}")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop has {len(p.stop)} strings, at most {MAX_STOP_STRINGS}")
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}"
        )
    for token_id, bias in p.logit_bias.items():
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(
                f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab_size - 1})"
            )
        _finite(bias, f"logit_bias[{token_id}]")
    if p.repetition_context_size < 0:
        raise InvalidRequest("repetition_context_size must be >= 0")
    if p.num_draft_tokens is not None and p.num_draft_tokens < 0:
        raise InvalidRequest(f"num_draft_tokens must be >= 0, got {p.num_draft_tokens}")
    if p.seed is not None and p.seed < 0:
        raise InvalidRequest(f"seed must be >= 0 (MLX random keys are unsigned), got {p.seed}")
    if p.seed is not None and p.seed >= SEED_LIMIT:
        raise InvalidRequest(f"seed must be below 2**63, got {p.seed}")
    return replace(
        p,
        max_tokens=default_max_tokens if request.max_tokens is None else request.max_tokens,
        logprobs=p.logprobs or p.top_logprobs > 0,
        stop=list(p.stop),
        logit_bias=dict(p.logit_bias),
    )


def _finite(value: float, name: str) -> float:
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value}")
    return value
