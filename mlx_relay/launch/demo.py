"""`mlx-relay demo`: the whole path once, start to finish, on the embedded default model."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

from mlx_relay.client.client import Client, chat_request
from mlx_relay.launch import preflight
from mlx_relay.launch.local import LocalCluster, free_ports
from mlx_relay.protocol import relay_pb2 as pb

QUESTION = "What is the capital of France? Answer in one sentence."


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start a local cluster, ask it one question, shut it down")
    p.add_argument("-n", "--num-ranks", type=int, default=2)
    p.add_argument("--model", default="default")
    p.add_argument("--question", default=QUESTION)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Converts the default model once, with progress, before the ranks start.
    preflight.check_ranks(preflight.check_model(args.model), args.num_ranks)
    grpc_port, http_port = free_ports(2)
    address = f"127.0.0.1:{grpc_port}"
    http = f"http://127.0.0.1:{http_port}"
    print(f"mlx-relay demo: starting {args.num_ranks} ranks on {args.model} ...", flush=True)
    t0 = time.perf_counter()
    cluster = LocalCluster(
        args.num_ranks,
        ["--model", args.model, "--http-address", f"127.0.0.1:{http_port}"],
        grpc_address=address,
    )
    with cluster:
        cluster.wait_serving(600)
        print(f"mlx-relay demo: serving after {time.perf_counter() - t0:.1f} s", flush=True)
        with Client(address, timeout=300) as client:
            for rank in client.status().ranks:
                print(
                    f"  rank {rank.rank}: layers [{rank.layer_start}, {rank.layer_end})"
                    f"  rss {rank.rss_bytes / 2**20:.0f} MiB",
                    flush=True,
                )
            print(f"\nuser: {args.question}\nassistant: ", end="", flush=True)
            final = None
            request = chat_request(args.question, params=pb.SamplingParams(max_tokens=64))
            for chunk in client.stream(request):
                print(chunk.text, end="", flush=True)
                if chunk.finish_reason:
                    final = chunk
            print()
        if final is not None:
            print(
                f"\n({final.usage.completion_tokens} tokens, finish_reason={final.finish_reason}, "
                f"first token {final.timings.time_to_first_token_s * 1000:.0f} ms, "
                f"{final.timings.decode_tokens_per_s:.1f} tok/s)",
                flush=True,
            )
        _ask_over_http(http, args.question, args.model)
    codes = [p.returncode for p in cluster.procs]
    print(f"mlx-relay demo: cluster shut down (exit codes {codes})")
    return 0 if all(c == 0 for c in codes) else 1


def _ask_over_http(base: str, question: str, model: str) -> None:
    """The same question through the OpenAI-compatible HTTP door, shown as curl would send it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 64,
    }
    print(
        f"\nThe same over HTTP (OpenAI's API; Anthropic's at /v1/messages, Ollama's at /api):\n"
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"       -d '{json.dumps(body)}'",
        flush=True,
    )
    request = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        reply = json.load(response)
    print(f"assistant (HTTP): {reply['choices'][0]['message']['content']}", flush=True)


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace(num_ranks=2, model="default", question=QUESTION)))
