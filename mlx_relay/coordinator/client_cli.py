"""Client commands: `chat`, `generate`, `status`, `free`."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from mlx_relay.coordinator.aggregate import aggregate
from mlx_relay.coordinator.client import (
    Client,
    chat_request,
    response_json,
    status_json,
    wait_serving,
)
from mlx_relay.launch.serve import DEFAULT_GRPC_ADDRESS
from mlx_relay.protocol import relay_pb2 as pb


def _sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_GRPC_ADDRESS, help="rank 0's gRPC address")
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


def add_parsers(sub: argparse._SubParsersAction) -> None:
    chat = sub.add_parser("chat", help="send one chat message to a cluster")
    chat.add_argument("message")
    chat.add_argument("--system", default="", help="system message")
    _sampling_options(chat)
    chat.set_defaults(func=run_chat)

    gen = sub.add_parser("generate", help="complete a raw prompt (no chat template)")
    gen.add_argument("prompt")
    _sampling_options(gen)
    gen.set_defaults(func=run_generate)

    status = sub.add_parser("status", help="print a cluster's status as JSON")
    status.add_argument("--address", default=DEFAULT_GRPC_ADDRESS)
    status.add_argument("--wait", type=float, default=0.0, help="wait up to SECONDS for SERVING")
    status.set_defaults(func=run_status)

    free = sub.add_parser("free", help="free the model on every rank")
    free.add_argument("--address", default=DEFAULT_GRPC_ADDRESS)
    free.add_argument("--shutdown", action="store_true", help="then stop every rank")
    free.set_defaults(func=run_free)


def sampling_params(args: argparse.Namespace) -> pb.SamplingParams:
    params = pb.SamplingParams(
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        ignore_eos=args.ignore_eos,
        stop=args.stop,
    )
    if args.max_tokens is not None:
        params.max_tokens = args.max_tokens
    if args.temperature is not None:
        params.temperature = args.temperature
    if args.seed is not None:
        params.seed = args.seed
    return params


def _run(args: argparse.Namespace, request: pb.GenerateRequest) -> int:
    with Client(args.address, timeout=args.timeout) as client:
        try:
            if args.stream:
                chunks = []
                for chunk in client.stream(request):
                    chunks.append(chunk)
                    out = sys.stderr if args.json else sys.stdout
                    print(chunk.text, end="", file=out, flush=True)
                if not args.json:
                    print()
                response = aggregate(chunks)
            else:
                response = client.generate(request)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(response_json(response), ensure_ascii=False))
    elif not args.stream:
        print(response.text)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    return _run(args, chat_request(args.message, system=args.system, params=sampling_params(args)))


def run_generate(args: argparse.Namespace) -> int:
    return _run(args, pb.GenerateRequest(prompt=args.prompt, params=sampling_params(args)))


def run_status(args: argparse.Namespace) -> int:
    if args.wait > 0:
        try:
            wait_serving(args.address, args.wait)
        except TimeoutError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    with Client(args.address) as client:
        try:
            print(status_json(client.status()))
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def run_free(args: argparse.Namespace) -> int:
    with Client(args.address) as client:
        try:
            reply = client.stub.Free(pb.FreeRequest(shutdown=args.shutdown), timeout=60)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(reply.message)
    return 0
