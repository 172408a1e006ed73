"""`mlx-relay launch` and `mlx.launch`: real clusters from hostfiles, checked against mlx-lm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import assert_gone
from launching import (
    MESSAGES,
    MLX_RELAY,
    Launched,
    chat_request,
    cpu_seconds,
    free_port_range,
    localhost_hostfile,
    rank_processes,
)
from mlx_names import mlx_private
from oracle import chat_tokens, mlx_lm_tokens

from mlx_relay.client.client import Client, wait_serving
from mlx_relay.launch.hostfile import parse_hostfile
from mlx_relay.launch.mlx_launch import (
    client_address,
    kill_script,
    launch_script,
    plan_wiring,
)
from mlx_relay.model.split import memory_split

# ---------------------------------------------------------------- unit: what gets run


def test_launch_script_is_mlx_launchs_own():
    launch = mlx_private("launch", "RemoteProcess")
    env = ["A=1", "B=with space's", "C", "bad-name=x", 'J=["tcp://1.2.3.4:5"]']
    files = {"MLX_HOSTFILE": json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]])}
    cmd = [sys.executable, "-m", "mlx_relay", "serve", "--model", "a b"]
    for cwd in (None, "/some where"):
        for is_local in (True, False):
            ours = launch_script(1, cwd, files, env, cmd, is_local)
            theirs = launch.RemoteProcess.make_launch_script(
                1, None, cwd, files, env, cmd, is_local
            )
            assert ours == theirs


def test_launch_script_runs_and_kill_script_signals(tmp_path):
    script = launch_script(
        2,
        str(tmp_path),
        {"MLX_HOSTFILE": "[]"},
        ["X=y z"],
        ["sh", "-c", "echo $X $MLX_RANK $(cat $MLX_HOSTFILE) $PWD; sleep 30"],
        True,
    )
    p = subprocess.Popen(["/bin/bash", "-c", script], stdout=subprocess.PIPE, text=True)
    pidfile = p.stdout.readline().strip()
    assert p.stdout.readline().split() == ["y", "z", "2", "[]", str(tmp_path)]
    assert Path(pidfile).read_text().strip() == str(p.pid)  # exec kept the pid
    subprocess.run(["/bin/bash", "-c", kill_script(pidfile)], check=True)
    assert p.wait(10) == -signal.SIGTERM
    assert not Path(pidfile).exists()


def test_wiring_counts_every_port_from_the_starting_port():
    hf = parse_hostfile([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 3)
    w = plan_wiring(hf, "ring", 40000)
    assert w.ring == [["127.0.0.1:40000"], ["127.0.0.1:40001"], ["127.0.0.1:40002"]]
    assert json.loads(w.files["MLX_HOSTFILE"]) == w.ring
    assert w.control == "tcp://127.0.0.1:40003"
    assert w.doorbells == [f"tcp://127.0.0.1:{p}" for p in (40004, 40005, 40006)]

    hf = parse_hostfile([{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}])
    w = plan_wiring(hf, "ring", 100, connections_per_ip=2)
    assert w.ring == [["10.0.0.1:100", "10.0.0.1:101"], ["10.0.0.2:102", "10.0.0.2:103"]]
    assert w.control == "tcp://10.0.0.1:104"
    assert w.doorbells == ["tcp://10.0.0.1:105", "tcp://10.0.0.2:106"]

    hf = parse_hostfile(
        [
            {"ssh": "m1", "ips": ["192.168.1.1"], "rdma": [None, "rdma_en2"]},
            {"ssh": "m2", "ips": ["192.168.1.2"], "rdma": ["rdma_en2", None]},
        ]
    )
    w = plan_wiring(hf, "jaccl", 500)
    assert "MLX_JACCL_COORDINATOR=192.168.1.1:500" in w.env
    assert json.loads(w.files["MLX_IBV_DEVICES"]) == [[None, "rdma_en2"], ["rdma_en2", None]]
    assert w.control == "tcp://192.168.1.1:501"

    hf = parse_hostfile([{"ssh": "127.0.0.1"}, {"ssh": "127.0.0.1"}])
    w = plan_wiring(hf, "mpi", 700)
    assert w.ring is None and w.files == {}
    assert w.control == "tcp://127.0.0.1:700"
    assert w.doorbells == ["tcp://127.0.0.1:701", "tcp://127.0.0.1:702"]


def test_client_address_reaches_rank_0_where_it_can():
    assert client_address("127.0.0.1:5", "127.0.0.1", True) == "127.0.0.1:5"
    assert client_address("127.0.0.1:5", "10.0.0.1", False) is None
    assert client_address("0.0.0.0:5", "10.0.0.1", False) == "10.0.0.1:5"
    assert client_address("10.0.0.1:5", "10.0.0.1", False) == "10.0.0.1:5"


def test_memory_split_weights_free_memory_and_keeps_a_layer_per_rank():
    gb = 2**30
    own = {"free_memory": 30 * gb, "active_memory": 2 * gb}  # rank 0's: 32 GB in all
    assert memory_split(30, [own, {"free_memory": 16 * gb}, {"free_memory": 48 * gb}]) == [
        10, 5, 15,
    ]  # fmt: skip
    assert memory_split(30, [own, {"free_memory": 0}, None]) == [10, 10, 10]  # unknown: average
    assert memory_split(4, [own, {"free_memory": gb // 100}, {"free_memory": 100 * gb}]) == [
        1, 1, 2,
    ]  # fmt: skip
    assert memory_split(30, [own, {"free_memory": int(32.5 * gb)}]) == [15, 15]  # within 5%


def test_launch_refuses_a_bad_hostfile_naming_the_entry(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, {"ssh": "127.0.0.1"}]))
    r = subprocess.run(
        [*MLX_RELAY, "launch", "--hostfile", str(bad), "--"], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert "hosts[1]" in r.stderr and "ips" in r.stderr
    bad.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    r = subprocess.run(
        [*MLX_RELAY, "launch", "--hostfile", str(bad), "--"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "MLX_HOSTFILE address list" in r.stderr


@pytest.mark.parametrize(
    "ranks, extra, says",
    [
        ("3", [], "--tensor-parallel 2 does not divide a cluster of 3 ranks"),
        ("2", ["--layers", "1,3"], "--layers 1,3 gives each rank a range of them"),
        ("6", ["--tensor-parallel", "3"], "MLX's ring backend does not have; launch with MPI"),
    ],
)
def test_local_refuses_a_tensor_split_the_ranks_cannot_make(tiny_model, ranks, extra, says):
    """Said before any rank starts: 3 ranks cannot be stages of 2; a split is not also a
    layer range a rank; `local`'s ring backend cannot make 6 ranks 2 stages of 3 (stages
    of 2 are pairs: test_tensor_parallel.py)."""
    model = tiny_model("llama", 4)
    r = subprocess.run(
        [*MLX_RELAY, "local", "-n", ranks, "--model", str(model), "--tensor-parallel", "2", *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert says in r.stderr, r.stderr


# ---------------------------------------------------------------- clusters


@pytest.mark.cluster
def test_launch_three_ranks_equals_mlx_lm_idles_and_stops_cleanly(tiny_model, tmp_path):
    model = tiny_model("llama", 7)
    hostfile = localhost_hostfile(tmp_path, 3)
    launched = Launched(tmp_path, hostfile, ["--model", str(model), "--layers", "auto"], 7)
    try:
        launched.wait_serving()
        assert len(launched.ranks) == 3, launched.ranks
        with Client(launched.grpc, timeout=120) as client:
            expected = mlx_lm_tokens(model, chat_tokens(model, MESSAGES), 30)
            assert list(client.generate(chat_request(30)).token_ids) == expected
            status = client.status()
            counts = [r.layer_end - r.layer_start for r in status.ranks]
            assert sum(counts) == 7 and min(counts) >= 1, counts  # Status shows the auto split
            # Each rank names itself in ps: its number, its layers, rank 0 its gRPC port.
            port = launched.grpc.rsplit(":", 1)[1]
            titles = {
                r: " ".join(p.cmdline()).strip()
                for r, p in rank_processes(launched.proc.pid).items()
            }
            assert titles == {
                r.rank: f"mlx-relay rank {r.rank}/3 layers {r.layer_start}-{r.layer_end - 1}"
                + (f" :{port}" if r.rank == 0 else "")
                for r in status.ranks
            }
        # The launcher leaves the cores to the ranks: idle, it sleeps.
        before, t0 = cpu_seconds(launched.proc.pid), time.monotonic()
        time.sleep(1.5)
        share = (cpu_seconds(launched.proc.pid) - before) / (time.monotonic() - t0)
        assert share < 0.05, f"launcher used {share:.1%} of a core while idle"
        out = launched.out.read_text() + launched.err.read_text()
        for rank in range(3):
            assert f"[rank {rank}] " in out
        assert "layers auto" in out
        assert launched.stop() == 0, launched.logs()
        assert "shutdown" in launched.err.read_text()
    finally:
        launched.stop()
    assert_gone(launched.ranks)


@pytest.mark.cluster
def test_a_failed_rank_stops_the_cluster_and_a_killed_launcher_orphans_none(tiny_model, tmp_path):
    model = tiny_model("llama", 5)
    hostfile = localhost_hostfile(tmp_path, 2)
    (tmp_path / "a").mkdir()
    launched = Launched(tmp_path / "a", hostfile, ["--model", str(model)], 5)
    try:
        launched.wait_serving()
        os.kill(launched.ranks[1], signal.SIGKILL)
        assert launched.proc.wait(60) == 4
        assert "rank 1 (127.0.0.1) killed by SIGKILL" in launched.err.read_text()
    finally:
        launched.stop()
    assert_gone(launched.ranks)

    (tmp_path / "b").mkdir()
    launched = Launched(tmp_path / "b", hostfile, ["--model", str(model)], 5)
    try:
        launched.wait_serving()
        launched.proc.kill()  # no chance to clean up: PR_SET_PDEATHSIG does it
        launched.proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in launched.ranks):
            time.sleep(0.2)
        assert_gone(launched.ranks)
    finally:
        launched.stop()


@pytest.mark.cluster
def test_mlx_launch_itself_with_a_localhost_hostfile(tiny_model, tmp_path):
    """`mlx.launch ... -- python -m mlx_relay serve` as hostfiles/README.md tells users."""
    model = tiny_model("qwen3", 5)
    hostfile = localhost_hostfile(tmp_path, 3)
    base = free_port_range(7)
    grpc = f"127.0.0.1:{free_port_range(1)}"
    doorbells = json.dumps([f"tcp://127.0.0.1:{base + 4 + r}" for r in range(3)])
    mlx_launch = str(Path(sys.executable).parent / "mlx.launch")
    cmd = [mlx_launch, "--hostfile", str(hostfile), "-p", str(base)]
    cmd += ["--env", "MLX_RELAY_SECRET=" + os.urandom(8).hex()]
    cmd += ["--env", f"MLX_RELAY_CONTROL=tcp://127.0.0.1:{base + 3}"]
    cmd += ["--env", f"MLX_RELAY_DOORBELLS={doorbells}"]
    cmd += ["--", sys.executable, "-m", "mlx_relay", "serve", "--model", str(model)]
    cmd += ["--grpc-address", grpc]
    log = tmp_path / "mlx.launch.log"
    with open(log, "wb") as out:
        # Its own session, so that every rank can be found and none outlives the test.
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.PIPE, start_new_session=True
        )
    ranks: dict[int, psutil.Process] = {}
    try:

        def check() -> None:
            if proc.poll() is not None:
                raise AssertionError(f"mlx.launch exited\n{log.read_text()[-5000:]}")

        wait_serving(grpc, 120, check=check)
        ranks = rank_processes(proc.pid)  # (mlx.launch's children, named by serve)
        with Client(grpc, timeout=120) as client:
            expected = mlx_lm_tokens(model, chat_tokens(model, MESSAGES), 30)
            assert list(client.generate(chat_request(30)).token_ids) == expected
            assert client.status().world_size == 3
        # SIGTERM to mlx.launch alone would orphan the ranks: stop them through rank 0.
        os.kill(ranks[0].pid, signal.SIGTERM)
        proc.wait(60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert_gone([p.pid for p in ranks.values()])


def test_free_ports_are_distinct_and_outside_the_kernels_own_choices():
    """Ports picked for a cluster never repeat within a process and lie below the ephemeral
    range, from which every outgoing connection's source port comes (a CI run once lost a
    cluster's gRPC port to one between the pick and the bind)."""
    from mlx_relay.launch.local import ephemeral_port_start, free_ports

    picked = free_ports(40) + free_ports(40)
    assert len(set(picked)) == 80
    assert all(1024 < p < ephemeral_port_start() for p in picked)


def test_ports_come_from_the_range_given(monkeypatch):
    """MLX_RELAY_PORTS keeps a run's ports inside a range (a firewall's; one test worker's
    share beside another's), and a malformed range is the user's error, said plainly."""
    from mlx_relay.errors import UserError
    from mlx_relay.launch.local import PORTS_ENV, free_ports, port_range

    monkeypatch.setenv(PORTS_ENV, "23000-23100")
    assert port_range() == (23000, 23100)
    assert all(23000 <= p < 23100 for p in free_ports(20))
    for bad in ("23000", "a-b", "900-2000", "24000-23000"):
        monkeypatch.setenv(PORTS_ENV, bad)
        with pytest.raises(UserError, match=PORTS_ENV):
            port_range()


def test_a_local_clusters_wiring_never_takes_its_own_doors_ports(monkeypatch, tmp_path):
    """Rank 0's door ports are free until it listens, after the ranks are wired: the
    wiring must not take them (a restarted cluster once found its gRPC port taken by its
    own ring)."""
    from mlx_relay.launch import local
    from mlx_relay.launch.lifeline import Lifeline

    # 8 ports, 6 of wiring and 2 doors: a window of this worker's own range that binds
    # now and that nothing here handed out (the other test worker has a range of its own)
    low, high = local.port_range()
    start = next(
        p
        for p in range(low, high - 8)
        if all(local._binds(q) and q not in local._handed_out for q in range(p, p + 8))
    )
    monkeypatch.setenv(local.PORTS_ENV, f"{start}-{start + 8}")
    doors = {start + 1, start + 5}
    cluster = local.LocalCluster(
        2, ["--http-address", f"127.0.0.1:{start + 1}"], grpc_address=f"127.0.0.1:{start + 5}"
    )
    cluster._workdir, cluster._lifeline = tmp_path, Lifeline()
    env = cluster._rank_env_base()
    wiring = [cluster.control_endpoint, *cluster.doorbell_endpoints, f":{env['NCCL_PORT']}"]
    wiring += [entry[0] for entry in json.loads((tmp_path / "hostfile.json").read_text())]
    taken = {int(address.rsplit(":", 1)[1]) for address in wiring}
    assert taken == set(range(start, start + 8)) - doors


def test_local_passes_every_serve_option_on_from_one_table():
    """`local` takes serve's options and gives them back to each rank (serve_argv): what a
    rank parses equals what `local` was given, except what travels another way."""
    import argparse

    from mlx_relay.launch import local, serve

    parser = argparse.ArgumentParser()
    local.add_parser(parser.add_subparsers(dest="command"))
    given = ["--layers", "4,4", "--no-prompt-cache", "--max-active", "3"]
    given += ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--step-timeout", "7.5"]
    given += ["--auth-token", "secret", "--grpc-address", "10.0.0.1:1"]
    args = parser.parse_args(["local", *given])
    argv = local.serve_argv(args)
    assert "secret" not in argv and "10.0.0.1:1" not in argv
    ranks = argparse.ArgumentParser()
    serve.add_parser(ranks.add_subparsers(dest="command"))
    rank = ranks.parse_args(["serve", *argv])
    for flag, _ in serve.SERVE_OPTIONS:
        dest = flag.removeprefix("--").replace("-", "_")
        if flag not in ("--auth-token", "--grpc-address"):
            assert getattr(rank, dest) == getattr(args, dest), flag


def test_a_rank_parses_only_the_serve_command():
    """Every rank starts as `mlx-relay serve`: its parser has serve alone, so a rank
    never imports the client or the launchers (0.2 s of each start and restart)."""
    code = (
        "import sys; from mlx_relay.cli import build_parser; "
        "p = build_parser('serve'); p.parse_args(['serve', '--model', 'default']); "
        "print(sorted(m for m in sys.modules if m.startswith(('mlx_relay.client', "
        "'mlx_relay.launch.local', 'mlx_relay.launch.demo'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    from mlx_relay.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    assert {"serve", "local", "launch", "chat", "demo"} <= set(commands)
