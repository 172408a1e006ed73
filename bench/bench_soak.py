"""Soak: many concurrent clients for a long time; outputs exact, nothing leaks, memory flat.

    .venv/bin/python bench/bench_soak.py [--model PATH] [--ranks 2] [--clients 32]
        [--seconds 300] [--warmup 30] [--max-active 8] [--seed 0] [--json FILE]

Without --model, a tiny random-weight llama (tests/tiny_models.py) is made and served.
Each client loops over requests drawn from a fixed pool of distinct requests: short and
long prompts, raw and chat, every sampler (greedy, temperature, top-p, top-k, min-p, XTC,
repetition / presence / frequency penalties, logit bias, stop strings, logprobs), each
seeded; sent unary or streaming, and some cancelled or their connection dropped midway.
Checks, each a line of the report and the exit code:

- every request that completed produced exactly what the same request produced alone
  (each pool entry is first run solo, one at a time, on the same cluster);
- once the clients stop, the cluster goes idle: no active or queued request, parked
  prompt caches at most --max-active;
- each rank's resident memory after the warm-up is flat: the mean of the last fifth of
  the samples is within --rss-slack MB of the mean of the first fifth.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from soak import SoakSettings, soak  # noqa: E402 - the soak itself (tests/soak.py)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    d = asdict(SoakSettings())
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=d["model"], help="a model directory (default: a tiny llama)")
    p.add_argument("--ranks", type=int, default=d["ranks"])
    p.add_argument("--clients", type=int, default=d["clients"])
    p.add_argument("--seconds", type=float, default=d["seconds"])
    p.add_argument("--warmup", type=float, default=d["warmup"], help="RSS is compared after this")
    p.add_argument("--max-active", type=int, default=d["max_active"])
    p.add_argument("--pool", type=int, default=d["pool"], help="distinct requests")
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument(
        "--rss-slack", type=float, default=d["rss_slack"], help="MB of RSS growth allowed"
    )
    p.add_argument("--solo-stream", action="store_true", help="solo runs streamed")
    p.add_argument("--json", type=Path, help="also write the report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    settings = vars(args).copy()
    settings.pop("json")
    report = soak(SoakSettings(**settings))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if report.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
