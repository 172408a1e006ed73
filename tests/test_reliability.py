"""Liveness, failures and trust, with real rank processes: a cluster never hangs and says
what broke.

Every wait here is bounded. The detection times asserted are the ones the issue asks
for; the measured ones are printed (run with -s) and recorded in RELIABILITY.md.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest
import zmq
from conftest import RunningCluster, start_cluster, stop_cluster
from launching import rank_processes
from oracle import mlx_lm_tokens, raw_prompt_tokens
from support import HOST, LONG, assert_names, error_of, stream_started
from tiny_models import make_tiny_model

from mlx_relay.api.server import watchdog
from mlx_relay.client.client import Client, wait_serving
from mlx_relay.coordinator.config import EngineConfig
from mlx_relay.coordinator.engine import Engine
from mlx_relay.coordinator.pipeline import Pipeline
from mlx_relay.launch.local import free_ports
from mlx_relay.launch.supervise import Supervisor, describe_exit, run_with_restarts
from mlx_relay.model.memory import shard_nbytes
from mlx_relay.protocol import control
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.protocol.exits import EXIT_CLUSTER_FAILED, EXIT_RANK0_SILENT, EXIT_RANK_FAILED
from mlx_relay.transport.doorbell import Doorbell, DoorbellError, DoorbellTimeout, NeighbourGone
from mlx_relay.transport.droplog import WINDOW_ENV, window_s
from mlx_relay.transport.hub import ControlHub
from mlx_relay.transport.link import rank0_patience

pytestmark = pytest.mark.cluster

HEARTBEAT_TIMEOUT = 3.0  # the default of --heartbeat-timeout


@pytest.fixture
def clusters(tmp_path):
    started: list[RunningCluster] = []

    def make(model: Path, n: int, *extra: str, **cluster: object) -> RunningCluster:
        log_dir = tmp_path / f"cluster{len(started)}"
        running = start_cluster(model, n, log_dir, *extra, timeout=120, **cluster)
        started.append(running)
        return running

    yield make
    for running in started:
        for p in running.cluster.procs:  # a test may leave a rank stopped on purpose
            p.send_signal(signal.SIGCONT)  # (none to one that has exited, even just now)
        stop_cluster(running)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama-4"), "llama", num_layers=4)


def _wait_exit(procs: list, timeout: float, t0: float | None = None) -> list[float]:
    """Seconds from `t0` (now) until each process exited; all must within `timeout`."""
    t0 = time.monotonic() if t0 is None else t0
    out = []
    for p in procs:
        left = max(0.0, timeout - (time.monotonic() - t0))
        try:
            p.wait(left)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pid {p.pid} still running after {timeout:.1f} s") from None
        out.append(time.monotonic() - t0)
    return out


# --- supervision (plain processes: fast) ---------------------------------------------


def _proc(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_exit_codes_are_described():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "exited with code 3 (the cluster failed)"
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(None) == "running"


def test_supervisor_names_the_cause_not_the_ranks_that_followed_it():
    sleeper = "import time; time.sleep(600)"
    # Rank 0 follows when told (a line on its stdin), rank 1 is killed first: the order is
    # the test's, never the children's start-up times'.
    follower = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); raise SystemExit(3)"],
        stdin=subprocess.PIPE,
        text=True,
    )
    procs = [follower, _proc(sleeper), _proc(sleeper)]
    sup = Supervisor(procs, ["a", "b", "c"])
    procs[1].kill()
    deadline = time.monotonic() + 60
    while sup.first_failure() is None:
        assert time.monotonic() < deadline, "the kill of rank 1 was not seen within 60 s"
        time.sleep(0.05)
    follower.stdin.write("go\n")
    follower.stdin.close()
    assert follower.wait(60) == 3
    sup.poll()  # (rank 0's exit seen too; the cause must not change)
    failure = sup.first_failure()
    assert str(failure) == "rank 1 (b) killed by SIGKILL" and failure.signal_name == "SIGKILL"
    assert sup.stop(timeout=5) == [3, -9, -signal.SIGTERM]


def test_supervisor_prefers_a_cause_over_a_consequence_seen_at_the_same_time():
    procs = [_proc("raise SystemExit(3)"), _proc("raise SystemExit(75)"), _proc("1/0")]
    for p in procs:
        p.wait(10)
    assert str(Supervisor(procs).first_failure()) == "rank 2 exited with code 1"


def test_supervisor_stop_escalates_to_sigkill():
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ignoring', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    # Wait on the child's own word that it ignores SIGTERM (a deadline: readline blocks).
    ready, _, _ = select.select([stubborn.stdout], [], [], 120)
    assert ready and stubborn.stdout.readline() == "ignoring\n"
    t0 = time.monotonic()
    assert Supervisor([stubborn]).stop(timeout=1.0) == [-signal.SIGKILL]
    # (escalated, not waited out: the child would sleep 600 s)
    assert time.monotonic() - t0 < 120


def test_restarts_are_bounded_and_reported():
    starts: list[int] = []
    lines: list[str] = []

    def start_one() -> Supervisor:
        starts.append(1)
        return Supervisor([_proc("raise SystemExit(7)")], ["h"])

    code = run_with_restarts(start_one, 2, report=lines.append, stop_timeout=5)
    assert code == EXIT_RANK_FAILED and len(starts) == 3
    assert lines[0] == "rank 0 (h) exited with code 7; the cluster was stopped; restart 1 of 2"
    assert lines[-1] == "rank 0 (h) exited with code 7; the cluster was stopped (no restart left)"


def test_a_start_that_raises_is_a_failure_and_is_restarted():
    lines: list[str] = []
    attempts: list[int] = []

    def start_one() -> Supervisor:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("rank 1 (h) never said hello")
        return Supervisor([_proc("pass")])

    assert run_with_restarts(start_one, 1, report=lines.append, stop_timeout=5) == 0
    assert lines == ["rank 1 (h) never said hello; the cluster was stopped; restart 1 of 1"]


@pytest.mark.parametrize("launcher", [["local"], ["launch", "--hostfile", "h.json"]])
def test_every_launcher_spells_the_restart_option_restarts(launcher, capsys):
    from mlx_relay.cli import build_parser

    assert build_parser().parse_args([*launcher, "--restarts", "4"]).restarts == 4
    assert build_parser().parse_args(launcher).restarts == 0
    assert "deprecated" not in capsys.readouterr().err
    # The old spelling still works, and says which one to use.
    assert build_parser().parse_args([*launcher, "--restart", "2"]).restarts == 2
    err = capsys.readouterr().err
    assert "--restart is deprecated; use --restarts" in err, err


# --- the side channel ----------------------------------------------------------------


def test_the_drop_summary_window_comes_from_the_environment(monkeypatch):
    for value, seconds in (("2", 2.0), ("0.5", 0.5), ("", 10.0), ("-1", 10.0), ("x", 10.0)):
        monkeypatch.setenv(WINDOW_ENV, value)
        assert window_s() == seconds, value


def test_side_channel_drops_and_logs_a_message_with_a_wrong_secret(caplog):
    port = free_ports(1)[0]
    hub = ControlHub(f"tcp://127.0.0.1:{port}", world_size=2, secret=b"right")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"rank1-cmd")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        with caplog.at_level("WARNING", logger="mlx_relay.sidechannel"):
            forged = {"rank": 1, "host": "evil", "pid": 1}
            sock.send_multipart(control.encode(control.HELLO, forged, b"wrong"))
            assert hub.wait_for(lambda: hub.rejected == 1, timeout=5)
            assert 1 not in hub.ranks and hub.wait_for_hello(0.2) == [1]
            # The same message signed with the cluster's secret is taken.
            sock.send_multipart(control.encode(control.HELLO, forged, b"right"))
            assert hub.wait_for_hello(5) == []
        assert any("signature does not match" in r.getMessage() for r in caplog.records)
        assert hub.snapshot()[1].host == "evil" and hub.rejected == 1
    finally:
        sock.close(0)
        hub.close()


def test_the_watchdog_watches_from_before_the_engine_starts():
    """Rank 0's watchdog fails the cluster, naming the rank, when a worker falls silent,
    whatever the engine thread does; started before that thread (rank 0's main thread
    starts the watchdog first), it used to leave at once where it looked before the
    engine ran, so a rank killed later went unnamed while the engine waited inside MLX
    (CI, three test workers beside a busy core: a stream ended DEADLINE_EXCEEDED, with no
    watchdog line in rank 0's log). Here the engine never starts at all: a worker says
    hello, then nothing."""
    port = free_ports(1)[0]
    hub = ControlHub(f"tcp://127.0.0.1:{port}", world_size=2, secret=b"k")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"rank1-cmd")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    engine = Engine(Pipeline(None, None), EngineConfig())
    try:
        sock.send_multipart(control.encode(control.HELLO, {"rank": 1, "host": "mac-b"}, b"k"))
        assert hub.wait_for_hello(5) == []
        watching = threading.Thread(target=watchdog, args=(engine, hub, 0.5), daemon=True)
        watching.start()
        watching.join(timeout=30)
        assert not watching.is_alive()
        assert engine.state == "failed", engine.state
        assert "rank 1 (mac-b)" in engine.error and "no heartbeat" in engine.error, engine.error
    finally:
        sock.close(0)
        hub.close()


def test_doorbells_take_their_neighbour_drop_strangers_then_stop_listening(caplog):
    """A stranger that reaches a doorbell first (junk, or a hello signed with another
    secret) is dropped and logged; the neighbour's signed hello is taken; headers flow
    both ways; the port then takes no connection; a neighbour that closes is reported as a
    broken connection, not waited on."""
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    bells: dict[int, Doorbell] = {}
    threads = [
        threading.Thread(target=lambda r=r: bells.update({r: Doorbell(r, 2, endpoints, b"k")}))
        for r in (0, 1)
    ]
    threads[1].start()  # rank 1 listens, and waits for rank 0 to
    port = int(endpoints[1].rsplit(":", 1)[1])
    strangers = []
    deadline = time.monotonic() + 10
    while len(strangers) < 2:
        try:
            strangers.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    strangers[0].sendall(b"\xff" * 64)  # (a length no message has)
    stranger = Doorbell.__new__(Doorbell)  # (its framing, another secret)
    stranger.secret = b"guessed"
    strangers[1].sendall(stranger._frame(b"doorbell 0->1"))
    with caplog.at_level("WARNING", logger="mlx_relay.doorbell"):
        threads[0].start()
        for t in threads:
            t.join(30)
        bells[0].ring(b"step 1")
        assert bells[1].wait(30) == b"step 1"  # (bounds against a hang)
        bells[1].ring(b"back")
        assert bells[0].wait(30) == b"back"
        with pytest.raises(DoorbellTimeout):
            bells[0].wait(0.05)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
        bells[1].dropped.flush()
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert dropped and all("rank 1's doorbell" in m for m in dropped), dropped
    for s in strangers:
        s.close()
    bells[0].close()
    with pytest.raises(NeighbourGone, match="connection"):
        bells[1].wait(30)
    bells[1].close()


def test_a_doorbell_whose_neighbour_never_comes_says_so():
    endpoints = [f"tcp://127.0.0.1:{p}" for p in free_ports(2)]
    with pytest.raises(DoorbellError, match="took no connection within"):
        Doorbell(0, 2, endpoints, b"k", timeout=0.3)


def _flood(endpoint: str, kind: int, messages: int, identity: bytes | None = None) -> None:
    """`messages` junk zmq messages of every shape to `endpoint`, from one socket."""
    sock = zmq.Context.instance().socket(kind)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    shapes = [
        [os.urandom(16)],
        [b"{}", b"not a signature"],
        control.encode(control.BYE, {"rank": 1}, b"guessed"),
        [b"a", b"b", b"c"],
    ]
    for i in range(messages):
        sock.send_multipart(shapes[i % len(shapes)])
    sock.close()  # lingers until the messages are out


def _raw_junk(endpoint: str, connections: int = 20) -> None:
    """Bytes that are no protocol at all (no zmq greeting, no HTTP/2 preface)."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    for _ in range(connections):
        try:
            with socket.create_connection((host, int(port)), timeout=2) as s:
                s.sendall(os.urandom(4096))
        except OSError:
            pass  # the server hung up on it: that is what it should do


def test_junk_on_every_port_is_dropped_quietly_and_the_cluster_serves(model, clusters):
    """2,000 malformed messages on the side channel, raw junk on every port (gRPC and HTTP
    included): a handful of log lines, no rank hurt, tokens unchanged. The doorbells take
    no connection at all once the ring is up."""
    http = f"127.0.0.1:{free_ports(1)[0]}"
    # (summaries every 3 s instead of 10, so that the counts below come sooner; the junk
    # below takes well under 1 s here, so each source still gets one summary line)
    running = clusters(model, 2, "--http-address", http, env={WINDOW_ENV: "3"})
    client = running.client
    request = pb.GenerateRequest(prompt="Once upon a time", params=pb.SamplingParams(max_tokens=12))
    before = client.generate(request).token_ids
    stream = client.stub.GenerateStream(request, timeout=120)  # in flight during the flood
    cluster = running.cluster
    _flood(cluster.control_endpoint, zmq.DEALER, 2000, identity=b"rank1-x")
    for endpoint in [cluster.control_endpoint, cluster.grpc_address]:
        _raw_junk(endpoint if "//" in endpoint else f"tcp://{endpoint}")
    for endpoint in cluster.doorbell_endpoints:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=2).close()
    _raw_junk(f"tcp://{http}", connections=200)  # uvicorn warns once per bad request
    streamed = [t for chunk in stream for t in chunk.token_ids]
    assert streamed == list(before)
    assert client.generate(request).token_ids == before
    assert all(p.poll() is None for p in cluster.procs)

    # Each source's first drop is logged at once, the rest summed up when the window ends:
    # the side channel (rank 0) got 2,000 from 127.0.0.1.
    logs = {r: running.log_dir / f"rank{r}.log" for r in (0, 1)}
    places = {0: ["side channel"], 1: []}

    def counted(text: str, where: str) -> int:
        first = text.count(f"{where}: dropped a message from 127.0.0.1")
        more = re.findall(rf"{where}: dropped ([\d,]+) more messages from 127\.0\.0\.1", text)
        return first + sum(int(n.replace(",", "")) for n in more)

    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        texts = {r: p.read_text(errors="replace") for r, p in logs.items()}
        if all(counted(texts[r], w) >= 2000 for r in places for w in places[r]):
            break
        time.sleep(0.5)
    for r, text in texts.items():
        dropped = [line for line in text.splitlines() if "dropped" in line]
        assert len(dropped) <= 12, f"rank {r}:\n" + "\n".join(dropped)
        for where in places[r]:
            assert counted(text, where) == 2000, "\n".join(dropped)  # each counted once
    assert texts[0].count("Invalid HTTP request") <= 2, texts[0][-3000:]
    assert client.generate(request).token_ids == before


def _listening(pids: list[int]) -> dict[int, set[tuple[str, int]]]:
    """Each process's listening TCP sockets (address, port)."""
    return {
        pid: {
            (c.laddr.ip.removeprefix("::ffff:"), c.laddr.port)  # gRPC's v4-mapped v6 socket
            for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        }
        for pid in pids
    }


def test_every_listening_socket_is_on_the_hostfile_address_not_0_0_0_0(model, clusters):
    """gRPC, side channel, the ring: on 127.0.0.1 as the local hostfile says. The doorbells
    listened there only until their neighbours connected."""
    running = clusters(model, 2)
    listening = _listening(running.pids)
    cluster = running.cluster
    ports = {int(e.rsplit(":", 1)[1]) for e in [cluster.control_endpoint, cluster.grpc_address]}
    doorbells = {int(e.rsplit(":", 1)[1]) for e in cluster.doorbell_endpoints}
    every = set().union(*listening.values())
    assert {port for _, port in every} >= ports, (every, ports)
    assert not {port for _, port in every} & doorbells, (every, doorbells)
    assert {ip for ip, _ in every} == {"127.0.0.1"}, listening


# --- failures of real clusters -------------------------------------------------------


def _ranks_of(launcher: subprocess.Popen, n: int, timeout: float = 60) -> dict[int, psutil.Process]:
    """The launcher's current rank processes by rank (by the names `serve` gives them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = rank_processes(launcher.pid)
        if sorted(ranks) == list(range(n)):
            return ranks
        time.sleep(0.1)
    raise AssertionError(f"launcher {launcher.pid} has no {n} ranks")


@pytest.mark.parametrize("kills", [3, pytest.param(10, marks=pytest.mark.exhaustive)])
def test_kill_9_of_a_worker_mid_stream_with_restarts(model, tmp_path, kills):
    """`mlx-relay local --restarts N-1`: N kills, N clean failures, N-1 restarts, then no
    restart left. Three kills go through every path (a first restart, a later one, the
    last failure); the ten RELIABILITY.md quotes are `exhaustive` (make test-all)."""
    address = f"127.0.0.1:{free_ports(1)[0]}"
    log_path = tmp_path / "local.log"
    log = open(log_path, "wb")  # noqa: SIM115
    launcher = subprocess.Popen(
        [sys.executable, "-m", "mlx_relay", "local", "-n", "2", "--model", str(model)]
        + ["--grpc-address", address, "--restarts", str(kills - 1)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    detect: list[float] = []
    try:
        for attempt in range(kills):
            wait_serving(address, 120, check=lambda: _alive(launcher, log_path))
            ranks = _ranks_of(launcher, 2)
            with Client(address) as client:
                stream = stream_started(client)
                killed = time.monotonic()
                ranks[1].kill()
                error, at = error_of(stream)
            detect.append(at - killed)
            assert_names(error, 1)
            assert "side-channel connection closed" in error.details(), error.details()
            assert detect[-1] < 60, f"attempt {attempt}: UNAVAILABLE after {detect[-1]:.2f} s"
            gone = psutil.wait_procs(list(ranks.values()), timeout=60)[1]
            assert not gone, f"attempt {attempt}: left behind {gone}"
        assert launcher.wait(30) == EXIT_RANK_FAILED
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(60)
        log.close()
    text = log_path.read_text()
    assert text.count("rank 1 (127.0.0.1) killed by SIGKILL; the cluster was stopped") == kills, (
        text
    )
    assert f"restart {kills - 1} of {kills - 1}" in text and "(no restart left)" in text
    print(f"\nkill -9 -> UNAVAILABLE: {', '.join(f'{d:.2f}' for d in detect)} s")


def test_requests_in_flight_end_unavailable_and_health_is_not_serving_during_a_restart(
    model, tmp_path
):
    """`local --restarts 1`, a worker killed with streams, unary calls and queued requests
    in flight: each ends with UNAVAILABLE (none hangs); health answers NOT_SERVING (or
    nothing at all while no rank 0 listens) until the restarted cluster serves again."""
    from concurrent.futures import ThreadPoolExecutor

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = f"127.0.0.1:{free_ports(1)[0]}"
    log_path = tmp_path / "local.log"
    log = open(log_path, "wb")  # noqa: SIM115
    launcher = subprocess.Popen(
        [sys.executable, "-m", "mlx_relay", "local", "-n", "2", "--model", str(model)]
        + ["--grpc-address", address, "--restarts", "1", "--max-active", "2"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_serving(address, 120, check=lambda: _alive(launcher, log_path))
        ranks = _ranks_of(launcher, 2)
        client = Client(address, timeout=60)
        streams = [stream_started(client) for _ in range(2)]  # the two slots

        def unary(_: int) -> grpc.StatusCode:
            try:
                client.stub.Generate(pb.GenerateRequest(prompt="hi", params=LONG), timeout=60)
            except grpc.RpcError as e:
                return e.code()
            return grpc.StatusCode.OK

        pool = ThreadPoolExecutor(3)
        queued = [pool.submit(unary, i) for i in range(3)]  # waiting for a slot
        deadline = time.monotonic() + 30
        while client.status().queued_requests < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.status().queued_requests == 3
        seen: list[str] = []  # health's answers, each change once, from before the kill

        def watch_health() -> None:
            channel = grpc.insecure_channel(address)
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() - killed < 120:
                try:
                    answer = health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    state = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
                except grpc.RpcError as e:
                    state = e.code().name  # between the two rank 0s
                if not seen or seen[-1] != state:
                    seen.append(state)
                if state == "SERVING" and len(seen) > 1:
                    break
                time.sleep(0.02)
            channel.close()

        killed = time.monotonic()
        watcher = threading.Thread(target=watch_health)
        watcher.start()
        while not seen:  # (health's first answer, before the kill)
            assert time.monotonic() - killed < 60 and watcher.is_alive(), "health never answered"
            time.sleep(0.01)
        ranks[1].kill()
        for stream in streams:
            error, at = error_of(stream)
            assert_names(error, 1)
            # Found by the closed connection, not a missed heartbeat; the deadline is
            # one a loaded machine keeps, only a bound against a hang.
            assert "side-channel connection closed" in error.details(), error.details()
            assert at - killed < 60
        assert [f.result(timeout=60) for f in queued] == [grpc.StatusCode.UNAVAILABLE] * 3
        pool.shutdown()
        watcher.join(130)
        assert seen[0] == "SERVING" and seen[-1] == "SERVING" and "NOT_SERVING" in seen, seen
        # Between the two rank 0s: nobody listening, or a check caught by the old
        # server's stop (which cancels the calls it still holds).
        between = {"NOT_SERVING", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"}
        assert set(seen[1:-1]) <= between, seen
        with Client(address, timeout=60) as again:
            request = pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_tokens=5))
            assert len(again.generate(request).token_ids) == 5
        client.close()
        print(f"\nhealth around the kill and restart: {' -> '.join(seen)}")
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(60)
        log.close()
    assert "restart 1 of 1" in log_path.read_text()


def _alive(launcher: subprocess.Popen, log_path: Path) -> None:
    if launcher.poll() is not None:
        raise AssertionError(f"launcher exited {launcher.returncode}\n{log_path.read_text()}")


# Eager hops post every receive before its data is sent: a dead or stopped rank must be
# found all the same (auto gives ready hops on a 2-core machine, eager on many cores: the
# Macs this is for). Every hop mode meets each kind of loss in `make test-all`; `make
# test` gives eager hops every one of them (kill -9, SIGSTOP, an overdue step: a rank
# alive but silent is the dangerous case) and the others at least one.
# Time limits are generous deadlines (a loaded machine); what found the loss is read
# from the error's words (a closed connection, no heartbeat, an overdue step).


def _hops(*modes: str, exhaustive: tuple[str, ...]):
    cases = [*modes, *(pytest.param(m, marks=pytest.mark.exhaustive) for m in exhaustive)]
    return pytest.mark.parametrize("hops", cases)


@_hops("eager", exhaustive=("auto",))
def test_kill_9_of_the_middle_rank_of_three(model, clusters, hops):
    running = clusters(model, 3, "--hop-mode", hops)
    procs = running.cluster.procs
    stream = stream_started(running.client)
    killed = time.monotonic()
    procs[1].kill()
    error, at = error_of(stream)
    assert_names(error, 1)
    # Found by the closed connection (at once), not by a missed heartbeat; within a
    # deadline a loaded machine keeps.
    assert "side-channel connection closed" in error.details(), error.details()
    assert at - killed < 60
    exits = _wait_exit(procs, 60, t0=killed)
    assert procs[0].returncode == EXIT_CLUSTER_FAILED, running.logs()
    print(
        f"\n3 ranks, kill -9 rank 1: UNAVAILABLE {at - killed:.2f} s, all exited {max(exits):.2f} s"
    )


@_hops("auto", "collective", "eager", exhaustive=())
def test_sigstop_of_a_worker_mid_stream(model, clusters, hops):
    running = clusters(model, 2, "--hop-mode", hops)
    rank0, worker = running.cluster.procs
    stream = stream_started(running.client)
    stopped = time.monotonic()
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        error, at = error_of(stream)
        assert_names(error, 1)
        assert "no heartbeat" in error.details()
        assert at - stopped < 60
        assert rank0.wait(60) == EXIT_CLUSTER_FAILED
    finally:
        worker.send_signal(signal.SIGCONT)  # (none if it has exited)
    # Woken up, the worker finds rank 0 gone and leaves by itself.
    woke = time.monotonic()
    worker.wait(60)
    print(
        f"\nSIGSTOP -> UNAVAILABLE {at - stopped:.2f} s; woken worker exited "
        f"{time.monotonic() - woke:.2f} s later ({describe_exit(worker.returncode)})"
    )


def test_a_worker_lost_while_idle_fails_the_cluster_too(model, clusters):
    running = clusters(model, 2)
    rank0, worker = running.cluster.procs
    killed = time.monotonic()
    worker.kill()
    assert rank0.wait(60) == EXIT_CLUSTER_FAILED
    elapsed = time.monotonic() - killed
    log = (running.log_dir / "rank0.log").read_text()
    assert re.search(r"watchdog: rank 1 \(.*\): its side-channel connection closed", log), log
    print(f"\nidle worker killed: rank 0 exited {elapsed:.2f} s later")


def test_rank0_killed_every_worker_exits(model, clusters):
    running = clusters(model, 3)
    procs = running.cluster.procs
    stream = stream_started(running.client)
    killed = time.monotonic()
    procs[0].kill()
    with pytest.raises(grpc.RpcError):
        for _ in stream:
            pass
    exits = _wait_exit(procs[1:], 60, t0=killed)
    codes = [describe_exit(p.returncode) for p in procs[1:]]
    assert all(p.returncode != 0 for p in procs[1:]), codes
    # Each found rank 0 gone by its closed connection, not by its silence (the last
    # resort, after `link.rank0_patience`): read from the worker's words, not the clock.
    for rank in (1, 2):
        log = (running.log_dir / f"rank{rank}.log").read_text()
        assert "rank 0 silent for" not in log, log
    print(f"\nrank 0 killed: workers exited after {[f'{t:.2f}' for t in exits]} s ({codes})")


def test_a_rank_0_held_up_past_the_heartbeat_timeout_keeps_its_cluster(model, clusters):
    """Rank 0 names failures; a worker bears a silent rank 0 longer than that
    (`link.rank0_patience`), and rank 0 counts no silence across a hold-up of its own
    (`control.HELD_UP_S`). So a rank 0 held up past the heartbeat timeout (an overloaded machine
    starved its side-channel thread 3.4 s in CI; a laptop lid; a debugger) resumes with
    its cluster whole, blames nobody and answers exactly. Held up past the worker's
    patience, the worker leaves and says why."""
    running = clusters(model, 2)
    rank0, worker = running.cluster.procs
    os.kill(rank0.pid, signal.SIGSTOP)
    time.sleep(HEARTBEAT_TIMEOUT + 2)  # (the hold-up itself: the condition is time passing)
    os.kill(rank0.pid, signal.SIGCONT)
    prompt = raw_prompt_tokens(model, "Once upon a time")
    response = running.client.generate(
        pb.GenerateRequest(prompt="Once upon a time", params=pb.SamplingParams(max_tokens=10))
    )
    assert list(response.token_ids) == mlx_lm_tokens(model, prompt, 10)
    assert rank0.poll() is None and worker.poll() is None
    assert "no heartbeat" not in (running.log_dir / "rank0.log").read_text()

    patience = rank0_patience(HEARTBEAT_TIMEOUT)
    stopped = time.monotonic()
    os.kill(rank0.pid, signal.SIGSTOP)
    try:
        (left,) = _wait_exit([worker], patience + 30, t0=stopped)
    finally:
        os.kill(rank0.pid, signal.SIGCONT)
    # Longer than rank 0 waits on a worker (counted from rank 0's last heartbeat, which
    # a busy machine may have sent late, some time before the stop: a lower bound only).
    assert worker.returncode == EXIT_RANK0_SILENT, describe_exit(worker.returncode)
    assert left > HEARTBEAT_TIMEOUT + 2, left
    assert "rank 0 silent for" in (running.log_dir / "rank1.log").read_text()
    print(f"\nrank 0 stopped: its worker left after {left:.2f} s (patience {patience:.0f} s)")


@_hops("auto", "eager", exhaustive=())
def test_an_overdue_step_fails_the_cluster_naming_the_rank(model, clusters, hops):
    running = clusters(
        model, 2, "--heartbeat-timeout", "60", "--step-timeout", "1", "--hop-mode", hops
    )
    rank0, worker = running.cluster.procs
    stream = stream_started(running.client)
    stopped = time.monotonic()
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        error, at = error_of(stream)
        assert_names(error, 1)
        assert "overdue" in error.details() and "--step-timeout" in error.details()
        assert at - stopped < 30  # (not the 60 s heartbeat's: the step's timeout found it)
        assert rank0.wait(60) == EXIT_CLUSTER_FAILED
    finally:
        worker.kill()
    print(f"\nstep timeout 1 s -> UNAVAILABLE {at - stopped:.2f} s")


# --- load-time checks ----------------------------------------------------------------

# Limits of twice a shard's weights leave room for one sequence's caches, not for eight
# of the model's whole context (test_memory_guard.py checks those).
SMALL_CACHES = ("--max-active", "1", "--max-context", "64")


def test_rank_0_refuses_a_shard_too_big_for_it_before_any_worker_loads(model, clusters, tmp_path):
    """Rank 0's shard includes the embedding and LM head; it is checked first."""
    big = make_tiny_model(tmp_path / "big", "llama", num_layers=4, hidden_size=256)
    small_need = shard_nbytes(model, 0, 2, ends=True)
    assert shard_nbytes(big, 0, 2, ends=True) > 4 * small_need > shard_nbytes(model, 0, 2) * 4
    running = clusters(
        model,
        2,
        *SMALL_CACHES,
        rank_env={0: {"MLX_RELAY_MEMORY_LIMIT": str(2 * small_need)}},
    )
    client = running.client
    with pytest.raises(grpc.RpcError) as info:
        client.stub.LoadModel(pb.LoadModelRequest(model=str(big)), timeout=60)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = info.value.details()
    assert f"rank 0 ({HOST})" in details and "MLX_RELAY_MEMORY_LIMIT" in details
    assert "layers [0, 2) with embedding and head need" in details
    assert str(big) not in (running.log_dir / "rank1.log").read_text()  # never asked to load
    loaded = client.stub.LoadModel(pb.LoadModelRequest(model=str(model)), timeout=60)
    assert loaded.status.state == "serving" and client.serving()


def test_load_checks_name_the_rank_and_the_cluster_can_load_again(model, clusters, tmp_path):
    """Each rank resolves `~/m` in its own HOME, as machines with different disks would."""
    homes = [tmp_path / "home0", tmp_path / "home1"]
    other = make_tiny_model(tmp_path / "other", "qwen3", num_layers=4)  # different config
    big = make_tiny_model(tmp_path / "big", "llama", num_layers=4, hidden_size=256)
    for home in homes:
        home.mkdir()
        (home / "same").symlink_to(model)
        (home / "big").symlink_to(big)
    (homes[0] / "mismatch").symlink_to(model)
    (homes[1] / "mismatch").symlink_to(other)
    (homes[0] / "missing").symlink_to(model)
    small_need, big_need = shard_nbytes(model, 2, 4), shard_nbytes(big, 2, 4)
    assert big_need > 4 * small_need
    limit = 2 * small_need
    running = clusters(
        model,
        2,
        *SMALL_CACHES,
        rank_env={
            0: {"HOME": str(homes[0])},
            1: {"HOME": str(homes[1]), "MLX_RELAY_MEMORY_LIMIT": str(limit)},
        },
    )
    client = running.client

    def refused(spec: str) -> str:
        with pytest.raises(grpc.RpcError) as info:
            client.stub.LoadModel(pb.LoadModelRequest(model=spec), timeout=60)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # (a load a worker refuses leaves the model that served before it serving)
        assert client.status().state == "serving" and client.serving()
        return info.value.details()

    missing = refused("~/missing")
    assert f"rank 1 ({HOST})" in missing and "does not exist" in missing
    assert str(homes[1] / "missing") in missing

    mismatch = refused("~/mismatch")
    assert f"rank 1 ({HOST})" in mismatch and "differs from rank 0's" in mismatch

    too_big = refused("~/big")
    assert f"rank 1 ({HOST})" in too_big and "MLX_RELAY_MEMORY_LIMIT" in too_big
    assert "layers [2, 4) need" in too_big

    loaded = client.stub.LoadModel(pb.LoadModelRequest(model="~/same"), timeout=60)
    assert loaded.status.state == "serving" and client.serving()
    prompt = raw_prompt_tokens(model, "Once upon a time")
    response = client.generate(
        pb.GenerateRequest(prompt="Once upon a time", params=pb.SamplingParams(max_tokens=10))
    )
    assert list(response.token_ids) == mlx_lm_tokens(model, prompt, 10)

    # A stranger on the network: a forged side-channel message.
    ctx = zmq.Context.instance()
    forged = ctx.socket(zmq.DEALER)
    forged.setsockopt(zmq.IDENTITY, b"rank1-x")
    forged.setsockopt(zmq.LINGER, 1000)
    forged.connect(running.cluster.control_endpoint)
    forged.send_multipart(control.encode(control.BYE, {"rank": 1}, b"guessed"))
    forged.close()
    log0 = running.log_dir / "rank0.log"
    deadline = time.monotonic() + 10
    while "signature does not match" not in log0.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "dropped a message" in log0.read_text()
    again = client.generate(
        pb.GenerateRequest(prompt="Once upon a time", params=pb.SamplingParams(max_tokens=10))
    )
    assert again.token_ids == response.token_ids
    assert all(p.poll() is None for p in running.cluster.procs)


# --- graceful stop -------------------------------------------------------------------


def test_sigterm_drains_then_every_rank_exits_0(model, clusters):
    running = clusters(model, 2, "--drain-timeout", "3")
    client = running.client
    short = client.stub.GenerateStream(
        pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_tokens=40, ignore_eos=True)),
        timeout=60,
    )
    endless = stream_started(client)
    next(short)
    t0 = time.monotonic()
    running.cluster.procs[0].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while client.serving() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not client.serving()
    with pytest.raises(grpc.RpcError) as info:
        client.generate(pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_tokens=2)))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    chunks = list(short)  # the running request finishes
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 40
    error, at = error_of(endless)  # the one that cannot finish in time is told so
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert 2.5 < at - t0 < 3 + 5
    codes = [p.wait(30) for p in running.cluster.procs]
    assert codes == [0, 0], running.logs()
    print(f"\nSIGTERM: drained; overdue request ended at {at - t0:.2f} s; exit codes {codes}")
