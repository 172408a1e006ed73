"""model/cache_sizes.py: which KV-cache buffer sizes a CUDA load warms, of what shape."""

from __future__ import annotations

from mlx_relay.model import sharding
from mlx_relay.model.cache_sizes import attention_shape, buffer_sizes, warm


def test_every_buffer_size_a_sequence_passes_through_up_to_the_limit():
    assert buffer_sizes(1000) == [256, 512, 768, 1024]  # (1,000 tokens fill 1,024)
    assert buffer_sizes(1024) == [256, 512, 768, 1024]
    assert buffer_sizes(20000)[-1] == 8192 and len(buffer_sizes(20000)) == 32
    assert buffer_sizes(0) == buffer_sizes(8192)  # (no bound: the limit's)


def test_a_ranks_attention_shape_is_its_share_of_the_heads():
    llama = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert attention_shape(llama) == (32, 8, 128)
    assert attention_shape(llama, 2) == (16, 4, 128)
    assert attention_shape({"text_config": {**llama, "head_dim": 256}}) == (32, 8, 256)
    assert attention_shape({"hidden_size": 64}) is None  # (not said plainly: nothing run)


def test_off_cuda_nothing_is_built(tiny_model):
    """The CPU's (and Metal's) attention kernels do not depend on lengths."""
    path = tiny_model("llama", 2)
    shard = sharding.load_shard(path, 0, 2, has_ends=True)
    assert warm(shard, path) == (0, 0.0)
