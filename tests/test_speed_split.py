"""Issue 37: a mixed cluster splits by speed. One CPU rank is throttled (stopped and
continued on a duty cycle, as `cpulimit` does) from its start, so the probe at load
measures it slower: the default split gives it fewer layers than the balanced split,
and the tokens are still mlx-lm's."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from oracle import mlx_lm_tokens, tokenizer_for

from mlx_relay.client.client import Client
from mlx_relay.coordinator.requests import encode_text
from mlx_relay.launch.local import LocalCluster, free_ports
from mlx_relay.model.sharding import head_cost_in_layers, read_config
from mlx_relay.model.split import layer_ranges, parse_layers
from mlx_relay.protocol import relay_pb2 as pb

NUM_LAYERS = 12
ON_S, OFF_S = 0.002, 0.006  # the throttled rank runs a quarter of the time


class Throttle:
    """Stop and continue one process on a duty cycle until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Throttle:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join(5)
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(OFF_S)
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                return
            time.sleep(ON_S)


@pytest.fixture
def model(tiny_model):
    return tiny_model("llama", NUM_LAYERS)


def test_a_throttled_rank_gets_fewer_layers(model, tmp_path):
    address = f"127.0.0.1:{free_ports(1)[0]}"
    cluster = LocalCluster(3, ["--model", str(model)], grpc_address=address, log_dir=tmp_path)
    cluster.start()
    try:
        with Throttle(cluster.procs[2].pid):  # (from before the load's probe)
            cluster.wait_serving(180)
        client = Client(address, timeout=120)
        got = [(r.layer_start, r.layer_end) for r in client.status().ranks]
        counts = [end - start for start, end in got]
        balanced = parse_layers("balanced", NUM_LAYERS, 3, head_cost_in_layers(read_config(model)))
        assert counts[2] < balanced[2], (got, layer_ranges(balanced))
        reply = client.generate(
            pb.GenerateRequest(prompt="Once upon a time", params=pb.SamplingParams(max_tokens=10))
        )
        prompt = encode_text(tokenizer_for(model), "Once upon a time")
        assert list(reply.token_ids) == mlx_lm_tokens(model, prompt, 10)
        client.close()
        print(f"\nthrottled rank 2: layers {counts}, balanced {balanced}")
    finally:
        cluster.stop()
