"""The scheduler: every request's state from queued to finished, and what runs next.

As vLLM v1's scheduler, it owns the state and makes the decisions; the engine
(engine.py) is the thread around it that carries them out on the pipeline and reports
back what happened. The state: the waiting requests, the running sequences, their
decode groups, and the prompt-cache slot table (slots.py). The calls:

- `add(request)`: queue it (EngineError "exhausted" beyond --max-queue);
- `admit()`: queued requests take slots while there are some and their caches fit
  (the memory check, admission.py); a sequence starts from a parked cache sharing its
  prompt's prefix;
- `schedule()`: the next forward step, typed: one sequence's `PrefillChunk` or a
  `DecodeGroup`'s next token (units take turns, chunks are paced: policy.py), or None;
  `launched(action)` once it is round the ring;
- `sampled(seqs, tokens)`: a step's tokens, still on the device, are its sequences'
  next inputs (a first token joins a decode group);
- `update_from_output(seqs, tokens, logprobs)`: the tokens read back become chunks for
  the clients; those that end a sequence (EOS, a stop string, the length, a grammar's
  end) finish it;
- `verified(action, tokens, proposed, logprobs)`: a speculating sequence's `Verify` step came
  back (speculation.py): the proposals kept and the token after them become chunks, and
  its position goes back to what its caches truly hold;
- `reap_cancelled`, `step_failed`, `fail`, `cancel_all`: the other ways sequences end.

Each call that ends sequences or moves slots returns an `Update`: what to put on the
requests' queues, the sequences finished, and the `Free`/`Park` steps to launch, in
order. A finished sequence's slot is parked (its caches stay for a later prompt
sharing a prefix) or freed; parked caches beyond --prompt-cache-tokens are freed.
Nothing here touches the ring or the device, nor takes a lock: the engine holds its
own around every call.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_relay.coordinator.admission import MemoryCheck
from mlx_relay.coordinator.output import OutputProcessor
from mlx_relay.coordinator.policy import Policy, StepOutput, Unit, pick_group
from mlx_relay.coordinator.sampling import Sampler
from mlx_relay.coordinator.sequence import Chunk, EngineError, Request, Sequence
from mlx_relay.coordinator.slots import SlotTable, Taken
from mlx_relay.coordinator.speculation import RoundCost, SpecConfig, SpecState, blocker
from mlx_relay.model import vision
from mlx_relay.model.sharding import Shard
from mlx_relay.protocol import header as hdr
from mlx_relay.text.markup import ChatMarkup

log = logging.getLogger("mlx_relay.scheduler")


@dataclass(frozen=True)
class PrefillChunk:
    """The next `tokens` of one sequence's prompt (with its last one: logits for token 1)."""

    seq: Sequence
    tokens: list[int]
    want_logits: bool
    reuse_from: int | None  # the parked slot its first step starts from

    @property
    def seqs(self) -> list[Sequence]:
        return [self.seq]


@dataclass(frozen=True)
class DecodeGroup:
    """One decode step of a group, fed each member's token sampled last."""

    group: int
    members: list[Sequence]
    inputs: list[mx.array]  # (1,) each, maybe not computed yet

    @property
    def seqs(self) -> list[Sequence]:
        return self.members


@dataclass(frozen=True)
class Free:
    """Drop the slot's caches on every rank."""

    slot: int


@dataclass(frozen=True)
class Park:
    """Keep the slot's caches as one sequence's on every rank, for a later prompt."""

    slot: int


@dataclass(frozen=True)
class Verify:
    """A speculating sequence's round: its next input and up to `k` proposals after it,
    in one step of 1 + k positions (the first round's input is the prompt's last token).
    The engine drafts the proposals at launch (`proposed`)."""

    seq: Sequence
    input: mx.array  # (1,), maybe not computed yet
    history: list[int]  # the sequence's every token so far, the input's value last
    k: int
    reuse_from: int  # the slot the step starts from: its own, cut back to its position
    proposed: mx.array | None = None  # (k,) the drafter's tokens, set at launch
    width: int = 0  # positions the step carries: 1 + k, or more where wider is cheaper

    @property
    def seqs(self) -> list[Sequence]:
        return [self.seq]


Forward = PrefillChunk | DecodeGroup | Verify


@dataclass
class Update:
    """What the engine carries out after a call: chunks and errors for the requests'
    queues, then the slot steps to launch, in order."""

    emit: list[tuple[Request, Chunk | Exception]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    slots: list[Free | Park] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        *,
        max_active: int,
        max_queue: int,
        prefill_chunk: int,
        groups: int,
        prompt_cache: bool = True,
        prompt_cache_tokens: int = 0,
        speculation: SpecConfig | None = None,
    ) -> None:
        self.max_queue = max_queue
        self.prompt_cache = prompt_cache
        self.prompt_cache_tokens = prompt_cache_tokens  # 0: as many as the slots hold
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []
        self.groups: list[list[Sequence]] = [[] for _ in range(groups)]
        self.slots = SlotTable(max_active)
        self.policy = Policy(prefill_chunk)
        # The loaded model's rules (load): output, chat markup, config, memory check.
        self.output: OutputProcessor | None = None
        self.markup: ChatMarkup | None = None
        self.config: dict[str, Any] = {}
        self.memory: MemoryCheck | None = None
        self.reuse = False  # prompt_cache, and the model's caches can be cut back
        self.whole_images = False  # an image prompt goes in one step (vision.prefills_whole)
        self.speculation = speculation
        self.spec_blocked = ""  # why the loaded model cannot speculate ('' if it can)
        self.round_cost = RoundCost()  # what a verify step takes by its width, here

    # --- the model ---------------------------------------------------------------------
    def load(
        self,
        output: OutputProcessor,
        markup: ChatMarkup,
        shard: Shard,
        hidden: int,
        memory: MemoryCheck | None,
    ) -> None:
        """A model was loaded on every rank (`shard`: rank 0's): no cache is parked any
        more, and its pace is still to be measured."""
        self.output, self.markup, self.memory = output, markup, memory
        self.config = shard.config
        self.slots.reset()
        self.reuse = self.prompt_cache and shard.reusable_caches
        self.whole_images = vision.prefills_whole(shard.config)
        # (quantized KV caches: a prompt alone goes in --prefill-chunk chunks)
        self.policy.reset(hidden, fixed_alone=shard.kv is not None)
        self.slots.usable = shard.usable_prefix
        self.spec_blocked = blocker(shard) if self.speculation else ""
        self.round_cost = RoundCost()
        if self.spec_blocked:
            log.warning("this model decodes without speculation: %s", self.spec_blocked)

    def unload(self) -> None:
        """The ranks' caches were dropped: parked slots are empty again."""
        self.slots.reset()
        self.output = self.markup = self.memory = None
        self.whole_images = False

    # --- queued --------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        # Requests about to take a free slot are not queued: only those beyond count.
        if len(self.waiting) - self.slots.open() >= self.max_queue:
            raise EngineError(
                "exhausted",
                f"server busy: {len(self.running)} requests running and "
                f"{len(self.waiting)} queued (limit {self.max_queue}); retry later",
            )
        self.waiting.append(request)

    def admit(self) -> Update:
        """Queued requests take slots, in order, while there are some. One whose caches
        would not fit waits while sequences run (they will end and free theirs), and is
        refused when none does."""
        update, failed = Update(), []
        while self.waiting and self.slots.open():
            request = self.waiting.popleft()
            if request.cancelled.is_set():
                update.emit.append((request, Chunk(finish_reason="cancelled")))
                continue
            short = self._memory_short(request)
            if short and self.running:
                self.waiting.appendleft(request)
                break
            if short:
                update.emit.append(
                    (request, EngineError("exhausted", f"not enough memory: {short}"))
                )
                continue
            taken = self.slots.take(request.prompt_tokens)
            try:
                seq = self._new_sequence(request, taken)
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the engine
                log.exception("request %s cannot start: %s", request.request_id, e)
                update.emit.append(
                    (request, EngineError("internal", f"the request cannot start: {e}"))
                )
                failed.append(taken)
                continue
            self.running.append(seq)
        for taken in failed:
            self._give_back(taken, update)
        return update

    def _memory_short(self, request: Request) -> str:
        if self.memory is None:
            return ""
        parked = [len(t) for t in self.slots.parked.values()]
        return self.memory.shortfall(request, self.running, parked)

    def _new_sequence(self, request: Request, taken: Taken) -> Sequence:
        assert self.output is not None
        cached = _cached_before_images(request, taken.cached, self.config)
        return Sequence(
            request=request,
            slot=taken.slot,
            sampler=Sampler(request.params),
            text=self.output.stream(request, self.markup),
            pending=list(request.prompt_tokens[cached:]),
            position=cached,
            context=list(request.prompt_tokens[:cached]),
            cached_tokens=cached,
            taken=taken,
            spec=self._speculates(request),
        )

    def _speculates(self, request: Request) -> SpecState | None:
        """A new sequence's speculation: on where the server has it and the model allows
        it, unless the request turns it off (num_draft_tokens 0), follows a grammar (its
        matcher moves one token at a time), carries images, or more than `max_streams`
        sequences run (alone on its caches it would cost the batched streams more)."""
        config, wanted = self.speculation, request.params.num_draft_tokens
        if config is None or self.spec_blocked or wanted == 0:
            return None
        if request.constraint is not None or request.pixel_values is not None:
            return None
        if len(self.running) >= config.max_streams:
            return None
        limit = min(config.num_draft_tokens, wanted or config.num_draft_tokens)
        return SpecState(k=limit, limit=limit, adaptive=config.adaptive)

    # --- what runs next ------------------------------------------------------------------
    def _units(self) -> list[Unit]:
        """Work that can go round the ring now, in a stable order."""
        units = [
            Unit("group", g)
            for g, members in enumerate(self.groups)
            if members and all(s.next_input is not None for s in members)
        ]
        units += [
            Unit("prefill", s, len(s.pending), self.whole_images and s.has_images, s.position)
            for s in self.running
            if s.group is None and s.prefilling and not s.request.cancelled.is_set()
        ]
        units += [
            Unit("verify", s)
            for s in self.running
            if s.spec is not None and s.next_input is not None and not s.request.cancelled.is_set()
        ]
        return units

    def schedule(self) -> Forward | None:
        """The next forward step (its inputs taken from the state), or None if nothing
        can run now."""
        decoding = any(self.groups) or any(s.spec and s.first_token_at for s in self.running)
        plan = self.policy.schedule(self._units(), decoding=decoding)
        if plan is None:
            return None
        if plan.unit.kind == "verify":
            seq = plan.unit.key
            last, seq.next_input = seq.next_input, None
            return Verify(seq, last, list(seq.context), self._proposals(seq), seq.slot)
        if plan.unit.kind == "group":
            members = list(self.groups[plan.unit.key])
            inputs = [s.next_input for s in members]
            for s in members:
                s.next_input = None
            return DecodeGroup(plan.unit.key, members, inputs)
        seq: Sequence = plan.unit.key
        tokens, seq.pending = seq.pending[: plan.tokens], seq.pending[plan.tokens :]
        reuse = seq.taken.source if seq.taken and seq.cached_tokens else None
        if seq.spec is not None and plan.want_logits and len(tokens) == 1:
            # The prompt's last token goes with the first proposals, as in mlx-lm.
            source = seq.slot if reuse is None else reuse
            k = self._proposals(seq)
            return Verify(seq, mx.array(tokens), seq.context + tokens, k, source)
        return PrefillChunk(seq, tokens, plan.want_logits, reuse)

    def _proposals(self, seq: Sequence) -> int:
        """How many proposals `seq`'s next round asks for: its adaptive k, at most the
        tokens it may still generate (as mlx-lm caps them), within the context."""
        assert seq.spec is not None
        remaining = seq.request.params.max_tokens - len(seq.generated)
        context = self.output.context_length if self.output is not None else 0
        if context:
            remaining = min(remaining, context - seq.position - 1)
        return seq.spec.wanted(remaining)

    def launched(self, action: Forward) -> Update:
        """`action`'s step is round the ring: its sequences' positions move on."""
        update = Update()
        if isinstance(action, DecodeGroup):
            for s in action.members:
                s.position += 1
            return update
        if isinstance(action, Verify):
            seq = action.seq
            self._launched_first(seq, update)
            if len(action.history) > len(seq.context):  # (its first: the prompt's last token)
                seq.context.append(action.history[-1])
            seq.position += action.width
            return update
        seq = action.seq
        self._launched_first(seq, update)
        seq.position += len(action.tokens)
        seq.context.extend(action.tokens)
        return update

    def has_work(self) -> bool:
        """Anything to admit, reap or launch."""
        return bool(
            (self.waiting and self.slots.open())
            or any(s.request.cancelled.is_set() for s in self.running)
            or self._units()
        )

    def step_took(self, out: StepOutput) -> None:
        """A forward step came back: what it took paces the next prompt chunks (a decode
        step counts only with no prompt prefilled beside it), and a verify step's tells
        how many proposals pay (RoundCost; a decode step's time overlaps the next one's,
        so it says nothing of a round's)."""
        if out.kind == "verify":
            self.round_cost.took(out.tokens, out.seconds)
            return
        if out.kind == "group" and any(s.prefilling for s in self.running):
            out = dataclasses.replace(out, beside_prefill=True)
        self.policy.update_from_output(out)

    # --- results ---------------------------------------------------------------------
    def is_running(self, seq: Sequence) -> bool:
        return seq in self.running

    def sampled(self, seqs: list[Sequence], tokens: mx.array) -> None:
        """`tokens` (len(seqs),), maybe not computed yet, are the next decode inputs; a
        sequence's first token makes it join a decode group."""
        for j, seq in enumerate(seqs):
            seq.next_input = tokens[j : j + 1]
            if seq.group is None:
                seq.group = pick_group([len(m) for m in self.groups], hdr.MAX_SEQS)
                self.groups[seq.group].append(seq)

    def update_from_output(
        self, seqs: list[Sequence], tokens: list[int], logprobs: list[mx.array | None]
    ) -> Update:
        """The tokens read back for a step's sequences (and their log-probabilities
        where wanted): a chunk for each still running, and the sequences they end."""
        update, now = Update(), time.perf_counter()
        for seq, token, row in zip(seqs, tokens, logprobs, strict=True):
            if seq not in self.running:
                continue
            if seq.first_token_at is None:
                seq.first_token_at = now
            seq.context.append(token)
            self._emit(seq, token, row, update)
        return update

    def verify_width(self, verify: Verify, proposals: int) -> int:
        """How many positions a round with `proposals` carries: one more, or a wider
        step where that costs less here (adaptive rounds: RoundCost.padded)."""
        spec = verify.seq.spec
        if spec is None or not spec.adaptive or not proposals:  # (none: exactly at its
            return 1 + proposals  # position after the round, to time it or join a group)
        return self.round_cost.padded(1 + proposals)

    def verified(
        self,
        action: Verify,
        tokens: list[int],
        proposed: list[int],
        logprobs: list[mx.array | None],
    ) -> tuple[Update, int]:
        """A verify step's tokens read back (one per position: its input's, then each of
        the `proposed` tokens'): the proposals up to the first that differs from what was
        sampled are kept, then the sampled token after them, each a chunk; the caches
        hold the rejected ones too, so the sequence's position goes back to what they
        truly hold (its next step cuts them out). The update, and how many were kept."""
        seq, update, kept = action.seq, Update(), 0
        while kept < len(proposed) and tokens[kept] == proposed[kept]:
            kept += 1
        if seq not in self.running or seq.spec is None:
            return update, kept
        seq.position -= action.width - 1 - kept  # (before any chunk: a park records it)
        seq.spec.record(len(proposed), kept, self.round_cost)
        seq.draft_tokens += len(proposed)
        seq.accepted_draft_tokens += kept
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        for token, row in zip(tokens[: kept + 1], logprobs[: kept + 1], strict=True):
            seq.context.append(token)
            self._emit(seq, token, row, update)
            if seq not in self.running:
                return update, kept
        following = mx.array(tokens[kept : kept + 1])
        config = self.speculation
        if config is not None and len(self.running) > config.max_streams:
            seq.spec.leaving = True  # (streams came: it decodes in a group from now on)
        if seq.spec.leaving and action.width == 1:  # its caches hold exactly its position
            seq.spec = None
            self.sampled([seq], following)
        else:
            seq.next_input = following
        return update, kept

    def _emit(self, seq: Sequence, token: int, logprobs: mx.array | None, update: Update) -> None:
        assert self.output is not None
        chunk, reason = self.output.token(seq, token, logprobs)
        constraint = seq.request.constraint
        if not reason and constraint is not None:
            # Here, while the device runs the next step: the matcher takes the token and
            # computes the next mask. A complete grammar ends the sequence.
            try:
                reason = "stop" if constraint.advance(token) else ""
            except RuntimeError as e:
                log.error("request %s: %s", seq.request.request_id, e)
                self._finish(seq, EngineError("internal", str(e)), update)
                return
        if reason:
            self._finish(seq, chunk, update, reason)
        else:
            update.emit.append((seq.request, chunk))

    # --- sequences ending otherwise ---------------------------------------------------
    def reap_cancelled(self, seqs: list[Sequence] | None = None) -> Update:
        """End the cancelled sequences (of `seqs`, or all): steps of theirs still in
        flight run to their end on every rank before the freeing step that follows them
        (steps keep their order), and what they return is ignored."""
        update = Update()
        for seq in list(self.running if seqs is None else seqs):
            if seq in self.running and seq.request.cancelled.is_set():
                self._finish(seq, Chunk(), update, "cancelled")
        return update

    def fail(self, seqs: list[Sequence], kind: str, message: str) -> Update:
        """End `seqs` with an EngineError (rank 0 failed a step of theirs)."""
        update = Update()
        for seq in list(seqs):
            if seq in self.running:
                self._finish(seq, EngineError(kind, message), update)
        return update

    def step_failed(self, slots: list[int], seqs: list[Sequence], message: str) -> Update:
        """A rank failed a step on `slots` for `seqs`: they end with its message. A parked
        cache among the slots (a park that failed, or a finished sequence's last step
        still in flight) may not hold what the other ranks' copies hold, so nobody may
        reuse it. The step's later steps in flight fail too; they find the sequences
        finished."""
        update = self.fail(seqs, "internal", message)
        lost = set(slots)
        for seq in self.running:
            if seq.taken and seq.cached_tokens and seq.taken.source in lost:
                self._restart_prefill(seq, update)
        for slot in self.slots.forget(slots):
            self._free(slot, update)
        return update

    def cancel_all(self, why: str) -> Update:
        """Every request queued or running ends with UNAVAILABLE (a load, a free)."""
        update = Update()
        waiting, self.waiting = list(self.waiting), deque()
        for request in waiting:
            update.emit.append((request, EngineError("unavailable", why)))
        for seq in list(self.running):
            self._finish(seq, EngineError("unavailable", why), update)
        return update

    def abandon(self) -> list[Request]:
        """Every request queued or running, forgotten: the cluster failed, nothing more
        is launched, and the caller answers them."""
        requests = list(self.waiting) + [s.request for s in self.running]
        self.waiting.clear()
        self.running.clear()
        return requests

    # --- slots -------------------------------------------------------------------------
    def _finish(
        self, seq: Sequence, last: Chunk | Exception, update: Update, reason: str | None = None
    ) -> None:
        if isinstance(last, Chunk):
            assert self.output is not None
            self.output.finish(seq, last, reason)
        update.emit.append((seq.request, last))
        update.finished.append(seq)
        self.running.remove(seq)
        if seq.group is not None:
            self.groups[seq.group].remove(seq)
        if seq.taken is not None and isinstance(last, Chunk):  # ended before any step
            self._give_back(seq.taken, update)
            self._keep_to_budget(update)
        elif seq.taken is not None:  # its first step failed on rank 0: reset the slot
            self._launched_first(seq, update)
            self._free(seq.slot, update)
        elif self.reuse and isinstance(last, Chunk) and seq.position and not seq.has_images:
            # (an image request's caches are not parked: its image tokens' ids say
            # nothing of the image, so a later prompt could match them wrongly)
            # It ended normally: its caches stay for a later prompt sharing a prefix
            # (after its steps still in flight: the park step follows them everywhere).
            update.slots.append(Park(seq.slot))
            self.slots.park(seq.slot, seq.context[: seq.position])
            self._keep_to_budget(update)
        else:
            self._free(seq.slot, update)

    def _give_back(self, taken: Taken, update: Update) -> None:
        """A slot taken for a sequence that never ran a step: no rank touched its caches."""
        if taken.held is not None:
            self.slots.park(taken.slot, taken.held)
            return
        if taken.source is not None:  # a copy source, pinned for this sequence
            self.slots.unpin(taken.source)
        self._free(taken.slot, update)  # it may hold an evicted cache on every rank

    def _launched_first(self, seq: Sequence, update: Update) -> None:
        """Rank 0 copied or cut back at launch, and every worker does so before any later
        step: a copy source may be taken or evicted again."""
        taken, seq.taken = seq.taken, None
        if taken is not None and taken.source not in (None, taken.slot):
            self.slots.unpin(taken.source)
            self._keep_to_budget(update)

    def _keep_to_budget(self, update: Update) -> None:
        """Free the oldest parked caches beyond --prompt-cache-tokens on every rank."""
        if self.prompt_cache_tokens <= 0:
            return
        for slot in self.slots.over_budget(self.prompt_cache_tokens):
            self._free(slot, update)

    def _restart_prefill(self, seq: Sequence, update: Update) -> None:
        """Its parked source is gone before its first step: prefill the whole prompt."""
        self._launched_first(seq, update)  # unpins
        prompt = seq.request.prompt_tokens
        seq.pending, seq.position, seq.context, seq.cached_tokens = list(prompt), 0, [], 0

    def _free(self, slot: int, update: Update) -> None:
        """The slot's caches go on every rank (the step follows its steps in flight); it
        is empty from now on."""
        update.slots.append(Free(slot))
        self.slots.release(slot)

    # --- status ----------------------------------------------------------------------
    def snapshot(self) -> list[dict[str, Any]]:
        """Every request queued or running, for a status page: its phase, tokens so far,
        timings and prompt-cache hit."""
        now = time.perf_counter()
        out: list[dict[str, Any]] = [
            {
                "request_id": r.request_id,
                "phase": "queued",
                "prompt_tokens": len(r.prompt_tokens),
                "age_s": now - r.created,
            }
            for r in self.waiting
        ]
        for seq in self.running:
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
            if seq.draft_tokens:
                row["draft_tokens"] = seq.draft_tokens
                row["accepted_draft_tokens"] = seq.accepted_draft_tokens
            if first is not None:
                row["time_to_first_token_s"] = first - r.created
                if generated > 1 and now > first:
                    row["decode_tokens_per_s"] = (generated - 1) / (now - first)
            out.append(row)
        return sorted(out, key=lambda row: -row["age_s"])


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
