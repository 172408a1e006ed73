"""Split a streamed generation into content, reasoning and tool calls.

Rank 0 detokenizes one token at a time and feeds the text here. Reasoning (text
between the think markers) and tool-call markup never reach the client as
content: reasoning goes out as reasoning deltas, and each tool call goes out as
one structured call the moment its closing markup arrives.

Stop strings are cut here too, on the same buffer: only the tail that could still
become a marker or a stop string is held back (textstream.py), all other text is
released as soon as it arrives, and a stop string ends the stream before any of it is
sent. Whitespace that
only separates content from markup (``</think>\\n\\n``, newlines between tool
calls) is dropped, so trailing whitespace of content waits for the next
non-whitespace character to show whether it separates text or precedes markup.

Tool-call formats come from the model's `ChatMarkup` (markup.py): the tokenizer's own
mlx-lm parser when it has one, otherwise ours in tool_calls/ (hermes JSON and Qwen XML
inside ``<tool_call>``, Gemma's ``tool_code`` fence).

Markup that does not parse is passed on as content and flagged as malformed,
so a bad generation is visible instead of raising or silently vanishing; except a call
the token limit cut short, which comes back as far as it got (tool_partial.py).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from mlx_relay.text.markup import ChatMarkup
from mlx_relay.text.textstream import first_match, held_back
from mlx_relay.text.tool_calls.common import tool_schemas
from mlx_relay.text.tool_partial import partial_calls, syntax_of_body


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object
    index: int  # position among this response's tool calls
    # False: the output ended (max_tokens) inside this call; `arguments` is the JSON text
    # written so far (tool_partial.py).
    complete: bool = True


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Final(Delta):
    """The last delta (whatever was held back) plus what went wrong in the response."""

    malformed_tool_call: bool = False
    unknown_tools: list[str] = field(default_factory=list)


# --- the streaming parser ---------------------------------------------------------------


class OutputParser:
    """Incrementally split generated text into content, reasoning and tool calls.

    ``feed`` each detokenized segment and send the returned delta; once ``stopped``
    (a stop string completed) feed no more. ``finish`` flushes what was held back. The
    ``content``, ``reasoning`` and ``tool_calls`` attributes are the aggregates of
    everything returned so far.
    """

    def __init__(
        self,
        markup: ChatMarkup | None = None,
        *,
        tools: list[dict] | None = None,
        starts_in_reasoning: bool = False,
        parse_tools: bool = True,
        opens_tool_call: str = "",
        stop: list[str] | None = None,
    ) -> None:
        """``markup``: the loaded model's (None: the default markers and our own tool
        formats). ``opens_tool_call``: the prompt ends with this tool-call marker
        (``tool_choice`` forced a call), so generation starts inside the call's body.
        ``stop``: strings that end the stream, none of which is ever sent; they are found
        in the raw text (inside reasoning and tool calls too), as mlx-lm finds them."""
        markup = markup or ChatMarkup.of(None)
        self.think_start, self.think_end = markup.think_start, markup.think_end
        self.tools = tools or None
        self._known = set(tool_schemas(tools)) if tools else None

        # Tool-call blocks: start marker -> (end marker, body parser, syntax).
        self._blocks: dict[str, tuple[str, Callable, str | None]] = {}
        if parse_tools:
            for fmt in markup.tool_formats:
                self._blocks[fmt.start] = (fmt.end, fmt.parse, fmt.syntax)
        self._content_markers = [self.think_start, *self._blocks]

        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[ToolCall] = []
        self.malformed_tool_call = False
        self.unknown_tools: list[str] = []

        self.stops = [s for s in stop or [] if s]
        self.stopped = False
        self.stop_string = ""  # the stop string that ended the output, once `stopped`

        self._buf = ""  # text not yet classified
        self._released = 0  # the head of _buf that cannot be part of a stop string
        self._mode = "reasoning" if starts_in_reasoning else "content"
        self._block_start = ""  # start marker of the open tool-call block
        self._end_search_from = 0  # where to resume looking for its end marker
        self._done = False
        self._cut = False  # the output was cut by its token limit (`finish`)
        self._forced = opens_tool_call in self._blocks
        if opens_tool_call in self._blocks:
            self._mode = "tool"
            self._block_start = opens_tool_call
        # Whitespace bookkeeping, see _emit_content and _emit_reasoning.
        self._ws = ""
        self._ws_before_block = ""
        self._content_started = False
        self._markup_seen = starts_in_reasoning or self._mode == "tool"
        self._ws_after_markup = False
        self._reasoning_ws = ""
        self._reasoning_started = False

    @property
    def in_reasoning(self) -> bool:
        return self._mode == "reasoning"

    @property
    def saw_tool_calls(self) -> bool:
        return bool(self.tool_calls)

    def feed(self, text: str) -> Delta:
        delta = Delta()
        if self._done or self.stopped:
            return delta
        self._buf += text
        self._find_stop()
        self._classify(delta, final=False)
        self._record(delta)
        return delta

    def finish(self, cut: bool = False) -> Final:
        """Flush what was held back. `cut`: the output ended at its token limit, so a
        tool call still open is returned as far as it got (`ToolCall.complete` False)."""
        final = Final()
        if not self._done:
            self._done = True
            self._cut = cut
            self._classify(final, final=True)
            if self._ws and not self._ws_after_markup:
                final.content += self._ws
            self._ws = self._reasoning_ws = ""
            self._record(final)
        final.malformed_tool_call = self.malformed_tool_call
        final.unknown_tools = list(self.unknown_tools)
        return final

    def _record(self, delta: Delta) -> None:
        self.content += delta.content
        self.reasoning += delta.reasoning
        self.tool_calls.extend(delta.tool_calls)

    def _find_stop(self) -> None:
        """Cut the buffer at the first stop string; none can start in the released head."""
        hit = first_match(self._buf, self.stops, self._released)
        if hit is not None:
            self._buf = self._buf[: hit[0]]
            self.stopped = True
            self.stop_string = hit[1]

    def _classify(self, delta: Delta, final: bool) -> None:
        """Scan what may no longer become a stop string; hold back the rest with it."""
        keep = 0 if final or self.stopped else held_back(self._buf, self.stops)
        ready, tail = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
        self._buf = ready
        self._scan(delta, final)
        self._released = len(self._buf)
        self._buf += tail

    def _scan(self, delta: Delta, final: bool) -> None:
        """Classify as much of the buffer as is certain, in order."""
        while True:
            if self._mode == "content":
                hit = first_match(self._buf, self._content_markers)
                if hit is None:
                    keep = 0 if final else held_back(self._buf, self._content_markers)
                    self._emit_content(self._buf[: len(self._buf) - keep], delta)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                i, marker = hit
                self._emit_content(self._buf[:i], delta)
                self._buf = self._buf[i + len(marker) :]
                self._ws_before_block, self._ws = self._ws, ""
                if marker == self.think_start:
                    self._mode = "reasoning"
                    self._reasoning_started = False
                else:
                    self._mode = "tool"
                    self._block_start = marker
                    self._end_search_from = 0
            elif self._mode == "reasoning":
                if not self._reasoning_started:
                    # Generation that starts inside reasoning may repeat the marker.
                    head = self._buf.lstrip()
                    if head.startswith(self.think_start):
                        self._buf = head[len(self.think_start) :]
                    elif head and self.think_start.startswith(head) and not final:
                        return
                i = self._buf.find(self.think_end)
                if i < 0:
                    keep = 0 if final else held_back(self._buf, [self.think_end])
                    self._emit_reasoning(self._buf[: len(self._buf) - keep], delta)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._emit_reasoning(self._buf[:i], delta)
                self._buf = self._buf[i + len(self.think_end) :]
                self._reasoning_ws = ""
                self._mode = "content"
                self._markup_seen = self._ws_after_markup = True
            else:
                end, parse, _ = self._blocks[self._block_start]
                # Long calls arrive in many pieces: only search the new text.
                i = self._buf.find(end, self._end_search_from) if end else -1
                if i < 0 and not final:
                    self._end_search_from = max(0, len(self._buf) - len(end) + 1)
                    return
                # An unclosed block at the end still counts if it parses completely.
                body = self._buf[:i] if i >= 0 else self._buf
                raw = self._block_start + body + (end if i >= 0 else "")
                self._buf = self._buf[i + len(end) :] if i >= 0 else ""
                self._mode = "content"
                self._close_block(body, raw, parse, delta, closed=i >= 0)

    def _close_block(
        self, body: str, raw: str, parse: Callable, delta: Delta, *, closed: bool
    ) -> None:
        try:
            calls = [
                (name, json.dumps(args, ensure_ascii=False), True)
                for name, args in parse(body, self.tools)
            ]
        except Exception:
            calls = self._partial(body, parse) if self._cut and not closed else []
            if not calls and not (self._cut and self._forced):
                # Not a tool call after all (and never an error that ends the response):
                # the client sees exactly what the model wrote.
                self.malformed_tool_call = True
                self._ws = self._ws_before_block
                self._emit_content(raw, delta)
                return
            # (a forced call cut before its name: nothing to show but the finish reason)
        for name, args, complete in calls:
            if self._known is not None and name not in self._known:
                self.unknown_tools.append(name)
                continue
            call = ToolCall(
                id=f"call_{secrets.token_hex(6)}",
                name=name,
                arguments=args,
                index=len(self.tool_calls) + len(delta.tool_calls),
                complete=complete,
            )
            delta.tool_calls.append(call)
        self._markup_seen = self._ws_after_markup = True

    def _partial(self, body: str, parse: Callable) -> list[tuple[str, str, bool]]:
        """The calls of a block cut by the token limit, as far as they got."""
        _, _, syntax = self._blocks[self._block_start]
        syntax = syntax_of_body(syntax, self._block_start, body)
        return partial_calls(syntax, body, parse, self.tools)

    def _emit_content(self, text: str, delta: Delta) -> None:
        """Send content, holding trailing whitespace until something follows it.

        Whitespace directly before markup is dropped; so is whitespace after
        markup when no content came before (``</think>\\n\\nAnswer``) or nothing
        comes after. Between content on both sides it stays as the separator.
        """
        body = text.lstrip()
        if not body:
            self._ws += text
            return
        lead = self._ws + text[: len(text) - len(body)]
        core = body.rstrip()
        if not self._content_started and self._markup_seen:
            lead = ""
        delta.content += lead + core
        self._ws = body[len(core) :]
        self._content_started = True
        self._ws_after_markup = False

    def _emit_reasoning(self, text: str, delta: Delta) -> None:
        """Send reasoning without the whitespace at the edges of a think block."""
        if not self._reasoning_started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._reasoning_ws += text
            return
        delta.reasoning += self._reasoning_ws + body
        self._reasoning_ws = text[len(body) :]
        self._reasoning_started = True
