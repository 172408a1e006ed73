"""Each GPU's utilisation while a benchmark ran, from `nvidia-smi --query-gpu=timestamp,
index,utilization.gpu --format=csv,noheader -lms 200` (bench/gpu/measure.sh writes it):
the median over the samples where any GPU was busy, so the idle start and end (model
loading, the client's set-up) do not count. A GPU kept fed reads near 100%. Beware: an
NCCL all-sum waiting for its peer is a kernel running, so a rank whose receive is posted
ahead (a worker's, on CUDA) reads 100% while it waits; the timeline's device marks
(bench/timeline_report.py) say what it computed."""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict


def busy_medians(lines: list[str]) -> dict[int, float]:
    """GPU index -> median utilisation (%) over the timestamps at which any GPU ran."""
    by_time: dict[str, dict[int, float]] = defaultdict(dict)
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[2].endswith("%"):
            continue
        by_time[parts[0]][int(parts[1])] = float(parts[2].rstrip(" %"))
    busy = [sample for sample in by_time.values() if max(sample.values()) > 0]
    gpus = sorted({g for sample in busy for g in sample})
    return {g: statistics.median(s[g] for s in busy if g in s) for g in gpus}


def main() -> int:
    path = sys.argv[1]
    with open(path) as f:
        medians = busy_medians(f.read().splitlines())
    shown = ", ".join(f"GPU {g} {m:.0f}%" for g, m in medians.items()) or "no busy samples"
    print(f"utilisation while busy ({path}): {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
