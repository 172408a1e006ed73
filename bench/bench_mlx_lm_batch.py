"""What one mlx-lm process does with C streams batched: the reference for a rank's batch.

    .venv/bin/python bench/bench_mlx_lm_batch.py [--model PATH | --shape NAME] [--streams 1,8,16]
        [--tokens 64] [--gpus G]

bench_concurrency.py compares N ranks with one rank serving the same streams; this says
whether one rank's cost per batched step is the engine's or the hardware's: mlx-lm's own
BatchGenerator (`batch_generate`) decodes the same chat prompt for C streams at once in
one process, and the decode tokens per second it reports are printed per C: the second of
two runs, as the first at a new batch size compiles its kernels (on CUDA a first run of 8
streams took 33 s). `--shape` is as in bench_pipeline.py; `--gpus` runs it on CUDA GPU 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import shapes  # noqa: E402
from bench_pipeline import PROMPT  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a local model folder")
    ap.add_argument("--shape", choices=shapes.NAMES, help="a random-weight model of this shape")
    ap.add_argument("--streams", default="1,8,16", help="comma-separated stream counts")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each stream generates")
    ap.add_argument("--gpus", type=int, default=0, help="run on CUDA (GPU 0)")
    args = ap.parse_args()
    if args.shape:
        args.model = str(shapes.make_shape(args.shape, shapes.cache_dir() / args.shape))
    if not args.model:
        ap.error("--model or --shape")
    if args.gpus:
        import os

        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")

    from mlx_lm import batch_generate, load

    model, tok = load(args.model)
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    ids = tok.encode(text, add_special_tokens=False)
    tok.eos_token_ids = set()  # like ignore_eos: every stream generates --tokens
    print(f"model {args.model}  prompt {len(ids)} tokens  tokens/stream {args.tokens}")
    print(f"{'streams':>8} {'decode tok/s':>14} {'wall s':>8}")
    for streams in (int(c) for c in args.streams.split(",")):
        batch_generate(model, tok, [ids] * streams, max_tokens=args.tokens)  # (compiles)
        t0 = time.perf_counter()
        response = batch_generate(model, tok, [ids] * streams, max_tokens=args.tokens)
        wall = time.perf_counter() - t0
        print(f"{streams:>8} {response.stats.generation_tps:>14.2f} {wall:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
