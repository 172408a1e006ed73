"""The soak: many concurrent clients for a while against a local cluster; every completed
request must equal the same request run alone, the cluster must go idle afterwards, and each
rank's resident memory must stay flat after the warm-up.

Shared by tests/test_soak.py (a short run) and bench/bench_soak.py (as long as asked, its
command line and the meaning of each check).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil

from mlx_relay.client.channel import client_channel
from mlx_relay.client.client import Client
from mlx_relay.launch.local import LocalCluster, free_ports
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.protocol import relay_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class SoakSettings:
    """What one soak runs: bench_soak's options, with its defaults."""

    model: str = ""  # a model directory ("": a tiny random llama made for the run)
    ranks: int = 2
    clients: int = 32
    seconds: float = 300
    warmup: float = 30  # resident memory is compared after this
    max_active: int = 8
    pool: int = 44  # distinct requests
    seed: int = 0
    rss_slack: float = 20.0  # MB of resident memory growth allowed
    solo_stream: bool = False  # the solo reference runs streamed
    # The soak goes on past `seconds` (for at most `overtime` more) until this many
    # requests completed and one was cut short (cancelled or disconnected): a count a
    # slow or busy machine also reaches, later, where a time alone would not.
    at_least: int = 0
    overtime: float = 300


SHORT = ["hi", "Once upon a time", "The capital of France is", "def add(a, b):"]
LONG = (
    "In the beginning the sea was calm and the ships sailed slowly along the coast, "
    "carrying grain and wine from one harbour to the next. "
) * 6
SAMPLERS: list[dict] = [
    {},  # greedy
    {"temperature": 0.8},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.7, "top_k": 20},
    {"temperature": 0.9, "min_p": 0.05},
    {"temperature": 1.0, "xtc_probability": 0.5, "xtc_threshold": 0.1},
    {"temperature": 0.6, "repetition_penalty": 1.3},
    {"temperature": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    {"temperature": 0.5, "logit_bias": {5: 2.0, 7: -5.0}},
    {"temperature": 0.9, "stop": ["e", "the"]},
    {"temperature": 0.7, "logprobs": True, "top_logprobs": 3},
]


def request_pool(size: int, rng: random.Random) -> list[pb.GenerateRequest]:
    """`size` distinct seeded requests covering every sampler, short and long prompts."""
    pool = []
    for i in range(size):
        sampler = dict(SAMPLERS[i % len(SAMPLERS)])
        bias = sampler.pop("logit_bias", {})
        params = pb.SamplingParams(
            max_tokens=rng.choice([8, 16, 32, 64]),
            seed=1000 + i,
            ignore_eos=rng.random() < 0.5,
            **sampler,
        )
        params.logit_bias.update(bias)
        text = rng.choice(SHORT) if rng.random() < 0.6 else LONG + rng.choice(SHORT)
        if rng.random() < 0.5:
            pool.append(pb.GenerateRequest(prompt=text, params=params))
        else:
            chat = [pb.ChatMessage(role="user", content=text)]
            pool.append(pb.GenerateRequest(messages=chat, params=params))
    return pool


def result_of(chunks) -> tuple:
    """What a request produced (streamed chunks or a unary response), comparable."""
    tokens: list[int] = []
    text = ""
    reason = ""
    for c in chunks:
        tokens += list(c.token_ids)
        text += c.text
        reason = c.finish_reason or reason
    return tuple(tokens), text, reason


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    completed: int = 0
    cancelled: int = 0
    disconnected: int = 0
    mismatches: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    tokens: int = 0

    def reached(self, count: int) -> bool:
        """`count` requests completed and one cut short (SoakSettings.at_least)."""
        with self.lock:
            cut = self.cancelled + self.disconnected
            return count <= 0 or (self.completed >= count and cut > 0)

    def error(self, what: str) -> None:
        with self.lock:
            self.errors[what] = self.errors.get(what, 0) + 1


def client_loop(
    address: str,
    pool: list[pb.GenerateRequest],
    solo: list[tuple],
    stop: threading.Event,
    tally: Tally,
    seed: int,
) -> None:
    rng = random.Random(seed)
    client = Client(address, timeout=300)
    try:
        while not stop.is_set():
            i = rng.randrange(len(pool))
            request = pool[i]
            action = rng.random()
            try:
                if action < 0.1:  # cancel a stream after a few chunks
                    call = client.stub.GenerateStream(request, timeout=300)
                    for n, _ in enumerate(call):
                        if n >= rng.randrange(1, 4):
                            break
                    call.cancel()
                    with tally.lock:
                        tally.cancelled += 1
                    continue
                if action < 0.15:  # the client's connection drops mid-stream
                    channel = client_channel(address)
                    call = pb_grpc.RelayStub(channel).GenerateStream(request, timeout=300)
                    next(iter(call), None)
                    channel.close()
                    with tally.lock:
                        tally.disconnected += 1
                    continue
                if action < 0.55:
                    got = result_of(client.stub.GenerateStream(request, timeout=300))
                else:
                    got = result_of([client.stub.Generate(request, timeout=300)])
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    tally.error(e.code().name)
                continue
            with tally.lock:
                tally.completed += 1
                tally.tokens += len(got[0])
                if got != solo[i]:
                    tally.mismatches.append(f"pool[{i}]: solo {solo[i]!r} soak {got!r}")
    finally:
        client.close()


def rss_sampler(pids: list[int], stop: threading.Event, every: float, out: list) -> None:
    procs = [psutil.Process(p) for p in pids]
    while not stop.wait(every):
        try:
            out.append((time.monotonic(), [p.memory_info().rss for p in procs]))
        except psutil.NoSuchProcess:
            return


def flat(samples: list[tuple[float, list[int]]], since: float, slack_mb: float) -> list[dict]:
    """Per rank: RSS at the start and end of the post-warm-up window, and if flat."""
    after = [s for t, s in samples if t >= since]
    if len(after) < 5:
        return []
    fifth = max(1, len(after) // 5)
    out = []
    for r in range(len(after[0])):
        first = statistics.mean(s[r] for s in after[:fifth]) / 1e6
        last = statistics.mean(s[r] for s in after[-fifth:]) / 1e6
        out.append(
            {
                "rank": r,
                "rss_first_mb": round(first, 1),
                "rss_last_mb": round(last, 1),
                "flat": last - first <= slack_mb,
            }
        )
    return out


def trend(samples: list[tuple[float, list[int]]], t0: float, every: float) -> list[list]:
    """[seconds since t0, RSS MB of each rank], one sample per `every` seconds."""
    out: list[list] = []
    for t, rss in samples:
        if not out or t - t0 - out[-1][0] >= every:
            out.append([round(t - t0), *(round(r / 1e6, 1) for r in rss)])
    return out


def wait_idle(client: Client, max_active: int, timeout: float = 60) -> pb.StatusResponse:
    deadline = time.monotonic() + timeout
    while True:
        status = client.status()
        idle = status.active_requests == 0 and status.queued_requests == 0
        if (idle and status.cached_prompts <= max_active) or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def soak(args: SoakSettings) -> dict:
    """Run the soak `args` describes; the report, its `checks` and `ok` (all checks held)."""
    workdir = Path(tempfile.mkdtemp(prefix="mlx-relay-soak-"))
    model = args.model
    if not model:
        from tiny_models import make_tiny_model

        model = str(make_tiny_model(workdir / "tiny", "llama", num_layers=4))
    address = f"127.0.0.1:{free_ports(1)[0]}"
    serve = ["--model", model, "--max-active", str(args.max_active)]
    serve += ["--max-queue", str(max(64, args.clients * 2))]
    cluster = LocalCluster(args.ranks, serve, grpc_address=address, log_dir=workdir / "logs")
    cluster.start()
    report: dict = {"model": model, "ranks": args.ranks, "clients": args.clients}
    try:
        cluster.wait_serving(300)
        rng = random.Random(args.seed)
        pool = request_pool(args.pool, rng)
        with Client(address, timeout=300) as client:
            t0 = time.monotonic()
            solo = []
            for r in pool:  # alone, one at a time: the reference (and the first warm-up)
                if args.solo_stream:
                    solo.append(result_of(client.stub.GenerateStream(r, timeout=300)))
                else:
                    solo.append(result_of([client.stub.Generate(r, timeout=300)]))
            report["solo_seconds"] = round(time.monotonic() - t0, 1)
            stop, tally, samples = threading.Event(), Tally(), []
            sampler_stop = threading.Event()
            sampler = threading.Thread(
                target=rss_sampler, args=(cluster_pids(cluster), sampler_stop, 1.0, samples)
            )
            sampler.start()
            started = time.monotonic()
            clients = [
                threading.Thread(
                    target=client_loop,
                    args=(address, pool, solo, stop, tally, args.seed * 1000 + c),
                )
                for c in range(args.clients)
            ]
            for t in clients:
                t.daemon = True  # Ctrl-C ends the soak early, still checked and reported
                t.start()
            try:
                stop.wait(args.seconds)
                until = started + args.seconds + args.overtime
                while not tally.reached(args.at_least) and time.monotonic() < until:
                    time.sleep(0.1)
            except KeyboardInterrupt:
                print("interrupted: stopping the clients", file=sys.stderr)
            stop.set()
            for t in clients:
                t.join(600)
            ran = time.monotonic() - started
            status = wait_idle(client, args.max_active)
            sampler_stop.set()
            sampler.join()
            memory = flat(samples, started + args.warmup, args.rss_slack)
            report.update(
                seconds=round(ran, 1),
                completed=tally.completed,
                cancelled=tally.cancelled,
                disconnected=tally.disconnected,
                errors=tally.errors,
                tokens=tally.tokens,
                tokens_per_s=round(tally.tokens / ran, 1),
                mismatches=len(tally.mismatches),
                mismatch_examples=tally.mismatches[:3],
                idle={
                    "active": status.active_requests,
                    "queued": status.queued_requests,
                    "cached_prompts": status.cached_prompts,
                    "state": status.state,
                },
                rss=memory,
                rss_trend_mb=trend(samples, started, every=max(10.0, ran / 20)),
            )
            checks = {
                "outputs_equal_solo": not tally.mismatches and tally.completed > 0,
                "no_errors": not tally.errors,
                "idle_after": status.active_requests == 0
                and status.queued_requests == 0
                and status.cached_prompts <= args.max_active
                and status.state == "serving",
                "rss_flat": bool(memory) and all(m["flat"] for m in memory),
                "ranks_alive": all(p.poll() is None for p in cluster.procs),
            }
            report["checks"] = checks
            report["ok"] = all(checks.values())
    finally:
        cluster.stop()
    return report


def cluster_pids(cluster: LocalCluster) -> list[int]:
    return [p.pid for p in cluster.procs]
