"""Constrained generation: which tokens a grammar allows next, with llguidance.

A request may carry OpenAI's `response_format` (`json_object`, `json_schema`) or a GBNF
grammar (llama.cpp's syntax, as LocalAI sends it); its tools make grammars of their own
(tool_grammars.py, tool_constraint.py); JSON Schema's part is json_schema.py. `Compiler`
turns any of them into an llguidance grammar once per text (compiling is the costly
part; a request gets a copy of a compiled matcher) and refuses what cannot be enforced
with `InvalidRequest`, before the request reaches the engine. `Constraint` is one
request's matcher, used only on the engine thread: `mask()` gives the next step's
allowed tokens as an MLX boolean row (None while unconstrained), `advance(token)` moves
the matcher over the token really sampled and says whether the grammar is complete.

The mask is computed on the host as soon as a token is read back, while the device runs
the next step, and applied with MLX ops (`mx.where`), so it works on every MLX backend.
EOS is in the mask only where the grammar may end; when nothing can follow, the request
ends ("stop") without waiting for the model to choose EOS.

Reasoning models: when the prompt opens a think block, the constraint waits for the
model's think-end token and applies to the answer after it; the thinking is free text.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np

from mlx_relay.errors import InvalidRequest, json_field
from mlx_relay.text.json_schema import check_schema, json_schema_grammar
from mlx_relay.text.markup import ChatMarkup

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
CACHED_GRAMMARS = 64


def request_grammar(response_format: Any, grammar: str) -> tuple[str, str] | None:
    """The llguidance grammar a request asks for and the field it came from, or None.
    `response_format`: OpenAI's object (or None)."""
    response_format = response_format_grammar(response_format)
    if grammar.strip() and response_format is not None:
        raise InvalidRequest("give either grammar or response_format, not both")
    if grammar.strip():
        return gbnf_grammar(grammar), "grammar"
    if response_format is not None:
        return response_format, "response_format"
    return None


def response_format_grammar(raw: Any) -> str | None:
    """The grammar of OpenAI's `response_format` (an object, or JSON text), None for
    plain text."""
    if isinstance(raw, str):
        raw = json_field(raw, "response_format", dict, "a JSON object with a 'type'")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequest("response_format must be a JSON object with a 'type'")
    value = raw
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise InvalidRequest(
            f"response_format.type {kind!r} is not one of {', '.join(RESPONSE_FORMATS)}"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"})
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest("response_format.json_schema must be an object with a 'schema'")
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest("response_format.json_schema.schema must be a JSON Schema object")
    check_schema(schema)
    return json_schema_grammar(schema)


def gbnf_grammar(text: str) -> str:
    """An llguidance grammar from a GBNF grammar (llama.cpp syntax; Lark also accepted)."""
    try:
        return llguidance.grammar_from("gbnf", text)
    except ValueError as e:
        raise InvalidRequest(f"grammar does not parse: {_short(e)}") from e


def _short(e: Exception) -> str:
    return str(e).removeprefix("Failed to convert the grammar from GBNF to Lark: ").strip()


class Compiler:
    """One tokenizer's grammars: the llguidance tokenizer (built once per loaded model),
    and compiled matchers by grammar text, copied for each request."""

    def __init__(self, tokenizer: Any, markup: ChatMarkup | None = None) -> None:
        """``markup``: the tokenizer's, resolved at load (None: resolved here)."""
        self.tokenizer = tokenizer
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
        try:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=eos)
        except Exception as e:  # noqa: BLE001 - e.g. a slow tokenizer
            raise InvalidRequest(
                f"structured output is not available for this model's tokenizer: {e}"
            ) from e
        self.think_end_id = (markup or ChatMarkup.of(tokenizer)).think_end_id
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._memo: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def constraint(self, grammar: str, field: str, *, in_reasoning: bool = False) -> Constraint:
        """A constraint of `grammar`, or InvalidRequest naming `field` and the reason."""
        gate = self.think_end_id if in_reasoning else None
        return Constraint(self.matcher(grammar, field), gate)

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """`make()`, once per `key` for this tokenizer (what a grammar or marker implies
        about the vocabulary, computed once rather than per request)."""
        with self._lock:
            if key in self._memo:
                return self._memo[key]
        value = make()
        with self._lock:
            value = self._memo.setdefault(key, value)
            while len(self._memo) > 2 * CACHED_GRAMMARS:
                self._memo.popitem(last=False)
            return value

    def spell(self, text: str) -> str:
        """`text` in a Lark grammar: a literal, or also the special token it is one of
        (a special token's bytes never match a literal, as `<tool_call>` on Qwen)."""
        literal = json.dumps(text, ensure_ascii=False)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.ll_tokenizer.is_special_token(ids[0]):
            return f"(<[{ids[0]}]> | {literal})"
        return literal

    def matcher(self, grammar: str, field: str) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar`, or InvalidRequest naming `field` and the reason."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
            if compiled.is_error():
                raise InvalidRequest(f"{field} cannot be enforced: {compiled.get_error()}")
            with self._lock:
                self._compiled[grammar] = compiled
                while len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        return compiled.deep_copy()


class Constraint:
    """One request's grammar state; engine thread only.

    `gate`: a token (the think end) before which nothing is constrained.
    """

    def __init__(self, matcher: llguidance.LLMatcher, gate: int | None = None) -> None:
        self.matcher = matcher
        self.gate = gate
        self._bitmask: bytes | None = None if gate is not None else matcher.compute_bitmask()

    @property
    def active(self) -> bool:
        return self._bitmask is not None

    def mask(self, vocab: int) -> mx.array | None:
        """The allowed tokens of the next step, (vocab,) bool, or None if unconstrained."""
        return None if self._bitmask is None else token_mask(self._bitmask, vocab)

    def advance(self, token: int) -> bool:
        """Move over the token sampled; True once the grammar is complete (nothing may follow).

        A token the mask did not allow (none can be sampled) raises RuntimeError.
        """
        if self._bitmask is None:
            if token == self.gate:
                self._bitmask = self.matcher.compute_bitmask()
            return False
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            raise RuntimeError(f"the grammar rejected token {token}: {self.matcher.get_error()}")
        if self.matcher.is_stopped():
            return True
        self._bitmask = self.matcher.compute_bitmask()
        return False


def token_mask(bitmask: bytes, vocab: int) -> mx.array:
    """llguidance's bitmask (bit i of 32-bit word i // 32 allows token i) as a (vocab,)
    bool array; ids the tokenizer does not have (padded vocabularies) are not allowed.

    Built on the calling thread (MLX streams are per thread): no module-level arrays."""
    words = mx.array(np.frombuffer(bitmask, dtype=np.uint32))
    bits = mx.arange(32, dtype=mx.uint32)
    allowed = (((words[:, None] >> bits) & 1) != 0).reshape(-1)
    n = allowed.shape[0]
    if n >= vocab:
        return allowed[:vocab]
    return mx.concatenate([allowed, mx.zeros((vocab - n,), dtype=mx.bool_)])


def apply_mask(logits: mx.array, allowed: mx.array) -> mx.array:
    """Disallowed tokens get -inf, as a logits processor would."""
    return mx.where(allowed, logits, -mx.inf)
