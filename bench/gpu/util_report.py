"""Each GPU's utilisation while a benchmark ran, from `nvidia-smi --query-gpu=timestamp,
index,utilization.gpu --format=csv,noheader -lms 200` (bench/gpu/measure.sh writes it):
the mean of every 5 seconds, GPU by GPU, so the phases of a run (loading, one rank, two
ranks) show apart. A GPU kept fed reads near 100%. Beware: an NCCL all-sum waiting for
its peer is a kernel running, so a rank whose receive is posted ahead (a worker's, on
CUDA) reads 100% while it waits; the timeline's device marks (bench/timeline_report.py)
say what it computed."""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from datetime import datetime

WINDOW_S = 5.0


def windows(lines: list[str]) -> list[tuple[float, dict[int, float]]]:
    """(seconds from the first sample, {GPU index: mean utilisation %}) per window."""
    samples: list[tuple[datetime, int, float]] = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[2].endswith("%"):
            continue
        when = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
        samples.append((when, int(parts[1]), float(parts[2].rstrip(" %"))))
    if not samples:
        return []
    start = samples[0][0]
    grouped: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for when, gpu, value in samples:
        grouped[int((when - start).total_seconds() // WINDOW_S)][gpu].append(value)
    return [
        (w * WINDOW_S, {g: statistics.mean(v) for g, v in sorted(gpus.items())})
        for w, gpus in sorted(grouped.items())
    ]


def main() -> int:
    path = sys.argv[1]
    with open(path) as f:
        rows = windows(f.read().splitlines())
    print(f"GPU utilisation, mean of each {WINDOW_S:.0f} s ({path}):")
    for seconds, gpus in rows:
        if any(gpus.values()):  # (idle stretches left out)
            shown = "  ".join(f"GPU {g} {v:3.0f}%" for g, v in gpus.items())
            print(f"  {seconds:5.0f} s  {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
