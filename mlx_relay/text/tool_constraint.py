"""Tool calls the model opens by itself (tool_choice auto), held to their grammar.

Under `auto` the model may answer in text or call a tool. `ToolCallWatch` is a
`Constraint` that stays idle (no mask: the row is sampled exactly as without it) while
the model writes text; once the text it has written contains the start marker of its
tool-call format (``<tool_call>``, ``[TOOL_CALLS]``, ...), the rest of the call is held
to the same grammar as a forced call (`tool_grammars.call_grammar`: an allowed tool,
arguments valid against its schema). When the call's end marker has been written, it is
idle again: text, another call or the end of the output, as the format allows. A format
without an end marker (Mistral's) holds the rest of the output.

The marker is looked for in the bytes of the tokens sampled, as the output parser looks
for it in the text, so a marker spelled over several tokens (the fallback prompt's
``<tool_call>`` on most vocabularies) counts as well as a special token. Text inside a
think block is free: the parser reads no calls there either. As llama.cpp's lazy
grammars do, the token that completes the marker may carry text after it; that text is
fed to the grammar. So that it is always text a call can begin with, while the text ends
in part of a marker spelled over several tokens (`<tool`), the tokens that would complete
it with anything else (`_call>Paris`) are masked out (`marker_guards`); every other token
stays allowed. Were such text to come anyway (a marker inside one token), the call could
not be held: it is logged and left to the output parser, which flags it malformed.
"""

from __future__ import annotations

import logging
from typing import Protocol

import llguidance
import numpy as np

from mlx_relay.errors import InvalidRequest
from mlx_relay.text.constraints import Compiler, Constraint
from mlx_relay.text.markup import ChatMarkup
from mlx_relay.text.tool_calls import hermes
from mlx_relay.text.tool_grammars import any_strict, call_grammar

log = logging.getLogger("mlx_relay.constraints")


class ToolPrompt(Protocol):
    """What the tool constraint reads of a rendered prompt (coordinator.requests.Prompt)."""

    tools: list[dict] | None
    tool_choice: str  # "auto", "none", "required" or a tool's name
    opens_tool_call: str  # the tool-call marker the prompt ends with, if forced
    tool_fallback: bool  # the tools went into the system prompt (tool_prompt.py)


class ToolCallWatch(Constraint):
    """One request's watch for tool calls; engine thread only (built on the request's).

    `grammar`: a compiled matcher of `call_grammar(..., closes=True)`, copied for each call.
    `closes`: the grammar ends with the format's end marker and then anything (the watch
    goes idle after the marker); else it is complete when the output is.
    """

    def __init__(
        self,
        grammar: llguidance.LLMatcher,
        tokenizer: llguidance.LLTokenizer,
        start: str,
        *,
        closes: bool,
        think: tuple[str, str] = ("", ""),
        in_reasoning: bool = False,
        request_id: str = "",
        guards: dict[int, bytes] | None = None,
    ) -> None:
        """`guards`: `marker_guards` of this grammar and marker (None: no guard)."""
        self._grammar = grammar
        self._guards = guards or {}
        self._tokenizer = tokenizer
        self._closes = closes
        self._start = start.encode()
        self._think_start, self._think_end = (m.encode() for m in think)
        self._thinking = in_reasoning
        self._seen = b""  # the text's tail that may still become a marker
        self._keep = max(len(self._start), len(self._think_start), len(self._think_end)) - 1
        self.request_id = request_id
        self.calls = 0  # calls opened so far (held or not)
        self.matcher = None  # the open call's, while one is open
        self.gate = None
        self._bitmask = None

    def advance(self, token: int) -> bool:
        """Move over the token sampled; True once the output must end (an end-less
        format's calls are complete). A token the call's mask refused raises
        RuntimeError, as `Constraint.advance` does."""
        matcher = self.matcher
        if matcher is None:
            self._watch(bytes(self._tokenizer.decode_bytes([token])))
            return False
        if not matcher.consume_token(token) or matcher.is_error():
            raise RuntimeError(f"the grammar rejected token {token}: {matcher.get_error()}")
        if matcher.is_stopped():
            self._idle(b"")
            return True
        if self._closes and matcher.is_accepting():  # the end marker is written
            self._idle(_tail(bytes(self._tokenizer.decode_bytes([token])), self._keep))
        else:
            self._bitmask = matcher.compute_bitmask()
        return False

    def _watch(self, piece: bytes) -> None:
        """Look for the markers in the text so far; open a call at a start marker."""
        text = self._seen + piece
        while True:
            if self._thinking:
                at = text.find(self._think_end) if self._think_end else -1
                if at < 0:
                    break
                text, self._thinking = text[at + len(self._think_end) :], False
                continue
            hits = [(text.find(m), m) for m in (self._start, self._think_start) if m]
            hits = [(at, m) for at, m in hits if at >= 0]
            if not hits:
                break
            at, marker = min(hits)
            text = text[at + len(marker) :]
            if marker == self._start:
                self._open(text)
                return
            self._thinking = True
        self._idle(_tail(text, self._keep))

    def _open(self, rest: bytes) -> None:
        """A call starts; `rest` is what its first token wrote after the marker."""
        self.calls += 1
        matcher = self._grammar.deep_copy()
        if rest:
            tokens = self._tokenizer.tokenize_bytes(rest)
            if not matcher.consume_tokens(tokens) or matcher.is_error():
                log.warning(
                    "request %s: tool call %d opened with %r, which no call can follow; "
                    "left unconstrained",
                    self.request_id,
                    self.calls,
                    rest.decode(errors="replace"),
                )
                self._idle(b"")
                return
        self.matcher = matcher
        self._bitmask = matcher.compute_bitmask()

    def _idle(self, seen: bytes) -> None:
        self.matcher, self._seen = None, seen
        self._bitmask = self._guard()

    def _guard(self) -> bytes | None:
        """The mask while the text ends in part of the start marker (None: no mask)."""
        if self._thinking:
            return None
        parts = [g for k, g in self._guards.items() if self._seen.endswith(self._start[:k])]
        if len(parts) < 2:
            return parts[0] if parts else None
        words = [np.frombuffer(g, dtype=np.uint32) for g in parts]
        return np.bitwise_and.reduce(words).tobytes()


def marker_guards(compiler: Compiler, grammar: str, start: str) -> dict[int, bytes]:
    """Per length k of a proper prefix of `start`: the tokens allowed after text ending
    in that prefix, as an llguidance bitmask, where some token would complete the marker
    with text no call in `grammar` (compiled) begins with. Computed once per tokenizer,
    grammar and marker."""

    def make() -> dict[int, bytes]:
        template = compiler.matcher(grammar, "tools")
        ll = compiler.ll_tokenizer
        guards = {}
        for k, candidates in _completions(compiler, start).items():
            bad = []
            for token, rest in candidates:
                matcher = template.deep_copy()
                if not matcher.consume_tokens(ll.tokenize_bytes(rest)) or matcher.is_error():
                    bad.append(token)
            if bad:
                words = np.full((ll.vocab_size + 31) // 32, 0xFFFFFFFF, dtype=np.uint32)
                for token in bad:
                    words[token // 32] &= ~np.uint32(1 << (token % 32))
                guards[k] = words.tobytes()
        return guards

    return compiler.memo(("marker_guards", grammar, start), make)


def _completions(compiler: Compiler, start: str) -> dict[int, list[tuple[int, bytes]]]:
    """Per length k of a proper prefix of `start`: the (token, text after the marker) of
    every ordinary token that completes the marker after that prefix with text after it."""

    def make() -> dict[int, list[tuple[int, bytes]]]:
        ll = compiler.ll_tokenizer
        marker = start.encode()
        firsts = set(marker[1:])  # what a completing token can begin with
        out: dict[int, list[tuple[int, bytes]]] = {}
        for token in range(ll.vocab_size):
            piece = bytes(ll.decode_bytes([token]))
            if not piece or piece[0] not in firsts or ll.is_special_token(token):
                continue
            for k in range(1, len(marker)):
                rest = marker[k:]
                if len(piece) > len(rest) and piece.startswith(rest):
                    out.setdefault(k, []).append((token, piece[len(rest) :]))
        return out

    return compiler.memo(("marker_completions", start), make)


def _tail(text: bytes, n: int) -> bytes:
    return text[max(0, len(text) - n) :] if n else b""


def tool_constraint(
    compiler: Compiler,
    markup: ChatMarkup,
    prompt: ToolPrompt,
    *,
    in_reasoning: bool = False,
    request_id: str = "",
) -> Constraint | None:
    """The constraint a request's tools call for: a forced call's grammar from the first
    token (the prompt opened the call, after closing any think block), a watch under
    `auto`, or None (no tools, tool_choice none, or a format no grammar is known for).

    A tool schema that cannot be enforced refuses a forced call or a strict tool
    (InvalidRequest); under `auto` with no strict tool it leaves calls unconstrained, so
    a request accepted before is not refused now.
    """
    if not prompt.tools:
        return None
    if prompt.tool_fallback:
        syntax, start, end = "hermes", hermes.tool_call_start, hermes.tool_call_end
    else:
        syntax, start = markup.tool_syntax, markup.tool_call_start
        end = next((f.end for f in markup.tool_formats if f.start == start), "")
    if syntax is None or start is None:
        return None
    if prompt.opens_tool_call:
        grammar = call_grammar(syntax, prompt.tools, closes=False, spell=compiler.spell)
        return compiler.constraint(grammar, "tools")
    if prompt.tool_choice != "auto":
        return None
    try:
        grammar = call_grammar(syntax, prompt.tools, closes=True, end=end, spell=compiler.spell)
        matcher = compiler.matcher(grammar, "tools")
    except InvalidRequest as e:
        if any_strict(prompt.tools):
            raise
        log.info("request %s: tool calls left unconstrained: %s", request_id, e)
        return None
    return ToolCallWatch(
        matcher,
        compiler.ll_tokenizer,
        start,
        closes=bool(end),
        think=(markup.think_start, markup.think_end),
        in_reasoning=in_reasoning,
        request_id=request_id,
        guards=marker_guards(compiler, grammar, start),
    )
