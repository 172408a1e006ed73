"""The engine: one thread that owns MLX and the ring, and turns requests into tokens.

gRPC handler threads never touch MLX. They submit a request and read its chunks
from a queue; commands (load, free, shutdown) are run by the engine thread between
steps, so every rank always sees one well-ordered sequence of steps. Each step
advances one sequence by one prefill chunk or one decoded token, round robin.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.utils import load_tokenizer

from mlx_relay.coordinator.pipeline import ClusterFailure, Pipeline, RankFailure
from mlx_relay.coordinator.sampling import Sampler, SamplingParams
from mlx_relay.coordinator.textstream import StopStrings

log = logging.getLogger("mlx_relay.engine")


class EngineError(Exception):
    """A request cannot be served; `kind` maps to a gRPC status in the servicer."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "invalid", "unavailable", "exhausted", "internal", "cancelled"


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass
class Chunk:
    """A piece of one request's output stream; the last one has a finish_reason."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    timings: dict[str, float] | None = None


@dataclass
class Request:
    prompt_tokens: list[int]
    params: SamplingParams
    request_id: str = ""
    created: float = field(default_factory=time.perf_counter)
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def chunks(self) -> Iterator[Chunk]:
        """Blocking iterator over the stream; raises EngineError if the request failed."""
        while True:
            item = self.out.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finish_reason is not None:
                return


@dataclass
class Sequence:
    """Engine-thread state of one active request."""

    request: Request
    slot: int
    sampler: Sampler
    detokenizer: Any
    stops: StopStrings
    position: int = 0  # tokens already in the KV cache
    pending: list[int] = field(default_factory=list)  # fed at the next step
    context: list[int] = field(default_factory=list)  # prompt + generated (for processors)
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    prefill_done_at: float | None = None


class Engine:
    def __init__(
        self,
        pipeline: Pipeline,
        *,
        max_active: int = 8,
        max_queue: int = 64,
        prefill_chunk: int = 512,
        default_max_tokens: int = 256,
    ) -> None:
        self.pipeline = pipeline
        self.max_active = max_active
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.default_max_tokens = default_max_tokens
        self.tokenizer: Any = None
        self.context_length = 0
        self.state = "starting"
        self.error = ""
        self._waiting: deque[Request] = deque()
        self._active: list[Sequence] = []
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._cv = threading.Condition()
        self._free_slots = list(range(max_active))
        self._rr = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.on_state: Callable[[str], None] = lambda state: None

    # --- API for other threads -----------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> Request:
        with self._cv:
            if self.state != "serving":
                raise EngineError("unavailable", f"the cluster is not serving ({self.state})")
            if len(self._waiting) >= self.max_queue:
                raise EngineError(
                    "exhausted",
                    f"server busy: {len(self._active)} requests running and "
                    f"{len(self._waiting)} queued (limit {self.max_queue}); retry later",
                )
            self._waiting.append(request)
            self._cv.notify_all()
        return request

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread between steps."""
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

    def load(self, spec: str, layers: list[int] | None = None) -> Future:
        return self.call(lambda: self._load(spec, layers))

    def free(self, shutdown: bool = False) -> Future:
        return self.call(lambda: self._free(shutdown))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    # --- engine thread -------------------------------------------------------------
    def _set_state(self, state: str) -> None:
        self.state = state
        self.on_state(state)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._run_commands()
                if self._stop:
                    break
                self._admit()
                if not self._active:
                    self._sleep_until_work()
                    continue
                seq = self._active[next(self._rr) % len(self._active)]
                self._advance_or_fail(seq)
        except Exception as e:  # noqa: BLE001 - the ring is broken; say so to everyone
            log.exception("engine stopped: %s", e)
            self._fail_everything(f"cluster failed: {e}")

    def _run_commands(self) -> None:
        while True:
            with self._cv:
                if not self._commands:
                    return
                fn, future = self._commands.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except ClusterFailure as e:
                    future.set_exception(e)
                    raise
                except Exception as e:  # noqa: BLE001 - reported to the caller
                    future.set_exception(e)

    def _sleep_until_work(self) -> None:
        """Nothing to do: block (workers sleep on their doorbells meanwhile)."""
        with self._cv:
            self._cv.wait_for(lambda: self._has_work() or self._stop)

    def _has_work(self) -> bool:
        return bool(self._waiting or self._commands or self._active)

    def _admit(self) -> None:
        with self._cv:
            while self._waiting and self._free_slots:
                request = self._waiting.popleft()
                if request.cancelled.is_set():
                    request.out.put(Chunk(finish_reason="cancelled"))
                    continue
                slot = self._free_slots.pop(0)
                self._active.append(self._new_sequence(request, slot))

    def _new_sequence(self, request: Request, slot: int) -> Sequence:
        return Sequence(
            request=request,
            slot=slot,
            sampler=Sampler(request.params),
            detokenizer=self.tokenizer.detokenizer,
            stops=StopStrings(request.params.stop),
            pending=list(request.prompt_tokens),
        )

    def _advance_or_fail(self, seq: Sequence) -> None:
        request = seq.request
        if request.cancelled.is_set():
            self._finish(seq, Chunk(finish_reason="cancelled"))
            return
        try:
            self._advance(seq)
        except ClusterFailure:
            raise
        except RankFailure as e:
            log.error("request %s failed: %s", request.request_id, e)
            self._finish(seq, EngineError("internal", str(e)))

    def _advance(self, seq: Sequence) -> None:
        """One step: a prefill chunk, or the step that yields the next token.

        Mirrors mlx-lm's generate_step: the prompt but its last token is prefilled in
        chunks, then every step feeds one token and samples the next.
        """
        if len(seq.pending) > 1:
            n = min(self.prefill_chunk, len(seq.pending) - 1)
            chunk, seq.pending = seq.pending[:n], seq.pending[n:]
            self.pipeline.forward(seq.slot, seq.position, chunk, want_logits=False)
            seq.position += n
            seq.context.extend(chunk)
            return
        inputs = seq.pending
        logits = self.pipeline.forward(seq.slot, seq.position, inputs, want_logits=True)
        seq.position += len(inputs)
        seq.context.extend(inputs)
        if seq.sampler.processors:
            logits = seq.sampler.process(mx.array(seq.context), logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        token_array = seq.sampler.sample(logprobs)
        mx.eval(token_array, logprobs)
        token = int(token_array.item())
        now = time.perf_counter()
        if seq.first_token_at is None:
            seq.first_token_at = now
        self._emit(seq, token, logprobs[0])

    def _emit(self, seq: Sequence, token: int, logprobs: mx.array) -> None:
        params = seq.request.params
        if token in self.tokenizer.eos_token_ids and not params.ignore_eos:
            self._finish(seq, Chunk(), reason="stop")
            return
        seq.generated.append(token)
        seq.pending = [token]
        chunk = Chunk(token_ids=[token])
        if params.logprobs:
            chunk.logprobs.append(self._logprob_entry(token, logprobs, params.top_logprobs))
        if token not in self._special_ids:
            seq.detokenizer.add_token(token)
            chunk.text = seq.stops.feed(seq.detokenizer.last_segment)
        if seq.stops.stopped:
            self._finish(seq, chunk, reason="stop")
        elif len(seq.generated) >= params.max_tokens:
            self._finish(seq, chunk, reason="length")
        elif self.context_length and seq.position + 1 >= self.context_length:
            self._finish(seq, chunk, reason="length")
        else:
            seq.request.out.put(chunk)

    def _logprob_entry(self, token: int, logprobs: mx.array, top: int) -> TokenLogprob:
        decode = self.tokenizer.decode
        entry = TokenLogprob(token, decode([token]), float(logprobs[token].item()))
        if top > 0:
            ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
            values = logprobs[ids]
            order = mx.argsort(-values)
            for i in order.tolist():
                tid = int(ids[i].item())
                entry.top.append((tid, decode([tid]), float(values[i].item())))
        return entry

    def _finish(self, seq: Sequence, last: Chunk | Exception, reason: str | None = None) -> None:
        request = seq.request
        if isinstance(last, Chunk):
            if reason in ("stop", "length") and not seq.stops.stopped:
                seq.detokenizer.finalize()
                last.text += seq.stops.feed(seq.detokenizer.last_segment)
                last.text += seq.stops.flush()
            last.finish_reason = reason or last.finish_reason
            last.usage = {
                "prompt_tokens": len(request.prompt_tokens),
                "completion_tokens": len(seq.generated),
                "total_tokens": len(request.prompt_tokens) + len(seq.generated),
            }
            last.timings = self._timings(seq)
        request.out.put(last)
        self._active.remove(seq)
        self._release_slot(seq.slot)

    def _release_slot(self, slot: int) -> None:
        try:
            self.pipeline.free([slot])
        finally:
            with self._cv:
                self._free_slots.append(slot)

    def _timings(self, seq: Sequence) -> dict[str, float]:
        now = time.perf_counter()
        first = seq.first_token_at
        ttft = (first - seq.request.created) if first else 0.0
        decoded = len(seq.generated) - 1
        decode_s = now - first if first else 0.0
        return {
            "time_to_first_token_s": ttft,
            "prompt_tokens_per_s": len(seq.request.prompt_tokens) / ttft if ttft > 0 else 0.0,
            "decode_tokens_per_s": decoded / decode_s if decoded > 0 and decode_s > 0 else 0.0,
            "total_s": now - seq.request.created,
        }

    # --- commands (engine thread) --------------------------------------------------
    def _load(self, spec: str, layers: list[int] | None) -> Any:
        self._cancel_all("the model is being replaced")
        self._set_state("loading")
        try:
            loaded = self.pipeline.load(spec, layers)
            self.tokenizer = load_tokenizer(loaded.path)
            self._special_ids = set(self.tokenizer.all_special_ids or [])
            config = self.pipeline.shard.config
            self.context_length = int(config.get("max_position_embeddings") or 0)
        except Exception:
            self._set_state("unloaded")
            raise
        self._set_state("serving")
        return loaded

    def _free(self, shutdown: bool) -> str:
        self._cancel_all("the model was freed")
        self.pipeline.unload()
        self.tokenizer = None
        self._set_state("unloaded")
        if shutdown:
            self._set_state("stopping")
            self.pipeline.shutdown()
            with self._cv:
                self._stop = True
            return "model freed; every rank is shutting down"
        return "model freed on every rank"

    def _cancel_all(self, why: str) -> None:
        with self._cv:
            waiting, self._waiting = list(self._waiting), deque()
        for request in waiting:
            request.out.put(EngineError("unavailable", why))
        for seq in list(self._active):
            self._finish(seq, EngineError("unavailable", why))

    def _fail_everything(self, why: str) -> None:
        self.error = why
        self._set_state("failed")
        with self._cv:
            self._stop = True
            waiting, self._waiting = list(self._waiting), deque()
            commands, self._commands = list(self._commands), deque()
        for request in waiting + [s.request for s in self._active]:
            request.out.put(EngineError("unavailable", why))
        self._active.clear()
        for _, future in commands:
            future.set_exception(EngineError("unavailable", why))

    _special_ids: set[int] = set()
