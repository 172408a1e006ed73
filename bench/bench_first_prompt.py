"""Warm at load: the first long prompts after a load against the tenth, and mlx-lm's.

    .venv/bin/python bench/bench_first_prompt.py [--model default | --shape tiny]
        [--ranks 1,2] [--gpus G] [--prompt-tokens 4000] [--prompts 10] [--serve-args "..."]

Each configuration starts fresh (a new process for single-process mlx-lm, a new cluster
for each rank count), then answers `--prompts` prompts of about `--prompt-tokens`
tokens, one after another, each different from its first token on (nothing reused from
a cache), 2 tokens each. Printed for each: every prompt's time to first token (the
client's clock), the first's and the second's as a ratio to the tenth's, and the
load's time (start to serving) for the clusters. A first prompt that pays for kernels
compiled on first use, or for a prefill pace measured while they compiled, shows here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import shapes  # noqa: E402
from bench_pipeline import FILLER, gpu_env  # noqa: E402

from mlx_relay.client.client import Client  # noqa: E402
from mlx_relay.launch.local import LocalCluster, free_ports  # noqa: E402
from mlx_relay.model.default_model import resolve_model  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402

# Single-process mlx-lm: load, then one greedy 2-token answer per prompt read from stdin
# (a JSON string a line), its time to first token printed as a JSON number.
BASELINE = r"""
import json, sys, time
import mlx.core as mx
from mlx_lm import load, stream_generate
model, tok = load(sys.argv[1])
print("loaded", flush=True)
for line in sys.stdin:
    text = tok.apply_chat_template([{"role": "user", "content": json.loads(line)}],
                                   tokenize=False, add_generation_prompt=True)
    ids = mx.array(tok.encode(text, add_special_tokens=False))
    t0 = time.perf_counter()
    for _ in stream_generate(model, tok, ids, max_tokens=1):
        break
    print(json.dumps(time.perf_counter() - t0), flush=True)
"""


def prompts(count: int, tokens: int) -> list[str]:
    """`count` prompts of about `tokens` tokens, each different from its first words on
    and a few tokens longer than the one before (as real prompts, none the length of
    another: on CUDA each prompt's last chunk then has a shape of its own)."""
    return [
        f"Note {i}: a report numbered {i * 7919}. " + FILLER * max(0, tokens // 17)
        + "More. " * (3 * i) + "Summarise the note in one line."
        for i in range(count)
    ]  # fmt: skip


def baseline_ttfts(path: Path, texts: list[str], gpus: int) -> list[float]:
    proc = subprocess.Popen(
        [sys.executable, "-c", BASELINE, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **gpu_env(0, gpus)},
    )
    assert proc.stdout.readline().strip() == "loaded"
    times = []
    for text in texts:
        proc.stdin.write(json.dumps(text) + "\n")
        proc.stdin.flush()
        times.append(json.loads(proc.stdout.readline()))
    proc.stdin.close()
    proc.wait(60)
    return times


def cluster_ttfts(
    model: str, n: int, texts: list[str], gpus: int, serve_args: list[str]
) -> tuple[float, list[float]]:
    """The load's seconds (start to serving) and each prompt's time to first token."""
    address = f"127.0.0.1:{free_ports(1)[0]}"
    logs = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(
            LocalCluster(
                n,
                ["--model", model, "--no-prompt-cache", *serve_args],
                grpc_address=address,
                log_dir=logs,
                rank_env={r: gpu_env(r, gpus) for r in range(n)},
            )
        )
        cluster.wait_serving(900)
        loaded = time.perf_counter() - t0
        client = stack.enter_context(Client(address, timeout=900))
        times, sizes = [], []
        for text in texts:
            request = pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content=text)],
                params=pb.SamplingParams(max_tokens=2, temperature=0.0),
            )
            start, first = time.perf_counter(), None
            for chunk in client.stream(request):
                if chunk.token_ids and first is None:
                    first = time.perf_counter() - start
                if chunk.HasField("usage"):
                    sizes.append(chunk.usage.prompt_tokens)
            if first is None:
                raise RuntimeError("no token came back")
            times.append(first)
    print(f"prompts of {min(sizes)}-{max(sizes)} tokens", flush=True)
    return loaded, times


def report(label: str, times: list[float], loaded: float | None = None) -> None:
    tenth = times[min(9, len(times) - 1)]
    each = " ".join(f"{t * 1000:.0f}" for t in times)
    load = f"; load {loaded:.1f} s" if loaded is not None else ""
    print(
        f"{label:<22} first / tenth {times[0] / tenth:.3f}, second / tenth "
        f"{times[1] / tenth:.3f}{load}\n{'':<22} TTFT ms: {each}",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--shape", choices=shapes.NAMES, help="a random-weight model of this shape")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--gpus", type=int, default=0, help="CUDA: rank r runs on GPU r mod G")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--serve-args", default="", help="extra options for every cluster")
    ap.add_argument("--no-baseline", action="store_true", help="skip single-process mlx-lm")
    args = ap.parse_args()
    if args.shape:
        args.model = str(shapes.make_shape(args.shape, shapes.cache_dir() / args.shape))
    path = resolve_model(args.model)
    texts = prompts(args.prompts, args.prompt_tokens)
    print(f"model {path}; {args.prompts} prompts of about {args.prompt_tokens} tokens")
    if not args.no_baseline:
        report("mlx-lm (1 process)", baseline_ttfts(path, texts, args.gpus))
    for n in (int(x) for x in args.ranks.split(",")):
        loaded, times = cluster_ttfts(args.model, n, texts, args.gpus, args.serve_args.split())
        report(f"mlx-relay {n} rank{'s' * (n > 1)}", times, loaded)
    return 0


if __name__ == "__main__":
    sys.exit(main())
