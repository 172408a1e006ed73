"""The fallback tool parsers keep mlx-lm's per-format contract: one module per format with
``tool_call_start``, ``tool_call_end`` and ``parse_tool_call(text, tools)`` returning
``{"name", "arguments"}`` (or a list of them) and raising on bad input. Their streaming
behaviour is tested through the output parser in test_postprocess.py."""

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
