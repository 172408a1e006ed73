#!/usr/bin/env bash
# On a CUDA device machine with two GPUs, as call 2 of bench/gpu/prepare.sh's recipe:
#     bash bench/gpu/measure.sh [warm] [load] [timeline] [single] [diagnose] [exact] [channels] [trace]
#                               [nranks] [nprefill] [nexact] [nload] [n70b] [nserver] [nchunk]
#                               [ptrace] [vloop] [spec] [specmodel] [specload]
#                               [n8decode] [n8load] [n8prefill] [tensor] [tensor70] [tensorload] [allsum]
#     (none: load timeline single; the n* parts need GPUS=4 GPUs or more)
# (`warm` first: a fresh machine's first cluster spends ~2 minutes compiling kernels.)
# Installs the carried wheels, builds the random 4-bit Llama-3-8B shape, and runs issue
# 10's measurements (bench/RESULTS.md quotes each command): `load` 16 streams on 1 and 2
# ranks (the 1.6x target), `timeline` 16 streams on 2 ranks with every rank's timeline
# and its report, `single` single-stream decode on 1 and 2 ranks against mlx-lm,
# `diagnose` three timelines (plain, the GPUs swapped, NCCL on one channel; alone it fits
# the 8 files a call brings back), `exact` 16 greedy streams on 1 and 2 ranks checked
# token by token against mlx-lm (bench/greedy_under_load.py), `channels` 16 streams on 2
# ranks with NCCL's own channel count and with one channel, interleaved, `trace` a GPU
# timeline of each rank (every kernel, copy, host wait and slow CUDA call, from
# bench/gpu/cupti_trace.c, which prepare.sh builds, read with bench/trace_report.py).
# Logs go
# to $OUT (what a device call brings back), with each GPU's utilisation (nvidia-smi's
# share of time a kernel ran, every 200 ms) during each part. Only ratios within one call
# compare. LOAD_ARGS adds to `load`'s options (e.g. LOAD_ARGS="--steps-in-flight 0,3");
# MLX_RELAY_BENCH_GPU_ORDER=1,0 puts rank 0 on GPU 1 and rank 1 on GPU 0.
set -uo pipefail
what=" ${*:-load timeline single} "
wants() { [[ $what == *" $1 "* ]]; }
bash .gpu/b/setup.sh > /dev/null || exit 1
# (CUDA_DEVICE_ORDER: CUDA numbers the GPUs as nvidia-smi does, so GPU r is rank r's)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH CUDA_DEVICE_ORDER=PCI_BUS_ID \
  MLX_RELAY_BENCH_TOKENIZER=$PWD/.gpu/b/tok MLX_RELAY_BENCH_MODELS=/root/bench
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
watch() { nvidia-smi --query-gpu=timestamp,index,utilization.gpu --format=csv,noheader \
            -lms 200 > "$OUT/util_$1.csv" & WATCH=$!; }
unwatch() { kill "$WATCH"; python3 bench/gpu/util_report.py "$OUT/util_$1.csv"; }
python3 bench/shapes.py llama3-8b /root/bench/llama3-8b > /dev/null; t shape built
load=(--shape llama3-8b --gpus 2 --streams 16 --idle-seconds 1 --hop-modes adaptive)
if wants warm; then  # (a fresh machine's first cluster compiles its kernels: not measured)
  t warm; timeout 300 python3 bench/bench_concurrency.py "${load[@]}" --ranks 2 --tokens 16 \
    > /dev/null 2>&1
fi
if wants load; then
  t load; watch load
  timeout 420 python3 bench/bench_concurrency.py "${load[@]}" --ranks 1,2 --tokens 256 \
    ${LOAD_ARGS:-} 2>&1 | tee "$OUT/load.log" | grep -v '^$' | tail -16
  unwatch load
fi
# One 16-stream run on 2 ranks with every rank's timeline: the report of all steady steps
# and of the slow ones, each GPU's utilisation, and every mark (tgz) in $OUT, named
# after $1; the rest of the arguments are environment settings for the run.
timeline() {
  local name=$1; shift
  t "timeline $name"; rm -rf /tmp/tl; watch "$name"
  env "$@" MLX_RELAY_TIMELINE=/tmp/tl timeout 240 python3 bench/bench_concurrency.py \
    "${load[@]}" --ranks 2 --tokens 512 2>&1 | grep 'tok/s' | head -1
  unwatch "$name" > "$OUT/$name.txt"; rm -f "$OUT/util_$name.csv"
  { python3 bench/timeline_report.py /tmp/tl --tokens 8 --skip 200
    echo "the slow steps (a period over 25 ms):"
    python3 bench/timeline_report.py /tmp/tl --tokens 8 --skip 200 --over 25 | tail -n +2
  } >> "$OUT/$name.txt" 2>&1
  grep -A40 'steady steps' "$OUT/$name.txt" | head -60
  tar czf "$OUT/$name.tgz" -C /tmp tl  # (every mark, for what the medians hide)
}
if wants timeline; then
  timeline timeline
fi
# The checks RESULTS (session 18) lists for rank 0's slow layers and the slow periods,
# after the plain timeline: the ranks on each other's GPUs, NCCL on one channel.
if wants diagnose; then
  timeline plain
  timeline swapped MLX_RELAY_BENCH_GPU_ORDER=1,0
  timeline one_channel NCCL_MAX_NCHANNELS=1
fi
if wants single; then
  t single; timeout 200 python3 bench/bench_pipeline.py --shape llama3-8b --gpus 2 --ranks 1,2 \
    --hop-modes auto --tokens 128 --rounds 2 2>&1 | tee "$OUT/single.log" | tail -12
fi
# Issue 51: a single stream on 2 (and GPUS=4: 4) GPUs as a pipeline and with every layer
# split (TPn) against mlx-lm on one, the 8B shape (`tensor`) and the 70B shape (`tensor70`);
# LAYOUTS=tensor,mlx-lm-tensor adds mlx-lm's own split generation as a reference,
# LAYOUTS=pipeline,tensor,auto what --tensor-parallel auto measures and chooses.
tp_ranks=1,2; [[ ${GPUS:-2} -ge 4 ]] && tp_ranks=1,2,4
if wants tensor; then
  t tensor; timeout 400 python3 bench/bench_pipeline.py --shape llama3-8b --gpus "${GPUS:-2}" \
    --ranks "$tp_ranks" --layouts "${LAYOUTS:-pipeline,tensor}" --tokens 128 --rounds 3 2>&1 \
    | tee "$OUT/tensor.log" | tail -12
fi
if wants tensor70; then
  t tensor70 build; python3 bench/shapes.py llama3-70b /root/bench/llama3-70b > /dev/null
  t tensor70; timeout 560 python3 bench/bench_pipeline.py --shape llama3-70b --gpus "${GPUS:-2}" \
    --ranks "$tp_ranks" --layouts "${LAYOUTS:-pipeline,tensor}" --tokens 64 --rounds 3 2>&1 \
    | tee "$OUT/tensor70.log" | tail -12
fi
# Issue 51: what an all-sum costs a split step (the floor under a split token), with MLX's
# CUDA graphs and launched directly.
if wants allsum; then
  t allsum; timeout 200 python3 bench/bench_all_sum.py --gpus 2 --hidden 8192 --layers 80 \
    --settings default,MLX_USE_CUDA_GRAPHS=0 2>&1 | tee "$OUT/allsum.log"
fi
# Issue 51: 16 streams with every layer split across 2 GPUs against a pipeline of the same
# 2, the 70B shape (the 8B's: SHAPE=llama3-8b).
if wants tensorload; then
  t tensorload; python3 bench/shapes.py "${SHAPE:-llama3-70b}" "/root/bench/${SHAPE:-llama3-70b}" > /dev/null
  timeout 560 python3 bench/bench_concurrency.py --shape "${SHAPE:-llama3-70b}" --gpus 2 --ranks 2 \
    --streams 1,16 --layouts pipeline,tensor --tokens 64 --idle-seconds 1 2>&1 \
    | tee "$OUT/tensorload.log" | tail -14
fi
# 16 streams on 2 ranks, NCCL with the channels it picks and with one channel
# (NCCL_MAX_NCHANNELS=1: fewer SMs spinning while a receive waits), interleaved, ROUNDS times.
if wants channels; then
  t channels
  for round in $(seq "${ROUNDS:-2}"); do
    for nccl in own 1; do
      [[ $nccl == own ]] && set -- || set -- NCCL_MAX_NCHANNELS=$nccl
      echo "round $round, NCCL channels $nccl: $(env "$@" timeout 200 python3 \
        bench/bench_concurrency.py "${load[@]}" --ranks 2 --tokens 256 2>&1 | grep -m1 'tok/s')"
    done
  done | tee "$OUT/channels.log"
fi
# Every kernel, copy, host wait and slow CUDA call of each rank (bench/gpu/cupti_trace.c,
# built here into .gpu/b) during a 16-stream run on 2 ranks with its timeline, and of one
# rank alone with 8 streams (the same 8-row steps, nothing beside them), read with
# bench/trace_report.py: what each GPU does in a period, normal and slow.
if wants trace; then
  t trace; rm -rf /tmp/alone /tmp/tr /tmp/tl; mkdir -p /tmp/alone /tmp/tr
  trace() { local dir=$1; shift; env CUDA_INJECTION64_PATH=$PWD/.gpu/b/cupti_trace.so \
    CUPTI_TRACE_DIR="$dir" "$@" > "$dir.log" 2>&1; grep -m1 'tok/s' "$dir.log"; }
  trace /tmp/alone MLX_RELAY_TIMELINE=/tmp/alone/tl timeout 200 python3 \
    bench/bench_concurrency.py --shape llama3-8b --gpus 2 --streams 8 --idle-seconds 1 \
    --hop-modes adaptive --ranks 1 --tokens 384
  trace /tmp/tr MLX_RELAY_TIMELINE=/tmp/tl timeout 240 python3 bench/bench_concurrency.py \
    "${load[@]}" --ranks 2 --tokens 512
  ls -la /tmp/tr /tmp/alone
  python3 bench/trace_report.py /tmp/tr /tmp/tl --alone /tmp/alone --dump "$OUT/trace_dump.txt" \
    > "$OUT/trace.txt" 2>&1
  python3 bench/timeline_report.py /tmp/tl --tokens 8 --skip 200 >> "$OUT/trace.txt" 2>&1
  gzip -f "$OUT/trace_dump.txt"; cat "$OUT/trace.txt"
fi
# N ranks (GPUS=4): single-stream decode and a ~4,000-token prompt's first token at 1 to
# GPUS ranks against mlx-lm on one GPU, with auto hops (every neighbouring pair over
# NCCL) and with eager ones (the ring backend through host memory) side by side; greedy
# exactness under load on GPUS ranks; 16 streams at 2 and GPUS ranks.
G=${GPUS:-2}
ranks=$(seq -s, 1 "$G")
if wants nranks; then
  t nranks; timeout 500 python3 bench/bench_pipeline.py --shape llama3-8b --gpus "$G" \
    --ranks "$ranks" --hop-modes auto,eager --tokens 128 --rounds 3 2>&1 \
    | tee "$OUT/nranks.log" | tail -14
fi
if wants nprefill; then
  t nprefill; timeout 500 python3 bench/bench_pipeline.py --shape llama3-8b --gpus "$G" \
    --ranks "$ranks" --hop-modes auto --tokens 16 --rounds 3 --prompt-tokens 4000 2>&1 \
    | tee "$OUT/nprefill.log" | tail -10
fi
# Where a ~4,000-token prompt's time goes on GPUS ranks: every rank's timeline and GPU
# trace during the last of its prefills, read with bench/prefill_report.py (the chunks'
# flow through the stages: each one's wait for input, compute span and kernel time).
if wants ptrace; then
  t ptrace; rm -rf /tmp/ptr /tmp/ptl; mkdir -p /tmp/ptr
  env CUDA_INJECTION64_PATH=$PWD/.gpu/b/cupti_trace.so CUPTI_TRACE_DIR=/tmp/ptr \
    MLX_RELAY_TIMELINE=/tmp/ptl timeout 400 python3 bench/bench_pipeline.py --shape llama3-8b \
    --gpus "$G" --ranks "$G" --hop-modes auto --tokens 16 --rounds 2 --prompt-tokens 4000 \
    ${PTRACE_ARGS:-} > "$OUT/ptrace.log" 2>&1; tail -4 "$OUT/ptrace.log"
  python3 bench/prefill_report.py /tmp/ptl --traces /tmp/ptr 2>&1 | tee "$OUT/ptrace.txt"
fi
# A verify loop's cost in one process (bench/verify_loop.py): steps of 5 and 8 positions
# at growing offsets, as is, with keys padded to the cache's buffer (one cuDNN graph per
# 256 positions instead of one per step), and with MLX's unfused attention.
if wants vloop; then
  t vloop; for v in "" --padded; do
    timeout 200 python3 bench/verify_loop.py /root/bench/llama3-8b $v; done 2>&1 | tee "$OUT/vloop.log"
  t vloop unfused; MLX_CUDA_USE_CUDNN_SDPA=0 timeout 200 python3 bench/verify_loop.py \
    /root/bench/llama3-8b 2>&1 | tee -a "$OUT/vloop.log"
fi
if wants nexact; then
  t nexact; timeout 400 python3 bench/greedy_under_load.py --shape llama3-8b --gpus "$G" \
    --ranks "1,$G" --streams 16 --tokens 128 2>&1 | tee "$OUT/nexact.log" | tail -4
fi
if wants nload; then
  t nload; timeout 420 python3 bench/bench_concurrency.py --shape llama3-8b --gpus "$G" \
    --streams 16 --idle-seconds 1 --hop-modes auto --ranks "2,$G" --tokens 256 2>&1 \
    | tee "$OUT/nload.log" | grep -v '^$' | tail -12
fi
# The 70B shape (37 GB, built here on first use) single stream at 2 and GPUS ranks
# against mlx-lm on one GPU; the qwen2 8B shape with 16 streams on GPUS ranks against
# mlx-lm's own distributed server on the same GPUs; a ~4,000-token prompt's first token
# with 1,024-token prefill chunks (the default is 512).
if wants n70b; then
  t n70b build; python3 bench/shapes.py llama3-70b /root/bench/llama3-70b > /dev/null
  t n70b; timeout 560 python3 bench/bench_pipeline.py --shape llama3-70b --gpus "$G" \
    --ranks "2,$G" --hop-modes auto --tokens 64 --rounds 3 2>&1 | tee "$OUT/n70b.log" | tail -10
fi
if wants nserver; then
  python3 bench/shapes.py llama3-8b-qwen2 /root/bench/llama3-8b-qwen2 > /dev/null
  t nserver warm; timeout 200 python3 bench/bench_concurrency.py --shape llama3-8b-qwen2 \
    --gpus "$G" --streams 16 --idle-seconds 1 --hop-modes auto --ranks "$G" --tokens 16 \
    > /dev/null 2>&1  # (the qwen2 shape's own kernels compiled: not measured)
  t nserver; timeout 500 python3 bench/bench_concurrency.py --shape llama3-8b-qwen2 \
    --gpus "$G" --streams 16 --idle-seconds 1 --hop-modes auto --ranks "$G" --tokens 256 \
    --mlx-lm-server 2>&1 | tee "$OUT/nserver.log" | grep -v '^$' | tail -12
fi
if wants nchunk; then
  t nchunk; timeout 500 python3 bench/bench_pipeline.py --shape llama3-8b --gpus "$G" \
    --ranks "2,$G" --hop-modes auto --tokens 16 --rounds 3 --prompt-tokens 4000 \
    --serve-args "--prefill-chunk 1024" 2>&1 | tee "$OUT/nchunk.log" | tail -10
fi
# Issue 41's table, written for eight GPUs (GPUS=8, one call per part: each fits the
# 10-minute limit of a call): the 70B shape single stream at 1, 2, 4 and GPUS ranks; 16
# and 64 streams at 2, 4 and GPUS ranks; a ~8,000-token prompt's first token at 1, 4 and
# GPUS ranks. With GPUS=4 the same parts run at 1, 2 and 4 ranks.
r8() { printf "%s\n" "$@" "$G" | awk -v g="$G" '$1 <= g' | sort -nu | paste -sd,; }
if wants n8decode || wants n8load || wants n8prefill; then
  t n8 build; python3 bench/shapes.py llama3-70b /root/bench/llama3-70b > /dev/null
fi
if wants n8decode; then
  t n8decode; timeout 560 python3 bench/bench_pipeline.py --shape llama3-70b --gpus "$G" \
    --ranks "$(r8 1 2 4)" --hop-modes auto --tokens 64 --rounds 3 2>&1 \
    | tee "$OUT/n8decode.log" | tail -12
fi
if wants n8load; then
  for streams in 16 64; do
    t "n8load $streams"; timeout 270 python3 bench/bench_concurrency.py --shape llama3-70b \
      --gpus "$G" --streams "$streams" --idle-seconds 1 --hop-modes auto --ranks "$(r8 2 4)" \
      --tokens 64 2>&1 | tee "$OUT/n8load_$streams.log" | grep -v '^$' | tail -8
  done
fi
if wants n8prefill; then
  t n8prefill; timeout 560 python3 bench/bench_pipeline.py --shape llama3-70b --gpus "$G" \
    --ranks "$(r8 1 4)" --hop-modes auto --tokens 16 --rounds 3 --prompt-tokens 8000 2>&1 \
    | tee "$OUT/n8prefill.log" | tail -10
fi
if wants exact; then
  t exact; timeout 400 python3 bench/greedy_under_load.py --shape llama3-8b --gpus 2 --ranks 1,2 \
    --streams 16 --tokens 256 2>&1 | tee "$OUT/exact.log" | tail -4
fi
# Speculative decoding (issue 40), one GPU per rank: prompt lookup on a copy prompt at 1
# and 2 ranks; a random SmolLM2-135M-shaped draft model against mlx-lm's own speculative
# generator; 16 streams with drafting on against off. Random weights: the logs give the
# acceptance each figure had.
if wants spec; then
  t spec_ngram; timeout 280 python3 bench/bench_speculation.py --shape llama3-8b --gpus "$G" \
    --ranks "1,$G" --prompt copy --tokens 128 --rounds 3 2>&1 | tee "$OUT/spec_ngram.log" | tail -12
fi
if wants specmodel; then
  t spec_model; timeout 280 python3 bench/bench_speculation.py --shape llama3-8b --gpus "$G" \
    --ranks "$G" --draft-shape smollm2-135m --prompt copy --tokens 128 --rounds 3 \
    2>&1 | tee "$OUT/spec_model.log" | tail -12
fi
if wants specload; then
  t spec_load; timeout 400 python3 bench/bench_speculation.py --shape llama3-8b --gpus "$G" \
    --ranks "$G" --streams 16 --prompt copy --tokens 96 --rounds 3 \
    2>&1 | tee "$OUT/spec_load.log" | tail -10
fi
t done
