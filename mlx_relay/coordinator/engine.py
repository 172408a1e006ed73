"""The engine: one thread that owns MLX and the ring, and turns requests into tokens.

gRPC handler threads never touch MLX. They submit a request and read its chunks from
a queue; commands (load, free, shutdown) run on the engine thread once no step is in
flight, so every rank always sees one well-ordered sequence of steps.

The engine core is a loop around the scheduler (scheduler.py), which owns every
request's state and decides what runs (how: its docstring). They meet at two calls
with typed values (plan.py): the engine asks `schedule()` for a `StepPlan` and carries
it out (slot steps, then the forward step on the pipeline), samples what comes back
(step_sampling.py), launches the next steps on those tokens before reading them (the
device and the ring are never idle while the host streams), then hands the tokens
read and what the step took to `update_from_output(StepResult)` and carries out the
`Outputs` it answers (chunks for the clients, frees and parks of slots). Up to one
step per rank is in flight: while rank 1 runs one group's layers, rank 0 runs the
next group's. Other threads read the scheduler's counts and the `EngineStats`
(stats.py) directly; the model's context is made once at load (model_context.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import mlx.core as mx

from mlx_relay import timeline
from mlx_relay.coordinator import warmup
from mlx_relay.coordinator.config import EngineConfig
from mlx_relay.coordinator.model_context import ModelContext
from mlx_relay.coordinator.pipeline import ClusterFailure, Pipeline, RankFailure, Step
from mlx_relay.coordinator.plan import (
    DecodeGroup,
    Forward,
    Outputs,
    Park,
    Restore,
    SlotAction,
    StepResult,
    Store,
    Verify,
)
from mlx_relay.coordinator.policy import StepOutput
from mlx_relay.coordinator.scheduler import Scheduler
from mlx_relay.coordinator.sequence import EngineError, Request, Sequence
from mlx_relay.coordinator.stats import EngineStats
from mlx_relay.coordinator.step_sampling import Sampled, sample_step
from mlx_relay.model import memory
from mlx_relay.model.kvcache import CacheError
from mlx_relay.model.prefix_store import StoreError
from mlx_relay.protocol import header as hdr

__all__ = ["Engine"]  # (the request model is sequence.py's)

log = logging.getLogger("mlx_relay.engine")


class Engine:
    def __init__(self, pipeline: Pipeline, config: EngineConfig | None = None) -> None:
        self.pipeline = pipeline
        self.config = config = config or EngineConfig()
        self.max_in_flight = max(1, pipeline.depth)
        self.model: ModelContext | None = None  # the loaded model's, made once at load
        self.state = "starting"
        self.error = ""
        self.on_state: Callable[[str], None] = lambda state: None
        self.stats = EngineStats()  # what /metrics, the status and the live page read
        groups = max(pipeline.depth, math.ceil(config.max_active / hdr.MAX_SEQS))
        self.scheduler = Scheduler(config, groups, self.stats)
        self._launched: deque[Step] = deque()
        self._restores: dict[int, Restore] = {}  # id of a Restore step in flight -> it
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._cv = threading.Condition()  # the commands, the stop, and waking the loop
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # --- API for other threads -----------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> Request:
        with self._cv:  # (as one with the check: a failing engine abandons it, or refuses)
            if self.state != "serving":
                raise EngineError("unavailable", f"the cluster is not serving ({self.state})")
            self.scheduler.add(request)
            self._cv.notify_all()
        return request

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread once no step is in flight."""
        future: Future = Future()
        with self._cv:
            if self._stop:
                future.set_exception(EngineError("unavailable", "the engine has stopped"))
                return future
            self._commands.append((fn, future))
            self._cv.notify_all()
        return future

    def load(self, spec: str, layers: list[int] | None = None) -> Future:
        return self.call(lambda: self._load(spec, layers))

    def free(self, shutdown: bool = False) -> Future:
        return self.call(lambda: self._free(shutdown))

    def drain(self) -> None:
        """Refuse new requests (UNAVAILABLE) while those already accepted finish."""
        with self._cv:
            if self.state == "serving":
                self._set_state("draining")

    def fail(self, why: str) -> None:
        """End every request with UNAVAILABLE now, from any thread (rank 0's watchdog).

        The engine thread may be stuck in a collective with a rank that stopped, so
        it cannot be relied on to notice and answer the clients itself.
        """
        self._fail_everything(why)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    # --- the loop ------------------------------------------------------------------
    def _set_state(self, state: str) -> None:
        self.state = state
        self.on_state(state)

    def _run(self) -> None:
        try:
            while not self._stop:
                if self._commands:
                    while self._launched:
                        self._complete_oldest()
                    self._run_commands()
                    continue
                self._launch_ready()
                if self._launched:
                    self._complete_oldest()
                else:
                    self._sleep_until_work()
        except Exception as e:  # noqa: BLE001 - the ring is broken; say so to everyone
            log.exception("engine stopped: %s", e)
            self._fail_everything(f"cluster failed: {e}")

    def _sleep_until_work(self) -> None:
        """Nothing to launch: block (the workers sleep on their doorbells meanwhile)."""
        with self._cv:
            self._cv.wait_for(
                lambda: self._stop or self._commands or self.scheduler.has_work(), timeout=0.5
            )

    def _run_commands(self) -> None:
        while True:
            with self._cv:
                if not self._commands:
                    return
                fn, future = self._commands.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except ClusterFailure as e:
                future.set_exception(e)
                raise
            except Exception as e:  # noqa: BLE001 - reported to the caller
                future.set_exception(e)

    def _carry_out(self, out: Outputs) -> None:
        """The scheduler's answer: chunks and errors to the requests' queues, then its
        slots' free and park steps, in order."""
        for request, item in out.emit:
            request.out.put(item)
        self._launch_slots(out.slots)

    def _launch_slots(self, slots: list[SlotAction]) -> None:
        for action in slots:
            if isinstance(action, Store | Restore):
                self._launch_blocks(action)
                continue
            step = self.pipeline.launch_free([action.slot], park=isinstance(action, Park))
            if step is not None:
                self._launched.append(step)

    def _launch_blocks(self, action: Store | Restore) -> None:
        """A slot's prompt blocks stored or restored on every rank. A restore rank 0
        cannot do itself is not sent: its sequence prefills instead; one a worker cannot
        do fails its step (RankFailure in _complete_oldest), with the same outcome."""
        if isinstance(action, Store):
            document: dict[str, Any] = {"blocks": [list(b) for b in action.blocks]}
            cmd = hdr.CMD_STORE
        else:
            document, cmd = {"keys": list(action.keys)}, hdr.CMD_RESTORE
        try:
            step = self.pipeline.launch_blocks(cmd, action.slot, document)
        except (StoreError, CacheError) as e:
            log.warning("restoring slot %d's prompt blocks failed on rank 0: %s", action.slot, e)
            failed = StepResult(None, failed=str(e), lost_slots=[action.slot])
            self._carry_out(self.scheduler.update_from_output(failed))
            return
        if step is None:  # (one rank: done)
            if isinstance(action, Restore):
                restored = StepResult(None, restored=[action])
                self._carry_out(self.scheduler.update_from_output(restored))
            return
        if isinstance(action, Restore):
            self._restores[id(step)] = action
        self._launched.append(step)

    # --- launching -----------------------------------------------------------------
    def _launch_ready(self) -> None:
        if self._commands:  # a command waits for the ring to empty: launch nothing new
            return
        limit = min(self.max_in_flight, self.pipeline.in_flight_limit)
        while len(self._launched) < limit and self._launch_next():
            pass

    def _launch_next(self) -> bool:
        plan = self.scheduler.schedule()
        self._carry_out(plan.before)
        action = plan.forward
        if action is None:
            return False
        try:
            step = self._launch(action)
        except RankFailure:
            raise
        except Exception as e:  # noqa: BLE001 - rank 0's own stage failed for this unit
            broken = self.pipeline.ring_failure(e)
            if broken is not None:  # the input it waited for never came: a rank is gone
                raise broken from e
            log.exception("rank 0 failed a step: %s", e)
            self._launch_slots(plan.after)
            self._carry_out(
                self.scheduler.update_from_output(StepResult(action, failed=f"rank 0: {e}"))
            )
            return True
        step.tag = action
        self._launched.append(step)
        self._launch_slots(plan.after)
        return True

    def _launch(self, action: Forward) -> Step:
        """One forward step on the pipeline: a decode group's, fed the tokens its members
        sampled last, which may not be computed yet (the step goes out before the host
        has read them); or a sequence's next prompt chunk."""
        if isinstance(action, Verify):
            return self._launch_verify(action)
        if isinstance(action, DecodeGroup):
            members = action.members
            return self.pipeline.launch_forward(
                [s.slot for s in members],
                action.positions,
                mx.concatenate(action.inputs)[:, None],
                [1] * len(members),
                group=action.group,
                want_logits=True,
            )
        seq, n = action.seq, len(action.tokens)
        return self.pipeline.launch_forward(
            [seq.slot],
            [action.position],
            mx.array([action.tokens]),
            [n],
            want_logits=action.want_logits,
            reuse_from=action.reuse_from,
            prompt=seq.image_inputs(self.pipeline.shard.model, action.position, n),
        )

    def _launch_verify(self, action: Verify) -> Step:
        """A speculative round: the drafter's proposals after the sequence's input, one
        step of `width` positions from its true position (its own caches, cut back to
        it), every position's logits wanted."""
        seq, proposed, k, width = action.seq, action.proposed, action.k, action.width
        assert proposed is not None
        inputs = mx.concatenate([action.input.astype(mx.int32), proposed])
        if width > 1 + k:  # (positions past the proposals: cut back with the refused)
            inputs = mx.concatenate([inputs, mx.repeat(inputs[-1:], width - 1 - k)])
        step = self.pipeline.launch_forward(
            [seq.slot],
            [action.position],
            inputs[None],
            [width],
            want_logits=True,
            reuse_from=action.reuse_from,
            all_positions=True,
        )
        return step

    def _timed(self, step: Step) -> None:
        """Count a finished forward step, and tell the scheduler what it took."""
        header = step.header
        if header.cmd != hdr.CMD_FORWARD:
            return
        seconds = time.monotonic() - step.launched_at
        if header.flags & hdr.FLAG_ALL_POSITIONS:  # a speculative round
            width = header.lengths[0]
            self.stats.step("verify", seconds, width)
            self._took(step, StepOutput(kind="verify", seconds=seconds, tokens=width))
            return
        decode = header.group != hdr.NO_GROUP
        # (a prompt chunk is paced by what it took from when it could start: chunks in
        # flight together wait for each other, which is not what they cost)
        took = seconds if decode or not step.took else step.took
        self.stats.step(
            "decode" if decode else "prefill",
            seconds,
            header.n_seqs if decode else header.lengths[0],
        )
        self._took(
            step,
            StepOutput(
                kind="group" if decode else "prefill",
                seconds=took,
                tokens=0 if decode else header.lengths[0],
                units=step.units,
                want_logits=step.want_logits,
            ),
        )

    # --- completing ----------------------------------------------------------------
    def _complete_oldest(self) -> None:
        """Take the oldest step back, and overlap: its tokens are sampled as a graph, the
        next steps are launched on them, and only then does the host wait to read them
        (as mlx-lm's generator does), so the device and the ring are never idle while
        the host detokenizes, parses and streams."""
        step = self._launched.popleft()
        seqs: list[Sequence] = step.tag.seqs if step.tag is not None else []
        sampled: Sampled | None = None
        try:
            back = self.pipeline.complete(step, early=True)
            rows = [(i, s) for i, s in enumerate(seqs) if not s.finished]
            if back.logits is not None and rows:
                # Where the return is not usable yet (returns.py), it is made so only
                # once the next steps are built on the sampled tokens, right before
                # their launch; a rank's failure of the step raises there (what was
                # built on its return is ignored).
                settling = not back.ready
                sampled = self._sample(step, rows, back.logits, start=not settling)
                self._launch_ready()
                if settling:
                    back.settle()
                    mx.async_eval(sampled.tokens)
        except ClusterFailure:
            raise
        except RankFailure as e:
            sampled = None  # (nothing of this step is read: it is done with)
            self._restores.pop(id(step), None)
            log.error("%s failed: %s", step.header.describe(), e)
            failed = StepResult(step.tag, failed=str(e), lost_slots=list(step.header.slots))
            self._carry_out(self.scheduler.update_from_output(failed))
            return
        finally:
            if sampled is None:  # nothing will read this step's results
                self.pipeline.done(step)
        if sampled is not None:
            self._emit_sampled(step, sampled)
        if (done := self._restores.pop(id(step), None)) is not None:
            restored = StepResult(None, restored=[done])
            self._carry_out(self.scheduler.update_from_output(restored))
        self._timed(step)
        self.pipeline.announce()

    def _sample(
        self, step: Step, rows: list[tuple[int, Sequence]], logits: mx.array, start: bool = True
    ) -> Sampled:
        """The step's rows sampled on the device, not waited for (step_sampling.py)."""
        return sample_step(step.tag, rows, logits, start)

    def _emit_sampled(self, step: Step, sampled: Sampled) -> None:
        """The one wait for the device per step: read the sampled tokens, then hand them
        to the scheduler and stream what it answers."""
        values = sampled.tokens.tolist()
        timeline.mark("tokens", step.header.step_id)
        self.pipeline.done(step)
        result = StepResult(step.tag, sampled.seqs, values, sampled.logprobs)
        self._carry_out(self.scheduler.update_from_output(result))

    def _took(self, step: Step, took: StepOutput) -> None:
        """What a step took (once its tokens are streamed), for the scheduler's pace."""
        self._carry_out(self.scheduler.update_from_output(StepResult(step.tag, took=took)))

    # --- commands (engine thread, nothing in flight) ---------------------------------
    def _load(self, spec: str, layers: list[int] | None) -> Any:
        self._cancel_all("the model is being replaced")
        self._set_state("loading")
        try:
            loaded = self.pipeline.load(spec, layers)
            model = ModelContext.at_load(self.pipeline, loaded, self.config.memory.max_context)
            self.scheduler.load(model)
            self.model = model
            self._warm_up(model)
        except Exception:
            self._set_state("unloaded")
            raise
        self.error = ""
        self._set_state("serving")
        return loaded

    def _warm_up(self, model: ModelContext) -> None:
        """A first prompt's steps on every rank before serving (warmup.py), whose warm
        chunk's pace is the pacer's first, in place of a probe chunk; with drafting,
        what verify steps cost here, which may turn it off for this load."""
        config, speculator = self.config, self.scheduler.speculator
        bound = memory.sequence_bound(model.context_length, config.memory.max_context)
        # (on the CPU, where every position costs compute, no wider step is cheaper)
        compiles = warmup.compiles_per_shape()
        widths = speculator.widths_to_time(wider=compiles)
        widths = [w for w in widths if not bound or w + 8 < bound]
        if warmup.wanted(config.warm_up):
            spec = config.speculation
            # (a verify step's width, unless timing the widths below runs it anyway)
            verify = not widths and spec is not None and not speculator.blocked
            width = spec.num_draft_tokens + 1 if verify and spec is not None else 0
            done = warmup.warm_up(self.pipeline, config.prefill_chunk, bound, width)
            self.scheduler.warmed(done.chunk_seconds, done.chunk_tokens, done.chunk_units)
            batched = warmup.warm_batches(self.pipeline, config.max_active, bound)
            log.info(
                "warmed up in %.2f s (%d steps; a %d-token chunk takes %.3f s warm), "
                "decode groups of up to %d in %.2f s (%d steps)",
                done.seconds,
                done.steps,
                done.chunk_tokens,
                done.chunk_seconds,
                batched.largest,
                batched.seconds,
                batched.steps,
            )
        if widths:
            seconds = warmup.time_widths(self.pipeline, widths, compiles)
            speculator.measured(seconds)
            log.info(
                "verify steps here: %s",
                ", ".join(f"{w} positions {s * 1000:.1f} ms" for w, s in seconds.items()),
            )

    def _free(self, shutdown: bool) -> str:
        self._cancel_all("the model was freed")
        self.pipeline.unload()
        self.scheduler.unload()
        self.model = None
        self._set_state("unloaded")
        if shutdown:
            self._set_state("stopping")
            self.pipeline.shutdown()
            with self._cv:
                self._stop = True
            return "model freed; every rank is shutting down"
        return "model freed on every rank"

    def _cancel_all(self, why: str) -> None:
        self._carry_out(self.scheduler.cancel_all(why))
        while self._launched:
            self._complete_oldest()

    def _fail_everything(self, why: str) -> None:
        if self.state != "failed":  # the first diagnosis names the rank; keep it
            self.error = why
            self._set_state("failed")
        with self._cv:
            self._stop = True
            requests = self.scheduler.abandon()
            commands, self._commands = list(self._commands), deque()
            self._cv.notify_all()
        for request in requests:
            request.out.put(EngineError("unavailable", why))
        for _, future in commands:
            future.set_exception(EngineError("unavailable", why))
