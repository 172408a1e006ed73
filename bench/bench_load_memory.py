"""Peak memory while loading: the whole model in one process against each rank's shard.

    .venv/bin/python bench/bench_load_memory.py [--model default] [--ranks 2,3]

Each measurement runs in a fresh process, so every peak is that load alone.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MEASURE = r"""
import sys, mlx.core as mx
from pathlib import Path
from mlx_lm.utils import load_model
from mlx_relay.model import sharding
path, start, end, ends = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
if start < 0:
    load_model(Path(path))
else:
    sharding.load_shard(Path(path), start, end, has_ends=ends)
print(mx.get_peak_memory())
"""


def peak(path: Path, start: int = -1, end: int = -1, ends: bool = True) -> float:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), str(start), str(end), "1" if ends else "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[-1]) / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--ranks", default="2,3")
    args = ap.parse_args()
    from mlx_relay.model import sharding
    from mlx_relay.model.default_model import resolve_model
    from mlx_relay.model.split import layer_ranges, split_layers

    path = resolve_model(args.model)
    layers = sharding.count_layers(sharding.read_config(path))
    whole = peak(path)
    print(f"whole model, one process: peak {whole:.1f} MiB")
    for n in (int(x) for x in args.ranks.split(",")):
        ranges = layer_ranges(split_layers(layers, n))
        peaks = [peak(path, a, b, ends=(r == 0)) for r, (a, b) in enumerate(ranges)]
        cells = ", ".join(
            f"rank {r} [{a},{b}) {p:.1f} MiB"
            for r, ((a, b), p) in enumerate(zip(ranges, peaks, strict=True))
        )
        print(f"{n} ranks: {cells}; largest/whole {max(peaks) / whole:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
