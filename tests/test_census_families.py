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

FAMILIES = ("qwen3_5", "qwen3_5_moe", "olmo2", "starcoder2", "internlm3", "smollm3")


@pytest.mark.parametrize("family", FAMILIES)
def test_stages_equal_the_whole_model(family, tmp_path):
    assert family_census.check(family, tmp_path) == ("EXACT", "")
