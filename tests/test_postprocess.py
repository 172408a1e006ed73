"""The streaming output parser: reasoning split and tool calls, fed the way rank 0 feeds it.

Model outputs are encoded with real tokenizers and detokenized one token at a
time, so markers arrive split across segments exactly as in the server: the
tiny test tokenizer has <think>/<tool_call> as single special tokens, SmolLM2's
tokenizer (the embedded default model) spells them with several ordinary tokens.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_tiny_model  # noqa: E402

from mlx_relay.coordinator.generation import GenerationRequest, Message  # noqa: E402
from mlx_relay.coordinator.generation import tools as tools_of  # noqa: E402
from mlx_relay.coordinator.requests import render_prompt  # noqa: E402
from mlx_relay.text.markup import ChatMarkup  # noqa: E402
from mlx_relay.text.postprocess import (  # noqa: E402
    Delta,
    Final,
    OutputParser,
    ToolCall,
)

ID_RE = re.compile(r"call_[0-9a-f]{12}")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "units": {"type": "string", "enum": ["metric", "imperial"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "configure",
            "description": "One parameter of every JSON type.",
            "parameters": {
                "type": "object",
                "properties": {
                    "count": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "enabled": {"type": "boolean"},
                    "options": {"type": "object"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "label": {"type": "string"},
                    "zip": {"type": "string"},
                    "limit": {"type": ["integer", "null"]},
                },
            },
        },
    },
]


# --- tokenizers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", num_layers=1)


@pytest.fixture(scope="module")
def tiny_tok(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="session")
def smol_tok():
    from mlx_relay.model.default_model import resolve_model

    return load_tokenizer(resolve_model("default", progress=False))


@pytest.fixture(
    params=["tiny", pytest.param("smollm2", marks=pytest.mark.default_model)],
)
def tok(request):
    return request.getfixturevalue("tiny_tok" if request.param == "tiny" else "smol_tok")


def tokenizer_with_parser(tiny_dir: Path, tmp_path: Path, parser_type: str):
    """The tiny tokenizer, with mlx-lm told to use one of its tool parsers."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["tool_parser_type"] = parser_type
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(tmp_path)


# --- driving the parser -------------------------------------------------------------


@dataclass
class Result:
    content: str
    reasoning: str
    calls: list[ToolCall]
    final: Final
    deltas: list[Delta]

    def summary(self) -> tuple:
        """What a client sees, without the random call ids."""
        return (
            self.content,
            self.reasoning,
            [(c.name, json.loads(c.arguments)) for c in self.calls],
            self.final.malformed_tool_call,
            self.final.unknown_tools,
        )


def collect(parser: OutputParser, deltas: list[Delta]) -> Result:
    """Aggregate the deltas, checking they agree with the parser's own aggregate."""
    final = parser.finish()
    assert isinstance(final, Final) and isinstance(final, Delta)
    deltas = [*deltas, final]
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    calls = [c for d in deltas for c in d.tool_calls]
    assert (content, reasoning, calls) == (parser.content, parser.reasoning, parser.tool_calls)
    assert parser.saw_tool_calls == bool(calls)
    assert len({c.id for c in calls}) == len(calls)
    for i, call in enumerate(calls):
        assert call.index == i
        assert ID_RE.fullmatch(call.id), call.id
        assert isinstance(json.loads(call.arguments), dict)
    return Result(content, reasoning, calls, final, deltas)


def feed_tokens(tokenizer, text: str, parser: OutputParser) -> Result:
    """Encode a whole model output, then stream it back token by token like the server."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    det = tokenizer.detokenizer
    deltas = []
    segments = []
    for token in ids:
        det.add_token(token)
        segments.append(det.last_segment)
        deltas.append(parser.feed(segments[-1]))
    det.finalize()
    segments.append(det.last_segment)
    deltas.append(parser.feed(segments[-1]))
    assert "".join(segments) == text  # the stream itself is faithful
    return collect(parser, deltas)


def feed_chunks(chunks: list[str], parser: OutputParser) -> Result:
    return collect(parser, [parser.feed(c) for c in chunks])


def run(text: str, mode: str, tokenizer=None, **kwargs) -> Result:
    """Feed by ``mode``: "token" (needs a tokenizer to encode with), "char" or "whole".

    The parser gets ``parser_tokenizer`` if given, else no tokenizer at all, so
    our own parsers are exercised even when streaming through the tiny tokenizer.
    """
    markup = ChatMarkup.of(kwargs.pop("parser_tokenizer", None))
    if "think_markers" in kwargs:
        start, end = kwargs.pop("think_markers")
        markup = dataclasses.replace(markup, think_start=start, think_end=end)
    parser = OutputParser(markup, tools=kwargs.pop("tools", TOOLS), **kwargs)
    if mode == "token":
        return feed_tokens(tokenizer, text, parser)
    if mode == "char":
        return feed_chunks(list(text), parser)
    return feed_chunks([text], parser)


# --- cases: (model output, parser kwargs, content, reasoning, calls, malformed, unknown) ---

WEATHER_PARIS = ("get_weather", {"city": "Paris", "days": 3})
HERMES_PARIS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)
HERMES_ROME = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
XML_TYPED = (
    "<tool_call>\n<function=configure>\n"
    "<parameter=count>\n3\n</parameter>\n"
    "<parameter=ratio>\n0.5\n</parameter>\n"
    "<parameter=enabled>\ntrue\n</parameter>\n"
    '<parameter=options>\n{"depth": [1, 2], "mode": "fast"}\n</parameter>\n'
    '<parameter=tags>\n["a", "b"]\n</parameter>\n'
    "<parameter=label>\nfirst line\nsecond line\n</parameter>\n"
    "<parameter=zip>\n01234\n</parameter>\n"
    "<parameter=limit>\nnull\n</parameter>\n"
    "<parameter=extra>\n5\n</parameter>\n"
    "</function>\n</tool_call>"
)
XML_TYPED_ARGS = {
    "count": 3,
    "ratio": 0.5,
    "enabled": True,
    "options": {"depth": [1, 2], "mode": "fast"},
    "tags": ["a", "b"],
    "label": "first line\nsecond line",
    "zip": "01234",
    "limit": None,
    "extra": "5",  # not in the schema: kept as written
}
XML_ROME = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)

CASES = {
    "plain": ("Hello, world! How are you today?", {}, "Hello, world! How are you today?", "", []),
    "plain_markup_lookalikes": (
        "Fine <|im_end|> and <b>bold</b>, a < b, <th> `code` ```python\nx = 1\n```",
        {},
        "Fine <|im_end|> and <b>bold</b>, a < b, <th> `code` ```python\nx = 1\n```",
        "",
        [],
    ),
    "plain_whitespace": (
        "\n  Line one.\n\nLine two.\n",
        {},
        "\n  Line one.\n\nLine two.\n",
        "",
        [],
    ),
    "unicode": ("Über den Wolken: 23°C 🙂", {}, "Über den Wolken: 23°C 🙂", "", []),
    "reasoning_then_content": (
        "<think>\nThe user asks step by step.\n</think>\n\nThe answer is 42.",
        {},
        "The answer is 42.",
        "The user asks step by step.",
        [],
    ),
    "starts_in_reasoning": (
        "\nThe capital of France.\n</think>\n\nParis, of course.",
        {"starts_in_reasoning": True},
        "Paris, of course.",
        "The capital of France.",
        [],
    ),
    "starts_in_reasoning_repeats_marker": (
        "<think>\nhmm\n</think>\nok",
        {"starts_in_reasoning": True},
        "ok",
        "hmm",
        [],
    ),
    "tool_markup_inside_reasoning_is_reasoning": (
        "<think>\nmaybe <tool_call> here\n</think>\nNo.",
        {},
        "No.",
        "maybe <tool_call> here",
        [],
    ),
    "reasoning_unterminated": ("<think>\nstill thinking ", {}, "", "still thinking", []),
    "reasoning_empty": ("<think>\n\n</think>\n\nHi.", {}, "Hi.", "", []),
    "hermes": ("Let me check.\n" + HERMES_PARIS, {}, "Let me check.", "", [WEATHER_PARIS]),
    "hermes_several_content_after": (
        "Let me check.\n" + HERMES_PARIS + "\n" + HERMES_ROME + "\nDone.",
        {},
        "Let me check.\nDone.",
        "",
        [WEATHER_PARIS, ("get_weather", {"city": "Rome"})],
    ),
    "hermes_after_reasoning": (
        "<think>\nI need the weather tool.\n</think>\n\n" + HERMES_PARIS,
        {},
        "",
        "I need the weather tool.",
        [WEATHER_PARIS],
    ),
    "hermes_two_objects_one_block": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
        {},
        "",
        "",
        [WEATHER_PARIS, ("get_weather", {"city": "Zürich"})],
    ),
    "hermes_string_arguments_decoded_once": (
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", '
        '\\"days\\": 3}"}\n</tool_call>',
        {},
        "",
        "",
        [WEATHER_PARIS],
    ),
    "hermes_unclosed_but_complete": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n',
        {},
        "",
        "",
        [WEATHER_PARIS],
    ),
    "hermes_no_tools_given_no_name_check": (
        '<tool_call>{"name": "anything", "arguments": {}}</tool_call>',
        {"tools": None},
        "",
        "",
        [("anything", {})],
    ),
    "hermes_parse_tools_off": (
        "Sure.\n" + HERMES_ROME,
        {"parse_tools": False, "tools": None},
        "Sure.\n" + HERMES_ROME,
        "",
        [],
    ),
    "xml_typed": (
        "Configuring.\n" + XML_TYPED,
        {},
        "Configuring.",
        "",
        [("configure", XML_TYPED_ARGS)],
    ),
    "xml_several_content_between": (
        XML_ROME + "\nand\n" + XML_ROME,
        {},
        "and",
        "",
        [("get_weather", {"city": "Rome", "days": 2})] * 2,
    ),
    "tool_code_positional": (
        'I\'ll look it up.\n```tool_code\nget_weather("Paris", 3)\n```',
        {},
        "I'll look it up.",
        "",
        [WEATHER_PARIS],
    ),
    "tool_code_several_literals": (
        "```tool_code\nget_weather('Oslo', units='metric')\n"
        "configure(enabled=true, options={'a': [1, -2.5, None]}, tags=('x',), limit=null)\n```\n"
        "Done.",
        {},
        "Done.",
        "",
        [
            ("get_weather", {"city": "Oslo", "units": "metric"}),
            (
                "configure",
                {"enabled": True, "options": {"a": [1, -2.5, None]}, "tags": ["x"], "limit": None},
            ),
        ],
    ),
    "tool_code_print_wrapper": (
        '```tool_code\nprint(get_weather(city="Paris", days=3))\n```',
        {},
        "",
        "",
        [WEATHER_PARIS],
    ),
    # tool_choice forced a call: the prompt ends with the opening marker.
    "forced_hermes_then_text": (
        HERMES_PARIS.removeprefix("<tool_call>") + "\nDone.",
        {"opens_tool_call": "<tool_call>"},
        "Done.",
        "",
        [WEATHER_PARIS],
    ),
    "forced_hermes_then_another": (
        HERMES_PARIS.removeprefix("<tool_call>") + "\n" + HERMES_ROME,
        {"opens_tool_call": "<tool_call>"},
        "",
        "",
        [WEATHER_PARIS, ("get_weather", {"city": "Rome"})],
    ),
    "forced_tool_code": (
        '\nget_weather(city="Paris", days=3)\n```',
        {"opens_tool_call": "```tool_code"},
        "",
        "",
        [WEATHER_PARIS],
    ),
}

# (model output, parser kwargs, unknown tools): calls to tools the request did not offer.
UNKNOWN = {
    "hermes": (
        '<tool_call>\n{"name": "launch_rocket", "arguments": {"when": "now"}}\n</tool_call>',
        ["launch_rocket"],
    ),
    "xml": (
        "<tool_call>\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>",
        ["rm_rf"],
    ),
    "tool_code": (
        '```tool_code\nlaunch_rocket("now", 3)\nget_weather(city="Paris", days=3)\n```',
        ["launch_rocket"],
    ),
}

# Markup that must come back verbatim as content, flagged malformed.
MALFORMED = {
    "hermes_unclosed": 'Sure. <tool_call>{"name": "get_weather", "arguments": {',
    "hermes_bad_json": '<tool_call>{"name": get_weather, "arguments": {}}</tool_call>',
    "hermes_arguments_not_object": '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
    "hermes_no_name": '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',
    "tool_call_unknown_format": "<tool_call>get_weather Paris</tool_call>",
    "xml_unclosed_function": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"
    ),
    "tool_code_syntax_error": '```tool_code\nget_weather(city="Par\n```',
    "tool_code_unclosed": '```tool_code\nget_weather(city="Par',
    "tool_code_not_a_literal": "```tool_code\nget_weather(city=os.environ['HOME'])\n```",
    "tool_code_too_many_positional": '```tool_code\nget_weather("Paris", 3, "metric", 4)\n```',
    "tool_code_statement": "```tool_code\nimport os\n```",
}


def check_case(result: Result, content, reasoning, calls, malformed=False, unknown=()):
    assert result.summary() == (content, reasoning, list(calls), malformed, list(unknown))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("mode", ["token", "char"])
def test_cases(tok, mode, name):
    text, kwargs, content, reasoning, calls = CASES[name]
    check_case(run(text, mode, tok, **kwargs), content, reasoning, calls)


@pytest.mark.parametrize("name", UNKNOWN)
@pytest.mark.parametrize("mode", ["token", "char"])
def test_unknown_tools_are_reported_not_called(tok, mode, name):
    text, unknown = UNKNOWN[name]
    result = run("Okay.\n" + text, mode, tok)
    calls = [WEATHER_PARIS] if name == "tool_code" else []
    check_case(result, "Okay.", "", calls, unknown=unknown)


@pytest.mark.parametrize("name", MALFORMED)
@pytest.mark.parametrize("mode", ["token", "char"])
def test_malformed_markup_becomes_content(tok, mode, name):
    text = MALFORMED[name]
    check_case(run(text, mode, tok), text, "", [], malformed=True)


def test_malformed_block_does_not_spoil_the_next_one():
    text = "A <tool_call>{oops}</tool_call> B\n" + HERMES_PARIS
    result = run(text, "char")
    check_case(result, "A <tool_call>{oops}</tool_call> B", "", [WEATHER_PARIS], malformed=True)


# --- every split point -------------------------------------------------------------------

SPLIT_TEXTS = {
    "reasoning_hermes": (
        "<think>\nweather?\n</think>\n\nLet me check.\n" + HERMES_ROME + "\nDone.",
        {},
    ),
    "starts_in_reasoning": ("plan </think> answer `x` <b>", {"starts_in_reasoning": True}),
    "xml": ("Hi\n" + XML_ROME + XML_ROME, {}),
    "tool_code": ('See:\n```tool_code\nget_weather("Paris", days=3)\n```\nok', {}),
    "malformed": ('a <tool_call>{"name": "get_weather"', {}),
}


@pytest.mark.parametrize("name", SPLIT_TEXTS)
def test_every_split_point_gives_the_same_result(name):
    text, kwargs = SPLIT_TEXTS[name]
    expected = run(text, "whole", **dict(kwargs)).summary()
    assert run(text, "char", **dict(kwargs)).summary() == expected
    for i in range(len(text) + 1):
        parser = OutputParser(tools=TOOLS, **kwargs)
        assert feed_chunks([text[:i], text[i:]], parser).summary() == expected, i
    rng = random.Random(name)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), 4))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert feed_chunks(chunks, OutputParser(tools=TOOLS, **kwargs)).summary() == expected


# --- streaming behaviour -----------------------------------------------------------------


def test_only_a_possible_marker_prefix_is_held_back():
    parser = OutputParser(tools=TOOLS)
    assert parser.feed("a <b").content == "a <b"  # "<b" cannot become a marker
    assert parser.feed(" x <too").content == " x"  # "<too" could be "<tool_call>"
    assert parser.feed("k").content == " <took"
    assert parser.feed(" `").content == ""  # could open ```tool_code
    assert parser.feed("`x").content == " ``x"
    assert parser.feed("<thi").content == ""
    assert parser.feed("s>").content == "<this>"
    assert parser.finish().content == ""


def test_reasoning_streams_and_holds_only_the_end_marker_prefix():
    parser = OutputParser(starts_in_reasoning=True)
    assert parser.feed("first ").reasoning == "first"
    assert parser.feed("second </th").reasoning == " second"
    delta = parser.feed("ink>\n\nAnswer")
    assert (delta.reasoning, delta.content) == ("", "Answer")
    assert parser.finish().content == ""


def test_tool_call_is_emitted_as_soon_as_it_closes():
    parser = OutputParser(tools=TOOLS)
    assert parser.feed("Checking. " + HERMES_PARIS[:-1]).tool_calls == []
    assert not parser.saw_tool_calls
    delta = parser.feed(">")
    assert [(c.name, json.loads(c.arguments), c.index) for c in delta.tool_calls] == [
        (*WEATHER_PARIS, 0)
    ]
    assert parser.saw_tool_calls
    assert parser.feed("\n" + HERMES_ROME).tool_calls[0].index == 1
    final = parser.finish()
    assert (final.content, final.tool_calls, final.malformed_tool_call) == ("", [], False)
    assert parser.content == "Checking."


def test_arguments_are_json_text_encoded_once():
    text = (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Zürich\\"}"}</tool_call>'
    )
    (call,) = run(text, "whole").calls
    assert call.arguments == '{"city": "Zürich"}'
    assert json.loads(call.arguments) == {"city": "Zürich"}

    text = '<tool_call>{"name": "configure", "arguments": {"options": {"k": "v"}}}</tool_call>'
    (call,) = run(text, "whole").calls
    assert json.loads(call.arguments) == {"options": {"k": "v"}}  # an object, not a string


def test_custom_think_markers():
    text = "<|channel>thought plan<channel|>Result <think>kept</think>"
    result = run(text, "char", think_markers=("<|channel>thought", "<channel|>"))
    assert (result.content, result.reasoning) == ("Result <think>kept</think>", "plan")


def test_finish_is_final():
    parser = OutputParser()
    parser.feed("<tool_call>{")
    first = parser.finish()
    assert first.malformed_tool_call and first.content == "<tool_call>{"
    again = parser.finish()
    assert (again.content, again.malformed_tool_call) == ("", True)
    assert parser.feed("more") == Delta()


# --- the tokenizer's own markers and mlx-lm's tool parsers ----------------------------------


def test_think_markers_from_tokenizer(tiny_tok, smol_tok):
    tiny, smol = ChatMarkup.of(tiny_tok), ChatMarkup.of(smol_tok)
    assert (tiny.think_start, tiny.think_end, tiny.thinks) == ("<think>", "</think>", True)
    assert not smol.thinks  # SmolLM2 does not think: the default markers apply
    assert (smol.think_start, smol.think_end) == ("<think>", "</think>")
    assert not ChatMarkup.of(None).thinks
    assert (tiny_tok.has_tool_calling, smol_tok.has_tool_calling) == (True, False)


@pytest.mark.parametrize("mode", ["token", "char"])
def test_tiny_tokenizer_json_tools_parser_is_used(tiny_tok, monkeypatch, mode):
    """The tiny template names <tool_call> and tool_call.name, so mlx-lm picks json_tools."""
    assert tiny_tok.tool_parser.__module__ == "mlx_lm.tool_parsers.json_tools"
    seen = []
    parse = tiny_tok.tool_parser

    def spy(text, tools=None):
        seen.append(text)
        return parse(text, tools)

    monkeypatch.setattr(tiny_tok, "_tool_parser", spy)
    text = "<think>\nweather\n</think>\n\nOn it.\n" + HERMES_PARIS + "\n" + HERMES_ROME
    result = run(text, mode, tiny_tok, parser_tokenizer=tiny_tok)
    check_case(result, "On it.", "weather", [WEATHER_PARIS, ("get_weather", {"city": "Rome"})])
    assert [json.loads(s)["arguments"]["city"] for s in seen] == ["Paris", "Rome"]


def test_tokenizer_parser_falls_back_to_qwen_xml(tiny_tok):
    """json_tools cannot read Qwen XML inside <tool_call>; our parser still does."""
    result = run("x\n" + XML_TYPED, "token", tiny_tok, parser_tokenizer=tiny_tok)
    check_case(result, "x", "", [("configure", XML_TYPED_ARGS)])


def test_tokenizer_parser_replaces_our_formats(tiny_tok):
    """With a tokenizer-chosen format, a tool_code fence is just text."""
    text = '```tool_code\nget_weather("Paris")\n```'
    check_case(run(text, "token", tiny_tok, parser_tokenizer=tiny_tok), text, "", [])


@pytest.mark.parametrize("mode", ["token", "char"])
def test_mlx_lm_pythonic_parser(tiny_dir, tmp_path, mode):
    tok = tokenizer_with_parser(tiny_dir, tmp_path, "pythonic")
    assert tok.tool_call_start == "<|tool_call_start|>"
    text = (
        'Checking both.<|tool_call_start|>[get_weather(city="Paris", days=3), '
        'get_weather(city="Rome")]<|tool_call_end|>'
    )
    result = run(text, mode, tok, parser_tokenizer=tok)
    check_case(result, "Checking both.", "", [WEATHER_PARIS, ("get_weather", {"city": "Rome"})])

    text = 'Hm <|tool_call_start|>[get_weather(city="Par'
    check_case(run(text, mode, tok, parser_tokenizer=tok), text, "", [], malformed=True)
    text = "<|tool_call_start|>[launch(when=1)]<|tool_call_end|>"
    check_case(run(text, mode, tok, parser_tokenizer=tok), "", "", [], unknown=["launch"])


def test_mlx_lm_mistral_parser_without_end_marker(tiny_dir, tmp_path):
    tok = tokenizer_with_parser(tiny_dir, tmp_path, "mistral")
    assert (tok.tool_call_start, tok.tool_call_end) == ("[TOOL_CALLS]", "")
    text = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'
    parser = OutputParser(ChatMarkup.of(tok), tools=TOOLS)
    deltas = [parser.feed(c) for c in text]
    assert not parser.saw_tool_calls  # no end marker: the call ends with the generation
    check_case(collect(parser, deltas), "Sure.", "", [WEATHER_PARIS])


@pytest.mark.parametrize("mode", ["token", "char"])
def test_mlx_lm_qwen3_coder_parser(tiny_dir, tmp_path, mode):
    tok = tokenizer_with_parser(tiny_dir, tmp_path, "qwen3_coder")
    text = "<think>\nconfigure it\n</think>\n\n" + XML_TYPED
    result = run(text, mode, tok, parser_tokenizer=tok)
    check_case(result, "", "configure it", [("configure", XML_TYPED_ARGS)])


def test_tool_call_marker_is_the_models_own(tiny_tok, smol_tok, tiny_dir, tmp_path):
    assert ChatMarkup.of(tiny_tok).tool_call_start == "<tool_call>"  # mlx-lm's json_tools
    pythonic = tokenizer_with_parser(tiny_dir, tmp_path, "pythonic")
    assert ChatMarkup.of(pythonic).tool_call_start == "<|tool_call_start|>"
    assert ChatMarkup.of(smol_tok).tool_call_start is None  # SmolLM2 writes no tool calls


def test_forced_call_that_does_not_parse_is_content_with_its_marker():
    result = run("{x", "char", opens_tool_call="<tool_call>")
    check_case(result, "<tool_call>{x", "", [], malformed=True)


def test_forced_call_closes_a_think_block_the_template_opened(tiny_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] += "{%- if add_generation_prompt %}<think>\n{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path)
    asked = GenerationRequest(
        messages=(Message(role="user", content="Weather in Paris?"),), tools=tools_of(TOOLS)
    )
    free = render_prompt(tokenizer, replace(asked, tool_choice="auto"))
    assert free.text.endswith("assistant\n<think>\n") and not free.opens_tool_call
    forced = render_prompt(tokenizer, replace(asked, tool_choice="required"))
    assert forced.text == free.text + "</think>\n\n<tool_call>\n"
    assert forced.opens_tool_call == "<tool_call>"
