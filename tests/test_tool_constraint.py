"""Tool calls held to a grammar in every format we know one for, forced and under `auto`.

In process, no ranks: the grammars of `tool_grammars` walked token by token with random
choices among the tokens their masks allow (a random walk is what a random model does
under them), each result read back by the format's own parser and validated against the
tool's schema; and `ToolCallWatch`, the `auto` constraint, fed the tokens a model would
write: idle (no mask) over text and think blocks, the grammar from a call's start marker
to its end marker, idle again after it. The cluster test of `auto` through every door is
tests/test_tool_auto.py.
"""

from __future__ import annotations

import logging

import jsonschema
import llguidance
import numpy as np
import pytest
from mlx_lm.tool_parsers import (
    function_gemma,
    gemma4,
    glm47,
    kimi_k2,
    kimi_k3,
    longcat,
    minicpm5,
    minimax_m2,
    mistral,
    muse_spark,
    pythonic,
    qwen3_coder,
)
from oracle import tokenizer_for

from mlx_relay.coordinator.generation import GenerationRequest, Message
from mlx_relay.coordinator.generation import tools as tools_of
from mlx_relay.coordinator.requests import InvalidRequest, render_prompt
from mlx_relay.text import constraints, tool_grammars
from mlx_relay.text.markup import ChatMarkup
from mlx_relay.text.tool_calls import hermes, qwen_xml, tool_code
from mlx_relay.text.tool_calls import rules as grammar_rules
from mlx_relay.text.tool_constraint import ToolCallWatch, marker_guards, tool_constraint

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 5}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": WEATHER, "strict": True},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
VOCAB = 512  # tests/tiny_models.py


def _calls(result) -> list[tuple[str, dict]]:
    items = result if isinstance(result, list) else [result]
    return [(c["name"], c["arguments"]) for c in items]


# The parser each syntax's calls are read back with (theirs where mlx-lm has one).
PARSERS = {
    "hermes": hermes.parse_tool_call,
    "qwen_xml": lambda text, tools: [
        *qwen_xml.parse_tool_call(text, tools),
        qwen3_coder.parse_tool_call(text, tools),  # mlx-lm's reads it the same
    ],
    "mistral_json": mistral.parse_tool_call,
    "mistral_args": mistral.parse_tool_call,
    "tool_code": tool_code.parse_tool_call,
    "pythonic": pythonic.parse_tool_call,
    "glm47": glm47.parse_tool_call,
    "longcat": longcat.parse_tool_call,
    "kimi_k2": kimi_k2.parse_tool_call,
    "kimi_k3": kimi_k3.parse_tool_call,
    "minimax_m2": minimax_m2.parse_tool_call,
    "minicpm5": minicpm5.parse_tool_call,
    "muse_spark": muse_spark.parse_tool_call,
    "gemma4": gemma4.parse_tool_call,
    "function_gemma": function_gemma.parse_tool_call,
}
ENDS = {"hermes": "</tool_call>", "qwen_xml": "</tool_call>", "tool_code": "```"}
ENDS["pythonic"] = "<|tool_call_end|>"
ENDS.update(
    {
        "glm47": "</tool_call>",
        "longcat": "</longcat_tool_call>",
        "kimi_k2": "<|tool_calls_section_end|>",
        "kimi_k3": "<|close|>tools<|sep|>",
        "minimax_m2": "</minimax:tool_call>",
        "minicpm5": "</function>",
        "muse_spark": "</atem:function_calls>",
        "gemma4": "<tool_call|>",
        "function_gemma": "<end_function_call>",
    }
)


@pytest.fixture(scope="module")
def compiler(tiny_model):
    return constraints.Compiler(tokenizer_for(tiny_model("llama", 2)))


def _pick(rng: np.random.Generator, allowed: np.ndarray, eos: set[int]) -> int:
    """A random allowed token; where EOS is allowed, EOS half the time (calls repeat)."""
    ends = [t for t in allowed.tolist() if t in eos]
    others = [t for t in allowed.tolist() if t not in eos]
    if ends and (not others or rng.random() < 0.5):
        return ends[0]
    return int(rng.choice(others))


def _walk(constraint, compiler, rng, limit: int = 400) -> list[int]:
    """Tokens chosen among those the constraint allows, until it is idle, complete,
    or allows only EOS."""
    eos = set(compiler.tokenizer.eos_token_ids)
    out: list[int] = []
    for _ in range(limit):
        mask = constraint.mask(VOCAB)
        if mask is None:
            return out
        allowed = np.flatnonzero(np.array(mask))
        assert allowed.size, "the grammar allowed nothing"
        token = _pick(rng, allowed, eos)
        if token in eos:
            return out
        out.append(token)
        if constraint.advance(token):
            return out
    raise AssertionError(f"no end after {limit} tokens: {compiler.tokenizer.decode(out)!r}")


def _check(syntax: str, text: str, allowed: set[str]) -> None:
    calls = _calls(PARSERS[syntax](text, TOOLS))
    assert calls, text
    for name, args in calls:
        assert name in allowed, text
        jsonschema.validate(args, SCHEMAS[name])


@pytest.mark.parametrize("syntax", tool_grammars.SYNTAXES)
def test_forced_calls_in_every_format_parse_and_validate(compiler, syntax):
    rng = np.random.default_rng(5)
    for tools, allowed in [(TOOLS, {"get_weather", "get_time"}), (TOOLS[:1], {"get_weather"})]:
        grammar = tool_grammars.call_grammar(syntax, tools, closes=False, spell=compiler.spell)
        for _ in range(4):
            tokens = _walk(compiler.constraint(grammar, "tools"), compiler, rng)
            _check(syntax, compiler.tokenizer.decode(tokens), allowed)


@pytest.mark.parametrize("syntax", sorted(ENDS))
def test_an_auto_call_is_held_from_its_marker_to_its_end_then_text_is_free(compiler, syntax):
    end = ENDS[syntax]
    grammar = tool_grammars.call_grammar(syntax, TOOLS, closes=True, end=end, spell=compiler.spell)
    watch = ToolCallWatch(
        compiler.matcher(grammar, "tools"), compiler.ll_tokenizer, "<S>", closes=True
    )
    encode = compiler.tokenizer.encode
    rng = np.random.default_rng(11)
    for call in range(1, 3):
        for token in encode("Let me check.", add_special_tokens=False):
            assert watch.advance(token) is False
            assert not watch.active and watch.mask(VOCAB) is None  # text: no mask at all
        for token in encode("<S>", add_special_tokens=False):  # several tokens
            watch.advance(token)
        assert watch.active and watch.calls == call
        tokens = _walk(watch, compiler, rng)
        assert not watch.active
        text = compiler.tokenizer.decode(tokens)
        body, _, after = text.rpartition(end)
        assert body and not after.strip()
        _check(syntax, body, set(SCHEMAS))


def test_the_special_token_marker_of_a_tool_templated_model(compiler):
    """The tiny model's `<tool_call>` and `</tool_call>` are special tokens: the watch
    opens on the token, and the grammar's end accepts the special token."""
    start_id, end_id = (
        compiler.tokenizer.convert_tokens_to_ids(m) for m in ("<tool_call>", "</tool_call>")
    )
    assert compiler.spell("</tool_call>") == f'(<[{end_id}]> | "</tool_call>")'
    grammar = tool_grammars.call_grammar(
        "hermes", TOOLS, closes=True, end="</tool_call>", spell=compiler.spell
    )
    watch = ToolCallWatch(
        compiler.matcher(grammar, "tools"), compiler.ll_tokenizer, "<tool_call>", closes=True
    )
    watch.advance(start_id)
    assert watch.active
    body = '\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
    for token in compiler.tokenizer.encode(body, add_special_tokens=False):
        assert bool(np.array(watch.mask(VOCAB))[token])
        watch.advance(token)
    assert bool(np.array(watch.mask(VOCAB))[end_id])
    assert watch.advance(end_id) is False and not watch.active


def test_text_after_the_marker_in_its_last_token_is_fed_to_the_grammar(compiler, caplog):
    """The marker `<c>{` ends inside the tiny vocabulary's token `{"`: its `"` is the
    call's first byte. (A made-up format: which one does not matter here.)"""
    ll = compiler.ll_tokenizer
    quote = b'"'

    def watch(grammar: str, guarded: bool = True) -> ToolCallWatch:
        grammar = llguidance.grammar_from("lark", grammar)
        guards = marker_guards(compiler, grammar, "<c>{") if guarded else None
        matcher = compiler.matcher(grammar, "test")
        return ToolCallWatch(matcher, ll, "<c>{", closes=True, guards=guards)

    tokens = ll.tokenize_bytes(b'OK <c>{"')
    brace = tokens[-1]
    assert ll.decode_bytes([brace]) == b"{" + quote  # the marker ends inside it
    opened = watch('start: "\\"x\\"" "</c>" /(?s:.*)/')
    for token in tokens[:-1]:
        opened.advance(token)
    assert not opened.active  # `{"` can start this call: nothing to guard
    opened.advance(brace)
    assert opened.active
    x = ll.tokenize_bytes(b"x")[0]
    assert np.flatnonzero(np.array(opened.mask(VOCAB))).tolist() == [x]  # "x, not "" or "y

    # A call that cannot begin with `"`: after `<c>` (part of the marker) the token
    # `{"` is masked out, and only it; the rest of the text stays free.
    guarded = watch('start: "y" "</c>" /(?s:.*)/')
    for token in tokens[:-1]:
        before = guarded.active
        guarded.advance(token)
    assert not before and guarded.active and guarded.matcher is None
    allowed = np.array(guarded.mask(VOCAB))
    assert not allowed[brace] and allowed.sum() == len(compiler.tokenizer) - 1
    guarded.advance(ll.tokenize_bytes(b"!")[0])  # the marker did not come: free again
    assert not guarded.active

    refused = watch('start: "y" "</c>" /(?s:.*)/', guarded=False)
    with caplog.at_level(logging.WARNING, logger="mlx_relay.constraints"):
        for token in tokens:
            refused.advance(token)
    assert not refused.active and refused.calls == 1  # left to the parser to flag
    assert "which no call can follow" in caplog.text


def test_calls_inside_a_think_block_are_free(compiler):
    grammar = tool_grammars.call_grammar(
        "hermes", TOOLS, closes=True, end="</tool_call>", spell=compiler.spell
    )
    ll = compiler.ll_tokenizer
    think = ("<think>", "</think>")
    for in_reasoning, text in [(False, b"<think>maybe <tool_call>"), (True, b"maybe <tool_call>")]:
        watch = ToolCallWatch(
            compiler.matcher(grammar, "tools"),
            ll,
            "<tool_call>",
            closes=True,
            think=think,
            in_reasoning=in_reasoning,
        )
        for token in ll.tokenize_bytes(text):
            watch.advance(token)
        assert not watch.active  # the parser reads no calls in reasoning either
        for token in ll.tokenize_bytes(b"</think>Yes.<tool_call>"):
            watch.advance(token)
        assert watch.active


def test_a_format_without_an_end_marker_holds_the_rest_of_the_output(compiler):
    grammar = tool_grammars.call_grammar("mistral_json", TOOLS, closes=True, spell=compiler.spell)
    ll = compiler.ll_tokenizer
    watch = ToolCallWatch(compiler.matcher(grammar, "tools"), ll, "[TOOL_CALLS]", closes=False)
    for token in ll.tokenize_bytes(b"[TOOL_CALLS]"):
        watch.advance(token)
    tokens = _walk(watch, compiler, np.random.default_rng(2))
    assert compiler.ll_tokenizer.decode_str(tokens).rstrip().endswith("]")
    _check("mistral_json", compiler.tokenizer.decode(tokens), set(SCHEMAS))


def test_strict_schemas_a_raw_text_value_cannot_enforce_are_refused(compiler):
    strict = {**TOOLS[0], "function": {**TOOLS[0]["function"]}}
    strict["function"]["parameters"] = {
        "type": "object",
        "properties": {"city": {"type": "string", "pattern": "^[A-Z]"}},
        "required": ["city"],
    }
    with pytest.raises(InvalidRequest, match="pattern cannot be enforced"):
        tool_grammars.call_grammar("qwen_xml", [strict], closes=False)
    # JSON formats enforce it (llguidance's JSON schemas know patterns).
    assert tool_grammars.call_grammar("hermes", [strict], closes=False)


def _prompt(tokenizer, tool_choice: str, tools=TOOLS):
    messages = (Message(role="user", content="Weather in Paris?"),)
    return render_prompt(
        tokenizer,
        GenerationRequest(messages=messages, tools=tools_of(tools), tool_choice=tool_choice),
    )


def test_which_constraint_a_request_gets(compiler):
    tokenizer = compiler.tokenizer
    markup = ChatMarkup.of(tokenizer)
    assert markup.tool_syntax == "hermes"  # mlx-lm's json_tools parser
    auto = tool_constraint(compiler, markup, _prompt(tokenizer, "auto"))
    assert isinstance(auto, ToolCallWatch) and not auto.active
    forced = tool_constraint(compiler, markup, _prompt(tokenizer, "required"))
    assert not isinstance(forced, ToolCallWatch) and forced.active
    assert tool_constraint(compiler, markup, _prompt(tokenizer, "none")) is None
    assert tool_constraint(compiler, markup, _prompt(tokenizer, "auto", tools=None)) is None
    unreadable = {"$ref": "http://example.com/s.json"}
    for strict in (False, True):
        tool = {"type": "function", "function": {"name": "f", "parameters": unreadable}}
        tool["function"]["strict"] = strict
        prompt = _prompt(tokenizer, "auto", tools=[tool])
        if strict:
            with pytest.raises(InvalidRequest, match="tools cannot be enforced"):
                tool_constraint(compiler, markup, prompt)
        else:  # a request accepted before is not refused now: its calls are free
            assert tool_constraint(compiler, markup, prompt) is None


# Each format's call of get_time(zone="UTC"), as its chat template writes one.
WRITTEN = {
    "hermes": '{"name": "get_time", "arguments": {"zone": "UTC"}}',
    "qwen_xml": "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>",
    "mistral_json": '[{"name": "get_time", "arguments": {"zone": "UTC"}}]',
    "mistral_args": 'get_time[ARGS]{"zone": "UTC"}',
    "tool_code": 'get_time(zone="UTC")',
    "pythonic": '[get_time(zone="UTC")]',
    "glm47": "get_time\n<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n",
    "longcat": "get_time\n<longcat_arg_key>zone</longcat_arg_key>\n"
    "<longcat_arg_value>UTC</longcat_arg_value>\n",
    "kimi_k2": '<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{"zone": "UTC"}'
    "<|tool_call_end|>",
    "kimi_k3": '<|open|>call tool="get_time" index="1"<|sep|><|open|>json type="object"<|sep|>'
    '{"zone": "UTC"}<|close|>json<|sep|><|close|>call<|sep|>',
    "minimax_m2": '\n<invoke name="get_time">\n<parameter name="zone">UTC</parameter>\n</invoke>\n',
    "minicpm5": '"get_time"><param name="zone">UTC</param>',
    "muse_spark": '<atem:invoke name="get_time"><atem:parameter name="zone">"UTC"'
    "</atem:parameter></atem:invoke>",
    "gemma4": 'call:get_time{zone:<|"|>UTC<|"|>}',
    "function_gemma": "call:get_time{zone:<escape>UTC<escape>}",
}


def _accepts(compiler, grammar: str, text: str) -> bool:
    """The grammar takes the whole of `text`, written in the vocabulary's own tokens."""
    matcher = compiler.matcher(grammar, "tools")
    tokens = compiler.ll_tokenizer.tokenize_bytes(text.encode())
    return bool(matcher.consume_tokens(tokens)) and not matcher.is_error()


@pytest.mark.parametrize("syntax", sorted(WRITTEN))
def test_a_call_as_the_template_writes_it_is_accepted_and_a_wrong_name_refused(compiler, syntax):
    text = WRITTEN[syntax]
    calls = _calls(PARSERS[syntax](text, TOOLS))
    assert calls and all(call == ("get_time", {"zone": "UTC"}) for call in calls)
    text = text.rstrip("\n")  # (a forced call's grammar ends with the call)
    grammar = tool_grammars.call_grammar(syntax, TOOLS, closes=False, spell=compiler.spell)
    assert _accepts(compiler, grammar, text)
    assert not _accepts(compiler, grammar, text.replace("get_time", "get_tame"))
    assert not _accepts(compiler, grammar, text.replace("UTC", "UTC_UTC"))  # maxLength 5


def test_a_raw_string_ends_at_its_marker_written_as_text_or_as_its_special_token(compiler):
    """`</tool_call>` is a special token of the tiny vocabulary (a stand-in for GLM's
    `</arg_value>` or Gemma 4's `<|"|>`): a raw string may end at that token or at the
    marker spelled in text, and holds neither."""
    tool = grammar_rules.tools_of(TOOLS[1:])[0]
    rules = [grammar_rules.WS]
    raw = grammar_rules.RawText("</tool_call>", trimmed=True)
    value = grammar_rules.raw_string(
        tool, "zone", TIME["properties"]["zone"], rules, "v", raw, compiler.spell
    )
    assert "<[" in value  # the special token's alternative
    grammar = llguidance.grammar_from("lark", "\n".join([f'start: "[" {value} "]"', *rules]))
    end_id = compiler.tokenizer.convert_tokens_to_ids("</tool_call>")
    ll = compiler.ll_tokenizer

    def takes(*pieces: bytes | int) -> bool:
        matcher = compiler.matcher(grammar, "tools")
        for piece in pieces:
            tokens = [piece] if isinstance(piece, int) else ll.tokenize_bytes(piece)
            if not matcher.consume_tokens(tokens) or matcher.is_error():
                return False
        return matcher.is_accepting()

    assert takes(b"[UTC</tool_call>]")
    assert takes(b"[UTC", end_id, b"]")
    assert takes(b"[</tool_call>]") and takes(b"[", end_id, b"]")  # the empty string
    assert not takes(b"[ UTC</tool_call>]")  # stripped by the parser: no edge whitespace
    assert not takes(b"[UTC_UTC</tool_call>]")  # maxLength 5
