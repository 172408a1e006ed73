"""`mlx-relay serve`: what every rank runs (under `mlx.launch` or `mlx-relay local`).

Rank 0 becomes the coordinator; every other rank a worker. The side channel's
address is rank 0's address from the hostfile, or given explicitly.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import mlx.core as mx

from mlx_relay import proctitle, timeline
from mlx_relay.errors import UserError, add_log_level, debugging
from mlx_relay.launch import preflight
from mlx_relay.launch.lifeline import watch_launcher
from mlx_relay.protocol import control
from mlx_relay.protocol.exits import EXIT_CLUSTER_FAILED, EXIT_USAGE, report_fatal
from mlx_relay.protocol.rpc import DEFAULT_GRPC_ADDRESS

if TYPE_CHECKING:
    from mlx_relay.api.config import ServeConfig
    from mlx_relay.coordinator.speculation import SpecConfig
    from mlx_relay.model.memory import Plan
    from mlx_relay.transport.ring import Ring
    from mlx_relay.transport.tensor import TensorGroup

log = logging.getLogger("mlx_relay.serve")

DEFAULT_CONTROL_PORT = 50151


# The options of every rank's `serve` that the launchers take and pass on: `local` takes
# them as its own and gives them back to each rank with `serve_argv`; `launch` takes them
# after `--` and checks them with serve's own parser. One table, so an option added here
# reaches both launchers.
SERVE_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("--model", dict(default="default", help="'default' (embedded SmolLM2) or a path")),
    (
        "--layers",
        dict(
            default="",
            help="layers per rank, e.g. 10,12,8; auto: by each rank's free memory; balanced: "
            "equal work per rank, counting rank 0's LM head (the default); even: the same count each",
        ),
    ),
    ("--grpc-address", dict(default=DEFAULT_GRPC_ADDRESS, help="rank 0's gRPC address")),
    (
        "--localai-address",
        dict(
            default="",
            help="HOST:PORT: rank 0 also serves LocalAI's backend.Backend gRPC service there "
            "(token: $LOCALAI_GRPC_AUTH_TOKEN, else the cluster's)",
        ),
    ),
    (
        "--http-address",
        dict(
            default="",
            help="rank 0's HTTP address for the OpenAI, Anthropic and Ollama APIs, HOST:PORT "
            "or a bare PORT on loopback (default: off)",
        ),
    ),
    ("--max-active", dict(type=int, default=8, help="sequences decoding at once")),
    ("--max-queue", dict(type=int, default=64, help="requests waiting beyond that")),
    (
        "--steps-in-flight",
        dict(
            type=int,
            default=0,
            choices=range(9),
            metavar="{0..8}",
            help="steps round the ring at once, the decoding sequences split into as many "
            "groups (default 0: one a rank); more than the ranks measured slower on two "
            "H200s and on a CPU (smaller batches), left for devices not yet measured",
        ),
    ),
    (
        "--max-context",
        dict(
            type=int,
            default=0,
            help="most tokens (prompt + output) in one sequence: a sequence ends there, a "
            "prompt that leaves no room is refused; each rank checks at load that its weights "
            "and the caches of --max-active such sequences fit its memory (default 0: the "
            "model's context)",
        ),
    ),
    (
        "--kv-bits",
        dict(
            type=int,
            default=0,
            choices=(0, 2, 3, 4, 5, 6, 8),
            help="quantize the KV caches to this many bits (2, 3, 4, 5, 6 or 8), as mlx-lm's "
            "--kv-bits: smaller caches, slightly different tokens; every rank quantizes the "
            "same way (default 0: not quantized)",
        ),
    ),
    (
        "--kv-group-size",
        dict(
            type=int,
            default=64,
            choices=(32, 64, 128),
            help="with --kv-bits: values per quantization group (the head dim's divisor)",
        ),
    ),
    (
        "--quantized-kv-start",
        dict(
            type=int,
            default=5000,
            help="with --kv-bits: a sequence's caches are quantized once they hold this many "
            "tokens (mlx-lm's default 5000)",
        ),
    ),
    ("--prefill-chunk", dict(type=int, default=512, help="prompt tokens per step")),
    (
        "--warm-up",
        dict(
            default="auto",
            choices=["auto", "on", "off"],
            help="run a first prompt's steps (full --prefill-chunk chunks, a decode step, "
            "a verify step with --draft) on every rank at load, so the first request does "
            "not wait for kernels to compile; auto: on a GPU (Metal, CUDA), not on the CPU, "
            "which compiles nothing per shape",
        ),
    ),
    (
        "--draft",
        dict(
            default="off",
            choices=["off", "ngram", "model"],
            help="speculative decoding: ngram proposes tokens by prompt lookup (the text so "
            "far repeating itself: edits, summaries, code, RAG); model runs --draft-model on "
            "rank 0; each round's proposals go through the ranks as one step and rank 0 keeps "
            "those the model agrees with (the output is the model's own); default off, or "
            "model when --draft-model is given",
        ),
    ),
    (
        "--draft-model",
        dict(
            default="",
            help="a small model sharing the served model's tokenizer, held whole on rank 0 "
            "to propose tokens (mlx_lm.server's flag)",
        ),
    ),
    (
        "--num-draft-tokens",
        dict(
            type=int,
            default=4,
            help="the most tokens a speculative round proposes (mlx_lm.server's flag); each "
            "sequence proposes fewer while its proposals keep failing",
        ),
    ),
    (
        "--draft-fixed",
        dict(
            action="store_true",
            help="propose --num-draft-tokens every round, whatever the acceptance (the "
            "tokens then equal mlx-lm's speculative generator's for the same seed)",
        ),
    ),
    (
        "--draft-max-streams",
        dict(
            type=int,
            default=2,
            help="with more requests running than this, new ones decode in batched groups "
            "without speculation (a verify step runs one sequence)",
        ),
    ),
    (
        "--hop-mode",
        dict(
            default="auto",
            choices=["auto", "eager", "ready", "collective", "adaptive"],
            help="eager: each rank queues its part of a step as soon as rank 0 decides it, "
            "and keeps one core spinning on the receive while busy (fastest where cores are "
            "spare); ready: a rank starts its part once its input has arrived (nothing spins); "
            "collective (2 ranks): timed as eager, each payload an all-sum of the pair, over "
            "NCCL on the GPU's streams on CUDA; adaptive (2 ranks): collective for a step "
            "alone in flight (single-stream decode), for steps in flight together "
            "collective out of rank 0 and back in the header's message; auto: adaptive for "
            "2 ranks on CUDA GPUs of their own, else eager with the ring or jaccl backend on "
            "a rank with 4+ cores of its own (CPU or GPU), else ready",
        ),
    ),
    (
        "--stage-weights",
        dict(
            action="store_true",
            help="rank 0 ships each worker the files of its own layers, read from rank 0's "
            "model (workers need no copy of it): kept in each machine's cache "
            "($MLX_RELAY_CACHE/shards, else ~/.cache/mlx-relay/shards) by content, so a "
            "relaunch sends nothing and another split only the layers a worker lacks",
        ),
    ),
    (
        "--stage-keep-free",
        dict(
            type=lambda text: _size(text),
            default="1GB",
            metavar="SIZE",
            help="with --stage-weights: a worker refuses to stage where its disk would keep "
            "less free than this (default 1GB)",
        ),
    ),
    (
        "--tensor-parallel",
        dict(
            type=lambda text: _tensor_parallel(text),
            default=1,
            metavar="T",
            help="split every layer across T ranks (mlx-lm's model.shard: each rank keeps "
            "1/T of every projection, two all-sums a layer) instead of giving each rank a "
            "layer range; T = the number of ranks (one stage). Pays where the ranks share a "
            "fast link (NVLink, Thunderbolt 5 RDMA) and the model's layers are large; a "
            "family mlx-lm cannot shard runs as a pipeline, and status says why. auto: "
            "each load times the group's all-sum (on 4 or more ranks also each pair's, for "
            "a grid of pairs) and a decode step of the model's first layer, and splits "
            "only where that pays (status shows the figures)",
        ),
    ),
    (
        "--default-max-tokens",
        dict(type=int, default=256, help="max_tokens when a request has none"),
    ),
    (
        "--no-prompt-cache",
        dict(
            action="store_true",
            help="drop a finished request's KV caches instead of keeping them for a later "
            "prompt that starts the same way (kept by default, in the --max-active slots)",
        ),
    ),
    (
        "--no-tool-fallback",
        dict(
            action="store_true",
            help="refuse requests with tools for a model whose chat template ignores them "
            "(by default the tools are written into the system prompt, Hermes style, and "
            "<tool_call> answers parsed back: see text/tool_prompt.py)",
        ),
    ),
    (
        "--prompt-cache-tokens",
        dict(
            type=int,
            default=0,
            help="at most this many tokens in kept caches, oldest dropped first (0: no limit "
            "beyond the slots); each token costs 2 x layers x KV heads x head dim x dtype bytes",
        ),
    ),
    (
        "--prompt-cache-bytes",
        dict(
            type=lambda text: _size(text),
            default=0,
            help="at most this much memory (e.g. 8GB) in kept caches on each rank, oldest "
            "dropped first, at the loaded model's bytes per token on its rank's layers (0: "
            "no limit beyond the slots and --prompt-cache-tokens)",
        ),
    ),
    (
        "--prompt-cache-dir",
        dict(
            default="",
            metavar="DIR",
            help="also keep prompt caches on disk, each rank its own layers' in blocks of "
            "128 tokens under DIR (its own disk; '~' is each rank's home), least recently "
            "used out first: a prefix pushed out of the kept caches, or one from before a "
            "restart with the same model and split, is loaded instead of prefilled "
            "(default: off)",
        ),
    ),
    (
        "--prompt-cache-disk-bytes",
        dict(
            type=lambda text: _size(text),
            default="10GB",
            metavar="SIZE",
            help="with --prompt-cache-dir: the most each rank keeps there (default 10GB)",
        ),
    ),
    (
        "--heartbeat-timeout",
        dict(
            type=float,
            default=3.0,
            help="a rank silent this long on the side channel counts as failed (seconds)",
        ),
    ),
    (
        "--step-timeout",
        dict(
            type=float,
            default=30.0,
            help="a forward step may take this many seconds beyond 4 times what it should take "
            "at the cluster's measured pace (its tokens and context), counted from when it "
            "could start; past that the rank holding it is named and the cluster fails "
            "(0: never)",
        ),
    ),
    (
        "--drain-timeout",
        dict(
            type=float,
            default=30.0,
            help="on SIGTERM, how long running requests may take to finish (seconds)",
        ),
    ),
    (
        "--auth-token",
        dict(
            default=None,
            help="require `authorization: Bearer TOKEN` on every RPC (default: "
            "$MLX_RELAY_AUTH_TOKEN; prefer the variable, `ps` shows options)",
        ),
    ),
    ("--tls-cert", dict(default="", help="PEM certificate chain: serve gRPC over TLS")),
    ("--tls-key", dict(default="", help="PEM private key for --tls-cert")),
    (
        "--max-request-bytes",
        dict(
            type=int,
            default=4 * 1024 * 1024,
            help="larger gRPC requests are refused with RESOURCE_EXHAUSTED",
        ),
    ),
]
# Passed on another way: `local` gives each rank its gRPC address itself, and the auth
# token travels in the environment, never on a command line (`ps` shows those).
_NOT_ON_COMMAND_LINES = ("--grpc-address", "--auth-token")


def _size(text: str) -> int:
    """A size option's bytes ('8GB'), as argparse wants its type: an error it shows."""
    from mlx_relay.sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _tensor_parallel(text: str) -> int:
    """--tensor-parallel's value: ranks, or auto (transport/tensor.py's AUTO)."""
    from mlx_relay.transport.tensor import parse_tensor_parallel

    try:
        return parse_tensor_parallel(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _argv_value(flag: str, value: Any) -> str:
    """An option's parsed value as its command line gives it again."""
    if flag == "--tensor-parallel" and value == 0:  # (AUTO)
        return "auto"
    return str(value)


def add_serve_options(p: argparse.ArgumentParser) -> None:
    """Options shared by `serve` and the launchers that pass them through."""
    for flag, kwargs in SERVE_OPTIONS:
        p.add_argument(flag, **kwargs)


def serve_argv(args: argparse.Namespace) -> list[str]:
    """`args`' serve options (and log level) as `serve` arguments, for a launcher's ranks.

    Empty values are left out (serve's defaults are the same), flags appear when set.
    """
    out: list[str] = []
    for flag, kwargs in SERVE_OPTIONS:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if flag in _NOT_ON_COMMAND_LINES or value is None or value == "" or value is False:
            continue
        out += [flag] if kwargs.get("action") == "store_true" else [flag, _argv_value(flag, value)]
    return [*out, "--log-level", args.log_level]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run one rank of a cluster (what mlx.launch starts)",
        epilog=f"Environment: {control.SECRET_ENV} (side-channel secret, set by the launcher), "
        "MLX_RELAY_AUTH_TOKEN (gRPC bearer token), MLX_RELAY_MEMORY_LIMIT (cap on the memory "
        "this rank may use for its shard and its caches, e.g. 8GB; default: the memory free at load time).",
    )
    add_serve_options(p)
    p.add_argument("--backend", default="any", help="mx.distributed backend: any, ring, mpi, jaccl")
    p.add_argument(
        "--control-address",
        default="",
        help=f"rank 0's side channel, tcp://host:port (default: rank 0's host, port {DEFAULT_CONTROL_PORT})",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=120.0,
        help="rank 0: how long every worker may take to say hello (seconds)",
    )
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    add_log_level(p)
    p.set_defaults(func=run)


def rank_hosts(size: int) -> list[str]:
    """Each rank's address as the backend knows it (ring hostfile), else loopback."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and os.path.exists(hostfile):
        with open(hostfile) as f:
            text = f.read().strip()
        hosts = json.loads(text) if text else []
        if isinstance(hosts, list) and len(hosts) == size and all(hosts):
            return [entry[0].rsplit(":", 1)[0] for entry in hosts]
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return [coordinator.rsplit(":", 1)[0]] + ["127.0.0.1"] * (size - 1)
    return ["127.0.0.1"] * size


def control_endpoint(args: argparse.Namespace, hosts: list[str]) -> str:
    return (
        args.control_address
        or os.environ.get(control.CONTROL_ENV)
        or f"tcp://{hosts[0]}:{DEFAULT_CONTROL_PORT}"
    )


def run(args: argparse.Namespace) -> int:
    """One rank, from start to exit; anything unexpected is its last line, not a traceback."""
    watch_launcher()  # a rank never outlives the launcher that started it
    proctitle.name_rank(_rank_before_init())
    try:
        return _serve(args)
    except Exception as e:  # noqa: BLE001 - a rank's last words, for its launcher
        log.debug("rank failed", exc_info=True)
        report_fatal(_rank_before_init(), f"{type(e).__name__}: {e}")
        if debugging(args):
            raise
        return 1


def _serve(args: argparse.Namespace) -> int:
    facts = None
    # (--stage-weights: a worker's model comes from rank 0 and is never looked for here)
    shipped = args.stage_weights and _rank_before_init() not in (0, "?")
    if args.model and not shipped:
        # Before joining the ring: a rank without the model leaves at once, and its
        # launcher stops the rest, instead of every rank waiting for it.
        try:
            facts = preflight.check_model(args.model)
        except UserError as e:
            return _fatal(_rank_before_init(), e)
    group = mx.distributed.init(backend=args.backend) if _distributed() else None
    rank = group.rank() if group else 0
    size = group.size() if group else 1
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    proctitle.name_rank(rank, size, address=args.grpc_address if rank == 0 else "")
    timeline.start(rank)  # (MLX_RELAY_TIMELINE: each rank's hot-path events, for profiling)
    from mlx_relay.model import memory

    # What each load checks to fit, and how rank 0's loads quantize the KV caches.
    plan = memory_plan(args)
    memory.configure(plan)
    layer_counts = None
    if facts is not None:
        try:
            from mlx_relay.transport.tensor import stage_count

            # (a grid's stages need a layer each; --layers with a split: refused below)
            stages = size if args.layers else stage_count(args.tensor_parallel, size)
            layer_counts = preflight.check_split(facts, stages, args.layers)
        except UserError as e:
            return _fatal(rank, e)

    from mlx_relay.transport.collective import gpu_tags, on_gpus_of_their_own, payload_groups
    from mlx_relay.transport.doorbell import Doorbell, DoorbellError, doorbell_endpoints
    from mlx_relay.transport.ring import AUTO, PAIRED_MODES, Ring, choose_hop_mode, fences_here
    from mlx_relay.transport.tensor import AUTO as TENSOR_AUTO
    from mlx_relay.transport.tensor import (
        TensorLayoutError,
        check_layout,
        group_size,
        tensor_group,
    )

    secret = control.cluster_secret()
    hosts = rank_hosts(size)
    ring = None
    tensor = None
    try:
        check_layout(args.tensor_parallel, size, args.hop_mode, args.layers)
    except TensorLayoutError as e:
        return _fatal(rank, UserError(str(e)))
    if size > 1:
        # (every rank asks once, over the ring, whose GPU each other one has: on CUDA
        # GPUs of their own, each neighbouring pair hops over NCCL, or the tensor group
        # all-sums over it)
        grouped = group_size(args.tensor_parallel, size) > 1
        # (--tensor-parallel auto: the hops a pipeline would have; a split is then chosen
        # only where they carry headers alone, see below)
        split = grouped and args.tensor_parallel != TENSOR_AUTO
        paired = args.hop_mode in (AUTO, *PAIRED_MODES) and not split
        tags = gpu_tags(group) if paired or grouped else []
        backend = _backend_in_use(args.backend)
        mode = choose_hop_mode(
            args.hop_mode,
            backend,
            cores=_cores(),
            ranks_here=hosts.count(hosts[rank]),
            gpu_pair=on_gpus_of_their_own(tags) and not split,
        )
        try:
            doorbell = Doorbell(rank, size, doorbell_endpoints(size, hosts), secret)
        except DoorbellError as e:
            return _fatal(rank, UserError(str(e)))
        try:
            payloads = payload_groups(group, hosts[0], tags) if mode in PAIRED_MODES else None
            ring = Ring(group, doorbell, mode, payloads=payloads, fences=fences_here(backend))
            tensor = tensor_group(group, args.tensor_parallel, hosts[0], tags, backend)
        except ValueError as e:
            return _fatal(rank, UserError(str(e)))
        if tensor is not None and tensor.auto and mode in PAIRED_MODES:
            tensor.why_not = (
                f"{mode} hops pair the ranks to carry payloads, which a split does not "
                f"send: start with --hop-mode eager or ready to let auto split"
            )
        if tensor is not None:
            log.info("rank %d: tensor group of %d over %s", rank, tensor.size, tensor.backend)
        log.info(
            "rank %d: %s hops%s%s%s",
            rank,
            mode,
            ", settled receives" if ring.settles else "",
            ", fenced shape changes" if ring.fences else "",
            f", payloads up to {ring.inline_max:,} bytes inline" if not ring.eager else "",
        )
    endpoint = control_endpoint(args, hosts)
    if rank == 0:
        return _run_rank0(args, plan, ring, tensor, endpoint, secret, layer_counts)
    return _run_worker(args, ring, tensor, endpoint, secret, rank)


def _run_rank0(
    args: argparse.Namespace,
    plan: Plan,
    ring: Ring | None,
    tensor: TensorGroup | None,
    endpoint: str,
    secret: bytes,
    layer_counts: list[int] | str | None,
) -> NoReturn:
    from mlx_relay.api import server
    from mlx_relay.transport.hub import ControlHub

    try:  # (the draft model is rank 0's alone: the other machines need not have it)
        config = serve_config(args, plan, layer_counts)
        if args.draft_model:
            preflight.check_model(args.draft_model)
    except (UserError, ValueError) as e:
        _leave(_fatal(0, e))

    size = ring.size if ring else 1
    hub = ControlHub(endpoint, size, secret) if ring else None
    log.info("rank 0 of %d; side channel %s", size, endpoint if ring else "(none)")
    code = server.run(config, ring, hub, tensor)
    if code == EXIT_CLUSTER_FAILED:
        # The engine thread may still be stuck in a collective with a dead rank;
        # nothing is left to clean up, so do not wait for it at exit.
        logging.shutdown()
        os._exit(code)
    _mpi_finalize(args.backend, code)
    _leave(code)


def _run_worker(
    args: argparse.Namespace,
    ring: Ring | None,
    tensor: TensorGroup | None,
    endpoint: str,
    secret: bytes,
    rank: int,
) -> NoReturn:
    from mlx_relay.model import memory
    from mlx_relay.transport.link import ControlLink, rank0_patience
    from mlx_relay.worker.loop import Worker

    worker: Worker | None = None

    def stats() -> dict:
        return {**memory.stats(), **(worker.timings() if worker else {})}

    link = ControlLink(
        endpoint, rank, secret, rank0_timeout=rank0_patience(args.heartbeat_timeout), stats=stats
    )
    link.hello()
    try:
        worker = Worker(ring, link, tensor)
        worker.run()
    finally:
        link.close()
    _mpi_finalize(args.backend, 0)
    _leave(0)


def memory_plan(args: argparse.Namespace) -> Plan:
    """What every rank's loads check to fit, and how they quantize the KV caches."""
    from mlx_relay.model.memory import Plan

    return Plan(
        args.max_active,
        args.max_context,
        args.kv_bits or 0,
        args.kv_group_size,
        args.quantized_kv_start,
    )


def spec_config(args: argparse.Namespace) -> SpecConfig | None:
    """Speculative decoding as the serve options ask (None: off; ValueError: options
    that do not go together)."""
    from mlx_relay.coordinator.speculation import SpecConfig

    source = "model" if args.draft_model and args.draft == "off" else args.draft
    if source == "off":
        return None
    return SpecConfig(
        source,
        num_draft_tokens=args.num_draft_tokens,
        draft_model=args.draft_model,
        adaptive=not args.draft_fixed,
        max_streams=args.draft_max_streams,
    )


def serve_config(
    args: argparse.Namespace, plan: Plan, layer_counts: list[int] | str | None = None
) -> ServeConfig:
    """Rank 0's configuration, built once from its command line (`plan`: memory_plan's,
    which every rank was given; `layer_counts`: the split as checked, or "auto")."""
    from mlx_relay.api.config import ServeConfig
    from mlx_relay.coordinator.config import EngineConfig

    engine = EngineConfig(
        max_active=args.max_active,
        max_queue=args.max_queue,
        prefill_chunk=args.prefill_chunk,
        default_max_tokens=args.default_max_tokens,
        prompt_cache=not args.no_prompt_cache,
        prompt_cache_tokens=args.prompt_cache_tokens,
        prompt_cache_bytes=args.prompt_cache_bytes,
        speculation=spec_config(args),
        warm_up=args.warm_up,
        memory=plan,
    )
    return ServeConfig(
        engine=engine,
        model=args.model,
        layers=args.layers,
        layer_counts=layer_counts,
        backend=args.backend,
        grpc_address=args.grpc_address,
        localai_address=args.localai_address,
        http_address=args.http_address,
        auth_token=args.auth_token,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        max_request_bytes=args.max_request_bytes,
        tool_fallback=not args.no_tool_fallback,
        heartbeat_timeout=args.heartbeat_timeout,
        step_timeout=args.step_timeout,
        steps_in_flight=args.steps_in_flight,
        stage_weights=args.stage_weights,
        stage_keep_free=args.stage_keep_free,
        prompt_store=(
            {"dir": args.prompt_cache_dir, "budget": args.prompt_cache_disk_bytes}
            if args.prompt_cache_dir and not args.no_prompt_cache
            else None
        ),
        startup_timeout=args.startup_timeout,
        drain_timeout=args.drain_timeout,
        shutdown_timeout=args.shutdown_timeout,
    )


def _leave(code: int) -> NoReturn:
    """Exit once this rank's own shutdown is done, without the interpreter's teardown.

    By now the model is freed, the doors and the side channel are closed and every rank
    was told to go. What is left is Python freeing transformers', grpc's, mlx-lm's and
    MLX's modules and objects one by one: a few tenths of a second of CPU per rank
    (1-2 s on a busy machine) that every stop, and every cluster a test starts, waited
    for. The exit handlers still run (logging's last flush, the timeline's events);
    ZeroMQ never flushes at exit anyway (pyzmq leaves its context alone then).
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fatal(rank: int | str, error: Exception) -> int:
    """Stop before serving for a reason the user can fix: one line, the launcher's to repeat."""
    report_fatal(rank, str(error))
    return EXIT_USAGE


def _rank_before_init() -> int | str:
    """This rank's number as its launcher set it, before mx.distributed says so."""
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0 if not _distributed() else "?"


def _backend_in_use(requested: str) -> str:
    """The backend `mx.distributed.init(backend=requested)` joined (MLX does not say)."""
    if requested != "any":
        return requested
    if "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ:
        return "mpi"
    if "MLX_JACCL_COORDINATOR" in os.environ:  # (mlx.launch sets it for jaccl, and only then)
        return "jaccl"
    return "ring"


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _distributed() -> bool:
    """Started as one of several ranks (mlx.launch, mpirun or mlx-relay local)?"""
    env = os.environ
    return any(
        k in env for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MLX_JACCL_COORDINATOR")
    )


def _mpi_finalize(backend: str, code: int) -> None:
    """After a clean shutdown under mpirun: MPI_Finalize (through mpi4py, the `mpi` extra), exit.

    MLX's mpi backend finalizes only from a C++ static destructor at process exit, which
    for a serving rank (its threads, grpc, zmq) comes too late for mpirun: it reports the
    clean exit as a failure. So finalize here, then leave without running destructors
    (MLX's would finalize a second time, which MPI aborts). mpi4py must not initialise
    MPI itself: MLX already has.
    """
    if backend not in ("mpi", "any") or "OMPI_COMM_WORLD_RANK" not in os.environ:
        return
    if code != 0:  # a failed cluster: a dead peer inside a collective can hold MPI_Finalize
        return  # (seen: rank 0 of a 4-rank grid, a peer killed, still there after 60 s)
    try:
        import mpi4py

        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
    except ImportError:
        return
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
