"""The floor of a pipeline token: one round trip of the ring, measured with the real hop.

    .venv/bin/python bench/bench_hop.py [--hidden 4096] [--dtype bfloat16] [--trips 500] [--gpus G]
        [--hop-mode ready|eager|collective]

Two ranks on loopback pass a decode step's payload, one hidden state (1, 1, hidden),
round the ring with mlx-relay's own hop (ring.py: the header on the doorbell, the
payload over `mx.distributed`, each send after its payload is computed; with ready hops a
payload up to MLX_RELAY_INLINE_MAX_BYTES rides in the header's message instead), and rank 1
adds one to it on its device as a stand-in for its layers. A token on N ranks costs
at least its compute plus one such round trip, so this is the floor the 2-rank
decode ratio is measured against. `--gpus G` puts rank r on GPU r mod G; `--hop-mode eager`
runs sends and receives on the CPU streams eager hops use, `collective` each payload as
an all-sum of the pair (NCCL on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rank_main(args: argparse.Namespace) -> None:
    import mlx.core as mx

    from mlx_relay.protocol import header as hdr
    from mlx_relay.transport.collective import gpu_tags, payload_groups
    from mlx_relay.transport.doorbell import Doorbell
    from mlx_relay.transport.ring import COLLECTIVE, Ring

    group = mx.distributed.init(backend="ring", strict=True)
    rank = group.rank()
    bells = json.loads(os.environ["BENCH_BELLS"])
    collective = args.hop_mode == COLLECTIVE
    payloads = payload_groups(group, "127.0.0.1", gpu_tags(group)) if collective else None
    ring = Ring(group, Doorbell(rank, 2, bells, b"bench"), args.hop_mode, payloads=payloads)
    shape = (1, 1, args.hidden)
    header = hdr.StepHeader(
        cmd=hdr.CMD_FORWARD,
        slots=[0],
        offsets=[0],
        lengths=[1],
        payload_kind=hdr.PAYLOAD_HIDDEN,
        payload_dtype=args.dtype,
        payload_shape=shape,
    )
    if rank == 1:
        for _ in range(args.trips + args.warmup):
            back = ring.recv_header()
            payload = ring.post_recv_payload(back)
            sent = ring.send(back, payload + 1, reads=[payload])
        mx.eval(sent)  # the last send has left before this process does
        return
    x = mx.zeros(shape, dtype=getattr(mx, args.dtype))
    times = []
    for i in range(args.trips + args.warmup):
        t0 = time.perf_counter()
        header.step_id = i + 1
        ring.choose_path(header, alone=True)
        ring.send(header, x + 1)
        back = ring.recv_header()
        x = ring.post_recv_payload(back)
        mx.eval(x)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    print(
        f"device {mx.default_device()}  {args.hop_mode} hops  payload {shape} {args.dtype}  {args.trips} round trips: "
        f"median {statistics.median(times) * 1e6:.0f} us, "
        f"p90 {times[int(0.9 * len(times))] * 1e6:.0f} us"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--trips", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--gpus", type=int, default=0)
    ap.add_argument("--hop-mode", choices=("ready", "eager", "collective"), default="ready")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        rank_main(args)
        return 0
    from mlx_relay.launch.local import free_ports

    ports = free_ports(5)
    workdir = Path(tempfile.mkdtemp(prefix="bench-hop-"))
    hostfile = workdir / "hostfile.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[:2]]))
    bells = json.dumps([f"tcp://127.0.0.1:{p}" for p in ports[2:4]])
    procs = []
    for rank in range(2):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        env["BENCH_BELLS"] = bells
        env["NCCL_PORT"] = str(ports[4])
        if args.gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(rank % args.gpus)
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank", *sys.argv[1:]], env=env))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
