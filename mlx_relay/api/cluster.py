"""What every front door asks of the cluster, in one place.

gRPC, HTTP and LocalAI's backend service all translate their wire messages into the
typed `generation.GenerationRequest` (each with an adapter of its own) and hand it to
`Cluster.submit`: one way from a request to the engine, checked the same way for every
door, so the doors differ only in how they spell things. Errors come out as
`requests.InvalidRequest`, `EngineError` (with a `kind`) or `RankFailure` (`REFUSALS`);
each door maps those to its own status codes.

It is also all a door reads of the cluster: its state, the model served, the workers,
the ring's steps, why it cannot serve (`unhealthy`). The engine and its pipeline stay
behind it (`_engine`), so they change without a door changing, and one `max_tokens`
policy (`budget.py`) applies to every door as the request is built.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mlx_relay import proctitle
from mlx_relay.api import budget
from mlx_relay.api.budget import Limit
from mlx_relay.api.metrics import Metrics
from mlx_relay.coordinator import generation, load_checks, requests
from mlx_relay.coordinator.engine import Engine
from mlx_relay.coordinator.generation import GenerationRequest
from mlx_relay.coordinator.model_context import ModelContext
from mlx_relay.coordinator.output import Chunk
from mlx_relay.coordinator.pipeline import ClusterFailure, LoadedModel, RankFailure
from mlx_relay.coordinator.sequence import EngineError, Request
from mlx_relay.coordinator.stats import StepCount
from mlx_relay.model import memory
from mlx_relay.model.default_model import ModelError
from mlx_relay.model.prefix_store import BLOCK_TOKENS
from mlx_relay.model.split import model_layers
from mlx_relay.protocol import control
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.text import constraints
from mlx_relay.text.markup import ChatMarkup
from mlx_relay.text.tool_constraint import tool_constraint
from mlx_relay.transport.hub import LinkFailure, RankInfo
from mlx_relay.transport.tensor import AUTO, TensorLayoutError, check_layout

log = logging.getLogger("mlx_relay.cluster")


class Cluster:
    """The engine as the front doors see it.

    `model` and `layers`: what rank 0 was started with, what `load` loads again when it
    names no model (after a Free, say); a successful load replaces them. One instance is
    shared by every door, so a LoadModel through one is what the others reload.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        backend: str = "",
        model: str = "",
        layers: str = "",
        tool_fallback: bool = True,
    ) -> None:
        self._engine = engine
        # Tools for a model whose template ignores them go into the system prompt
        # (text/tool_prompt.py); False (--no-tool-fallback) refuses such requests.
        self.tool_fallback = tool_fallback
        self.backend = backend
        self.last_model = model
        self.last_layers = layers
        self._compiler: constraints.Compiler | None = None  # the loaded tokenizer's
        self._compiler_lock = threading.Lock()
        self.metrics = Metrics(self)  # every door's requests, by API

    def tokenizer(self) -> Any:
        """The loaded model's tokenizer, or EngineError('unavailable') saying why not."""
        return self._model().tokenizer

    def markup(self) -> ChatMarkup:
        """The loaded model's chat markup (resolved once, at load), or EngineError."""
        return self._model().markup

    def _model(self) -> ModelContext:
        """The loaded model's context (made once at load), or EngineError saying why not."""
        model = self._engine.model
        if model is None or self._engine.state != "serving":
            raise EngineError("unavailable", not_serving(self._engine.state, self._engine.error))
        return model

    # --- what the doors read of the cluster (none looks past this class) ----------
    @property
    def state(self) -> str:
        """The engine's state: starting, loading, serving, unloaded, draining, stopping
        or failed."""
        return self._engine.state

    @property
    def error(self) -> str:
        """Why the cluster failed ('' unless it did)."""
        return self._engine.error

    @property
    def running(self) -> bool:
        """The engine's loop thread is alive: a server over a dead loop serves nothing."""
        return self._engine.running

    @property
    def loaded(self) -> LoadedModel | None:
        """The model served (its spec, path, fingerprint, layer ranges), None if none."""
        return self._engine.pipeline.loaded

    def model_id(self) -> str:
        """The served model's name as every API lists it ('' when none is loaded)."""
        loaded = self.loaded
        return loaded.spec if loaded else ""

    @property
    def context_length(self) -> int:
        """The loaded model's context (0: none loaded, or none known)."""
        model = self._engine.model
        return model.context_length if model is not None else 0

    @property
    def world_size(self) -> int:
        return self._engine.pipeline.world_size

    def counts(self) -> tuple[int, int]:
        """Requests running and queued."""
        return self._engine.scheduler.counts()

    def cached_prompts(self) -> tuple[int, int]:
        """Parked prompt caches and the tokens they hold."""
        return self._engine.scheduler.cached_prompts()

    def cached_tokens(self, request_id: str) -> int:
        """The prompt tokens a running request found in a kept cache (0 once it is gone):
        what a stream's first event reports before the final usage comes."""
        rows = self._engine.scheduler.snapshot()
        return next((r.get("cached_tokens", 0) for r in rows if r["request_id"] == request_id), 0)

    def speculation(self) -> pb.SpeculationStatus:
        """Speculative decoding's settings and its rounds so far."""
        engine = self._engine
        config, counts = engine.config.speculation, engine.stats.rounds()
        if config is None:
            return pb.SpeculationStatus()
        rounds, proposed, kept = counts.rounds, counts.proposed, counts.accepted
        return pb.SpeculationStatus(
            source=config.source,
            num_draft_tokens=config.num_draft_tokens,
            adaptive=config.adaptive,
            off_reason=engine.scheduler.speculator.blocked,
            rounds=rounds,
            draft_tokens=proposed,
            accepted_draft_tokens=kept,
            acceptance_rate=kept / proposed if proposed else 0.0,
            tokens_per_round=(rounds + kept) / rounds if rounds else 0.0,
        )

    def prompt_store(self) -> pb.PromptStoreStatus:
        """The prompt blocks kept on disk (--prompt-cache-dir) and what they gave."""
        pipeline, model = self._engine.pipeline, self._engine.model
        settings = pipeline.prompt_store
        if not settings:
            return pb.PromptStoreStatus()
        out = pb.PromptStoreStatus(
            dir=str(settings["dir"]),
            budget_bytes=int(settings["budget"]),
            off_reason=pipeline.prompt_store_off(),
        )
        store = pipeline.runner.store
        if store is not None:
            out.blocks, out.bytes = len(store.keys()), store.bytes
        index = model.prefixes if model is not None else None
        if index is not None:
            out.restores, out.restored_tokens = index.restores, index.restored_tokens
            out.failed_restores, out.stored_blocks = index.failed_restores, index.stored_blocks
        return out

    def prompt_cache_tiers(self) -> tuple[list[pb.PromptCacheTier], int]:
        """The prompt cache's tiers (RAM's parked slots; disk's blocks where kept), and
        the prompt tokens of the requests whose prefill finished, that hit rates are of."""
        counted = self._engine.stats.prompts()
        total = counted.tokens

        def rate(hits: int) -> float:
            return hits / total if total else 0.0

        parked, tokens, nbytes, budget = self._engine.scheduler.ram_tier()
        tiers = [
            pb.PromptCacheTier(
                tier="ram",
                entries=parked,
                tokens=tokens,
                bytes=nbytes,
                budget_bytes=budget,
                hit_tokens=counted.from_ram,
                hit_rate=rate(counted.from_ram),
            )
        ]
        store = self.prompt_store()
        if store.dir:
            tiers.append(
                pb.PromptCacheTier(
                    tier="disk",
                    entries=store.blocks,
                    tokens=store.blocks * BLOCK_TOKENS,
                    bytes=store.bytes,
                    budget_bytes=store.budget_bytes,
                    hit_tokens=counted.from_disk,
                    hit_rate=rate(counted.from_disk),
                )
            )
        return tiers, total

    def layout(self) -> pb.LayoutStatus:
        """How the loaded model is spread over the ranks (empty with none loaded)."""
        pipeline = self._engine.pipeline
        loaded = pipeline.loaded
        if loaded is None:
            return pb.LayoutStatus()
        layout, choice = loaded.layout, loaded.layout.choice
        measured = (
            dict(
                chosen_at_load=True,
                all_sum_seconds=choice.all_sum_s,
                layer_seconds=choice.layer_s,
                pipeline_token_seconds=choice.pipeline_s,
                tensor_token_seconds=choice.tensor_s,
                pair_all_sum_seconds=choice.pair_sum_s,
                grid_token_seconds=choice.grid_s,
            )
            if choice is not None
            else {}
        )
        return pb.LayoutStatus(
            stages=layout.stages,
            tensor_parallel=layout.tensor,
            tensor_backend=split.backend if (split := pipeline.runner.tensor) else "",
            note=layout.note,
            **measured,
        )

    def steps(self) -> dict[str, StepCount]:
        """Forward steps round the ring so far, by kind (prefill, decode ...)."""
        return self._engine.stats.steps()

    def workers(self) -> dict[int, RankInfo]:
        """Every worker as its heartbeats last told rank 0 (none with one rank)."""
        return self._engine.pipeline.worker_stats()

    def lagging(self) -> LinkFailure | None:
        """The worker holding the oldest step far longer than it should, while serving."""
        return self._engine.pipeline.lagging() if self.state == "serving" else None

    def ring(self) -> Ring:
        """How the ring is run: what the live page shows beside the ranks."""
        engine, pipeline = self._engine, self._engine.pipeline
        hub, ring = pipeline.hub, pipeline.ring
        return Ring(
            hop_mode=ring.mode if ring is not None else "none (one rank)",
            heartbeat_timeout=pipeline.heartbeat_timeout,
            heartbeat_interval=hub.heartbeat_interval if hub is not None else 0.5,
            max_active=engine.config.max_active,
            max_queue=engine.config.max_queue,
        )

    def unhealthy(self) -> str:
        """Why the cluster cannot serve now ('' if it can): its loop stopped, it serves no
        model, or a worker is gone or silent (before the watchdog fails the cluster)."""
        engine, pipeline = self._engine, self._engine.pipeline
        if not engine.running:
            return "the engine's loop has stopped" + (f": {engine.error}" if engine.error else "")
        if engine.state != "serving":
            return not_serving(engine.state, engine.error)
        if pipeline.hub is not None:
            failure = pipeline.hub.failure(pipeline.heartbeat_timeout)
            if failure is not None:
                return f"a rank is down: {failure}"
        return ""

    def build(self, request: GenerationRequest, limit: Limit | None = None) -> Request:
        """Check and render a request; nothing reaches the engine yet. `limit`: a door's
        own cap on prompt + output (LocalAI's ContextSize), besides the cluster's."""
        tokenizer = self.tokenizer()
        prompt = self.render(request)
        params = generation.check_sampling(
            request,
            vocab_size=len(tokenizer),
            default_max_tokens=self._engine.config.default_max_tokens,
        )
        # One max_tokens policy for every door (api/budget.py): a ceiling, cut to what
        # the prompt leaves of the model's context, --max-context (what each rank checked
        # its memory for) and the door's limit; a prompt that leaves nothing is refused.
        context = self.context_length
        max_context = self._engine.config.memory.max_context
        bound = memory.sequence_bound(context, max_context) if max_context else 0
        limits = [
            Limit(context, "the model's context"),
            Limit(bound, "the most this cluster serves per sequence (--max-context)"),
            limit or Limit(0, ""),
        ]
        params.max_tokens = budget.cap(params.max_tokens, len(prompt.token_ids), limits)
        starts_in_reasoning = bool(request.messages) and self.markup().opens_think(prompt.text)
        request_id = request.request_id or uuid.uuid4().hex[:12]
        return Request(
            prompt_tokens=prompt.token_ids,
            params=params,
            request_id=request_id,
            tools=prompt.tools,
            parse_tools=prompt.tool_choice != "none",
            starts_in_reasoning=starts_in_reasoning,
            opens_tool_call=prompt.opens_tool_call,
            constraint=self._constraint(
                tokenizer, request, prompt, starts_in_reasoning, request_id
            ),
            pixel_values=prompt.pixel_values,  # rank 0 encodes them as the prefill starts
            cache_salt=request.cache_salt,
            image_keyed=prompt.cache_tokens,
        )

    def _constraint(
        self,
        tokenizer: Any,
        request: GenerationRequest,
        prompt: requests.Prompt,
        in_reasoning: bool,
        request_id: str,
    ) -> constraints.Constraint | None:
        """The grammar of `response_format` or `grammar`, or of the request's tool
        calls (tool_constraint: a forced call from its first token, a call the model
        opens under `auto` from its start marker), compiled; or None (free text). A
        forced call wins over a response format; a response format over `auto` calls."""
        wanted = constraints.request_grammar(request.response_format, request.grammar)
        if wanted is None and not prompt.tools:
            return None
        try:
            compiler = self._compiler_for(tokenizer)
        except requests.InvalidRequest:
            if wanted is None and not prompt.opens_tool_call:
                return None  # `auto` calls on a tokenizer llguidance cannot read: free
            raise
        if wanted is None or prompt.opens_tool_call:
            return tool_constraint(
                compiler, self.markup(), prompt, in_reasoning=in_reasoning, request_id=request_id
            )
        grammar, field = wanted
        return compiler.constraint(grammar, field, in_reasoning=in_reasoning)

    def _compiler_for(self, tokenizer: Any) -> constraints.Compiler:
        with self._compiler_lock:  # built once per loaded tokenizer (up to ~1 s)
            if self._compiler is None or self._compiler.tokenizer is not tokenizer:
                self._compiler = constraints.Compiler(tokenizer, self.markup())
            return self._compiler

    def render(self, request: GenerationRequest) -> requests.Prompt:
        """The prompt's text and tokens, as the model will see them."""
        rendered = requests.render_prompt(
            self.tokenizer(),
            request,
            markup=self.markup(),
            tool_fallback=self.tool_fallback,
        )
        if rendered.images:  # image tokens expanded, pixels ready (or InvalidRequest)
            pipeline = self._engine.pipeline
            loaded, shard = pipeline.loaded, pipeline.shard
            requests.encode_images(
                rendered, loaded.path if loaded else None, shard.config if shard else {}
            )
        return rendered

    def submit(
        self, request: GenerationRequest, api: str = "grpc", limit: Limit | None = None
    ) -> Request:
        """Start generating; iterate `.chunks()` (or `observed`), and `.cancel()` when the
        caller goes. A refusal is counted in the metrics under `api`, then raised."""
        try:
            return self._engine.submit(self.build(request, limit))
        except Exception as e:
            self.metrics.refused(api, error_kind(e))
            raise

    def observed(self, req: Request, api: str) -> Iterator[Chunk]:
        """`req`'s chunks, counted in the metrics; closing early cancels the request."""
        observer = self.metrics.observe(req, api)
        try:
            for chunk in req.chunks():
                observer.chunk(chunk)
                yield chunk
        except Exception as e:
            observer.failed(error_kind(e))
            raise
        finally:
            req.cancel()  # a no-op once finished; frees the slot if the caller went away
            observer.close()

    def load(self, model: str = "", layers: str = "") -> None:
        """Load `model` (or the last one again) over every rank; raise why not.

        Everything rank 0 can check is checked before the serving model is let go
        (`load_checks`): a bad path, a directory that is not a model or a share too
        big for rank 0 is refused with the old model still serving and its requests
        running. A load that fails later (a worker refuses its shard) has already
        released the old model, so that one is loaded again and the error says so.
        """
        spec = model or self.last_model
        layers_spec = layers if model or layers else self.last_layers
        if not spec:
            raise requests.InvalidRequest("model is required ('default' or a path)")
        if self._engine.state in ("draining", "stopping", "failed"):
            raise EngineError("unavailable", f"the cluster is {self._engine.state}")
        pipeline = self._engine.pipeline
        if (split := pipeline.tensor) is not None:  # (the start's rule for --layers)
            try:
                check_layout(
                    AUTO if split.auto else split.size, pipeline.world_size, layers=layers_spec
                )
            except TensorLayoutError as e:
                raise requests.InvalidRequest(str(e)) from e
        try:
            counts = model_layers(layers_spec, spec, pipeline.world_size)
        except ModelError as e:
            raise requests.InvalidRequest(str(e)) from e
        except ValueError as e:
            raise requests.InvalidRequest(f"layers: {e}") from e
        previous = pipeline.loaded
        serving = (previous.path, *previous.ranges[0]) if previous else None
        try:
            load_checks.check_loadable(
                spec, counts, pipeline.world_size, serving, stages=_stages(pipeline, counts)
            )
        except load_checks.DoesNotFit as e:
            log.warning("load of %r refused, %s still serves: %s", spec, _named(previous), e)
            raise EngineError("precondition", str(e)) from e
        except requests.InvalidRequest as e:
            log.warning("load of %r refused, %s still serves: %s", spec, _named(previous), e)
            raise
        log.info("loading %r in place of %s", spec, _named(previous))
        try:
            self._load(spec, counts)
        except ClusterFailure:
            raise  # the ring is broken: nothing can be loaded again
        except (EngineError, requests.InvalidRequest) as e:
            note = self._restore(previous)
            if not note:
                raise
            if isinstance(e, EngineError):
                raise EngineError(e.kind, f"{e}; {note}") from e
            raise requests.InvalidRequest(f"{e}; {note}") from e
        self.last_model, self.last_layers = spec, layers_spec

    def _restore(self, previous: Any) -> str:
        """After a load failed past the checks: load the model it replaced again.
        What to add to the load's error ('' when nothing was released)."""
        if previous is None or self._engine.state != "unloaded":
            return ""
        counts = [end - start for start, end in previous.ranges]
        log.warning("the load failed after %s was released; loading it again", previous.spec)
        try:
            self._load(previous.spec, counts)
        except Exception as e:  # noqa: BLE001 - reported with the load's own error
            log.error("%s could not be loaded again: %s", previous.spec, e)
            return (
                f"the previous model {previous.spec!r} had been released for this load and "
                f"could not be loaded again ({e}): `mlx-relay load --model "
                f"{previous.spec}` loads it"
            )
        return (
            f"the previous model {previous.spec!r} had been released for this load and serves again"
        )

    def _load(self, spec: str, counts: Any) -> None:
        """The engine's load, its failures as the doors report them."""
        try:
            loaded = self._engine.load(spec, counts).result()
        except ClusterFailure:
            raise
        except RankFailure as e:  # a worker refused its shard; the cluster still serves
            raise EngineError("precondition", str(e)) from e
        except (EngineError, requests.InvalidRequest):
            raise
        except Exception as e:  # noqa: BLE001 - the load failed; say why, keep serving
            raise EngineError("invalid" if isinstance(e, ValueError) else "internal", str(e)) from e
        proctitle.show_layers(*loaded.ranges[0])

    def free(self, shutdown: bool = False) -> str:
        """Free the model on every rank (CMD_SHUTDOWN stops them too); a message saying so."""
        message = self._engine.free(shutdown=shutdown).result()
        proctitle.show_layers(None)
        return message

    def status(self) -> pb.StatusResponse:
        """The cluster as the Status RPC (and `/v1/status`) shows it."""
        loaded = self.loaded
        active, queued = self.counts()
        parked, parked_tokens = self.cached_prompts()
        out = pb.StatusResponse(
            world_size=self.world_size,
            state=self.state,
            active_requests=active,
            queued_requests=queued,
            backend=self.backend,
            error=self.error,
            cached_prompts=parked,
            cached_prompt_tokens=parked_tokens,
        )
        if loaded:
            out.model = loaded.spec
            out.model_path = loaded.path
            out.num_layers = loaded.num_layers
        out.requests.extend(pb.RequestStatus(**row) for row in self._engine.scheduler.snapshot())
        out.speculation.CopyFrom(self.speculation())
        out.layout.CopyFrom(self.layout())
        out.prompt_store.CopyFrom(self.prompt_store())
        tiers, out.prompt_tokens = self.prompt_cache_tiers()
        out.prompt_cache_tiers.extend(tiers)
        out.ranks.append(_rank0_status(loaded))
        now = time.monotonic()
        for rank, info in sorted(self.workers().items()):
            start, end = loaded.ranges[rank] if loaded else (0, 0)
            out.ranks.append(
                pb.RankStatus(
                    rank=rank,
                    host=info.host,
                    pid=info.pid,
                    layer_start=start,
                    layer_end=end,
                    active_memory_bytes=info.stats.get("active_memory", 0),
                    peak_memory_bytes=info.stats.get("peak_memory", 0),
                    rss_bytes=info.stats.get("rss", 0),
                    free_memory_bytes=info.stats.get("free_memory", 0),
                    state=info.state,
                    last_seen_s=now - info.last_seen,
                    staging=_staging(info.staging),
                    versions=info.versions,
                )
            )
        return out


@dataclass(frozen=True)
class Ring:
    hop_mode: str  # how a hop is timed (--hop-mode), "none (one rank)" with one rank
    heartbeat_timeout: float  # a worker silent this long is gone
    heartbeat_interval: float
    max_active: int
    max_queue: int


def _stages(pipeline: Any, counts: list[int] | None) -> int:
    """The pipeline stages a load needs a layer range for, by the start's rule: one a
    rank, but a stage x tensor grid's stages hold their ranks' layers together."""
    split = pipeline.tensor
    if split is None or split.auto or counts is not None:  # (auto may choose a pipeline)
        return pipeline.world_size
    return split.stages


def _named(loaded: Any) -> str:
    return repr(loaded.spec) if loaded else "no model"


# What the cluster refuses or fails a request with; each door maps them to its statuses
# (error_kind), anything else being an internal error.
REFUSALS = (requests.InvalidRequest, EngineError, RankFailure)


def error_kind(e: BaseException) -> str:
    """The `EngineError` kind a door reports `e` as (invalid, unavailable, ...)."""
    if isinstance(e, requests.InvalidRequest):
        return "invalid"
    if isinstance(e, EngineError):
        return e.kind
    if isinstance(e, RankFailure):
        return "unavailable"
    return "internal"


def not_serving(state: str, error: str) -> str:
    """Why no request can run now, and what would change that."""
    if state == "unloaded":
        return (
            "no model is loaded (unloaded): `mlx-relay load` loads the last one again, "
            "`mlx-relay load --model PATH` another (the LoadModel RPC)"
        )
    if state in ("starting", "loading"):
        return f"no model is being served yet ({state}): `mlx-relay status --wait 60` waits"
    return f"no model is being served ({state}{': ' + error if error else ''})"


def _staging(report: dict[str, Any]) -> pb.RankStaging:
    """A worker's last staging report (worker/staging.py's StageProgress) as the RPC's."""
    return pb.RankStaging(
        state=str(report.get("state", "")),
        total_bytes=int(report.get("total", 0)),
        ready_bytes=int(report.get("ready", 0)),
        fetched_bytes=int(report.get("fetched", 0)),
        reused_bytes=int(report.get("reused", 0)),
        source=str(report.get("source", "")),
        cache=str(report.get("cache", "")),
        error=str(report.get("error", "")),
        seconds=float(report.get("seconds", 0.0)),
    )


def _rank0_status(loaded: Any) -> pb.RankStatus:
    stats = memory.stats()
    start, end = loaded.ranges[0] if loaded else (0, 0)
    return pb.RankStatus(
        rank=0,
        host=control.host_name(),
        pid=os.getpid(),
        layer_start=start,
        layer_end=end,
        active_memory_bytes=stats["active_memory"],
        peak_memory_bytes=stats["peak_memory"],
        rss_bytes=stats["rss"],
        free_memory_bytes=stats["free_memory"],
        state="coordinator",
        versions=control.versions(),
    )
