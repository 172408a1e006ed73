"""Grammars of tool calls, one per call format a model may write.

A forced call (tool_choice required or named) and, under `auto`, a call the model opens
itself are held to the same rules: the name of an allowed tool, then arguments valid
against that tool's JSON schema, spelled the way the model's format spells them.
`call_grammar` gives the llguidance grammar of the text after the format's start marker:

- forced: one call, complete once the call closes (the request then ends; the output
  parser reads the unclosed block at the end as the call);
- auto (`closes=True`): one call, then the end marker, after which the grammar is done
  and the model writes free text again (`tool_constraint.ToolCallWatch`). A format
  without an end marker (Mistral's) runs to the end of the output: its calls are the
  whole rest of it.

Formats (`ChatMarkup.tool_syntax` names them):

- ``hermes``: ``{"name": N, "arguments": {...}}`` inside ``<tool_call>`` (Qwen 2.5/3,
  Hermes, the fallback prompt);
- ``qwen_xml``: ``<function=N><parameter=P>value</parameter></function>`` inside
  ``<tool_call>`` (Qwen3-Coder): strings are raw text, other values JSON text;
- ``mistral_json``: ``[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]``;
- ``mistral_args``: ``[TOOL_CALLS]N[ARGS]{...}``, repeatable;
- ``tool_code``: Gemma's fenced ``N(key=value)``, values as JSON literals (the parser
  reads JSON's true/false/null);
- ``pythonic``: ``<|tool_call_start|>[N(key=value), ...]<|tool_call_end|>`` (LFM2);
- the formats of mlx-lm's other parsers: ``glm47`` (GLM 4.7, Laguna), ``longcat``,
  ``kimi_k2``, ``kimi_k3``, ``minimax_m2``, ``minicpm5``, ``muse_spark``, ``gemma4``,
  ``function_gemma``.

Each format's rule lives in its own module of `tool_calls` (the registry), built from
the blocks in tool_calls/rules.py; this module only puts a format's rule into a grammar.

A `strict` tool's schema must be enforceable in full (else InvalidRequest); other tools'
schemas are enforced leniently (tool_calls/rules.py). Keyword and XML arguments follow
the order of the schema's ``properties``; required ones must appear.
"""

from __future__ import annotations

import llguidance

from mlx_relay.errors import InvalidRequest
from mlx_relay.text import tool_calls
from mlx_relay.text.tool_calls.rules import WS, Spell, lark, tools_of

SYNTAXES = tool_calls.SYNTAXES


def any_strict(tools: list[dict]) -> bool:
    return any(t.strict for t in tools_of(tools))


def call_grammar(
    syntax: str,
    tools: list[dict],
    *,
    closes: bool,
    end: str = "",
    spell: Spell | None = None,
) -> str:
    """The llguidance grammar of what follows the start marker of a call in `syntax`.

    `closes`: the call is followed by `end` (the format's end marker, if it has one) and
    then by anything, for the watch to notice the call is over; else the grammar is
    complete when the call is. `spell`: how a marker is written in the grammar (default:
    as text only).
    """
    spell = spell or lark
    parsed = tools_of(tools)
    rules = [WS]
    fmt = tool_calls.syntax(syntax)
    body = fmt.block(fmt.call(parsed, rules, spell), spell)
    if closes and end:
        body = f"{body} {fmt.end_gap} {spell(end)} /(?s:.*)/"
    try:
        return llguidance.grammar_from("lark", "\n".join([f"start: WS? {body}", *rules]))
    except ValueError as e:
        raise InvalidRequest(f"tools cannot be enforced: {e}") from e
