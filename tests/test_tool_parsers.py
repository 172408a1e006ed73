"""The fallback tool parsers keep mlx-lm's per-format contract: one module per format with
``tool_call_start``, ``tool_call_end`` and ``parse_tool_call(text, tools)`` returning
``{"name", "arguments"}`` (or a list of them) and raising on bad input; the registry
(text/tool_calls) finds every format module. Their streaming behaviour is tested through
the output parser in test_postprocess.py."""

from __future__ import annotations

import importlib
import json

import pytest

from mlx_relay.text import tool_calls
from mlx_relay.text.tool_calls import hermes, qwen_xml, tool_code

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
PARIS = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}

# (module, the text between its markers, what it reads)
FORMATS = {
    "hermes": (hermes, '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'),
    "qwen_xml": (
        qwen_xml,
        "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n",
    ),
    "tool_code": (tool_code, '\nget_weather("Paris", days=3)\n'),
}


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_has_mlx_lms_contract(name):
    module, body = FORMATS[name]
    mlx_lm_module = importlib.import_module("mlx_lm.tool_parsers.json_tools")
    for attr in ("tool_call_start", "tool_call_end", "parse_tool_call"):
        assert hasattr(module, attr) and hasattr(mlx_lm_module, attr)
    assert module.tool_call_start and module.tool_call_end
    assert module.parse_tool_call(body, TOOLS) == [PARIS]


@pytest.mark.parametrize("name", FORMATS)
def test_bad_input_raises(name):
    module, _ = FORMATS[name]
    with pytest.raises(ValueError):
        module.parse_tool_call("get_weather Paris <", TOOLS)


def test_hermes_agrees_with_mlx_lms_json_tools():
    from mlx_lm.tool_parsers import json_tools

    _, body = FORMATS["hermes"]
    assert (hermes.tool_call_start, hermes.tool_call_end) == (
        json_tools.tool_call_start,
        json_tools.tool_call_end,
    )
    assert hermes.parse_tool_call(body) == [json_tools.parse_tool_call(body)]


def test_hermes_decodes_string_arguments_once():
    body = json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Paris"})})
    assert hermes.parse_tool_call(body) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]


def test_tagged_picks_the_format_by_what_follows_the_marker():
    for name in ("hermes", "qwen_xml"):
        assert tool_calls.parse_tagged(FORMATS[name][1], TOOLS) == [PARIS]
    with pytest.raises(ValueError, match="unknown <tool_call> format"):
        tool_calls.parse_tagged("get_weather(Paris)", TOOLS)
    assert [(s, e) for s, e, _ in tool_calls.FALLBACK] == [
        ("<tool_call>", "</tool_call>"),
        ("```tool_code", "```"),
    ]


# The mlx-lm parser modules a tokenizer may declare, and the syntax each is held to (as
# ChatMarkup resolved them before the formats moved into one module each).
DECLARED = {
    "json_tools": "hermes",
    "qwen3_coder": "qwen_xml",
    "mistral": "mistral_json",
    "pythonic": "pythonic",
    "glm47": "glm47",
    "longcat": "longcat",
    "kimi_k2": "kimi_k2",
    "kimi_k3": "kimi_k3",
    "minimax_m2": "minimax_m2",
    "minicpm5": "minicpm5",
    "muse_spark": "muse_spark",
    "gemma4": "gemma4",
    "function_gemma": "function_gemma",
}


def test_the_registry_finds_every_format_module_and_what_each_declares():
    assert sorted(tool_calls.SYNTAXES) == sorted({*DECLARED.values(), "mistral_args", "tool_code"})
    for module, syntax in DECLARED.items():
        assert tool_calls.declared_syntax(module, "") == syntax
    # newer Mistral templates write name[ARGS]{...}: the same parser, the other syntax
    assert tool_calls.declared_syntax("mistral", "{{ '[ARGS]' }}") == "mistral_args"
    assert tool_calls.declared_syntax("no_such_parser", "") is None
    assert all(tool_calls.syntax(s).partial is not None for s in tool_calls.SYNTAXES)
    assert tool_calls.find(None) is None and tool_calls.find("nope") is None
    with pytest.raises(ValueError, match="no grammar for tool-call syntax"):
        tool_calls.syntax("nope")


def test_two_formats_may_not_claim_one_syntax():
    one = tool_calls.syntax("hermes")
    with pytest.raises(ValueError, match="declared twice"):
        tool_calls.index([one, one])
