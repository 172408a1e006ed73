"""mlx-lm's own tensor-parallel generation: the oracle for `--tensor-parallel`.

Splitting a layer across ranks changes the order of its sums, so single-process mlx-lm
is no longer the reference: mlx-lm's `sharded_load(path, tensor_group=group)` with the
same group is. `tensor_tokens` runs this file as every rank of a ring group on this
machine (MLX_RANK, MLX_HOSTFILE, as mlx.launch would set them) and returns rank 0's
tokens: `mlx_lm.stream_generate`'s, the EOS token itself left out, as oracle.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mlx_relay.launch.local import free_ports


def tensor_tokens(
    path: Path,
    prompt: list[int],
    max_tokens: int,
    ranks: int,
    *,
    seed: int | None = None,
    sampler: dict | None = None,
    timeout: float = 300,
) -> list[int]:
    """Rank 0's tokens of mlx-lm's generation on `ranks` processes splitting every layer."""
    ports = free_ports(ranks)
    hostfile = Path(os.environ.get("TMPDIR", "/tmp")) / f"tensor-oracle-{ports[0]}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    job = json.dumps({"path": str(path), "prompt": prompt, "max_tokens": max_tokens,
                      "seed": seed, "sampler": sampler or {}})  # fmt: skip
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
    if job["seed"] is not None:
        mx.random.seed(job["seed"])
    responses = list(
        stream_generate(
            model,
            tokenizer,
            mx.array(job["prompt"]),
            max_tokens=job["max_tokens"],
            sampler=make_sampler(**job["sampler"]),
        )
    )
    tokens = [r.token for r in responses]
    if responses and responses[-1].finish_reason == "stop":
        tokens = tokens[:-1]
    if group.rank() == 0:
        print(json.dumps(tokens), flush=True)


if __name__ == "__main__":
    _rank()
