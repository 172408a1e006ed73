"""What each GPU did during a cluster's steady steps, from CUPTI traces beside its timeline.

    CUDA_INJECTION64_PATH=$PWD/.gpu/b/cupti_trace.so CUPTI_TRACE_DIR=/tmp/tr \\
        MLX_RELAY_TIMELINE=/tmp/tl python3 bench/bench_concurrency.py --ranks 2 ...
    python3 bench/trace_report.py /tmp/tr /tmp/tl --tokens 8 --skip 200

(`bench/gpu/cupti_trace.c` records every kernel, copy, host wait and slow CUDA call of
each rank, on the clock the timeline marks use.) The window is the steady steps that
`bench/timeline_report.py` reports. For each rank: how busy its GPU was and on which
streams, the kernels that took its time, the gaps when nothing ran, its host's waits
and slow calls; then the kernels both ranks run, side by side (are rank 0's slower?);
then each step period of rank 0 split into compute, NCCL (an all-sum waits inside its
kernel for its peer) and idle time on each GPU, for normal and slow periods apart.
`--dump FILE` writes every record and mark from 200 ms before the middle slow period to
400 ms after it, to read by eye.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import timeline_report


class Records(list):
    """(start, end, int, text) records sorted by start, to take windows of quickly."""

    def seal(self) -> Records:
        self.sort()
        self.starts = [r[0] for r in self]
        self.longest = max((r[1] - r[0] for r in self), default=0)
        return self


@dataclass
class Trace:
    """One process's records, times in ns."""

    kernels: Records = field(default_factory=Records)  # stream, kernel name
    copies: Records = field(default_factory=Records)  # stream, C<copy kind> / M (a set)
    syncs: Records = field(default_factory=Records)  # stream, CUPTI's sync type
    calls: Records = field(default_factory=Records)  # thread, R:/D: call name


def read_trace(path: Path) -> Trace:
    t = Trace()
    for line in path.read_text(errors="replace").splitlines():
        f = line.split("\t")
        try:
            start, end = int(f[1]), int(f[2])
            if f[0] == "K":
                t.kernels.append((start, end, int(f[3]), f[5]))
            elif f[0] in ("C", "M"):
                t.copies.append((start, end, int(f[3]), f"{f[0]}{f[5]} {f[4]} B"))
            elif f[0] == "S":
                t.syncs.append((start, end, int(f[3]), f"sync type {f[4]}"))
            elif f[0] == "A":
                t.calls.append((start, end, int(f[3]), f[4]))
        except (IndexError, ValueError):
            continue  # a line cut short where the process ended
    for records in (t.kernels, t.copies, t.syncs, t.calls):
        records.seal()
    return t


def read_traces(folder: Path) -> dict[int, Trace]:
    """Each rank's trace in a CUPTI_TRACE_DIR (`rank<R>-<pid>.tsv`; of several files of
    one rank, the largest; processes with no rank, such as a baseline, left out)."""
    traces: dict[int, Trace] = {}
    for f in sorted(folder.glob("rank*-*.tsv"), key=lambda f: f.stat().st_size):
        rank = f.name.split("-")[0].removeprefix("rank")
        if rank.isdigit() and f.stat().st_size:
            traces[int(rank)] = read_trace(f)
    return traces


def is_nccl(name: str) -> bool:
    return "nccl" in name.lower()


def inside(records: Records, a: int, b: int) -> list:
    """The records that ran during [a, b]."""
    lo = bisect.bisect_left(records.starts, a - records.longest)
    hi = bisect.bisect_left(records.starts, b)
    return [r for r in records[lo:hi] if r[1] > a]


def busy_ns(intervals: list[tuple[int, int]], a: int, b: int) -> int:
    """How long at least one of `intervals` ran within [a, b]."""
    total, reach = 0, a
    for s, e in sorted(intervals):
        s, e = max(s, reach), min(e, b)
        if e > s:
            total += e - s
            reach = e
    return total


def gaps(intervals: list[tuple[int, int]], a: int, b: int) -> list[int]:
    """The stretches of [a, b] when none of `intervals` ran, in ns."""
    out, reach = [], a
    for s, e in sorted(intervals):
        if s > reach:
            out.append(min(s, b) - reach)
        reach = max(reach, e)
        if reach >= b:
            break
    if reach < b:
        out.append(b - reach)
    return [g for g in out if g > 0]


def q(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(p * len(v)))] if v else float("nan")


def short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def rank_summary(label: str, t: Trace, a: int, b: int, top: int) -> list[str]:
    span = (b - a) / 1e6
    ks = inside(t.kernels, a, b)
    out = [f"== {label}: {len(ks)} kernels in {span:.0f} ms"]
    all_busy = busy_ns([(s, e) for s, e, _, _ in ks], a, b) / 1e6
    compute = [(s, e) for s, e, _, n in ks if not is_nccl(n)]
    out.append(
        f"GPU busy {all_busy:.0f} ms ({all_busy / span:.0%}); without NCCL's kernels "
        f"{busy_ns(compute, a, b) / 1e6 / span:.0%}"
    )
    streams: dict[int, list] = defaultdict(list)
    for s, e, st, _ in ks:
        streams[st].append((s, e))
    out.append(f"  {len(streams)} streams (CUDA graphs' kernels count on streams of their own):")
    for st, iv in sorted(streams.items(), key=lambda x: -len(x[1]))[:4]:
        out.append(f"  stream {st}: {len(iv)} kernels, busy {busy_ns(iv, a, b) / 1e6 / span:.0%}")
    g = gaps([(s, e) for s, e, _, _ in ks], a, b)
    for lo in (0.02, 0.2, 1.0, 5.0):
        big = [x / 1e6 for x in g if x / 1e6 >= lo]
        out.append(f"  idle gaps >= {lo:g} ms: {len(big)}, {sum(big):.1f} ms in all")
    by_name: dict[str, list[float]] = defaultdict(list)
    for s, e, _, n in ks:
        by_name[n].append((e - s) / 1e3)
    out.append(f"  top kernels by time: total ms, count, median / p90 us ({len(by_name)} names)")
    for n, d in sorted(by_name.items(), key=lambda x: -sum(x[1]))[:top]:
        out.append(
            f"  {sum(d) / 1e3:8.1f} {len(d):7d} {statistics.median(d):8.1f} {q(d, 0.9):8.1f}  {short(n)}"
        )
    for what, recs in (("host waits", t.syncs), ("copies", t.copies), ("slow calls", t.calls)):
        grouped: dict[str, list[float]] = defaultdict(list)
        for s, e, _, n in inside(recs, a, b):
            grouped[n].append((e - s) / 1e6)
        out.append(f"  {what}: count, total ms, median / max ms")
        for n, d in sorted(grouped.items(), key=lambda x: -sum(x[1]))[:8]:
            out.append(
                f"    {len(d):6d} {sum(d):8.1f} {statistics.median(d):7.3f} {max(d):7.2f}  {short(n)}"
            )
    return out


def side_by_side(
    traces: dict[str, Trace], windows: dict[str, tuple[int, int]], top: int
) -> list[str]:
    """Median duration of each kernel name every trace runs, heaviest first."""
    medians: dict[str, dict[str, float]] = {}
    totals: dict[str, float] = defaultdict(float)
    for label, t in traces.items():
        a, b = windows[label]
        d: dict[str, list[float]] = defaultdict(list)
        for s, e, _, n in inside(t.kernels, a, b):
            d[n].append((e - s) / 1e3)
        medians[label] = {n: statistics.median(v) for n, v in d.items()}
        for n, v in d.items():
            totals[n] += sum(v)
    labels = list(traces)
    common = [n for n in totals if all(n in medians[x] for x in labels)]
    out = ["== kernels every trace runs: median us (" + " / ".join(labels) + ")"]
    for n in sorted(common, key=lambda n: -totals[n])[:top]:
        vals = " ".join(f"{medians[x][n]:8.1f}" for x in labels)
        out.append(f"  {vals}  {short(n, 60)}")
    return out


def periods(
    events: timeline_report.Events, steady: list[int], traces: dict[int, Trace], over_ms: float
) -> list[str]:
    """Each rank-0 step period split, per GPU, into compute, NCCL and idle ms."""
    rows: dict[tuple[bool, int], list[tuple[float, float, float]]] = defaultdict(list)
    for s in steady:
        a, b = events[(0, "build", s)], events[(0, "build", s + 1)]
        slow = timeline_report.period_ms(events, s) > over_ms
        for rank, t in traces.items():
            ks = inside(t.kernels, a, b)
            compute = busy_ns([(x, y) for x, y, _, n in ks if not is_nccl(n)], a, b)
            nccl = busy_ns([(x, y) for x, y, _, n in ks if is_nccl(n)], a, b)
            allk = busy_ns([(x, y) for x, y, _, _ in ks], a, b)
            rows[(slow, rank)].append((compute / 1e6, nccl / 1e6, (b - a - allk) / 1e6))
    out = [f"== rank 0's step periods (median ms; slow: over {over_ms:g} ms)"]
    out.append("  periods  rank  compute  nccl  idle   (nccl overlaps compute where streams do)")
    for slow in (False, True):
        for rank in sorted(traces):
            r = rows.get((slow, rank), [])
            if not r:
                continue
            c, n, i = (statistics.median(x[k] for x in r) for k in range(3))
            out.append(
                f"  {'slow' if slow else 'normal':7s} {len(r):4d} {rank:4d} {c:8.2f} {n:5.2f} {i:5.2f}"
            )
    return out


def dump(
    path: Path,
    events: timeline_report.Events,
    steady: list[int],
    traces: dict[int, Trace],
    over_ms: float,
) -> None:
    """Every record and mark from 200 ms before the middle slow period to 400 ms after it
    (several normal periods and slow ones)."""
    slow = [s for s in steady if timeline_report.period_ms(events, s) > over_ms]
    if not slow:
        return
    s = slow[len(slow) // 2]
    a, b = events[(0, "build", s)] - 200_000_000, events[(0, "build", s)] + 400_000_000
    lines = []
    for (rank, event, step), ns in events.items():
        if a <= ns <= b:
            lines.append((ns, f"mark r{rank} {event} step {step}"))
    for rank, t in traces.items():
        for kind, recs in (("K", t.kernels), ("C", t.copies), ("S", t.syncs), ("A", t.calls)):
            for x, y, st, n in inside(recs, a, b):
                lines.append((x, f"{kind} r{rank} +{(y - x) / 1e3:.0f}us s{st} {short(n, 90)}"))
    lines.sort()
    path.write_text("".join(f"{(ns - a) / 1e6:9.3f} {text}\n" for ns, text in lines))


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("traces", type=Path, help="CUPTI_TRACE_DIR of the run")
    p.add_argument("timeline", type=Path, help="MLX_RELAY_TIMELINE of the same run")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--skip", type=int, default=200)
    p.add_argument("--over", type=float, default=25.0, help="a slow period, ms")
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--alone",
        type=Path,
        help="traces of a 1-rank run to set beside (its timeline: ALONE/tl; the rank: the largest trace)",
    )
    p.add_argument("--dump", type=Path)
    args = p.parse_args()

    events, carries = timeline_report.read(args.timeline)
    steady = timeline_report.steady_steps(events, carries, args.skip, args.tokens)
    if not steady:
        print("no steady steps")
        return 1
    a, b = events[(0, "build", steady[0])], events[(0, "build", steady[-1] + 1)]
    traces = read_traces(args.traces)
    print(f"{len(steady)} steady steps of {args.tokens} tokens, {(b - a) / 1e6:.0f} ms")
    for rank, t in sorted(traces.items()):
        print("\n".join(rank_summary(f"rank {rank}", t, a, b, args.top)))
    labelled = {f"rank {r}": t for r, t in sorted(traces.items())}
    windows = {label: (a, b) for label in labelled}
    if args.alone:
        ev1, ca1 = timeline_report.read(args.alone / "tl")
        st1 = timeline_report.steady_steps(ev1, ca1, args.skip, args.tokens)
        files = sorted(args.alone.glob("rank*-*.tsv"), key=lambda f: f.stat().st_size)
        alone = read_trace(files[-1]) if files else None
        if st1 and alone:
            labelled["alone"] = alone
            windows["alone"] = (ev1[(0, "build", st1[0])], ev1[(0, "build", st1[-1] + 1)])
            print("\n".join(rank_summary("1 rank alone", alone, *windows["alone"], args.top)))
    print("\n".join(side_by_side(labelled, windows, args.top)))
    print("\n".join(periods(events, steady, traces, args.over)))
    if args.dump:
        dump(args.dump, events, steady, traces, args.over)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
