"""`mlx-relay hostfile check|make`: find hostfile mistakes before ssh-ing into anything."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlx_relay.launch.hostfile import (
    BACKENDS,
    KIND_RING_ENV,
    OVERS,
    HostfileError,
    check_hostfile,
    effective_backend,
    format_hostfile,
    load_hostfile,
    make_hostfile,
)
from mlx_relay.model.split import AUTO, layer_ranges, split_layers


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "hostfile",
        help="check or make a hostfile for mlx.launch",
        description="Check or make hostfiles for mlx.launch (see hostfiles/README.md).",
    )
    sub = p.add_subparsers(dest="hostfile_command", required=True, metavar="{check,make}")

    c = sub.add_parser(
        "check",
        help="check a hostfile (mlx.launch format or an MLX_HOSTFILE address list)",
        description="Print OK and exit 0, or print each problem and exit 1.",
    )
    c.add_argument("file", help="the hostfile to check")
    c.add_argument("--backend", help=f"check for this backend ({', '.join(BACKENDS)})")
    c.add_argument("--num-layers", type=int, help="the model's layer count")
    c.add_argument("--layers", help="layer counts per rank, a,b,c (or auto, balanced, even)")
    c.set_defaults(func=run_check)

    m = sub.add_parser(
        "make",
        help="write a hostfile for some hosts",
        description="Print a hostfile (or write it with -o). Hosts are NAME, IP or NAME=IP.",
    )
    m.add_argument("--hosts", help="comma-separated hosts in rank order: NAME, IP or NAME=IP")
    m.add_argument("-n", "--ranks", type=int, help="with --over local: this many ranks")
    m.add_argument("--over", required=True, choices=OVERS, help="how the hosts are connected")
    m.add_argument("--backend", choices=("ring", "jaccl", "jaccl-ring", "mpi"), default=None)
    m.add_argument("-o", "--output", help="write the hostfile here instead of printing it")
    m.set_defaults(func=run_make)


NAMED_SPLITS = (AUTO, "balanced", "even")  # decided from the model (or memory), not counts


def run_check(args: argparse.Namespace) -> int:
    try:
        hf = load_hostfile(args.file)
    except HostfileError as e:
        print(e)
        return 1
    layers = None
    spec = (args.layers or "").strip()
    if spec and spec not in NAMED_SPLITS:
        try:
            layers = [int(x) for x in args.layers.split(",")]
        except ValueError:
            print(f"--layers {args.layers!r}: expected comma-separated counts, e.g. 10,12,8")
            return 1
    problems = check_hostfile(hf, backend=args.backend, num_layers=args.num_layers, layers=layers)
    if problems:
        for p in problems:
            print(f"{args.file}: {p}")
        return 1
    backend = effective_backend(hf, args.backend)
    if hf.kind == KIND_RING_ENV:
        backend += " (MLX_HOSTFILE address list)"
    elif not (args.backend or hf.backend):
        backend += " (mlx.launch default)"
    print(f"OK: {len(hf.hosts)} hosts, backend {backend}")
    if args.num_layers and (layers or spec == "even"):
        counts = layers or split_layers(args.num_layers, len(hf.hosts))
        spans = ", ".join(f"rank {r}: [{a}, {b})" for r, (a, b) in enumerate(layer_ranges(counts)))
        print(f"layers {counts}: {spans}")
    elif args.num_layers:
        print(
            f"layers: {spec or 'balanced'}, decided at load from "
            + ("each rank's free memory" if spec == AUTO else "the model's weights")
        )
    return 0


def run_make(args: argparse.Namespace) -> int:
    if args.hosts:
        hosts = [h.strip() for h in args.hosts.split(",")]
    elif args.over == "local" and args.ranks:
        hosts = ["127.0.0.1"] * args.ranks
    else:
        print("error: give --hosts a,b,c (or -n N with --over local)", file=sys.stderr)
        return 2
    if args.ranks and len(hosts) != args.ranks:
        print(f"error: -n {args.ranks} but {len(hosts)} hosts given", file=sys.stderr)
        return 2
    try:
        data = make_hostfile(hosts, args.over, backend=args.backend)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = format_hostfile(data)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: {len(data['hosts'])} hosts, backend {data['backend']}")
    else:
        sys.stdout.write(text)
    if args.over == "thunderbolt":
        print(
            "note: the Thunderbolt addresses and rdma device names are placeholders in "
            "mlx.distributed_config's scheme; see hostfiles/README.md to put in the real ones",
            file=sys.stderr,
        )
    return 0
