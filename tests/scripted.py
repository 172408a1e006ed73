"""The scripted model: a tiny llama whose weights make greedy decoding spell out a fixed
text after a given token (a bigram table), so reasoning, content and tool-call markup come
out exactly as written, and the chat and raw prompts the tests script it for."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_tokenizer

# The chat the scripted tests send, and the tool they offer.
MESSAGES = [{"role": "user", "content": "Tell me about the weather in Paris today."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

# What greedy decoding writes after a chat prompt (which ends in "\n") and after the raw
# prompt "Q". Argument-less calls, because a bigram model cannot repeat a token and this
# vocabulary has only six tokens holding a double quote.
CHAT_SCRIPT = [
    "<think>",
    "Weather?",
    "</think>",
    "OK",
    '<tool_call>{"name": "get_weather"}</tool_call>',
]
RAW_PROMPT = "Q"
RAW_SCRIPT = ["<tool_call>{x"]  # never closed, never JSON: malformed


def _segment(pieces: dict[int, str], text: str, used: set[int]) -> list[int]:
    """Token ids spelling `text`, none in `used` and none twice (longest pieces first)."""

    def search(pos: int, chosen: list[int]) -> list[int] | None:
        if pos == len(text):
            return chosen
        fits = [i for i, s in pieces.items() if text.startswith(s, pos)]
        for i in sorted(fits, key=lambda i: (-len(pieces[i]), i)):
            if i not in used and i not in chosen:
                found = search(pos + len(pieces[i]), [*chosen, i])
                if found is not None:
                    return found
        return None

    found = search(0, [])
    assert found is not None, f"no distinct tokens spell {text!r}"
    return found


def script_model(path, scripts: dict[int, list[str]]) -> dict[int, list[int]]:
    """Make the tiny llama at `path` continue each start token with its script, then EOS.

    Every layer adds nothing to the residual stream (o_proj and down_proj are zero), so
    the logits depend on the last token alone: a bigram table, embedded one-hot. Returns
    each script's token ids.
    """
    tokenizer = load_tokenizer(path)
    pieces = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    pieces = {i: s for i, s in pieces.items() if s and "\ufffd" not in s}
    eos = tokenizer.eos_token_id
    used = set(scripts) | {eos}
    chains = {}
    for start, parts in scripts.items():
        ids = [i for part in parts for i in _segment(pieces, part, used)]
        assert tokenizer.decode(ids) == "".join(parts)
        used |= set(ids)
        chains[start] = ids
    weights = mx.load(str(path / "model.safetensors"))
    embed = np.zeros(weights["model.embed_tokens.weight"].shape, np.float32)
    head = np.zeros(weights["lm_head.weight"].shape, np.float32)
    pairs = [
        pair
        for start, ids in chains.items()
        for pair in zip([start, *ids], [*ids, eos], strict=True)
    ]
    assert len(pairs) <= embed.shape[1], "scripts too long for the hidden size"
    for dim, (current, following) in enumerate(pairs):
        embed[current, dim] = 1.0
        head[following, dim] = 1.0
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(w)
    weights["model.embed_tokens.weight"] = mx.array(embed)
    weights["lm_head.weight"] = mx.array(head)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return chains
