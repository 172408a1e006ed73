"""How a model's layers are split over ranks: the one place `--layers` is understood.

`--layers` (and LoadModel's `layers`) is one of: empty (the default, `balanced`),
comma-separated counts (`10,12,8`), `balanced` (equal work per rank, rank 0's LM head
counted), `even` (equal layers per rank), or `auto` (by each rank's free memory, which
only the running ranks know, so it is resolved later by the pipeline). Launchers check
it before starting any rank, and rank 0 checks LoadModel's with the same code.
"""

from __future__ import annotations

import math
from fractions import Fraction

AUTO = "auto"  # --layers auto: split by each rank's free memory, known only once ranks run

Layers = list[int] | str | None  # counts, AUTO, or None (the default split)


def split_layers(num_layers: int, n: int, weights: list[float] | None = None) -> list[int]:
    """Layer counts per rank: even, or proportional to `weights` (e.g. free memory).

    Even: the remainder goes one layer each to the first ranks (as mlx-lm's
    PipelineMixin does). Weighted: largest remainder method with at least 1 layer per
    rank; ties go to the lower rank, so equal weights give the even split.
    """
    if n < 1:
        raise ValueError(f"cannot split over {n} ranks")
    if num_layers < n:
        raise ValueError(f"{num_layers} layers cannot give each of {n} ranks at least 1")
    if weights is None:
        base, extra = divmod(num_layers, n)
        return [base + (1 if r < extra else 0) for r in range(n)]
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {n} ranks")
    if any(not math.isfinite(w) or w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"weights {weights}: need finite, non-negative, not all zero")
    ws = [Fraction(w) for w in weights]
    quota = [Fraction(num_layers) * w / sum(ws) for w in ws]
    counts = [max(1, math.floor(q)) for q in quota]
    while sum(counts) < num_layers:
        i = max(range(n), key=lambda r: (quota[r] - counts[r], -r))
        counts[i] += 1
    while sum(counts) > num_layers:  # the forced 1s overshot: take from the most over quota
        i = min((r for r in range(n) if counts[r] > 1), key=lambda r: (quota[r] - counts[r], -r))
        counts[i] -= 1
    return counts


def balanced_split(num_layers: int, n: int, head_layers: float) -> list[int]:
    """Layer counts that give every rank the same work, rank 0's LM head included.

    Rank 0's share is the average of layers + head minus the head; with the head worth
    8 layers (SmolLM2-135M's), 30 layers over 2 ranks become 11 and 19.
    """
    share = (num_layers + head_layers) / n
    return split_layers(num_layers, n, [max(0.0, share - head_layers)] + [share] * (n - 1))


def parse_layers(spec: str, num_layers: int, n: int, head_layers: float = 0.0) -> list[int]:
    """`--layers 10,12,8` -> [10, 12, 8], checked against the model and the ranks;
    `--layers balanced` -> `balanced_split`."""
    if spec.strip() == "balanced":
        return balanced_split(num_layers, n, head_layers)
    if spec.strip() == "even":
        return split_layers(num_layers, n)
    try:
        counts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(
            f"--layers {spec!r}: expected comma-separated layer counts per rank, e.g. "
            "10,12,8, or auto, balanced or even"
        ) from None
    if len(counts) != n:
        raise ValueError(f"--layers {spec!r}: {len(counts)} counts for {n} ranks")
    if any(c < 1 for c in counts):
        raise ValueError(f"--layers {spec!r}: every rank needs at least 1 layer")
    if sum(counts) != num_layers:
        raise ValueError(
            f"--layers {spec!r}: sums to {sum(counts)}, the model has {num_layers} layers"
        )
    return counts


def layer_ranges(counts: list[int]) -> list[tuple[int, int]]:
    """[10, 12, 8] -> [(0, 10), (10, 22), (22, 30)]: each rank's half-open layer range."""
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def resolve_layers(spec: str, num_layers: int, n: int, head_layers: float = 0.0) -> Layers:
    """`--layers` for a model of `num_layers` layers over `n` ranks: counts, AUTO, or
    None (the default split, left to the pipeline); ValueError says what is wrong."""
    spec = spec.strip()
    if not spec:
        return None
    if spec == AUTO:
        return AUTO
    return parse_layers(spec, num_layers, n, head_layers)


def model_layers(spec: str, model: str, n: int) -> Layers:
    """`resolve_layers` for the model `model` ('default' or a path); its config is read
    only when the spec needs the model's layer count."""
    if spec.strip() in ("", AUTO):
        return resolve_layers(spec, 0, n)
    from mlx_relay.model import sharding
    from mlx_relay.model.default_model import resolve_model

    config = sharding.read_config(resolve_model(model))
    return resolve_layers(
        spec, sharding.count_layers(config), n, sharding.head_cost_in_layers(config)
    )
