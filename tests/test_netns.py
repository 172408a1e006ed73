"""Ranks on separate "hosts": network namespaces with their own addresses on a bridge.

Skipped only where the machine cannot make namespaces (not root, no CAP_NET_ADMIN, no
iproute2); CI runs as root on machines where it can.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from launching import MESSAGES, chat_request, rank_pids
from netns import NETNS_DIR, NetnsHosts, unavailable_reason
from oracle import chat_tokens, mlx_lm_tokens, tokenizer_for

from mlx_relay.client.client import Client, wait_serving
from mlx_relay.model.default_model import resolve_model
from mlx_relay.protocol import relay_pb2 as pb

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")


def _listen_once(hosts: NetnsHosts, i: int, port: int) -> subprocess.Popen:
    code = (
        "import socket; s = socket.socket(); "
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        f"s.bind(('{hosts.addresses[i]}', {port})); s.listen(); print('up', flush=True); "
        "c, a = s.accept(); c.sendall(c.recv(64)); c.close()"
    )
    p = subprocess.Popen([*hosts.prefix(i), sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"up\n"
    return p


def test_namespace_hosts_have_their_own_addresses_a_capped_link_and_an_ssh_stand_in():
    hosts = NetnsHosts(3, rate="1gbit")
    with hosts:
        for i, address in enumerate(hosts.addresses):
            shown = hosts.run(i, ["ip", "-o", "-4", "addr", "show", "dev", "eth0"]).stdout
            assert f"inet {address}/24" in shown
            qdisc = hosts.run(i, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
            assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc
        # host 0 -> host 2, across the bridge
        server = _listen_once(hosts, 2, 7000)
        reach = (
            f"import socket; c = socket.create_connection(('{hosts.addresses[2]}', 7000), "
            "timeout=5); c.sendall(b'ping'); print(c.recv(64).decode())"
        )
        assert hosts.run(0, [sys.executable, "-c", reach]).stdout.strip() == "ping"
        server.wait(5)
        # the root namespace (a test's client) -> host 1
        server = _listen_once(hosts, 1, 7001)
        with socket.create_connection((hosts.addresses[1], 7001), timeout=5) as c:
            c.sendall(b"pong")
            assert c.recv(64) == b"pong"
        server.wait(5)
        # `ssh host command` as mlx.launch runs it lands in that host's namespace
        r = subprocess.run(
            ["ssh", "-tt", "-o", "LogLevel=QUIET", hosts.addresses[2], "stty -echo; ip -o -4 addr"],
            capture_output=True,
            text=True,
            env=hosts.env_with_ssh(),
            timeout=30,
        )
        assert f"inet {hosts.addresses[2]}/24" in r.stdout and hosts.addresses[0] not in r.stdout
    assert not any((NETNS_DIR / ns).exists() for ns in hosts.namespaces)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert hosts.bridge not in links


@pytest.mark.cluster
@pytest.mark.default_model
def test_three_namespaces_launched_over_ssh_serve_the_default_model(tmp_path):
    """`mlx-relay launch` with a hostfile of 3 namespace hosts, each rank started through
    the ssh stand-in; greedy tokens equal single-process mlx-lm; gRPC from the root."""
    model = resolve_model("default")
    expected = mlx_lm_tokens(model, chat_tokens(model, MESSAGES), 8)  # (~0.14 s a token here)
    with NetnsHosts(3) as hosts:
        hostfile = tmp_path / "netns-3.json"
        hostfile.write_text(json.dumps(hosts.hostfile()))
        grpc = f"{hosts.addresses[0]}:50051"
        out, err = tmp_path / "launch.out", tmp_path / "launch.err"
        cmd = [sys.executable, "-m", "mlx_relay", "launch", "--hostfile", str(hostfile)]
        cmd += ["--", "--model", "default", "--grpc-address", grpc]
        with open(out, "wb") as o, open(err, "wb") as e:
            launcher = subprocess.Popen(cmd, stdout=o, stderr=e, env=hosts.env_with_ssh())
        try:

            def check() -> None:
                if launcher.poll() is not None:
                    raise AssertionError(f"launcher exited\n{err.read_text()[-5000:]}")

            wait_serving(grpc, 180, check=check)
            ranks = rank_pids(launcher.pid)
            inside = set(hosts.pids_inside())
            assert len(ranks) == 3 and set(ranks) <= inside, (ranks, inside)
            with Client(grpc, timeout=120) as client:
                response = client.generate(chat_request(8))
                assert list(response.token_ids) == expected
                status = client.status()
                assert status.world_size == 3
                # The default split is balanced: rank 0 also runs the LM head.
                assert [(r.layer_start, r.layer_end) for r in status.ranks] == [
                    (0, 4),
                    (4, 17),
                    (17, 30),
                ]
            launcher.send_signal(signal.SIGTERM)
            assert launcher.wait(60) == 0, err.read_text()[-5000:]
            assert hosts.pids_inside() == []  # every rank ended, none orphaned
            log = err.read_text()
            assert "[rank 2] " in log and "rank 2: shutdown" in log
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()


# --- faults on a link between hosts ----------------------------------------------------

HEARTBEAT_TIMEOUT = 3.0  # serve's default --heartbeat-timeout


class _Launched:
    """`mlx-relay launch` of a tiny model over namespace hosts, through the ssh stand-in."""

    def __init__(self, hosts: NetnsHosts, model, tmp_path, *serve: str) -> None:
        hostfile = tmp_path / "hosts.json"
        hostfile.write_text(json.dumps(hosts.hostfile()))
        self.address = f"{hosts.addresses[0]}:50051"
        self.err = tmp_path / "launch.err"
        cmd = [sys.executable, "-m", "mlx_relay", "launch", "--hostfile", str(hostfile)]
        cmd += ["--", "--model", str(model), "--grpc-address", self.address, *serve]
        with open(self.err, "wb") as e:
            self.proc = subprocess.Popen(
                cmd, stdout=e, stderr=subprocess.STDOUT, env=hosts.env_with_ssh()
            )

        def check() -> None:
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited\n{self.err.read_text()[-5000:]}")

        wait_serving(self.address, 180, check=check)
        self.client = Client(self.address, timeout=120)

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("llama-4"), "llama", num_layers=4)


def _cut(hosts: NetnsHosts, a: int, b: int) -> None:
    """Every packet between hosts a and b lost, silently (a pulled cable): blackhole
    routes both ways, so no connection is refused or reset, it just goes quiet."""
    for src, dst in ((a, b), (b, a)):
        route = ["ip", "route", "add", "blackhole", f"{hosts.addresses[dst]}/32"]
        hosts.run(src, route, check=True)


@pytest.mark.cluster
def test_a_dropped_link_is_detected_within_the_heartbeat_timeout_naming_the_rank(tiny, tmp_path):
    import grpc

    prompt = pb.GenerateRequest(
        prompt="hi", params=pb.SamplingParams(max_tokens=100_000, ignore_eos=True)
    )
    with NetnsHosts(2, index=1) as hosts:
        launched = _Launched(hosts, tiny, tmp_path)
        try:
            stream = launched.client.stub.GenerateStream(prompt, timeout=120)
            for _ in range(3):
                next(stream)
            cut = time.monotonic()
            _cut(hosts, 0, 1)
            with pytest.raises(grpc.RpcError) as info:
                for _ in stream:
                    pass
            took = time.monotonic() - cut
            error = info.value
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            assert "rank 1" in error.details(), error.details()
            # Found by the missed heartbeats (not the 30 s step timeout, nor a hang): read
            # from the error's words; the deadline only bounds a hang on a loaded machine.
            assert "no heartbeat" in error.details(), error.details()
            assert took < 60, (took, error.details())
            # The launcher stops every rank (rank 1 finds rank 0 silent and leaves too).
            code = launched.proc.wait(HEARTBEAT_TIMEOUT + 30)
            assert code != 0
            assert hosts.pids_inside() == []
            print(f"\nlink cut -> UNAVAILABLE in {took:.2f} s: {error.details()}")
        finally:
            launched.close()


def _slow_lossy(hosts: NetnsHosts, i: int) -> str:
    """Make host i's outgoing link slow, and lossy where the kernel can; returns what was set.

    netem (delay 20 ms, 1% loss) where the kernel has it; else (these CI kernels have no
    netem, nor random-drop actions) a 1 Mbit/s tbf: slow, every byte of a step delayed.
    """
    netem = ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem"]
    if hosts.run(i, [*netem, "delay", "20ms", "loss", "1%"]).returncode == 0:
        return "netem delay 20ms loss 1%"
    tbf = ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", "1mbit"]
    hosts.run(i, [*tbf, "burst", "131072", "latency", "500ms"], check=True)
    return "tbf 1mbit (no netem in this kernel: slow, not lossy)"


def _drops(hosts: NetnsHosts, i: int) -> int:
    shown = hosts.run(i, ["tc", "-s", "qdisc", "show", "dev", "eth0"]).stdout
    return sum(int(n) for n in re.findall(r"dropped (\d+)", shown))


@pytest.mark.cluster
def test_a_slow_or_lossy_link_is_only_slower_and_token_exact(tiny, tmp_path):
    from mlx_relay.coordinator.requests import encode_text

    texts = ["Once upon a time", "The capital of France is", "def add(a, b):"]
    with NetnsHosts(2, index=2) as hosts:  # its own names: the last set may still be going
        launched = _Launched(hosts, tiny, tmp_path)
        try:
            tokenizer = tokenizer_for(tiny)
            expected = [mlx_lm_tokens(tiny, encode_text(tokenizer, t), 40) for t in texts]
            how = [_slow_lossy(hosts, i) for i in range(2)]
            t0 = time.monotonic()
            for _ in range(3):
                for text, want in zip(texts, expected, strict=True):
                    params = pb.SamplingParams(max_tokens=40, ignore_eos=True)
                    got = launched.client.generate(pb.GenerateRequest(prompt=text, params=params))
                    assert list(got.token_ids) == want
            drops = [_drops(hosts, i) for i in range(2)]
            assert launched.client.serving()
            # Every socket a rank listens on is on its host's address from the hostfile.
            for i, ns in enumerate(hosts.namespaces):
                found = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
                pids = [int(p) for p in found.stdout.split()]
                for pid in pids:
                    proc = psutil.Process(pid)
                    if "mlx_relay" not in " ".join(proc.cmdline()):
                        continue
                    for c in proc.net_connections(kind="inet"):
                        if c.status == psutil.CONN_LISTEN:
                            ip = c.laddr.ip.removeprefix("::ffff:")
                            assert ip == hosts.addresses[i], (i, c)
            print(
                f"\n{how[0]}: 9 requests token-exact in {time.monotonic() - t0:.1f} s, "
                f"packets dropped per host {drops}"
            )
        finally:
            launched.close()
