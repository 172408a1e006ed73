"""The family census's model builder and check (bench/family_census.py runs it over every
family of mlx-lm; tests/test_census_families.py keeps the families it found exact).

A tiny config is made for a family from one table of small values (hidden 64, 6 layers,
4 heads, 2 KV heads, 4 experts ...), given to the module's own `ModelArgs`, and the model
is built with random weights. `check` compares its logits over a 20-token prefill and 3
decode steps from mlx-lm's whole model with the stages' at 1, 2 and 3 uneven splits, the
stages chained by the ranks' own code (tests/staged.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
from pathlib import Path

import mlx.core as mx
import mlx_lm.models
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from staged import Staged, greedy_forward

from mlx_relay.model import sharding, vision
from mlx_relay.worker.stage import StepError

# Small values for the ModelArgs fields families name; a field a family requires and
# this table lacks makes it NO-CONFIG.
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "layer_norm_eps": 1e-5,
    "norm_eps": 1e-5,
    "n_layer": 6,
    "n_embd": 64,
    "n_head": 4,
    "num_layers": 6,
    "d_model": 64,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_hidden_size": 128,
    "num_key_value_groups": 2,
    "sliding_window": 8,
    "layer_norm_epsilon": 1e-5,
    "rope_scaling": None,
    "sliding_window_pattern": 3,
    "use_qkv_bias": False,
    "partial_rotary_factor": 0.5,
    "use_bias": False,
    "attention_bias": False,
    "mlp_bias": False,
    "post_norm": False,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "norm_topk_prob": True,
    "shared_expert_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_embeddings": False,
    "max_window_layers": 6,
    "use_sliding_window": False,
}
# What a family needs besides TINY (its own required fields, sizes its defaults make
# too large for the 45 s limit). Families whose ModelArgs wrap a text model's config
# get TINY as that config, plus what is listed under "text_config" here.
OVERRIDES: dict[str, dict] = {
    "gemma3": {"text_config": {"model_type": "gemma3_text"}},
    "mistral3": {"text_config": {"model_type": "mistral"}},
    "kimi_k25": {"text_config": {"model_type": "deepseek_v3"}},
    "qwen3_vl_moe": {"text_config": {"model_type": "qwen3_moe"}},
    "phixtral": {
        "num_vocab": 512,
        "model_dim": 64,
        "num_heads": 4,
        "num_layers": 6,
        "rotary_dim": 8,
    },
    "gemma4": {
        "vocab_size": 512,
        "text_config": {
            "model_type": "gemma4_text",
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
            "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": 0,
        },
    },
    "deepseek_v2": {
        "rope_scaling": {
            "factor": 1.0,
            "original_max_position_embeddings": 2048,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    },
    "kimi_linear": {
        "linear_attn_config": {"kda_layers": [1, 2, 4, 5], "num_heads": 2, "head_dim": 16},
        "model_max_length": 2048,
    },
    "nemotron_h": {
        "hybrid_override_pattern": ["M", "*", "-", "M", "E", "*"],
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
    },
    "llama4": {
        "text_config": {
            "model_type": "llama4_text",
            "attention_chunk_size": 8,
            "interleave_moe_layer_step": 2,
            "intermediate_size_mlp": 128,
            "num_local_experts": 4,
            "use_qk_norm": False,
            "num_experts_per_tok": 1,
        }
    },
    "longcat_flash": {
        "attention_method": "MLA",
        "zero_expert_type": "identity",
        "expert_ffn_hidden_size": 32,
        "zero_expert_num": 2,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
    },
    "longcat_flash_ngram": {
        "expert_ffn_hidden_size": 32,
        "zero_expert_num": 2,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "ngram_vocab_size_ratio": 2,
    },
    "mimo_v2_flash": {
        "hybrid_layer_pattern": [0, 1, 1, 0, 1, 1],
        "moe_layer_freq": [0, 1, 1, 1, 1, 1],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "sliding_window_size": 8,
        "layernorm_epsilon": 1e-5,
        "swa_rope_theta": 10000.0,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 16,
        "swa_v_head_dim": 16,
        "v_head_dim": 16,
        "partial_rotary_factor": 1,
    },
    "bailing_moe_linear": {"layer_group_size": 3, "group_norm_size": 2},
    "bailing_hybrid": {"layer_group_size": 3, "group_norm_size": 2},
    "mamba2": {"num_heads": 8, "head_dim": 16, "time_step_limit": [0.0, 100.0]},
    "granitemoe": {
        "logits_scaling": 2.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 3.0,
        "residual_multiplier": 0.5,
    },
    "minicpm": {"dim_model_base": 32, "scale_depth": 1.4, "scale_emb": 4.0},
    "rwkv7": {
        "a_low_rank_dim": 8,
        "v_low_rank_dim": 8,
        "gate_low_rank_dim": 8,
        "decay_low_rank_dim": 8,
    },
    "hunyuan": {
        "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
        "use_cla": True,  # (Hunyuan-Large's cross-layer attention: pairs of layers)
    },
    "exaone4": {"sliding_window_pattern": "LLG"},
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "conv", "full_attention", "conv"]},
    "lfm2_moe": {
        "layer_types": ["conv", "full_attention", "conv", "conv", "full_attention", "conv"]
    },
    "ministral3": {
        "rope_parameters": {
            "rope_theta": 10000.0,
            "rope_type": "default",
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 16,
        },
        "layer_types": ["sliding_attention", "full_attention"] * 3,
    },
    "mistral4": {
        "rope_parameters": {
            "rope_theta": 10000.0,
            "rope_type": "default",
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 16,
        }
    },
    "mellum": {
        "rope_parameters": {
            "full_attention": {"rope_theta": 10000.0},
            "sliding_attention": {"rope_theta": 10000.0},
        }
    },
    "glm_moe_dsa": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
    "jamba": {
        "attn_layer_offset": 1,
        "attn_layer_period": 3,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "mamba_d_conv": 4,
        "mamba_d_state": 8,
        "mamba_expand": 2,
    },
    "gpt2": {"n_ctx": 2048, "n_positions": 2048},
    "gpt_bigcode": {"n_inner": 128, "n_positions": 2048},
    "gptj": {"rotary_dim": 8},
    "qwen": {"kv_channels": 16},
    "lille-130m": {"block_size": 2048},
    "spark2_5": {
        "rope_parameters": {
            "full_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        }
    },
    "plamo": {"n_shared_head": 2},
    "openelm": {
        "num_transformer_layers": 6,
        "model_dim": 64,
        "ffn_dim_divisor": 8,
        "num_query_heads": [4] * 6,
        "num_kv_heads": [2] * 6,
        "ffn_multipliers": [2.0] * 6,
    },
    "dbrx": {
        "n_layers": 6,
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
    },
    "afm7": {"hidden_dim": 64, "num_kv_reuse_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    "baichuan_m1": {"sliding_window_layers": [1, 3], "conv_window": 2},
    "minicpm3": {
        "dim_model_base": 32,
        "scale_depth": 1.4,
        "scale_emb": 4.0,
        "rope_scaling": {"original_max_position_embeddings": 2048},
    },
    "pixtral": {"text_config": {"model_type": "llama"}},
    "lfm2-vl": {
        "text_config": {
            "model_type": "lfm2",
            "layer_types": ["conv", "full_attention", "conv", "conv", "full_attention", "conv"],
            "conv_bias": False,
            "conv_L_cache": 3,
            "block_dim": 64,
            "block_ff_dim": 128,
            "block_multiple_of": 16,
            "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": False,
        }
    },
    "bailing_moe_v3": {
        "layer_group_size": 3,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
    },
    "kimi_k3": {
        "linear_attn_config": {
            "kda_layers": [1, 2, 4, 5],
            "num_heads": 2,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "attn_res_block_size": 2,  # (attention residuals: a block state every 2 layers)
    },
    "iquestloopcoder": {"loop_window_size": 8},  # (its second pass's window slides)
    # a window of 4; groups of 2 positions compressed by layers 1 and 3, indexed by
    # layers 1 and 4, read by all but layer 0 (every compressed layer's picks must index
    # entries of its ratio: mlx-lm gathers them unchecked)
    "deepseek_v41": {
        "head_dim": 32,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "sliding_window": 4,
        "compress_ratios": [0, 2, 2, 2, 2, 2],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 4],
        "candidate_source_layer_id": 1,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 2,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 3,
        "hc_sinkhorn_iters": 3,
    },
    "muse_spark": {
        "text_config": {
            "post_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "layer_rope_theta": [10000.0, 10000.0, 0.0] * 2,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
            "final_logit_softcapping": 30.0,
            "output_multiplier": 1.0,
            "moe_hidden_size": 32,
            "moe_intermediate_size": 32,
            "num_local_experts": 4,
            "mlp_layer_types": ["sparse"] * 6,
        }
    },
    "nemotron-nas": {
        "block_configs": [
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.5}},
            {"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 2.0}},
            {"attention": {"n_heads_in_group": 4}, "ffn": {"no_op": True}},
            {"attention": {"n_heads_in_group": 2}, "ffn": {"replace_with_linear": True}},
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
        ]
    },
    "granite": {
        "logits_scaling": 2.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 3.0,
        "residual_multiplier": 0.5,
    },
}
WRAPPERS = (
    "gemma3",
    "gemma4",
    "gemma3n",
    "mistral3",
    "kimi_k25",
    "kimi_vl",
    "lfm2-vl",
    "llama4",
    "minimax_m3_vl",
    "muse_spark",
    "pixtral",
    "qwen3_vl_moe",
)


# Values for fields a family's ModelArgs requires (has no default for) and TINY lacks:
# given only to the families that require them, so no family that builds from TINY
# alone changes.
REQUIRED = {
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "use_qk_norm": False,
    "qk_norm": False,
    "num_shared_experts": 1,
    "num_shared_expert": 1,
    "num_local_experts": 4,
    "shared_intermediate_size": 32,
    "rotary_dim": 8,
    "moe_num_experts": 4,
    "moe_topk": 2,
    "use_mixed_mlp_moe": False,
    "use_cla": False,
    "cla_share_factor": 2,
    "num_attention_groups": 2,
    "hidden_act": "relu2",
    "rotary_emb_base": 10000,
    "rotary_pct": 0.5,
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_allow_neg_eigval": False,
    "conv_bias": False,
    "conv_L_cache": 3,
    "block_dim": 64,
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False,
    "use_expert_bias": False,
    "num_dense_layers": 1,
    "state_size": 8,
    "conv_kernel": 4,
    "use_conv_bias": True,
    "time_step_rank": 8,
    "intermediate_size_mlp": 128,
    "no_rope_layers": [1, 1, 1, 0, 1, 1],
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "mamba_proj_bias": False,
    "ssm_state_size": 8,
    "n_groups": 1,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 8,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "moe_layer_freq": 1,
    "is_moe_layer": [False, True, True, True, True, True],
    "layer_types": ["full_attention", "sliding_attention"] * 3,
}


def tiny_config(family: str) -> dict:
    """The census's config for `family`: TINY, what its ModelArgs requires from
    REQUIRED, then its overrides."""
    extra = dict(OVERRIDES.get(family, {}))
    config = {"model_type": family, **TINY}
    try:
        fields = dataclasses.fields(importlib.import_module(f"mlx_lm.models.{family}").ModelArgs)
    except (ImportError, TypeError):
        fields = ()
    for f in fields:
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if no_default and f.name not in config and f.name in REQUIRED:
            config[f.name] = REQUIRED[f.name]
    config.update(extra)
    if family in WRAPPERS:
        config["text_config"] = {**TINY, **extra.get("text_config", {})}
    return config


SPLITS = ([(0, 6)], [(0, 2), (2, 6)], [(0, 1), (1, 4), (4, 6)])
# Families whose splits must keep some layers together: gemma3n's last 2 layers (the
# tests' model) reuse the keys and values of layers 2 and 3, so the last rank holds 2-5.
FAMILY_SPLITS = {
    "gemma3n": ([(0, 6)], [(0, 2), (2, 6)], [(0, 1), (1, 2), (2, 6)]),
    # afm7's last 2 layers (its second list) reuse layer 3's keys and values
    "afm7": ([(0, 6)], [(0, 2), (2, 6)], [(0, 1), (1, 3), (3, 6)]),
    # deepseek_v41's hops after layers 2, 3 and 4 carry different parts of its shared
    # state (after layer 1 none: layer 0 compresses nothing)
    "deepseek_v41": ([(0, 6)], [(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)]),
}


def families() -> list[str]:
    """Modules of mlx_lm.models that define a Model and its ModelArgs."""
    found = []
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except (Exception, SystemExit):  # noqa: BLE001 - olmo exits without ai2-olmo
            continue
        if hasattr(module, "Model") and hasattr(module, "ModelArgs"):
            found.append(info.name)
    return found


def write_model(family: str, path: Path) -> Path:
    """A tiny random model of `family` at `path` (its config and weights); raises what
    building it raises."""
    arch = importlib.import_module(f"mlx_lm.models.{family}")
    config = tiny_config(family)
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    path.mkdir(parents=True)
    weights = {
        name: (mx.random.normal(w.shape) * 0.5).astype(w.dtype)
        if mx.issubdtype(w.dtype, mx.floating)
        else w
        for name, w in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def tests_model(family: str, path: Path) -> Path | None:
    """The tests' own tiny model of `family` (tests/tiny_models.py), for a family the
    table cannot build; None where the tests have none."""
    from tiny_models import make_tiny_model

    try:
        return make_tiny_model(path, family, num_layers=6, hidden_size=64)
    except ValueError as e:
        if "unknown family" in str(e):
            return None
        raise


def check(family: str, workdir: Path) -> tuple[str, str]:
    """`family`'s census result: its tiny model's logits over a 20-token prefill and 3
    decode steps, from mlx-lm's whole model and from its stages at each of its splits,
    chained as a cluster runs them (tests/staged.py: rank 0's `StageRunner`, then each
    worker's own `WorkerStage.take`; per-layer inputs, n-gram ids and a second lap are
    the ranks' own doing). The loads leave out what the census does not ask about
    (Staged's `housekeeping`: the caches' measure, the unload's gc.collect), which
    would triple its time."""
    if vision.is_vlm({"model_type": family}):  # (gemma4 without a vision_config: text)
        return "VLM", "loaded through mlx-vlm: tests/test_vision*.py compare it with mlx-vlm"
    try:
        path = write_model(family, workdir / family)
    except Exception as e:  # noqa: BLE001 - the census reports every failure
        path = tests_model(family, workdir / "tests")
        if path is None:
            return "NO-CONFIG", f"{type(e).__name__}: {e}"
    prompt = mx.array([[(7 * i + 11) % 500 + 7 for i in range(20)]])
    steps = [mx.array([[t]]) for t in (9, 99, 199)]
    try:
        whole, _ = load_model(path)
        cache = make_prompt_cache(whole)
        expected = [whole(prompt, cache=cache)[:, -1]]
        expected += [whole(t, cache=cache)[:, -1] for t in steps]
    except Exception as e:  # noqa: BLE001
        return "NO-CONFIG", f"mlx-lm itself: {type(e).__name__}: {e}"
    try:
        for split in FAMILY_SPLITS.get(family, SPLITS):
            forward = greedy_forward(Staged(path, list(split), housekeeping=False))
            got = [forward(prompt)] + [forward(t) for t in steps]
            for i, (a, b) in enumerate(zip(got, expected, strict=True)):
                if not mx.array_equal(a, b).item():
                    diff = mx.abs(a - b).max().item()
                    return "MISMATCH", f"split {split} step {i}: max logit difference {diff:.3g}"
    except sharding.UnsupportedFamily as e:
        return "REFUSED", str(e)
    except StepError as e:  # (a worker's load: refused there as on rank 0)
        if isinstance(e.__cause__, sharding.UnsupportedFamily):
            return "REFUSED", str(e.__cause__)
        return "CRASH", f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        return "CRASH", f"{type(e).__name__}: {e}"
    return "EXACT", ""
