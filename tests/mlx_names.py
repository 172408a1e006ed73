"""MLX's private launcher modules that mlx-relay mirrors, checked where they stand.

`mlx_relay.launch.hostfile` and `mlx_relay.launch.mlx_launch` write what `mlx.launch`
writes (its hostfile format, its MLX_HOSTFILE, its per-rank launch script); the tests
compare with mlx's own code in `mlx._distributed_utils`, a private package. When mlx
moves or renames it, those tests fail saying so, never skip quietly: the mirror must be
re-checked against the new mlx.
"""

from __future__ import annotations

import importlib
from importlib.metadata import version
from types import ModuleType

import pytest

PACKAGE = "mlx._distributed_utils"
MIRRORS = "mlx_relay/launch/hostfile.py and mlx_relay/launch/mlx_launch.py"


def mlx_private(module: str, *names: str) -> ModuleType:
    """`mlx._distributed_utils.<module>`, holding `names`, or a failure saying what moved."""
    where = f"{PACKAGE}.{module}"
    try:
        found = importlib.import_module(where)
    except ImportError as e:
        pytest.fail(
            f"mlx {version('mlx')} has no {where} ({e}): mlx moved its launcher's private "
            f"code; re-check {MIRRORS} against the new mlx.launch and update this test"
        )
    missing = [n for n in names if not hasattr(found, n)]
    if missing:
        pytest.fail(
            f"mlx {version('mlx')}: {where} has no {', '.join(missing)}: re-check {MIRRORS} "
            "against the new mlx.launch and update this test"
        )
    return found
