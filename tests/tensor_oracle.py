"""mlx-lm's own tensor-parallel generation: the oracle for `--tensor-parallel`.

Splitting a layer across ranks changes the order of its sums, so single-process mlx-lm
is no longer the reference: mlx-lm's `sharded_load(path, tensor_group=group)` with the
same group is. `tensor_generations` runs this file as every rank of a ring group on
this machine (MLX_RANK, MLX_HOSTFILE, as mlx.launch would set them), which loads the
model once and generates each answer asked for in turn, and returns rank 0's tokens:
`mlx_lm.stream_generate`'s, the EOS token itself left out, as oracle.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlx_relay.launch.local import free_ports


@dataclass(frozen=True)
class Generation:
    """One answer to generate: from `prompt` (token ids), at most `max_tokens`; with a
    `seed`, the random state seeded just before it (as a fresh process would be), and
    `sampler`: mlx-lm's make_sampler arguments (none: greedy)."""

    prompt: list[int]
    max_tokens: int
    seed: int | None = None
    sampler: dict = field(default_factory=dict)


def tensor_tokens(
    path: Path,
    prompt: list[int],
    max_tokens: int,
    ranks: int,
    *,
    seed: int | None = None,
    sampler: dict | None = None,
) -> list[int]:
    """Rank 0's tokens of mlx-lm's generation on `ranks` processes splitting every layer."""
    generation = Generation(prompt, max_tokens, seed, sampler or {})
    return tensor_generations(path, [generation], ranks)[0]


def tensor_generations(
    path: Path, generations: list[Generation], ranks: int, timeout: float = 300
) -> list[list[int]]:
    """Rank 0's tokens of each of `generations`, in order, from one run of the `ranks`
    processes (one start and one load for them all)."""
    ports = free_ports(ranks)
    hostfile = Path(os.environ.get("TMPDIR", "/tmp")) / f"tensor-oracle-{ports[0]}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    job = json.dumps({"path": str(path), "generations": [asdict(g) for g in generations]})
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, job],
            env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(ranks)
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
        hostfile.unlink(missing_ok=True)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"the oracle's rank failed:\n{err[-3000:]}"
    return json.loads(outs[0][0].strip().splitlines()[-1])


def _rank() -> None:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import sharded_load

    job = json.loads(sys.argv[1])
    group = mx.distributed.init(backend="ring", strict=True)
    model, tokenizer = sharded_load(job["path"], tensor_group=group)
    answers = []
    for g in job["generations"]:
        if g["seed"] is not None:
            mx.random.seed(g["seed"])
        responses = list(
            stream_generate(
                model,
                tokenizer,
                mx.array(g["prompt"]),
                max_tokens=g["max_tokens"],
                sampler=make_sampler(**g["sampler"]),
            )
        )
        tokens = [r.token for r in responses]
        if responses and responses[-1].finish_reason == "stop":
            tokens = tokens[:-1]
        answers.append(tokens)
    if group.rank() == 0:
        print(json.dumps(answers), flush=True)


if __name__ == "__main__":
    _rank()
