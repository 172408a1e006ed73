"""--stage-weights in one process: a worker's share of a checkpoint cut into units, the
transfer from rank 0's blob server (resumed, refused, checked), and a worker's staging
(kept, fetched again, refused for disk), each through the real code the ranks run."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest
from tiny_models import make_tiny_model

from mlx_relay.coordinator.staging import DigestCache, progress_line
from mlx_relay.model import checkpoint, sharding
from mlx_relay.model.shard_files import GLOBAL_UNIT, worker_units
from mlx_relay.protocol import control
from mlx_relay.transport import blobs
from mlx_relay.transport.blobs import BlobServer, FetchError
from mlx_relay.worker.staging import Stager, StagingError

SECRET = b"s3cret"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama-6"), "llama", num_layers=6)


@pytest.fixture
def server():
    s = BlobServer("127.0.0.1", SECRET)
    yield s
    s.close()


def _offer(server: BlobServer, model: Path, start: int, end: int) -> list[dict]:
    listed = []
    for unit in worker_units(model, start, end):
        digest = unit.digest()
        server.offer(digest, unit.size, unit.read)
        listed.append({"name": unit.name, "digest": digest, "size": unit.size})
    return listed


def test_a_workers_units_hold_its_layers_and_nothing_of_rank_0(model):
    units = worker_units(model, 2, 5)
    assert [u.name for u in units] == ["layer-00002", "layer-00003", "layer-00004"]
    source = checkpoint.tensors(model)
    names = {name for u in units for name, _ in u.tensors}
    assert names == {n for n in source if checkpoint.layer_of(n) in (2, 3, 4)}
    # A composed file is a safetensors file mx.load reads back to the checkpoint's tensors.
    whole = {}
    for f in model.glob("*.safetensors"):
        whole.update(mx.load(str(f)))
    for unit in units:
        data = unit.read(0, unit.size)
        assert len(data) == unit.size
        scratch = model.parent / f"{unit.name}.safetensors"
        scratch.write_bytes(data)
        for name, array in mx.load(str(scratch)).items():
            assert mx.array_equal(array, whole[name]).item(), name
        scratch.unlink()
    # Reading from anywhere gives the same bytes as reading the whole.
    unit = units[1]
    whole_bytes = unit.read(0, unit.size)
    assert unit.read(7, 1000) == whole_bytes[7:1007]
    assert unit.read(unit.size - 5, 100) == whole_bytes[-5:]


def test_tensors_outside_the_layers_go_to_rank_0_unless_a_worker_needs_them(model):
    from mlx_relay.model.shard_files import rank0_parts, rank0_tensor

    own = rank0_parts(sharding.read_config(model))
    assert rank0_tensor("model.embed_tokens.weight", own)
    assert rank0_tensor("model.norm.weight", own)
    assert rank0_tensor("lm_head.weight", own)
    assert rank0_tensor("vision_tower.encoder.layers.0.mlp.fc1.weight", own)
    assert not rank0_tensor("model.rotary_emb.inv_freq", own)
    assert all(u.name != GLOBAL_UNIT for u in worker_units(model, 0, 6))


def test_digests_are_computed_once_per_checkpoint(model, tmp_path):
    units = worker_units(model, 0, 3)
    cache = DigestCache(tmp_path / "digests.json")
    first = cache.digests(units)
    assert first == [u.digest() for u in units]
    again = DigestCache(tmp_path / "digests.json")  # (as a relaunch reads it)
    assert again._known == cache._known
    assert again.digests(units) == first
    # Entries of checkpoints that are gone are dropped.
    cache._known["gone"] = {"digest": "0" * 64, "file": str(tmp_path / "deleted.safetensors")}
    cache._save()
    assert "gone" not in DigestCache(tmp_path / "digests.json")._known


def test_a_fetch_resumes_where_it_stopped_and_checks_the_digest(model, server, tmp_path):
    unit = worker_units(model, 1, 2)[0]
    digest = unit.digest()
    server.offer(digest, unit.size, unit.read)
    endpoint = f"tcp://127.0.0.1:{server.port}"
    into = tmp_path / "unit.safetensors"
    # A transfer cut off after 1,000 bytes left its part file behind.
    (tmp_path / "unit.safetensors.part").write_bytes(unit.read(0, 1000))
    seen: list[int] = []
    moved = blobs.fetch(endpoint, SECRET, digest, unit.size, into, seen.append)
    assert moved == unit.size - 1000 and seen[0] == 1000 and seen[-1] == unit.size
    assert into.read_bytes() == unit.read(0, unit.size)
    assert not (tmp_path / "unit.safetensors.part").exists()
    assert oct(into.stat().st_mode & 0o777) == "0o600"
    # A part file whose bytes are not the unit's: the whole is refused and removed.
    (tmp_path / "bad.part").write_bytes(b"x" * 1000)
    with pytest.raises(FetchError, match="do not match"):
        blobs.fetch(endpoint, SECRET, digest, unit.size, tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.part").exists()


def test_a_stranger_gets_no_weights(model, server, tmp_path):
    listed = _offer(server, model, 0, 1)
    endpoint = f"tcp://127.0.0.1:{server.port}"
    blobs.REPLY_TIMEOUT_S, saved = 2.0, blobs.REPLY_TIMEOUT_S
    try:
        with pytest.raises(FetchError):
            blobs.fetch(endpoint, b"wrong", listed[0]["digest"], listed[0]["size"], tmp_path / "f")
    finally:
        blobs.REPLY_TIMEOUT_S = saved
    with pytest.raises(FetchError, match="not offered"):
        blobs.fetch(endpoint, SECRET, "0" * 64, 10, tmp_path / "g")


def _stage(model: Path, server: BlobServer, start: int, end: int, **doc) -> tuple[Stager, Path]:
    reports: list[dict] = []
    stager = Stager(1, SECRET, "127.0.0.1", reports.append)
    document = {
        "port": server.port,
        "config": (model / "config.json").read_text(),
        "keep_free": 0,
        "ranks": {"1": _offer(server, model, start, end)},
        **doc,
    }
    stager.start(document)
    try:
        view = stager.wait()
    except StagingError:
        view = None
    assert reports and reports[-1]["state"] in ("staged", "failed")
    return stager, view


def test_a_worker_stages_keeps_and_fetches_again_what_changed(model, server, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_RELAY_CACHE", str(tmp_path / "cache"))
    stager, view = _stage(model, server, 2, 5)
    p = stager.progress
    assert p.state == "staged" and p.fetched == p.total > 0 and p.reused == 0
    # The view loads as the worker's stage: only its layers, the same weights.
    shard = sharding.load_shard(view, 2, 5, has_ends=False, partial=True)
    full = sharding.load_shard(model, 2, 5, has_ends=False)
    from mlx.utils import tree_flatten

    got, want = (
        dict(tree_flatten(shard.model.parameters())),
        dict(tree_flatten(full.model.parameters())),
    )
    assert got.keys() == want.keys()
    assert all(mx.array_equal(got[k], want[k]).item() for k in want)
    # Files readable by the serving user only.
    store = tmp_path / "cache" / "shards" / "blobs"
    assert all(f.stat().st_mode & 0o077 == 0 for f in store.iterdir())
    assert store.stat().st_mode & 0o077 == 0
    # Again: nothing fetched.
    stager, again = _stage(model, server, 2, 5)
    assert again == view and stager.progress.fetched == 0
    assert stager.progress.reused == stager.progress.total
    # Another split: only the layer it lacks.
    stager, _ = _stage(model, server, 1, 5)
    assert stager.progress.fetched == worker_units(model, 1, 2)[0].size
    # A flipped byte: that file again, and only it.
    victim = sorted(store.iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    stager, _ = _stage(model, server, 1, 5)
    assert stager.progress.fetched == len(data)
    assert blobs.file_digest(victim) == victim.name.removesuffix(".safetensors")


def test_a_worker_without_the_disk_refuses_before_fetching(model, server, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_RELAY_CACHE", str(tmp_path / "cache"))
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    stager, view = _stage(model, server, 0, 3, keep_free=free)
    assert view is None and stager.progress.state == "failed"
    assert "needs" in stager.progress.error and "keeping" in stager.progress.error
    assert not list((tmp_path / "cache" / "shards" / "blobs").iterdir())
    with pytest.raises(StagingError, match="staging failed: its shard needs"):
        stager.wait()


def test_progress_reads_as_a_bar():
    line = progress_line(
        {"state": "fetching", "total": 4e9, "ready": 1e9, "fetched": 1e9, "seconds": 2.0}
    )
    assert line.startswith("[######------------------] 1.0 GB of 4.0 GB fetching"), line
    assert "500.0 MB/s, 6 s left" in line


def test_versions_that_differ_are_named():
    mine = control.versions()
    assert mine["mlx"] and mine["mlx-lm"] and mine["mlx-relay"]
    assert control.version_differences(mine, dict(mine)) == []
    other = {**mine, "mlx": "0.0.1"}
    assert control.version_differences(mine, other) == [f"mlx {mine['mlx']} on rank 0, 0.0.1 there"]


def test_rank_0_refuses_a_rank_with_other_versions_naming_it():
    """The real hub and the check rank 0 makes after every hello (pipeline.hub_ready)."""
    import zmq

    from mlx_relay.coordinator.pipeline import hub_ready
    from mlx_relay.launch.local import free_ports
    from mlx_relay.transport.hub import ControlHub

    port = free_ports(1)[0]
    hub = ControlHub(f"tcp://127.0.0.1:{port}", world_size=2, secret=SECRET)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, control.identity(1, "cmd"))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        hello = {"rank": 1, "host": "mac-2", "pid": 1, "versions": control.versions()}
        sock.send_multipart(control.encode(control.HELLO, hello, SECRET))
        hub_ready(hub, 2, timeout=5)  # the same versions: taken
        older = {**control.versions(), "mlx-lm": "0.20.0"}
        sock.send_multipart(control.encode(control.HELLO, {**hello, "versions": older}, SECRET))
        assert hub.wait_for(lambda: hub.snapshot()[1].versions == older, timeout=5)
        with pytest.raises(RuntimeError) as refused:
            hub_ready(hub, 2, timeout=5)
        assert str(refused.value).startswith("rank 1 (mac-2) would not give rank 0's tokens: ")
        assert f"mlx-lm {control.versions()['mlx-lm']} on rank 0, 0.20.0 there" in str(
            refused.value
        )
    finally:
        sock.close(0)
        hub.close()


KILLED_FETCH = """
import sys
from pathlib import Path
from mlx_relay.transport import blobs
blobs.fetch(sys.argv[1], sys.argv[2].encode(), sys.argv[3], int(sys.argv[4]), Path(sys.argv[5]))
"""


def test_a_fetch_killed_midway_resumes_from_its_bytes(server, tmp_path):
    """A worker process killed (SIGKILL) while its file arrives; the next fetch sends
    only the rest, and the whole is its digest."""
    import hashlib
    import signal
    import subprocess
    import sys
    import time

    data = os.urandom(48 << 20)
    digest = hashlib.sha256(data).hexdigest()
    server.offer(digest, len(data), lambda offset, n: data[offset : offset + n])
    endpoint = f"tcp://127.0.0.1:{server.port}"
    into = tmp_path / "big.safetensors"
    part = tmp_path / "big.safetensors.part"
    cmd = [sys.executable, "-c", KILLED_FETCH, endpoint, SECRET.decode(), digest]
    worker = subprocess.Popen([*cmd, str(len(data)), str(into)])
    deadline = time.monotonic() + 60
    while not (part.exists() and part.stat().st_size >= 4 << 20):
        assert time.monotonic() < deadline and worker.poll() is None, "it never started"
        time.sleep(0.001)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    kept = part.stat().st_size
    assert 0 < kept < len(data) and not into.exists()
    moved = blobs.fetch(endpoint, SECRET, digest, len(data), into)
    assert moved == len(data) - kept
    assert into.read_bytes() == data


def test_a_new_staging_stops_one_under_way(tmp_path, monkeypatch):
    """Rank 0 gave up on a load (its blob server is gone, so the fetch waits); the next
    CMD_STAGE stops the waiting fetch at once instead of after its reply timeout."""
    import threading
    import time

    import zmq

    monkeypatch.setenv("MLX_RELAY_CACHE", str(tmp_path / "cache"))
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # (takes requests, never replies)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    stager = Stager(1, SECRET, "127.0.0.1")
    unit = {"name": "layer-00000", "digest": "ab" * 32, "size": 1 << 20}
    document = {"port": port, "config": "{}", "keep_free": 0, "ranks": {"1": [unit]}}
    try:
        stager.start(document)
        deadline = time.monotonic() + 10
        while stager.progress.state != "fetching":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        old = stager.progress
        stopped = threading.Thread(target=stager.start, args=({**document, "ranks": {"1": []}},))
        stopped.start()
        # The old fetch ends for the new staging, not for its reply timeout (60 s): read
        # from its error's words; the deadline (half the reply timeout) only bounds a hang.
        stopped.join(timeout=30)
        assert not stopped.is_alive(), "the old fetch was not stopped"
        assert old.state == "failed", old
        assert "stopped: rank 0 started another staging" in old.error, old.error
    finally:
        silent.close(0)


def test_two_ranks_of_one_machine_fetching_one_file_take_turns(server, tmp_path):
    """A stage's peers in a grid need the same file: two processes fetching it at once
    into one store both end with it whole, the bytes moved once (before, they wrote one
    part file together and the second's rename failed: seen on a 4-rank MPI grid)."""
    import hashlib
    import subprocess
    import sys

    data = os.urandom(24 << 20)
    digest = hashlib.sha256(data).hexdigest()
    server.offer(digest, len(data), lambda offset, n: data[offset : offset + n])
    endpoint = f"tcp://127.0.0.1:{server.port}"
    into = tmp_path / "shared.safetensors"
    cmd = [sys.executable, "-c", KILLED_FETCH + "print('moved')"]
    args = [endpoint, SECRET.decode(), digest, str(len(data)), str(into)]
    both = [subprocess.Popen([*cmd, *args], stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errors = [p.communicate(timeout=120)[1] for p in both]
    assert [p.returncode for p in both] == [0, 0], errors
    assert into.read_bytes() == data
    assert not (tmp_path / "shared.safetensors.part").exists()
