"""Families the census (tests/census.py; bench/family_census.py runs it over every family)
found exact, kept so: stages at 1, 2 and 3 uneven splits bit-identical to the whole mlx-lm
model, on its tiny random configs.

qwen3_5 and qwen3_5_moe keep their LM head in the `language_model` they wrap
(`sharding.head_owner`): the census found their logits wrong when the head was looked
for on the wrapper only."""

from __future__ import annotations

import json
from pathlib import Path

import census
import mlx.core as mx
import pytest
from family_checks import RAW_TOKENS, continuable_prompt, raw_request, second_equals_mlx_lm
from oracle import (
    chat_request,
    chat_tokens,
    generate_concurrently,
    mlx_lm_tokens,
    raw_prompt_tokens,
)
from tiny_models import write_tokenizer

from mlx_relay.model import memory, sharding, split
from mlx_relay.model.kvcache import CacheError, SlotCaches

FAMILIES = (
    "qwen3_5",
    "qwen3_5_moe",
    "olmo2",
    "starcoder2",
    "internlm3",
    "smollm3",
    # their parts named otherwise (their adapters' parts: families/): a layer list inside a decoder
    # module (plamo2, plamo3; plamo3's sliding mask is a window + 1 over a cache of the
    # window), tok_embeddings and an `output` head (internlm2), final_layernorm (phi),
    # transformer.h / wte / ln_f (exaone), a decoder in a wrapped language model (qwen3_vl)
    "plamo2",
    "plamo3",
    "internlm2",
    "phi",
    "exaone",
    "qwen3_vl",
    # a text model wrapped in a `language_model` (mlx-lm's text-only load of a VLM)
    "mistral3",
    "qwen3_vl_moe",
    "kimi_vl",
    # heads and norms named otherwise: `output` (llama4_text), `model.embed_out`
    # (gpt_neox), `embedding_norm` (lfm2), `final_layernorm` (jamba); mamba's layers
    # take no mask; ministral3 and mistral4 layers take an attention scale by position
    "llama4_text",
    "gpt_neox",
    "mamba",
    "lfm2",
    "jamba",
    "ministral3",
    "mistral4",
    # MLA with its own rope scaling (deepseek_v2); linear attention (KDA) and MLA (kimi_linear)
    "deepseek_v2",
    "kimi_linear",
    # layers without a cache between those with one (their adapters' keeps_cache)
    "nemotron_h",
    # large MoEs whose census configs were written by hand (MLA and zero experts;
    # sliding and full attention with sinks)
    "longcat_flash",
    "mimo_v2_flash",
    # every layer takes the step's position offset (its adapter's layer_inputs), which
    # their forward reads from an attention layer's cache; a rank may hold none
    "bailing_moe_linear",
    "bailing_hybrid",
    "bailing_moe_v3",
    # layers with no-op attention keep no cache (their adapters' keeps_cache)
    "nemotron-nas",
    "pixtral",
    "lfm2-vl",
    # learned position embeddings added at the embedding by each row's position (the
    # header's offsets), a table only rank 0 holds (GPT-2, StarCoder 1)
    "gpt2",
    "gpt_bigcode",
    # chunked attention on 3 layers in 4 (ChunkedKVCache: its own mask kind, each cache
    # trimmed to its chunk before a step as the forward does; no batch form, so a decode
    # group runs row by row)
    "llama4",
    # a layer's cache chosen by its index in the whole model (baichuan_m1's sliding
    # layers, each a CacheList of a conv state and a KV cache): a shard of later layers
    # got full-attention caches for its sliding ones until the caches came from a
    # template made with every layer there (Shard.cache_template)
    "baichuan_m1",
    # parts named otherwise: transformer.h (qwen), h / wte / ln_f (gptj), transformer
    # with token_embeddings (openelm), blocks / norm_f (dbrx), tok_embeddings and a tied
    # head (lille-130m), `embedding` (spark2_5), a layer list inside a module (plamo)
    "qwen",
    "gptj",
    "openelm",
    "dbrx",
    "lille-130m",
    "spark2_5",
    "plamo",
    "minicpm3",
    # the census builds it from the tests' own config (tests/tiny_models.py); its last
    # two layers reuse layers 2 and 3's keys and values, so its splits keep 2-5 together
    "gemma3n",
    # a second hidden state besides h, carried folded into the payload (carried.py): the
    # normed embedding every block adds (talkie, whose head is a bare parameter), the
    # first layer's values every later layer mixes in (rwkv7)
    "talkie",
    "rwkv7",
    # attention residuals: one hidden state per block of layers so far, carried after h
    # (a hop after more blocks is wider); its final norm reads their mix
    "kimi_k3",
    # a second layer list after the first, each reusing the keys and values the first
    # list's last layer holds (kv_reuse_layers): joined into one list, split as
    # KV-shared layers are (the last rank holds them with the layer they reuse)
    "afm7",
    # hyper-connection streams, their collapse weights and the state its layers share
    # (compressed rows, index keys, top-k picks, candidate blocks) laid out by the step's
    # position (deepseek_v4.py); splits at layers 2, 3 and 4 (FAMILY_SPLITS) each carry
    # a different part of it
    "deepseek_v41",
    # an n-gram embedding of each position's previous ids (LongCat Flash): rank 0 keeps
    # each sequence's ids and gives every row its own (the census passes them as the
    # header's slots would)
    "longcat_flash_ngram",
    # every layer runs twice a step (two_pass.py): the ring twice, the second lap on
    # the caches the first left, a window of 8 sliding in the second pass
    "iquestloopcoder",
)


@pytest.mark.parametrize("family", FAMILIES)
def test_stages_equal_the_whole_model(family, tmp_path):
    assert census.check(family, tmp_path) == ("EXACT", "")


def test_the_memory_check_counts_a_chunk_for_chunked_layers(tmp_path):
    """Llama 4's chunked layers (3 in 4) hold at most a chunk of positions, so --layers
    auto and the check at load count that for them, not the whole context."""
    path = census.write_model("llama4", tmp_path / "llama4")
    config = json.loads((path / "config.json").read_text())  # as Llama 4's: all in text_config
    mla = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    text = {k: v for k, v in config["text_config"].items() if k not in mla}  # (the census's)
    config = {"model_type": "llama4", "text_config": text}
    (path / "config.json").write_text(json.dumps(config))
    full = memory.cache_nbytes(path, 3, 4, 4096)  # layer 3 attends to every position
    chunked = memory.cache_nbytes(path, 0, 1, 4096)  # chunks of 8 positions
    assert 0 < chunked < full / 10


def test_afm7s_second_layer_list_is_its_last_layers(tmp_path):
    """afm7's kv_reuse_layers are the model's last layers to the split and the memory
    check (their tensors are named `kv_reuse_layers.N`), and a split that parts them
    from the layer whose cache they read is refused with what to do."""
    path = census.write_model("afm7", tmp_path / "afm7")
    config = sharding.read_config(path)
    costs = split.layer_costs(path, 6, config)
    assert costs is not None and all(costs.held) and costs.held[4] == costs.held[5]
    assert memory.shard_nbytes(path, 4, 6) == costs.held[4] + costs.held[5]
    with pytest.raises(ValueError, match="must hold at least 3 layers"):
        split.resolve_layers("4,2", 6, 2, 0.0, costs, sharding.kv_shared_tail(config))
    with pytest.raises(sharding.UnsupportedFamily, match="layer 4 reuses layer 3's keys"):
        sharding.load_shard(path, 4, 6, has_ends=False)


@pytest.mark.parametrize("cla", [True, False])
def test_cross_layer_attention_splits_anywhere(cla, tmp_path, monkeypatch):
    """hunyuan with use_cla (Hunyuan-Large): each second layer reuses the keys and values
    of the layer before it, computed in the same step; where a split parts a pair (after
    layer 1 or 3 here) they travel with h. Without it (Hunyuan-A13B) nothing does."""
    monkeypatch.setitem(
        census.OVERRIDES, "hunyuan", {**census.OVERRIDES["hunyuan"], "use_cla": cla}
    )
    assert census.check("hunyuan", tmp_path) == ("EXACT", "")


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("family", "layers", "hops"),
    [
        ("ministral3", "2,4", "auto"),
        ("nemotron_h", "3,3", "auto"),
        ("bailing_hybrid", "2,4", "auto"),
        ("baichuan_m1", "2,4", "auto"),
        ("llama4", "3,3", "auto"),
        ("gpt2", "2,4", "auto"),
        ("talkie", "2,4", "auto"),
        ("rwkv7", "2,4", "auto"),
        ("kimi_k3", "1,2,3", "eager"),
        ("hunyuan", "1,2,3", "auto"),
        ("afm7", "2,4", "auto"),
        ("deepseek_v41", "2,2,2", "eager"),
        ("deepseek_v41", "3,3", "auto"),
        ("longcat_flash_ngram", "2,4", "auto"),
        ("iquestloopcoder", "2,4", "auto"),
        ("iquestloopcoder", "1,2,3", "eager"),
    ],
)
def test_in_a_cluster_equals_mlx_lm(family, layers, hops, tmp_path, cluster_pool):
    """Two (or three) uneven ranks, a greedy and a seeded chat decoded at once (one
    batch of caches with different offsets), token-exact against mlx-lm. Ministral 3's
    layers take an attention scale that grows past its original context (16 positions
    here); nemotron_h's MLP and MoE layers keep no cache between its mamba and attention
    ones (M * - | M E *: each rank holds one). bailing_hybrid's layers take the step's
    offset (one per row in a group: the header's); rank 0 holds only linear-attention
    layers, whose caches do not count positions. baichuan_m1: rank 1's first layer is a
    sliding one, which only the whole model's cache list knows. llama4: chunks of 8
    positions, the chats longer than that. gpt2: each row's learned position embedding
    by its own offset in the decode group. talkie and rwkv7: a second hidden state
    travels with h. kimi_k3, at 3 ranks: its attention residuals keep a block state
    every 2 layers, carried after h, so each hop is wider than the one before (2, 3,
    then 4 x hidden back to rank 0, whose receive eager hops post at launch). hunyuan,
    at 3 ranks: both hops part a pair of layers sharing keys and values (use_cla), which
    travel with h. afm7: rank 1 holds the last layer of the first list and the second
    list's two layers, which read all its cache holds. deepseek_v41: its streams and
    shared state cross each hop, laid out by each row's position (two rows at different
    positions decode row by row, padded to the wider). longcat_flash_ngram: each row's
    n-gram embedding reads its own earlier ids, which rank 0 keeps. iquestloopcoder:
    every step goes round the ring twice."""
    path = write_tokenizer(census.write_model(family, tmp_path / family))
    running = cluster_pool.serving(path, len(layers.split(",")), "--hop-mode", hops, layers=layers)
    texts = [("Tell me about the sea and the lighthouse.", None), ("Why is the sky blue?", 7)]
    got = generate_concurrently(running.client, [chat_request(t, s, 12) for t, s in texts])
    for (text, seed), tokens in zip(texts, got, strict=True):
        prompt = chat_tokens(path, [{"role": "user", "content": text}])
        sampler = {"temp": 0.9, "top_p": 0.95} if seed is not None else None
        assert tokens == mlx_lm_tokens(path, prompt, 12, seed=seed, sampler=sampler)
    if family in PARKED and (layers, hops) == PARKED_SPLIT:  # the same cluster checks it
        _goes_on_from_a_parked_request(running, path)


# Families whose parked caches a continued prompt goes on from, on 2 ranks split 2,4 with
# the hop mode auto: where test_in_a_cluster_equals_mlx_lm starts that very cluster, it
# checks this too (one cluster start fewer each).
PARKED = ("longcat_flash_ngram", "deepseek_v41", "iquestloopcoder")
PARKED_SPLIT = ("2,4", "auto")


@pytest.mark.cluster
@pytest.mark.parametrize("family", ["deepseek_v41"])
def test_a_prompt_goes_on_from_a_parked_request(family, tmp_path, cluster_pool):
    """A raw prompt continuing an earlier prompt and its output starts from that
    request's parked caches: longcat_flash_ngram's n-gram embedding from the ids rank 0
    kept for it, deepseek_v41 from its LayerCaches (windows and compressed groups, reused
    whole only). The tokens are mlx-lm's going on from the same state. (longcat and
    iquestloopcoder: in test_in_a_cluster_equals_mlx_lm, on its cluster.)"""
    path = write_tokenizer(census.write_model(family, tmp_path / "m"))
    running = cluster_pool.serving(path, 2, "--hop-mode", PARKED_SPLIT[1], layers=PARKED_SPLIT[0])
    _goes_on_from_a_parked_request(running, path)


def _goes_on_from_a_parked_request(running, path: Path) -> None:
    raw = continuable_prompt(path)
    reply = running.client.generate(raw_request(raw, RAW_TOKENS)).text
    first = raw_prompt_tokens(path, raw)
    cached = second_equals_mlx_lm(running, path, first, raw + reply + "\nAnd then?")
    assert cached > len(first)


def test_the_ids_rank_0_keeps_follow_the_caches(tmp_path):
    """What the n-gram embedding reads before a step: the slot's own ids, or a parked
    slot's up to the shared prefix; a freed slot's are gone."""
    path = census.write_model("longcat_flash_ngram", tmp_path / "m")
    caches = SlotCaches(sharding.load_shard(path, 0, 6, has_ends=True))
    assert caches.ids_before(0, 0).shape == (1, 0)
    caches.record_ids(0, caches.ids_before(0, 0), mx.array([[5, 6, 7, 8]]))
    caches.record_ids(0, caches.ids_before(0, 4), mx.array([[9]]))
    assert caches.ids_before(0, 5).tolist() == [[5, 6, 7, 8, 9]]
    assert caches.ids_before(1, 3, source=0).tolist() == [[5, 6, 7]]  # (a prefix reused)
    with pytest.raises(CacheError):
        caches.ids_before(1, 6, source=0)
    caches.free([0])
    with pytest.raises(CacheError):
        caches.ids_before(0, 1)
