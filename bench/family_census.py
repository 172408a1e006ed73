"""Which of mlx-lm's model families split exactly: a census on tiny random models.

    .venv/bin/python bench/family_census.py [FAMILY ...] [--markdown FILE]

For each module of `mlx_lm.models` (or the families named), a tiny config is made from
one table of small values (hidden 64, 6 layers, 4 heads, 2 KV heads, 4 experts ...),
given to the module's own `ModelArgs`, and the model is built with random weights. Its
logits over a 20-token prefill and 3 decode steps are compared with mlx-relay's stages
(chained by the ranks' own code: rank 0's `StageRunner`, each worker's
`WorkerStage.take`) at 1, 2 and 3 uneven splits, each family in a process of its own (a
family that aborts the process or runs past 45 s is a CRASH). The table, the model
builder and the check are tests/census.py's (tests/test_census_families.py keeps the
families found exact). Each family ends in one of:

- EXACT: bit-identical at every split;
- REFUSED: mlx-relay refuses it at load, with the message;
- MISMATCH / CRASH: different logits, or an exception while running the stages;
- VLM: a family mlx-relay loads through mlx-vlm (its vision path), not mlx-lm, so the
  census has no oracle for it (the vision tests compare it with mlx-vlm);
- NO-CONFIG: the census could not build a tiny model of it from the table (a required
  argument it has no value for, a Metal-only kernel, ...): nothing is known of it.

The tests verify families with hand-made configs (tests/tiny_models.py); this is a
wider, rougher net for finding the families that still fail.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

# (the census itself: tests/census.py; its names kept here for cache_measure_census.py)
from census import check, families, tests_model, write_model  # noqa: E402, F401


def one(family: str) -> tuple[str, str]:
    """`check(family)` in a process of its own."""
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--one", family],
            capture_output=True,
            text=True,
            timeout=45,
        )
    except subprocess.TimeoutExpired:
        return "CRASH", "no result within 45 s"
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            status, why = json.loads(line[len("RESULT ") :])
            return status, why
    tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    return "CRASH", f"exit {done.returncode}: {tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="*", help="default: every family of mlx_lm.models")
    ap.add_argument("--markdown", type=Path, help="also write the table here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory(prefix="census-") as tmp:
            print("RESULT " + json.dumps(check(args.one, Path(tmp))), flush=True)
        return 0
    rows = []
    for family in args.families or families():
        status, why = one(family)
        why = " ".join(why.split())[:160]
        rows.append((family, status, why))
        print(f"{family:<24} {status:<10} {why}", flush=True)
    counts = {s: sum(1 for r in rows if r[1] == s) for s in sorted({r[1] for r in rows})}
    print("\n" + ", ".join(f"{s} {n}" for s, n in counts.items()))
    if args.markdown:
        lines = ["| family | result | why |", "| --- | --- | --- |"]
        lines += [f"| {f} | {s} | {w.replace('|', '/')} |" for f, s, w in rows]
        args.markdown.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
