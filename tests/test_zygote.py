"""The rank zygote (`mlx_relay/launch/zygote.py`): a child it forks runs `python -m` as a
fresh interpreter would (argv, environment, working directory, inherited descriptors,
output, exit status), answers like `subprocess.Popen`, and dies with its launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from mlx_relay.launch import zygote

pytestmark = pytest.mark.skipif(not zygote.enabled(), reason="the zygote forks on Linux only")

PROBE = """
import json, os, sys
fd = int(os.environ["PROBE_FD"])
print(json.dumps({
    "argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("PROBE"),
    "inherited": os.environ.get("ONLY_THE_LAUNCHERS") is None,
    "fd_open": os.get_inheritable(fd), "session": os.getsid(0) == os.getpid(),
    "preloaded": "transformers" in sys.modules, "mlx_before": "mlx" in sys.modules,
}), flush=True)
os.write(fd, b"through the inherited descriptor")
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def forks():
    z = zygote.Zygote()
    yield z
    z.close()


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "probe.py").write_text(textwrap.dedent(PROBE))
    return tmp_path


def test_a_child_runs_python_dash_m_with_what_it_was_given(forks, probe, monkeypatch):
    read, write = os.pipe()
    monkeypatch.setenv("ONLY_THE_LAUNCHERS", "1")
    env = {"PYTHONPATH": str(probe), "PROBE": "yes", "PROBE_FD": str(write)}
    monkeypatch.chdir(probe)
    child = forks.spawn("probe", ["3", "x"], env=env, pass_fds=(write,))
    os.close(write)
    said = json.loads(child.stdout.readline())
    assert child.wait(30) == 3 and child.poll() == 3 and child.returncode == 3
    assert said == {
        "argv": ["3", "x"],
        "cwd": str(probe),
        "env": "yes",
        "inherited": True,  # only the environment it was given
        "fd_open": True,
        "session": True,  # its own session, as the ranks Popen starts
        "preloaded": True,
        "mlx_before": False,
    }
    assert os.read(read, 100) == b"through the inherited descriptor"
    os.close(read)


def test_an_exception_is_exit_1_with_its_traceback_and_a_signal_is_negative(forks, tmp_path):
    (tmp_path / "boom.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    env = {"PYTHONPATH": str(tmp_path)}
    boom = forks.spawn("boom", [], env=env)
    assert boom.wait(30) == 1
    assert b"RuntimeError: boom" in boom.stdout.read()
    sleeper = forks.spawn("sleeper", [], env=env)
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.2)
    sleeper.kill()
    assert sleeper.wait(30) == -signal.SIGKILL
    sleeper.kill()  # (ended: nothing to signal, as with Popen)


def test_children_end_with_the_zygotes_launcher(tmp_path):
    """A launcher killed with SIGKILL: its zygote reads end-of-file and leaves, and the
    children get SIGTERM (their parent-death signal)."""
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    launcher = textwrap.dedent(f"""
        import time
        from mlx_relay.launch import zygote
        z = zygote.Zygote()
        child = z.spawn("sleeper", [], env={{"PYTHONPATH": {str(tmp_path)!r}}})
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE)
    pid = int(proc.stdout.readline())
    assert psutil.pid_exists(pid)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child outlived its launcher"
        time.sleep(0.05)


def test_a_closed_zygote_says_so_and_local_spawns_instead(tmp_path):
    """`spawn` on a zygote that has ended raises ZygoteError, which `local` answers by
    starting that rank with Popen (`LocalCluster._forked` returns None)."""
    from mlx_relay.launch.lifeline import Lifeline
    from mlx_relay.launch.local import LocalCluster

    z = zygote.Zygote()
    z.close()
    deadline = time.monotonic() + 10
    while z.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(zygote.ZygoteError):
        z.spawn("json.tool", [], env={})
    cluster = LocalCluster(1, [])
    cluster._lifeline = Lifeline()
    try:
        assert cluster._forked(z, 0, [sys.executable, "-m", "mlx_relay", "serve"], {}) is None
    finally:
        cluster._lifeline.close()


def test_a_pinned_child_runs_on_its_core(forks, tmp_path):
    """`local --pin`: the core goes with the request and the child sets it first."""
    (tmp_path / "cores.py").write_text("import os\nprint(sorted(os.sched_getaffinity(0)))\n")
    core = max(os.sched_getaffinity(0))
    child = forks.spawn("cores", [], env={"PYTHONPATH": str(tmp_path)}, cpu=core)
    assert child.wait(30) == 0
    assert child.stdout.read().decode().strip() == f"[{core}]"


def test_a_thread_beside_the_preloads_is_counted_by_name():
    """The zygote refuses to fork once any thread but its own runs (a preload that
    started one); the refusal names them, read from /proc, native ones included. In a
    process of its own, where no other thread comes and goes."""
    script = textwrap.dedent(
        """
        import json, threading
        from mlx_relay.launch import zygote
        alone = zygote._other_threads()
        stop = threading.Event()
        extra = threading.Thread(target=stop.wait)
        extra.start()
        print(json.dumps([alone, zygote._other_threads()]))
        stop.set()
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    alone, beside = json.loads(out.stdout)
    assert alone == []
    assert len(beside) == 1 and beside[0]  # (its name: a Python thread has the process's)


def test_where_torch_is_installed_the_tokenizer_classes_are_left_to_the_ranks(tmp_path):
    """transformers' tokenizer classes import PyTorch where it is installed, and PyTorch
    starts a thread (the zygote then cannot fork): with a `torch` package findable, the
    preload leaves them (and imports no torch); without one it loads them."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('not to be imported')\n")
    (tmp_path / "torch-2.9.0.dist-info").mkdir()  # (transformers reads its version here)
    (tmp_path / "torch-2.9.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0\n"
    )
    script = textwrap.dedent(
        """
        import json, sys
        from mlx_relay.launch import zygote
        zygote._preload()
        print(json.dumps(["transformers.models.auto.tokenization_auto" in sys.modules,
                          "torch" in sys.modules]))
        """
    )
    found = {}
    for torch_installed in (False, True):
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        if torch_installed:
            env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
        )
        assert out.returncode == 0, out.stderr
        found[torch_installed] = json.loads(out.stdout)
    assert found == {False: [True, False], True: [False, False]}
