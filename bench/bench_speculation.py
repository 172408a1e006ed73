"""Speculative decoding: decode speed with proposals against without, side by side.

    .venv/bin/python bench/bench_speculation.py [--model default | --shape NAME]
        [--draft ngram | --draft-model PATH | --draft-shape NAME] [--num-draft-tokens 4]
        [--ranks 2] [--gpus G] [--tokens 200] [--rounds 5] [--prompt copy|story]
        [--streams 1]

One cluster per rank count, started with the draft options; each round runs the same
request with drafting on and off (`num_draft_tokens` 0, the request's own switch), so
both are measured on the same cluster seconds apart, and single-process mlx-lm (plain,
and with `--draft-model`/`--draft-shape` its own speculative generator with the same
draft and K) on one process or GPU. `--prompt copy` asks to repeat a text (what prompt
lookup is for); `story` asks for new text. Acceptance is what the usage says: kept
proposals over proposals. `--streams S` runs S requests at once and reports the
aggregate, drafting on against off. Random-weight shapes (`--shape`) say nothing of
acceptance on real text: report the measured acceptance with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import shapes  # noqa: E402
from bench_pipeline import Baseline, gpu_env, interleaved  # noqa: E402

from mlx_relay.client.client import Client  # noqa: E402
from mlx_relay.launch.local import LocalCluster, free_ports  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402

TEXT = (
    "The lighthouse stood on the rocks at the edge of the bay, and every night its lamp "
    "swept the dark water. The keeper climbed the one hundred and twelve steps at dusk, "
    "trimmed the wick, wound the clockwork and wrote the weather in his log: wind from "
    "the west, a falling glass, three ships passing north before midnight."
)
PROMPTS = {
    "copy": f"Repeat the following text exactly, word for word, twice:\n\n{TEXT}",
    "story": "Write a long story about a lighthouse keeper who finds a message in a bottle.",
}

SPECULATIVE = r"""
import json, os, sys, time
import mlx.core as mx
from mlx_lm import load, stream_generate
path, n, prompt, draft, k = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
model, tok = load(path)
draft_model = load(draft)[0] if draft else None
ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
tok.eos_token_ids = set()  # like ignore_eos: always generate n tokens
extra = {"draft_model": draft_model, "num_draft_tokens": k} if draft_model else {}
print(json.dumps({"prompt_tokens": len(ids)}), flush=True)
for line in sys.stdin:
    t0 = time.perf_counter(); first = None; count = 0; drafted = 0
    for r in stream_generate(model, tok, mx.array(ids), max_tokens=n, **extra):
        count += 1
        drafted += bool(getattr(r, "from_draft", False))
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    print(json.dumps({"decode_tps": (count - 1) / (end - first), "accepted": drafted / count}),
          flush=True)
"""


def baseline(path: Path, args: argparse.Namespace, draft: str, env: dict) -> Baseline:
    """Single-process mlx-lm (with a draft model: its speculative generator)."""
    prompt = PROMPTS[args.prompt]
    return Baseline(path, args.tokens, prompt, env, SPECULATIVE, (draft, str(args.k)))


def _request(args: argparse.Namespace, drafting: bool) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    if not drafting:
        params.num_draft_tokens = 0
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=PROMPTS[args.prompt])], params=params
    )


def _one(client: Client, request: pb.GenerateRequest, out: list[dict]) -> None:
    t0, first, count, usage = time.perf_counter(), None, 0, None
    for chunk in client.stream(request):
        count += len(chunk.token_ids)
        if first is None and chunk.token_ids:
            first = time.perf_counter()
        if chunk.HasField("usage"):
            usage = chunk.usage
    end = time.perf_counter()
    proposed = usage.draft_tokens if usage else 0
    out.append(
        {
            "ttft": first - t0,
            "end": end,
            "first": first,
            "tokens": count,
            "accepted": usage.accepted_draft_tokens / proposed if proposed else 0.0,
        }
    )


def cluster_run(client: Client, args: argparse.Namespace, drafting: bool) -> dict:
    """`--streams` requests at once: the aggregate decode rate (tokens after each one's
    first, over the time from the first first token to the last end)."""
    runs: list[dict] = []
    threads = [
        threading.Thread(target=_one, args=(client, _request(args, drafting), runs))
        for _ in range(args.streams)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start, end = min(r["first"] for r in runs), max(r["end"] for r in runs)
    decoded = sum(r["tokens"] - 1 for r in runs)
    return {
        "decode_tps": decoded / (end - start),
        "accepted": statistics.mean(r["accepted"] for r in runs),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--shape", choices=shapes.NAMES, help="a random-weight model of this shape")
    ap.add_argument("--draft", choices=("ngram", "model"), default="ngram")
    ap.add_argument("--draft-model", default="", help="a draft model's path (--draft model)")
    ap.add_argument("--draft-shape", choices=shapes.NAMES, help="a random-weight draft shape")
    ap.add_argument("--num-draft-tokens", dest="k", type=int, default=4)
    ap.add_argument("--fixed", action="store_true", help="--draft-fixed on the clusters")
    ap.add_argument("--ranks", default="2")
    ap.add_argument("--gpus", type=int, default=0, help="CUDA: rank r runs on GPU r mod G")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", choices=sorted(PROMPTS), default="copy")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--serve-args", default="", help="extra options for every cluster")
    args = ap.parse_args()

    from mlx_relay.model.default_model import resolve_model

    if args.shape:
        args.model = str(shapes.make_shape(args.shape, shapes.cache_dir() / args.shape))
    if args.draft_shape:
        shape_dir = shapes.cache_dir() / args.draft_shape
        args.draft_model = str(shapes.make_shape(args.draft_shape, shape_dir))
    if args.draft_model:
        args.draft = "model"
    path = resolve_model(args.model)
    draft = str(resolve_model(args.draft_model)) if args.draft_model else ""
    sizes = [int(x) for x in args.ranks.split(",")]
    print(
        f"model {path}  draft {draft or 'ngram'}  K {args.k}  tokens {args.tokens}  "
        f"prompt {args.prompt}  streams {args.streams}  rounds {args.rounds}"
    )
    runners: dict[str, object] = {}
    with contextlib.ExitStack() as stack:
        plain = baseline(path, args, "", gpu_env(0, args.gpus))
        stack.callback(plain.close)
        if args.streams == 1:
            runners["mlx_lm"] = plain.run
            if draft:
                spec = baseline(path, args, draft, gpu_env(0, args.gpus))
                stack.callback(spec.close)
                runners["mlx_lm speculative"] = spec.run
        options = ["--draft-model", draft] if draft else ["--draft", "ngram"]
        options += ["--num-draft-tokens", str(args.k), "--no-prompt-cache"]
        options += ["--draft-fixed"] if args.fixed else []
        for n in sizes:
            address = f"127.0.0.1:{free_ports(1)[0]}"
            cluster = stack.enter_context(
                LocalCluster(
                    n,
                    ["--model", str(path), *options, "--max-active", str(max(8, args.streams))]
                    + args.serve_args.split(),
                    grpc_address=address,
                    log_dir=Path(tempfile.mkdtemp(prefix="bench-spec-")),
                    rank_env={r: gpu_env(r, args.gpus) for r in range(n)},
                )
            )
            cluster.wait_serving(900)
            client = stack.enter_context(Client(address, timeout=900))
            for drafting in (False, True):
                label = f"{n} rank{'s' if n > 1 else ''} drafting {'on' if drafting else 'off'}"
                runners[label] = lambda c=client, d=drafting: cluster_run(c, args, d)
        results = interleaved(runners, args.rounds)
    report(results, sizes, args.streams)
    return 0


def report(results: dict[str, list[dict]], sizes: list[int], streams: int) -> None:
    """Medians over rounds; ratios taken within a round, then their median."""

    def ratio(a: str, b: str) -> float:
        pairs = zip(results[a], results[b], strict=True)
        return statistics.median(x["decode_tps"] / y["decode_tps"] for x, y in pairs)

    print(f"{'config':<30}{'decode tok/s':>14}{'acceptance':>12}")
    for label, runs in results.items():
        tps = statistics.median(r["decode_tps"] for r in runs)
        accepted = statistics.median(r["accepted"] for r in runs)
        print(f"{label:<30}{tps:>14.2f}{accepted:>12.2f}")
    print("ratios (median of per-round ratios):")
    for n in sizes:
        on, off = f"{n} rank{'s' if n > 1 else ''} drafting on", None
        off = on.replace(" on", " off")
        print(f"  {n} ranks: drafting on / off          {ratio(on, off):.3f}")
        if streams == 1:
            print(f"  {n} ranks: drafting on / mlx_lm       {ratio(on, 'mlx_lm'):.3f}")
            if "mlx_lm speculative" in results:
                speculative = ratio(on, "mlx_lm speculative")
                print(f"  {n} ranks: drafting on / mlx_lm spec  {speculative:.3f}")
    if "mlx_lm speculative" in results:
        print(f"  mlx_lm speculative / mlx_lm          {ratio('mlx_lm speculative', 'mlx_lm'):.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
