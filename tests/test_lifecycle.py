"""Starting and stopping: Free, shutdown, and the `mlx-relay local` launcher itself."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import grpc
import psutil
import pytest
from conftest import assert_gone
from launching import rank_processes
from oracle import mlx_lm_tokens, raw_prompt_tokens

from mlx_relay.client.client import Client, wait_serving
from mlx_relay.launch.local import free_ports
from mlx_relay.model.sharding import head_cost_in_layers, read_config
from mlx_relay.model.split import balanced_split, layer_ranges
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = pytest.mark.cluster


def _wait_gone(pids: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
            return
        time.sleep(0.1)
    assert_gone(pids)


def test_free_then_load_again_then_shutdown(tiny_model, cluster_factory):
    model = tiny_model("llama", 5)
    running = cluster_factory(model, 3)
    client = running.client
    reply = client.stub.Free(pb.FreeRequest(), timeout=30)
    assert "freed" in reply.message
    assert client.status().state == "unloaded"
    assert not client.serving()
    with pytest.raises(grpc.RpcError) as info:
        client.generate(pb.GenerateRequest(prompt="hello"))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    loaded = client.stub.LoadModel(
        pb.LoadModelRequest(model=str(model), layers="2,2,1"), timeout=60
    )
    assert [(r.layer_start, r.layer_end) for r in loaded.status.ranks] == [(0, 2), (2, 4), (4, 5)]
    assert client.serving()
    prompt = raw_prompt_tokens(model, "Once upon a time")
    response = client.generate(
        pb.GenerateRequest(prompt="Once upon a time", params=pb.SamplingParams(max_tokens=12))
    )
    assert list(response.token_ids) == mlx_lm_tokens(model, prompt, 12)

    # `balanced` gives rank 0 fewer layers for the LM head it also runs.
    expected = balanced_split(5, 3, head_cost_in_layers(read_config(model)))
    loaded = client.stub.LoadModel(
        pb.LoadModelRequest(model=str(model), layers="balanced"), timeout=60
    )
    assert [(r.layer_start, r.layer_end) for r in loaded.status.ranks] == layer_ranges(expected)

    client.stub.Free(pb.FreeRequest(shutdown=True), timeout=30)
    for p in running.cluster.procs:
        assert p.wait(30) == 0, running.logs()
    _wait_gone(running.pids)


def test_a_bad_load_is_refused_while_the_old_model_keeps_serving(
    tiny_model, cluster_factory, tmp_path
):
    """Issue 38: /nonexistent, a config without a layer count and a directory without
    weights are refused before anything is released: a request running meanwhile runs
    to its end and the next one is served, with no load in between."""
    model = tiny_model("llama", 5)
    running = cluster_factory(model, 2)
    client = running.client
    no_layers = tmp_path / "no-layers"
    no_layers.mkdir()
    (no_layers / "config.json").write_text(json.dumps({"model_type": "llama"}))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(
        json.dumps({"model_type": "llama", "num_hidden_layers": 4})
    )
    stream = client.stub.GenerateStream(
        pb.GenerateRequest(
            prompt="Once upon a time",
            params=pb.SamplingParams(max_tokens=150, ignore_eos=True),
        ),
        timeout=120,
    )
    first = next(stream)  # the request is running
    for bad, said in [
        (tmp_path / "nonexistent", "does not exist"),
        (no_layers, "how many layers"),
        (no_weights, "safetensors"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            client.stub.LoadModel(pb.LoadModelRequest(model=str(bad)), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert said in info.value.details()
        assert client.status().state == "serving"
    chunks = [first, *stream]
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == 150
    assert client.generate(
        pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_tokens=2))
    ).finish_reason
    assert client.status().model_path == str(model)


def test_local_launcher_stops_cleanly_on_sigterm(tiny_model, tmp_path):
    model = tiny_model("llama", 5)
    address = f"127.0.0.1:{free_ports(1)[0]}"
    log = open(tmp_path / "local.log", "wb")  # noqa: SIM115
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_relay",
            "local",
            "-n",
            "2",
            "--model",
            str(model),
            "--grpc-address",
            address,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_serving(address, 120)
        with Client(address, timeout=60) as client:
            assert (
                client.generate(
                    pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(max_tokens=3))
                ).usage.completion_tokens
                >= 0
            )
            ranges = {r.rank: (r.layer_start, r.layer_end - 1) for r in client.status().ranks}
        processes = rank_processes(launcher.pid)
        # Ranks forked from the zygote share its command line; each names itself in ps.
        port = address.rsplit(":", 1)[1]
        titles = {r: " ".join(p.cmdline()).strip() for r, p in processes.items()}
        assert titles == {
            0: "mlx-relay rank 0/2 layers {}-{} :".format(*ranges[0]) + port,
            1: "mlx-relay rank 1/2 layers {}-{}".format(*ranges[1]),
        }
        ranks = [p.pid for p in processes.values()]
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0, (tmp_path / "local.log").read_text()
        _wait_gone(ranks)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        log.close()
