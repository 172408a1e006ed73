"""Where a long prompt's time goes on N ranks: the flow of its chunks through the stages.

    CUDA_INJECTION64_PATH=$PWD/.gpu/b/cupti_trace.so CUPTI_TRACE_DIR=/tmp/ptr \\
        MLX_RELAY_TIMELINE=/tmp/ptl python3 bench/bench_pipeline.py --ranks 4 \\
        --prompt-tokens 4000 ...
    python3 bench/prefill_report.py /tmp/ptl --traces /tmp/ptr

A prompt of k chunks through N stages is a flow shop: ideally each stage computes chunk
i while the stage after it computes chunk i - 1, and the time to the first token is one
stage's k chunk times plus N - 1 more. The report takes the last prompt the timeline
holds (rank 0's last run of consecutive steps carrying more than one token) and prints,
for every chunk and rank, in ms from rank 0 beginning to build the first chunk: when the
stage's input was on its device (`received`; rank 0: built), when its output was
(`output`; rank 0: `computed`), how long it waited for that input after its previous
chunk's output (idle for want of work), and its compute span. With CUPTI traces
(`bench/gpu/cupti_trace.c`), also how much of each span a kernel ran (a span longer than
its kernels is launch gaps or host waits) and each GPU's time in compute kernels, NCCL
kernels and idle over the whole prompt.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import timeline_report
import trace_report


def last_prompt(carries: dict[int, int]) -> list[int]:
    """The step ids of the last run of consecutive steps carrying more than one token."""
    run: list[int] = []
    for step in sorted(carries, reverse=True):
        if carries[step] > 1 and (not run or step == run[-1] - 1):
            run.append(step)
        elif run:
            break
    return sorted(run)


def stage_times(
    events: timeline_report.Events, steps: list[int], ranks: int
) -> dict[tuple[int, int], tuple[int | None, int | None]]:
    """(rank, step) -> (input on the device, output on the device), ns (None: unmarked)."""
    out = {}
    for s in steps:
        out[(0, s)] = (events.get((0, "build", s)), events.get((0, "computed", s)))
        for r in range(1, ranks):
            out[(r, s)] = (events.get((r, "received", s)), events.get((r, "output", s)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("timeline", type=Path, help="MLX_RELAY_TIMELINE of the run")
    p.add_argument("--traces", type=Path, help="CUPTI_TRACE_DIR of the same run")
    args = p.parse_args()

    events, carries = timeline_report.read(args.timeline)
    steps = last_prompt(carries)
    if not steps:
        print("no prompt (no step carrying more than one token)")
        return 1
    ranks = 1 + max(rank for rank, _, _ in events)
    t0 = events[(0, "build", steps[0])]
    end = events.get((0, "tokens", steps[-1]))
    traces = trace_report.read_traces(args.traces) if args.traces else {}

    def ms(ns: int | None) -> str:
        return "      -" if ns is None else f"{(ns - t0) / 1e6:7.1f}"

    total = f", first token at {(end - t0) / 1e6:.1f} ms" if end else ""
    print(f"prompt of {sum(carries[s] for s in steps)} tokens in {len(steps)} chunks{total}")
    times = stage_times(events, steps, ranks)
    print("chunk rank  tokens   input  output   waited    span  kernels")
    for i, s in enumerate(steps):
        for r in range(ranks):
            got, done = times[(r, s)]
            before = times[(r, steps[i - 1])][1] if i else None
            waited = span = busy = ""
            if got is not None and before is not None:
                waited = f"{max(0, got - before) / 1e6:8.1f}"
            if got is not None and done is not None:
                start = max(got, before or got)
                span = f"{(done - start) / 1e6:7.1f}"
                if r in traces:
                    kernels = trace_report.inside(traces[r].kernels, start, done)
                    compute = [(k[0], k[1]) for k in kernels if not trace_report.is_nccl(k[3])]
                    busy = f"{trace_report.busy_ns(compute, start, done) / 1e6:8.1f}"
            print(
                f"{i:5d} {r:4d} {carries[s]:7d} {ms(got)} {ms(done)} {waited:>8} {span:>7} {busy:>8}"
            )
    if traces and end:
        print(f"each GPU over the prompt ({(end - t0) / 1e6:.1f} ms): compute, NCCL, idle ms")
        for r, t in sorted(traces.items()):
            kernels = trace_report.inside(t.kernels, t0, end)
            compute = [(k[0], k[1]) for k in kernels if not trace_report.is_nccl(k[3])]
            nccl = [(k[0], k[1]) for k in kernels if trace_report.is_nccl(k[3])]
            every = compute + nccl
            idle = (end - t0) - trace_report.busy_ns(every, t0, end)
            gaps = sorted(trace_report.gaps(every, t0, end), reverse=True)[:5]
            print(
                f"  rank {r}: {trace_report.busy_ns(compute, t0, end) / 1e6:7.1f} "
                f"{trace_report.busy_ns(nccl, t0, end) / 1e6:7.1f} {idle / 1e6:7.1f}"
                f"  (largest gaps {', '.join(f'{g / 1e6:.1f}' for g in gaps)})"
            )
            slow = [c for c in trace_report.inside(t.calls, t0, end) if c[1] - c[0] > 1e6]
            for c in slow[:8]:
                print(f"    slow call {(c[0] - t0) / 1e6:7.1f} +{(c[1] - c[0]) / 1e6:.1f} {c[3]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
