"""The engine: one thread that owns MLX and the ring, and turns requests into tokens.

gRPC handler threads never touch MLX. They submit a request and read its chunks from
a queue; commands (load, free, shutdown) run on the engine thread once no step is in
flight, so every rank always sees one well-ordered sequence of steps.

Scheduling. A new sequence is prefilled one chunk per step, the way mlx-lm prefills:
all prompt tokens but the last in chunks, then the last one in the step that yields the
first token. Its chunks are known in advance, so several are in flight at once, each on
the next rank while the one before it runs on this one. A chunk is sized by measured
time: alone about CHUNK_TARGET_S (at most `--prefill-chunk` tokens), beside running
streams about STALL_STEPS decode steps, so a long prompt delays each running stream by
no more than that per token (scheduler.py holds these rules). It then joins one of
several decode groups, each decoded as one batch per step. Units of work (a group's next token, a sequence's
next prefill chunk) take turns, so a long prompt never stalls running streams, and up
to one step per rank is in flight at once: while rank 1 runs one group's layers,
rank 0 runs the next group's. Everything that decides — sampling, stop strings, EOS,
cancellation — happens here, between steps, so a worker never has anything to decide.
What a client sees of each token read back (text, reasoning, tool calls, logprobs, the
finish reason, usage) is the output processor's (output.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import load_tokenizer

from mlx_relay import timeline
from mlx_relay.coordinator.markup import ChatMarkup
from mlx_relay.coordinator.output import OutputProcessor
from mlx_relay.coordinator.pipeline import ClusterFailure, Pipeline, RankFailure, Step
from mlx_relay.coordinator.postprocess import OutputParser
from mlx_relay.coordinator.sampling import Sampler, sample_batch
from mlx_relay.coordinator.scheduler import Scheduler, StepOutput, Unit, pick_group
from mlx_relay.coordinator.sequence import Chunk, EngineError, Request, Sequence
from mlx_relay.coordinator.slots import SlotTable, Taken
from mlx_relay.model import memory, vision
from mlx_relay.model.step_inputs import PromptInputs
from mlx_relay.protocol import header as hdr

log = logging.getLogger("mlx_relay.engine")


@dataclass
class Sampled:
    """One step's sampled tokens, computed or not yet, for the sequences it served."""

    step: Step
    seqs: list[Sequence]
    tokens: mx.array  # (len(seqs),)
    logprobs: list[mx.array | None]  # a row's log-probabilities where its request wants them


def _cached_before_images(request: Request, cached: int, config: dict[str, Any]) -> int:
    """An image request reuses a parked cache only where it ends before the first
    image token: past it, equal token ids need not mean equal images. None where the
    prompt goes whole from position 0 (vision.prefills_whole: gemma4's image mask)."""
    if request.pixel_values is None or not cached:
        return cached
    if vision.prefills_whole(config):
        return 0
    prompt, image_token = request.prompt_tokens, vision.image_token_id(config)
    first = prompt.index(image_token) if image_token in prompt else len(prompt)
    return cached if cached <= first else 0


class Engine:
    def __init__(
        self,
        pipeline: Pipeline,
        *,
        max_active: int = 8,
        max_queue: int = 64,
        prefill_chunk: int = 512,
        default_max_tokens: int = 256,
        prompt_cache: bool = True,
        prompt_cache_tokens: int = 0,
    ) -> None:
        self.pipeline = pipeline
        self.prompt_cache = prompt_cache
        self.prompt_cache_tokens = prompt_cache_tokens  # 0: as many as the slots hold
        self.max_active = max_active
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.default_max_tokens = default_max_tokens
        self.max_in_flight = max(1, pipeline.depth)
        n_groups = max(pipeline.depth, math.ceil(max_active / hdr.MAX_SEQS))
        self.tokenizer: Any = None
        self.markup: ChatMarkup | None = None  # its chat markup, resolved once at load
        self.context_length = 0
        self.state = "starting"
        self.error = ""
        self.on_state: Callable[[str], None] = lambda state: None
        self._output: OutputProcessor | None = None  # the loaded model's output rules
        self._waiting: deque[Request] = deque()
        self._active: list[Sequence] = []
        self._groups: list[list[Sequence]] = [[] for _ in range(n_groups)]
        self._launched: deque[Step] = deque()
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._cv = threading.Condition()
        self._slots = SlotTable(max_active)
        self._reuse = False  # prompt_cache, and the model's caches can be cut back
        self._stop = False
        self._scheduler = Scheduler(prefill_chunk)  # what runs next (data in, data out)
        # Forward steps round the ring by kind, and their seconds from launch to back on
        # rank 0 (read by the metrics; written by the engine thread only).
        self.step_counts: dict[str, int] = {}
        self.step_seconds: dict[str, float] = {}
        # Tokens those steps carried by kind (prompt tokens prefilled, tokens decoded), for
        # throughput on the live page (read by other threads; written by the engine's).
        self.step_tokens: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # --- API for other threads -----------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> Request:
        with self._cv:
            if self.state != "serving":
                raise EngineError("unavailable", f"the cluster is not serving ({self.state})")
            # Requests about to take a free slot are not queued: only those beyond count.
            if len(self._waiting) - self._slots.open() >= self.max_queue:
                raise EngineError(
                    "exhausted",
                    f"server busy: {len(self._active)} requests running and "
                    f"{len(self._waiting)} queued (limit {self.max_queue}); retry later",
                )
            self._waiting.append(request)
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

    def counts(self) -> tuple[int, int]:
        with self._cv:
            return len(self._active), len(self._waiting)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every request queued or running, for a status page: its phase, tokens so far,
        timings and prompt-cache hit. Read from another thread: counts may be a step old."""
        now = time.perf_counter()
        with self._cv:
            waiting, active = list(self._waiting), list(self._active)
        out: list[dict[str, Any]] = [
            {
                "request_id": r.request_id,
                "phase": "queued",
                "prompt_tokens": len(r.prompt_tokens),
                "age_s": now - r.created,
            }
            for r in waiting
        ]
        for seq in active:
            r, first, generated = seq.request, seq.first_token_at, len(seq.generated)
            row = {
                "request_id": r.request_id,
                "phase": "prefill" if first is None else "decode",
                "prompt_tokens": len(r.prompt_tokens),
                "prefilled_tokens": len(r.prompt_tokens) - len(seq.pending),
                "cached_tokens": seq.cached_tokens,
                "generated_tokens": generated,
                "age_s": now - r.created,
            }
            if first is not None:
                row["time_to_first_token_s"] = first - r.created
                if generated > 1 and now > first:
                    row["decode_tokens_per_s"] = (generated - 1) / (now - first)
            out.append(row)
        return sorted(out, key=lambda row: -row["age_s"])

    def cached_prompts(self) -> tuple[int, int]:
        """Parked slots and the tokens their caches hold."""
        with self._cv:
            return self._slots.stats()

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
                self._admit()
                self._reap_cancelled()
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
                lambda: (
                    self._stop
                    or self._commands
                    or (self._waiting and self._slots.open())
                    or any(s.request.cancelled.is_set() for s in self._active)
                    or self._launchable()
                ),
                timeout=0.5,
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

    def _admit(self) -> None:
        failed: list[Taken] = []
        with self._cv:
            while self._waiting and self._slots.open():
                request = self._waiting.popleft()
                if request.cancelled.is_set():
                    request.out.put(Chunk(finish_reason="cancelled"))
                    continue
                short = self._memory_short(request)
                if short and self._active:  # running sequences will end and free theirs
                    self._waiting.appendleft(request)
                    break
                if short:
                    request.out.put(EngineError("exhausted", f"not enough memory: {short}"))
                    continue
                taken = self._slots.take(request.prompt_tokens)
                try:
                    seq = self._new_sequence(request, taken)
                except Exception as e:  # noqa: BLE001 - one bad request must not stop the engine
                    log.exception("request %s cannot start: %s", request.request_id, e)
                    request.out.put(EngineError("internal", f"the request cannot start: {e}"))
                    failed.append(taken)
                    continue
                self._active.append(seq)
        for taken in failed:
            self._give_back(taken)

    def _memory_short(self, request: Request) -> str:
        """Why `request`'s caches would not fit what the ranks have left now ('' if they
        would): rank 0's own figures, the workers' from their last heartbeat, less what
        the running sequences may still add. Rechecked at most every 50 ms while it waits."""
        loaded = self.pipeline.loaded
        if loaded is None:
            return ""
        now = time.monotonic()
        last = getattr(self, "_memory_checked", (0.0, None, ""))
        if last[1] is request and now - last[0] < 0.05:
            return last[2]
        bound = memory.sequence_bound(self.context_length) or 1 << 30

        def most(r: Request) -> int:  # the tokens a sequence may reach
            return min(len(r.prompt_tokens) + r.params.max_tokens, bound)

        tokens = most(request)
        running = [(s.position, most(s.request)) for s in self._active]
        parked = [len(t) for t in self._slots.parked.values()]
        figures = {0: memory.stats()}
        if self.pipeline.hub is not None:
            figures.update({r: i.stats for r, i in self.pipeline.hub.snapshot().items()})
        short = memory.admission_shortfall(
            Path(loaded.path), loaded.ranges, figures, tokens, running, parked, loaded.fingerprint
        )
        self._memory_checked = (now, request, short)
        return short

    def _give_back(self, taken: Taken) -> None:
        """A slot taken for a sequence that never ran a step: no rank touched its caches."""
        with self._cv:
            if taken.held is not None:
                self._slots.park(taken.slot, taken.held)
                return
            if taken.source is not None:  # a copy source, pinned for this sequence
                self._slots.unpin(taken.source)
        self._free_slot(taken.slot)  # it may hold an evicted cache on every rank

    def _new_sequence(self, request: Request, taken: Taken) -> Sequence:
        cached = _cached_before_images(request, taken.cached, self.pipeline.shard.config)
        return Sequence(
            request=request,
            slot=taken.slot,
            sampler=Sampler(request.params),
            detokenizer=self.tokenizer.detokenizer,
            parser=OutputParser(
                self.markup,
                tools=request.tools,
                parse_tools=request.parse_tools,
                starts_in_reasoning=request.starts_in_reasoning,
                opens_tool_call=request.opens_tool_call,
                stop=request.params.stop,
            ),
            pending=list(request.prompt_tokens[cached:]),
            position=cached,
            context=list(request.prompt_tokens[:cached]),
            cached_tokens=cached,
            taken=taken,
        )

    def _reap_cancelled(self) -> None:
        """End cancelled sequences now: steps of theirs still in flight run to their end
        on every rank before the freeing step that follows them (steps keep their order),
        and what they return is ignored."""
        for seq in list(self._active):
            if seq.request.cancelled.is_set():
                self._finish(seq, Chunk(), reason="cancelled")

    # --- launching -----------------------------------------------------------------
    def _units(self) -> list[Unit]:
        """Work that can go round the ring now, in a stable order."""
        units = [
            Unit("group", g)
            for g, members in enumerate(self._groups)
            if members and all(s.next_input is not None for s in members)
        ]
        shard = self.pipeline.shard  # (whole: its image prompts go in one step)
        whole = shard is not None and vision.prefills_whole(shard.config)
        units += [
            Unit(
                "prefill",
                s,
                len(s.pending),
                whole and s.request.pixel_values is not None,
                position=s.position,
            )
            for s in self._active
            if s.group is None and s.prefilling and not s.request.cancelled.is_set()
        ]
        return units

    def _launchable(self) -> bool:
        return bool(self._units())

    def _launch_next(self) -> bool:
        plan = self._scheduler.schedule(self._units(), decoding=any(self._groups))
        if plan is None:
            return False
        unit = plan.unit
        try:
            if unit.kind == "group":
                self._launch_group(unit.key)
            else:
                self._launch_single(unit.key, plan.tokens, plan.want_logits)
        except RankFailure:
            raise
        except Exception as e:  # noqa: BLE001 - rank 0's own stage failed for this unit
            broken = self.pipeline.ring_failure(e)
            if broken is not None:  # the input it waited for never came: a rank is gone
                raise broken from e
            seqs = self._groups[unit.key] if unit.kind == "group" else [unit.key]
            log.exception("rank 0 failed a step: %s", e)
            for seq in list(seqs):
                self._finish(seq, EngineError("internal", f"rank 0: {e}"))
        return True

    def _launch_single(self, seq: Sequence, n: int, want_logits: bool) -> None:
        """The next prefill chunk of `n` tokens, or the last prompt token (whose logits
        give token 1), as the scheduler planned it."""
        tokens, seq.pending = seq.pending[:n], seq.pending[n:]
        step = self.pipeline.launch_forward(
            [seq.slot],
            [seq.position],
            mx.array([tokens]),
            [n],
            want_logits=want_logits,
            reuse_from=seq.taken.source if seq.taken and seq.cached_tokens else None,
            prompt=self._image_inputs(seq, n),
        )
        self._launched_first(seq)
        seq.position += n
        seq.context.extend(tokens)
        self._track(step, [seq])

    def _image_inputs(self, seq: Sequence, n: int) -> PromptInputs | None:
        """For an image request, its prompt's merged embeddings (and multimodal rope
        positions) for the next `n` prompt positions (vision tower and projector run
        once, at the first chunk); else None."""
        if seq.request.pixel_values is None:
            return None
        if seq.embeddings is None:
            seq.embeddings = vision.prompt_inputs(
                self.pipeline.shard.model, seq.request.prompt_tokens, seq.request.pixel_values
            )
        out = seq.embeddings.chunk(seq.position, n)
        if seq.position + n >= len(seq.request.prompt_tokens):
            seq.embeddings = None  # the prompt is all sent; decode embeds tokens
        return out

    def _timed(self, step: Step) -> None:
        """Tell the scheduler what a finished forward step took."""
        header = step.header
        if header.cmd != hdr.CMD_FORWARD:
            return
        decode = header.group != hdr.NO_GROUP
        seconds = time.monotonic() - step.launched_at
        # (a prompt chunk is paced by what it took from when it could start: chunks in
        # flight together wait for each other, which is not what they cost)
        took = seconds if decode or not step.took else step.took
        kind = "decode" if decode else "prefill"
        self.step_counts[kind] = self.step_counts.get(kind, 0) + 1
        self.step_seconds[kind] = self.step_seconds.get(kind, 0.0) + seconds
        carried = header.n_seqs if decode else header.lengths[0]
        self.step_tokens[kind] = self.step_tokens.get(kind, 0) + carried
        self._scheduler.update_from_output(
            StepOutput(
                kind="group" if decode else "prefill",
                seconds=took,
                tokens=0 if decode else header.lengths[0],
                units=step.units,
                want_logits=step.want_logits,
                beside_prefill=decode and any(s.prefilling for s in self._active),
            )
        )

    def _launch_group(self, group: int) -> None:
        """One decode step of the group, fed the tokens its members sampled last, which
        may not be computed yet: the step goes out before the host has read them."""
        members = list(self._groups[group])
        tokens = mx.concatenate([s.next_input for s in members])[:, None]
        for s in members:
            s.next_input = None
        step = self.pipeline.launch_forward(
            [s.slot for s in members],
            [s.position for s in members],
            tokens,
            [1] * len(members),
            group=group,
            want_logits=True,
        )
        for s in members:
            s.position += 1
        self._track(step, members)

    def _track(self, step: Step, seqs: list[Sequence]) -> None:
        step.tag = seqs
        for s in seqs:
            s.in_flight += 1
        self._launched.append(step)

    # --- completing ----------------------------------------------------------------
    def _complete_oldest(self) -> None:
        """Take the oldest step back, and overlap: its tokens are sampled as a graph, the
        next steps are launched on them, and only then does the host wait to read them
        (as mlx-lm's generator does), so the device and the ring are never idle while
        the host detokenizes, parses and streams."""
        step = self._launched.popleft()
        seqs: list[Sequence] = step.tag or []
        for s in seqs:
            s.in_flight -= 1
        sampled: Sampled | None = None
        try:
            logits = self.pipeline.complete(step, early=True)
            for seq in seqs:
                if seq in self._active and seq.request.cancelled.is_set():
                    self._finish(seq, Chunk(), reason="cancelled")
            rows = [(i, s) for i, s in enumerate(seqs) if s in self._active]
            if logits is not None and rows:
                # On CUDA the return is settled only once the next steps are built on
                # the sampled tokens, right before their launch (Pipeline.settle).
                settling = self.pipeline.unsettled
                sampled = self._sample(step, rows, logits, start=not settling)
                self._launch_ready()
                if settling:
                    self.pipeline.settle()
                    failure = self.pipeline.failure_of(step)
                    if failure is not None:  # (what was built on its return is ignored)
                        raise failure
                    mx.async_eval(sampled.tokens)
        except ClusterFailure:
            raise
        except RankFailure as e:
            sampled = None  # (nothing of this step is read: it is done with)
            self._step_failed(step, seqs, e)
            return
        finally:
            if sampled is None:  # nothing will read this step's results
                self.pipeline.done(step)
        if sampled is not None:
            self._emit_sampled(sampled)
        self._timed(step)
        self.pipeline.announce()

    def _step_failed(self, step: Step, seqs: list[Sequence], e: RankFailure) -> None:
        log.error("%s failed: %s", step.header.describe(), e)
        for seq in seqs:
            if seq in self._active:
                self._finish(seq, EngineError("internal", str(e)))
        # A rank failed a step on these slots: a parked cache among them (a park that
        # failed, or a finished sequence's last step still in flight) may not hold what
        # the other ranks' copies hold, so nobody may reuse it.
        lost = set(step.header.slots)
        for seq in self._active:
            if seq.taken and seq.cached_tokens and seq.taken.source in lost:
                self._restart_prefill(seq)
        with self._cv:
            forgotten = self._slots.forget(step.header.slots)
        for slot in forgotten:
            self._free_slot(slot)
        # Its later steps in flight fail too; they find the sequences finished.

    def _launch_ready(self) -> None:
        if self._commands:  # a command waits for the ring to empty: launch nothing new
            return
        limit = min(self.max_in_flight, self.pipeline.in_flight_limit)
        while len(self._launched) < limit and self._launch_next():
            pass

    def _join_group(self, seq: Sequence) -> None:
        group = pick_group([len(m) for m in self._groups], hdr.MAX_SEQS)
        seq.group = group
        self._groups[group].append(seq)

    def _sample(
        self, step: Step, rows: list[tuple[int, Sequence]], logits: mx.array, start: bool = True
    ) -> Sampled:
        """mlx-lm's step for each row (logits processors, log-softmax, sample), built as
        one graph and started (unless not `start`: the caller starts it once the return
        it reads is settled), not waited for; each sequence's next input is its row.

        The batch is sampling.sample_batch's; a grammar's mask is for the token after
        the one read back last, which `_emit` has moved the matcher over (a sequence has
        at most one step that wants logits in flight).
        """
        if len(rows) < logits.shape[0]:
            logits = logits[mx.array([i for i, _ in rows])]
        seqs = [s for _, s in rows]
        tokens, wanted = sample_batch(logits, seqs)
        for j, seq in enumerate(seqs):
            seq.next_input = tokens[j : j + 1]
            if seq.group is None:
                self._join_group(seq)
        if start:
            mx.async_eval(tokens)
        return Sampled(step, seqs, tokens, wanted)

    def _emit_sampled(self, sampled: Sampled) -> None:
        """The one wait for the device per step: read the sampled tokens, then stream."""
        values = sampled.tokens.tolist()
        timeline.mark("tokens", sampled.step.header.step_id)
        self.pipeline.done(sampled.step)
        now = time.perf_counter()
        for seq, token, logprobs in zip(sampled.seqs, values, sampled.logprobs, strict=True):
            if seq not in self._active:
                continue
            if seq.first_token_at is None:
                seq.first_token_at = now
            seq.context.append(token)
            self._emit(seq, token, logprobs)

    def _emit(self, seq: Sequence, token: int, logprobs: mx.array | None) -> None:
        chunk, reason = self._output.token(seq, token, logprobs)
        constraint = seq.request.constraint
        if not reason and constraint is not None:
            # Here, while the device runs the next step: the matcher takes the token and
            # computes the next mask. A complete grammar ends the sequence.
            try:
                reason = "stop" if constraint.advance(token) else ""
            except RuntimeError as e:
                log.error("request %s: %s", seq.request.request_id, e)
                self._finish(seq, EngineError("internal", str(e)))
                return
        if reason:
            self._finish(seq, chunk, reason=reason)
        else:
            seq.request.out.put(chunk)

    def _finish(self, seq: Sequence, last: Chunk | Exception, reason: str | None = None) -> None:
        request = seq.request
        if isinstance(last, Chunk):
            self._output.finish(seq, last, reason)
        request.out.put(last)
        self._active.remove(seq)
        if seq.group is not None:
            self._groups[seq.group].remove(seq)
        if seq.taken is not None and isinstance(last, Chunk):  # ended before any step
            self._give_back(seq.taken)
            self._keep_to_budget()
        elif seq.taken is not None:  # its first step failed on rank 0: reset the slot
            self._launched_first(seq)
            self._free_slot(seq.slot)
        elif self._reuse and isinstance(last, Chunk) and seq.position and not seq.has_images:
            # (an image request's caches are not parked: its image tokens' ids say
            # nothing of the image, so a later prompt could match them wrongly)
            # It ended normally: its caches stay for a later prompt sharing a prefix
            # (after its steps still in flight: the park step follows them everywhere).
            self._launch_free([seq.slot], park=True)
            with self._cv:
                self._slots.park(seq.slot, seq.context[: seq.position])
            self._keep_to_budget()
        else:
            self._free_slot(seq.slot)

    def _launched_first(self, seq: Sequence) -> None:
        """Rank 0 copied or cut back at launch, and every worker does so before any later
        step: a copy source may be taken or evicted again."""
        taken, seq.taken = seq.taken, None
        if taken is not None and taken.source not in (None, taken.slot):
            with self._cv:
                self._slots.unpin(taken.source)
            self._keep_to_budget()

    def _keep_to_budget(self) -> None:
        """Free the oldest parked caches beyond --prompt-cache-tokens on every rank."""
        if self.prompt_cache_tokens <= 0:
            return
        with self._cv:
            evicted = self._slots.over_budget(self.prompt_cache_tokens)
        for slot in evicted:
            self._free_slot(slot)

    def _restart_prefill(self, seq: Sequence) -> None:
        """Its parked source is gone before its first step: prefill the whole prompt."""
        self._launched_first(seq)  # unpins
        prompt = seq.request.prompt_tokens
        seq.pending, seq.position, seq.context, seq.cached_tokens = list(prompt), 0, [], 0

    def _free_slot(self, slot: int) -> None:
        """Drop the slot's caches on every rank; it is empty from now on."""
        self._launch_free([slot])
        with self._cv:
            self._slots.release(slot)

    def _launch_free(self, slots: list[int], park: bool = False) -> None:
        step = self.pipeline.launch_free(slots, park=park)
        if step is not None:
            self._launched.append(step)

    # --- commands (engine thread, nothing in flight) ---------------------------------
    def _load(self, spec: str, layers: list[int] | None) -> Any:
        self._cancel_all("the model is being replaced")
        self._set_state("loading")
        try:
            loaded = self.pipeline.load(spec, layers)
            self.tokenizer = load_tokenizer(loaded.path)
            self.markup = ChatMarkup.of(self.tokenizer)
            config = self.pipeline.shard.config
            self.context_length = int(config.get("max_position_embeddings") or 0)
            self._output = OutputProcessor(self.tokenizer, self.context_length)
            self._unpark_all()
            self._reuse = self.prompt_cache and self.pipeline.shard.reusable_caches
            shard = self.pipeline.shard
            self._scheduler.reset(self.pipeline.hidden_size, fixed_alone=shard.kv is not None)
            self._slots.usable = self.pipeline.shard.usable_prefix
        except Exception:
            self._set_state("unloaded")
            raise
        self.error = ""
        self._set_state("serving")
        return loaded

    def _free(self, shutdown: bool) -> str:
        self._cancel_all("the model was freed")
        self.pipeline.unload()
        self._unpark_all()
        self.tokenizer = self.markup = self._output = None
        self._set_state("unloaded")
        if shutdown:
            self._set_state("stopping")
            self.pipeline.shutdown()
            with self._cv:
                self._stop = True
            return "model freed; every rank is shutting down"
        return "model freed on every rank"

    def _unpark_all(self) -> None:
        """The ranks' caches were replaced or dropped: parked slots are empty again."""
        with self._cv:
            self._slots.reset()

    def _cancel_all(self, why: str) -> None:
        with self._cv:
            waiting, self._waiting = list(self._waiting), deque()
        for request in waiting:
            request.out.put(EngineError("unavailable", why))
        for seq in list(self._active):
            self._finish(seq, EngineError("unavailable", why))
        while self._launched:
            self._complete_oldest()

    def _fail_everything(self, why: str) -> None:
        if self.state != "failed":  # the first diagnosis names the rank; keep it
            self.error = why
            self._set_state("failed")
        with self._cv:
            self._stop = True
            waiting, self._waiting = list(self._waiting), deque()
            commands, self._commands = list(self._commands), deque()
            self._cv.notify_all()
        for request in waiting + [s.request for s in list(self._active)]:
            request.out.put(EngineError("unavailable", why))
        self._active.clear()
        for _, future in commands:
            future.set_exception(EngineError("unavailable", why))
