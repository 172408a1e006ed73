"""Does detokenizing pay to move off the engine thread? The text work of one token there,
against the decode step it would overlap with.

    .venv/bin/python bench/bench_detokenize.py [--model default] [--tokens 256]
        [--rounds 5] [--streams 16] [--step-tokens 32]

Every token rank 0 reads back goes through `OutputProcessor.token` on the engine thread:
the EOS check, the streaming detokenizer, the output parser (reasoning, tool-call
markup, stop strings) and the limits. This times it per token over typical streams of
the model's own tokens: plain prose, prose with two stop strings watched, a reasoning
block then an answer, and a Hermes tool call with the request's tools. It then times a
decode step of the same model with single-process mlx-lm on this machine, for scale
(`--step-tokens 0` leaves it out).
With `--streams S` the text work of S streams (one token each a step) is set against
one step. Off-thread would save at most that share of a step, while a stop string
must still end its sequence before the next step launches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm import load, stream_generate  # noqa: E402
from mlx_lm.utils import load_tokenizer  # noqa: E402

from mlx_relay.coordinator.output import OutputProcessor  # noqa: E402
from mlx_relay.coordinator.sampling import Sampler, SamplingParams  # noqa: E402
from mlx_relay.coordinator.sequence import Request, Sequence  # noqa: E402
from mlx_relay.model.default_model import resolve_model  # noqa: E402
from mlx_relay.text.markup import ChatMarkup  # noqa: E402

PROSE = (
    "The river runs past the old mill, where the miller's children once played on the "
    "stones. In spring the water rises and covers the lowest steps; in summer it falls "
    "back and the moss dries to a pale green. Travellers stop on the bridge to watch the "
    "wheel turn, and some of them ask how old it is. Nobody in the village knows for "
    "certain, but the oldest records speak of a mill on this spot four hundred years ago. "
)
# The one tool the tool-call stream calls, in the OpenAI shape.
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def streams(tokenizer, n: int) -> dict[str, tuple[list[int], dict]]:
    """name -> (the tokens a model would write, the request's fields), each ~n tokens."""

    def ids(text: str) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out += tokenizer.encode(text, add_special_tokens=False)
        return out[:n]

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    half = ids(PROSE)[: n // 2]
    return {
        "prose": (ids(PROSE), {}),
        "prose, 2 stop strings": (ids(PROSE), {"stop": ["\n\nUser:", "THE END"]}),
        "reasoning then answer": (
            tokenizer.encode("<think>\n", add_special_tokens=False)
            + half
            + tokenizer.encode("\n</think>\n\n", add_special_tokens=False)
            + half,
            {},
        ),
        "prose then a tool call": (
            half + tokenizer.encode("\n" + call * 3 + "</tool_call>", add_special_tokens=False),
            {"tools": TOOLS},
        ),
    }


def per_token_us(output: OutputProcessor, markup, tokens: list[int], fields: dict) -> float:
    """Microseconds a token of `OutputProcessor.token` (and the last chunk's finish)."""
    params = SamplingParams(max_tokens=len(tokens) + 1, stop=fields.get("stop", []))
    request = Request(prompt_tokens=[1], params=params, tools=fields.get("tools"))
    seq = Sequence(
        request=request,
        slot=0,
        sampler=Sampler(params),
        text=output.stream(request, markup),
        pending=[],
        context=[1],
    )
    start = time.perf_counter()
    chunk = None
    for token in tokens:
        seq.context.append(token)
        chunk, reason = output.token(seq, token, None)
        if reason:
            break
    output.finish(seq, chunk, "length")
    return (time.perf_counter() - start) / len(tokens) * 1e6


def step_ms(path: Path, tokens: int) -> float:
    """Milliseconds a decode step of single-process mlx-lm (its own generation rate)."""
    model, tokenizer = load(str(path))
    rate = 0.0
    for _ in range(2):  # the first warms up
        for response in stream_generate(model, tokenizer, PROSE, max_tokens=tokens):
            rate = response.generation_tps
    return 1000.0 / rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--step-tokens", type=int, default=32)
    args = p.parse_args()
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    markup = ChatMarkup.of(tokenizer)
    output = OutputProcessor(tokenizer, 0)
    worst = 0.0
    cases = streams(tokenizer, args.tokens)
    for tokens, fields in cases.values():  # warm-up: imports, regexes, caches
        per_token_us(output, markup, tokens, fields)
    for name, (tokens, fields) in cases.items():
        times = [per_token_us(output, markup, tokens, fields) for _ in range(args.rounds)]
        # (the least disturbed round is the cost; the median shows the host's noise)
        least, median = min(times), statistics.median(times)
        worst = max(worst, least)
        print(f"{name:26s} {len(tokens):4d} tokens  {least:7.1f} us a token (median {median:.1f})")
    print(
        f"{args.streams} streams' text work a step, at the slowest stream's rate: "
        f"{worst * args.streams / 1000:.2f} ms"
    )
    if args.step_tokens:
        step = step_ms(path, args.step_tokens)
        print(f"mlx-lm decode step        {step:7.2f} ms ({1000 / step:.1f} tok/s)")
        print(f"one stream's text work: {worst / (step * 1000):.2%} of its step")


if __name__ == "__main__":
    main()
