"""What a model family is, to a shard: the defaults, which a plain mlx-lm decoder keeps.

A stage runs a model's own layer modules between its embedding and its final norm and
head (sharding.py). Most families need nothing else; one that does says so in a
`FamilyAdapter` of its own (one module of this package), and sharding.py, memory.py and
the coordinator ask the adapter instead of naming the family. Every field is one rule,
written as the family's own forward writes it, so a stage stays bit-identical to the
whole model; a field left at its default is the plain decoder's rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_relay.model.carried import Carrier, MaskFor
from mlx_relay.model.step_inputs import LayerInputs

# An operation the family's forward does around the layers, given the model's own
# ModelArgs (so a default the config leaves out is the model's) and an array.
Op = Callable[[Any, mx.array], mx.array]
# How its forward calls a layer, where not `layer(h, mask, cache)`: given the layer, the
# hidden state, `mask_for(cache)` (the model's mask for a layer with that cache), the
# layer's cache and the keyword arguments its step inputs give, the layer's output h.
LayerCall = Callable[..., mx.array]
# (this rank's layers, h entering them, the step's inputs) -> each layer's keyword
# arguments for this call (step_inputs.py).
InputsOf = Callable[[list[Any], mx.array, LayerInputs], list[dict[str, Any]]]


@dataclass(frozen=True)
class Parts:
    """Where a family keeps its decoder body and, in it, the layer list (a dotted path
    where a module of its own holds the list: plamo's `layers.layers`), the token
    embedding and the final norm (None: the forward norms without a module, which a
    PRE_HEAD op then does)."""

    decoder: str = "model"
    layers: str = "layers"
    embed: str = "embed_tokens"
    norm: str | None = "norm"
    # the untied LM head: on the model (or the language model it wraps), or where a
    # dotted path from the model says (gpt_neox: model.embed_out)
    head: str = "lm_head"

    @property
    def head_name(self) -> str:
        return self.head.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class LayerRun:
    """What a family's own loop over this rank's layers is given (FamilyAdapter.run_layers)."""

    inner: Any  # the decoder
    layers: list[Any]
    # a KV-shared layer's local index -> the local index of the layer it reuses (both here)
    kv_sources: dict[int, int]
    caches: list[Any]  # the layers' own, in order (a KV-shared layer has none)
    kws: list[dict[str, Any]]  # each layer's keyword arguments (its step inputs)
    mask_for: MaskFor  # the model's mask for a layer with this cache


@dataclass(frozen=True)
class FamilyAdapter:
    """One family's rules (or several model types' that share them). The defaults are a
    plain decoder's: `embed_tokens`, `layer(h, mask, cache)` over `model.layers`, `norm`,
    `lm_head`, one cache per layer, decode groups batched."""

    # the model types (config.json's model_type) these rules are for
    names: tuple[str, ...] = ()
    # model types whose ModelArgs only wrap this text family's config and whose decoder is
    # its (mlx-lm's gemma4 wraps gemma4_text): every rule is this family's
    wrappers: tuple[str, ...] = ()
    parts: Parts = Parts()
    # where, from the model, its decoder's own args are, where its ModelArgs only wrap a
    # text config (gemma3n: model.language_model.config)
    text_args: str | None = None

    # --- around the layers (rank 0) ---------------------------------------------------
    embed_op: Op | None = None  # on embed_tokens' output
    pre_head_op: Op | None = None  # on the final norm's output, before the head
    logits_op: Op | None = None  # on the head's output
    # an LM head that is not a module called on h: given the module holding it and h
    head_call: Callable[[Any, mx.array], mx.array] | None = None
    # the model's attribute holding token ids whose logits its head sets to -inf
    masked_ids: str | None = None
    # the decoder's table of learned position embeddings, added by each token's position
    position_embeddings: str | None = None
    # its embedding reads the sequence's earlier ids, keeping the last few in a cache of
    # its own, first in the model's cache list (LongCat Flash's n-gram embedding)
    embed_reads_ids: bool = False
    # modules of the decoder, besides the embedding, that only rank 0 holds and runs
    root_parts: tuple[str, ...] = ()

    # --- the layers (every rank) ------------------------------------------------------
    layer_call: LayerCall | None = None
    # what its layers take besides h, which rank 0 computes and sends (step_inputs.py),
    # and in which configurations (its ModelArgs; None: always)
    layer_inputs: InputsOf | None = None
    inputs_when: Callable[[Any], bool] | None = None
    # rank 0 computes per-layer inputs from the token ids every step (`per_layer_inputs`)
    per_layer: bool = False
    # some layers keep no cache: given a layer, whether it keeps one (nemotron_h)
    keeps_cache: Callable[[Any], bool] | None = None
    # last layers reuse an earlier layer's keys and values, computed in the same step: the
    # decoder's list of, for each layer, the layer whose keys and values it uses
    kv_sharing: str | None = None
    # its last layers sit in a second list, each reusing the first list's last layer's
    # keys and values: (the list, the config key counting it) (afm7)
    reuse_list: tuple[str, str] | None = None
    # its sliding-window layers' mask window, where not their cache's size
    sliding_mask_window: Callable[[Any], int] | None = None
    # what its layers take and return besides h, carried with it (carried.py)
    carrier: Carrier | None = None
    altup: bool = False  # its state between layers is AltUp streams (altup.py)
    passes: int = 1  # 2: every layer runs twice a step (two_pass.py)
    # decode groups run row by row: a batch would change its tokens, or its caches have
    # no batch form
    row_by_row: bool = False
    maskless: bool = False  # its layers take no mask (caches of its own kind)
    # as a vision-language model whose image tokens attend to each other (its config's
    # use_bidirectional_attention is "vision"), which mlx-vlm's mask does only in an
    # unchunked prefill from position 0: an image prompt goes round whole (vision.py)
    prefills_images_whole: bool = False

    # --- memory (memory.py) -----------------------------------------------------------
    # how its caches' size follows from its config alone: "attention" (keys and values
    # of every KV head, or sliding windows), "mla" (a latent and a rotary key per
    # position), "mla_indexer" (MLA plus an indexer key, in a CacheList); None: not from
    # the family (a config's layer_types, mlx-lm's default caches, or measured)
    kv_cache: str | None = None
    # its config's sliding_window_pattern says which layers slide (gemma3's)
    sliding_pattern: bool = False
    # chunked attention on 3 of 4 layers (llama 4's attention_chunk_size)
    chunked_attention: bool = False

    @property
    def name(self) -> str:
        """The family these rules are for ("" for the defaults)."""
        return self.names[0] if self.names else ""

    @property
    def calls_layers_itself(self) -> bool:
        """Whether its layers are called otherwise than `layer(x, mask, cache)`, as its
        forward calls them (check_splittable then leaves their signature alone)."""
        return bool(
            self.layer_call or self.altup or self.carrier or self.reuse_list or self.passes == 2
        )

    def takes_inputs(self, args: Any) -> bool:
        """Whether its layers, in this configuration (ModelArgs), take step inputs."""
        if self.layer_inputs is None:
            return False
        return self.inputs_when is None or self.inputs_when(args)

    def per_layer_inputs(
        self, inner: Any, vision: bool, tokens: mx.array, h: mx.array, ids_part: Any
    ) -> mx.array:
        """The per-layer inputs of every layer (batch, tokens, layers, dim), on rank 0
        from the token ids and the first hidden state, for a family with `per_layer`."""
        raise NotImplementedError(f"{self.name or 'this family'} takes no per-layer inputs")

    def run_layers(self, run: LayerRun, h: mx.array) -> mx.array:
        """This rank's layers as the family's own forward loops over them, for a family
        whose layers share keys and values or take AltUp streams."""
        raise NotImplementedError(f"{self.name or 'this family'} runs its layers one by one")
