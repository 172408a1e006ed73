"""Ollama's API: `/api/chat` and `/api/generate` (NDJSON streams, streaming by default),
`/api/tags`, `/api/ps`, `/api/show`, `/api/version`, for chat UIs that speak only Ollama.
A chat without messages (or a generate without a prompt) is Ollama's load ping: it
answers at once, done_reason "load".

`options` map onto the engine's `SamplingParams` (`num_predict` is the request's max_tokens,
`repeat_penalty` repetition_penalty) in the typed `GenerationRequest`; the non-streaming
answer is the stream's chunks folded.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from mlx_relay.api.http.common import (
    Door,
    HttpError,
    Output,
    collect,
    sampling,
    tool_call,
)
from mlx_relay.api.http.schemas import Lenient, dumps
from mlx_relay.coordinator import generation
from mlx_relay.coordinator.generation import GenerationRequest
from mlx_relay.coordinator.output import Chunk
from mlx_relay.coordinator.sampling import SamplingParams
from mlx_relay.model import checkpoint, vision
from mlx_relay.text.postprocess import ToolCall as CallOut
from mlx_relay.text.tool_partial import json_prefix_object

API = "ollama"


def error_body(e: HttpError) -> dict[str, Any]:
    return {"error": str(e)}


class Options(Lenient):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: list[str] | str | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def max_tokens(self) -> int | None:
        """num_predict; -1 (Ollama's "no limit") or 0 leave it to the server."""
        return self.num_predict if self.num_predict and self.num_predict > 0 else None

    def params(self) -> SamplingParams:
        return sampling(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            repetition_penalty=self.repeat_penalty,
            repetition_context_size=self.repeat_last_n
            if self.repeat_last_n and self.repeat_last_n > 0
            else None,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )


class Function(Lenient):
    name: str
    arguments: dict[str, Any] | str = {}


class ToolCall(Lenient):
    function: Function


class Message(Lenient):
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    thinking: str | None = None
    tool_name: str | None = None


class Common(Lenient):
    model: str
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    think: bool | None = None
    cache_salt: str | None = None  # vLLM's, not Ollama's: no cached prefix shared across salts

    def response_format(self) -> dict[str, Any] | None:
        if not self.format:
            return None
        if self.format == "json":
            return {"type": "json_object"}
        if isinstance(self.format, dict):
            return {"type": "json_schema", "json_schema": {"name": "output", "schema": self.format}}
        raise HttpError("invalid", f"format {self.format!r} is not 'json' or a JSON schema")

    def kwargs(self) -> dict[str, Any]:
        return {"enable_thinking": self.think} if self.think is not None else {}

    def request(self, **fields: Any) -> GenerationRequest:
        """The typed request: `fields` (the prompt or messages, tools) with the options,
        format and think every Ollama request shares."""
        options = self.options or Options()
        return GenerationRequest(
            max_tokens=options.max_tokens(),
            sampling=options.params(),
            chat_template_kwargs=self.kwargs(),
            response_format=self.response_format(),
            cache_salt=self.cache_salt or "",
            **fields,
        )


class ChatRequest(Common):
    messages: list[Message] = []
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(Common):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None


class ShowRequest(Lenient):
    model: str | None = None
    name: str | None = None


def _images(images: list[str] | None, where: str) -> list[bytes]:
    """Ollama's images (base64 strings) as file bytes; they are shown before the text.
    A text-only model refuses them (Cluster.build)."""
    out = []
    for i, data in enumerate(images or []):
        try:
            out.append(vision.b64decode_image(data, f"{where}[{i}]"))
        except vision.VisionError as e:
            raise HttpError("invalid", str(e), where) from None
    return out


def chat_messages(messages: list[Message]) -> tuple[generation.Message, ...]:
    out = []
    for i, m in enumerate(messages):
        out.append(
            generation.Message(
                role=m.role,
                content=m.content,
                images=_images(m.images, f"messages[{i}].images"),
                reasoning=m.thinking or "",
                name=m.tool_name or "",
                tool_calls=tuple(
                    tool_call(c.function.name, c.function.arguments) for c in m.tool_calls or []
                ),
            )
        )
    return tuple(out)


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _final(model: str, whole: Chunk, started: float) -> dict[str, Any]:
    u, t = whole.usage or {}, whole.timings or {}
    total = time.perf_counter() - started
    ttft = t.get("time_to_first_token_s", 0.0)
    return {
        "model": model,
        "created_at": _now(),
        "done": True,
        "done_reason": {"tool_calls": "stop"}.get(whole.finish_reason, whole.finish_reason),
        "total_duration": int(total * 1e9),
        "load_duration": 0,
        "prompt_eval_count": u.get("prompt_tokens", 0),
        "prompt_eval_duration": int(ttft * 1e9),
        "eval_count": u.get("completion_tokens", 0),
        "eval_duration": int(max(total - ttft, 0) * 1e9),
    }


def _message(text: str, reasoning: str, calls: list) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["thinking"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"function": {"name": c.name, "arguments": _arguments(c)}} for c in calls
        ]
    return message


def _arguments(call: CallOut) -> Any:
    """An object, as Ollama sends them: a call cut by the token limit gives what it has."""
    if not call.complete:
        return json_prefix_object(call.arguments)
    try:
        return json.loads(call.arguments or "{}")
    except ValueError:
        return call.arguments


def _piece(chat: bool, model: str, chunk: Chunk) -> dict[str, Any]:
    if chat:
        return {
            "model": model,
            "created_at": _now(),
            "message": _message(chunk.text, chunk.reasoning, chunk.tool_calls),
            "done": False,
        }
    piece = {"model": model, "created_at": _now(), "response": chunk.text, "done": False}
    if chunk.reasoning:
        piece["thinking"] = chunk.reasoning
    return piece


async def _lines(chat: bool, model: str, output: Output, started: float) -> AsyncIterator[str]:
    whole = Chunk()
    try:
        async for chunk in output:
            whole.add(chunk)
            if chunk.text or chunk.reasoning or chunk.tool_calls:
                yield dumps(_piece(chat, model, chunk)) + "\n"
    except HttpError as e:
        yield dumps(error_body(e)) + "\n"
        return
    last = _final(model, whole, started)
    last.update({"message": _message("", "", [])} if chat else {"response": ""})
    yield dumps(last) + "\n"


async def _answer(
    chat: bool, model: str, output: Output, stream: bool, started: float, http: Request
) -> Any:
    if stream:
        return output.response(_lines(chat, model, output, started), "application/x-ndjson")
    whole = await collect(output, http)
    out = _final(model, whole, started)
    if chat:
        out["message"] = _message(whole.text, whole.reasoning, whole.tool_calls)
    else:
        out["response"] = whole.text
        if whole.reasoning:
            out["thinking"] = whole.reasoning
    return out


_DTYPE_BYTES = {"F64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1}


def _config(door: Door) -> dict[str, Any]:
    loaded = door.cluster.loaded
    if loaded is None:
        return {}
    try:
        return json.loads((Path(loaded.path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _details(door: Door) -> dict[str, Any]:
    config = _config(door)
    family = str(config.get("model_type", ""))
    loaded = door.cluster.loaded
    parameters = _parameter_count(Path(loaded.path), config) if loaded else 0
    return {
        "format": "mlx",
        "family": family,
        "families": [family] if family else [],
        "parameter_size": _short_count(parameters),
        "quantization_level": str((config.get("quantization") or {}).get("bits", "")),
        "context_length": int(config.get("max_position_embeddings") or 0),
    }


def _parameter_count(path: Path, config: dict[str, Any]) -> int:
    """The model's parameters, from its safetensors headers: a quantized weight (packed
    in U32) holds 32 / bits of them a word; its scales and biases are not parameters."""
    bits = int((config.get("quantization") or {}).get("bits") or 0)
    total = 0
    for name, tensor in checkpoint.tensors(path).items():
        if bits and name.endswith((".scales", ".biases")):
            continue
        if bits and tensor.dtype == "U32":
            total += tensor.nbytes * 8 // bits
        else:
            total += tensor.nbytes // _DTYPE_BYTES.get(tensor.dtype, 2)
    return total


def _short_count(n: int) -> str:
    """Ollama's way to say a parameter count: '135M', '7.6B'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + unit
    return str(n)


def _entry(door: Door) -> dict[str, Any]:
    """The served model as /api/tags and /api/ps list it: its bytes on disk and a
    digest of its fingerprint (config and weight index: the same model, the same one)."""
    loaded = door.cluster.loaded
    served = door.cluster.model_id()
    details = _details(door)
    details.pop("context_length")
    size = sum(checkpoint.tensor_bytes(Path(loaded.path)).values()) if loaded else 0
    digest = hashlib.sha256((loaded.fingerprint if loaded else "").encode()).hexdigest()
    return {
        "name": served,
        "model": served,
        "modified_at": _now(),
        "size": size,
        "digest": digest,
        "details": details,
    }


def router(door: Door) -> APIRouter:
    r = APIRouter()

    @r.post("/api/chat")
    async def chat(body: ChatRequest, request: Request) -> Any:
        started = time.perf_counter()
        model = door.check_model(body.model)
        if not body.messages:  # Ollama's way to load a model: it is loaded
            return {
                "model": body.model,
                "created_at": _now(),
                "message": {"role": "assistant", "content": ""},
                "done": True,
                "done_reason": "load",
            }
        req = body.request(
            messages=chat_messages(body.messages), tools=generation.tools(body.tools)
        )
        output = await door.generate(req, API)
        return await _answer(True, body.model or model, output, body.stream, started, request)

    @r.post("/api/generate")
    async def generate(body: GenerateRequest, request: Request) -> Any:
        started = time.perf_counter()
        model = door.check_model(body.model)
        images = _images(body.images, "images")
        if images and body.raw:
            raise HttpError(
                "invalid",
                "images need the chat template to place them; a raw prompt cannot carry them",
                "raw",
            )
        if not (body.prompt or body.system or images):  # Ollama's way to load a model: it is loaded
            return {
                "model": body.model,
                "created_at": _now(),
                "response": "",
                "done": True,
                "done_reason": "load",
            }
        if body.raw:  # (the template's kwargs are the template's: none for a raw prompt)
            req = replace(body.request(prompt=body.prompt), chat_template_kwargs={})
        else:
            system = [generation.Message("system", body.system)] if body.system else []
            user = generation.Message("user", body.prompt, images=tuple(images))
            req = body.request(messages=(*system, user))
        output = await door.generate(req, API)
        return await _answer(False, body.model or model, output, body.stream, started, request)

    @r.get("/api/tags")
    async def tags() -> dict[str, Any]:
        if not door.cluster.model_id():
            return {"models": []}
        return {"models": [await run_in_threadpool(_entry, door)]}

    @r.get("/api/ps")
    async def ps() -> dict[str, Any]:
        """The running model: the one served, in memory across the ranks until freed."""
        if not door.cluster.model_id():
            return {"models": []}
        entry = await run_in_threadpool(_entry, door)
        entry.pop("modified_at")
        entry["expires_at"] = "9999-12-31T23:59:59Z"  # never unloaded for idleness
        entry["size_vram"] = entry["size"]
        entry["context_length"] = door.cluster.context_length
        return {"models": [entry]}

    @r.post("/api/show")
    async def show(body: ShowRequest) -> dict[str, Any]:
        door.check_model(body.model or body.name)
        details = _details(door)
        context = details.pop("context_length")
        template = getattr(door.cluster.tokenizer(), "chat_template", None) or ""
        return {
            "modelfile": "",
            "parameters": "",
            "template": template if isinstance(template, str) else "",
            "details": details,
            "model_info": {
                "general.architecture": details["family"],
                f"{details['family']}.context_length": context,
            },
            "capabilities": ["completion", "tools"]
            if door.cluster.tool_fallback or "tool" in str(template)
            else ["completion"],
        }

    @r.get("/")
    async def root() -> PlainTextResponse:
        return PlainTextResponse(
            "mlx-relay is running (Ollama's API under /api, OpenAI's under /v1)"
        )

    @r.get("/api/version")
    async def api_version() -> dict[str, str]:
        try:
            return {"version": version("mlx-relay")}
        except PackageNotFoundError:
            return {"version": "0.0.0"}

    return r
