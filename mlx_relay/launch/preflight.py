"""What can be checked before any rank starts: is it a model, do the ranks and the split fit.

Launchers run these checks first, in about a second, so that a wrong path or split is
one line on the terminal instead of N processes that each fail (or wait) in turn.
`serve` runs them as well, for ranks started some other way. The checks read
config.json and the safetensors headers only: no weight is loaded.
"""

from __future__ import annotations

import errno
import json
import socket
import ssl
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_relay.errors import ModelError, UserError


@dataclass(frozen=True)
class ModelFacts:
    """What the launcher needs to know about a model to plan a cluster."""

    spec: str
    path: Path
    model_type: str
    num_layers: int
    head_layers: float  # the LM head's cost in decoder layers (for --layers balanced)
    tail: int = 0  # layers the last rank must hold together (sharding.kv_shared_tail)


def check_model(spec: str) -> ModelFacts:
    """`spec` ('default' or a path) names an MLX model mlx-lm can build; its facts.

    'default' is converted here, once, if it has not been yet (before any rank starts,
    so that ranks do not queue for the conversion lock).
    """
    from mlx_relay.model.default_model import resolve_model

    path = resolve_model(spec)  # ModelNotFoundError (a UserError) says what is missing
    config = _read_config(path)
    _check_weights(path)
    # Only now mlx-lm (and transformers through it: a second of CPU), so that a wrong
    # path, an empty directory or a cut-short copy is refused at once.
    from mlx_relay.model import sharding

    model_type = _check_family(path, config)
    try:
        num_layers = sharding.count_layers(config)
    except ValueError as e:
        raise ModelError(f"model {spec!r}: {path / 'config.json'}: {e}") from None
    if num_layers < 1:
        raise ModelError(f"model {spec!r}: config.json says it has {num_layers} layers")
    head = sharding.head_cost_in_layers(config)
    return ModelFacts(spec, path, model_type, num_layers, head, sharding.kv_shared_tail(config))


def check_ranks(facts: ModelFacts, n: int) -> None:
    """Every rank holds at least one layer, so a model of L layers takes at most L ranks."""
    if n < 1:
        raise UserError(f"{n} ranks: a cluster has at least 1")
    if n > facts.num_layers:
        raise UserError(
            f"{n} ranks for {facts.spec!r}, which has {facts.num_layers} layers: every rank "
            f"needs at least one, so use at most {facts.num_layers}"
        )


def check_split(facts: ModelFacts, n: int, layers: str) -> list[int] | str | None:
    """`--layers` for this model and `n` ranks: counts, AUTO, or None (the default split)."""
    from mlx_relay.model.split import resolve_layers

    check_ranks(facts, n)
    try:
        return resolve_layers(layers, facts.num_layers, n, facts.head_layers, tail=facts.tail)
    except ValueError as e:
        raise UserError(str(e)) from None


def check_hop_mode(mode: str, n: int) -> None:
    """Collective (and adaptive) hops are all-sums of the pair a hop joins: off CUDA, where
    the ring group is the only group, a cluster of 2 ranks. (On CUDA every neighbouring
    pair gets an NCCL communicator of its own, so any size; the ranks check it at start.)"""
    from mlx_relay.device import on_cuda
    from mlx_relay.transport.collective import check_pair
    from mlx_relay.transport.ring import PAIRED_MODES

    if mode in PAIRED_MODES and not on_cuda():
        try:
            check_pair(n)
        except ValueError as e:
            raise UserError(str(e)) from None


def check_tensor_parallel(
    tensor: int, n: int, hop_mode: str, layers: str | None, backend: str = "ring"
) -> None:
    """`--tensor-parallel tensor` fits a cluster of `n` ranks with `--hop-mode hop_mode`
    and `--layers layers` (transport/tensor.py's check_layout), and a stage x tensor
    grid the ranks' `backend` (MPI splits groups; on CUDA, NCCL does), said before any
    rank starts."""
    from mlx_relay.device import on_cuda
    from mlx_relay.transport.tensor import TensorLayoutError, check_grid_backend, check_layout

    try:
        check_layout(tensor, n, hop_mode, layers)
        check_grid_backend(tensor, n, backend, splits=backend == "mpi" or on_cuda())
    except TensorLayoutError as e:
        raise UserError(str(e)) from None


def check_listen(address: str) -> None:
    """Nothing listens on the gRPC address `host:port` yet, and it is this machine's."""
    host, _, port = address.rpartition(":")
    if address.startswith("unix:") or not port.isdigit():
        return  # gRPC checks the forms it accepts itself
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            # As gRPC binds: a port a closed server left in TIME_WAIT is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(infos[0][4])
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UserError(
                f"{address} is in use (another cluster? `mlx-relay free --shutdown --address "
                f"{address}` stops it); choose another with --grpc-address"
            ) from None
        raise UserError(f"cannot listen on {address}: {e.strerror or e}") from None


def check_tls(cert: str, key: str) -> None:
    """--tls-cert and --tls-key come together and make a certificate with its key."""
    if not cert and not key:
        return
    if not (cert and key):
        raise UserError("TLS needs both --tls-cert and --tls-key")
    for option, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not Path(path).is_file():
            raise UserError(f"{option} {path}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise UserError(f"TLS: --tls-cert {cert} with --tls-key {key}: {e}") from None


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelError(f"{path / 'config.json'} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path / 'config.json'} is not a JSON object")
    return config


def _check_weights(path: Path) -> None:
    """mlx-lm loads `model*.safetensors`; each must be whole (a copy may have stopped short)."""
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise ModelError(
            f"{path} has no weights (model*.safetensors): not an MLX model directory; "
            "`mlx_lm.convert` writes one"
        )
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelError(f"{index} is not a readable weight index: {e}") from None
        missing = sorted(named - {f.name for f in files})
        if missing:
            raise ModelError(f"{path} lacks weight files its index names: {', '.join(missing)}")
    for f in files:
        _check_safetensors(f)


def _check_safetensors(file: Path) -> None:
    """The header parses and the file is as long as the header says."""
    try:
        with open(file, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError) as e:
        raise ModelError(f"{file} is not a safetensors file: {e}") from None
    expected = 8 + size + max(ends, default=0)
    actual = file.stat().st_size
    if actual < expected:
        raise ModelError(
            f"{file} is cut short: {actual} bytes, its header needs {expected} "
            "(an interrupted copy or download?)"
        )


def _check_family(path: Path, config: dict[str, Any]) -> str:
    """mlx-lm has the model's architecture (the check `mlx_lm.load` makes first)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelError(f"{path / 'config.json'} has no model_type")
    if config.get("model_file"):
        raise ModelError(
            f"{path}: model_type {model_type!r} needs its own Python code "
            f"({config['model_file']}), which mlx-relay does not run"
        )
    # The default of mlx_lm.utils.load_model(get_model_classes=...): the same mapping of
    # model types and architectures to mlx_lm.models modules that loading uses.
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except ValueError as e:
        raise ModelError(f"{path}: {e} (mlx-lm {_mlx_lm_version()})") from None
    return model_type


def _mlx_lm_version() -> str:
    from importlib.metadata import version

    return version("mlx-lm")
