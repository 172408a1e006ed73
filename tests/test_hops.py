"""How hops are timed (`--hop-mode`): the automatic choice, settled receives and
collective hops end to end."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from oracle import _load, chat_request, chat_tokens, mlx_lm_tokens, raw_prompt_tokens
from teacher_forcing import misses

from mlx_relay.coordinator.mailboxes import Mailboxes
from mlx_relay.errors import UserError
from mlx_relay.launch import preflight
from mlx_relay.launch.local import free_ports
from mlx_relay.protocol import header as hdr
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.transport.collective import (
    PayloadGroups,
    check_pair,
    on_gpus_of_their_own,
    pair_colorings,
)
from mlx_relay.transport.doorbell import Doorbell, NeighbourGone
from mlx_relay.transport.outbox import Outbox
from mlx_relay.transport.ring import (
    ADAPTIVE,
    AUTO,
    COLLECTIVE,
    EAGER,
    FENCE_ENV,
    INLINE_BACK_MAX_BYTES,
    INLINE_ENV,
    INLINE_MAX_BYTES,
    PAIRED_MODES,
    READY,
    Ring,
    choose_hop_mode,
    dtype_name,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import timeline_report  # noqa: E402


@pytest.mark.parametrize(
    ("backend", "cores", "ranks_here", "expected"),
    [
        ("ring", 16, 2, EAGER),  # cores to spare for a spinning receive (a CPU or GPU rank)
        ("ring", 16, 3, EAGER),
        ("ring", 8, 1, EAGER),
        ("jaccl", 8, 1, EAGER),
        ("ring", 2, 2, READY),  # the CI box: spinning would take the compute's cores
        ("ring", 4, 2, READY),
        ("mpi", 64, 1, READY),  # receives on their own thread: not under plain MPI_Init
    ],
)
def test_auto_picks_eager_hops_only_where_they_cost_nothing(backend, cores, ranks_here, expected):
    assert choose_hop_mode(AUTO, backend, cores=cores, ranks_here=ranks_here) == expected


def test_an_explicit_mode_is_kept_and_a_bad_one_is_refused_clearly():
    assert choose_hop_mode(EAGER, "ring", cores=2, ranks_here=3) == EAGER
    assert choose_hop_mode(READY, "ring", cores=64, ranks_here=1) == READY
    assert choose_hop_mode(COLLECTIVE, "ring", cores=2, ranks_here=2) == COLLECTIVE
    assert choose_hop_mode(ADAPTIVE, "ring", cores=2, ranks_here=2) == ADAPTIVE
    with pytest.raises(ValueError, match="not mpi"):
        choose_hop_mode(EAGER, "mpi", cores=64, ranks_here=1)
    with pytest.raises(ValueError, match="expected auto, eager, ready, collective, adaptive"):
        choose_hop_mode("fast", "ring", cores=64, ranks_here=1)


def test_auto_gives_a_pair_of_cuda_ranks_adaptive_hops():
    assert choose_hop_mode(AUTO, "ring", cores=16, ranks_here=2, gpu_pair=True) == ADAPTIVE
    assert choose_hop_mode(AUTO, "ring", cores=16, ranks_here=2) == EAGER  # (CPUs, or 3 ranks)
    assert choose_hop_mode(AUTO, "mpi", cores=16, ranks_here=1, gpu_pair=True) == READY
    # Each rank names its CUDA GPU (0: none); NCCL refuses two ranks on one GPU.
    assert on_gpus_of_their_own([0x1A2B3C5, 0x77F0013])
    assert not on_gpus_of_their_own([0x1A2B3C5, 0x1A2B3C5])
    assert not on_gpus_of_their_own([0x1A2B3C5, 0])  # (a CUDA rank and a CPU or Metal one)
    assert not on_gpus_of_their_own([0, 0])
    assert not on_gpus_of_their_own([])  # (not asked: 3 ranks, or eager hops asked for)


@pytest.mark.cluster
@pytest.mark.parametrize("hops", [EAGER, READY])
def test_settled_receives_keep_tokens_exact(tiny_model, cluster_factory, hops, tmp_path):
    """The CUDA path (each receive waited for before the kernels reading it launch), run
    on the CPU, with READY hops' payloads all over the ring
    (MLX_RELAY_INLINE_MAX_BYTES=0): concurrent chats, a long prompt in chunks, tokens
    equal to mlx-lm's. Each rank's timeline
    (MLX_RELAY_TIMELINE) records the steps in causal order."""
    # Rank 0 builds its next step before settling a return: sampled rows and logits
    # processors are built on the unsettled return too.
    env = {"MLX_RELAY_SETTLE_RECEIVES": "1"}
    env[INLINE_ENV] = "0"  # (READY: every payload over the ring, as a long prompt's chunks go)
    logs = _timed_chats(tiny_model("llama", 6), cluster_factory, 3, hops, tmp_path, env)
    assert "settled receives" in logs
    assert ("payloads up to 0 bytes inline" in logs) == (hops == READY)


@pytest.mark.cluster
def test_fenced_shape_changes_keep_tokens_exact(tiny_model, cluster_factory):
    """The JACCL guard (mlx issue 3149: back-to-back transfers of different shapes got
    wrong data), run on the ring backend (MLX_RELAY_FENCE_SHAPES=1): concurrent chats
    and a prompt in chunks of several sizes, every transfer of a new shape waiting for
    the one before; tokens equal to mlx-lm's, and the waits happened."""
    model = tiny_model("llama", 6)
    running = cluster_factory(
        model, 3, "--hop-mode", EAGER, "--prefill-chunk", "16", env={FENCE_ENV: "1"}
    )
    _chats_equal_mlx_lm(running, model)
    running.stop()
    logs = running.logs()
    assert logs.count("fenced shape changes") == 3, logs
    waits = [int(n) for n in re.findall(r"\((\d+) hops waited for a shape change\)", logs)]
    assert len(waits) == 2 and min(waits) > 0, logs


def _doorbell_pair() -> tuple[Doorbell, Doorbell]:
    """Rank 0's and rank 1's doorbells of a 2-rank ring, connected over loopback."""
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    bells: dict[int, Doorbell] = {}
    threads = [
        threading.Thread(target=lambda r=r: bells.update({r: Doorbell(r, 2, endpoints, b"k")}))
        for r in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return bells[0], bells[1]


def test_ready_hops_carry_small_payloads_in_the_headers_message():
    """A READY hop's computed payload up to the limit travels after its header in one
    doorbell message, bit for bit whatever its dtype or layout; a larger one, a side
    array's step or eager hops leave it to the ring; a forwarded header's stale flag is
    cleared. (Every cluster test on a 2-core machine runs READY hops this way.)"""
    group = mx.distributed.init()  # (this process alone: the ring itself is not used)
    out, into = _doorbell_pair()
    sender, receiver = Ring(group, out, READY), Ring(group, into, READY)
    assert sender.inline_max == INLINE_MAX_BYTES
    base = mx.random.normal((2, 5, 8))
    payloads = [
        base.astype(mx.bfloat16),
        base.astype(mx.float16),
        base[:, 1:4, ::2],  # (a strided view, as the last rank's return is)
        mx.arange(40, dtype=mx.uint8),
    ]
    for step_id, payload in enumerate(payloads, 1):
        kind = hdr.PAYLOAD_BYTES if payload.dtype == mx.uint8 else hdr.PAYLOAD_HIDDEN
        header = hdr.StepHeader(
            cmd=hdr.CMD_FORWARD,
            step_id=step_id,
            payload_kind=kind,
            payload_dtype=dtype_name(payload.dtype),
            payload_shape=tuple(payload.shape),
        )
        assert sender.send(header, payload) is None  # (nothing posted on the ring)
        came = receiver.recv_header(timeout=5)
        assert came.flags & hdr.FLAG_INLINE
        got = receiver.post_recv_payload(came)
        assert got.dtype == payload.dtype and mx.array_equal(got, payload).item()
    big = mx.zeros((1, INLINE_MAX_BYTES // 4 + 1), dtype=mx.float32)
    header = hdr.StepHeader(cmd=hdr.CMD_FORWARD, flags=hdr.FLAG_INLINE)  # (stale)
    assert sender._inline_bytes(header, big) == b"" and not header.flags & hdr.FLAG_INLINE
    assert Ring(group, out, EAGER)._inline_bytes(header, base) == b""
    out.close()
    into.close()


def test_a_bad_inline_limit_is_refused_clearly(monkeypatch):
    group = mx.distributed.init()
    for bad in ("lots", str(2**21)):
        monkeypatch.setenv(INLINE_ENV, bad)
        with pytest.raises(ValueError, match="MLX_RELAY_INLINE_MAX_BYTES=.*expected a number"):
            Ring(group, doorbell=None, mode=READY)


@pytest.mark.parametrize(
    ("mode", "alone", "returned", "expected", "inline"),
    [
        (ADAPTIVE, True, 64, hdr.FLAGS_COLLECTIVE, False),  # single stream: both all-sums
        (ADAPTIVE, False, 64, hdr.FLAG_COLLECTIVE_OUT, True),  # beside others: back inline
        (ADAPTIVE, False, INLINE_BACK_MAX_BYTES + 2, hdr.FLAG_COLLECTIVE_OUT, False),  # ring
        (COLLECTIVE, False, 64, hdr.FLAGS_COLLECTIVE, False),
        (EAGER, True, 64, 0, False),
    ],
)
def test_rank_0_marks_which_hops_of_a_step_are_all_sums(mode, alone, returned, expected, inline):
    """`returned`: the bytes the last rank sends back (one row of that many bfloat16 bytes)."""
    group = mx.distributed.init()  # (this process alone: rank 0)
    payloads = PayloadGroups(group, group, separate_streams=False) if mode in PAIRED_MODES else None
    ring = Ring(group, doorbell=None, mode=mode, payloads=payloads)
    stale = hdr.FLAG_COLLECTIVE_BACK | hdr.FLAG_INLINE_BACK  # (a second lap's copied flags)
    header = hdr.StepHeader(
        cmd=hdr.CMD_FORWARD,
        flags=stale | hdr.FLAG_WANT_OUTPUT,
        payload_kind=hdr.PAYLOAD_HIDDEN,
        payload_dtype="bfloat16",
        payload_shape=(1, 5, returned // 2),
    )
    ring.choose_path(header, alone=alone)
    assert header.flags & hdr.FLAGS_COLLECTIVE == expected
    assert ring.sends_collectively(header) == bool(expected)
    assert ring.returns_inline(header) == inline
    if mode == EAGER:  # a rank whose hops are all over the ring refuses an all-sum
        header.flags |= hdr.FLAG_COLLECTIVE_OUT
        with pytest.raises(hdr.ProtocolError, match="hops collectively, but this rank"):
            ring.sends_collectively(header)


@pytest.mark.parametrize(
    ("mode", "at_launch", "settles", "early"),
    [
        (EAGER, True, True, False),
        (READY, False, True, True),  # (on the CPU: returns come computed, host-writable)
        (COLLECTIVE, True, False, False),  # (all-sums are waited for on the device)
        (ADAPTIVE, True, True, False),
    ],
)
def test_each_hop_mode_answers_rank_0s_questions(mode, at_launch, settles, early):
    """Rank 0's ring driver asks the ring about a step, never which mode runs
    (transport/hops.py): when it goes on, when its return's receive is posted, whether
    that receive is settled, whether rank 0 may build on the return before it came."""
    group = mx.distributed.init()
    payloads = PayloadGroups(group, group, separate_streams=False) if mode in PAIRED_MODES else None
    ring = Ring(group, doorbell=None, mode=mode, payloads=payloads, settles=True)
    header = hdr.StepHeader(
        cmd=hdr.CMD_FORWARD,
        flags=hdr.FLAG_WANT_OUTPUT,
        payload_kind=hdr.PAYLOAD_HIDDEN,
        payload_dtype="bfloat16",
        payload_shape=(1, 5, 8),
    )
    ring.choose_path(header, alone=True)  # (a lone step: adaptive hops collectively)
    assert ring.announces_at_launch() == ring.eager == at_launch
    assert ring.posts_return_at_launch(header) == at_launch
    assert ring.settles == settles
    assert ring.settles_return(header, header) == (settles and mode != ADAPTIVE)
    assert ring.returns_early(header) == early
    if mode == ADAPTIVE:  # beside others: back inline, so built on before it came
        ring.choose_path(header, alone=False)
        assert ring.returns_early(header) and not ring.posts_return_at_launch(header)


@pytest.mark.parametrize("mode", [COLLECTIVE, ADAPTIVE])
def test_collective_hops_join_two_ranks_only(mode):
    preflight.check_hop_mode(mode, 2)
    preflight.check_hop_mode(EAGER, 3)
    with pytest.raises(UserError, match="exactly 2 ranks.*has 3: use --hop-mode eager or ready"):
        preflight.check_hop_mode(mode, 3)


@pytest.mark.cluster
@pytest.mark.parametrize("hops", [COLLECTIVE, ADAPTIVE])
def test_collective_hops_keep_tokens_exact(tiny_model, cluster_factory, hops, tmp_path):
    """Each payload an all-sum of the pair (on CUDA over NCCL; here the ring backend's),
    or with adaptive hops a lone step's both ways and the others' only out of rank 0:
    concurrent chats, a long prompt in chunks, sampled and penalised rows, tokens equal
    to mlx-lm's. Loading the model and shutting down travel the same hops."""
    logs = _timed_chats(tiny_model("llama", 6), cluster_factory, 2, hops, tmp_path)
    assert f"{hops} hops" in logs and "settled receives" not in logs


@pytest.mark.cluster
def test_adaptive_hops_on_the_cuda_path_keep_tokens_exact(tiny_model, cluster_factory, tmp_path):
    """Adaptive hops as they run on CUDA (receives settled; the last rank pads each
    inline return, ring.RETURN_PAD_BYTES, and sends only its bytes), run on the CPU, with
    rank 0 building on each inline return before it came (Pipeline.complete's mailboxes):
    concurrent chats, sampled and penalised rows, tokens equal to mlx-lm's."""
    env = {"MLX_RELAY_SETTLE_RECEIVES": "1"}
    logs = _timed_chats(tiny_model("llama", 6), cluster_factory, 2, ADAPTIVE, tmp_path, env)
    assert "adaptive hops" in logs and "settled receives" in logs
    events, _ = timeline_report.read(tmp_path / "timelines")  # (rank 0 filled a mailbox)
    assert any(rank == 0 and event == "settle" for rank, event, _ in events)


def test_mailboxes_take_turns_and_stay_writable():
    """Boxes of one size are handed out in turn, `keep` of them, each written through a
    NumPy view and read through an MLX view of it; sizes do not share boxes."""
    boxes = Mailboxes(keep=2)
    first, second = boxes.take(8), boxes.take(8)
    assert first is not second and boxes.take(8) is first and boxes.take(8) is second
    assert boxes.take(4).size == 4
    np.array(first, copy=False)[:] = np.arange(8, dtype=np.uint8)
    assert first.view(mx.int32).tolist() == np.arange(8, dtype=np.uint8).view(np.int32).tolist()
    with pytest.raises(ValueError, match="fewer than 2"):
        Mailboxes(keep=1)


def _timed_chats(model, cluster_factory, ranks: int, hops: str, tmp_path, env=None) -> str:
    """A cluster of `ranks` with `hops` hops and prefill chunks of 16, each rank keeping
    a timeline: its chats equal mlx-lm's and its timelines are in causal order. Returns
    the ranks' logs."""
    timelines = tmp_path / "timelines"
    running = cluster_factory(
        model,
        ranks,
        "--hop-mode",
        hops,
        "--prefill-chunk",
        "16",
        env={**(env or {}), "MLX_RELAY_TIMELINE": str(timelines)},
    )
    _chats_equal_mlx_lm(running, model)
    logs = running.logs()
    running.stop()  # (each rank writes the rest of its timeline as it exits)
    _check_timelines(timelines, ranks=ranks, hops=hops)
    return logs


def _chats_equal_mlx_lm(running, model) -> None:
    """Four greedy chats at once (one a prompt long enough for several chunks), a seeded
    sampled one and a penalised one: each one's tokens are mlx-lm's."""
    prompts = [
        [{"role": "user", "content": f"Question {i}: why is the sky blue?"}] for i in range(3)
    ]
    prompts.append([{"role": "user", "content": "Tell me a story. " * 12}])
    calls = [running.client.stream(_chat(p)) for p in prompts]
    sampled = chat_request("Seeded: why is the sea blue?", seed=7, max_tokens=8)
    penalised = _chat(prompts[0])
    penalised.params.repetition_penalty = 1.3
    more = [running.client.stream(r) for r in (sampled, penalised)]
    for p, call in zip(prompts, calls, strict=True):
        tokens = [t for chunk in call for t in chunk.token_ids]
        assert tokens == mlx_lm_tokens(model, chat_tokens(model, p), 8)
    seeded, repeated = ([t for chunk in call for t in chunk.token_ids] for call in more)
    seeded_prompt = chat_tokens(
        model, [{"role": "user", "content": "Seeded: why is the sea blue?"}]
    )
    assert seeded == mlx_lm_tokens(
        model, seeded_prompt, 8, seed=7, sampler={"temp": 0.9, "top_p": 0.95}
    )
    assert repeated == mlx_lm_tokens(
        model, chat_tokens(model, prompts[0]), 8, processors={"repetition_penalty": 1.3}
    )


def _check_timelines(folder, ranks: int, hops: str) -> None:
    """Every forward step reached each worker after rank 0 began to build it and came
    back after the last worker had it; the report lays a step out across the ranks."""
    events, carries = timeline_report.read(folder)
    assert {rank for rank, _, _ in events} == set(range(ranks))
    built = [step for rank, event, step in events if rank == 0 and event == "build"]
    assert len(built) > 30
    for step in built:
        start = events[(0, "build", step)]
        arrivals = [events[(r, "header", step)] for r in range(1, ranks)]
        assert start <= arrivals[0] <= arrivals[-1] <= events[(0, "returned", step)]
        assert events[(ranks - 1, "posted", step)] <= events[(ranks - 1, "released", step)]
        if hops == EAGER:
            assert (ranks - 1, "settled", step) in events
    # What the device computed, as watcher threads saw it: a worker's input after its
    # header came; rank 0's part, and with eager hops that part sent on after it began
    # the step.
    for rank in range(1, ranks):
        got = [s for s in built if (rank, "received", s) in events]
        assert got and all(
            events[(rank, "received", s)] >= events[(rank, "header", s)] for s in got
        )
        done = [s for s in built if (rank, "output", s) in events]  # (its part computed)
        assert done and all(
            events[(rank, "output", s)] >= events[(rank, "header", s)] for s in done
        )
    assert any((0, "computed", s) in events for s in built)  # (rank 0's part)
    sent = [s for s in built if (0, "sent", s) in events]
    assert bool(sent) == (hops != READY)
    assert all(events[(0, "sent", s)] >= events[(0, "build", s)] for s in sent)
    # Rank 0 marks the steps whose hops are all all-sums: every step, or with adaptive
    # hops those launched alone (each chat's decode steps once the others are done) but
    # not those launched beside others (the four chats at once: they return inline).
    collective = {step for step in built if (0, "collective", step) in events}
    if hops == COLLECTIVE:
        assert collective == set(built)
    elif hops == ADAPTIVE:
        assert collective and collective != set(built)
        assert {step for step in built if (0, "inline_back", step) in events} == (
            set(built) - collective
        )
    else:
        assert not collective
    # Each step's tokens: a prefill chunk 16 (--prefill-chunk), a decode step one a stream.
    assert set(carries) == set(built) and 16 in carries.values() and min(carries.values()) >= 1
    lines = timeline_report.report(events, skip=4)
    assert "median period" in lines[0]
    # --over: the slow steps alone (all of them over 0.001 ms, none over an hour)
    assert timeline_report.report(events, skip=4, over_ms=0.001)[0] == lines[0]
    assert "no steady steps" in timeline_report.report(events, skip=4, over_ms=3.6e6)[0]
    assert any(f"rank {ranks - 1} posted" in line for line in lines)


def _chat(messages: list[dict]) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        params=pb.SamplingParams(max_tokens=8),
    )


def test_an_outbox_sends_in_posting_order_and_hands_on_a_failure():
    """Messages leave in the order posted, a ready one straight away when nothing is
    pending, one still being computed on the outbox's thread (the others queue behind
    it); a failure there reaches the next drain or post, once; `drain` waits for the rest."""
    sent: list[bytes] = []
    computed = threading.Event()
    box = Outbox(sent.append)
    box.post(b"1")
    assert sent == [b"1"]  # (nothing pending: sent here and now)

    def slow() -> bytes:
        computed.wait(5)
        return b"2"

    box.post(slow)
    box.post(b"3")  # (behind the one computing)
    assert sent == [b"1"]
    computed.set()
    assert box.drain(5)
    assert sent == [b"1", b"2", b"3"]

    def broken() -> bytes:
        raise NeighbourGone("the next rank went away")

    box.post(broken)
    with pytest.raises(NeighbourGone, match="went away"):
        box.drain(5)
    box.post(b"4")  # (raised once)
    assert sent[-1] == b"4"
    box.close()


def test_the_check_under_load_catches_a_token_the_model_would_not_choose(tiny_model):
    """tests/teacher_forcing.py's check, the oracle of bench/greedy_under_load.py's CUDA
    check: mlx-lm's own greedy output passes, and one token swapped for another is caught
    where it is."""
    path = tiny_model("llama", 5)
    model, tokenizer = _load(str(path))  # (the model mlx_lm_tokens runs, loaded once)
    prompt = raw_prompt_tokens(tokenizer, "The harbour at dawn, and")
    output = mlx_lm_tokens(path, prompt, 24)
    assert misses(model, prompt, output)[0] == []
    swapped = list(output)
    swapped[10] ^= 1
    found, margin = misses(model, prompt, swapped)
    assert found and found[0][0] == 10 and found[0][1] > 0 and margin > 0


@pytest.mark.parametrize("size", [3, 4, 5, 8])
def test_every_neighbouring_pair_gets_a_communicator_of_its_own(size):
    """N ranks on CUDA GPUs of their own: splits of the NCCL world give each hop of the
    ring (r -> r+1, the last back to rank 0) a group of exactly its two ranks."""
    pairs: list[frozenset[int]] = []
    colorings = pair_colorings(size)
    assert len(colorings) == (2 if size % 2 == 0 else 3)
    for colors in colorings:
        groups: dict[int, set[int]] = {}
        for rank, color in enumerate(colors):
            groups.setdefault(color, set()).add(rank)
        assert all(len(g) <= 2 for g in groups.values())  # (ranks alone: unused)
        pairs += [frozenset(g) for g in groups.values() if len(g) == 2]
    assert sorted(map(sorted, pairs)) == sorted(sorted({r, (r + 1) % size}) for r in range(size))


def test_collective_hops_off_cuda_join_two_ranks_only():
    with pytest.raises(ValueError, match="exactly 2 ranks"):
        check_pair(3)
    check_pair(2)
