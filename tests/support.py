"""Helpers the test files share (a test file is never imported by another as a library).

`Served`: a running cluster with its HTTP doors and the SDK clients pointed at them.
`greedy`: the gRPC door's greedy answer to a chat, the value an HTTP door or a client
must give back for the same request (the server's default sampling is greedy).
`stream_started`, `error_of`, `assert_names`: a long stream under way, the error that
ends it, and that error naming the rank at fault (the failure tests').
`meanwhile`: a cluster's part of a test on a thread while the oracle computes.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from contextlib import contextmanager
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest

from mlx_relay.protocol import relay_pb2 as pb


class Served:
    """A cluster (`running`, a conftest.RunningCluster) serving `path` with its HTTP doors
    on `port`; `chat_ids`: the token ids a scripted model answers a chat with ([] if none)."""

    def __init__(self, running, path, chat_ids, port) -> None:
        self.running = running
        self.path = path
        self.model = str(path)
        self.chat_ids = chat_ids
        self.base = f"http://127.0.0.1:{port}"
        self.openai = openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0)
        self.anthropic = anthropic.Anthropic(base_url=self.base, api_key="none", max_retries=0)
        self.http = httpx.Client(base_url=self.base, timeout=60)


@contextmanager
def meanwhile(work: Callable[[], Any], deadline: float = 900) -> Iterator[Future]:
    """`work()` on a thread of its own while the `with` block runs (`.result()` is what
    it returned, or raises what it raised), for a test to compute mlx-lm's answer on its
    own thread meanwhile: a cluster starting and answering one stream keeps about one of
    the machine's two cores busy, and the default model's mlx-lm answer takes ~25 s of
    the other for 200 tokens. The block's end waits for `work` (up to `deadline`
    seconds), even when the block failed, so a cluster it started is in its fixture's
    list before the fixture's teardown stops them. The thread must not run MLX: MLX
    state made on a thread that is not the main one aborts the process at exit
    ("terminate called without an active exception")."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as e:  # noqa: BLE001 - handed to the caller's .result()
            future.set_exception(e)

    threading.Thread(target=run, name="meanwhile", daemon=True).start()
    try:
        yield future
    finally:
        wait([future], timeout=deadline)


def chat_messages(messages: list[dict[str, Any]]) -> list[pb.ChatMessage]:
    """OpenAI-shaped chat messages (tool calls and results included) as the gRPC door's."""
    out = []
    for m in messages:
        calls = [
            pb.ToolCall(
                id=c.get("id", ""),
                type="function",
                function=pb.ToolCallFunction(
                    name=c["function"]["name"], arguments=c["function"]["arguments"]
                ),
            )
            for c in m.get("tool_calls") or []
        ]
        out.append(
            pb.ChatMessage(
                role=m["role"],
                content=m.get("content") or "",
                tool_calls=calls,
                tool_call_id=m.get("tool_call_id", ""),
            )
        )
    return out


def greedy(
    served: Served, messages: list[dict[str, Any]], max_tokens: int, **request: Any
) -> pb.GenerateResponse:
    """The gRPC door's greedy answer to `messages` (OpenAI's shape); `request`: more
    GenerateRequest fields (tools_json, tool_choice, ...)."""
    return served.running.client.generate(
        pb.GenerateRequest(
            messages=chat_messages(messages),
            params=pb.SamplingParams(max_tokens=max_tokens),
            **request,
        )
    )


HOST = socket.gethostname()
LONG = pb.SamplingParams(max_tokens=100_000, ignore_eos=True)  # runs until something breaks


def stream_started(client, chunks: int = 3, timeout: float = 60):
    """A long greedy stream on `client` (mlx_relay's Client) that has produced `chunks`
    chunks."""
    stream = client.stub.GenerateStream(
        pb.GenerateRequest(prompt="hi", params=LONG), timeout=timeout
    )
    for _ in range(chunks):
        next(stream)
    return stream


def error_of(stream) -> tuple[grpc.RpcError, float]:
    """Drain a stream that must fail; the error and when it arrived."""
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    return info.value, time.monotonic()


def assert_names(error: grpc.RpcError, rank: int) -> None:
    """`error` is UNAVAILABLE and names `rank` on this machine."""
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert f"rank {rank} ({HOST})" in error.details(), error.details()
