"""Ranks on separate "hosts": network namespaces with their own addresses on a bridge.

Skipped only where the machine cannot make namespaces (not root, no CAP_NET_ADMIN, no
iproute2); CI runs as root on machines where it can.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest
from launching import MESSAGES, chat_request, rank_pids
from netns import NETNS_DIR, NetnsHosts, unavailable_reason
from oracle import chat_tokens, mlx_lm_tokens

from mlx_relay.client.client import Client, wait_serving
from mlx_relay.model.default_model import resolve_model

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
    expected = mlx_lm_tokens(model, chat_tokens(model, MESSAGES), 24)
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
                response = client.generate(chat_request(24))
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
