"""The family adapters (mlx_relay/model/families/), in process and without any model.

The registry finds every module's adapters, one per model type, and a model type without
one gets the plain decoder's defaults. The rules the adapters give are those the
per-family tables of sharding.py, step_inputs.py, carried.py and memory.py gave before
they moved into the adapters (written out here), so that a family cannot lose or gain
a rule by accident; the model-level tests (test_families.py, test_census_families.py,
test_gemma*.py ...) check that a stage following them is exact.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_relay.model import families, sharding, step_inputs
from mlx_relay.model.families import FamilyAdapter, LayerRun, Parts


def _with(rule) -> set[str]:
    """The model types whose adapter has this rule (a predicate on the adapter)."""
    return {name for name, adapter in families.adapters().items() if rule(adapter)}


def test_every_module_of_the_package_is_found_and_names_its_model_types():
    for name in families._modules():
        module = importlib.import_module(f"mlx_relay.model.families.{name}")
        assert module.ADAPTERS, name
        for adapter in module.ADAPTERS:
            assert isinstance(adapter, FamilyAdapter)
            assert isinstance(adapter.names, tuple) and adapter.names, name
            assert all(families.adapter_for(t) is adapter for t in adapter.names)


def test_two_adapters_for_one_model_type_are_refused():
    with pytest.raises(ValueError, match="'llama' has two family adapters"):
        families.index([FamilyAdapter(names=("llama",)), FamilyAdapter(names=("llama",))])
    with pytest.raises(ValueError, match="two family adapters"):
        families.index([FamilyAdapter(names=("a",)), FamilyAdapter(names=("b",), wrappers=("a",))])


def test_a_model_type_without_an_adapter_is_a_plain_decoder():
    config = {"model_type": "some_new_decoder"}
    adapter = families.adapter_of(config)
    assert adapter is families.PLAIN and adapter.name == ""
    assert sharding.parts_of(config) == Parts()
    assert families.family_of(config) == "some_new_decoder"
    assert not adapter.calls_layers_itself and not adapter.takes_inputs(SimpleNamespace())
    assert adapter.passes == 1 and not adapter.row_by_row and adapter.kv_cache is None
    with pytest.raises(NotImplementedError):
        adapter.per_layer_inputs(None, False, mx.zeros((1, 1)), mx.zeros((1, 1, 1)), None)


def test_a_wrapper_follows_the_text_family_it_wraps():
    assert families.family_of({"model_type": "gemma4"}) == "gemma4_text"
    assert families.adapter_of({"model_type": "gemma4"}) is families.adapter_for("gemma4_text")
    assert families.wraps_text("gemma4") and not families.wraps_text("gemma4_text")
    assert families.adapter_for("gemma4") is families.PLAIN  # (by its config only)


def test_the_rules_are_the_tables_they_replace():
    assert _with(lambda a: a.row_by_row) == {
        "phi3small",
        "llama4",
        "deepseek_v41",
        "iquestloopcoder",
    }
    assert _with(lambda a: a.maskless) == {"deepseek_v41"}
    assert _with(lambda a: a.passes == 2) == {"iquestloopcoder"}
    assert _with(lambda a: a.altup) == {"gemma3n"}
    assert _with(lambda a: a.carrier) == {"talkie", "rwkv7", "kimi_k3", "hunyuan", "deepseek_v41"}
    assert _with(lambda a: a.embed_reads_ids) == {"longcat_flash_ngram"}
    assert {
        t: a.position_embeddings for t, a in families.adapters().items() if a.position_embeddings
    } == {
        "gpt2": "wpe",
        "gpt_bigcode": "wpe",
    }
    per_layer = (
        "embed_tokens_per_layer",
        "per_layer_model_projection",
        "per_layer_projection_norm",
    )
    assert {t: a.root_parts for t, a in families.adapters().items() if a.root_parts} == {
        "gpt2": ("wpe",),
        "gpt_bigcode": ("wpe",),
        "gemma4_text": per_layer,
        "gemma3n": (*per_layer, "altup_projections", "altup_unembed_projections"),
    }
    assert {t: a.kv_sharing for t, a in families.adapters().items() if a.kv_sharing} == {
        "gemma4_text": "previous_kvs",
        "gemma3n": "layer_idx_to_cache_idx",
    }
    assert {t: a.reuse_list for t, a in families.adapters().items() if a.reuse_list} == {
        "afm7": ("kv_reuse_layers", "num_kv_reuse_layers")
    }
    assert _with(lambda a: a.keeps_cache) == {"nemotron_h", "nemotron-nas"}
    assert _with(lambda a: a.sliding_mask_window) == {"plamo3"}
    assert _with(lambda a: a.text_args) == {"gemma3n"}
    assert _with(lambda a: a.per_layer) == {"gemma4_text", "gemma3n"}
    assert _with(lambda a: a.head_call) == {"talkie"}
    assert _with(lambda a: a.masked_ids) == {"phi3small"}
    assert _with(lambda a: a.prefills_images_whole) == {"gemma4_text"}


def test_the_ops_around_the_layers_are_the_tables_they_replace():
    assert _with(lambda a: a.embed_op) == set(
        "gemma gemma2 gemma3_text gemma3 granite granitemoe granitemoehybrid minicpm minicpm3 "
        "afmoe gear muse_glimmer gemma4_text gemma3n nanochat talkie phi3small "
        "recurrent_gemma".split()
    )
    assert _with(lambda a: a.pre_head_op) == {"minicpm", "minicpm3", "nanochat", "talkie"}
    # (a family with none whose config soft-caps its logits is refused: check_splittable)
    assert _with(lambda a: a.logits_op) == set(
        "gemma2 gear granite granitemoe granitemoehybrid cohere cohere2 muse_glimmer "
        "gemma4_text gemma3n nanochat falcon_h1 recurrent_gemma phi3small".split()
    )


def test_how_layers_are_called_and_what_they_take():
    assert _with(lambda a: a.layer_call) == set(
        "bailing_moe_linear bailing_hybrid gemma4_text falcon_h1 ministral3 mistral4 mamba "
        "recurrent_gemma qwen2_vl qwen2_5_vl".split()
    )
    assert _with(lambda a: a.calls_layers_itself) == _with(lambda a: a.layer_call) | {
        "gemma3n",
        "talkie",
        "rwkv7",
        "kimi_k3",
        "hunyuan",
        "deepseek_v41",
        "afm7",
        "iquestloopcoder",
    }
    inputs = {t: a.layer_inputs for t, a in families.adapters().items() if a.layer_inputs}
    assert inputs == {
        "qwen2_vl": step_inputs.mrope,
        "qwen2_5_vl": step_inputs.mrope,
        "gemma4_text": step_inputs.per_layer,
        "gemma3n": step_inputs.per_layer,
        "bailing_moe_linear": step_inputs.step_offset,
        "bailing_hybrid": step_inputs.step_offset,
    }
    gemma4 = families.adapter_for("gemma4_text")
    assert gemma4.takes_inputs(SimpleNamespace(hidden_size_per_layer_input=256))
    assert not gemma4.takes_inputs(SimpleNamespace(hidden_size_per_layer_input=0))
    assert gemma4.takes_inputs(
        SimpleNamespace(hidden_size_per_layer_input=0, use_bidirectional_attention="vision")
    )
    assert families.adapter_for("gemma3n").takes_inputs(SimpleNamespace())
    assert not families.adapter_for("llama").takes_inputs(SimpleNamespace())


def test_the_memory_estimates_are_the_sets_they_replace():
    attention = set(
        "llama mistral qwen2 qwen3 qwen2_moe qwen3_moe mixtral phi phi3 gemma gemma2 gemma3 "
        "gemma3_text starcoder2 olmo olmo2 cohere smollm3 granite internlm2 exaone glm4_moe".split()
    )
    assert _with(lambda a: a.kv_cache == "attention") == attention
    assert _with(lambda a: a.kv_cache == "mla") == {"deepseek_v3", "kimi_k2"}
    assert _with(lambda a: a.kv_cache == "mla_indexer") == {"deepseek_v32"}
    assert _with(lambda a: a.sliding_pattern) == {"gemma3", "gemma3_text", "gemma3n"}
    assert _with(lambda a: a.chunked_attention) == {"llama4"}


def test_parts_named_otherwise():
    assert sharding.parts_of({"model_type": "gpt_neox"}).head_name == "embed_out"
    assert sharding.parts_of({"model_type": "plamo3"}).layers == "layers.layers"
    assert sharding.parts_of({"model_type": "nanochat"}).norm is None
    assert sharding.parts_of({"model_type": "gemma4"}) == Parts()  # (its text family's)
    named = _with(lambda a: a.parts != Parts())
    assert {"falcon_h1", "lfm2-vl", "internlm2", "gemma3n", "talkie", "mamba2"} <= named
    assert len(named) == 37


def test_ops_compute_what_the_family_forwards_compute():
    h = mx.array([[[1.0, -2.0]]])
    args = SimpleNamespace(
        hidden_size=4,
        embedding_multiplier=3.0,
        logits_scaling=2.0,
        final_logit_softcapping=None,
        tie_word_embeddings=False,
        dim_model_base=2,
    )
    granite = families.adapter_for("granitemoe")
    assert granite.embed_op(args, h).tolist() == [[[3.0, -6.0]]]
    assert granite.logits_op(args, h).tolist() == [[[0.5, -1.0]]]
    assert families.adapter_for("gemma").embed_op(args, h).tolist() == [[[2.0, -4.0]]]
    assert families.adapter_for("gemma2").logits_op(args, h).tolist() == h.tolist()  # (no cap)
    assert families.adapter_for("minicpm").pre_head_op(args, h).tolist() == [[[0.5, -1.0]]]
    h16 = mx.array([[[1.0]]], mx.float16)  # gemma3 rounds sqrt(hidden) to bfloat16 first
    scaled = families.adapter_for("gemma3").embed_op(SimpleNamespace(hidden_size=3), h16)
    assert scaled.item() == mx.array(3**0.5, mx.bfloat16).astype(mx.float16).item()
    assert families.adapter_for("plamo3").sliding_mask_window(SimpleNamespace(window_size=8)) == 9


def test_a_family_that_shares_keys_and_values_or_streams_runs_its_own_loop():
    own_loop = _with(lambda a: type(a).run_layers is not FamilyAdapter.run_layers)
    assert own_loop == _with(lambda a: a.kv_sharing or a.reuse_list or a.altup)
    assert own_loop == {"gemma4_text", "gemma3n", "afm7"}
    with pytest.raises(NotImplementedError):
        families.PLAIN.run_layers(
            LayerRun(None, [], {}, [], [], lambda c: None), mx.zeros((1, 1, 1))
        )
