"""The families people split: MoE, MLA, sliding windows, hybrid linear attention.

Two levels. In process: each family's layers cut into uneven stages (the functions every
rank runs) give logits bit-identical to the whole mlx-lm model, over a prefill and decode
steps that pass the sliding windows. Through real clusters: concurrent greedy and seeded
streams equal single-process mlx-lm token for token at 2 and 3 uneven ranks (the
exhaustive matrix, `make test-all`, adds 1 and 2 ranks for MLA and hybrid attention), and a
second chat turn reuses the first turn's caches exactly where that is exact (plain KV
caches only) and gives mlx-lm's tokens either way.
"""

from __future__ import annotations

import importlib
import time
from math import inf

import mlx.core as mx
import pytest
from conftest import start_cluster
from family_checks import (
    RAW_TOKENS,
    SPLITS,
    continuable_prompt,
    family_oracle,
    family_request,
    raw_request,
    second_equals_mlx_lm,
    whole_model,
)
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from oracle import (
    chat_tokens,
    generate_concurrently,
    raw_prompt_tokens,
)
from staged import Staged, greedy_forward
from tiny_models import (
    ADAPTED_FAMILIES,
    CACHELIST_FAMILIES,
    MOE_FAMILIES,
    MULTIPLIER_FAMILIES,
    ROW_BY_ROW_FAMILIES,
    SCALED_FAMILIES,
    UNSPLITTABLE,
    _config,
)

from mlx_relay.model import memory, sharding
from mlx_relay.model.kvcache import CacheError, SlotCaches
from mlx_relay.model.split import balanced_split, cost_split, default_split, layer_costs
from mlx_relay.protocol import relay_pb2 as pb

FAMILIES = (*MOE_FAMILIES, *CACHELIST_FAMILIES, "gemma3_text")
NUM_LAYERS = 6


@pytest.mark.parametrize(
    "family",
    FAMILIES
    + SCALED_FAMILIES
    + MULTIPLIER_FAMILIES
    + ADAPTED_FAMILIES
    + ROW_BY_ROW_FAMILIES
    + ("llama", "qwen2", "qwen3", "mistral", "phi3"),
)
def test_stages_equal_the_whole_model(tiny_model, family):
    """Logits bit-identical to mlx-lm for a 40-token prefill and 10 decode steps (one
    sequence; ROW_BY_ROW_FAMILIES decode groups row by row), the stages chained by the
    ranks' own code (tests/staged.py)."""
    # gemma2 at a width whose sqrt is not a bfloat16 (gemma3 rounds it, gemma2 does not).
    path = tiny_model(family, NUM_LAYERS, **({"hidden_size": 96} if family == "gemma2" else {}))
    model = whole_model(path)
    prompt = mx.array([[(7 * i + 11) % 500 + 7 for i in range(40)]])
    steps = [mx.array([[t]]) for t in (9, 99, 199, 299, 399, 13, 31, 71, 171, 271)]
    cache = make_prompt_cache(model)
    expected = [model(prompt, cache=cache)[:, -1]] + [model(t, cache=cache)[:, -1] for t in steps]
    for split in SPLITS:
        forward = greedy_forward(Staged(path, list(split), housekeeping=False))
        got = [forward(prompt)] + [forward(t) for t in steps]
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert mx.array_equal(a, b).item(), f"{family} split {split}: step {i} differs"


# (family, ranks, --layers): every family at least once over several ranks; the two
# that failed before (MLA, hybrid linear attention) at 1, 2 and 3 ranks. Their 1- and
# 2-rank clusters are `exhaustive` (make test-all): the 3-rank one has every hop a
# smaller one has (rank 0 sending to a worker, a worker to a worker, the last back to
# rank 0) with a layer boundary of each kind inside, test_stages_equal_the_whole_model
# runs the same splits' stages bit-exact in process, and the 1-rank path (no hop) is
# test_cluster's and test_generation's.


def _cluster(family: str, ranks: int, layers: str | None, exhaustive: bool = False):
    marks = [pytest.mark.exhaustive] if exhaustive else []
    return pytest.param(family, ranks, layers, id=f"{family}-{ranks}ranks", marks=marks)


CLUSTERS = [
    _cluster("deepseek_v3", 1, None, exhaustive=True),
    _cluster("deepseek_v3", 2, "4,2", exhaustive=True),
    _cluster("deepseek_v3", 3, "1,3,2"),
    _cluster("deepseek_v32", 1, None, exhaustive=True),
    _cluster("deepseek_v32", 2, "2,4", exhaustive=True),
    _cluster("deepseek_v32", 3, "2,1,3"),
    _cluster("qwen3_next", 1, None, exhaustive=True),
    _cluster("qwen3_next", 2, "1,5", exhaustive=True),
    _cluster("qwen3_next", 3, "2,1,3"),
    _cluster("qwen3_moe", 2, "1,5"),
    _cluster("mixtral", 3, "2,3,1"),
    _cluster("gpt_oss", 3, "3,2,1"),
    _cluster("glm4_moe", 2, "2,4"),
    _cluster("gemma3_text", 3, "1,2,3"),
]
PROMPTS = [
    ("Tell me about the sea.", None),
    ("Hello! What is the weather like in Paris today, and tomorrow?", 7),
    ("Pipelines split a model's layers across machines. " * 3 + "Explain.", None),
    ("Write add(a, b) in Python.", 21),
]


@pytest.mark.cluster
@pytest.mark.parametrize(("family", "ranks", "layers"), CLUSTERS)
def test_cluster_equals_mlx_lm(tiny_model, cluster_pool, family, ranks, layers):
    path = tiny_model(family, NUM_LAYERS)
    running = cluster_pool.serving(path, ranks, layers=layers)
    results = generate_concurrently(running.client, [family_request(*p) for p in PROMPTS])
    for i, (text, seed) in enumerate(PROMPTS):
        assert results[i] == family_oracle(path, text, seed), f"request {i} ({seed=})"

    # Prompt cache: a chat's next turn, and a raw prompt continuing the first one's
    # prompt and output. Whatever the cluster reused, it is allowed (a state or a slid
    # window only whole) and the tokens are mlx-lm's continuing a cache cut to it.
    first = [{"role": "user", "content": PROMPTS[0][0]}]
    reply = running.client.generate(family_request(*PROMPTS[0])).text
    turn = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
    second_equals_mlx_lm(running, path, chat_tokens(path, first), turn)
    raw = continuable_prompt(path)
    raw_reply = running.client.generate(raw_request(raw, RAW_TOKENS)).text
    first = raw_prompt_tokens(path, raw)
    cached = second_equals_mlx_lm(running, path, first, raw + raw_reply + "\nAnd then?")
    assert cached > len(first), "continuing a prompt and its output reuses its caches"
    status = running.client.status()
    assert status.active_requests == 0 and status.queued_requests == 0


@pytest.mark.parametrize(("family", "overrides"), UNSPLITTABLE)
def test_a_family_that_cannot_be_split_is_refused_when_it_loads(tiny_model, family, overrides):
    path = tiny_model(family, 4, overrides=overrides)
    with pytest.raises(
        sharding.UnsupportedFamily, match=f"'{family}' cannot be split over ranks: "
    ) as refused:
        sharding.load_shard(path, 0, 2, has_ends=True)
    if overrides:
        assert overrides[0][0] in str(refused.value), "the reason names what is refused"


@pytest.mark.cluster
def test_an_unsplittable_cluster_fails_at_start_naming_the_family(tiny_model, tmp_path):
    family, overrides = UNSPLITTABLE[0]
    path = tiny_model(family, 4, overrides=overrides)
    with pytest.raises(
        AssertionError,
        match=f"model family '{family}' cannot be split over ranks: ",
    ):
        start_cluster(path, 2, tmp_path / "logs", timeout=120)


@pytest.mark.cluster
def test_cancel_and_free_with_rotating_and_ssm_caches(tiny_model, cluster_factory):
    """Streams cancelled mid-decode leave no state behind: the ring stays in step and a
    freed and reloaded model answers exactly (hybrid caches: SSM + KV; gpt-oss: sliding;
    deepseek_v32: a CacheList per layer; falcon_h1: SSM + KV in one CacheList)."""
    hybrid = tiny_model("qwen3_next", NUM_LAYERS)
    running = cluster_factory(hybrid, 2, layers="2,4")
    client = running.client
    _cancel_two_and_finish(client, hybrid)

    sliding = tiny_model("gpt_oss", NUM_LAYERS)
    client.stub.Free(pb.FreeRequest(), timeout=60)
    client.stub.LoadModel(pb.LoadModelRequest(model=str(sliding), layers="3,3"), timeout=120)
    assert list(client.generate(family_request(*PROMPTS[2])).token_ids) == family_oracle(
        sliding, *PROMPTS[2]
    )

    listed = tiny_model("deepseek_v32", NUM_LAYERS)
    client.stub.Free(pb.FreeRequest(), timeout=60)
    client.stub.LoadModel(pb.LoadModelRequest(model=str(listed), layers="4,2"), timeout=120)
    _cancel_two_and_finish(client, listed)

    both = tiny_model("falcon_h1", NUM_LAYERS)  # a CacheList of an SSM state and a KV cache
    client.stub.Free(pb.FreeRequest(), timeout=60)
    client.stub.LoadModel(pb.LoadModelRequest(model=str(both), layers="1,5"), timeout=120)
    _cancel_two_and_finish(client, both)


def _cancel_two_and_finish(client, path) -> None:
    """Three streams at once, two cancelled once decoding started: the third and a
    later request give mlx-lm's tokens, and nothing stays active."""
    calls = [client.stream(family_request(*PROMPTS[i])) for i in (0, 1, 2)]
    for call in calls[:2]:
        next(iter(call))  # decoding has started
        call.cancel()
    rest = [t for chunk in calls[2] for t in chunk.token_ids]
    assert rest == family_oracle(path, *PROMPTS[2])
    deadline = time.monotonic() + 60
    while client.status().active_requests and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.status().active_requests == 0
    assert list(client.generate(family_request(*PROMPTS[3])).token_ids) == family_oracle(
        path, *PROMPTS[3]
    )


@pytest.mark.parametrize(
    "family",
    [
        "qwen3_next",
        "gpt_oss",
        "deepseek_v3",
        "deepseek_v32",
        "gemma3_text",
        "gemma4_text",  # sliding + full, MoE beside the MLP
        "falcon_h1",  # a CacheList of an SSM state and a KV cache per layer
        "recurrent_gemma",  # RG-LRU states and local attention
    ],
)
def test_decode_groups_of_every_cache_kind(tiny_model, family):
    """Sequences of different lengths prefilled alone, then decoded as one batch (KV, sliding
    and SSM caches merged), one leaving (parked) and one joining midway: each row's
    logits equal its own single-sequence run in mlx-lm, and the parked one goes on alone."""
    path = tiny_model(family, NUM_LAYERS)
    model = whole_model(path)
    staged = Staged(path, [(0, 2), (2, 6)], housekeeping=False)  # (the ranks' own loop)
    prompts = {s: [(13 * s + 5 * i) % 500 + 7 for i in range(9 + 7 * s)] for s in range(3)}
    steps = 12
    feed = {s: [(s * 31 + 17 * i) % 500 + 7 for i in range(steps)] for s in range(3)}

    expected = {}
    for s, prompt in prompts.items():
        cache = make_prompt_cache(model)
        out = [model(mx.array([prompt]), cache=cache)[:, -1]]
        out += [model(mx.array([[t]]), cache=cache)[:, -1] for t in feed[s]]
        expected[s] = out

    got = {s: [] for s in prompts}
    pos = {}
    for s in (0, 1):  # slot 2 joins later
        got[s].append(staged.step([s], [0], mx.array([prompts[s]])))
        pos[s] = len(prompts[s])
    members = [0, 1]
    for i in range(steps):
        if i == 4:  # slot 2 is prefilled and joins
            got[2].append(staged.step([2], [0], mx.array([prompts[2]])))
            pos[2] = len(prompts[2])
            members.append(2)
        if i == 8:  # slot 0 finishes: parked, leaves the group
            staged.park([0])
            members.remove(0)
        tokens = mx.array([[feed[s][len(got[s]) - 1]] for s in members])
        offsets = [pos[s] for s in members]
        logits = staged.step(list(members), offsets, tokens, group=1)
        for row, s in enumerate(members):
            got[s].append(logits[row : row + 1])
            pos[s] += 1
    # Slot 1 has had all its steps; slot 2 (which joined late) leaves the group parked
    # too, and the parked slots' own rows, extracted from the batch, go on alone to the
    # end of their feeds: every slot is compared at every step.
    assert len(got[1]) == len(expected[1])
    staged.park([2])
    for s in (0, 2):
        while len(got[s]) < len(expected[s]):
            token = mx.array([[feed[s][len(got[s]) - 1]]])
            got[s].append(staged.step([s], [pos[s]], token))
            pos[s] += 1
    for s in prompts:
        for i, (a, b) in enumerate(zip(got[s], expected[s], strict=True)):
            assert mx.allclose(a, b, atol=1e-4).item(), f"{family}: slot {s} step {i} differs"
            assert mx.argmax(a).item() == mx.argmax(b).item()


def test_the_split_counts_each_layers_bytes(tiny_model):
    """A dense first layer weighs less than an MoE layer; a token runs through only
    some experts, so its work is less than the bytes the layer holds."""
    path = tiny_model("deepseek_v3", NUM_LAYERS)
    costs = layer_costs(path, NUM_LAYERS, sharding.read_config(path))
    assert costs.held[0] < costs.held[1] == costs.held[5]
    assert costs.work[0] == costs.held[0] and costs.work[1] < costs.held[1]
    assert costs.ends > 0  # embedding, LM head, final norm
    assert sum(default_split(path, NUM_LAYERS, 2)) == NUM_LAYERS

    # Equal costs: the even split, or the head-balanced one; otherwise by cost.
    for n_layers, n, head in ((30, 2, 8.0), (30, 3, 0.0), (4, 2, 100.0), (7, 3, 0.0)):
        assert cost_split([1.0] * n_layers, n, head) == balanced_split(n_layers, n, head)
    assert cost_split([1.0] * 30, 2, 8.0) == [11, 19]
    assert cost_split([1, 1, 1, 1, 1, 1, 1, 1, 8], 2) == [8, 1]  # 8 light layers = 1 heavy
    assert cost_split([6, 1, 1, 1, 1, 1, 1, 6], 2) == [4, 4]
    assert cost_split([1.0] * 12, 3, 0.0, capacity=[1, 2, 3]) == [2, 4, 6]
    assert cost_split([1.0] * 3, 3, 50.0) == [1, 1, 1]  # every rank keeps a layer


def test_layer_bytes_of_a_decoder_not_named_layers(tiny_model):
    """nanochat keeps its layers as transformer.h.N: the split and the memory check
    still count each layer's bytes on its rank, not all of them on rank 0's."""
    path = tiny_model("nanochat", NUM_LAYERS)
    costs = layer_costs(path, NUM_LAYERS, sharding.read_config(path))
    assert costs is not None and all(costs.held) and len(set(costs.held)) == 1
    ends = memory.shard_nbytes(path, 0, 0, ends=True)
    assert 0 < ends == costs.ends  # embedding and LM head only
    assert memory.shard_nbytes(path, 2, 4) == costs.held[2] + costs.held[3]


def test_prefix_reuse_only_where_exact(tiny_model):
    """A state is reused only whole, a sliding window cut back only before anything left
    it, plain KV caches anywhere; a copied or cut cache goes on as mlx-lm's would."""
    rules = (("qwen3_next", (True, 0.0)), ("gpt_oss", (True, 8.0)), ("deepseek_v32", (True, inf)))
    for family, rule in rules:
        path = tiny_model(family, NUM_LAYERS)
        shard = sharding.load_shard(path, 0, NUM_LAYERS, has_ends=True)
        assert (shard.reusable_caches, shard.cut_back_below) == rule
        model = whole_model(path)
        prompt = [(11 * i) % 500 + 7 for i in range(6)]
        more = [17, 71, 117]
        for n in (6, 4):  # the whole parked cache, or a prefix of it
            caches = SlotCaches(shard)

            def run(slot, offset, tokens, source=None, caches=caches, shard=shard):
                h = sharding.embed(shard, mx.array([tokens]))
                c = caches.for_sequence(slot, offset, source, len(tokens))
                return sharding.head(shard, sharding.run_layers(shard, h, c))[:, -1]

            run(0, 0, prompt)
            if not shard.usable_prefix(len(prompt), n):
                with pytest.raises(CacheError):
                    run(1, n, more, source=0)
                continue
            got = run(1, n, more, source=0)
            reference = make_prompt_cache(model)
            want = model(mx.array([prompt[:n] + more]), cache=reference)[:, -1]
            assert mx.allclose(got, want, atol=1e-5).item(), f"{family}: reuse of {n}"
            assert caches.at == {0: 6, 1: n + len(more)}
    assert sharding.load_shard(tiny_model("llama", 4), 0, 4, has_ends=True).cut_back_below == inf


def test_a_cache_kind_without_a_mask_rule_is_refused(tiny_model):
    """A layer cache of a kind no general mask rule covers (deepseek_v41's own window and
    compressed groups, which only its own layers read, maskless: deepseek_v4.py), alone
    or inside a CacheList, is refused before any weight is read."""
    from mlx_lm.models.deepseek_v41 import LayerCache

    config = _config("llama", 4, 64, None, None, None)
    arch = importlib.import_module("mlx_lm.models.llama")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    for cache in (LayerCache(8), CacheList(ArraysCache(2), LayerCache(8))):
        with pytest.raises(sharding.UnsupportedFamily, match="'llama'.*LayerCache"):
            sharding.check_splittable(model, config, [cache] * 4)


def test_a_cachelist_takes_its_mask_from_its_attention_cache():
    """As DeepSeek-V3.2 (attention + indexer) and Baichuan-M1 (conv state + KV or sliding
    window) build their masks: from the first attention cache in the list."""
    window = RotatingKVCache(max_size=8)
    assert sharding.mask_source(CacheList(ArraysCache(2), window)) is window
    first = KVCache()
    assert sharding.mask_source(CacheList(first, KVCache())) is first
    state = ArraysCache(2)
    assert sharding.mask_source(CacheList(state)) is state
    assert sharding.reuse_rule([CacheList(KVCache(), KVCache())] * 2) == (True, inf)
    assert sharding.reuse_rule([CacheList(ArraysCache(2), window)]) == (True, 0.0)


def test_the_cache_estimate_counts_a_cachelist(tiny_model):
    """DeepSeek-V3.2's CacheList (MLA latent + rotary key, indexer keys), from the config
    alone, to the byte of what mlx-lm allocates; the parts of a split add up."""
    path = tiny_model("deepseek_v32", NUM_LAYERS)
    model = whole_model(path)
    caches = make_prompt_cache(model)
    model(mx.array([list(range(5, 45))]), cache=caches)
    for _ in range(300):  # past the first 256 positions
        model(mx.array([[7]]), cache=caches)
    flat = sharding.flat_caches(caches)
    mx.eval([c.state for c in flat])
    real = sum(c.keys.nbytes + c.values.nbytes for c in flat)
    assert memory.cache_nbytes(path, 0, NUM_LAYERS, 340) == real
    parts = memory.cache_nbytes(path, 0, 2, 340) + memory.cache_nbytes(path, 2, NUM_LAYERS, 340)
    assert parts == real
