"""Split any mlx-lm decoder by layer ranges and run one stage of it.

mlx-lm's own pipeline support (`PipelineMixin`) covers a few families only, and the
models' `__call__` cannot be reused on a slice of layers (gemma3 rescales whatever it
is given as embeddings and picks sliding layers by their index in the full list). So a
stage is run with three small functions that follow the models' own code: `embed`,
`run_layers` (one mask per layer from that layer's own cache, which is exactly the
mask the full model would build for it) and `head`. Given the same inputs they give
bit-identical results to the full model, which the tests check for every family.

Layers need not be uniform: a rank's layers may mix full attention, sliding windows
and linear attention (conv/SSM state), dense and MoE MLPs. What mask each layer gets
follows from its cache's kind (`mask_kind`), as in the models' own `__call__`; a
family this cannot reproduce is refused when it loads (`check_splittable`). What
travels between ranks may be more than one hidden state: gemma3n's AltUp streams,
folded into the payload's width (altup.py), or what the layers of talkie, rwkv7, Kimi
K3, Hunyuan-Large and DeepSeek V4.1 take besides h (carried.py); IQuest Loop Coder runs
every layer twice a step, its steps going round the ring twice (two_pass.py). Where a
family differs from a plain decoder, its adapter says how (families/): this module is
the machinery that asks it and names no family itself.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import inspect
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import BaseModelArgs, create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.models.deepseek_v41 import LayerCache as DeepSeekLayerCache
from mlx_lm.utils import load_model

from mlx_relay.model import altup, tensor_split, two_pass, vision
from mlx_relay.model.families import (
    FamilyAdapter,
    LayerRun,
    Parts,
    adapter_for,
    adapter_of,
    family_of,
    wraps_text,
)
from mlx_relay.model.step_inputs import LayerInputs


def parts_of(config: dict[str, Any]) -> Parts:
    return adapter_of(config).parts


def _plain_call(layer: Any, h: mx.array, mask_for: Callable[[Any], Any], c: Any) -> mx.array:
    return layer(h, mask_for(c), c)


def _keeps_cache(layers: list[Any], config: dict[str, Any]) -> tuple[bool, ...] | None:
    keeps = adapter_of(config).keeps_cache
    return tuple(keeps(layer) for layer in layers) if keeps else None


def _cacheless_count(layers: list[Any], config: dict[str, Any]) -> int:
    keeps = adapter_of(config).keeps_cache
    return sum(1 for layer in layers if not keeps(layer)) if keeps else 0


# What mask a layer gets, by its cache's kind: the models build one mask per kind from
# the first cache of that kind (full attention, sliding window, chunked attention,
# linear attention).
FULL, SLIDING, CHUNKED, SSM = "full", "sliding", "chunked", "ssm"
_MASK_KINDS: tuple[tuple[tuple[type, ...], str], ...] = (
    ((RotatingKVCache, BatchRotatingKVCache), SLIDING),
    ((ChunkedKVCache,), CHUNKED),  # (llama 4: attention within chunks of positions)
    ((KVCache, BatchKVCache, QuantizedKVCache, ConcatenateKVCache), FULL),
    ((ArraysCache,), SSM),  # MambaCache is one too
)


# Caches that summarise every position so far (an SSM state; DeepSeek V4.1's window and
# closed compressed groups): reusable whole, never cut back.
STATE_CACHES: tuple[type, ...] = (ArraysCache, DeepSeekLayerCache)


class UnsupportedFamily(ValueError):
    """A model family whose layers cannot be split over ranks exactly."""


_KIND_OF: dict[type, str] = {}  # memo: run_layers asks for every layer of every step


def mask_kind(cache: Any) -> str:
    """FULL, SLIDING or SSM: which of the model's masks a layer with this cache gets."""
    kind = _KIND_OF.get(type(cache))
    if kind is None:
        for kinds, name in _MASK_KINDS:
            if isinstance(cache, kinds):
                kind = _KIND_OF[type(cache)] = name
                break
        else:
            raise UnsupportedFamily(f"no mask rule for a layer with a {type(cache).__name__}")
    return kind


def mask_source(cache: Any) -> Any:
    """The cache a layer's mask is built from: the cache itself, or for a CacheList
    (several caches for one layer: DeepSeek-V3.2's attention and indexer, a conv state
    and a KV cache) its first attention cache, else its first state, as the models
    that make CacheLists build their masks."""
    if type(cache) is not CacheList:
        return cache
    inner = [mask_source(c) for c in cache.caches]
    for c in inner:
        if mask_kind(c) != SSM:
            return c
    if not inner:
        raise UnsupportedFamily("no mask rule for a layer with an empty CacheList")
    return inner[0]


def flat_caches(caches: list[Any]) -> list[Any]:
    """The caches inside any CacheList, one flat list."""
    out: list[Any] = []
    for c in caches:
        out.extend(flat_caches(list(c.caches)) if isinstance(c, CacheList) else [c])
    return out


@dataclass(frozen=True)
class KVQuant:
    """mlx-lm's --kv-bits, --kv-group-size and --quantized-kv-start: a layer's plain KV
    cache becomes a QuantizedKVCache once it holds `start` positions, after the step
    that filled it, as mlx_lm.generate's maybe_quantize_kv_cache does. Every rank
    quantizes the same way: rank 0 sends this in the load document."""

    bits: int
    group_size: int = 64
    start: int = 0

    def __post_init__(self) -> None:
        if self.bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"--kv-bits must be 2, 3, 4, 5, 6 or 8, not {self.bits}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"--kv-group-size must be 32, 64 or 128, not {self.group_size}")
        if self.start < 0:
            raise ValueError(f"--quantized-kv-start must be >= 0, not {self.start}")

    @classmethod
    def of(cls, value: KVQuant | dict[str, int] | None) -> KVQuant | None:
        """From a load document's dict (None: no quantization)."""
        return cls(**value) if isinstance(value, dict) else value

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class Rows(list):
    """A decode group's caches as one cache list per row, each row run alone: quantized
    KV caches have no batch form (mlx-lm does not batch them either), and a batch would
    change a row-by-row family's tokens (see Shard.row_by_row)."""


@dataclass
class Shard:
    """One rank's part of the model: layers [start, end), plus embedding and head on rank 0."""

    model: nn.Module
    config: dict[str, Any]
    start: int
    end: int
    num_layers: int
    has_ends: bool  # embedding, final norm and LM head live here
    # A finished sequence's caches may serve a later prompt that shares a prefix with
    # them, where that is exact: all of what they hold always (a new prompt that
    # continues it), a part of it only if every layer's cache can be cut back to it.
    # Plain KV caches always can; a sliding window's only while nothing has left the
    # window (fewer positions than `cut_back_below`); an SSM state never (docs/how-it-works.md).
    reusable_caches: bool = False
    cut_back_below: float = 0.0
    # The model's own forward asks for array masks (create_attention_mask(...,
    # return_array=True)), e.g. DeepSeek's MLA, which adds its rope scores to the mask.
    array_masks: bool = False
    # A vision-language model loaded through mlx-vlm: its decoder is
    # model.language_model.model, its head model.language_model.lm_head, and rank 0
    # also holds the vision tower and projector (model/vision.py).
    vision: bool = False
    kv: KVQuant | None = None  # quantized KV caches
    # Its layers take step inputs besides h (its adapter's layer_inputs; e.g. Qwen2-VL's
    # positions, gemma4's per-layer inputs), which rank 0 computes.
    takes_inputs: bool = False
    # Layers reusing an earlier layer's keys and values (gemma4's KV sharing): local
    # index -> local index of the layer reused; they have no cache of their own.
    kv_sources: dict[int, int] | None = None
    # Whether each local layer keeps a cache, where some do not (keeps_cache); None: all do.
    keeps_cache: tuple[bool, ...] | None = None
    # Empty caches of the local layers as the whole model made them at load, copied for
    # each new sequence. A model may choose a layer's cache by its index (baichuan_m1's
    # sliding layers), which only the whole layer list gives right.
    cache_template: tuple[Any, ...] = ()
    # Why the model's caches cannot be kept on disk in blocks (prefix_store.py: only
    # plain KV, every layer's, no quantized ones, no ids rank 0's embedding reads);
    # "" where they can.
    not_storable: str = ""

    @property
    def passes(self) -> int:
        """How many times a step runs the layers: 2 for IQuest Loop Coder (two_pass.py),
        whose steps go round the ring twice."""
        return self.adapter.passes

    @property
    def row_by_row(self) -> bool:
        """Whether a decode group runs each row alone on its own caches (Rows): caches
        with no batch form (quantized), or a family a batch changes (row_by_row)."""
        return self.kv is not None or self.adapter.row_by_row

    @cached_property
    def adapter(self) -> FamilyAdapter:
        """The rules of the model's family (families/), looked up once: every step asks."""
        return adapter_of(self.config)

    def usable_prefix(self, held: int, shared: int) -> bool:
        """Whether a parked cache holding `held` positions can start a sequence at its
        first `shared` ones with exactly the state a fresh prefill would give."""
        return self.reusable_caches and (shared == held or held < self.cut_back_below)

    @property
    def inner(self) -> nn.Module:
        if self.vision:
            return self.model.language_model.model
        return inner_model(self.model, self.parts)

    @cached_property
    def parts(self) -> Parts:
        return parts_of(self.config)

    @property
    def layers(self) -> list[nn.Module]:
        """This rank's layers (whatever the family calls its layer list)."""
        return _attr_path(self.inner, self.parts.layers)

    @property
    def outer(self) -> nn.Module:
        """The module holding the LM head: the language model of a VLM, else `head_owner`."""
        return self.model.language_model if self.vision else head_owner(self.model, self.parts.head)

    def make_caches(self) -> list[Any]:
        return new_caches(self)


def head_owner(model: nn.Module, head: str = "lm_head") -> nn.Module:
    """The module holding the LM head (`head`, see Parts): the model, or for a text model
    wrapped in a `language_model` (qwen3_5) that language model; a tied head has none
    anywhere."""
    if "." in head:
        return _attr_path(model, head.rsplit(".", 1)[0])
    language_model = getattr(model, "language_model", None)
    if head not in model and isinstance(language_model, nn.Module):
        if head in language_model:
            return language_model
    return model


def inner_model(model: nn.Module, parts: Parts | None = None) -> nn.Module:
    """The decoder body that owns the layers (model.model for most mlx-lm families; for
    a text model wrapped in a `language_model` (qwen3_vl, mistral3, kimi_vl loaded as
    text by mlx-lm), that model's decoder)."""
    parts = parts or Parts()
    for name in (parts.decoder, "model", "language_model.model", "language_model"):
        candidate = _attr_path(model, name)
        if candidate is not None and _attr_path(candidate, parts.layers) is not None:
            return candidate
    raise ValueError(
        f"model type {type(model).__module__} has no decoder with a 'layers' list; "
        "mlx-relay shards decoders whose forward loops over model.layers"
    )


def _attr_path(obj: Any, dotted: str) -> Any:
    """obj.a.b for "a.b" (None where a part is missing)."""
    for name in dotted.split("."):
        obj = getattr(obj, name, None)
    return obj


def _set_attr_path(obj: Any, dotted: str, value: Any) -> None:
    *owners, name = dotted.split(".")
    for owner in owners:
        obj = getattr(obj, owner)
    setattr(obj, name, value)


def read_config(path: Path) -> dict[str, Any]:
    with open(Path(path) / "config.json") as f:
        return json.load(f)


def count_layers(config: dict[str, Any]) -> int:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if key in config:
            return int(config[key])
    text = config.get("text_config") or {}
    if "num_hidden_layers" in text:
        return int(text["num_hidden_layers"])
    raise ValueError("config.json does not say how many layers the model has")


def hidden_size(config: dict[str, Any]) -> int:
    """The decoder's hidden size (0 if the config does not say): how much a token's
    attention over its context costs beside its weights (coordinator/pace.py)."""
    c = config.get("text_config") or config
    for key in ("hidden_size", "d_model", "n_embd", "dim"):
        value = c.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def head_cost_in_layers(config: dict[str, Any]) -> float:
    """What the LM head costs per decoded token, in decoder layers (0.0 if unknown).

    Decode is matmul-bound, and a matmul's cost follows its weight count: the head has
    vocab x hidden weights, a layer its attention and MLP projections. Rank 0 runs the
    head besides its own layers, so a balanced split gives it that many fewer.
    """
    c = config.get("text_config") or config
    try:
        hidden = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or hidden // heads)
        vocab = int(c["vocab_size"])
        experts = int(c.get("num_experts_per_tok") or 1)  # the experts a token runs through
        mlp = experts * int(c.get("moe_intermediate_size") or c["intermediate_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0.0
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    layer = attention + 3 * hidden * mlp
    return vocab * hidden / layer if layer > 0 else 0.0


def fingerprint(path: Path) -> str:
    """Config plus weight index: equal on every rank when all ranks hold the same model."""
    path = Path(path)
    h = hashlib.sha256()
    h.update(json.dumps(read_config(path), sort_keys=True).encode())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    index = path / "model.safetensors.index.json"
    if index.exists():
        h.update(index.read_bytes())
    return h.hexdigest()[:16]


def load_shard(
    path: Path,
    start: int,
    end: int,
    *,
    has_ends: bool,
    kv: KVQuant | dict[str, int] | None = None,
    tensor: mx.distributed.Group | None = None,
    partial: bool = False,
) -> Shard:
    """Load only layers [start, end) (plus the ends on rank 0) and evaluate only those.

    The weights are opened lazily; the layers of other ranks are dropped before
    anything is evaluated, so peak memory is about the shard, not the whole model.
    `kv`: quantize the plain KV caches (see KVQuant). `tensor`: this rank's tensor group
    (transport/tensor.py): every layer kept is split across it (tensor_split.py), this
    rank evaluating only its slice. `partial`: the checkpoint holds only this stage's
    tensors (a worker's staged files, shard_files.py), so the others' are not looked for.
    """
    kv = KVQuant.of(kv)
    config = read_config(Path(path))
    vlm = vision.load_vlm(Path(path)) if vision.is_vlm(config) else None
    if vlm is not None:
        model, config = vlm
        inner, outer = model.language_model.model, model.language_model
    else:  # (a text model; a Gemma 4 without its tower's weights too: vision.text_only)
        model, config = load_model(Path(path), lazy=True, strict=not partial)
        config = vision.text_only(config)
        try:
            inner = inner_model(model, parts_of(config))
        except ValueError as e:
            raise unsplittable(config.get("model_type"), str(e)) from None
        outer = head_owner(model, parts_of(config).head)
    parts = parts_of(config)
    caches = make_prompt_cache(model)  # all layers still here
    adapter = adapter_of(config)
    if adapter.embed_reads_ids:  # (the embedding's own, first in the list)
        caches = caches[1:]
    if adapter.passes == 2:  # (a layer's two: one per pass)
        caches = two_pass.pair_caches(caches)
    _join_layer_lists(inner, parts, config)
    num_layers = len(_attr_path(inner, parts.layers))
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"layer range [{start}, {end}) outside the model's {num_layers} layers")
    check_splittable(model, config, caches, inner)
    kv_sources = kv_shared_sources(inner, config, start, end)
    reusable, cut_back_below = reuse_rule(caches)
    if kv is not None:
        # A prefix's quantized keys depend on when each position was quantized (which
        # step), so a parked cache would not give what a fresh prefill gives.
        reusable, cut_back_below = False, 0.0
    template = _local_caches(caches, _attr_path(inner, parts.layers), inner, config, start, end)
    _set_attr_path(inner, parts.layers, _attr_path(inner, parts.layers)[start:end])
    if not has_ends:
        for owner, name in ((inner, parts.embed), (inner, parts.norm), (outer, parts.head_name)):
            if name is not None and name in owner:
                owner.pop(name)
        for name in vision.ENCODER_PARTS:  # a VLM's vision tower and projector: rank 0's
            if name in model:
                model.pop(name)
        for name in adapter.root_parts:  # what only rank 0 computes
            if name in inner and inner[name] is not None:
                inner.pop(name)
    if tensor is not None and tensor.size() > 1:
        tensor_split.split(model, config, tensor)
        # (a layer at a time: each slice is cut from its whole tensor, read in full,
        # so evaluating them all at once would hold the whole model for a moment)
        for layer in _attr_path(inner, parts.layers):
            mx.eval(layer.parameters())
    mx.eval(model.parameters())
    shard = Shard(
        model,
        config,
        start,
        end,
        num_layers,
        has_ends,
        reusable,
        cut_back_below,
        wants_array_masks(inner),
        vision.is_vlm(config),
        kv,
        adapter.takes_inputs(model_args_of(outer, config)),
        kv_sources,
        _keeps_cache(_attr_path(inner, parts.layers), config),
        template,
        _not_storable(caches, kv, adapter),
    )
    if kv is not None:  # (its probe step: not with a tensor group, whose collectives
        check_quantizable(shard, caches, probe=tensor is None)  # no other rank is in)
    return shard


def _not_storable(caches: list[Any], kv: KVQuant | None, adapter: FamilyAdapter) -> str:
    """Shard.not_storable, from the whole model's caches as made at load."""
    if kv is not None:
        return "its KV caches are quantized (--kv-bits)"
    if adapter.embed_reads_ids or adapter.passes != 1:
        return "its steps need more than the keys and values (ids, two passes)"
    kinds = {type(c).__name__ for c in caches if type(c) is not KVCache}
    return f"its caches include {', '.join(sorted(kinds))}" if kinds else ""


def second_list_from(config: dict[str, Any]) -> int:
    """The model's index of the first layer of its second layer list (reuse_list);
    0 for a model with one list."""
    reusing = kv_shared_layers(config) if adapter_of(config).reuse_list else 0
    return count_layers(config) - reusing if reusing else 0


def _join_layer_lists(inner: nn.Module, parts: Parts, config: dict[str, Any]) -> None:
    """One layer list of a decoder that keeps its last layers in a second (reuse_list),
    so that the split, the memory check and the shard see the model's layers in order."""
    rule = adapter_of(config).reuse_list
    if rule is None:
        return
    second = getattr(inner, rule[0])
    _set_attr_path(inner, parts.layers, list(_attr_path(inner, parts.layers)) + list(second))
    setattr(inner, rule[0], [])


def _local_caches(
    caches: list[Any],
    layers: list[Any],
    inner: nn.Module,
    config: dict[str, Any],
    start: int,
    end: int,
) -> tuple[Any, ...]:
    """The whole model's caches of layers [start, end): it makes one, in layer order, for
    each layer that keeps its own (none for a KV-shared layer or one keeps_cache says
    keeps none; check_splittable has made sure the counts agree)."""
    keeps = _keeps_cache(layers, config) or (True,) * len(layers)
    sources = _kv_sources_of(inner, config) or list(range(len(layers)))
    owns = [k and source == i for i, (k, source) in enumerate(zip(keeps, sources, strict=True))]
    first = sum(owns[:start])
    return tuple(caches[first : first + sum(owns[start:end])])


def quantize_caches(caches: list[Any], kv: KVQuant) -> None:
    """Turn each plain KV cache holding at least `kv.start` positions into a
    QuantizedKVCache, in place: the state mlx-lm's maybe_quantize_kv_cache leaves after
    a step (it quantizes what has `to_quantized`: not states, not CacheLists)."""
    for i, c in enumerate(caches):
        if type(c) is KVCache and not c.empty() and c.offset >= kv.start:
            caches[i] = c.to_quantized(group_size=kv.group_size, bits=kv.bits)


def check_quantizable(shard: Shard, all_caches: list[Any], *, probe: bool = True) -> None:
    """Refuse --kv-bits, at load, for a model whose caches cannot be quantized: sliding
    windows (mlx-lm cannot either), or a cached dimension that is not a multiple of the
    group size or an attention that cannot read quantized caches, which a step of this
    shard's layers on two zero positions and then one more on quantized caches shows."""
    kv = shard.kv
    assert kv is not None
    family = shard.config.get("model_type")
    if shard.passes == 2:
        raise UnsupportedFamily(
            f"model family {family!r}: --kv-bits cannot quantize its caches (its second "
            "pass reads the first pass's keys and values as they are); serve it without"
        )
    if any(isinstance(c, RotatingKVCache) for c in all_caches):
        raise UnsupportedFamily(
            f"model family {family!r}: --kv-bits cannot quantize its sliding-window "
            "caches (mlx-lm cannot either); serve it without --kv-bits"
        )
    if not probe:
        return
    h = probe_input(shard, 2)
    caches = new_caches(shard)
    try:
        mx.eval(run_layers(shard, h, caches))
        quantize_caches(caches, KVQuant(kv.bits, kv.group_size, 0))
        mx.eval(run_layers(shard, h[:, :1], caches))
    except Exception as e:  # noqa: BLE001 - whatever mlx says, it is why
        raise UnsupportedFamily(
            f"model family {family!r}: its caches cannot be quantized with --kv-bits "
            f"{kv.bits} --kv-group-size {kv.group_size}: {e}"
        ) from None


def probe_input(shard: Shard, tokens: int) -> mx.array:
    """What enters the shard's first layer for a probe step of `tokens` positions: zeros
    of the hidden state, in its layers' float dtype, with any state its family carries."""
    text = shard.config.get("text_config") or shard.config
    floats = [
        a.dtype
        for _, a in tree_flatten(shard.layers[0].parameters())
        if mx.issubdtype(a.dtype, mx.floating)
    ]
    h = mx.zeros((1, tokens, int(text["hidden_size"])), floats[0] if floats else mx.float32)
    if carrier := shard.adapter.carrier:  # (what enters its layers)
        h = carrier.probe_state(shard.inner, shard.start, h)
    return h


def reuse_rule(caches: list[Any]) -> tuple[bool, float]:
    """(reusable at all, cut back exactly below this many positions) for a model whose
    layers make these caches; the same on every rank, as it looks at all layers."""
    caches = flat_caches(caches)  # a CacheList is reusable where all it holds is
    kinds = {type(c) for c in caches}
    if not kinds <= {KVCache, RotatingKVCache, *STATE_CACHES}:
        return False, 0.0
    if kinds & set(STATE_CACHES):  # a state summarises every position: no going back
        return True, 0.0
    windows = [c.max_size for c in caches if isinstance(c, RotatingKVCache)]
    return True, float(min(windows)) if windows else math.inf


def unsplittable(family: str | None, why: str) -> UnsupportedFamily:
    """The one refusal a family that cannot be split gets, naming it and the reason."""
    return UnsupportedFamily(f"model family {family!r} cannot be split over ranks: {why}")


def check_splittable(
    model: nn.Module, config: dict[str, Any], caches: list[Any], inner: nn.Module | None = None
) -> None:
    """Refuse, before any weight is read, a family whose layers a stage cannot run as
    the full model does: UnsupportedFamily names the family and the reason. `inner`:
    the decoder, where it is not `inner_model(model)` (a VLM's language model)."""
    family = family_of(config) if "model_type" in config else type(model).__module__
    adapter = adapter_for(family)

    def refuse(why: str) -> UnsupportedFamily:
        return unsplittable(config.get("model_type", family), why)

    if config.get("final_logit_softcapping") and adapter.logits_op is None:
        # A family without a logits rule whose forward may soft-cap its logits: refused
        # rather than split into different logits.
        raise refuse(
            "its config soft-caps the logits (final_logit_softcapping), and "
            "mlx-relay has no rule for where this family applies it"
        )
    parts = parts_of(config)
    inner = inner if inner is not None else inner_model(model, parts)
    for name in (parts.embed, parts.norm):
        if name is not None and name not in inner:
            raise refuse(
                f"its decoder has no '{name}' (mlx-relay runs {parts.embed}, the "
                f"layers, then {parts.norm} and the LM head)"
            )
    layers = _attr_path(inner, parts.layers)
    # (KV-shared layers have no cache, nor have the layers keeps_cache says keep none)
    owners = len(layers) - _kv_shared_count(inner, config) - _cacheless_count(layers, config)
    if len(caches) != owners:
        raise refuse(
            f"it makes {len(caches)} caches for {owners} layers (mlx-relay keeps one cache "
            "per layer; here some layers keep none or several)"
        )
    for i, cache in enumerate(caches if not adapter.maskless else ()):
        try:
            mask_kind(mask_source(cache))
        except UnsupportedFamily as e:
            raise refuse(f"layer {i}: {e}") from None
    if adapter.calls_layers_itself:  # (called as its forward does)
        return
    for layer in {type(layer): layer for layer in layers}.values():
        params = list(inspect.signature(layer.__call__).parameters)
        if len(params) != 3 or "mask" not in params[1] or "cache" not in params[2]:
            raise refuse(
                f"its {type(layer).__name__} takes ({', '.join(params)}), not (x, mask, cache)"
            )


def wants_array_masks(inner: nn.Module) -> bool:
    """Whether the model's own forward builds its attention masks as arrays."""
    try:
        source = inspect.getsource(type(inner).__call__)
    except (OSError, TypeError):
        return False
    return re.search(r"return_array\s*=\s*True", source) is not None


def new_caches(shard: Shard) -> list[Any]:
    """Fresh KV caches for the local layers, of the types the model itself would use
    (none for a layer that reuses another's keys and values: `kv_sources`)."""
    return copy.deepcopy(list(shard.cache_template))  # (one copy: shared parts stay so)


def model_args(shard: Shard) -> Any:
    """The model's own ModelArgs (the config with the model's defaults filled in)."""
    return model_args_of(shard.outer, shard.config)


def model_args_of(outer: nn.Module, config: dict[str, Any]) -> Any:
    if path := adapter_of(config).text_args:
        return _attr_path(outer, path)
    if wraps_text(config.get("model_type")):  # (the wrapped text model's own)
        language_model = getattr(outer, "language_model", outer)
        # (mlx-vlm's language model, of the family's VLM, keeps its TextConfig as config)
        return getattr(language_model, "args", None) or language_model.config
    args = getattr(outer, "args", None)
    if args is None and isinstance(getattr(outer, "config", None), BaseModelArgs):
        args = outer.config  # (plamo keeps its ModelArgs as `config`)
    return args or SimpleNamespace(**config)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config the decoder is built from: the text config a wrapper (an adapter's
    `wrappers`) passes on (with the defaults its own ModelArgs fills in), else the config
    itself."""
    model_type = config.get("model_type")
    if not wraps_text(model_type):
        return config
    wrapper = importlib.import_module(f"mlx_lm.models.{model_type}")
    return dict(wrapper.ModelArgs.from_dict(config).text_config)


def computes_per_layer_inputs(shard: Shard) -> bool:
    """Whether rank 0 computes per-layer inputs for this model's layers every step (a
    gemma4 VLM may take step inputs without them: an image prompt's token types)."""
    return (
        shard.takes_inputs
        and shard.adapter.per_layer
        and bool(getattr(model_args(shard), "hidden_size_per_layer_input", True))
    )


def per_layer_inputs(
    shard: Shard, tokens: mx.array, h: mx.array, ids_part: mx.array | None = None
) -> mx.array:
    """The per-layer inputs of every layer (batch, tokens, layers, dim) of a family
    that takes them (gemma4, gemma3n), on rank 0 from the token ids and the first hidden
    state (embed's output), by the model's own methods, as its forward computes them
    before its first layer. `ids_part`: the part from the ids, already computed (a gemma4
    image prompt's, by mlx-vlm's get_input_embeddings)."""
    return shard.adapter.per_layer_inputs(shard.inner, shard.vision, tokens, h, ids_part)


def embeds_ids(shard: Shard) -> bool:
    """Whether rank 0's embedding reads each sequence's earlier ids (embed_reads_ids)."""
    return shard.has_ends and shard.adapter.embed_reads_ids


def embed(
    shard: Shard,
    tokens: mx.array,
    offsets: Sequence[int] | None = None,
    before: Sequence[mx.array] | None = None,
) -> mx.array:
    """Token embeddings as the family's own forward feeds them to its first layer.
    `offsets`: each row's first position (learned position embeddings read them);
    `before`: each row's ids before these (1, offset), for `embeds_ids`."""
    adapter = shard.adapter
    if adapter.embed_reads_ids:
        return _ngram_embed(getattr(shard.inner, shard.parts.embed), tokens, before)
    h = getattr(shard.inner, shard.parts.embed)(tokens)
    if table := adapter.position_embeddings:
        rows, length = tokens.shape
        start = mx.array(list(offsets) if offsets is not None else [0] * rows)
        h = h + getattr(shard.inner, table)(start[:, None] + mx.arange(length))
    op = adapter.embed_op
    h = op(model_args(shard), h) if op else h
    if adapter.carrier:
        return adapter.carrier.start(shard.inner, h)
    return altup.expand(shard.inner, h) if adapter.altup else h


def output_width(shard: Shard, width: int, layers_done: int | None = None) -> int:
    """The width of the state the model's first `layers_done` layers (default: up to
    this shard's last) leave, where `width` entered this shard: the same, except for a
    family whose carried state grows (carried.py)."""
    carrier = shard.adapter.carrier
    if carrier is None:
        return width
    done = shard.end if layers_done is None else layers_done
    return carrier.width_after(shard.inner, done, width)


def _ngram_embed(embedding: Any, tokens: mx.array, before: Sequence[mx.array] | None) -> mx.array:
    """LongCat Flash's n-gram embedding of each row, given the row's earlier ids as the
    cache its forward keeps would hold them (the last emb_neighbor_num - 1)."""
    rows = []
    for i in range(tokens.shape[0]):
        earlier = before[i] if before is not None else None
        context = ArraysCache(size=1)
        if earlier is not None and earlier.shape[1]:
            context[0] = earlier[:, max(0, earlier.shape[1] - embedding.n + 1) :].astype(mx.int64)
        rows.append(embedding(tokens[i : i + 1], cache=context))
    return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)


def run_layers(
    shard: Shard,
    h: mx.array,
    caches: list[Any],
    inputs: LayerInputs | None = None,
    *,
    second_pass: bool = False,
) -> mx.array:
    """Each layer gets the mask its own cache implies; caches of one kind share one mask.

    Within a step every cache of a kind (full attention, sliding window, linear
    attention) holds the same positions, so their masks are equal: build each once
    from the first cache of its kind, as the models themselves do. `inputs`: the step's
    inputs besides h, for a family whose layers take more (its adapter's layer_inputs);
    `second_pass`: a two-pass model's second run of the layers (Shard.passes).
    """
    if isinstance(caches, Rows):
        rows = [
            run_layers(shard, h[i : i + 1], c, inputs and inputs.row(i), second_pass=second_pass)
            for i, c in enumerate(caches)
        ]
        return _stack_rows(rows)
    if shard.passes == 2:  # (IQuest Loop Coder: which pass, the step's header says)
        if second_pass:
            return two_pass.second_pass(shard.inner, shard.start, shard.layers, h, caches)
        return two_pass.first_pass(shard.layers, h, caches)
    masks: dict[tuple[str, int], Any] = {}
    first = h
    if inputs is not None and inputs.token_types is not None:  # gemma4's image prompt
        layer_masks = vision.image_masks(shard.inner, h, caches, inputs.token_types)
        for cache, mask in zip(caches, layer_masks, strict=False):  # (the owners first)
            masks[_mask_key(mask_source(cache))] = mask

    def mask_for(cache: Any) -> Any:
        source = mask_source(cache)
        kind = mask_kind(source)
        if kind == CHUNKED:  # (each chunked cache drops what its next chunk cannot see
            source.maybe_trim_front()  # before the step, as llama 4's forward does)
        key = _mask_key(source)
        if key not in masks:
            masks[key] = make_mask(shard, kind, first, source)
        return masks[key]

    adapter = shard.adapter
    if carrier := adapter.carrier:
        return carrier.run_layers(shard.inner, shard.start, shard.layers, h, caches, mask_for)
    call = adapter.layer_call or _plain_call
    kws = None
    if shard.takes_inputs:
        if inputs is None:  # (a probe, or a test's own run: positions from the caches)
            inputs = LayerInputs(offsets=[_offset(caches)] * h.shape[0], deltas=[0] * h.shape[0])
        assert adapter.layer_inputs is not None  # (takes_inputs says it has them)
        kws = adapter.layer_inputs(shard.layers, h, inputs)
    if adapter.altup or shard.kv_sources:  # (its forward's own loop: its adapter's)
        kws = kws if kws is not None else [{}] * len(shard.layers)
        sources = shard.kv_sources or {}
        run = LayerRun(shard.inner, shard.layers, sources, caches, kws, mask_for)
        return adapter.run_layers(run, h)
    if kws is not None:
        for layer, cache, kw in zip(shard.layers, caches, kws, strict=True):
            h = call(layer, h, mask_for, cache, **kw)
        return h
    if shard.keeps_cache is not None:
        own = iter(caches)
        for layer, keeps in zip(shard.layers, shard.keeps_cache, strict=True):
            h = call(layer, h, mask_for, next(own)) if keeps else layer(h, None, None)
        return h
    if call is _plain_call and _all_full(caches):  # (the common case: one mask for all)
        mask = mask_for(caches[0])
        for layer, cache in zip(shard.layers, caches, strict=True):
            h = layer(h, mask, cache)
        return h
    for layer, cache in zip(shard.layers, caches, strict=True):
        h = call(layer, h, mask_for, cache)
    return h


def _all_full(caches: list[Any]) -> bool:
    """Whether every cache is one whose kind is known to be FULL, so that every layer
    gets the same mask (built once): on a GPU, where building the graph is what a token
    waits for, asking each of 32 layers for its mask cost ~2% of a token."""
    return bool(caches) and all(_KIND_OF.get(type(c)) == FULL for c in caches)


def _mask_key(source: Any) -> tuple[str, int]:
    """Which of a step's masks a layer with this cache gets: its kind's (and for a
    sliding window, its window's: windows may differ)."""
    kind = mask_kind(source)
    return (kind, source.max_size if kind == SLIDING else 0)


def _stack_rows(rows: list[mx.array]) -> mx.array:
    """Rows run one by one, as one batch; a family whose state's width depends on the
    row's position (carried.py: DeepSeek V4.1's) gets every row padded to the widest."""
    width = max(r.shape[-1] for r in rows)
    padded = [
        r if r.shape[-1] == width else mx.pad(r, [(0, 0), (0, 0), (0, width - r.shape[-1])])
        for r in rows
    ]
    return mx.concatenate(padded, axis=0)


def _kv_sources_of(inner: nn.Module, config: dict[str, Any]) -> list[int]:
    """For each of the decoder's layers, the layer whose keys and values it uses."""
    adapter = adapter_of(config)
    if adapter.reuse_list:  # (the last layers reuse the one before them)
        n, reusing = count_layers(config), kv_shared_layers(config)
        return list(range(n - reusing)) + [n - reusing - 1] * reusing
    name = adapter.kv_sharing
    return list(getattr(inner, name, None) or []) if name else []


def _kv_shared_count(inner: nn.Module, config: dict[str, Any]) -> int:
    """How many of the decoder's layers reuse another layer's keys and values."""
    return sum(1 for i, source in enumerate(_kv_sources_of(inner, config)) if source != i)


def kv_shared_sources(
    inner: nn.Module, config: dict[str, Any], start: int, end: int
) -> dict[int, int] | None:
    """For layers [start, end) of a model whose last layers reuse earlier layers' keys
    and values (gemma4: num_kv_shared_layers): each KV-shared layer's local index -> the
    local index of the layer it reuses. Those keys and values are computed in the same
    step, so both must be on this rank; UnsupportedFamily if the range parts them."""
    sources = _kv_sources_of(inner, config)
    out: dict[int, int] = {}
    for layer in range(start, end):
        source = sources[layer] if layer < len(sources) else layer
        if source == layer:
            continue
        if not start <= source < end:
            tail = kv_shared_tail(config)
            raise unsplittable(
                family_of(config),
                f"layer {layer} reuses layer {source}'s keys and values, computed in the "
                f"same step, so one rank must hold "
                f"both; layers [{start}, {end}) part them: give the last rank at least "
                f"the last {tail} layers (--layers)",
            )
        out[layer - start] = source - start
    return out or None


def _kv_sharing_args(config: dict[str, Any]) -> Any:
    """The decoder's own args of a family that may share KV (None otherwise), so that a
    value the config leaves out is the model's default (gemma4_text's is 20 layers)."""
    family, adapter = family_of(config), adapter_of(config)
    if not adapter.kv_sharing:
        return None
    module = importlib.import_module(f"mlx_lm.models.{family}")
    if adapter.text_args:  # (gemma3n: its decoder's own TextConfig)
        return module.TextConfig.from_dict(config.get("text_config") or {})
    return module.ModelArgs.from_dict(text_config(config))


def kv_shared_layers(config: dict[str, Any]) -> int:
    """How many last layers keep no keys and values of their own (0: none share)."""
    if rule := adapter_of(config).reuse_list:
        return int(text_config(config).get(rule[1]) or 0)
    args = _kv_sharing_args(config)
    return max(0, int(getattr(args, "num_kv_shared_layers", 0) or 0)) if args else 0


def kv_shared_tail(config: dict[str, Any]) -> int:
    """How many last layers one rank must hold together: the KV-shared layers and the
    layers they reuse (gemma4's and gemma3n's rule: a shared layer reuses the last layer
    of its type before the shared ones); 0 for a model without KV sharing."""
    if not kv_shared_layers(config):
        return 0
    if adapter_of(config).reuse_list:  # (and the one layer they all reuse)
        return kv_shared_layers(config) + 1
    args = _kv_sharing_args(config)
    n = args.num_hidden_layers
    first_shared = n - args.num_kv_shared_layers
    last_of_type = {kind: i for i, kind in enumerate(args.layer_types[:first_shared])}
    return n - min(last_of_type[args.layer_types[j]] for j in range(first_shared, n))


def _offset(caches: list[Any]) -> int:
    """The positions the caches of one sequence hold (for a run without step inputs):
    the first cache that counts them (a linear-attention state does not)."""
    counting = (c for c in flat_caches(caches) if hasattr(c, "offset"))
    return int(getattr(next(counting, None), "offset", 0))


def _chunk_mask(h: mx.array, cache: ChunkedKVCache) -> mx.array:
    """Llama 4's chunked attention: a position sees the earlier positions of its own
    chunk that the cache still holds (from its start_position on)."""
    end = cache.offset + h.shape[1]
    held = mx.arange(cache.start_position, end)
    new = mx.arange(cache.offset, end)[:, None]
    same_chunk = (held // cache.chunk_size) == (new // cache.chunk_size)
    return same_chunk & (held <= new)


def make_mask(shard: Shard, kind: str, h: mx.array, cache: Any) -> Any:
    """The mask the full model builds for layers of this kind (a sliding cache knows
    its own window, which is the model's unless its adapter's sliding_mask_window says
    otherwise: plamo3's forward gives window + 1 over a cache of window)."""
    if kind == SSM:
        return create_ssm_mask(h, cache)
    if kind == CHUNKED:
        return _chunk_mask(h, cache)
    window = None
    if kind == SLIDING and (rule := shard.adapter.sliding_mask_window):
        window = rule(model_args(shard))
    return create_attention_mask(h, cache, window_size=window, return_array=shard.array_masks)


def head(shard: Shard, h: mx.array) -> mx.array:
    """Final norm and LM head (tied embeddings when the model has no lm_head), with
    whatever the family's own forward does around them (its adapter's ops)."""
    adapter = shard.adapter
    if adapter.altup:  # gemma3n: its AltUp streams merged into one first
        h = altup.merge(shard.inner, h)
    if adapter.carrier:
        h = adapter.carrier.final(shard.inner, h)
    norm = shard.parts.norm
    if norm is not None:
        h = getattr(shard.inner, norm)(h)
    if op := adapter.pre_head_op:
        h = op(model_args(shard), h)
    if call := adapter.head_call:
        logits = call(shard.outer, h)
    elif shard.parts.head_name in shard.outer:
        logits = shard.outer[shard.parts.head_name](h)
    else:
        logits = getattr(shard.inner, shard.parts.embed).as_linear(h)
    if op := adapter.logits_op:
        logits = op(model_args(shard), logits)
    if adapter.masked_ids:
        logits[..., getattr(shard.outer, adapter.masked_ids)] = -float("inf")
    return logits
