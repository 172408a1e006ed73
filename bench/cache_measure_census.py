"""How close the measured cache layout (`memory.measure_caches`) is to what mlx-lm holds.

    .venv/bin/python bench/cache_measure_census.py [FAMILY ...]

For each family of the census (bench/family_census.py's tiny models, or the families
named), the whole model is loaded as one shard, its caches measured off a probe step's
graph shapes, and the measure for 340 tokens compared with the bytes mlx-lm's own caches
hold after a 40-token prompt and 300 decode steps (KV buffers whole, states as they
are). Every family is measured, those whose caches the config tells too (the census's
configs carry fields of every family, so most of them fall to measuring here anyway).
A line per family: the estimate, the real bytes, their ratio; or why it could not run.
"""

from __future__ import annotations

import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import family_census  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

from mlx_relay.model import memory, sharding  # noqa: E402

TOKENS = 340  # a 40-token prompt, then 300 decode steps (past the first 256 positions)
SECONDS = 40  # a family's limit


def held_bytes(path: Path) -> int:
    """Bytes mlx-lm's own caches hold after TOKENS tokens."""
    model, _ = load_model(path)
    caches = make_prompt_cache(model)
    model(mx.array([list(range(5, 45))]), cache=caches)
    for _ in range(TOKENS - 40):
        model(mx.array([[7]]), cache=caches)
    total = 0
    for cache in sharding.flat_caches(caches):
        mx.eval(cache.state)
        keys = getattr(cache, "keys", None)
        if isinstance(keys, mx.array):
            values = getattr(cache, "values", None)
            total += keys.nbytes + (values.nbytes if isinstance(values, mx.array) else 0)
        else:
            state = tree_flatten(cache.state)
            total += sum(a.nbytes for _, a in state if isinstance(a, mx.array))
    return total


def measure(family: str, workdir: Path) -> str:
    try:  # (as the census builds it: the tests' own model where the table cannot)
        path = family_census.write_model(family, workdir / family)
    except Exception:  # noqa: BLE001
        path = family_census.tests_model(family, workdir / f"{family}-tests")
        if path is None:
            raise
    layers = sharding.count_layers(sharding.read_config(path))
    shard = sharding.load_shard(path, 0, layers, has_ends=True)
    estimate = memory.layout_nbytes(memory.measure_caches(shard), TOKENS)
    real = held_bytes(path)
    return f"est {estimate:>10}  real {real:>10}  ratio {estimate / max(real, 1):.2f}"


def _too_long(*_: object) -> None:
    raise TimeoutError(f"over {SECONDS} s")


def main() -> int:
    signal.signal(signal.SIGALRM, _too_long)
    workdir = Path(tempfile.mkdtemp(prefix="cache-measure-"))
    for family in sys.argv[1:] or family_census.families():
        signal.alarm(SECONDS)
        try:
            line = measure(family, workdir)
        except Exception as e:  # noqa: BLE001 - a family that cannot be built: say why
            line = f"not measured: {type(e).__name__}: {str(e)[:100]}"
        finally:
            signal.alarm(0)
        print(f"{family:28s} {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
