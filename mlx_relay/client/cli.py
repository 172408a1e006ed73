"""Client commands: `chat`, `generate`, `status`, `load`, `free`.

Every failure is one line on stderr (through `errors.run_command`): a refused request
with its status and reason, a cluster that cannot be reached with why (nothing
listening, TLS, token). Ctrl-C cancels the request on the cluster and ends quietly.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import grpc

from mlx_relay.client.client import (
    Client,
    chat_request,
    response_json,
    status_json,
    wait_serving,
)
from mlx_relay.errors import CommandFailed, UserError
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.protocol.aggregate import aggregate
from mlx_relay.protocol.rpc import AUTH_TOKEN_ENV, DEFAULT_GRPC_ADDRESS


def _connection_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_GRPC_ADDRESS, help="rank 0's gRPC address")
    p.add_argument(
        "--auth-token",
        default=None,
        help=f"bearer token (default: ${AUTH_TOKEN_ENV}; prefer the variable, `ps` shows options)",
    )
    p.add_argument("--tls-ca", default=None, help="PEM file to verify a TLS server with")


def _client(args: argparse.Namespace, timeout: float | None = None) -> Client:
    try:
        return Client(args.address, timeout=timeout, token=args.auth_token, tls_ca=args.tls_ca)
    except OSError as e:
        raise UserError(f"--tls-ca {args.tls_ca}: {e.strerror or e}") from None


@contextmanager
def _explained(client: Client) -> Iterator[None]:
    """A failed RPC becomes one line saying what is wrong (CommandFailed)."""
    try:
        yield
    except grpc.RpcError as e:
        raise CommandFailed(client.explain(e)) from None


def _check_utf8(args: argparse.Namespace) -> None:
    """Arguments the terminal passed as bytes that are not UTF-8 (Python keeps them as
    lone surrogates) cannot be sent; say which one, rather than fail deep in protobuf."""
    for name, value in vars(args).items():
        for text in value if isinstance(value, list) else [value]:
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raw = text.encode("utf-8", "surrogateescape")[e.start : e.start + 1]
                where = name.replace("_", "-") if name not in ("message", "prompt") else name
                raise UserError(
                    f"the {where} is not valid UTF-8 (byte 0x{raw.hex()} at position "
                    f"{e.start}): check the terminal's encoding (LANG, LC_ALL)"
                ) from None


def _sampling_options(p: argparse.ArgumentParser) -> None:
    _connection_options(p)
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    p.add_argument("--xtc-probability", type=float, default=0.0)
    p.add_argument("--xtc-threshold", type=float, default=0.0, help="(server default 0.1)")
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument(
        "--repetition-context-size",
        type=int,
        default=0,
        help="tokens the repetition penalty looks back over (server default 20)",
    )
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        type=_logit_bias,
        metavar="ID=BIAS",
        help="add BIAS to token ID's logit (repeatable)",
    )
    p.add_argument("--logprobs", action="store_true", help="log-probability of each token")
    p.add_argument("--top-logprobs", type=int, default=0, metavar="N", help="and the N likeliest")
    p.add_argument(
        "--tool-choice",
        default="",
        help="auto, none (no tool-call parsing), required or a tool name (forces a call)",
    )
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    shape.add_argument(
        "--json-schema", metavar="FILE", help="the output is JSON valid against this JSON Schema"
    )
    shape.add_argument("--grammar", metavar="FILE", help="the output follows this GBNF grammar")


def _read(option: str, path: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{option} {path}: {getattr(e, 'strerror', None) or e}") from None


def structured_output(args: argparse.Namespace) -> dict[str, str]:
    """The request fields of --json-object, --json-schema FILE or --grammar FILE."""
    if args.grammar:
        return {"grammar": _read("--grammar", args.grammar)}
    if args.json_object:
        return {"response_format_json": json.dumps({"type": "json_object"})}
    if not args.json_schema:
        return {}
    try:
        schema = json.loads(_read("--json-schema", args.json_schema))
    except ValueError as e:
        raise UserError(f"--json-schema {args.json_schema}: not valid JSON: {e}") from None
    spec = {"name": Path(args.json_schema).stem, "schema": schema, "strict": True}
    return {"response_format_json": json.dumps({"type": "json_schema", "json_schema": spec})}


def _logit_bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS, e.g. 42=-5.0, got {text!r}") from None


def _chat_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tools", metavar="FILE", help="JSON list of tool definitions (OpenAI shape)")
    p.add_argument(
        "--chat-template-kwargs",
        default="",
        metavar="JSON",
        help="JSON object for the chat template, e.g. '{\"enable_thinking\": false}'",
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="send one chat message to a cluster")
    chat.add_argument("message")
    chat.add_argument("--system", default="", help="system message")
    _sampling_options(chat)
    _chat_options(chat)
    chat.set_defaults(func=run_chat)

    gen = sub.add_parser("generate", help="complete a raw prompt (no chat template)")
    gen.add_argument("prompt")
    _sampling_options(gen)
    gen.set_defaults(func=run_generate)

    status = sub.add_parser("status", help="print a cluster's status as JSON")
    _connection_options(status)
    status.add_argument("--wait", type=float, default=0.0, help="wait up to SECONDS for SERVING")
    status.set_defaults(func=run_status)

    load = sub.add_parser(
        "load", help="load a model on every rank (again, after `free`), without a restart"
    )
    _connection_options(load)
    load.add_argument(
        "--model",
        default="",
        help="'default' or a path present on every rank (default: the model loaded last)",
    )
    load.add_argument(
        "--layers",
        default="",
        help="layers per rank, e.g. 10,12,8, or auto or balanced (default: as last loaded "
        "when --model is not given, else balanced)",
    )
    load.add_argument("--timeout", type=float, default=None, help="seconds before giving up")
    load.set_defaults(func=run_load)

    free = sub.add_parser("free", help="free the model on every rank")
    _connection_options(free)
    free.add_argument("--shutdown", action="store_true", help="then stop every rank")
    free.set_defaults(func=run_free)


def sampling_params(args: argparse.Namespace) -> pb.SamplingParams:
    params = pb.SamplingParams(
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        ignore_eos=args.ignore_eos,
        stop=args.stop,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        repetition_context_size=args.repetition_context_size,
        logit_bias=dict(args.logit_bias),
        logprobs=args.logprobs,
        top_logprobs=args.top_logprobs,
    )
    if args.max_tokens is not None:
        params.max_tokens = args.max_tokens
    if args.temperature is not None:
        params.temperature = args.temperature
    if args.seed is not None:
        params.seed = args.seed
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        if getattr(args, name) is not None:
            setattr(params, name, getattr(args, name))
    return params


def _run(args: argparse.Namespace, request: pb.GenerateRequest) -> int:
    with _client(args, args.timeout) as client, _explained(client):
        if args.stream:
            response = _stream(client, request, sys.stderr if args.json else sys.stdout)
            if not args.json:
                print()
        else:
            response = _generate(client, request)
    if args.json:
        print(json.dumps(response_json(response), ensure_ascii=False))
    elif not args.stream:
        print(response.text)
    if not args.json:
        for call in response.tool_calls:
            print(f"[tool call] {call.function.name} {call.function.arguments}")
    return 0


def _stream(client: Client, request: pb.GenerateRequest, out: TextIO) -> pb.GenerateResponse:
    """Print text as it comes; Ctrl-C cancels the request on the cluster."""
    call = client.stream(request)
    chunks = []
    try:
        for chunk in call:
            chunks.append(chunk)
            print(chunk.text, end="", file=out, flush=True)
    except KeyboardInterrupt:
        call.cancel()
        raise
    return aggregate(chunks)


def _generate(client: Client, request: pb.GenerateRequest) -> pb.GenerateResponse:
    """One response; Ctrl-C cancels the request on the cluster."""
    call = client.stub.Generate.future(request, timeout=client.timeout)
    try:
        return call.result()
    except KeyboardInterrupt:
        call.cancel()
        raise


def run_chat(args: argparse.Namespace) -> int:
    _check_utf8(args)
    tools_json = ""
    if args.tools:
        try:
            tools_json = Path(args.tools).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--tools {args.tools}: {getattr(e, 'strerror', None) or e}") from None
    request = chat_request(
        args.message,
        system=args.system,
        params=sampling_params(args),
        tools_json=tools_json,
        tool_choice=args.tool_choice,
        chat_template_kwargs_json=args.chat_template_kwargs,
        **structured_output(args),
    )
    return _run(args, request)


def run_generate(args: argparse.Namespace) -> int:
    _check_utf8(args)
    request = pb.GenerateRequest(
        prompt=args.prompt,
        params=sampling_params(args),
        tool_choice=args.tool_choice,
        **structured_output(args),
    )
    return _run(args, request)


def run_status(args: argparse.Namespace) -> int:
    if args.wait > 0:
        wait_serving(args.address, args.wait, token=args.auth_token, tls_ca=args.tls_ca)
    with _client(args) as client, _explained(client):
        print(status_json(client.status()))
    return 0


def run_load(args: argparse.Namespace) -> int:
    request = pb.LoadModelRequest(model=args.model, layers=args.layers)
    with _client(args) as client, _explained(client):
        status = client.stub.LoadModel(request, timeout=args.timeout).status
    ranges = ", ".join(f"[{r.layer_start}, {r.layer_end})" for r in status.ranks)
    layout = status.layout
    split = ""
    if layout.tensor_parallel > 1:
        across = (
            f"its stage's {layout.tensor_parallel}" if layout.stages > 1 else layout.tensor_parallel
        )
        stages = f", {layout.stages} stages," if layout.stages > 1 else ","
        split = f"{stages} every layer split across {across}"
    note = f" ({layout.note})" if layout.note else ""
    print(
        f"serving {status.model_path} on {status.world_size} rank(s), layers {ranges}{split}{note}"
    )
    return 0


def run_free(args: argparse.Namespace) -> int:
    with _client(args) as client, _explained(client):
        reply = client.stub.Free(pb.FreeRequest(shutdown=args.shutdown), timeout=60)
    hint = "" if args.shutdown else " (`mlx-relay load` loads it again)"
    print(reply.message + hint)
    return 0
