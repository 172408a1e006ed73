"""ChatMarkup: a model's think and tool-call markup, resolved once from its tokenizer.

Real tokenizers: the tiny test tokenizer (Qwen3-style template, <think>/<tool_call> as
special tokens), the same told to use other mlx-lm tool parsers or given other chat
templates, and SmolLM2's (the embedded default model), which neither thinks nor calls.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import CHAT_TEMPLATE, write_tokenizer  # noqa: E402

from mlx_relay.text.markup import ChatMarkup  # noqa: E402
from mlx_relay.text.postprocess import OutputParser  # noqa: E402

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


def variant(tiny_dir: Path, tmp_path: Path, **config) -> object:
    """The tiny tokenizer with some tokenizer_config.json keys replaced."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, tmp_path / name)
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return load_tokenizer(tmp_path)


def test_tiny_tokenizer_thinks_and_uses_mlx_lms_json_tools(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    markup = ChatMarkup.of(tok)
    assert (markup.think_start, markup.think_end, markup.thinks) == ("<think>", "</think>", True)
    assert markup.think_end_id == tok.convert_tokens_to_ids("</think>")
    assert markup.tool_parser == "mlx_lm.tool_parsers.json_tools"
    assert [(f.start, f.end) for f in markup.tool_formats] == [("<tool_call>", "</tool_call>")]
    assert markup.tool_call_start == "<tool_call>"
    assert markup.tool_call_opening == "<tool_call>\n"
    assert markup.tool_syntax == "hermes"  # calls held to tool_grammars' hermes grammar


@pytest.mark.parametrize(
    "parser_type, start, end, opening, syntax",
    [
        ("pythonic", "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_call_start|>", "pythonic"),
        ("mistral", "[TOOL_CALLS]", "", "[TOOL_CALLS]", "mistral_json"),
        ("qwen3_coder", "<tool_call>", "</tool_call>", "<tool_call>\n", "qwen_xml"),
        ("glm47", "<tool_call>", "</tool_call>", "<tool_call>", "glm47"),
        (
            "longcat",
            "<longcat_tool_call>",
            "</longcat_tool_call>",
            "<longcat_tool_call>",
            "longcat",
        ),
        (
            "kimi_k2",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_calls_section_begin|>",
            "kimi_k2",
        ),
        (
            "kimi_k3",
            "<|open|>tools<|sep|>",
            "<|close|>tools<|sep|>",
            "<|open|>tools<|sep|>",
            "kimi_k3",
        ),
        (
            "minimax_m2",
            "<minimax:tool_call>",
            "</minimax:tool_call>",
            "<minimax:tool_call>",
            "minimax_m2",
        ),
        ("minicpm5", "<function name=", "</function>", "<function name=", "minicpm5"),
        (
            "muse_spark",
            "<atem:function_calls>",
            "</atem:function_calls>",
            "<atem:function_calls>",
            "muse_spark",
        ),
        ("gemma4", "<|tool_call>", "<tool_call|>", "<|tool_call>", "gemma4"),
        (
            "function_gemma",
            "<start_function_call>",
            "<end_function_call>",
            "<start_function_call>",
            "function_gemma",
        ),
    ],
)
def test_a_declared_mlx_lm_parser_is_the_only_format(
    tiny_dir, tmp_path, parser_type, start, end, opening, syntax
):
    markup = ChatMarkup.of(variant(tiny_dir, tmp_path, tool_parser_type=parser_type))
    assert markup.tool_parser == f"mlx_lm.tool_parsers.{parser_type}"
    assert [(f.start, f.end) for f in markup.tool_formats] == [(start, end)]
    assert (markup.tool_call_start, markup.tool_call_opening) == (start, opening)
    assert markup.tool_syntax == syntax


def test_a_mistral_template_with_args_markers_gets_the_args_grammar(tiny_dir, tmp_path):
    template = "{%- for m in messages %}{{ m.content }}{%- endfor %}[TOOL_CALLS]f[ARGS]{}"
    tok = variant(tiny_dir, tmp_path, tool_parser_type="mistral", chat_template=template)
    assert ChatMarkup.of(tok).tool_syntax == "mistral_args"


def test_a_gemma_template_falls_back_to_our_formats_and_forces_tool_code(tiny_dir, tmp_path):
    template = (
        "{%- for m in messages %}{{ m.content }}{%- endfor %}"
        "{%- if tools %}Call tools in a ```tool_code block.{%- endif %}"
    )
    markup = ChatMarkup.of(variant(tiny_dir, tmp_path, chat_template=template))
    assert markup.tool_parser == "fallback"
    assert [f.start for f in markup.tool_formats] == ["<tool_call>", "```tool_code"]
    assert markup.tool_call_start == "```tool_code"
    assert markup.tool_call_opening == "```tool_code\n"
    assert markup.tool_syntax == "tool_code"


def test_a_template_without_tool_markup_cannot_force_a_call(tiny_dir, tmp_path):
    template = CHAT_TEMPLATE.replace("<tool_call>", "").replace("tool_call.name", "x")
    markup = ChatMarkup.of(variant(tiny_dir, tmp_path, chat_template=template))
    assert markup.tool_parser == "fallback"
    assert markup.tool_call_start is None and markup.tool_call_opening == ""
    assert markup.tool_syntax is None
    assert markup.thinks  # the vocabulary still has the think tokens


def test_no_tokenizer_gets_the_defaults():
    markup = ChatMarkup.of(None)
    assert (markup.think_start, markup.think_end, markup.thinks) == ("<think>", "</think>", False)
    assert markup.think_end_id is None and markup.tool_call_start is None
    assert [f.start for f in markup.tool_formats] == ["<tool_call>", "```tool_code"]


@pytest.mark.default_model
def test_default_model_neither_thinks_nor_calls_tools():
    from mlx_relay.model.default_model import resolve_model

    tok = load_tokenizer(resolve_model("default", progress=False))
    markup = ChatMarkup.of(tok)
    assert not markup.thinks and markup.think_end == "</think>"
    assert markup.think_end_id is None  # several ordinary tokens: no grammar gate
    assert markup.tool_parser == "fallback" and markup.tool_call_start is None


def test_opens_think_reads_the_rendered_prompt(tiny_dir, tmp_path):
    markup = ChatMarkup.of(load_tokenizer(tiny_dir))
    assert markup.opens_think("<|im_start|>assistant\n<think>\n")
    assert not markup.opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    custom = dataclasses.replace(markup, think_start="<|channel>thought")
    assert custom.opens_think("x <|channel>thought ") and not custom.opens_think("x <think>")


def test_the_output_parser_uses_the_markup_it_is_given(tiny_dir):
    markup = ChatMarkup.of(load_tokenizer(tiny_dir))
    parser = OutputParser(markup, tools=None)
    parser.feed("<think>hm</think>ok <tool_call>" + CALL + "</tool_call>")
    parser.finish()
    assert (parser.reasoning, parser.content) == ("hm", "ok")
    assert [c.name for c in parser.tool_calls] == ["get_weather"]
