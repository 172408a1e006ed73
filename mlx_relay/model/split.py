"""How a model's layers are split over ranks: the one place `--layers` is understood.

`--layers` (and LoadModel's `layers`) is one of: empty (the default, `balanced`),
comma-separated counts (`10,12,8`), `balanced` (equal work per rank, rank 0's LM head
counted), `even` (equal layers per rank), or `auto` (by each rank's free memory, which
only the running ranks know, so it is resolved later by the pipeline). Launchers check
it before starting any rank, and rank 0 checks LoadModel's with the same code.

Layers are not all alike (a dense first layer before MoE layers, an MoE layer's
experts of which a token runs only a few), so where the weights are at hand the split
counts each layer's bytes from the safetensors headers (`LayerCosts`): `balanced` the
bytes a token's pass reads (the experts it is routed to, not all of them), with rank 0's
LM head as before; `auto` the bytes each rank holds against its memory (rank 0's
embedding and head included). Models of uniform layers split as they always did.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
import struct
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

log = logging.getLogger("mlx_relay.split")

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


@dataclass
class LayerCosts:
    """What each layer costs, in bytes of weights (from the checkpoint's headers)."""

    held: list[int]  # bytes each layer holds in memory
    work: list[float]  # bytes one token's pass through each layer reads
    ends: int  # bytes outside the layers (embedding, final norm, LM head): rank 0's


# Routed experts stacked (mlx: switch_mlp, gpt-oss: experts.*) or one by one (HF:
# experts.N.*); shared experts ("shared_experts", "shared_expert") run for every token.
_ROUTED = re.compile(r"\.(?:experts|switch_mlp)\.")


def _active_expert_share(config: dict[str, Any]) -> float:
    """Of a layer's routed experts, the share one token runs through (1.0 if dense)."""
    c = config.get("text_config") or config
    total = next(
        (c[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if c.get(k)),
        None,
    )
    active = c.get("num_experts_per_tok") or c.get("num_experts_per_token")
    if not total or not active:
        return 1.0
    return min(1.0, float(active) / float(total))


def layer_costs(path: Path, num_layers: int, config: dict[str, Any]) -> LayerCosts | None:
    """Each layer's bytes from the model's weight files; None if they say nothing
    (no safetensors, or no tensor named after its layer)."""
    from mlx_relay.model import checkpoint, sharding  # (they import MLX: lazily)

    try:
        sizes = checkpoint.tensor_bytes(path)
    except (OSError, ValueError, KeyError, struct.error):
        return None
    share = _active_expert_share(config)
    held, work = [0] * num_layers, [0.0] * num_layers
    ends = 0
    second = sharding.second_list_from(config)
    for name, nbytes in sizes.items():
        i = checkpoint.layer_of(name, second)
        if i is None:
            ends += nbytes
            continue
        if i >= num_layers:  # e.g. a multi-token-prediction layer the model drops
            continue
        held[i] += nbytes
        work[i] += nbytes * (share if _ROUTED.search(name) else 1.0)
    if not any(held):
        return None
    return LayerCosts(held, work, ends)


def cost_split(
    costs: list[float], n: int, extra0: float = 0.0, capacity: list[float] | None = None
) -> list[int]:
    """Contiguous layer counts that give each rank a cost in proportion to its capacity
    as nearly as whole layers allow; rank 0 also carries `extra0` (its LM head).

    Exact: dynamic programming over the cut points, minimising the sum over ranks of
    cost^2 / capacity (least when every cost is proportional to its capacity). Among
    equally good splits the earlier ranks get more layers, so equal costs give
    `split_layers`'s even split and `balanced_split`'s.
    """
    num_layers = len(costs)
    if n < 1:
        raise ValueError(f"cannot split over {n} ranks")
    if num_layers < n:
        raise ValueError(f"{num_layers} layers cannot give each of {n} ranks at least 1")
    cap = capacity or [1.0] * n
    if len(cap) != n or any(not math.isfinite(c) or c <= 0 for c in cap):
        raise ValueError(f"capacities {capacity}: need {n} finite positive numbers")
    scale = max(sum(costs) + extra0, 1e-30)  # keep the squares in range
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c / scale)

    def price(r: int, i: int, j: int) -> float:
        cost = prefix[j] - prefix[i] + (extra0 / scale if r == 0 else 0.0)
        return cost * cost / cap[r]

    def ends(r: int, i: int) -> range:  # where rank r's layers from i may end
        return range(i + 1, num_layers - (n - 2 - r))

    # best[r][i]: the least price of placing layers i.. on ranks r..n-1
    best = [[math.inf] * (num_layers + 1) for _ in range(n + 1)]
    best[n][num_layers] = 0.0
    for r in range(n - 1, -1, -1):
        for i in range(r, num_layers - (n - 1 - r)):
            best[r][i] = min(price(r, i, j) + best[r + 1][j] for j in ends(r, i))
    counts, i = [], 0
    for r in range(n):
        bound = best[r][i] * (1 + 1e-9) + 1e-15
        j = max(j for j in ends(r, i) if price(r, i, j) + best[r + 1][j] <= bound)
        counts.append(j - i)
        i = j
    return counts


def parse_layers(
    spec: str,
    num_layers: int,
    n: int,
    head_layers: float = 0.0,
    costs: LayerCosts | None = None,
    tail: int = 0,
) -> list[int]:
    """`--layers 10,12,8` -> [10, 12, 8], checked against the model and the ranks;
    `--layers balanced` -> `cost_split` of the layers' work when `costs` are known,
    else `balanced_split`. `tail`: the last rank must hold at least that many layers
    (gemma4's KV-shared layers with the layers they reuse, `sharding.kv_shared_tail`):
    a named split gives it exactly those and splits the rest its own way; counts that
    do not are refused."""
    spec = spec.strip()
    if spec in ("balanced", "even"):
        if n > 1 and tail > 0:
            if num_layers - tail < n - 1:
                raise ValueError(
                    f"this model's last {tail} layers must stay on one rank, which leaves "
                    f"fewer than one layer for each of the other {n - 1} ranks"
                )
            natural = _named_split(spec, num_layers, n, head_layers, costs)
            if natural[-1] >= tail:
                return natural
            rest = num_layers - tail
            return [*_named_split(spec, rest, n - 1, head_layers, costs), tail]
        return _named_split(spec, num_layers, n, head_layers, costs)
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
    if n > 1 and counts[-1] < tail:
        raise ValueError(kv_shared_refusal(counts, tail))
    return counts


def kv_shared_refusal(counts: list[int], tail: int) -> str:
    return (
        f"layer split {counts}: this model's last {tail} layers reuse each other's keys "
        "and values within a step, so the last rank must hold "
        f"at least {tail} layers"
    )


def _named_split(
    spec: str, num_layers: int, n: int, head_layers: float, costs: LayerCosts | None
) -> list[int]:
    """`balanced` or `even` over the first `num_layers` layers."""
    if spec == "even":
        return split_layers(num_layers, n)
    work = costs.work[:num_layers] if costs is not None else []
    if len(work) == num_layers and len(set(work)) > 1:
        # Layers of unequal work: each in units of the typical layer, the head as
        # many of those as its weights (head_layers) say.
        typical = statistics.median(work) or 1.0
        return cost_split([w / typical for w in work], n, head_layers)
    return balanced_split(num_layers, n, head_layers)


def layer_ranges(counts: list[int]) -> list[tuple[int, int]]:
    """[10, 12, 8] -> [(0, 10), (10, 22), (22, 30)]: each rank's half-open layer range."""
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def resolve_layers(
    spec: str,
    num_layers: int,
    n: int,
    head_layers: float = 0.0,
    costs: LayerCosts | None = None,
    tail: int = 0,
) -> Layers:
    """`--layers` for a model of `num_layers` layers over `n` ranks: counts, AUTO, or
    None (the default split, left to the pipeline); ValueError says what is wrong."""
    spec = spec.strip()
    if not spec:
        return None
    if spec == AUTO:
        return AUTO
    return parse_layers(spec, num_layers, n, head_layers, costs, tail)


def default_split(
    path: Path, num_layers: int, n: int, speeds: list[float] | None = None
) -> list[int]:
    """The default (`balanced`) split of the model at `path`: by each layer's bytes
    when the weight files tell them, else by layer count with the head counted.

    `speeds`: each rank's measured weight-reading speed (model/speed.py), where ranks
    differ: each rank's work (its layers, and rank 0's head) is then in proportion to
    its speed, so a rank twice as fast holds about twice the layers. The caller keeps
    a KV-shared tail together (`keep_kv_shared_together`, computed=True)."""
    from mlx_relay.model import sharding

    config = sharding.read_config(path)
    costs = layer_costs(path, num_layers, config)
    head = sharding.head_cost_in_layers(config)
    if speeds is None:
        tail = sharding.kv_shared_tail(config)
        return parse_layers("balanced", num_layers, n, head, costs, tail)
    work = costs.work if costs is not None and len(costs.work) == num_layers else []
    typical = (statistics.median(work) or 1.0) if work else 1.0
    units = [w / typical for w in work] if work else [1.0] * num_layers
    return cost_split(units, n, head, speeds)


def memory_split(
    num_layers: int, stats: list[dict[str, Any] | None], costs: LayerCosts | None = None
) -> list[int]:
    """Layer counts in proportion to the memory each rank has for the model (`auto`).

    `stats`: each rank's memory figures (model/memory.stats(): rank 0's own, the
    workers' from their latest side-channel report; None where a rank has not
    reported, which then counts as the average). A rank's weight is its free memory
    plus the memory MLX already holds there (the shard and caches being replaced).
    Weights within 5% of each other give the even split. Every rank gets at least one
    layer.
    """

    def weight(figures: dict[str, Any] | None) -> float | None:
        free = None if figures is None else figures.get("free_memory")
        return None if free is None else float(free) + float(figures.get("active_memory", 0))

    world_size = len(stats)
    weights = [weight(figures) for figures in stats]
    known = [w for w in weights if w is not None and w > 0]
    fill = sum(known) / len(known) if known else 1.0
    filled = [w if w is not None and w > 0 else fill for w in weights]
    # Within 5% of each other (ranks sharing a machine, say) is equal: the even split.
    even = max(filled) <= 1.05 * min(filled)
    if costs is not None and len(costs.held) == num_layers:  # each layer's bytes, rank 0's ends
        counts = cost_split(
            [float(b) for b in costs.held], world_size, costs.ends, None if even else filled
        )
    else:
        counts = split_layers(num_layers, world_size, None if even else filled)
    log.info(
        "layers auto: memory per rank %s GB -> layers %s",
        [round(w / 2**30, 2) for w in filled],
        counts,
    )
    return counts


def keep_kv_shared_together(path: Any, counts: list[int], computed: bool) -> list[int]:
    """A split whose last rank holds the model's KV-shared layers with the layers they
    reuse (gemma4: sharding.kv_shared_tail). The named splits keep them there already
    (parse_layers); a computed split (by memory, by speed) gets layers moved to the
    last rank from the ranks before it (each keeps one), and counts a user gave that
    part them are refused, with the numbers, before any rank loads."""
    from mlx_relay.model import sharding

    tail = sharding.kv_shared_tail(sharding.read_config(path))
    if len(counts) == 1 or counts[-1] >= tail:
        return counts
    if not computed:
        raise ValueError(kv_shared_refusal(counts, tail))
    moved = list(counts)
    for rank in range(len(moved) - 2, -1, -1):
        give = min(moved[rank] - 1, tail - moved[-1])
        moved[rank] -= give
        moved[-1] += give
    if moved[-1] < tail:
        raise ValueError(
            f"this model's last {tail} layers must stay on one rank, which leaves fewer "
            f"than one layer for each of the other {len(counts) - 1} ranks"
        )
    log.info("layers %s -> %s: the last rank holds the KV-shared layers", counts, moved)
    return moved


def model_layers(spec: str, model: str, n: int) -> Layers:
    """`resolve_layers` for the model `model` ('default' or a path); its config is read
    only when the spec needs the model's layer count."""
    if spec.strip() in ("", AUTO):
        return resolve_layers(spec, 0, n)
    from mlx_relay.model import sharding
    from mlx_relay.model.default_model import resolve_model

    path = resolve_model(model)
    config = sharding.read_config(path)
    num_layers = sharding.count_layers(config)
    costs = layer_costs(path, num_layers, config) if spec.strip() == "balanced" else None
    head = sharding.head_cost_in_layers(config)
    return resolve_layers(spec, num_layers, n, head, costs, sharding.kv_shared_tail(config))
