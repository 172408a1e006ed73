"""Helpers for tests that start clusters with `mlx-relay launch` or `mlx.launch`."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil

from mlx_relay.client.client import wait_serving
from mlx_relay.launch.local import port_range
from mlx_relay.protocol import relay_pb2 as pb

MESSAGES = [{"role": "user", "content": "Name three rivers and one café 🙂."}]
MLX_RELAY = [sys.executable, "-m", "mlx_relay"]


def free_port_range(k: int) -> int:
    """A base port P with P..P+k-1 free on loopback now (ring, side channel, doorbells),
    below the kernel's ephemeral range so no outgoing connection takes one meanwhile, and
    in this test worker's own share (`port_range`: MLX_RELAY_PORTS, set in conftest)."""
    low, high = port_range()
    for _ in range(200):
        base = random.randrange(low, max(high - k, low + 1))
        socks = []
        try:
            for port in range(base, base + k):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def localhost_hostfile(tmp_path: Path, n: int, backend: str = "ring") -> Path:
    host = {"ssh": "127.0.0.1"} if backend == "mpi" else {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}
    path = tmp_path / f"localhost-{n}-{backend}.json"
    path.write_text(json.dumps({"backend": backend, "envs": [], "hosts": [host] * n}))
    return path


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def rank_processes(launcher: int) -> dict[int, psutil.Process]:
    """A launcher's running rank processes by rank: the descendants `serve` named
    mlx-relay-rN (`local`'s ranks are its zygote's children on Linux, elsewhere its own)."""
    ranks = {}
    for p in psutil.Process(launcher).children(recursive=True):
        try:
            named = re.fullmatch(r"mlx-relay-r(\d+)", p.name())
            if named and p.status() != psutil.STATUS_ZOMBIE:
                ranks[int(named.group(1))] = p
        except psutil.NoSuchProcess:
            continue
    return ranks


def rank_pids(launcher: int) -> list[int]:
    return [p.pid for p in psutil.Process(launcher).children(recursive=True)]


class Launched:
    """`mlx-relay launch` as a subprocess, as a user runs it."""

    def __init__(
        self,
        tmp_path: Path,
        hostfile: Path,
        serve: list[str],
        n_ports: int,
        launch_args: tuple[str, ...] = (),
    ) -> None:
        self.grpc = f"127.0.0.1:{free_port_range(1)}"
        self.out = tmp_path / "launch.out"
        self.err = tmp_path / "launch.err"
        cmd = [
            *MLX_RELAY,
            "launch",
            "--hostfile",
            str(hostfile),
            "-p",
            str(free_port_range(n_ports)),
            *launch_args,
        ]
        cmd += ["--", *serve, "--grpc-address", self.grpc]
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        self.ranks: list[int] = []

    def logs(self) -> str:
        return f"--- stdout\n{self.out.read_text()[-3000:]}\n--- stderr\n{self.err.read_text()[-6000:]}"

    def wait_serving(self, timeout: float = 120) -> None:
        def check() -> None:
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited {self.proc.returncode}\n{self.logs()}")

        wait_serving(self.grpc, timeout, check=check)
        self.ranks = rank_pids(self.proc.pid)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            for pid in self.ranks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def chat_request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in MESSAGES],
        params=pb.SamplingParams(max_tokens=max_tokens),
    )
