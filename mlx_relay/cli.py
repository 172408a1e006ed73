"""The `mlx-relay` command: each part of the package registers its own subcommands."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from mlx_relay.coordinator import client_cli
    from mlx_relay.launch import demo, hostfile_cli, local, mlx_launch, serve

    parser = argparse.ArgumentParser(
        prog="mlx-relay",
        description="Pipeline-parallel LLM inference over several machines with MLX.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(sub)
    local.add_parser(sub)
    client_cli.add_parsers(sub)
    hostfile_cli.add_parser(sub)
    mlx_launch.add_parser(sub)
    demo.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
