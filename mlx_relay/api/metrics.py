"""Prometheus metrics of every front door, in vLLM's naming style under `mlx_relay:`.

One observer per request sees the chunks as its door hands them on (`Cluster.observed`
for the gRPC doors, `http.common.Output` for HTTP), labelled by API, so every door is
measured the same way; `/metrics` on the HTTP door shows them all.
Running and waiting requests and parked prompt caches are read from the cluster at
scrape time, and so are step times: round the ring as rank 0 sees them, and each worker's
share as it reports it. Not measured: the transfer of each hop on its own (telling it from
a rank's compute would take one more wait on the device per hop).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mlx_relay.coordinator.output import Chunk
from mlx_relay.coordinator.sequence import Request

if TYPE_CHECKING:  # (the cluster builds its Metrics: no import at run time)
    from mlx_relay.api.cluster import Cluster

PREFIX = "mlx_relay:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
_LATENCY_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0)
_REQUEST_BUCKETS += (50.0, 60.0, 120.0, 240.0, 480.0, 960.0)

disable_created_metrics()  # `*_created` series double the output and tell nobody anything


class _ClusterGauges(Collector):
    """Gauges read from the cluster when scraped, so they are never stale."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    def collect(self) -> Iterator[GaugeMetricFamily]:
        cluster = self._cluster
        running, waiting = cluster.counts()
        parked, parked_tokens = cluster.cached_prompts()
        for name, doc, value in (
            ("num_requests_running", "Requests decoding or prefilling now.", running),
            ("num_requests_waiting", "Requests queued for a slot.", waiting),
            ("num_cached_prompts", "Finished requests whose KV caches wait for reuse.", parked),
            ("cached_prompt_tokens", "Tokens those parked caches hold.", parked_tokens),
        ):
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        yield GaugeMetricFamily(
            PREFIX + "engine_serving",
            "1 while the engine serves a model, else 0.",
            value=1 if cluster.state == "serving" and cluster.running else 0,
        )
        layout = cluster.layout()
        yield GaugeMetricFamily(
            PREFIX + "tensor_parallel",
            "Ranks splitting every layer of a stage (1: each rank a layer range; 0: no model).",
            value=layout.tensor_parallel,
        )
        yield GaugeMetricFamily(
            PREFIX + "pipeline_stages", "Pipeline stages (0: no model).", value=layout.stages
        )
        yield GaugeMetricFamily(
            PREFIX + "tensor_all_sum_seconds",
            "One all-sum of a token's hidden state over the tensor group, as "
            "--tensor-parallel auto measured it at load (0: not measured).",
            value=layout.all_sum_seconds,
        )
        yield GaugeMetricFamily(
            PREFIX + "tensor_pair_all_sum_seconds",
            "The slowest pair's all-sum of a token's hidden state, as --tensor-parallel auto "
            "measured it at load on 4 or more ranks for a grid of pairs (0: not measured).",
            value=layout.pair_all_sum_seconds,
        )
        yield from _step_timings(cluster)
        yield from _speculation(cluster)
        yield from _prompt_cache_tiers(cluster)
        yield from _prompt_store(cluster)


def _prompt_cache_tiers(cluster: Cluster) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The prompt cache by tier (ram: the parked slots; disk: --prompt-cache-dir): what
    each holds, and the prompt tokens each served, of every request and door."""
    tiers, prompt_tokens = cluster.prompt_cache_tiers()
    gauges = {
        "entries": "Parked sequences (ram) or stored blocks of 128 tokens (disk).",
        "tokens": "Tokens the tier holds.",
        "bytes": "Bytes the tier holds on the rank holding the most.",
        "budget_bytes": "The tier's byte budget (0: none bounds it).",
    }
    for field, doc in gauges.items():
        family = GaugeMetricFamily(PREFIX + f"prompt_cache_{field}", doc, labels=["tier"])
        for tier in tiers:
            family.add_metric([tier.tier], getattr(tier, field))
        yield family
    hits = CounterMetricFamily(
        PREFIX + "prompt_cache_hit_tokens",
        "Prompt tokens a cache tier served instead of a prefill (hit rate: over "
        "prompt_cache_prompt_tokens).",
        labels=["tier"],
    )
    for tier in tiers:
        hits.add_metric([tier.tier], tier.hit_tokens)
    yield hits
    yield CounterMetricFamily(
        PREFIX + "prompt_cache_prompt_tokens",
        "Prompt tokens of the requests whose prefill finished, every door's.",
        value=prompt_tokens,
    )


def _prompt_store(cluster: Cluster) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The prompt blocks kept on disk (--prompt-cache-dir; rank 0's store) and what
    requests got from them: the disk tier's hits beside the parked caches' (RAM)."""
    store = cluster.prompt_store()
    if not store.dir:
        return
    yield GaugeMetricFamily(
        PREFIX + "prompt_store_blocks", "Prompt blocks of 128 tokens on disk.", value=store.blocks
    )
    yield GaugeMetricFamily(
        PREFIX + "prompt_store_bytes", "Bytes of rank 0's prompt store.", value=store.bytes
    )
    for name, doc, value in (
        ("prompt_store_restores", "Prompts that started from stored blocks.", store.restores),
        (
            "prompt_store_restored_tokens",
            "Prompt tokens loaded from disk instead of prefilled.",
            store.restored_tokens,
        ),
        (
            "prompt_store_failed_restores",
            "Restores some rank could not do (the prompt was prefilled).",
            store.failed_restores,
        ),
    ):
        yield CounterMetricFamily(PREFIX + name, doc, value=value)


def _speculation(cluster: Cluster) -> Iterator[CounterMetricFamily]:
    """Speculative decoding's rounds, proposals and those kept (acceptance: the ratio of
    the last two; tokens per round: (rounds + kept) / rounds)."""
    spec = cluster.speculation()
    for name, doc, value in (
        ("spec_rounds", "Speculative verify steps round the ring.", spec.rounds),
        ("spec_draft_tokens", "Tokens speculative decoding proposed.", spec.draft_tokens),
        (
            "spec_accepted_draft_tokens",
            "Proposed tokens the model agreed with (emitted).",
            spec.accepted_draft_tokens,
        ),
    ):
        yield CounterMetricFamily(PREFIX + name, doc, value=value)


def _step_timings(cluster: Cluster) -> Iterator[CounterMetricFamily]:
    """Step times: round the whole ring as rank 0 sees them, and each worker's own share
    (from its header arriving to its output computed, receiving its input included, with
    ready hops; to its part queued on its device with eager hops, which never wait for
    the device), as the workers report them with their heartbeats."""
    ring_seconds = CounterMetricFamily(
        PREFIX + "ring_step_seconds",
        "Forward steps' time from launch on rank 0 to their result back on rank 0.",
        labels=["kind"],
    )
    ring_steps = CounterMetricFamily(
        PREFIX + "ring_steps", "Forward steps round the ring.", labels=["kind"]
    )
    for kind, steps in sorted(cluster.steps().items()):
        ring_steps.add_metric([kind], steps.steps)
        ring_seconds.add_metric([kind], steps.seconds)
    rank_seconds = CounterMetricFamily(
        PREFIX + "rank_step_seconds",
        "A worker's time per forward step, from its header arriving to its output computed "
        "(ready hops) or queued on its device (eager hops).",
        labels=["rank"],
    )
    rank_steps = CounterMetricFamily(
        PREFIX + "rank_steps", "Forward steps a worker took.", labels=["rank"]
    )
    for rank, info in sorted(cluster.workers().items()):
        if "steps" in info.stats:
            rank_steps.add_metric([str(rank)], info.stats["steps"])
            rank_seconds.add_metric([str(rank)], info.stats.get("step_seconds", 0.0))
    yield from (ring_steps, ring_seconds, rank_steps, rank_seconds)


class Metrics:
    """The registry the `/metrics` endpoint shows, and the observers that fill it."""

    def __init__(self, cluster: Cluster | None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "Requests by API and outcome (a finish reason, or the error kind that ended it).",
            ["api", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Between consecutive output chunks of one request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "From arrival to the last chunk.",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", registry=r
        )
        self.cache_queries = Counter(
            PREFIX + "prefix_cache_queries",
            "Prompt tokens looked up in the prompt cache.",
            registry=r,
        )
        self.cache_hits = Counter(
            PREFIX + "prefix_cache_hits",
            "Prompt tokens found in the prompt cache (not computed again).",
            registry=r,
        )
        self.cache_hit_requests = Counter(
            PREFIX + "prompt_cache_hit_requests",
            "Requests that reused an earlier request's KV cache.",
            registry=r,
        )
        if cluster is not None:  # (None: requests counted, no gauges)
            r.register(_ClusterGauges(cluster))

    def refused(self, api: str, kind: str) -> None:
        """A request refused before it reached the engine."""
        self.requests.labels(api, kind).inc()

    def observe(self, request: Request, api: str) -> Observer:
        return Observer(self, request, api)


class Observer:
    """One request's timings and counts, from its chunks as they reach the client."""

    def __init__(self, metrics: Metrics, request: Request, api: str) -> None:
        self.metrics = metrics
        self.api = api
        self.created = request.created  # perf_counter at arrival
        self.last: float | None = None
        self.outcome = ""

    def chunk(self, chunk: Chunk) -> None:
        now = time.perf_counter()
        m = self.metrics
        if chunk.token_ids:
            if self.last is None:
                m.ttft.observe(now - self.created)
            else:
                m.itl.observe(now - self.last)
            self.last = now
        if chunk.finish_reason is not None:
            self.outcome = chunk.finish_reason
            m.e2e.observe(now - self.created)
            usage = chunk.usage or {}
            m.prompt_tokens.inc(usage.get("prompt_tokens", 0))
            m.generation_tokens.inc(usage.get("completion_tokens", 0))
            m.cache_queries.inc(usage.get("prompt_tokens", 0))
            cached = usage.get("cached_tokens", 0)
            m.cache_hits.inc(cached)
            if cached:
                m.cache_hit_requests.inc()

    def failed(self, kind: str) -> None:
        self.outcome = self.outcome or kind

    def close(self) -> None:
        """The stream ended: count the outcome ('disconnected' if the client left first)."""
        self.metrics.requests.labels(self.api, self.outcome or "disconnected").inc()
