"""Shared fixtures: tiny models made at test time, real clusters of real rank processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from mlx_lm.utils import load_tokenizer  # noqa: E402
from oracle import CACHE_ENV  # noqa: E402
from scripted import CHAT_SCRIPT, MESSAGES, RAW_PROMPT, RAW_SCRIPT, script_model  # noqa: E402
from support import Served  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from mlx_relay.client.client import Client  # noqa: E402
from mlx_relay.coordinator.requests import encode_text  # noqa: E402
from mlx_relay.launch.local import PORTS_ENV, LocalCluster, free_ports, port_range  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """make(family, num_layers, **kw) -> model dir, made once per session per arguments."""
    made: dict[tuple, Path] = {}

    def make(family: str = "llama", num_layers: int = 5, **kwargs) -> Path:
        key = (family, num_layers, tuple(sorted(kwargs.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}-{num_layers}")
            made[key] = make_tiny_model(out, family, num_layers=num_layers, **kwargs)
        return made[key]

    return make


class RunningCluster:
    def __init__(self, cluster: LocalCluster, log_dir: Path) -> None:
        self.cluster = cluster
        self.log_dir = log_dir
        self.address = cluster.grpc_address
        self.client = Client(self.address, timeout=120)
        self.localai_address: str | None = None  # (where it serves LocalAI's backend)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.cluster.procs]

    def logs(self) -> str:
        return "\n".join(
            f"--- {f.name}\n{f.read_text(errors='replace')[-4000:]}"
            for f in sorted(self.log_dir.glob("*.log"))
        )

    def stop(self) -> list[int | None]:
        self.client.close()
        return self.cluster.stop()


def start_cluster(
    model: Path | str,
    n: int,
    log_dir: Path,
    *extra: str,
    layers: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 180,
    **options: Any,
) -> RunningCluster:
    """A cluster serving `model`, or an AssertionError with the ranks' logs; `options` go
    to LocalCluster (per-rank environments, auth token, TLS CA)."""
    args = ["--model", str(model), *extra]
    if layers:
        args += ["--layers", layers]
    address = f"127.0.0.1:{free_ports(1)[0]}"
    cluster = LocalCluster(n, args, grpc_address=address, log_dir=log_dir, env=env or {}, **options)
    cluster.start()
    running = RunningCluster(cluster, log_dir)
    try:
        cluster.wait_serving(timeout)
    except Exception as e:
        running.stop()
        raise AssertionError(f"cluster did not start: {e}\n{running.logs()}") from e
    return running


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate (for 127.0.0.1 and localhost) and its key, as PEM files."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key


def assert_gone(pids: list[int]) -> None:
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive, f"rank processes left behind: {alive}"


def stop_cluster(running: RunningCluster) -> None:
    """Stop a test's cluster and check that none of its rank processes is left."""
    running.stop()
    assert_gone(running.pids)


@pytest.fixture
def cluster_factory(tmp_path):
    """start(model, n, *serve_args, layers=None) -> RunningCluster; all stopped afterwards."""
    started: list[RunningCluster] = []

    def start(model, n, *extra, **kwargs) -> RunningCluster:
        running = start_cluster(model, n, tmp_path / f"cluster{len(started)}", *extra, **kwargs)
        started.append(running)
        return running

    yield start
    for running in started:
        stop_cluster(running)


@pytest.fixture(scope="session")
def default_cluster(tmp_path_factory):
    """(RunningCluster, HTTP port): the embedded default model on 2 ranks with the HTTP
    doors and LocalAI's (at `.localai_address`), started once for every module that only
    asks it questions (a default-model cluster takes seconds of both cores to start, and
    a prompt it has seen is not computed again; tests that stop, reload or break a
    cluster start their own)."""
    port, localai = free_ports(2)
    logs = tmp_path_factory.mktemp("default-cluster")
    running = start_cluster(
        "default", 2, logs, "--http-address", f"127.0.0.1:{port}",
        "--localai-address", f"127.0.0.1:{localai}",
    )  # fmt: skip
    running.localai_address = f"127.0.0.1:{localai}"
    yield running, port
    stop_cluster(running)


class ClusterPool:
    """Clusters kept running between tests and modules, one per shape (rank count and
    serve options), each loading the model a test asks for (Free, then LoadModel) when
    it serves another: a test that only asks questions pays a model load (a fraction of
    a second for a tiny model) instead of starting rank processes (seconds of both cores
    each). Tests that stop, break or reconfigure a cluster start their own.

    A cluster found not serving, or with a rank gone, is replaced. At most `max_ranks`
    rank processes stay up (idle ranks cost ~130 MB and no CPU worth the name); the one
    used longest ago goes first."""

    def __init__(self, log_dir: Path, max_ranks: int = 16) -> None:
        self.log_dir = log_dir
        self.max_ranks = max_ranks
        # shape -> (the cluster, the model and layers it serves), in order of last use
        self._clusters: dict[tuple, tuple[RunningCluster, tuple[str, str]]] = {}
        self._started = 0

    def serving(
        self,
        model: Path | str,
        n: int,
        *extra: str,
        layers: str | None = None,
        env: dict[str, str] | None = None,
        fresh: bool = False,
    ) -> RunningCluster:
        """A cluster of `n` ranks started with `extra` (and `env`), serving `model` split
        as `layers`; `fresh` loads the model again even where it is loaded (no prompt
        cache or parked request left from an earlier test)."""
        key = (n, extra, tuple(sorted((env or {}).items())))
        want = (str(model), layers or "")
        running, loaded = self._clusters.pop(key, (None, None))
        if running is not None and not _healthy(running):
            stop_cluster(running)
            running = None
        if running is None:
            self._make_room(n)
            self._started += 1
            log_dir = self.log_dir / f"cluster{self._started}"
            running = start_cluster(model, n, log_dir, *extra, layers=layers, env=env)
        elif fresh or loaded != want:
            running.client.stub.Free(pb.FreeRequest(), timeout=60)
            running.client.stub.LoadModel(
                pb.LoadModelRequest(model=want[0], layers=want[1]), timeout=120
            )
        self._clusters[key] = (running, want)
        return running

    def _make_room(self, n: int) -> None:
        while self._clusters and sum(len(r.pids) for r, _ in self._clusters.values()) + n > (
            self.max_ranks
        ):
            oldest = next(iter(self._clusters))
            stop_cluster(self._clusters.pop(oldest)[0])

    def close(self) -> None:
        while self._clusters:
            stop_cluster(self._clusters.popitem()[1][0])


def _healthy(running: RunningCluster) -> bool:
    if any(p.poll() is not None for p in running.cluster.procs):
        return False
    try:
        status = running.client.status()
    except Exception:  # noqa: BLE001 - any failure to answer means start afresh
        return False
    return status.active_requests == 0 and running.client.serving()


@pytest.fixture(scope="session")
def cluster_pool(tmp_path_factory):
    """The session's ClusterPool: `cluster_pool.serving(model, n, *serve_args, layers=)`."""
    pool = ClusterPool(tmp_path_factory.mktemp("pool"))
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def scripted_http(tmp_path_factory):
    """A 2-rank cluster of the scripted tiny llama (scripted.CHAT_SCRIPT after any chat,
    RAW_SCRIPT after RAW_PROMPT) with its HTTP doors, as a support.Served: one per module."""
    path = make_tiny_model(tmp_path_factory.mktemp("scripted-http"), "llama", num_layers=4)
    tokenizer = load_tokenizer(path)
    chat = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    chat_end = encode_text(tokenizer, chat)[-1]
    raw_end = encode_text(tokenizer, RAW_PROMPT)[-1]
    chains = script_model(path, {chat_end: CHAT_SCRIPT, raw_end: RAW_SCRIPT})
    port = free_ports(1)[0]
    running = start_cluster(
        path, 2, tmp_path_factory.mktemp("logs"), "--http-address", f"127.0.0.1:{port}"
    )
    served = Served(running, path, chains[chat_end], port)
    yield served
    served.http.close()
    stop_cluster(running)


def pytest_configure(config):
    os.environ.setdefault("MLX_RELAY_LOG", "INFO")
    _share_ports(config)
    _share_oracle_answers(config)


def _share_oracle_answers(config) -> None:
    """One directory for the session's mlx-lm answers (tests/oracle.py), made by the
    process that starts the session: pytest-xdist's workers inherit it, so a default-model
    answer one test file computed is not computed again by another on the other worker."""
    if getattr(config, "workerinput", None) is not None or CACHE_ENV in os.environ:
        return
    root = tempfile.mkdtemp(prefix="mlx-relay-oracle-")
    os.environ[CACHE_ENV] = root
    config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))


def _share_ports(config) -> None:
    """On pytest-xdist workers (`make test` runs two) each worker's clusters pick
    ports from a share of the range of their own: a port one worker's cluster let go
    (a rank restarting binds it again) is never another worker's free port meanwhile.
    The range shared is `MLX_RELAY_PORTS` where the run was given one (two runs side by
    side on one machine), else the default range."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return
    index, count = int(worker["workerid"].removeprefix("gw")), int(worker["workercount"])
    low, high = port_range()
    share = (high - low) // count
    os.environ[PORTS_ENV] = f"{low + index * share}-{low + (index + 1) * share}"


def pytest_addoption(parser):
    parser.addoption(
        "--exhaustive",
        action="store_true",
        help="also run the tests marked exhaustive (make test-all)",
    )


# Every file of 10 test-seconds or more, longest first (`pytest --durations=0` of a
# two-worker run on 2 cores, 2026-11-29), handed out in this order where files run on
# two workers at once (`make test`: pytest-xdist, --dist loadfile
# --no-loadscope-reorder): one of these started last would leave the other worker idle
# at the end, and the files after them are short.
LONGEST_FIRST = (
    "test_reliability",  # 93
    "test_default_model_cluster",  # 89
    "test_census_families",  # 68
    "test_families",  # 60
    "test_tensor_parallel",  # 48
    "test_first_hour",  # 44
    "test_mpi",  # 40 (session 40: its 4-rank grids)
    "test_concurrency",  # 36
    "test_launch",  # 35
    "test_netns",  # 32
    "test_memory_guard",  # 32
    "test_cluster",  # 31
    "test_speculation_cluster",  # 29
    "test_clients_e2e",  # 28
    "test_vision_gemma4",  # 27
    "test_multiplier_families",  # 26
    "test_generation",  # 26
    "test_long_prompts",  # 23
    "test_vision_qwen2_vl",  # 21
    "test_hops",  # 21
    "test_prompt_cache",  # 19
    "test_structured",  # 18
    "test_gemma4_small",  # 17
    "test_stage_weights",  # 16
    "test_vision",  # 15
    "test_soak",  # 15
    "test_http_api",  # 15
    "test_tiny_models",  # 13
    "test_lifecycle",  # 13
    "test_localai",  # 12
    "test_speed_split",  # 11
    "test_live_page",  # 11
    "test_default_model",  # 11
    "test_zygote",  # 10
    "test_prompt_store",  # 10
)


def _file_order(item) -> int:
    name = item.path.stem
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """Tests marked `exhaustive` (the rest of a matrix whose cheapest cases the default
    suite runs: each says why its kept cases cover it) run only with --exhaustive, so
    `make test` stays within its time on 2 cores while `make test-all` runs them all.
    On xdist workers the longest files come first (LONGEST_FIRST; each file's tests keep
    their order); one process at a time keeps the files' own order."""
    if hasattr(config, "workerinput"):  # (pytest-xdist: TEST_WORKERS=2 make test)
        items.sort(key=_file_order)
    if config.getoption("--exhaustive"):
        return
    kept, left = [], []
    for item in items:
        (left if item.get_closest_marker("exhaustive") else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
