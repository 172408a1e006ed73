"""The scheduler: every request's state from queued to finished, and what runs next.

As vLLM v1's scheduler, it owns the state (waiting requests, running sequences, their
decode groups, the prompt-cache slots: slot_steps.py, speculation: speculator.py) and
decides; the engine is the loop that carries out its plans and feeds back the results,
through `schedule() -> StepPlan` and `update_from_output(StepResult) -> Outputs`
(plan.py). Cancellations come through a queue, drained once a call; queued requests
take slots while their caches fit (admission.py); units of work take turns and prompt
chunks are paced (policy.py). Tokens read back become chunks; those that end a sequence
(EOS, a stop string, the length, a grammar's end) finish it, and its slot is parked for
a later prompt sharing its prefix, or freed. Nothing here touches the ring. Other
threads only `add` and read counts: a lock of its own guards the state against them
(a round's drafting runs outside it).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import mlx.core as mx

from mlx_relay.coordinator import status_rows
from mlx_relay.coordinator.admission import new_sequence
from mlx_relay.coordinator.config import EngineConfig
from mlx_relay.coordinator.model_context import ModelContext
from mlx_relay.coordinator.plan import (
    DecodeGroup,
    Forward,
    Outputs,
    PrefillChunk,
    StepPlan,
    StepResult,
    Verify,
)
from mlx_relay.coordinator.policy import Policy, StepOutput, Unit, pick_group
from mlx_relay.coordinator.sequence import Chunk, EngineError, Request, Sequence
from mlx_relay.coordinator.slot_steps import SlotSteps
from mlx_relay.coordinator.slots import SlotTable
from mlx_relay.coordinator.speculator import Speculator
from mlx_relay.coordinator.stats import EngineStats
from mlx_relay.model.memory import CacheUnknown, size_text
from mlx_relay.protocol import header as hdr

log = logging.getLogger("mlx_relay.scheduler")


class Scheduler:
    def __init__(self, config: EngineConfig, groups: int, stats: EngineStats | None = None) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []
        self.groups: list[list[Sequence]] = [[] for _ in range(groups)]
        self.slots = SlotTable(config.max_active)
        self._slot_steps = SlotSteps(self.slots, config.prompt_cache_tokens)
        self.policy = Policy(config.prefill_chunk)
        self.stats = stats or EngineStats()
        self.speculator = Speculator(config.speculation, self.stats)
        self.model: ModelContext | None = None  # the loaded model's (load)
        self.ram_bytes_per_token = 0.0  # the parked caches' bytes per token (status)
        self._cancels: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._lock = threading.Lock()  # against the other threads' add and reads

    # --- the model ---------------------------------------------------------------------
    def load(self, model: ModelContext) -> None:
        """A model was loaded on every rank: no cache is parked any more, its pace is
        still to be measured, and its drafter is loaded (ValueError: it cannot be)."""
        shard = model.shard
        with self._lock:
            self.model = model
            self.slots.reset()
            self._slot_steps.prefixes = model.prefixes
            self._slot_steps.whole_images = model.whole_images
            # (quantized KV caches: a prompt alone goes in --prefill-chunk chunks)
            self.policy.reset(model.hidden, fixed_alone=shard.kv is not None)
            self.slots.usable = shard.usable_prefix
            self.ram_bytes_per_token = self._bytes_per_token(model)
            self._slot_steps.budget = self._ram_budget(self.ram_bytes_per_token)
        self.speculator.load(model, self.config.memory.max_context)

    def _bytes_per_token(self, model: ModelContext) -> float:
        """The parked caches' bytes per token on the rank holding the most (0: unknown),
        for --prompt-cache-bytes and the status's RAM tier."""
        try:
            return model.memory.bytes_per_token() if model.memory is not None else 0.0
        except CacheUnknown as e:
            if self.config.prompt_cache_bytes:
                log.warning(
                    "--prompt-cache-bytes not applied: this model's caches are unknown (%s)", e
                )
            return 0.0

    def ram_tier(self) -> tuple[int, int, int, int]:
        """The parked caches (the RAM tier): sequences, tokens, bytes and the budget in
        bytes (0: none set), on the rank holding the most per token."""
        parked, tokens = self.cached_prompts()
        per_token, budget = self.ram_bytes_per_token, self._slot_steps.budget
        limit = self.config.prompt_cache_bytes or int(budget * per_token)
        return parked, tokens, int(tokens * per_token), limit

    def _ram_budget(self, per_token: float) -> int:
        """The parked caches' token budget: --prompt-cache-tokens, and within
        --prompt-cache-bytes on every rank at `per_token` bytes a token (0: none)."""
        tokens, nbytes = self.config.prompt_cache_tokens, self.config.prompt_cache_bytes
        if not nbytes or per_token <= 0:
            return tokens
        fit = max(1, int(nbytes // per_token))
        log.info("kept prompt caches: at most %d tokens (%s on each rank)", fit, size_text(nbytes))
        return min(tokens, fit) if tokens else fit

    def warmed(self, seconds: float, tokens: int, units: float) -> None:
        """A warm-up (warmup.py) timed a prompt chunk of `tokens` (`units` of work) at
        `seconds` with its kernels compiled: the first pace prompts are paced by (no
        probe chunk, timed while kernels compile)."""
        with self._lock:
            self.policy.pacer.prefill_chunk_took(seconds, tokens, units)

    def unload(self) -> None:
        """The ranks' caches were dropped: parked slots are empty again."""
        with self._lock:
            self.slots.reset()
            self._slot_steps.prefixes = None
            self.model = None

    # --- other threads -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request (EngineError "exhausted" beyond --max-queue); its cancellation
        reaches this scheduler through a queue from now on."""
        with self._lock:
            # Requests about to take a free slot are not queued: only those beyond count.
            if len(self.waiting) - self.slots.open() >= self.config.max_queue:
                raise EngineError(
                    "exhausted",
                    f"server busy: {len(self.running)} requests running and "
                    f"{len(self.waiting)} queued (limit {self.config.max_queue}); retry later",
                )
            request.cancels = self._cancels
            self.waiting.append(request)

    def counts(self) -> tuple[int, int]:
        with self._lock:  # (requests running and queued)
            return len(self.running), len(self.waiting)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every request queued or running, for a status page (status_rows.py)."""
        with self._lock:
            return status_rows.rows(self.waiting, self.running)

    def cached_prompts(self) -> tuple[int, int]:
        """Parked slots and the tokens their caches hold."""
        with self._lock:
            return self.slots.stats()

    def has_work(self) -> bool:
        """Anything to admit, reap or launch."""
        with self._lock:
            admits = bool(self.waiting and self.slots.open())
            return admits or not self._cancels.empty() or bool(self._units())

    # --- the plan ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Cancellations, admissions, then the next forward step, if any can run now."""
        with self._lock:
            plan = StepPlan(before=self._reap())
            self._admit(plan.before)
            forward = self._next()
        if isinstance(forward, Verify):  # (the draft model runs without the lock)
            forward = self.speculator.draft(forward)
        if forward is not None:
            with self._lock:
                self._launched(forward, plan.after)
        plan.forward = forward
        return plan

    def _admit(self, out: Outputs) -> None:
        """Queued requests take slots, in order, while there are some. One whose caches
        would not fit waits while sequences run (they will end and free theirs), and is
        refused when none does."""
        failed = []
        while self.waiting and self.slots.open():
            request = self.waiting.popleft()
            if request.cancelled.is_set():
                out.emit.append((request, Chunk(finish_reason="cancelled")))
                continue
            memory = self.model.memory if self.model is not None else None
            parked = [len(t) for t in self.slots.parked.values()]
            short = memory.shortfall(request, self.running, parked) if memory else ""
            if short and self.running:
                self.waiting.appendleft(request)
                break
            if short:
                out.emit.append((request, EngineError("exhausted", f"not enough memory: {short}")))
                continue
            taken = self._slot_steps.restorable(
                request, self.slots.take(request.cache_tokens(), request.cache_salt), out
            )
            try:
                assert self.model is not None
                spec = self.speculator.start(request, len(self.running))
                seq = new_sequence(request, taken, self.model, spec)
                seq.restoring = bool(taken.restore)
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the engine
                log.exception("request %s cannot start: %s", request.request_id, e)
                out.emit.append(
                    (request, EngineError("internal", f"the request cannot start: {e}"))
                )
                failed.append(taken)
                continue
            self.running.append(seq)
        for taken in failed:
            self._slot_steps.give_back(taken, out)

    def _units(self) -> list[Unit]:
        """Work that can go round the ring now, in a stable order. A sequence whose first
        token the engine has sampled joins a decode group first."""
        for s in self.running:
            if s.group is None and s.spec is None and s.next_input is not None:
                self._join_group(s)
        whole_images = self.model is not None and self.model.whole_images
        units = [
            Unit("group", g)
            for g, members in enumerate(self.groups)
            if members and all(s.next_input is not None for s in members)
        ]
        units += [
            Unit("prefill", s, len(s.pending), whole_images and s.has_images, s.position)
            for s in self.running
            if s.group is None and s.prefilling and not s.restoring
        ]
        units += [
            Unit("verify", s)
            for s in self.running
            if s.spec is not None and s.next_input is not None
        ]
        return units

    def _join_group(self, seq: Sequence) -> None:
        seq.group = pick_group([len(m) for m in self.groups], hdr.MAX_SEQS)
        self.groups[seq.group].append(seq)

    def _next(self) -> Forward | None:
        """The next forward step, its inputs taken from the state, or None."""
        units = self._units()  # (first: a sequence sampled its first token joins a group)
        decoding = any(self.groups) or any(s.spec and s.first_token_at for s in self.running)
        plan = self.policy.schedule(units, decoding=decoding)
        if plan is None:
            return None
        if plan.unit.kind == "verify":
            seq = plan.unit.key
            last, seq.next_input = seq.next_input, None
            k = self._proposals(seq)
            return Verify(seq, last, list(seq.context), k, seq.slot, position=seq.position)
        if plan.unit.kind == "group":
            members = list(self.groups[plan.unit.key])
            inputs = [s.next_input for s in members]
            for s in members:
                s.next_input = None
            return DecodeGroup(plan.unit.key, members, inputs, [s.position for s in members])
        seq: Sequence = plan.unit.key
        tokens, seq.pending = seq.pending[: plan.tokens], seq.pending[plan.tokens :]
        reuse = seq.taken.source if seq.taken and seq.cached_tokens else None
        if seq.spec is not None and plan.want_logits and len(tokens) == 1:
            # The prompt's last token goes with the first proposals, as in mlx-lm.
            source = seq.slot if reuse is None else reuse
            k = self._proposals(seq)
            history = seq.context + tokens
            return Verify(seq, mx.array(tokens), history, k, source, position=seq.position)
        return PrefillChunk(seq, tokens, plan.want_logits, reuse, seq.position)

    def _proposals(self, seq: Sequence) -> int:
        """How many proposals `seq`'s next round asks for: its adaptive k, at most the
        tokens it may still generate (as mlx-lm caps them), within the context."""
        assert seq.spec is not None
        remaining = seq.request.params.max_tokens - len(seq.generated)
        context = self.model.context_length if self.model is not None else 0
        if context:
            remaining = min(remaining, context - seq.position - 1)
        return seq.spec.wanted(remaining)

    def _launched(self, action: Forward, out: Outputs) -> None:
        """`action` goes round the ring next: its sequences' positions move on."""
        if isinstance(action, DecodeGroup):
            for s in action.members:
                s.position += 1
            return
        seq = action.seq
        self._slot_steps.first_step(seq, out)
        if isinstance(action, Verify):
            if len(action.history) > len(seq.context):  # (its first: the prompt's last token)
                seq.context.append(action.history[-1])
            seq.position += action.width
            return
        seq.position += len(action.tokens)
        seq.context.extend(action.tokens)

    # --- results ---------------------------------------------------------------------
    def update_from_output(self, result: StepResult) -> Outputs:
        """A forward step came back (or failed): the chunks for the clients and the
        sequences it ends, then what it took paces the next steps."""
        with self._lock:
            out = self._reap()
            if result.failed:
                self._step_failed(result, out)
            elif result.restored:
                for seq in self.running:
                    if seq.restoring and any(
                        seq.taken and seq.taken.restore is r.keys for r in result.restored
                    ):
                        self._slot_steps.restored(seq)
            elif isinstance(result.forward, Verify) and result.tokens is not None:
                self._verified(result, out)
            elif result.tokens is not None:
                self._read(result, out)
            if result.took is not None:
                self._took(result.took)
        return out

    def _read(self, result: StepResult, out: Outputs) -> None:
        """The tokens read back for a step's sequences (and their log-probabilities where
        wanted): a chunk for each still running, and the sequences they end."""
        now = time.perf_counter()
        assert result.tokens is not None
        for seq, token, row in zip(result.seqs, result.tokens, result.logprobs, strict=True):
            if seq not in self.running:
                continue
            if seq.first_token_at is None:
                self._first_token(seq, now)
            seq.context.append(token)
            self._emit(seq, token, row, out)

    def _first_token(self, seq: Sequence, now: float) -> None:
        """Its prefill is done: what of its prompt a cache served is final now."""
        seq.first_token_at = now
        self.stats.prompt(len(seq.request.prompt_tokens), seq.cached_tokens, seq.restored)

    def _verified(self, result: StepResult, out: Outputs) -> None:
        """A verify step's tokens read back (one per position: its input's, then each
        proposal's): the proposals up to the first that differs from what was sampled are
        kept, then the sampled token after them, each a chunk; the caches hold the
        refused ones too, so the sequence's position goes back to what they truly hold
        (its next step cuts them out). The drafter follows what was kept."""
        verify, tokens = result.forward, result.tokens
        assert isinstance(verify, Verify) and tokens is not None
        proposed, kept = self.speculator.verified(verify, tokens)
        seq = verify.seq
        if seq not in self.running or seq.spec is None:
            return
        # (its position moves back before any chunk: a park records it)
        self.speculator.settle(verify, len(proposed), kept)
        if seq.first_token_at is None:
            self._first_token(seq, time.perf_counter())
        for token, row in zip(tokens[: kept + 1], result.logprobs[: kept + 1], strict=True):
            seq.context.append(token)
            self._emit(seq, token, row, out)
            if seq not in self.running:
                return
        if self.speculator.next_round(verify, proposed, kept, len(self.running)):
            self._join_group(seq)
        seq.next_input = mx.array(tokens[kept : kept + 1])

    def _took(self, took: StepOutput) -> None:
        """What a forward step took paces the next prompt chunks (a decode step counts
        only with no prompt prefilled beside it), and a verify step's tells how many
        proposals pay (a decode step's time overlaps the next one's, so it says nothing
        of a round's)."""
        if took.kind == "verify":
            self.speculator.took(took.tokens, took.seconds)
            return
        if took.kind == "group" and any(s.prefilling for s in self.running):
            took = dataclasses.replace(took, beside_prefill=True)
        self.policy.update_from_output(took)

    def _emit(self, seq: Sequence, token: int, logprobs: mx.array | None, out: Outputs) -> None:
        assert self.model is not None
        chunk, reason = self.model.output.token(seq, token, logprobs)
        constraint = seq.request.constraint
        if not reason and constraint is not None:
            # Here, while the device runs the next step: the matcher takes the token and
            # computes the next mask. A complete grammar ends the sequence.
            try:
                reason = "stop" if constraint.advance(token) else ""
            except RuntimeError as e:
                log.error("request %s: %s", seq.request.request_id, e)
                self._finish(seq, EngineError("internal", str(e)), out)
                return
        if reason:
            self._finish(seq, chunk, out, reason)
        else:
            out.emit.append((seq.request, chunk))

    # --- sequences ending otherwise ---------------------------------------------------
    def _reap(self) -> Outputs:
        """End the sequences whose requests were cancelled since the last call: steps of
        theirs still in flight run to their end on every rank before the freeing step
        that follows them (steps keep their order), and what they return is ignored. (A
        queued request cancelled is answered as it would take a slot.)"""
        out = Outputs()
        while not self._cancels.empty():
            request = self._cancels.get_nowait()
            seq = next((s for s in self.running if s.request is request), None)
            if seq is not None:
                self._finish(seq, Chunk(), out, "cancelled")
        return out

    def _step_failed(self, result: StepResult, out: Outputs) -> None:
        """A step failed (on a rank, on `lost_slots`; or on rank 0 at launch): its
        sequences end with its message. A parked cache among the lost slots (a park that
        failed, or a finished sequence's last step still in flight) may not hold what the
        other ranks' copies hold, so nobody may reuse it. The step's later steps in
        flight fail too; they find the sequences finished."""
        for seq in [s for s in (result.forward.seqs if result.forward else []) if not s.finished]:
            self._finish(seq, EngineError("internal", result.failed), out)
        for seq in self.running:
            if seq.restoring and seq.slot in result.lost_slots:
                self._slot_steps.restore_failed(seq, out)
            elif seq.taken and seq.cached_tokens and seq.taken.source in result.lost_slots:
                self._slot_steps.restart(seq, out)
        self._slot_steps.forget(result.lost_slots, out)

    def cancel_all(self, why: str) -> Outputs:
        """Every request queued or running ends with UNAVAILABLE (a load, a free)."""
        out = Outputs()
        with self._lock:
            waiting, self.waiting = list(self.waiting), deque()
            for request in waiting:
                out.emit.append((request, EngineError("unavailable", why)))
            for seq in list(self.running):
                self._finish(seq, EngineError("unavailable", why), out)
        return out

    def abandon(self) -> list[Request]:
        """Every request queued or running, forgotten: the cluster failed, nothing more
        is launched, and the caller answers them."""
        with self._lock:
            requests = list(self.waiting) + [s.request for s in self.running]
            self.waiting.clear()
            self.running.clear()
        return requests

    def _finish(
        self, seq: Sequence, last: Chunk | Exception, out: Outputs, reason: str | None = None
    ) -> None:
        if isinstance(last, Chunk):
            assert self.model is not None
            self.model.output.finish(seq, last, reason)
        out.emit.append((seq.request, last))
        out.finished.append(seq)
        seq.finished = True
        self.running.remove(seq)
        if seq.spec is not None:
            self.speculator.drop(seq.spec)
        if seq.group is not None:
            self.groups[seq.group].remove(seq)
        reuse = self.config.prompt_cache and self.model is not None and self.model.reusable
        self._slot_steps.end(seq, isinstance(last, Chunk), reuse, out)
