"""The `mlx-relay` command: each part of the package registers its own subcommands."""

from __future__ import annotations

import argparse
import os
import sys

from mlx_relay.errors import add_log_level, run_command


def build_parser() -> argparse.ArgumentParser:
    from mlx_relay.client import cli as client_cli
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
    for command in sub.choices.values():
        if command.get_default("log_level") is None:  # serve and local define their own
            add_log_level(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    # gRPC's C core logs failed TLS handshakes and the like on stderr at INFO; the
    # commands say what went wrong themselves. GRPC_VERBOSITY=INFO brings them back.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    args = build_parser().parse_args(argv)
    return run_command(args.command, args.func, args)


if __name__ == "__main__":
    sys.exit(main())
