"""The prompt cache: time to first token of a chat's second turn, with and without it.

    .venv/bin/python bench/bench_prompt_cache.py [--model default] [--ranks 2] [--rounds 3]

Two clusters of the same size run side by side, one serving with the prompt cache (the
default) and one with `--no-prompt-cache`; each rank is pinned to its own core. Each
round sends one fresh conversation to both: a first turn under a long system prompt,
then the second turn, whose prompt repeats the first turn and its answer. With the
cache, the second turn prefills only what the first turn's caches do not hold. The
clusters take turns, so a slow minute on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_relay.client.client import Client  # noqa: E402
from mlx_relay.launch.local import LocalCluster, free_ports  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402

SYSTEM = (
    "You are the assistant of a lighthouse museum. Visitors ask about the history of "
    "lighthouses, the lives of their keepers, the lenses and lamps, the storms and the "
    "ships. Answer in plain words, in two or three sentences, and say so when you do not "
    "know. The museum opens at nine and closes at five, except on Mondays. Tickets cost "
    "eight euros, children under twelve enter free, and the tower can be climbed in good "
    "weather only. The oldest lamp in the collection burned whale oil; the newest is an "
    "electric lamp from 1952. "
) * 2


def turn(client: Client, messages: list[dict]) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in messages],
        params=pb.SamplingParams(max_tokens=16),
    )
    return client.generate(request)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    print(f"model {args.model}  ranks {args.ranks}  rounds {args.rounds}  cores {os.cpu_count()}")
    configs = {"prompt cache": [], "no prompt cache": ["--no-prompt-cache"]}
    ttft: dict[str, list[float]] = {label: [] for label in configs}
    cached: list[int] = []
    prompt_tokens: list[int] = []
    with contextlib.ExitStack() as stack:
        clients = {}
        for label, extra in configs.items():
            address = f"127.0.0.1:{free_ports(1)[0]}"
            logs = Path(tempfile.mkdtemp(prefix="bench-logs-"))
            cluster = LocalCluster(
                args.ranks,
                ["--model", args.model, *extra],
                grpc_address=address,
                log_dir=logs,
                pin=True,
            )
            stack.enter_context(cluster)
            cluster.wait_serving(600)
            clients[label] = stack.enter_context(Client(address, timeout=900))
        # This thread (the client's requests) to core 0 only now: pinned sooner, the
        # clusters it starts would inherit core 0 and pin every rank to it. (The gRPC
        # threads the clients started stay free; the TTFT they see is seconds long.)
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        for i in range(args.rounds):
            first = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Visitor {i}: when does the museum open?"},
            ]
            for label, client in clients.items():
                answer = turn(client, first)
                second = [
                    *first,
                    {"role": "assistant", "content": answer.text},
                    {"role": "user", "content": "And can I climb the tower today?"},
                ]
                response = turn(client, second)
                ttft[label].append(response.timings.time_to_first_token_s)
                if label == "prompt cache":
                    cached.append(response.usage.cached_tokens)
                    prompt_tokens.append(response.usage.prompt_tokens)
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    with_cache = statistics.median(ttft["prompt cache"])
    without = statistics.median(ttft["no prompt cache"])
    print(
        f"second turn: {statistics.median(prompt_tokens):.0f} prompt tokens, "
        f"{statistics.median(cached):.0f} of them cached"
    )
    print(f"{'config':<18}{'TTFT s':>10}")
    print(f"{'no prompt cache':<18}{without:>10.2f}")
    print(f"{'prompt cache':<18}{with_cache:>10.2f}")
    print(f"speed-up of the second turn's first token: {without / with_cache:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
