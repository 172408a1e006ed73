"""From a typed request to token ids, or a clear refusal.

Everything a client can get wrong in its prompt (messages, tools, tool_choice, template
kwargs, images) is checked here, as `generation.check_sampling` checks its sampling
options, before the request reaches the engine, and reported as `InvalidRequest`
naming the field; each door maps that to its own error shape. Prompts are rendered
and encoded exactly as mlx-lm does, so a request here and `mlx_lm.stream_generate`
on the same text see the same tokens. `json_field` and `logit_bias` are the helpers
the doors' adapters share for what their wire formats spell as JSON text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mlx_relay.coordinator import image_keys
from mlx_relay.coordinator.generation import GenerationRequest, Message
from mlx_relay.errors import InvalidRequest, json_field
from mlx_relay.model import vision
from mlx_relay.text import tool_prompt
from mlx_relay.text.markup import ChatMarkup
from mlx_relay.text.tool_calls import hermes

__all__ = ["InvalidRequest", "Prompt", "encode_images", "json_field", "logit_bias"]

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class Prompt:
    text: str
    token_ids: list[int]
    tools: list[dict] | None = None
    tool_choice: str = "auto"
    opens_tool_call: str = ""  # the tool-call marker the prompt ends with, if forced
    # The tools went into the system prompt (tool_prompt), the template having no place
    # for them: calls are Hermes `<tool_call>` JSON whatever the model's own markup.
    tool_fallback: bool = False
    images: list[bytes] = field(default_factory=list)  # image files, in the order shown
    pixel_values: Any = None  # the images preprocessed (encode_images), for rank 0
    cache_tokens: list[int] | None = None  # token_ids keyed by the images (image_keys.py)


def logit_bias(value: dict[Any, Any], name: str = "logit_bias") -> dict[int, float]:
    """OpenAI's `logit_bias` (token ids as JSON object keys, so strings) as token id ->
    bias; InvalidRequest naming `name` for a key that is not a token id or a bias that is
    not a number. (Ranges are checked with the other sampling fields: sampling_params.)"""
    out = {}
    for token, bias in value.items():
        try:
            out[int(token)] = float(bias)
        except (TypeError, ValueError) as e:
            raise InvalidRequest(
                f'{name} must map token ids to numbers, e.g. {{"123": -100}}; got '
                f"{token!r}: {bias!r}"
            ) from e
    return out


def _message_dict(i: int, m: Message) -> dict[str, Any]:
    if m.role not in ROLES:
        raise InvalidRequest(f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
    out["content"] = m.content
    if m.images:  # OpenAI-style parts in the client's order, as vision templates read them
        try:
            out["content"] = vision.content_parts(m.content, len(m.images), list(m.image_offsets))
        except vision.VisionError as e:
            raise InvalidRequest(f"messages[{i}].{e}") from e
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": c.type or "function",
                "function": {"name": c.name, "arguments": _tool_arguments(i, c.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _tool_arguments(i: int, raw: str) -> Any:
    """Chat templates iterate over arguments as a mapping; JSON text becomes one."""
    try:
        return json.loads(raw) if raw else {}
    except ValueError as e:
        raise InvalidRequest(f"messages[{i}].tool_calls arguments are not valid JSON: {e}") from e


def chat_messages(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    return [_message_dict(i, m) for i, m in enumerate(messages)]


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """mlx-lm's rule: add special tokens unless the text already starts with BOS."""
    bos = tokenizer.bos_token
    add_special = bos is None or not text.startswith(bos)
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def render_prompt(
    tokenizer: Any,
    request: GenerationRequest,
    *,
    markup: ChatMarkup | None = None,
    tool_fallback: bool = True,
) -> Prompt:
    """The prompt text and tokens of a request.

    ``tool_choice`` 'required' or a tool's name forces a call the way the model itself
    writes one: the prompt ends with the model's tool-call marker (after closing a think
    block the template opened), and for a named tool only that tool is shown.
    ``markup``: the model's, resolved when it was loaded (None: resolved here).
    ``tool_fallback``: where the chat template ignores tools, write them into the system
    prompt (`tool_prompt`) instead of refusing the request.
    """
    prompt, messages = request.prompt, request.messages
    if isinstance(prompt, bytes):
        try:
            prompt = prompt.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequest(f"prompt is not valid UTF-8 ({e.reason} at byte {e.start})") from e
    if prompt and messages:
        raise InvalidRequest("give either prompt or messages, not both")
    # Checked for raw prompts too: there the tools still name what the parser accepts.
    for i, tool in enumerate(request.tools):
        if not tool.name:
            raise InvalidRequest(f"tools[{i}] has no function name")
    tools = [dict(t.definition) for t in request.tools] or None
    kwargs = dict(request.chat_template_kwargs)
    choice = parse_tool_choice(request.tool_choice, tools)
    forced = choice not in ("auto", "none")
    named = forced and choice != "required"
    opens_tool_call = ""
    fallback = False
    if messages:
        dicts = chat_messages(messages)
        shown = [t for t in tools if _tool_name(t) == choice] if named else tools
        text = _render(tokenizer, dicts, shown, kwargs)
        if tools and text == _render(tokenizer, dicts, None, kwargs):
            if not tool_fallback:
                raise InvalidRequest(
                    "tools were given but this model's chat template ignores tool "
                    "definitions; the model would never see them (this server runs with "
                    "--no-tool-fallback, which refuses them instead of writing them into "
                    "the system prompt)"
                )
            text = _render(tokenizer, tool_prompt.with_tools(dicts, shown), None, kwargs)
            fallback = True
        if forced:
            markup = markup or ChatMarkup.of(tokenizer)
            text, opens_tool_call = _open_tool_call(markup, text, choice, fallback)
    elif prompt:
        if forced:
            raise InvalidRequest(f"tool_choice {choice!r} needs chat messages, not a raw prompt")
        text = prompt
    else:
        raise InvalidRequest("the request has neither a prompt nor messages")
    token_ids = encode_text(tokenizer, text)
    if not token_ids:
        raise InvalidRequest("the prompt encodes to no tokens")
    # A named tool is the only one shown, and the only one the parser accepts.
    accepted = [t for t in tools if _tool_name(t) == choice] if named else tools
    images = [image for m in messages for image in m.images]
    return Prompt(text, token_ids, accepted, choice, opens_tool_call, fallback, images)


def _open_tool_call(
    markup: ChatMarkup, text: str, choice: str, fallback: bool = False
) -> tuple[str, str]:
    """The prompt ending in the marker that opens a call, and that marker. `fallback`:
    the prompt taught the model Hermes calls (tool_prompt), whatever its own markup."""
    if fallback:
        start, opening = hermes.tool_call_start, hermes.tool_call_start + "\n"
    elif markup.tool_call_start is None:
        raise InvalidRequest(
            f"tool_choice {choice!r} cannot be enforced: this model's chat template has no "
            "tool-call markup to start a call with; use 'auto'"
        )
    else:
        start, opening = markup.tool_call_start, markup.tool_call_opening
    if markup.opens_think(text):
        text = text + markup.think_end + "\n\n"
    return text + opening, start


def _tool_name(tool: dict) -> str:
    function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    name = function.get("name")
    return name if isinstance(name, str) else ""


def _render(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None, kwargs: dict[str, Any]
) -> str:
    """Apply the chat template; merge same-role neighbours if the template wants alternation."""
    extra = {**kwargs, "tools": tools} if tools else kwargs
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )
    except Exception as e:  # noqa: BLE001 - template errors are the client's input
        merged = merge_same_roles(messages)
        if "alternat" in str(e).lower() and len(merged) < len(messages):
            return _render(tokenizer, merged, tools, kwargs)
        raise InvalidRequest(f"the model's chat template refused these messages: {e}") from e


def merge_same_roles(messages: list[dict]) -> list[dict]:
    """Join consecutive messages of the same role (plain text ones) into one."""
    out: list[dict] = []
    for m in messages:
        prev = out[-1] if out else None
        if (
            prev is not None
            and prev["role"] == m["role"]
            and set(prev) == set(m) == {"role", "content"}
            and isinstance(prev["content"], str)
            and isinstance(m["content"], str)
        ):
            out[-1] = {"role": m["role"], "content": f"{prev['content']}\n\n{m['content']}"}
        else:
            out.append(dict(m))
    return out


def parse_tool_choice(raw: str | Mapping[str, Any], tools: list[dict] | None) -> str:
    """'auto', 'none', 'required', or the name of one of the request's tools (`raw` may
    be OpenAI's object naming one, or that object as JSON text)."""
    value = raw if isinstance(raw, Mapping) else None
    choice = raw.strip() if isinstance(raw, str) else ""
    if choice.startswith("{"):
        value = json_field(choice, "tool_choice", dict)
    if value is not None:
        choice = _tool_name(dict(value)) if value.get("type", "function") == "function" else ""
        if not choice:
            raise InvalidRequest("tool_choice object must name a function")
    if choice in ("", "auto", "none"):
        return choice or "auto"
    if choice == "required" and not tools:
        raise InvalidRequest("tool_choice 'required' needs tools")
    if choice == "required":
        return choice
    names = [_tool_name(t) for t in tools or []]
    if choice not in names:
        raise InvalidRequest(
            f"tool_choice {choice!r} is not 'auto', 'none', 'required' or one of the tools "
            f"given ({', '.join(names) or 'none given'})"
        )
    return choice


def encode_images(prompt: Prompt, model_path: str | None, config: dict[str, Any]) -> None:
    """Expand the image placeholders of `prompt.token_ids` and preprocess its images
    (`prompt.pixel_values`) with the model's own (mlx-vlm) processor. A model that
    takes no images, or an image that is not one, is the client's error."""
    if not vision.is_vlm(config) or model_path is None:
        family = config.get("model_type", "unknown")
        supported = ", ".join(vision.VLM_FAMILIES)
        raise InvalidRequest(
            f"the request has {len(prompt.images)} image(s), but the loaded model "
            f"({family}) reads text only; images need a vision-language model ({supported})"
        )
    try:
        encoded = vision.processor_for(str(model_path)).encode(prompt.text, prompt.images)
    except vision.VisionError as e:
        raise InvalidRequest(str(e)) from e
    image_id = vision.image_token_id(config)
    placed = sum(1 for t in encoded.token_ids if t == image_id)
    if not placed:
        raise InvalidRequest(
            "the model's chat template put no image placeholder in the prompt, so the "
            "images would not be seen"
        )
    prompt.token_ids = encoded.token_ids
    prompt.pixel_values = encoded.pixel_values
    prompt.cache_tokens = image_keys.keyed(encoded.token_ids, image_id, prompt.images)
