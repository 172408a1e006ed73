"""What both ends of the gRPC port agree on beyond `relay.proto`.

Rank 0's server (`api`), the clients (`client`) and the launchers must agree on where
rank 0 listens by default and how the bearer token travels, so all take it from here.
The token should come from the environment (`MLX_RELAY_AUTH_TOKEN`) rather than the
command line, where `ps` shows it.
"""

from __future__ import annotations

import os

DEFAULT_GRPC_ADDRESS = "127.0.0.1:50051"  # rank 0's gRPC address unless told otherwise

AUTH_TOKEN_ENV = "MLX_RELAY_AUTH_TOKEN"
HEADER = "authorization"  # gRPC metadata key (lower case, as gRPC requires)
SCHEME = "bearer "  # compared case-insensitively, as HTTP does


def auth_token(explicit: str | None = None) -> str:
    """The token from an option if given, else from the environment ('' = no auth)."""
    return explicit if explicit else os.environ.get(AUTH_TOKEN_ENV, "")
