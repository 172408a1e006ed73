"""Prompt caches that last (--prompt-cache-dir): a long prefix's first token after other
traffic pushed its cache out of RAM, and after a restart, against a cold prefill.

    .venv/bin/python bench/bench_prompt_store.py [--model default] [--ranks 2]
        [--prefix-tokens 2000] [--rounds 3] [--sessions 8] [--session-model tiny]

Part 1, on `--model` with `--ranks` ranks (one slot, `--max-active 1`, so any other
request pushes the parked cache out of RAM), each round a fresh ~`--prefix-tokens`
prefix (a system prompt that starts with the round's number):

- cold: the prefix and a first question, nothing stored;
- pushed out: another request runs, then the prefix and a second question;
- restarted: after every round, the cluster is stopped and started again on the same
  store, and each round's prefix is asked a third question.

Time to first token is the server's own (Timings.time_to_first_token_s); every answer's
tokens are checked against single-process mlx-lm on the whole prompt.

Part 2, on `--session-model` (a tiny random llama: the hit rate does not depend on the
model's speed): `--sessions` agent-like sessions take turns, each a ~4,000-token prefix
growing by a few hundred tokens a turn, `--max-active 2`, a disk budget that holds them
all; printed: the share of prompt tokens that came from a cache (usage.cached_tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import shapes  # noqa: E402
from oracle import chat_tokens, mlx_lm_tokens  # noqa: E402

from mlx_relay.client.client import Client  # noqa: E402
from mlx_relay.launch.local import LocalCluster, free_ports  # noqa: E402
from mlx_relay.model.default_model import resolve_model  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402

PARAGRAPH = (
    "The harbour office keeps the tide tables, the pilot rota and the list of berths. "
    "Ships over forty metres need a pilot; fishing boats do not. The crane on the north "
    "quay lifts twelve tonnes and is booked a day ahead. Fuel is sold from six to ten. "
)
MAX_TOKENS = 8


def _messages(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _ask(client: Client, messages: list[dict], max_tokens: int = MAX_TOKENS) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in messages],
        params=pb.SamplingParams(max_tokens=max_tokens),
    )
    return client.generate(request)


@contextlib.contextmanager
def _cluster(model: str, ranks: int, logs: Path, *args: str):
    address = f"127.0.0.1:{free_ports(1)[0]}"
    cluster = LocalCluster(
        ranks, ["--model", model, *args], grpc_address=address, log_dir=logs, pin=True
    )
    cluster.start()
    try:
        cluster.wait_serving(600)
        with Client(address, timeout=900) as client:
            yield client
    finally:
        cluster.stop()


def part_one(args: argparse.Namespace, work: Path) -> None:
    path = resolve_model(args.model)
    store = work / "store"
    context = max(8192, args.prefix_tokens + 512)
    flags = ("--prompt-cache-dir", str(store), "--max-active", "1", "--max-context", str(context))
    words = len(PARAGRAPH.split())
    repeats = max(1, round(args.prefix_tokens / (words * 1.25)))
    systems = [f"Round {r}. " + PARAGRAPH * repeats for r in range(args.rounds)]
    questions = ["Who needs a pilot?", "When is fuel sold?", "What does the crane lift?"]
    times: dict[str, list[float]] = {"cold": [], "pushed out": [], "restarted": []}
    cached: dict[str, list[int]] = {k: [] for k in times}
    exact = True
    prompt_len = []

    def check(label: str, system: str, question: str, reply: pb.GenerateResponse) -> None:
        nonlocal exact
        prompt = chat_tokens(path, _messages(system, question))
        prompt_len.append(len(prompt))
        exact &= list(reply.token_ids) == mlx_lm_tokens(path, prompt, MAX_TOKENS)
        times[label].append(reply.timings.time_to_first_token_s)
        cached[label].append(reply.usage.cached_tokens)

    with _cluster(args.model, args.ranks, work / "logs1", *flags) as client:
        _ask(client, [{"role": "user", "content": "Hello"}])  # (warm-up)
        for system in systems:
            check("cold", system, questions[0], _ask(client, _messages(system, questions[0])))
            _ask(client, [{"role": "user", "content": "Name a colour."}])  # (pushes it out)
            check("pushed out", system, questions[1], _ask(client, _messages(system, questions[1])))
    with _cluster(args.model, args.ranks, work / "logs2", *flags) as client:
        _ask(client, [{"role": "user", "content": "Hello"}])
        for system in systems:
            check("restarted", system, questions[2], _ask(client, _messages(system, questions[2])))
    cold = statistics.median(times["cold"])
    print(f"\nmodel {args.model}, {args.ranks} ranks, prompts of {min(prompt_len)}-{max(prompt_len)} "
          f"tokens, {args.rounds} rounds; tokens equal single-process mlx-lm's: {exact}")  # fmt: skip
    print("| first token | median s | of cold | cached tokens |")
    print("| --- | ---: | ---: | --- |")
    for label, values in times.items():
        median = statistics.median(values)
        print(f"| {label} | {median:.2f} | {median / cold:.3f} | {cached[label]} |")


def part_two(args: argparse.Namespace, work: Path) -> None:
    made = shapes.make_shape(args.session_model, shapes.cache_dir() / args.session_model)
    model = work / "session-model"  # (the shape with room for the sessions' contexts)
    shutil.copytree(made, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    (model / "config.json").write_text(json.dumps(config))
    flags = ("--prompt-cache-dir", str(work / "sessions"), "--max-active", "2")
    flags += ("--prompt-cache-disk-bytes", "20GB", "--max-context", "16384")
    sessions = [
        [{"role": "system", "content": f"Agent {s}. " + PARAGRAPH * 28}]
        for s in range(args.sessions)
    ]
    totals = {"all turns": [0, 0], "after each session's first": [0, 0]}
    with _cluster(str(model), args.ranks, work / "logs3", *flags) as client:
        for turn in range(args.turns):
            for history in sessions:
                history.append({"role": "user", "content": f"Step {turn}: " + PARAGRAPH * 2})
                reply = _ask(client, history, max_tokens=4)
                history.append({"role": "assistant", "content": reply.text})
                for label in totals if turn else ["all turns"]:
                    totals[label][0] += reply.usage.prompt_tokens
                    totals[label][1] += reply.usage.cached_tokens
        status = client.status().prompt_store
    print(f"\n{args.sessions} sessions x {args.turns} turns on {args.session_model}, "
          f"--max-active 2; store: {status.blocks} blocks, {status.bytes / 1e6:.0f} MB on rank 0, "
          f"{status.restores} restores, {status.failed_restores} failed")  # fmt: skip
    print("| turns | prompt tokens | from a cache | hit rate |")
    print("| --- | ---: | ---: | ---: |")
    for label, (prompt, cached) in totals.items():
        print(f"| {label} | {prompt:,} | {cached:,} | {cached / max(prompt, 1):.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--session-model", default="tiny", choices=shapes.NAMES)
    ap.add_argument("--skip", choices=["one", "two"], default=None)
    ap.add_argument("--gpus", type=int, default=0, help="CUDA: rank r on GPU r mod G")
    args = ap.parse_args()
    global GPUS
    GPUS = args.gpus
    print(f"cores {os.cpu_count()}")
    with tempfile.TemporaryDirectory(prefix="bench-prompt-store-") as tmp:
        if args.skip != "one":
            part_one(args, Path(tmp))
        if args.skip != "two":
            part_two(args, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
