"""How long `local` takes to start a cluster, with its ranks forked by the zygote or spawned.

    .venv/bin/python bench/bench_rank_start.py [--model default] [-n 3] [--rounds 3]

Each round starts the same cluster twice, one way then the other (`MLX_RELAY_ZYGOTE`),
and stops it: the seconds until it serves, and each rank's CPU seconds by then (psutil,
read as soon as the cluster serves, so a rank's start and its model load). The zygote's
own imports are paid once per launcher, before the first round, and shown apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_relay.launch import zygote  # noqa: E402
from mlx_relay.launch.local import LocalCluster, free_ports  # noqa: E402


def start_once(model: str, n: int, log_dir: Path) -> tuple[float, list[float]]:
    """Seconds until the cluster serves, and its ranks' CPU seconds by then."""
    address = f"127.0.0.1:{free_ports(1)[0]}"
    cluster = LocalCluster(n, ["--model", model], grpc_address=address, log_dir=log_dir)
    started = time.monotonic()
    cluster.start()
    try:
        cluster.wait_serving(120)
        took = time.monotonic() - started
        cpu = [sum(psutil.Process(p.pid).cpu_times()[:2]) for p in cluster.procs]
    finally:
        cluster.stop()
    return took, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("-n", type=int, default=3, help="ranks")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not zygote.enabled():
        print("the zygote is off here (not Linux, or MLX_RELAY_ZYGOTE=0): nothing to compare")
        return 1
    began = time.monotonic()
    forks = zygote.shared()
    assert forks is not None
    print(f"the zygote imported in {time.monotonic() - began:.2f} s (once per launcher)")
    results: dict[str, list[tuple[float, list[float]]]] = {"spawned": [], "forked": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for way, flag in (("spawned", "0"), ("forked", "1")):
                os.environ[zygote.ZYGOTE_ENV] = flag
                results[way].append(start_once(args.model, args.n, Path(tmp) / f"{way}{r}"))
    print(f"{args.n} ranks serving {args.model}, {args.rounds} rounds, medians:")
    for way, runs in results.items():
        took = statistics.median(t for t, _ in runs)
        cpu = statistics.median(c for _, cpus in runs for c in cpus)
        print(f"  {way:8s} serving after {took:5.2f} s; a rank's CPU {cpu:5.2f} s")
    spawned = statistics.median(t for t, _ in results["spawned"])
    forked = statistics.median(t for t, _ in results["forked"])
    print(f"forked / spawned start time: {forked / spawned:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
