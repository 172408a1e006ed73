"""Errors a person can fix, and how every command reports them: one line, no traceback.

A command raises `UserError` (or a subclass) for anything the user can act on: a
model path that is not a model, a layer split that does not fit, a message that is
not UTF-8, a cluster that cannot be reached. `run_command` prints it as one line on
stderr and returns a non-zero code; tracebacks are shown only with
`--log-level DEBUG` (or `MLX_RELAY_LOG=DEBUG`), for unexpected errors as well.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

EXIT_USER_ERROR = 2  # as argparse: the command line (or what it names) is wrong
EXIT_FAILED = 1  # the command could not do its job (an RPC failed, a cluster is unreachable)
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


class UserError(Exception):
    """Something the user can fix, said in one line that names what and how."""

    exit_code = EXIT_USER_ERROR


class InvalidRequest(ValueError):
    """A request the server refuses; the message names the field and says why.

    Raised wherever a request is checked before it reaches the engine (the request's own
    fields in coordinator/requests.py, its grammars and tools in the text layer); every
    door answers it as the client's error. It lives here, below both, so that either
    can raise it."""


def json_field(raw: str, name: str, kind: type, shape: str = "") -> Any:
    """A request field that carries JSON text, parsed: None when blank, InvalidRequest
    naming `name` when it is not JSON or not a `kind` (`shape`: how to say what it must
    be, "a JSON <kind>" when not given). Every door's JSON-in-a-string field goes here."""
    if not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise InvalidRequest(f"{name} is not valid JSON: {e}") from e
    if not isinstance(value, kind):
        raise InvalidRequest(f"{name} must be {shape or 'a JSON ' + kind.__name__}")
    return value


class ModelError(UserError, ValueError):
    """The model named cannot be served: missing, not a model, incomplete, not supported."""


class CommandFailed(UserError):
    """The command could not do its job, for a reason one line can name (a cluster that
    cannot be reached, a token it refuses, a request it rejects)."""

    exit_code = EXIT_FAILED


def add_log_level(p: argparse.ArgumentParser) -> None:
    """`--log-level`, shared by every command; DEBUG also shows tracebacks."""
    p.add_argument(
        "--log-level",
        default=os.environ.get("MLX_RELAY_LOG", "INFO"),
        help="DEBUG, INFO, WARNING or ERROR (default: $MLX_RELAY_LOG or INFO); "
        "DEBUG also prints tracebacks",
    )


def debugging(args: argparse.Namespace) -> bool:
    return str(getattr(args, "log_level", "")).upper() == "DEBUG"


def run_command(name: str, func: Callable[[argparse.Namespace], int | None], args) -> int:
    """Run one command; errors become one line on stderr and an exit code."""
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line ^C left open, say nothing more
        return EXIT_INTERRUPTED
    except UserError as e:
        if debugging(args):
            logging.getLogger("mlx_relay").exception("%s", e)
        print(f"mlx-relay {name}: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:
        # `mlx-relay ... | head`: the reader left. Point stdout at /dev/null so that the
        # flush at exit does not complain about the closed pipe as well.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - the last resort: still one line
        if debugging(args):
            raise
        print(
            f"mlx-relay {name}: {type(e).__name__}: {e} (--log-level DEBUG shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILED
