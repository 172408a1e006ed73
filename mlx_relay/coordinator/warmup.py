"""Warm at load: the steps a first prompt meets, run once on every rank before serving.

On a GPU the first use of a kernel compiles it (Metal builds its pipelines, CUDA its
kernels through NVRTC, and cuDNN an attention graph for each query and key length), so
a fresh cluster's first long prompt paid for all of it: on one H200, the Llama-3-8B
shape's first ~3,800-token prompt took 2.4 s on 2 ranks against 0.66 s for the tenth,
and 74 s on a machine whose kernels had never been compiled (bench/bench_first_prompt.py,
bench/RESULTS.md). Worse, the prefill pacer (policy.py) timed its first
probe chunk while it compiled, took the model for slow and cut the next prompt chunks
small: shapes no later prompt meets, compiled again. So `warm_up` runs, on one slot
of every rank, a prompt in full `--prefill-chunk` chunks, its last chunk's logits, a
decode step and (with fixed speculation; adaptive speculation's verify steps run in
`time_widths`) a verify step, a prompt's odd-length last chunk and its last token, then
one more full chunk timed warm, which gives the
pacer its pace (no probe chunk after it), and drops the slot. On CUDA
the prompt runs on to CUDA_CONTEXT tokens, so cuDNN has each chunk's graph at every
offset a prompt of that length reaches (CUDA only: Metal's and the CPU's attention
kernels do not depend on lengths). A decode step's attention is built for the size of
the KV cache's buffer its keys sit in, not for their count (its parity included, as
session 39 had thought: measured apart, bench/RESULTS.md); a prompt of any other
length decodes in another buffer, so every rank runs one-query attention over each
buffer size at load, apart from these steps (model/cache_sizes.py).

On the CPU nothing is compiled per shape (MLX's CPU kernels are built in; `mx.compile`d
functions are shapeless), so `auto` does not warm up there: loads stay as fast as they
were. The tokens are exact either way: the slot is dropped on every rank before the
first request takes one, and what the warm-up computes from its logits (a greedy token,
log-probabilities) goes nowhere.

Many streams meet what one prompt never does: slots other than SLOT, and decode groups of
several sequences, each at its own offset, run as one batch (masked attention, matmuls of
B rows, whose kernels change with B). On a fresh 2x H200 host, 16 streams of the
Llama-3-70B shape on 2 ranks failed three fresh clusters in a row: a step ran past the
30 s `--step-timeout` early in the 16-stream load (step 123, one sequence in slot 5 after
a run of 1-stream requests on slot 0; then step 123 again; then step 58, a group of 7),
and the watchdog took it for a hung rank. None was the first step of its shape by
`pace.step_shape` (which is allowed 120 s), so what it waited on (a slot's first use, or
kernels for a batch `step_shape` does not tell apart) was not pinned down; with the
timeout at 400 s the same load ran, and so did every later cluster on that host
(bench/RESULTS.md, session 37). So `warm_batches` gives every slot a short prompt, then
runs decode groups of 2, 4, 8 ... up to the largest, and drops those slots: both happen
at load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_relay.coordinator.pipeline import Pipeline, Step
from mlx_relay.coordinator.sampling import Sampler, SamplingParams, sample_batch
from mlx_relay.device import on_cuda, on_gpu
from mlx_relay.protocol import header as hdr

MODES = ("auto", "on", "off")
CUDA_CONTEXT = 4096  # tokens a CUDA warm-up prompt runs to (cuDNN's graphs per length)
SLOT = 0  # the slot it runs on (every slot is free at load)
TOKEN = 0  # its prompt's every token (any id the embedding has)
TIMINGS = 3  # rounds of verify-like steps timed at load, the least of each width's kept


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up ran and measured."""

    steps: int  # forward steps round the ring
    seconds: float  # all of it, the slot's drop included
    chunk_tokens: int  # the timed chunk's tokens
    chunk_seconds: float  # that chunk, warm, launch to logits read
    chunk_units: float  # its work in the pacer's units (pace.step_cost)


def compiles_per_shape() -> bool:
    """Whether this device builds kernels for the shapes it meets (a GPU: Metal, CUDA),
    not the CPU, whose kernels are built in."""
    return on_gpu()


def wanted(mode: str) -> bool:
    """Whether to warm up: `on`, or `auto` where kernels compile per shape."""
    if mode not in MODES:
        raise ValueError(f"unknown warm-up mode {mode!r} ({', '.join(MODES)})")
    return mode == "on" or (mode == "auto" and compiles_per_shape())


def warm_up(pipeline: Pipeline, chunk: int, context_length: int, verify_width: int = 0) -> WarmUp:
    """Run the warm-up's steps on every rank (`chunk`: --prefill-chunk; `verify_width`:
    a speculative round's positions, 0 without speculation) and drop its slot."""
    started = time.monotonic()
    limit = max(1, context_length - 2) if context_length else 2 * chunk + 2
    size = max(1, min(chunk, (limit - 1) // 2))  # two chunks and a decode step fit
    length = CUDA_CONTEXT if on_cuda() else 2 * size
    length = max(2 * size, min(length, limit - 1) // size * size)
    steps = 0
    token = None
    for offset in range(0, length, size):  # the prompt, its last chunk with logits
        _, token = _run(pipeline, offset, size, want_logits=offset + size >= length)
        steps += 1
    # A decode step fed the token sampled last, still on the device, as the engine
    # feeds it (argmax's uint32, not the prompt's int32: on CUDA the embedding's gather
    # for those indices is another kernel, compiled on first use: ~5 s on a fresh H200)
    _run(pipeline, length, 1, want_logits=True, group=0, tokens=token)
    steps += 1
    if verify_width > 1 and length + 1 + verify_width <= limit:
        _run(pipeline, length + 1, verify_width, want_logits=True, all_positions=True)
        steps += 1
    # A prompt's last chunk, of an odd length as it nearly always is, then its last
    # token alone with logits (policy.py: the step that gives token 1). On a fresh
    # H200 this odd chunk took 0.7-0.9 s of the load (kernels built for a length off
    # the attention's tiles) against 0.05-0.1 s for any later one (bench/RESULTS.md).
    odd = size // 2 | 1
    if odd < size:
        _run(pipeline, length - odd, odd, want_logits=False, reuse=True)
        _run(pipeline, length, 1, want_logits=True)
        steps += 2
    t0 = time.monotonic()  # a chunk again, warm: the pace prompts start from
    units, _ = _run(pipeline, 0, size, want_logits=True)
    chunk_seconds = time.monotonic() - t0
    steps += 1
    _drop(pipeline)
    return WarmUp(steps, time.monotonic() - started, size, chunk_seconds, units)


@dataclass(frozen=True)
class BatchWarmUp:
    """What `warm_batches` ran."""

    steps: int  # forward steps round the ring
    seconds: float
    largest: int  # the largest decode group run (0: none)


def batch_sizes(largest: int) -> list[int]:
    """The decode groups `warm_batches` runs: 2, 4, 8 ... below `largest`, then `largest`
    (kernels are picked by ranges of B whose edges are powers of two)."""
    sizes = [b for b in (2**k for k in range(1, largest.bit_length())) if b < largest]
    return sizes + [largest] if largest > 1 else []


def warm_batches(pipeline: Pipeline, slots: int, context_length: int) -> BatchWarmUp:
    """Every slot and decode groups of several sequences, on every rank, before serving
    (`slots`: --max-active): slot i gets a prompt of 2 + i % hdr.MAX_SEQS tokens (so a
    group's members sit at offsets of their own, as in a live group), then the first
    slots run one decode step a size of `batch_sizes` (a group holds at most
    hdr.MAX_SEQS), each fed the tokens the step before sampled, still on the device;
    the slots are dropped."""
    started = time.monotonic()
    sizes = batch_sizes(min(slots, hdr.MAX_SEQS))
    if not sizes or (context_length and hdr.MAX_SEQS + 2 + len(sizes) > context_length):
        return BatchWarmUp(0, 0.0, 0)
    offsets = [2 + slot % hdr.MAX_SEQS for slot in range(slots)]
    tokens = [
        _run(pipeline, 0, length, want_logits=True, slot=slot)[1]
        for slot, length in enumerate(offsets)
    ]
    for size in sizes:
        members = list(range(size))
        step = pipeline.launch_forward(
            members,
            offsets[:size],
            mx.concatenate(tokens[:size])[:, None],
            [1] * size,
            group=0,
            want_logits=True,
        )
        for slot, token in zip(members, _sampled(pipeline, step, size), strict=True):
            tokens[slot] = token
            offsets[slot] += 1
    _drop(pipeline, list(range(slots)))
    return BatchWarmUp(slots + len(sizes), time.monotonic() - started, sizes[-1])


def time_widths(pipeline: Pipeline, widths: list[int], compiles: bool) -> dict[int, float]:
    """Each width's step (every position's logits, as a speculative verify step) timed on
    the warm-up's slot after a short prompt, each from the same position (the slot cut
    back to it), so drafting can be judged at load (speculation.never_pays) and its
    round costs start measured: the least of TIMINGS rounds, the widths taking turns
    (a busy moment then slows one timing, not a width's figure). `compiles`: the device
    builds kernels per shape (a GPU): a round runs first untimed. The slot is dropped."""
    prompt = 8
    _run(pipeline, 0, prompt, want_logits=False)
    seconds: dict[int, float] = {}
    for round_ in range(TIMINGS + (1 if compiles else 0)):
        for width in widths:
            t0 = time.monotonic()
            _run(pipeline, prompt, width, want_logits=True, all_positions=True, reuse=True)
            took = time.monotonic() - t0
            if round_ or not compiles:
                seconds[width] = min(took, seconds.get(width, took))
    _drop(pipeline)
    return seconds


def _drop(pipeline: Pipeline, slots: list[int] | None = None) -> None:
    freed = pipeline.launch_free(slots or [SLOT])
    if freed is not None:
        pipeline.complete(freed)
        pipeline.done(freed)


def _run(
    pipeline: Pipeline,
    offset: int,
    length: int,
    *,
    want_logits: bool,
    group: int = hdr.NO_GROUP,
    all_positions: bool = False,
    reuse: bool = False,
    tokens: mx.array | None = None,
    slot: int = SLOT,
) -> tuple[float, mx.array | None]:
    """One step of `length` tokens at `offset` on `slot` (`tokens`: a sampled token as a
    decode step's input, else the prompt's), waited for, its logits sampled as a
    request's are where it wants them (a greedy token, and log-probabilities); returns
    its work in the pacer's units and the token (None without logits)."""
    if tokens is not None:
        inputs = mx.concatenate([tokens[0:1]])[:, None]  # (as engine._launch builds it)
    else:
        inputs = mx.full((1, length), TOKEN, dtype=mx.int32)
    step: Step = pipeline.launch_forward(
        [slot],
        [offset],
        inputs,
        [length],
        group=group,
        want_logits=want_logits,
        all_positions=all_positions,
        reuse_from=slot if reuse else None,
    )
    units = step.units
    sampled = _sampled(pipeline, step, 1)
    return units, sampled[0] if sampled else None


def _sampled(pipeline: Pipeline, step: Step, rows: int) -> list[mx.array]:
    """Wait for `step`, sample its first `rows` rows' logits as greedy requests that want
    log-probabilities (one token each, shape (1,), left on the device as the engine
    leaves them), and retire the step. Empty where it returned no logits."""
    back = pipeline.complete(step)
    tokens: list[mx.array] = []
    if back.logits is not None:
        back.settle()
        logits = back.logits[:, -1, :] if back.logits.ndim == 3 else back.logits
        want = [_WarmRow(Sampler(SamplingParams(logprobs=True))) for _ in range(rows)]
        token, wanted = sample_batch(logits[:rows], want)
        mx.eval(token, *wanted)
        tokens = [token[i : i + 1] for i in range(rows)]
    pipeline.done(step)
    pipeline.announce()
    return tokens


@dataclass
class _WarmRow:
    """A greedy request that wants log-probabilities, as sampling.sample_batch reads it."""

    sampler: Sampler
    context: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    constraint: None = None
