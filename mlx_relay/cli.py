"""The `mlx-relay` command: each part of the package registers its own subcommands."""

from __future__ import annotations

import argparse
import os
import sys

from mlx_relay.errors import add_log_level, run_command


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand, or only `serve` where `command` is "serve": that is how every
    rank starts, and a rank has no use for the client's and the launchers' imports
    (about 0.2 s of each rank's start, every restart included)."""
    from mlx_relay.launch import serve

    parser = argparse.ArgumentParser(
        prog="mlx-relay",
        description="Pipeline-parallel LLM inference over several machines with MLX.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(sub)
    if command != "serve":
        from mlx_relay.client import cli as client_cli
        from mlx_relay.launch import demo, hostfile_cli, local, mlx_launch

        local.add_parser(sub)
        client_cli.add_parsers(sub)
        hostfile_cli.add_parser(sub)
        mlx_launch.add_parser(sub)
        demo.add_parser(sub)
    for subcommand in sub.choices.values():
        if subcommand.get_default("log_level") is None:  # serve and local define their own
            add_log_level(subcommand)
    return parser


def main(argv: list[str] | None = None) -> int:
    # gRPC's C core logs failed TLS handshakes and the like on stderr at INFO; the
    # commands say what went wrong themselves. GRPC_VERBOSITY=INFO brings them back.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    return run_command(args.command, args.func, args)


if __name__ == "__main__":
    sys.exit(main())
