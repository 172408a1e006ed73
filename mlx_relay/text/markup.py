"""A model's chat markup, resolved once when its tokenizer is loaded.

The input side (forcing a tool call, noticing a prompt that opens a think block), the
grammar gate (the think-end token) and the output parser all need the same facts about
a model: its think markers, the markup that opens and closes a tool call, and the parser
that reads a call. mlx-lm's `TokenizerWrapper` detects most of them (`think_start`,
`tool_call_start`, `tool_parser`); `ChatMarkup.of` reads them once, fills the gaps with
our fallbacks, and the engine keeps the result beside the tokenizer, so no request looks
anything up again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_relay.text import tool_calls
from mlx_relay.text.tool_calls import hermes, tool_code
from mlx_relay.text.tool_calls.common import name_and_arguments

DEFAULT_THINK_MARKERS = ("<think>", "</think>")
# Parses the text between a format's markers into (name, arguments) pairs; raises
# ValueError (or anything else) when the text is not a call in that format.
Calls = list[tuple[str, dict]]
ParseCalls = Callable[[str, "list[dict] | None"], Calls]


@dataclass(frozen=True)
class ToolFormat:
    """One tool-call format: the markup around a call and the parser of its body.

    ``end`` may be empty (Mistral's ``[TOOL_CALLS]`` has none): then the call runs to
    the end of the generation.
    """

    start: str
    end: str
    parse: ParseCalls
    syntax: str | None = None  # its tool_calls syntax, where one is known


@dataclass(frozen=True)
class ChatMarkup:
    """The markup one model writes; one instance per loaded tokenizer."""

    think_start: str = DEFAULT_THINK_MARKERS[0]
    think_end: str = DEFAULT_THINK_MARKERS[1]
    thinks: bool = False  # the tokenizer declares think markers (else the defaults apply)
    think_end_id: int | None = None  # the think end as one token, for the grammar gate
    tool_formats: tuple[ToolFormat, ...] = ()  # what the output parser recognises
    # The marker that opens a call this model writes (forcing tool_choice), or None.
    tool_call_start: str | None = None
    tool_parser: str = ""  # where the parser comes from, for logs and tests
    # How a call is held to a grammar (tool_calls.SYNTAXES), None where no grammar
    # of this model's format is known: its calls are then parsed but not constrained.
    tool_syntax: str | None = None

    @classmethod
    def of(cls, tokenizer: Any) -> ChatMarkup:
        """Resolve a tokenizer's markup (an mlx-lm TokenizerWrapper, or None)."""
        start, end = _declared_think(tokenizer) or DEFAULT_THINK_MARKERS
        declared = _declared_tool_parser(tokenizer)
        if declared is not None:
            parser, call_start, call_end = declared
            # Inside <tool_call> ours get a second try (json_tools cannot read Qwen XML).
            second = tool_calls.parse_tagged if call_start == hermes.tool_call_start else None
            opener: str | None = call_start
            source = getattr(parser, "__module__", "") or "tokenizer"
            # (the format whose module declares this parser, which can hold it to a grammar)
            syntax = tool_calls.declared_syntax(source.rpartition(".")[2], _template(tokenizer))
            formats = (ToolFormat(call_start, call_end, _calls(parser, second), syntax),)
        else:
            tagged = "qwen_xml" if "<function=" in _template(tokenizer) else "hermes"
            syntaxes = {hermes.tool_call_start: tagged, tool_code.tool_call_start: "tool_code"}
            formats = tuple(
                ToolFormat(s, e, _calls(p), syntaxes.get(s)) for s, e, p in tool_calls.FALLBACK
            )
            opener = _template_tool_marker(tokenizer, [f.start for f in formats])
            source = "fallback"
            syntax = syntaxes.get(opener) if opener else None
        return cls(
            think_start=start,
            think_end=end,
            thinks=_declared_think(tokenizer) is not None,
            think_end_id=_single_token(tokenizer, end),
            tool_formats=formats,
            tool_call_start=opener,
            tool_parser=source,
            tool_syntax=syntax,
        )

    def opens_think(self, prompt_text: str) -> bool:
        """Templates such as Qwen3's open the think block in the prompt itself."""
        return prompt_text.rstrip().endswith(self.think_start)

    @property
    def tool_call_opening(self) -> str:
        """What a prompt ends with to make the model write a call (tool_choice forced).

        Hermes and Gemma put the call on the next line; other formats (GLM's name after
        the same ``<tool_call>`` too) run on directly.
        """
        if self.tool_call_start is None:
            return ""
        newline = self.tool_call_start in (hermes.tool_call_start, tool_code.tool_call_start)
        newline = newline and self.tool_syntax != "glm47"
        return self.tool_call_start + ("\n" if newline else "")


def _declared_think(tokenizer: Any) -> tuple[str, str] | None:
    """The think markers an mlx-lm TokenizerWrapper detected in the vocabulary, or None."""
    if tokenizer is None or not getattr(tokenizer, "has_thinking", False):
        return None
    start, end = tokenizer.think_start, tokenizer.think_end
    if not start or not end:
        return None
    return start, end


def _declared_tool_parser(tokenizer: Any) -> tuple[Callable, str, str] | None:
    """mlx-lm's (parser, start marker, end marker) for this tokenizer, if it chose one."""
    if tokenizer is None or not getattr(tokenizer, "has_tool_calling", False):
        return None
    parser = getattr(tokenizer, "tool_parser", None)
    start = getattr(tokenizer, "tool_call_start", None)
    if parser is None or not start:
        return None
    return parser, start, getattr(tokenizer, "tool_call_end", None) or ""


def _template_tool_marker(tokenizer: Any, markers: list[str]) -> str | None:
    """The first of our markers that the chat template writes, if any."""
    template = _template(tokenizer)
    return next((m for m in markers if m in template), None)


def _template(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else str(template or "")


def _single_token(tokenizer: Any, text: str) -> int | None:
    if tokenizer is None:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _calls(parse: Callable, second_try: Callable | None = None) -> ParseCalls:
    """A parser with mlx-lm's contract (the text between the markers and the tools in,
    {"name", "arguments"} or a list of them out, raising on bad input) as (name,
    arguments) pairs, string arguments decoded once; ``second_try`` reads what ``parse``
    could not."""

    def calls(body: str, tools: list[dict] | None) -> Calls:
        try:
            result = parse(body, tools)
            items = result if isinstance(result, list) else [result]
            out = [name_and_arguments(item) for item in items]
            if not out:
                raise ValueError("no tool call")
            return out
        except Exception as e:  # third-party parsers raise all sorts of errors
            if second_try is not None:
                return _calls(second_try)(body, tools)
            raise ValueError(f"tool parser failed: {e}") from e

    return calls
