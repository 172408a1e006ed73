"""A tool call cut by the token limit, read back as far as it got (tool_partial.py).

In process: each format's call of get_weather, cut after every character, read with that
format's own parser (mlx-lm's where it has one). Once the name is whole the call comes
back under it, its arguments a prefix of the call's JSON arguments that reads as an
object holding only what was written (a string cut short is the start of the string).
The cluster test with the real clients is tests/test_clients_e2e.py
(test_forced_call_cut_short).
"""

from __future__ import annotations

import importlib
import json

import pytest

from mlx_relay.text.markup import ChatMarkup, _calls
from mlx_relay.text.postprocess import OutputParser
from mlx_relay.text.tool_calls import hermes, qwen_xml, tool_code
from mlx_relay.text.tool_partial import json_prefix_object, partial_calls

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
ARGS = {"city": "Paris", "days": 3}


def _mlx_lm(name: str):
    """mlx-lm's parser module of that name."""
    return importlib.import_module(f"mlx_lm.tool_parsers.{name}")


# syntax -> (parser, one call of get_weather(city="Paris", days=3) as the format writes it)
CALLS = {
    "hermes": (hermes, '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'),
    "mistral_json": (
        _mlx_lm("mistral"),
        '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
    ),
    "qwen_xml": (
        qwen_xml,
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>",
    ),
    "tool_code": (tool_code, 'get_weather(city="Paris", days=3)'),
    "pythonic": (_mlx_lm("pythonic"), '[get_weather(city="Paris", days=3)]'),
    "glm47": (
        _mlx_lm("glm47"),
        "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>",
    ),
    "longcat": (
        _mlx_lm("longcat"),
        "get_weather\n<longcat_arg_key>city</longcat_arg_key>\n"
        "<longcat_arg_value>Paris</longcat_arg_value>\n<longcat_arg_key>days</longcat_arg_key>"
        "\n<longcat_arg_value>3</longcat_arg_value>",
    ),
    "kimi_k2": (
        _mlx_lm("kimi_k2"),
        "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": 3}<|tool_call_end|>',
    ),
    "kimi_k3": (
        _mlx_lm("kimi_k3"),
        '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" '
        'type="string"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key="days" '
        'type="integer"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>',
    ),
    "minimax_m2": (
        _mlx_lm("minimax_m2"),
        '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">3</parameter>\n</invoke>',
    ),
    "minicpm5": (
        _mlx_lm("minicpm5"),
        '"get_weather"><param name="city">Paris</param><param name="days">3</param>',
    ),
    "muse_spark": (
        _mlx_lm("muse_spark"),
        '<atem:invoke name="get_weather"><atem:parameter name="city">"Paris"</atem:parameter>'
        '<atem:parameter name="days">3</atem:parameter></atem:invoke>',
    ),
    "gemma4": (_mlx_lm("gemma4"), 'call:get_weather{city:<|"|>Paris<|"|>,days:3}'),
    "function_gemma": (
        _mlx_lm("function_gemma"),
        "call:get_weather{city:<escape>Paris<escape>,days:3}",
    ),
}


@pytest.mark.parametrize("syntax", sorted(CALLS))
def test_a_call_cut_anywhere_after_its_name_comes_back_as_far_as_it_got(syntax):
    module, text = CALLS[syntax]
    parse = _calls(module.parse_tool_call)
    assert parse(text, TOOLS) == [("get_weather", ARGS)]
    named = text.index("get_weather") + len("get_weather")
    seen = False
    for cut in range(named, len(text)):
        calls = partial_calls(syntax, text[:cut], parse, TOOLS)
        assert len(calls) == (1 if seen else len(calls)) <= 1, (text[:cut], calls)
        seen = seen or bool(calls)
        for name, arguments, complete in calls:
            assert name == "get_weather", text[:cut]
            if complete:  # (cut after the arguments, before the call's end)
                assert json.loads(arguments) == ARGS
                continue
            assert not arguments or arguments.startswith("{"), arguments
            got = json_prefix_object(arguments)
            for key, value in got.items():
                assert key in ARGS, (text[:cut], got)
                full = ARGS[key]
                assert value == full or (isinstance(value, str) and full.startswith(value)), got
    assert seen  # (by the last cut at the latest)


def test_json_prefix_object_closes_what_is_open():
    assert json_prefix_object('{"city": "Par') == {"city": "Par"}
    assert json_prefix_object('{"city": "Paris", "da') == {"city": "Paris"}
    assert json_prefix_object('{"a": [1, {"b": tr') == {"a": [1, {}]}
    assert json_prefix_object('{"a": "x\\') == {"a": "x"}
    assert json_prefix_object("") == {}
    assert json_prefix_object('{"a": 1}') == {"a": 1}


def _parser(cut_text: str, **kwargs) -> OutputParser:
    parser = OutputParser(ChatMarkup.of(None), tools=TOOLS, **kwargs)
    parser.feed(cut_text)
    return parser


def test_the_output_parser_returns_a_cut_call_only_when_the_output_was_cut():
    body = '{"name": "get_weather", "arguments": {"city": "Par'
    final = _parser(body, opens_tool_call="<tool_call>").finish(cut=True)
    [call] = final.tool_calls
    assert (call.name, call.arguments, call.complete) == (
        "get_weather",
        '{"city": "Par',
        False,
    )
    assert final.content == "" and not final.malformed_tool_call

    # Under auto, cut inside a call the model opened itself: the same.
    final = _parser(f"Let me see. <tool_call>\n{body}").finish(cut=True)
    assert final.tool_calls[0].name == "get_weather" and not final.tool_calls[0].complete

    # Not cut (the model ended it so): markup that does not parse is content, flagged.
    final = _parser(f"<tool_call>\n{body}").finish(cut=False)
    assert not final.tool_calls and final.malformed_tool_call
    assert final.content.startswith("<tool_call>")

    # A forced call cut before its name is whole: no call to show, and no markup either.
    final = _parser('{"name": "get_wea', opens_tool_call="<tool_call>").finish(cut=True)
    assert not final.tool_calls and final.content == ""


def test_a_whole_call_is_complete():
    body = json.dumps({"name": "get_weather", "arguments": ARGS})
    parser = _parser(f"<tool_call>{body}</tool_call>")
    parser.finish(cut=True)
    [call] = parser.tool_calls
    assert call.complete and json.loads(call.arguments) == ARGS
