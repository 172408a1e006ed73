"""Hostfile parsing, checking and generation, the layer split, and `mlx-relay hostfile`."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mlx_names import mlx_private

from mlx_relay.launch import hostfile_cli
from mlx_relay.launch.hostfile import (
    KIND_RING_ENV,
    HostfileError,
    check_hostfile,
    format_hostfile,
    hostfile_to_json,
    load_hostfile,
    make_hostfile,
    parse_hostfile,
    ring_addresses,
)

HOSTFILES = Path(__file__).resolve().parent.parent / "hostfiles"
EXAMPLES = sorted(HOSTFILES.glob("*.json"))


def check(data, **kw) -> list[str]:
    return check_hostfile(parse_hostfile(data), **kw)


def one_problem(data, **kw) -> str:
    problems = check(data, **kw)
    assert len(problems) == 1, problems
    return problems[0]


def ring(*hosts) -> dict:
    return {"backend": "ring", "hosts": [{"ssh": s, "ips": ips} for s, ips in hosts]}


def jaccl(matrix, ips=("10.0.0.1",), backend="jaccl") -> dict:
    hosts = [{"ssh": f"mac{i + 1}", "rdma": row} for i, row in enumerate(matrix)]
    hosts[0]["ips"] = list(ips)
    return {"backend": backend, "hosts": hosts}


MESH3 = [
    [None, "rdma_en2", "rdma_en3"],
    ["rdma_en2", None, "rdma_en3"],
    ["rdma_en2", "rdma_en3", None],
]


# ---------------------------------------------------------------- the examples


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    for name in (
        "localhost-2.json",
        "localhost-3.json",
        "thunderbolt-2-macs.json",
        "thunderbolt-4-ring.json",
        "ethernet-3-macs.json",
        "jaccl-4-mesh.json",
        "mpi-2.json",
        "mpi-2x2.json",
    ):
        assert name in names
    readme = (HOSTFILES / "README.md").read_text()
    for name in names:
        assert name in readme, f"{name} is not explained in hostfiles/README.md"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_check(path):
    hf = load_hostfile(path)
    assert check_hostfile(hf, num_layers=30) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_read_by_mlx_launch(path):
    """mlx.launch's own parser accepts it, seeing the same hosts."""
    common = mlx_private("common", "Hostfile")
    theirs = common.Hostfile.from_file(str(path))
    ours = load_hostfile(path)
    assert [h.ssh_hostname for h in theirs.hosts] == [h.ssh for h in ours.hosts]
    assert [h.ips for h in theirs.hosts] == [h.ips for h in ours.hosts]
    assert (theirs.backend or None) == ours.backend


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        if port > 65000:
            continue
        try:
            with socket.socket() as b1, socket.socket() as b2, socket.socket() as b3:
                b1.bind(("127.0.0.1", port))
                b2.bind(("127.0.0.1", port + 1))
                b3.bind(("127.0.0.1", port + 2))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port range")


@pytest.mark.cluster  # (rank processes of an mx.distributed ring, not test-fast's)
@pytest.mark.parametrize("name", ["localhost-2.json", "localhost-3.json"])
def test_localhost_example_runs_under_mlx_launch(name, tmp_path):
    """The local examples really start a ring: every rank sees the full group."""
    launch = Path(sys.executable).with_name("mlx.launch")
    if not launch.exists():
        pytest.skip("mlx.launch not installed")
    n = len(load_hostfile(HOSTFILES / name).hosts)
    script = tmp_path / "probe.py"
    script.write_text(
        "import mlx.core as mx\n"
        "g = mx.distributed.init(backend='ring', strict=True)\n"
        "s = mx.distributed.all_sum(mx.array([1.0]), group=g).item()\n"
        "print(f'rank {g.rank()} size {g.size()} sum {s:.0f}', flush=True)\n"
    )
    out = subprocess.run(
        [str(launch), "--hostfile", str(HOSTFILES / name), "-p", str(_free_port_pair())]
        + ["--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    # mlx.launch exits 0 even when a rank fails, so read what the ranks printed.
    for r in range(n):
        assert f"rank {r} size {n} sum {n}" in out.stdout, out.stdout + out.stderr


# ---------------------------------------------------------------- parsing


def test_parse_list_and_object_forms():
    hf = parse_hostfile([{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}])
    assert hf.backend is None and hf.envs == [] and [h.ssh for h in hf.hosts] == ["a", "b"]
    hf = parse_hostfile({"backend": "jaccl", "envs": ["A=1"], "hosts": [{"ssh": "a"}]})
    assert hf.backend == "jaccl" and hf.envs == ["A=1"] and hf.hosts[0].ips == []
    assert hf.hosts[0].rdma is None
    assert parse_hostfile({"backend": "", "hosts": []}).backend is None


@pytest.mark.parametrize(
    "data, words",
    [
        ({"hosts": [{"ssh": "a"}, {"ips": ["10.0.0.2"]}]}, ["hosts[1]", "missing 'ssh'"]),
        ([{"ssh": "a", "ip": ["10.0.0.1"]}], ["hosts[0] (ssh 'a')", "'ip'", "did you mean 'ips'"]),
        ({"backend": "ring", "host": []}, ["unknown key 'host'", "did you mean 'hosts'"]),
        ({"backend": "ring"}, ["no 'hosts'"]),
        ([{"ssh": "a", "ips": "10.0.0.1"}], ["hosts[0] (ssh 'a')", "'ips' must be a list"]),
        ([{"ssh": "a"}, "b"], ["hosts[1]", "expected an object"]),
        ([{"ssh": ""}], ["hosts[0]", "non-empty"]),
        ([{"ssh": "a", "rdma": [None, 3]}], ["hosts[0] (ssh 'a')", "'rdma'"]),
        ({"envs": "A=1", "hosts": []}, ["'envs'"]),
        ("mac1,mac2", ["a hostfile is"]),
        ([["127.0.0.1"], ["127.0.0.1:5001"]], ["rank 0", 'not "ip:port"']),
        ([["::1:5000"], ["::1:5001"]], ["rank 0", "IPv6"]),
    ],
)
def test_parse_errors_name_the_entry(data, words):
    with pytest.raises(HostfileError) as e:
        parse_hostfile(data)
    for w in words:
        assert w in str(e.value)


def test_load_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"ssh": "a", // comment\n}]')
    with pytest.raises(HostfileError, match="bad.json: not valid JSON"):
        load_hostfile(bad)
    with pytest.raises(HostfileError, match="missing.json"):
        load_hostfile(tmp_path / "missing.json")
    bad.write_text('[{"ssh": "a"}, {"ips": []}]')
    with pytest.raises(HostfileError, match=r"bad.json: hosts\[1\]"):
        load_hostfile(bad)


def test_to_json_round_trip():
    for path in EXAMPLES:
        data = json.loads(path.read_text())
        hf = parse_hostfile(data)
        again = parse_hostfile(json.loads(format_hostfile(hostfile_to_json(hf))))
        assert again == hf


# ---------------------------------------------------------------- ring


def test_ring_missing_ips_names_the_host():
    data = ring(("mac1", ["10.0.0.1"]), ("mac2", ["10.0.0.2"]), ("mac3", []))
    assert one_problem(data) == (
        "hosts[2] (ssh 'mac3'): ring backend needs 'ips' (the addresses the ring connects over)"
    )


def test_ring_is_the_default_backend():
    data = [{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2"}]
    assert "hosts[1] (ssh 'mac2'): ring backend needs 'ips'" in one_problem(data)
    assert check(data, backend="mpi") == []


def test_ring_needs_equal_ip_counts():
    data = ring(("mac1", ["10.0.0.1", "10.0.1.1"]), ("mac2", ["10.0.0.2"]))
    p = one_problem(data)
    assert "hosts[1] (ssh 'mac2')" in p and "same number of ips" in p


@pytest.mark.parametrize(
    "ip, words",
    [
        ("10.0.0.300", ["not an IP address"]),
        ("mac2.local", ["not an IP address"]),
        ("fe80::1", ["IPv6"]),
        ("0.0.0.0", ["not an address a peer can connect to"]),
    ],
)
def test_bad_ip(ip, words):
    p = one_problem(ring(("mac1", ["10.0.0.1"]), ("mac2", [ip])))
    assert p.startswith("hosts[1] (ssh 'mac2'): ")
    assert all(w in p for w in words)


def test_duplicate_remote_rank():
    data = ring(("mac1", ["10.0.0.1"]), ("mac2", ["10.0.0.2"]), ("mac1", ["10.0.0.1"]))
    p = one_problem(data)
    assert "hosts[2] (ssh 'mac1')" in p and "hosts[0]" in p and "duplicate rank" in p


def test_repeated_localhost_is_not_a_duplicate():
    assert check(ring(*[("127.0.0.1", ["127.0.0.1"])] * 4)) == []


def test_same_ip_on_two_machines():
    p = one_problem(ring(("mac1", ["10.0.0.1"]), ("mac2", ["10.0.0.1"])))
    assert "hosts[1] (ssh 'mac2')" in p and "also listed for hosts[0]" in p


def test_loopback_reached_from_another_machine():
    data = ring(("127.0.0.1", ["127.0.0.1"]), ("mac2", ["10.0.0.2"]))
    p = one_problem(data)
    assert p.startswith("hosts[0] (ssh '127.0.0.1'): 127.0.0.1 is a loopback address")


def test_single_host_ring_is_refused():
    p = one_problem(ring(("127.0.0.1", ["127.0.0.1"])))
    assert "1 host" in p and "without mlx.launch" in p
    assert check(ring(("127.0.0.1", ["127.0.0.1"])), backend="mpi") == []


def test_no_hosts():
    assert "at least 1 host" in one_problem({"backend": "ring", "hosts": []})


def test_unknown_backend_and_bad_envs():
    data = {"backend": "tcp", "envs": ["GOOD=1", "BAD-NAME=1", "EMPTY"], "hosts": []}
    problems = check(data)
    assert any("unknown backend 'tcp'" in p for p in problems)
    assert any("envs[1]" in p for p in problems)
    assert any("envs[2]" in p and "no '='" in p for p in problems)


def test_nccl_is_refused_for_the_pipeline():
    data = {"backend": "nccl", "hosts": [{"ssh": "gpu1", "ips": ["10.0.0.1"]}]}
    assert "send/recv" in one_problem(data)


# ---------------------------------------------------------------- jaccl


def test_jaccl_mesh_ok():
    assert check(jaccl(MESH3)) == []


def test_jaccl_ragged_matrix():
    m = [row[:] for row in MESH3]
    m[1] = ["rdma_en2", None]
    p = one_problem(jaccl(m))
    assert p.startswith("hosts[1] (ssh 'mac2'): 'rdma' has 2 entries for 3 hosts")


def test_jaccl_missing_rdma():
    data = jaccl(MESH3)
    del data["hosts"][2]["rdma"]
    assert one_problem(data).startswith("hosts[2] (ssh 'mac3'): jaccl needs 'rdma'")


def test_jaccl_non_null_diagonal():
    m = [row[:] for row in MESH3]
    m[2][2] = "rdma_en4"
    p = one_problem(jaccl(m))
    assert p.startswith("hosts[2] (ssh 'mac3'): rdma[2] must be null")


def test_jaccl_null_off_diagonal():
    m = [row[:] for row in MESH3]
    m[0][2] = None
    p = one_problem(jaccl(m))
    assert p.startswith("hosts[0] (ssh 'mac1'): rdma[2] is null")
    assert "hosts[2] (ssh 'mac3')" in p


def test_jaccl_needs_coordinator_ip():
    p = one_problem(jaccl(MESH3, ips=()))
    assert p.startswith("hosts[0] (ssh 'mac1'): jaccl needs rank 0's 'ips'")
    assert "MLX_JACCL_COORDINATOR" in p


def test_jaccl_ring_needs_only_neighbours():
    m = [
        [None, "a", None, "b"],
        ["a", None, "b", None],
        [None, "a", None, "b"],
        ["a", None, "b", None],
    ]
    assert check(jaccl(m, backend="jaccl-ring")) == []
    problems = check(jaccl(m))  # a mesh needs every pair
    assert len(problems) == 4 and all("rdma[" in p for p in problems)


def test_jaccl_multi_cable_entries():
    m = [[None, ["rdma_en2", "rdma_en3"]], [["rdma_en2", "rdma_en3"], None]]
    assert check(jaccl(m)) == []


# ---------------------------------------------------------------- mpi


def test_mpi_needs_no_ips_but_adjacent_repeats():
    assert check({"backend": "mpi", "hosts": [{"ssh": "127.0.0.1"}, {"ssh": "127.0.0.1"}]}) == []
    data = {
        "backend": "mpi",
        "hosts": [{"ssh": "127.0.0.1"}, {"ssh": "mac2"}, {"ssh": "127.0.0.1"}],
    }
    p = one_problem(data)
    assert p.startswith("hosts[2] (ssh '127.0.0.1')") and "rank order" in p


# ---------------------------------------------------------------- MLX_HOSTFILE format


def test_ring_env_format_ok():
    hf = parse_hostfile([["127.0.0.1:5000"], ["127.0.0.1:5001"], ["127.0.0.1:5002"]])
    assert hf.kind == KIND_RING_ENV and hf.backend == "ring"
    assert check_hostfile(hf, num_layers=30) == []
    assert hf.hosts[2].ips == ["127.0.0.1"] and hf.hosts[2].ports == [5002]


def test_ring_env_duplicate_port():
    p = one_problem([["127.0.0.1:5000"], ["127.0.0.1:5001"], ["127.0.0.1:5000"]])
    assert p.startswith("rank 2 (127.0.0.1:5000)") and "rank 0" in p


def test_ring_env_problems():
    assert "1 rank" in one_problem([["127.0.0.1:5000"]])
    assert "rank 1" in one_problem([["127.0.0.1:5000"], ["127.0.0.1:70000"]])
    assert "rank 1" in one_problem([["127.0.0.1:5000"], ["127.0.0.256:5001"]])
    p = one_problem([["127.0.0.1:5000", "127.0.0.1:5002"], ["127.0.0.1:5001"]])
    assert p.startswith("rank 1") and "left" in p
    assert "ring backend" in one_problem([["127.0.0.1:5000"], ["127.0.0.1:5001"]], backend="mpi")


def test_ring_addresses_match_mlx_launch():
    hf = load_hostfile(HOSTFILES / "localhost-3.json")
    assert ring_addresses(hf, starting_port=4000) == [
        ["127.0.0.1:4000"],
        ["127.0.0.1:4001"],
        ["127.0.0.1:4002"],
    ]
    addrs = ring_addresses(hf, starting_port=4000, connections_per_ip=2)
    assert addrs[1] == ["127.0.0.1:4002", "127.0.0.1:4003"]
    assert check(addrs) == []


# ---------------------------------------------------------------- layers


def test_too_many_ranks_for_layers():
    data = ring(*[("127.0.0.1", ["127.0.0.1"])] * 4)
    p = one_problem(data, num_layers=3)
    assert "4 ranks" in p and "3 layers" in p


def test_layers_sum_mismatch():
    data = ring(*[("127.0.0.1", ["127.0.0.1"])] * 3)
    p = one_problem(data, num_layers=30, layers=[10, 10, 9])
    assert "sums to 29" in p and "30" in p
    assert "3 ranks" in one_problem(data, layers=[15, 15])
    assert "rank 1 gets 0" in one_problem(data, num_layers=30, layers=[15, 0, 15])
    assert check(data, num_layers=30, layers=[5, 20, 5]) == []


# ---------------------------------------------------------------- make_hostfile


@pytest.mark.parametrize(
    "hosts, over, backend",
    [
        (["127.0.0.1"] * 2, "local", None),
        (["localhost"] * 3, "local", "ring"),
        (["127.0.0.1"] * 2, "local", "mpi"),
        (["mac1", "mac2"], "thunderbolt", None),
        (["mac1", "mac2", "mac3"], "thunderbolt", "ring"),
        ([f"mac{i}" for i in range(8)], "thunderbolt", "ring"),
        (["mac1=10.0.0.1", "mac2", "mac3", "mac4"], "thunderbolt", "jaccl"),
        (["mac1=10.0.0.1", "mac2", "mac3", "mac4"], "thunderbolt", "jaccl-ring"),
        (["mac1", "mac2"], "thunderbolt", "mpi"),
        (["10.0.0.1", "mac2=10.0.0.2", "10.0.0.3"], "ethernet", None),
        (["mac1", "mac2"], "ethernet", "mpi"),
    ],
)
def test_make_hostfile_passes_check(hosts, over, backend):
    data = make_hostfile(hosts, over, backend=backend)
    assert data["backend"] == (backend or "ring")
    assert len(data["hosts"]) == len(hosts)
    hf = parse_hostfile(json.loads(format_hostfile(data)))
    assert check_hostfile(hf) == []


def test_make_local_uses_127_0_0_1_for_ssh():
    data = make_hostfile(["localhost", "127.0.0.1"], "local")
    assert all(h == {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]} for h in data["hosts"])


def test_make_thunderbolt_addresses():
    two = make_hostfile(["a", "b"], "thunderbolt")["hosts"]
    assert [h["ips"] for h in two] == [["192.168.0.1"], ["192.168.0.2"]]
    four = make_hostfile(["a", "b", "c", "d"], "thunderbolt")["hosts"]
    assert [h["ips"][0] for h in four] == [
        "192.168.0.14",
        "192.168.0.2",
        "192.168.0.6",
        "192.168.0.10",
    ]
    assert make_hostfile(["a=10.9.0.1", "b"], "thunderbolt")["hosts"][0]["ips"] == ["10.9.0.1"]


def test_make_jaccl_matrix():
    hosts = make_hostfile(["a=10.0.0.1", "b", "c"], "thunderbolt", backend="jaccl")["hosts"]
    matrix = [h["rdma"] for h in hosts]
    assert all(len(row) == 3 for row in matrix)
    assert all(matrix[i][i] is None for i in range(3))
    assert all(matrix[i][j].startswith("rdma_en") for i in range(3) for j in range(3) if i != j)


@pytest.mark.parametrize(
    "hosts, over, backend, words",
    [
        (["mac1", "mac2"], "ethernet", None, "mac1=<its IP>"),
        (["mac1", "mac2"], "thunderbolt", "jaccl", "rank 0's IP"),
        (["mac1=10.0.0.1", "mac2"], "ethernet", "jaccl", "Thunderbolt"),
        (["mac1"], "thunderbolt", None, "at least 2"),
        (["mac1", "mac1"], "thunderbolt", None, "twice"),
        (["mac1"], "local", None, "127.0.0.1 or localhost"),
        (["mac1=notanip"], "ethernet", None, "not an IP"),
        ([], "local", None, "no hosts"),
        (["a", "b"], "wifi", None, "over"),
    ],
)
def test_make_hostfile_errors(hosts, over, backend, words):
    with pytest.raises(ValueError, match=words):
        make_hostfile(hosts, over, backend=backend)


# ---------------------------------------------------------------- the CLI


def cli(*argv: str) -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    hostfile_cli.add_parser(sub)
    args = p.parse_args(["hostfile", *argv])
    return args.func(args)


def test_cli_check_ok(capsys):
    hostfile = str(HOSTFILES / "localhost-3.json")
    assert cli("check", hostfile, "--num-layers", "30", "--layers", "even") == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: 3 hosts, backend ring\n")
    assert "rank 2: [20, 30)" in out
    assert cli("check", hostfile, "--num-layers", "30") == 0  # the default: balanced
    assert "layers: balanced, decided at load from the model's weights" in capsys.readouterr().out


def test_cli_check_problems(tmp_path, capsys):
    f = tmp_path / "h.json"
    f.write_text(json.dumps(ring(("mac1", ["10.0.0.1"]), ("mac2", ["10.0.0.2"]), ("mac3", []))))
    assert cli("check", str(f), "--num-layers", "30", "--layers", "10,10,9") == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert "hosts[2] (ssh 'mac3'): ring backend needs 'ips'" in out[0]
    assert "sums to 29" in out[1]


def test_cli_check_backend_override_and_unreadable(tmp_path, capsys):
    assert cli("check", str(HOSTFILES / "mpi-2.json")) == 0
    assert cli("check", str(HOSTFILES / "mpi-2.json"), "--backend", "ring") == 1
    assert "ring backend needs 'ips'" in capsys.readouterr().out
    f = tmp_path / "h.json"
    f.write_text("not json")
    assert cli("check", str(f)) == 1
    assert "not valid JSON" in capsys.readouterr().out


def test_cli_check_ring_env(tmp_path, capsys):
    f = tmp_path / "h.json"
    f.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    assert cli("check", str(f)) == 0
    assert "MLX_HOSTFILE" in capsys.readouterr().out


def test_cli_make_prints_and_writes(tmp_path, capsys):
    assert cli("make", "--hosts", "mac1,mac2,mac3,mac4", "--over", "thunderbolt") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backend"] == "ring" and len(data["hosts"]) == 4
    out = tmp_path / "local.json"
    assert cli("make", "--over", "local", "-n", "3", "-o", str(out)) == 0
    assert cli("check", str(out)) == 0
    assert cli("make", "--hosts", "mac1,mac2", "--over", "ethernet") == 1
    assert "mac1=<its IP>" in capsys.readouterr().err


def test_cli_make_jaccl_round_trip(tmp_path):
    out = tmp_path / "mesh.json"
    hosts = "mac1=10.0.0.1,mac2,mac3,mac4"
    assert (
        cli("make", "--hosts", hosts, "--over", "thunderbolt", "--backend", "jaccl", "-o", str(out))
        == 0
    )
    assert cli("check", str(out), "--num-layers", "30") == 0
