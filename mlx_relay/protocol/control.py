"""Side-channel messages: worker <-> rank 0 over pyzmq, beside the ring.

The ring (mx.distributed) has no timeouts and cannot be polled, so everything that
must work while a rank is stuck or asleep travels here: hello, heartbeats, error
details, and rank 0's bye. Every message is
signed with the per-cluster secret so a stranger on the network cannot inject one.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import socket
import time
from typing import Any

# Message kinds.
HELLO = "hello"  # worker -> rank 0: rank, host, pid, free memory, library versions
HEARTBEAT = "heartbeat"  # worker -> rank 0: memory and state, every interval
ERROR = "error"  # worker -> rank 0: details of a failed step (step_id, message)
LOADED = "loaded"  # worker -> rank 0: model fingerprint and memory after CMD_LOAD
STAGING = "staging"  # worker -> rank 0: how far its shard's staging is (--stage-weights)
BYE = "bye"  # rank 0 -> worker: rank 0 is gone or stopping; exit

SECRET_ENV = "MLX_RELAY_SECRET"
HOST_NAME_ENV = "MLX_RELAY_HOST_NAME"  # the name a rank gives its machine (default: hostname)
CONTROL_ENV = "MLX_RELAY_CONTROL"  # tcp://host:port of rank 0's side channel


# A peer whose side-channel connection closed counts as gone once it stays closed this
# long (a process that died); both ends use it, so that neither outlives the other long.
LINK_GRACE_S = 0.5

# A side-channel thread that found itself more than this late on its own schedule was
# held up (its process stopped, or its thread starved on a busy machine): what it has not
# heard meanwhile may be waiting unread in zmq's own I/O thread, which was held up too. So
# silence is counted again from the end of such a hold-up, never across it.
HELD_UP_S = 1.0


class HoldUps:
    """A side-channel thread's hold-ups, told from its own turns (`turn` once a round of
    its loop, which comes every `interval` or sooner): `until`, the end of the last one,
    from which a peer's silence is counted again; `behind`, one going on now."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.turned_at = self.until = time.monotonic()

    def turn(self, now: float) -> None:
        if self.behind(now):
            self.until = now
        self.turned_at = now

    def behind(self, now: float) -> bool:
        return now - self.turned_at > self.interval + HELD_UP_S


def host_name() -> str:
    """The name of this rank's machine, in its hello, errors and status: the hostname,
    unless MLX_RELAY_HOST_NAME names it (a friendlier name; or, in the tests, several
    ranks of one machine posing as machines of their own). Ranks with the same name are
    on one machine, which the default split counts as equally fast."""
    return os.environ.get(HOST_NAME_ENV) or socket.gethostname()


# The libraries whose versions decide a rank's tokens: ranks that differ in one may not
# serve together (rank 0 compares every worker's hello with its own).
TOKEN_LIBRARIES = ("mlx", "mlx-lm", "mlx-relay")


@functools.cache
def versions() -> dict[str, str]:
    """This rank's versions of TOKEN_LIBRARIES ("" for one not installed)."""
    from importlib import metadata

    found = {}
    for name in TOKEN_LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = ""
    return found


def version_differences(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """What differs between two ranks' versions(), as "mlx 0.29.1 here, 0.29.0 there"."""
    return [
        f"{name} {mine.get(name) or 'missing'} on rank 0, {theirs.get(name) or 'missing'} there"
        for name in TOKEN_LIBRARIES
        if mine.get(name) != theirs.get(name)
    ]


def identity(rank: int, role: str) -> bytes:
    """A worker socket's zmq identity: which rank, and which of its sockets ('cmd', 'hb')."""
    return f"rank{rank}-{role}".encode()


def parse_identity(identity: bytes) -> tuple[int, str] | None:
    """`identity` read back: (rank, role), or None for a socket that is not one of ours."""
    try:
        name, role = identity.decode().split("-", 1)
        return int(name.removeprefix("rank")), role
    except (UnicodeDecodeError, ValueError):
        return None


class BadMessage(ValueError):
    """A side-channel message that fails its signature or does not parse."""


def cluster_secret() -> bytes:
    """The shared secret; an unset secret is the empty key (local development only)."""
    return os.environ.get(SECRET_ENV, "").encode()


def new_secret() -> str:
    return os.urandom(24).hex()


def sign(payload: bytes, secret: bytes) -> list[bytes]:
    """The frames of a signed message: the payload, then its HMAC."""
    return [payload, hmac.new(secret, payload, hashlib.sha256).digest()]


def verify(frames: list[bytes], secret: bytes) -> bytes:
    """The payload of a signed message; BadMessage if it is not one of ours."""
    if len(frames) != 2:
        raise BadMessage(f"expected 2 frames, got {len(frames)}")
    payload, mac = frames
    expected = hmac.new(secret, payload, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        raise BadMessage("signature does not match the cluster secret")
    return payload


def encode(kind: str, body: dict[str, Any], secret: bytes) -> list[bytes]:
    return sign(json.dumps({"kind": kind, **body}, separators=(",", ":")).encode(), secret)


def decode(frames: list[bytes], secret: bytes) -> dict[str, Any]:
    payload = verify(frames, secret)
    try:
        message = json.loads(payload)
    except ValueError as e:
        raise BadMessage(f"not JSON: {e}") from e
    if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
        raise BadMessage("message has no kind")
    return message
