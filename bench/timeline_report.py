"""Where a step's time goes, from the timelines the ranks of one cluster recorded.

    MLX_RELAY_TIMELINE=/tmp/tl python3 bench/bench_pipeline.py --ranks 2 --hop-modes eager ...
    python3 bench/timeline_report.py /tmp/tl

Run one cluster configuration at a time (every rank r of every cluster writes
`rank<r>.tsv`). Each step is anchored at the moment rank 0 began to build it; the report
prints, for the steady steps, the median time of every rank's events of that step and of
rank 0's events of the next one after that anchor, in the order they happen, and the
median step period. Events (see the `timeline.mark` calls): rank 0 `build`s a step,
`settle`s the return it reads (CUDA), has it (`return_settled`), sends the header
(`header_sent`) and has launched its part (`posted`); a worker has the `header`, has
`built` its part, sent the header on, has its input (`settled`, eager hops) or its
output (`computed`, ready hops, and the last rank's inline return; `copied`: that
return copied to the host), has `posted` its part and has `released` the last
step's send (the loop's next wait for a header begins there); rank 0 has the header back
(`returned`) and the step's sampled `tokens` read. Watcher threads mark when the device
has finished: on rank 0 the tokens the step reads (`sampled`), its part (`computed`) and
its part's hop out (`sent`, eager hops; an all-sum ends once its peer has joined it), on
a worker its input (`received`) and its output (`output`); the gaps between them are the device's work and the
hops. `--tokens N` keeps the steps that carry N tokens (rank 0's `build` records it): a
batch of N streams' decode steps. `--over MS` keeps the steps whose period is longer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

Events = dict[tuple[int, str, int], int]  # (rank, event, step) -> ns, first occurrence


def read(folder: Path) -> tuple[Events, dict[int, int]]:
    """The events of every rank, and the tokens each step rank 0 built carries."""
    events: Events = {}
    carries: dict[int, int] = {}
    for path in sorted(folder.glob("rank*.tsv")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            event, step, ns, tokens = line.split("\t")
            events.setdefault((rank, event, int(step)), int(ns))
            if rank == 0 and event == "build":
                carries[int(step)] = int(tokens)
    return events, carries


def report(
    events: Events,
    skip: int,
    carries: dict[int, int] | None = None,
    tokens: int = 0,
    over_ms: float = 0.0,
) -> list[str]:
    """The median offsets of each (rank, event) from its step's rank-0 build, in ms;
    with `tokens`, over the steps carrying that many tokens only (`carries`: read's);
    with `over_ms`, over the steps whose period (to the next step's build) is longer."""
    steady = steady_steps(events, carries, skip, tokens)
    if over_ms:
        steady = [s for s in steady if period_ms(events, s) > over_ms]
    if not steady:
        carrying = f" carrying {tokens} tokens" if tokens else ""
        longer = f" of periods over {over_ms:g} ms" if over_ms else ""
        return [f"no steady steps{carrying}{longer} (rank 0's `build` events of consecutive steps)"]
    by_step: dict[int, list[tuple[int, str, int]]] = defaultdict(list)
    for (rank, event, step), ns in events.items():
        by_step[step].append((rank, event, ns))
    offsets: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    periods = []
    for s in steady:
        anchor = events[(0, "build", s)]
        periods.append(period_ms(events, s))
        for rank, event, ns in by_step[s]:
            offsets[("step", rank, event)].append((ns - anchor) / 1e6)
        for rank, event, ns in by_step[s + 1]:
            if rank == 0:
                offsets[("next", rank, event)].append((ns - anchor) / 1e6)
    rows = sorted(
        (
            (statistics.median(v), which, rank, event, len(v))
            for (which, rank, event), v in offsets.items()
        ),
    )
    lines = [
        f"{len(steady)} steady steps; median period {statistics.median(periods):.3f} ms "
        f"(p10 {_quantile(periods, 0.1):.3f}, p90 {_quantile(periods, 0.9):.3f})",
        "median ms after rank 0 began to build step s:",
    ]
    previous = 0.0
    for median, which, rank, event, count in rows:
        label = f"rank {rank} {event}" + (" (step s+1)" if which == "next" else "")
        lines.append(f"  {median:8.3f}  (+{median - previous:7.3f})  {label}  [{count}]")
        previous = median
    return lines


def steady_steps(
    events: Events, carries: dict[int, int] | None, skip: int, tokens: int = 0
) -> list[int]:
    """Rank 0's steps after the first `skip` whose next step was built too (so each has
    a period); with `tokens`, those carrying that many tokens only."""
    builds = sorted(step for rank, event, step in events if rank == 0 and event == "build")
    built = set(builds)
    steady = [s for s in builds[skip:] if s + 1 in built]
    if tokens and carries is not None:
        steady = [s for s in steady if carries.get(s) == tokens]
    return steady


def period_ms(events: Events, step: int) -> float:
    return (events[(0, "build", step + 1)] - events[(0, "build", step)]) / 1e6


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--skip", type=int, default=8, help="first steps left out (warm-up)")
    parser.add_argument(
        "--tokens",
        type=int,
        default=0,
        help="only steps carrying this many tokens (a decode step: one a stream)",
    )
    parser.add_argument(
        "--over",
        type=float,
        default=0.0,
        metavar="MS",
        help="only steps whose period is longer than MS (what the slow steps wait for)",
    )
    args = parser.parse_args()
    events, carries = read(args.folder)
    if not events:
        print(f"no timelines in {args.folder}", file=sys.stderr)
        return 1
    counts = Counter(carries.values())
    print("steps by tokens carried:", ", ".join(f"{n}: {c}" for n, c in sorted(counts.items())))
    print("\n".join(report(events, args.skip, carries, args.tokens, args.over)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
