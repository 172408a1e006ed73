"""Greedy tokens under load: does every stream of a busy cluster follow the model?

    .venv/bin/python bench/greedy_under_load.py [--model default | --shape NAME] [--gpus G]
        [--ranks 1,2] [--streams 16] [--tokens 256]

The test suite proves token-exactness on this CPU; on a GPU the engine's overlap (the
sampled tokens read to the host while the next step, already queued, reads them on the
device) could race where the CPU cannot. This runs C greedy streams at once on each rank
count, then checks every emitted token against single-process mlx-lm by teacher forcing:
one forward pass over prompt + output, and at each position the emitted token must be the
argmax. Batched kernels round differently from a one-row forward, so a near tie may flip
(the gap printed is the argmax's logit minus the emitted token's, small for a tie); a race
would instead show as a large gap, or as a rate of misses that grows with the rank count.
Streams whose whole output equals that of the first rank count are counted too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import shapes  # noqa: E402
from bench_concurrency import start  # noqa: E402
from teacher_forcing import misses  # noqa: E402 - the check itself (tests/teacher_forcing.py)

from mlx_relay.coordinator.requests import encode_text  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402


def _prompt(i: int) -> str:
    return f"Story {i}: the harbour at dawn, a ship named {i * 37 % 101}, and"


def generate_all(client, streams: int, tokens: int) -> list[list[int]]:
    """Every stream's greedy token ids, all sent at once so that they decode together."""
    out: list[list[int]] = [[] for _ in range(streams)]

    def run(i: int) -> None:
        request = pb.GenerateRequest(
            prompt=_prompt(i), params=pb.SamplingParams(max_tokens=tokens, ignore_eos=True)
        )
        for chunk in client.stream(request):
            out[i].extend(chunk.token_ids)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--shape", choices=shapes.NAMES, help="a random-weight model of this shape")
    ap.add_argument("--gpus", type=int, default=0, help="CUDA: rank r runs on GPU r mod G")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--layers", default="balanced")
    args = ap.parse_args()
    if args.shape:
        args.model = str(shapes.make_shape(args.shape, shapes.cache_dir() / args.shape))
    outputs: dict[int, list[list[int]]] = {}
    for n in (int(x) for x in args.ranks.split(",")):
        cluster, client = start(args.model, n, args.layers, args.gpus, 64)
        try:
            outputs[n] = generate_all(client, args.streams, args.tokens)
        finally:
            client.close()
            cluster.stop()

    from mlx_lm import load  # (after the clusters: the GPU is this process's alone now)

    model, tokenizer = load(args.model)
    prompts = [encode_text(tokenizer, _prompt(i)) for i in range(args.streams)]
    first = next(iter(outputs))
    print(f"model {args.model}  {args.streams} greedy streams x {args.tokens} tokens")
    for n, streams in outputs.items():
        checked = [misses(model, p, s) for p, s in zip(prompts, streams, strict=True)]
        found = [f for f, _ in checked]
        margin = statistics.median(m for _, m in checked)
        gaps = [g for f in found for _, g in f]
        same = sum(s == o for s, o in zip(streams, outputs[first], strict=True))
        earliest = min((f[0][0] for f in found if f), default=None)
        print(
            f"{n} rank(s): {len(gaps)} of {sum(map(len, streams))} tokens not the argmax "
            f"in {sum(map(bool, found))} stream(s); largest gap {max(gaps, default=0):.4f} "
            f"(median margin of the argmax {margin:.4f}); "
            f"first miss at token {earliest}; streams equal to {first} rank(s)'s: "
            f"{same}/{args.streams}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
