"""Families the census (bench/family_census.py) found exact, kept so: stages at 1, 2 and
3 uneven splits bit-identical to the whole mlx-lm model, on its tiny random configs.

qwen3_5 and qwen3_5_moe keep their LM head in the `language_model` they wrap
(`sharding.head_owner`): the census found their logits wrong when the head was looked
for on the wrapper only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import family_census  # noqa: E402

FAMILIES = (
    "qwen3_5",
    "qwen3_5_moe",
    "olmo2",
    "starcoder2",
    "internlm3",
    "smollm3",
    # their parts named otherwise (sharding._PARTS): a layer list inside a decoder
    # module (plamo2, plamo3; plamo3's sliding mask is a window + 1 over a cache of the
    # window), tok_embeddings and an `output` head (internlm2), final_layernorm (phi),
    # transformer.h / wte / ln_f (exaone), a decoder in a wrapped language model (qwen3_vl)
    "plamo2",
    "plamo3",
    "internlm2",
    "phi",
    "exaone",
    "qwen3_vl",
)


@pytest.mark.parametrize("family", FAMILIES)
def test_stages_equal_the_whole_model(family, tmp_path):
    assert family_census.check(family, tmp_path) == ("EXACT", "")


@pytest.mark.parametrize(
    ("family", "reason"),
    [
        ("talkie", "TransformerBlock takes (e_x, x, mask, cache)"),  # the embedding, per layer
        ("deepseek_v41", "LayerCache"),  # its own cache: window plus compressed groups
        ("iquestloopcoder", "makes 12 caches for 6 layers"),  # loops over its layers twice
    ],
)
def test_families_a_stage_cannot_run_are_refused_with_the_reason(family, reason, tmp_path):
    status, why = family_census.check(family, tmp_path)
    assert status == "REFUSED" and f"'{family}'" in why and reason in why
