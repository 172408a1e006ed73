#!/usr/bin/env bash
# On a CUDA device machine with two GPUs, as call 2 of bench/gpu/prepare.sh's recipe:
#     bash bench/gpu/measure.sh [load|timeline|single|all]
# Installs the carried wheels, builds the random 4-bit Llama-3-8B shape, and runs issue
# 10's measurements (bench/RESULTS.md quotes each command): `load` 16 streams on 1 and 2
# ranks (the 1.6x target), `timeline` 16 streams on 2 ranks with every rank's timeline
# and its report, `single` single-stream decode on 1 and 2 ranks against mlx-lm. Logs go
# to $OUT (what a device call brings back). Only ratios within one call compare.
set -uo pipefail
what=${1:-all}
bash .gpu/b/setup.sh > /dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH \
  MLX_RELAY_BENCH_TOKENIZER=$PWD/.gpu/b/tok MLX_RELAY_BENCH_MODELS=/root/bench
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 bench/shapes.py llama3-8b /root/bench/llama3-8b > /dev/null; t shape built
load=(--shape llama3-8b --gpus 2 --streams 16 --idle-seconds 1 --hop-modes adaptive)
if [[ $what == load || $what == all ]]; then
  t load; timeout 300 python3 bench/bench_concurrency.py "${load[@]}" --ranks 1,2 --tokens 256 \
    2>&1 | tee "$OUT/load.log" | grep -v '^$' | tail -14
fi
if [[ $what == timeline || $what == all ]]; then
  t timeline; rm -rf /tmp/tl
  MLX_RELAY_TIMELINE=/tmp/tl timeout 200 python3 bench/bench_concurrency.py "${load[@]}" \
    --ranks 2 --tokens 512 2>&1 | grep 'tok/s' | head -1
  python3 bench/timeline_report.py /tmp/tl --tokens 8 --skip 200 2>&1 | tee "$OUT/timeline.txt" | tail -30
fi
if [[ $what == single || $what == all ]]; then
  t single; timeout 200 python3 bench/bench_pipeline.py --shape llama3-8b --gpus 2 --ranks 1,2 \
    --hop-modes auto --tokens 128 --rounds 2 2>&1 | tee "$OUT/single.log" | tail -12
fi
t done
