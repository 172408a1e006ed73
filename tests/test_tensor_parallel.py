"""`--tensor-parallel`: every layer split across the ranks, token-exact with mlx-lm's own
tensor-parallel generation (tests/tensor_oracle.py), on real rank processes.

Splitting a layer changes the order of its sums, so the oracle is mlx-lm's
`sharded_load(path, tensor_group=...)` run as the same number of ring ranks, not
single-process mlx-lm. Two ranks: on this 2-core machine a third rank's busy-polling
all-sums share the cores with the other two (3 ranks took ~2 s a token here).
"""

from __future__ import annotations

import os
import signal

import grpc
import httpx
import pytest
from oracle import chat_request, chat_tokens, generate_concurrently, mlx_lm_tokens
from support import assert_names, error_of, meanwhile, stream_started
from tensor_oracle import Generation, tensor_generations

from mlx_relay.launch.local import free_ports
from mlx_relay.model import checkpoint
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.protocol.control import HOST_NAME_ENV

pytestmark = pytest.mark.cluster

RANKS = 2
TP = ("--tensor-parallel", str(RANKS))
MESSAGES = [{"role": "user", "content": "Tell me a story about a lighthouse and 3 cats."}]
LONG = [{"role": "user", "content": "Tell me a story about three cats. " * 20}]
TEXTS = ["Name a colour.", "Tell me about the sea and the harbour.", "Count to five."]
REPEAT = [{"role": "user", "content": "Repeat after me: one two three one two three."}]
SEED, SAMPLER = 7, {"temp": 0.8, "top_p": 0.95, "top_k": 40}


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def split_answers(tiny_model):
    """family -> {answer: tokens}: mlx-lm's split generation of every answer this file
    checks of the family, from one run of the oracle's ranks (one start, one load)."""
    answers: dict[str, dict[str, list[int]]] = {}

    def of(family: str) -> dict[str, list[int]]:
        if family not in answers:
            model = tiny_model(family, 4)
            prompt = chat_tokens(model, MESSAGES)
            jobs = {
                "greedy": Generation(prompt, 48),
                "seeded": Generation(prompt, 24, SEED, SAMPLER),
            }
            if family == "llama":  # (the other tests' answers)
                jobs["chunked"] = Generation(chat_tokens(model, LONG), 24)
                jobs |= {t: Generation(chat_tokens(model, _user(t)), 20) for t in TEXTS}
                jobs["repeat"] = Generation(chat_tokens(model, REPEAT), 40)
            tokens = tensor_generations(model, list(jobs.values()), RANKS)
            answers[family] = dict(zip(jobs, tokens, strict=True))
        return answers[family]

    return of


def _chat(messages: list[dict], **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in messages], params=pb.SamplingParams(**params)
    )


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_and_seeded_tokens_equal_mlx_lm_tensor_parallel(
    family, tiny_model, cluster_pool, split_answers
):
    model = tiny_model(family, 4)
    running = cluster_pool.serving(model, RANKS, *TP)
    layout = running.client.status().layout
    assert (layout.stages, layout.tensor_parallel, layout.note) == (1, RANKS, "")
    assert [(r.layer_start, r.layer_end) for r in running.client.status().ranks] == [(0, 4)] * 2
    reply = running.client.generate(_chat(MESSAGES, max_tokens=48))
    assert list(reply.token_ids) == split_answers(family)["greedy"]
    seeded = running.client.generate(
        _chat(MESSAGES, max_tokens=24, temperature=0.8, top_p=0.95, top_k=40, seed=SEED)
    )
    assert list(seeded.token_ids) == split_answers(family)["seeded"]


def test_a_load_giving_layers_is_refused_and_the_split_still_serves(
    tiny_model, cluster_pool, split_answers
):
    """Layers per rank would load the model as a pipeline with the split's settings (CUDA
    graphs off: half the throughput on GPUs), so a split cluster refuses them up front."""
    model = tiny_model("llama", 4)
    running = cluster_pool.serving(model, RANKS, *TP)
    with pytest.raises(grpc.RpcError) as refused:
        running.client.stub.LoadModel(pb.LoadModelRequest(model=str(model), layers="3,1"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    says = "--layers 3,1 gives each rank a range of them: give one or the other"
    assert says in refused.value.details(), refused.value.details()
    assert running.client.status().layout.tensor_parallel == RANKS
    reply = running.client.generate(_chat(MESSAGES, max_tokens=48))
    assert list(reply.token_ids) == split_answers("llama")["greedy"]


def test_a_peer_staged_from_rank_0s_copy_gives_the_same_tokens(
    tiny_model, cluster_factory, split_answers, tmp_path
):
    """--stage-weights with a tensor group: the peer gets every layer whole (it cuts its
    own slices) and nothing of rank 0's ends."""
    model = tiny_model("llama", 4)
    env = {1: {"MLX_RELAY_CACHE": str(tmp_path / "peer-cache")}}
    running = cluster_factory(model, RANKS, *TP, "--stage-weights", rank_env=env)
    reply = running.client.generate(_chat(MESSAGES, max_tokens=48))
    assert list(reply.token_ids) == split_answers("llama")["greedy"]
    staging = running.client.status().ranks[1].staging
    layers = sum(
        nbytes
        for name, nbytes in checkpoint.tensor_bytes(model).items()
        if checkpoint.layer_of(name) is not None
    )
    assert staging.state == "staged" and staging.fetched_bytes == staging.total_bytes
    assert layers <= staging.total_bytes <= 1.05 * layers


def test_eager_hops_and_a_prompt_in_several_chunks(tiny_model, cluster_pool, split_answers):
    """Eager hops (what `auto` picks on a Mac with cores to spare) and a long prompt
    prefilled 64 tokens a step: each chunk's step is split across the ranks."""
    model = tiny_model("llama", 4)
    running = cluster_pool.serving(
        model, RANKS, *TP, "--hop-mode", "eager", "--prefill-chunk", "64"
    )
    assert len(chat_tokens(model, LONG)) > 5 * 64
    reply = running.client.generate(_chat(LONG, max_tokens=24))
    assert list(reply.token_ids) == split_answers("llama")["chunked"]


def test_concurrent_requests_and_a_reused_prompt(tiny_model, cluster_pool, split_answers):
    """Continuous batching (one decode group of three rows) and the prompt cache under a
    tensor split: each answer is the one it gets alone from mlx-lm's split generation."""
    model = tiny_model("llama", 4)
    running = cluster_pool.serving(model, RANKS, *TP, fresh=True)
    replies = generate_concurrently(running.client, [chat_request(t, None, 20) for t in TEXTS])
    for text, tokens in zip(TEXTS, replies, strict=True):
        assert tokens == split_answers("llama")[text], text
    first = running.client.generate(_chat(MESSAGES, max_tokens=12))
    again = running.client.generate(_chat(MESSAGES, max_tokens=12))
    assert again.usage.cached_tokens == len(chat_tokens(model, MESSAGES)) - 1
    assert again.token_ids == first.token_ids


def test_speculation_keeps_the_greedy_tokens(tiny_model, cluster_pool, split_answers):
    """Verify steps (several positions a step) split across the ranks too: the model
    drafting for itself proposes every round (prompt lookup on a random model found
    nothing to propose: its rounds carried no proposals, and split nothing wider), with
    fixed K (whether rounds pay, timed at load, could turn drafting off on a busy
    machine); the tokens are mlx-lm's split greedy ones."""
    model = tiny_model("llama", 4)
    running = cluster_pool.serving(model, RANKS, *TP, "--draft-model", str(model), "--draft-fixed")
    reply = running.client.generate(_chat(REPEAT, max_tokens=40))
    assert list(reply.token_ids) == split_answers("llama")["repeat"]
    speculation = running.client.status().speculation
    assert speculation.draft_tokens >= 4 * 4 and speculation.accepted_draft_tokens > 0


def test_a_family_mlx_lm_cannot_shard_runs_as_a_pipeline(tiny_model, cluster_pool):
    model = tiny_model("gemma3_text", 4)
    running = cluster_pool.serving(model, RANKS, *TP)
    layout = running.client.status().layout
    assert (layout.stages, layout.tensor_parallel) == (RANKS, 1)
    assert "no shard()" in layout.note, layout.note
    reply = running.client.generate(_chat(MESSAGES, max_tokens=24))
    assert list(reply.token_ids) == mlx_lm_tokens(model, chat_tokens(model, MESSAGES), 24)


def test_a_killed_tensor_peer_is_named(tiny_model, cluster_factory):
    running = cluster_factory(tiny_model("llama", 4), RANKS, *TP)
    stream = stream_started(running.client)
    running.cluster.procs[1].kill()
    error, _ = error_of(stream)
    assert_names(error, 1)


def test_a_stopped_tensor_peer_is_named(tiny_model, cluster_factory):
    """A peer alive but silent (SIGSTOP) holds rank 0 in a layer's all-sum: the missing
    heartbeat names it, and rank 0 ends the stream instead of waiting forever."""
    running = cluster_factory(tiny_model("llama", 4), RANKS, *TP)
    _stopped_mid_stream_is_named(running, 1)
    running.cluster.procs[0].wait(60)  # rank 0 gives up and exits (else TimeoutExpired)


def _stopped_mid_stream_is_named(running, rank: int) -> None:
    """SIGSTOP `rank` of `running` while a stream runs: the stream ends UNAVAILABLE
    naming it (the rank is let go again afterwards, if it is still there)."""
    stream = stream_started(running.client)
    peer = running.cluster.procs[rank]
    os.kill(peer.pid, signal.SIGSTOP)
    try:
        error, _ = error_of(stream)
        assert_names(error, rank)
    finally:
        peer.send_signal(signal.SIGCONT)  # (none if it has exited)


@pytest.mark.parametrize("machines", [1, 2], ids=["one-machine", "posing-as-two"])
def test_auto_measures_the_group_and_chooses(machines, tiny_model, cluster_factory, split_answers):
    """`--tensor-parallel auto`: the load times an all-sum over the group (every rank at
    once) and rank 0's weight reading, and says so in status and /metrics. Ranks of one
    machine always run as a pipeline; posing as two machines, whichever layout the
    figures chose serves exactly its own oracle's tokens (the split's or mlx-lm's)."""
    model = tiny_model("llama", 4)
    env = {1: {HOST_NAME_ENV: "other-mac"}} if machines == 2 else {}
    port = free_ports(1)[0]
    running = cluster_factory(
        model,
        RANKS,
        "--tensor-parallel",
        "auto",
        "--http-address",
        f"127.0.0.1:{port}",
        rank_env=env,
    )
    layout = running.client.status().layout
    print(f"\nauto on {machines} machine(s): {layout.note}")
    assert layout.chosen_at_load and layout.note.startswith("auto ("), layout
    assert layout.all_sum_seconds > 0 and layout.layer_seconds > 0, layout
    assert 0 < layout.tensor_token_seconds and 0 < layout.pipeline_token_seconds, layout
    if machines == 1:
        assert (layout.stages, layout.tensor_parallel) == (RANKS, 1)
        assert "share one machine" in layout.note
    reply = running.client.generate(_chat(MESSAGES, max_tokens=48))
    if layout.tensor_parallel == RANKS:
        assert layout.stages == 1 and layout.note.endswith(": split"), layout.note
        assert list(reply.token_ids) == split_answers("llama")["greedy"]
    else:
        assert layout.stages == RANKS
        expected = mlx_lm_tokens(model, chat_tokens(model, MESSAGES), 48)
        assert list(reply.token_ids) == expected
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    gauge = [
        ln for ln in metrics.splitlines() if ln.startswith("mlx_relay:tensor_all_sum_seconds ")
    ]
    assert [float(ln.split()[1]) for ln in gauge] == [pytest.approx(layout.all_sum_seconds)]


def test_auto_on_four_machines_weighs_a_grid_of_pairs(tiny_model, cluster_factory):
    """`--tensor-parallel auto` on 4 ranks posing as 4 machines also weighs a grid of
    pairs: each pair's all-sum timed over its own link, one pair after another (the
    pairs' second ranks write their figures into the timing header), and the pairs'
    estimate beside the pipeline's in the note. Its model has 2 KV heads (no 4-way
    split) and layers large enough (hidden 1,024: a layer's decode step ~5 ms here
    against a pair's all-sum of ~0.1 ms) that the grid is chosen; whichever layout the
    figures chose serves exactly its own oracle's tokens."""
    model = tiny_model("llama", 4, hidden_size=1024)
    prompt = chat_tokens(model, MESSAGES)
    env = {r: {HOST_NAME_ENV: f"mac-{r}"} for r in (1, 2, 3)}
    port = free_ports(1)[0]

    def split_on_two() -> list[int]:  # (mlx-lm's processes, while the cluster's start)
        return tensor_generations(model, [Generation(prompt, 24)], 2)[0]

    with meanwhile(split_on_two, deadline=300) as grid_answer:
        running = cluster_factory(
            model, 4, "--tensor-parallel", "auto", "--http-address", f"127.0.0.1:{port}",
            rank_env=env,
        )  # fmt: skip
    status = running.client.status()
    layout = status.layout
    print(f"\nauto on 4 machines: {layout.note}")
    assert layout.chosen_at_load and "a pair's all-sum" in layout.note, layout
    assert layout.pair_all_sum_seconds > 0 and layout.grid_token_seconds > 0, layout
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    gauge = [ln for ln in metrics.splitlines() if ln.startswith("mlx_relay:tensor_pair_all_sum")]
    assert [float(ln.split()[1]) for ln in gauge] == [pytest.approx(layout.pair_all_sum_seconds)]
    assert "does not divide by 4" in layout.note or layout.stages == 2, layout
    reply = running.client.generate(_chat(MESSAGES, max_tokens=24))
    if layout.stages == 2:
        assert layout.tensor_parallel == 2 and layout.note.endswith(": grid of pairs"), layout
        assert layout.tensor_backend == "ring, stages of 2 (pairs)", layout
        ranges = [(r.layer_start, r.layer_end) for r in status.ranks]
        assert ranges == [(0, 2)] * 2 + [(2, 4)] * 2
        assert list(reply.token_ids) == grid_answer.result(timeout=300)
    else:
        assert (layout.stages, layout.tensor_parallel) == (4, 1), layout
        assert list(reply.token_ids) == mlx_lm_tokens(model, prompt, 24)


def test_a_grid_of_pairs_over_the_ring(tiny_model, cluster_factory, split_answers):
    """`--tensor-parallel 2` on 4 ring ranks: two stages of two, where the ring backend
    has no Group.split: each pair's all-sums are exchanges over their link
    (transport/pairs.py). With eager hops between the stages, a long prompt prefilled 16
    tokens a step and speculative verify steps (the model drafting for itself, fixed K),
    the tokens are mlx-lm's split generation's on 2 ranks; then rank 2, the second
    stage's first rank, stopped mid-stream (SIGSTOP) is named."""
    model = tiny_model("llama", 4)
    running = cluster_factory(
        model,
        4,
        *TP,
        "--hop-mode",
        "eager",
        "--prefill-chunk",
        "16",
        "--draft-model",
        str(model),
        "--draft-fixed",
    )
    status = running.client.status()
    layout = status.layout
    assert (layout.stages, layout.tensor_parallel) == (2, RANKS), layout
    assert layout.tensor_backend == "ring, stages of 2 (pairs)", layout
    assert [(r.layer_start, r.layer_end) for r in status.ranks] == [(0, 2)] * 2 + [(2, 4)] * 2
    assert len(chat_tokens(model, LONG)) > 5 * 16
    reply = running.client.generate(_chat(LONG, max_tokens=24))
    assert list(reply.token_ids) == split_answers("llama")["chunked"]
    reply = running.client.generate(_chat(REPEAT, max_tokens=40))
    assert list(reply.token_ids) == split_answers("llama")["repeat"]
    speculation = running.client.status().speculation
    assert speculation.draft_tokens >= 4 * 4 and speculation.accepted_draft_tokens > 0
    _stopped_mid_stream_is_named(running, 2)
