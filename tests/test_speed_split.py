"""Issue 37: a mixed cluster splits by speed. One CPU rank poses as a machine of its own
(MLX_RELAY_HOST_NAME) and is throttled to a tenth of a core (a CFS bandwidth limit)
from its start, so the probe at load
measures it slower: the default split gives it fewer layers than the balanced split,
and the tokens are still mlx-lm's. Ranks of one machine are never told apart by speed:
the same cluster without the pose keeps the balanced split, however busy the machine."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from oracle import mlx_lm_tokens, tokenizer_for

from mlx_relay.client.client import Client
from mlx_relay.coordinator.requests import encode_text
from mlx_relay.launch.local import LocalCluster, free_ports
from mlx_relay.model.sharding import head_cost_in_layers, read_config
from mlx_relay.model.split import parse_layers
from mlx_relay.protocol import relay_pb2 as pb
from mlx_relay.protocol.control import HOST_NAME_ENV

NUM_LAYERS = 12
SHARE = 0.1  # the throttled rank may run a tenth of the time (its neighbours, sharing
# two cores with another test worker's ranks, still get several times more)
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller, where mounted writable


class Throttle:
    """Hold one process to SHARE of a core: the kernel's CFS bandwidth limit (a cgroup
    of its own, cpu.cfs_quota_us) where this machine lets us make one, else stopping and
    continuing it on a duty cycle from a thread, as `cpulimit` does (less exact under
    load: the thread itself must get the CPU on time)."""

    PERIOD_US = 20_000

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._group = CGROUP_CPU / f"mlx-relay-throttle-{pid}"
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Throttle:
        try:
            self._group.mkdir()
            (self._group / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (self._group / "cpu.cfs_quota_us").write_text(str(int(self.PERIOD_US * SHARE)))
            (self._group / "cgroup.procs").write_text(str(self.pid))
        except OSError:
            self._thread = threading.Thread(target=self._duty_cycle, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._thread is not None:
            self._done.set()
            self._thread.join(5)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
        if self._group.exists():
            with contextlib.suppress(OSError):  # (its process back where it was)
                (CGROUP_CPU / "cgroup.procs").write_text(str(self.pid))
            with contextlib.suppress(OSError):
                self._group.rmdir()

    def _duty_cycle(self) -> None:
        on = self.PERIOD_US * SHARE / 1e6
        while not self._done.is_set():
            try:
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.PERIOD_US / 1e6 - on)
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                return
            time.sleep(on)


@pytest.fixture
def model(tiny_model):
    return tiny_model("llama", NUM_LAYERS)


def _counts(client: Client) -> list[int]:
    return [r.layer_end - r.layer_start for r in client.status().ranks]


def test_a_throttled_rank_gets_fewer_layers(model, tmp_path):
    address = f"127.0.0.1:{free_ports(1)[0]}"
    cluster = LocalCluster(
        3,
        # A tenth of a core can keep the rank's heartbeat thread off the CPU for seconds on
        # a busy machine (CI's 3 s default failed it once); liveness is not what this tests.
        ["--model", str(model), "--heartbeat-timeout", "60"],
        grpc_address=address,
        log_dir=tmp_path,
        rank_env={2: {HOST_NAME_ENV: "slow-mac"}},
    )
    cluster.start()
    try:
        with Throttle(cluster.procs[2].pid):  # (from before the load's probe)
            cluster.wait_serving(180)
        client = Client(address, timeout=120)
        counts = _counts(client)
        balanced = parse_layers("balanced", NUM_LAYERS, 3, head_cost_in_layers(read_config(model)))
        assert counts[2] < balanced[2], (counts, balanced)
        reply = client.generate(
            pb.GenerateRequest(prompt="Once upon a time", params=pb.SamplingParams(max_tokens=10))
        )
        prompt = encode_text(tokenizer_for(model), "Once upon a time")
        assert list(reply.token_ids) == mlx_lm_tokens(model, prompt, 10)
        client.close()
        print(f"\nthrottled rank 2: layers {counts}, balanced {balanced}")
    finally:
        cluster.stop()


def test_ranks_of_one_machine_keep_the_balanced_split(model, cluster_factory):
    """Throttled or not, ranks with one host name are one machine's: nothing is probed."""
    running = cluster_factory(model, 2)
    balanced = parse_layers("balanced", NUM_LAYERS, 2, head_cost_in_layers(read_config(model)))
    assert _counts(running.client) == balanced
    assert "layers by speed" not in running.logs()
