"""Rank 0's pipeline: what the engine calls to load a model and to run steps on it.

Three rooms do the work, and this module only joins them:
- the split plan (model/split_plan.py): which layers each rank loads;
- rank 0's runner (runner.py): its shard and caches, a step's inputs, its layers and
  the LM head, asking the family's adapter whatever a family needs;
- the ring driver (ring_driver.py): steps launched and completed in FIFO order,
  commands, deferred frees, the ring watch; how each hop is timed is the ring's
  (transport/hops.py), and completing a step gives a `Completion` handle, so the
  engine never knows which hop mode runs.
With one rank the ring is empty and the same calls run locally.

With a tensor group (`--tensor-parallel`, transport/tensor.py) the load chooses the
layout: where the family can split its layers (model/tensor_split.py) every rank loads
every layer, each its slice, and a forward step is rank 0's own as with one rank, its
header sent round the ring to start the peers; otherwise the model runs as a pipeline
and `layout` says why.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_relay import timeline
from mlx_relay.coordinator import layout_choice, staging
from mlx_relay.coordinator.layout_choice import Choice
from mlx_relay.coordinator.pace import StepPace, step_cost
from mlx_relay.coordinator.prefix_index import PrefixIndex
from mlx_relay.coordinator.returns import Completion
from mlx_relay.coordinator.ring_driver import WATCH_INTERVAL_S, RingDriver, Step
from mlx_relay.coordinator.ring_watch import ClusterFailure, RankFailure
from mlx_relay.coordinator.runner import StageRunner
from mlx_relay.device import compute_dtype
from mlx_relay.model import layer_timing, memory, prefix_store, sharding, speed, tensor_split
from mlx_relay.model.default_model import resolve_model
from mlx_relay.model.split_plan import host_speeds, plan_ranges, probes_speed
from mlx_relay.model.step_inputs import PromptInputs
from mlx_relay.protocol import control
from mlx_relay.protocol import header as hdr
from mlx_relay.transport.hub import ControlHub, LinkFailure
from mlx_relay.transport.ring import Ring, bytes_payload, dtype_name
from mlx_relay.transport.tensor import TensorGroup

__all__ = [
    "WATCH_INTERVAL_S",
    "ClusterFailure",
    "Completion",
    "Layout",
    "LoadedModel",
    "Pipeline",
    "RankFailure",
    "Step",
    "hub_ready",
]

log = logging.getLogger("mlx_relay.pipeline")


@dataclass(frozen=True)
class Layout:
    """How the loaded model is spread over the ranks: `stages` in a pipeline, each of
    `tensor` ranks splitting every layer; `why`: why a requested tensor split is not."""

    stages: int
    tensor: int = 1
    why: str = ""
    choice: Choice | None = None  # what `--tensor-parallel auto` measured and chose

    @property
    def note(self) -> str:
        """Why a requested split is not in use, or what `auto` chose by ('' otherwise)."""
        return self.why or (self.choice.describe() if self.choice is not None else "")

    def describe(self) -> str:
        if self.tensor > 1 and self.stages > 1:
            return (
                f"stage x tensor grid: a pipeline of {self.stages} stages, every layer of a "
                f"stage split across its {self.tensor} ranks"
            )
        if self.tensor > 1:
            split = f"tensor parallel: every layer split across {self.tensor} ranks"
            return f"{split} ({self.note})" if self.note else split
        pipeline = f"pipeline of {self.stages} stage{'s' if self.stages > 1 else ''}"
        return f"{pipeline} ({self.note})" if self.note else pipeline


@dataclass
class LoadedModel:
    spec: str
    path: str
    fingerprint: str
    num_layers: int
    ranges: list[tuple[int, int]]
    layout: Layout


def in_flight(steps_in_flight: int, tensor: TensorGroup | None) -> int:
    """The steps the ring may carry at once (0: one a rank, RingDriver's default): the
    user's, else with a split one a stage (one, as on one machine, or a grid's stages).
    `--tensor-parallel auto` keeps one a rank: most loads it makes a pipeline (always on
    ranks sharing a machine), and a split step goes round in order behind the one before
    (two in flight measured as one on the 70B split's 16 streams, bench/RESULTS.md)."""
    if tensor is None or tensor.auto:
        return steps_in_flight
    return steps_in_flight or tensor.stages


class Pipeline:
    def __init__(
        self,
        ring: Ring | None,
        hub: ControlHub | None,
        *,
        heartbeat_timeout: float = 3.0,
        step_timeout: float = 0.0,
        steps_in_flight: int = 0,
        tensor: TensorGroup | None = None,
        stage_weights: bool = False,
        stage_keep_free: int = 0,
        prompt_store: dict[str, Any] | None = None,
    ) -> None:
        self.ring = ring
        self.hub = hub
        self.tensor = tensor
        # --stage-weights: rank 0 ships each worker its shard's files (staging.py)
        self.stage_weights = stage_weights and ring is not None and ring.size > 1
        self.stage_keep_free = stage_keep_free
        self.staged: dict[int, dict[str, Any]] = {}  # each worker's last staging report
        # --prompt-cache-dir: {"dir", "budget"} for every rank's blocks (prefix_store.py)
        self.prompt_store = prompt_store
        steps_in_flight = in_flight(steps_in_flight, tensor)
        self.heartbeat_timeout = heartbeat_timeout
        self.step_timeout = step_timeout
        self.world_size = ring.size if ring else 1
        self.runner = StageRunner(on_ring=self.world_size > 1)
        self.driver = RingDriver(
            ring,
            hub,
            self.runner,
            heartbeat_timeout=heartbeat_timeout,
            step_timeout=step_timeout,
            steps_in_flight=steps_in_flight,
        )
        self.watch = self.driver.watch
        self.loaded: LoadedModel | None = None

    # --- what the engine and the status pages read ------------------------------------
    @property
    def shard(self) -> sharding.Shard | None:
        return self.runner.shard

    @property
    def caches(self) -> Any:
        return self.runner.caches

    @property
    def hidden_size(self) -> int:
        """The loaded model's hidden size (0: none loaded), for costing steps (pace.py)."""
        return self.runner.hidden_size

    @property
    def depth(self) -> int:
        """Steps round the ring at once, at most (RingDriver.depth)."""
        return self.driver.depth

    @depth.setter
    def depth(self, value: int) -> None:
        self.driver.depth = value

    @property
    def in_flight_limit(self) -> int:
        return self.driver.in_flight_limit

    @property
    def pace(self) -> StepPace:
        """The ring's measured pace (what the scheduler sizes prompt chunks by)."""
        return self.watch.pace

    def overdue(self) -> ClusterFailure | None:
        """For a watchdog thread: RingWatch.overdue."""
        return self.watch.overdue()

    def lagging(self, factor: float = 4.0, floor: float = 1.0) -> LinkFailure | None:
        """For a status page: RingWatch.lagging."""
        return self.watch.lagging(factor, floor)

    def worker_stats(self) -> dict[int, Any]:
        return self.hub.snapshot() if self.hub else {}

    # --- commands ------------------------------------------------------------------
    def load(self, spec: str, layers: list[int] | str | None = None) -> LoadedModel:
        """Load `spec` on every rank, each its own layer range; all ranks or none."""
        self.unload()
        path = resolve_model(spec)
        config = sharding.read_config(path)
        num_layers = sharding.count_layers(config)
        layout = self._layout(path, config, layers)
        tensor = self._group_of(layout)
        if tensor is not None:  # (every rank of a stage its layers, each its slice;
            # the stages by equal work)
            stages = plan_ranges(path, layout.stages, None, stats=lambda: [], speeds=lambda: None)
            ranges = [r for r in stages for _ in range(layout.tensor)]
        else:
            ranges = plan_ranges(
                path, self.world_size, layers, stats=self._rank_stats, speeds=self.probe_speeds
            )
        try:  # before any worker loads: rank 0 holds the embedding and LM head too
            memory.check_fits(path, *ranges[0], ends=True, tensor=layout.tensor)
        except memory.ShardTooBig as e:
            raise RankFailure(0, control.host_name(), str(e), hdr.ERR_OUT_OF_MEMORY) from e
        fp = sharding.fingerprint(path)
        kv = memory.plan().kv_quantization()  # quantized KV caches: the same on every rank
        document = {"model": spec, "ranges": ranges, "fingerprint": fp, "kv": kv}
        document["tensor"] = layout.tensor
        if self.prompt_store:
            document["prompt_store"] = self.prompt_store
        if self.stage_weights:
            assert self.hub is not None
            self.staged = staging.stage_weights(
                lambda cmd, data: self.driver.command(cmd, bytes_payload(data)),
                self.hub,
                path,
                ranges,
                keep_free=self.stage_keep_free,
                heartbeat_timeout=self.heartbeat_timeout,
            )
            document["staged"] = True
        try:
            if self.world_size > 1:
                self.driver.command(hdr.CMD_LOAD, bytes_payload(json.dumps(document).encode()))
            self.runner.load(path, *ranges[0], kv, tensor)
            self.runner.store = prefix_store.open_for(document, 0, self.runner.shard.not_storable)
        except Exception:
            if self.world_size > 1:  # the ranks that did load let go again
                self.driver.command(hdr.CMD_UNLOAD)
            raise
        self.runner.loaded()
        self.watch.reset()  # (a new model: its pace is still to be measured)
        self.loaded = LoadedModel(
            spec, str(path), fp, num_layers, [tuple(r) for r in ranges], layout
        )
        log.info("%s: %s", spec, layout.describe())
        return self.loaded

    def _layout(self, path: Path, config: dict[str, Any], layers: list[int] | str | None) -> Layout:
        """The layout a load of the model of `config` gets: split across the tensor
        group where one was asked for and the family can split its layers (else a
        pipeline, and why); with `--tensor-parallel auto`, only where what this load
        measures says the split pays (layout_choice.py)."""
        if self.tensor is None:
            return Layout(stages=self.world_size)
        why = self.tensor.why_not or tensor_split.refusal(config, self.tensor.size)
        if why is None and layers is not None:
            why = "--layers gives each rank a layer range"
        # (auto's grid of pairs, where it has one, is refused or not on its own count)
        weigh_pairs = self.tensor.auto and self.tensor.pairs is not None and layers is None
        pairs_why = (self.tensor.why_not or tensor_split.refusal(config, 2)) if weigh_pairs else why
        if why is not None and pairs_why is not None:
            log.warning("tensor parallel refused, the model runs as a pipeline: %s", why)
            return Layout(stages=self.world_size, why=why)
        if not self.tensor.auto:
            return Layout(stages=self.tensor.stages, tensor=self.tensor.size)
        choice = self._choose(path, config, why or "", (pairs_why or "") if weigh_pairs else None)
        if choice.tensor > 1:
            return Layout(stages=choice.stages, tensor=choice.tensor, choice=choice)
        return Layout(stages=self.world_size, choice=choice)

    def _choose(
        self, path: Path, config: dict[str, Any], split_refused: str, pairs_refused: str | None
    ) -> Choice:
        """`auto`'s measurements for this model, and its choice: one all-sum of a token's
        hidden state over the group (every rank at once) and, with a grid of pairs to
        weigh (`pairs_refused` not None), over each pair in turn; one decode step of the
        model's first layer on rank 0."""
        assert self.tensor is not None
        num_layers = sharding.count_layers(config)
        shape = (1, 1, sharding.hidden_size(config))
        all_sum_s = self.driver.time_all_sum(self.tensor, shape, compute_dtype())
        hosts = [control.host_name(), *(self.watch.host(r) for r in range(1, self.world_size))]
        own_gpus = self.tensor.backend == "nccl"  # (a split reads faster on each GPU)
        pairs: dict[str, Any] = {}
        if self.tensor.pairs is not None and pairs_refused is not None:
            pair_sums = self.driver.time_pair_sums(self.tensor.pairs, shape, compute_dtype())
            pairs = dict(
                pair_sum_s=max(pair_sums),
                pairs_apart=own_gpus
                or all(a != b for a, b in zip(hosts[::2], hosts[1::2], strict=True)),
                pairs_refused=pairs_refused,
            )
        return layout_choice.choose(
            layer_timing.decode_step_seconds(path),
            num_layers,
            self.tensor.size,
            all_sum_s,
            shared_machine=len(set(hosts)) < len(hosts) and not own_gpus,
            split_refused=split_refused,
            **pairs,
        )

    def _group_of(self, layout: Layout) -> TensorGroup | None:
        """The group a load laid out as `layout` splits its layers across: the start's, or
        auto's grid of pairs (None: a pipeline)."""
        if layout.tensor <= 1 or self.tensor is None:
            return None
        group = self.tensor.of_size(layout.tensor)
        assert group is not None, layout
        return group

    def _rank_stats(self) -> list[dict[str, Any] | None]:
        """Every rank's memory figures: rank 0's own, each worker's latest report."""
        snapshot = self.hub.snapshot() if self.hub is not None else {}
        workers = [snapshot[r].stats if r in snapshot else None for r in range(1, self.world_size)]
        return [memory.stats(), *workers]

    def probe_speeds(self) -> list[float] | None:
        """Each rank's weight-reading speed in MB/s (model/speed.py), measured one rank
        after another: rank 0 here, then each worker as CMD_PROBE passes it, writing its
        figure into the header's `lengths` at its rank; ranks of one machine count as
        the fastest of them (split_plan.host_speeds). None where all ranks share one
        machine (nothing is measured), with one rank, or more ranks than a header has
        rows."""
        hosts = [control.host_name(), *(self.watch.host(r) for r in range(1, self.world_size))]
        if not probes_speed(hosts, hdr.MAX_SEQS):
            return None
        own = speed.probe()
        back = self.driver.command(hdr.CMD_PROBE, slots=list(range(self.world_size)))
        return host_speeds([own, *(float(v) for v in back.lengths[1:])], hosts)

    def unload(self) -> None:
        if self.loaded is not None and self.world_size > 1:
            self.driver.command(hdr.CMD_UNLOAD)
        self.runner.unload()
        self.loaded = None
        self.driver.returns.clear()
        mx.clear_cache()

    def shutdown(self) -> None:
        """The last step: every worker releases its model and leaves its loop."""
        if self.world_size > 1:
            if self.hub is not None:
                self.hub.expect_exits()
            self.driver.command(hdr.CMD_SHUTDOWN)
        self.runner.shard = None
        self.runner.caches = None
        self.loaded = None

    # --- steps -------------------------------------------------------------------------
    def launch_forward(
        self,
        slots: list[int],
        offsets: list[int],
        tokens: mx.array,
        lengths: list[int],
        *,
        group: int = hdr.NO_GROUP,
        want_logits: bool,
        reuse_from: int | None = None,
        prompt: PromptInputs | None = None,
        all_positions: bool = False,
    ) -> Step:
        """Post rank 0's layers for one step and send it round the ring.

        `tokens` (batch, width) may still be on its way (the sampled tokens of the step
        before): nothing here waits for it. A decode group (one token per sequence)
        runs as one batch; otherwise each sequence (a prefill chunk, right-padded to
        the widest) runs alone on its own cache. `reuse_from`: the one sequence starts
        from that slot's parked cache, cut back to its offset. `prompt`: a prefill
        chunk's input embeddings (1, width, hidden), used instead of embedding `tokens`
        (an image request's prompt, with the image features merged in on rank 0), and
        for a multimodal-rope model its positions, sent round as a side array, and its
        sequence's position delta, which every later step of the slot carries.
        `all_positions`: the step's one sequence wants logits at every position it
        carries (a speculative verify step), not only at its last.
        """
        if self.runner.shard is None or self.runner.caches is None:
            raise RuntimeError("no model loaded")
        timeline.mark("build", self.driver.next_id, sum(lengths))
        header = hdr.StepHeader(
            cmd=hdr.CMD_FORWARD,
            flags=(hdr.FLAG_WANT_OUTPUT if want_logits else 0)
            | (hdr.FLAG_REUSE if reuse_from is not None else 0)
            | (hdr.FLAG_ALL_POSITIONS if all_positions else 0),
            group=group,
            slots=list(slots),
            offsets=list(offsets),
            lengths=list(lengths),
            source=hdr.NO_SOURCE if reuse_from is None else reuse_from,
        )
        h, sides = self.runner.run(header, tokens, reuse_from=reuse_from, prompt=prompt)
        step = Step(header, want_logits, sides=sides)
        step.units = step_cost(lengths, offsets, self.runner.hidden_size)
        split = self.runner.tensor
        if self.world_size == 1 or (split is not None and not split.grid):
            hidden = h[:, -1:, :] if want_logits and not all_positions else h
            if split is None:
                self.driver.post_here(step, hidden, tokens)
            else:  # (every layer was here: the ring carries the header to the peers)
                self.driver.launch_tensor(step, hidden, tokens)
            return step
        if split is not None:  # (a grid: stage 0's last rank sends its output on)
            self.driver.launch_tensor(step, h, tokens)
            return step
        header.payload_kind = hdr.PAYLOAD_HIDDEN
        header.payload_dtype = dtype_name(h.dtype)
        header.payload_shape = tuple(h.shape)
        self.driver.launch(step, h, tokens)
        return step

    def launch_free(self, slots: list[int], park: bool = False) -> Step | None:
        """RingDriver.launch_free: the slots' caches dropped (or parked) on every rank."""
        return self.driver.launch_free(slots, park)

    def launch_blocks(self, cmd: int, slot: int, document: dict[str, Any]) -> Step | None:
        """RingDriver.launch_blocks: a slot's prompt-cache blocks stored or restored."""
        return self.driver.launch_blocks(cmd, slot, document)

    def prefix_index(self) -> PrefixIndex | None:
        """Rank 0's index of the blocks every rank keeps (None: no store for this
        model), from what its own store holds: found again after a restart."""
        store = self.runner.store
        return PrefixIndex(store.ident, store.keys()) if store is not None else None

    def prompt_store_off(self) -> str:
        """Why the loaded model keeps no prompt blocks although --prompt-cache-dir asks."""
        if not self.prompt_store or self.runner.shard is None:
            return ""
        store = self.runner.store
        if store is None:
            return self.runner.shard.not_storable
        return store.why_not

    def complete(self, step: Step, *, early: bool = False) -> Completion:
        """RingDriver.complete: the oldest step taken back, as a Completion."""
        return self.driver.complete(step, early=early)

    def announce(self) -> None:
        """RingDriver.announce: launched steps sent on once computed."""
        self.driver.announce()

    def done(self, step: Step) -> None:
        """RingDriver.done: the caller has read what it wanted of `step`."""
        self.driver.done(step)

    def complete_all(self) -> None:
        self.driver.complete_all()

    def ring_failure(self, e: Exception) -> ClusterFailure | None:
        return self.driver.ring_failure(e)


def hub_ready(hub: ControlHub, world_size: int, timeout: float) -> None:
    missing = hub.wait_for_hello(timeout)
    if missing:
        raise RuntimeError(
            f"ranks {missing} never reached rank 0's side channel within {timeout:.0f} s"
        )
    mine = control.versions()
    for _, info in sorted(hub.snapshot().items()):
        if differ := control.version_differences(mine, info.versions):
            raise RuntimeError(
                f"{info.where} would not give rank 0's tokens: "
                + "; ".join(differ)
                + " (install the same versions on every machine)"
            )
    log.info(
        "all %d workers said hello (mlx %s, mlx-lm %s)", world_size - 1, mine["mlx"], mine["mlx-lm"]
    )
