"""The cost of the link: decode tokens/s of 2 ranks across namespaces vs loopback, side by side.

    sudo .venv/bin/python bench/bench_network.py [--tokens 48] [--repeats 3] [--no-tiny]

Every configuration runs in this one invocation with the same model and prompt, each
cluster started by `mlx-relay launch` from a hostfile, each rank pinned to its own core
(rank i -> core i mod cores), standing for one machine:

- loopback: both ranks on 127.0.0.1;
- netns: one rank in each of 2 network namespaces joined by a bridge (veth), started
  through the ssh stand-in of tests/netns.py, uncapped and with each host's outgoing
  traffic capped by `tc tbf` at 10 Gbit/s and at 1 Gbit/s (standing in for Ethernet);
- loopback under `mlx.launch` itself, for the launcher's own CPU use (`--no-mlx-launch`
  to skip), also measured with the cluster idle.

First, without any model: TCP round trips of one token's and of one 512-token prefill
chunk's hidden states over each link (`--links-only` to stop there).

The clusters of one model run side by side (idle ranks sleep) and the requests go
round-robin over them, so load from other processes drifts over all configurations
alike; `mlx.launch` runs alone afterwards, as its launcher spins a core.
It prints decode tokens/s (median of the repeats after a warm-up), the time per token,
what the link adds per token against loopback, and the launcher's own CPU use while the
cluster decodes. The default model spends most of a token computing on this CPU, which
hides the link; so the same table follows for a tiny random model with the same hidden
size (576, so the same bytes cross the link per token) and almost no compute
(`--no-tiny` to skip). Needs root for the namespaces (those rows are skipped otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import psutil  # noqa: E402
from launching import free_port_range  # noqa: E402
from netns import NetnsHosts, unavailable_reason  # noqa: E402

from mlx_relay.client.client import Client, wait_serving  # noqa: E402
from mlx_relay.launch.local import free_ports  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
LOCAL_HOSTS = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


def pin_ranks(pids: list[int]) -> None:
    """Every thread of rank i onto core i (threads made later inherit it)."""
    cores = sorted(os.sched_getaffinity(0))
    for i, pid in enumerate(pids):
        for t in psutil.Process(pid).threads():
            try:
                os.sched_setaffinity(t.id, {cores[i % len(cores)]})
            except OSError:
                pass


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def rank_processes(launcher: int, n: int) -> list[int]:
    """The rank processes under a launcher, in rank order (by MLX_RANK)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = {}
        for p in psutil.Process(launcher).children(recursive=True):
            try:
                rank = p.environ().get("MLX_RANK")
                if rank is not None and "python" in p.name():
                    found[int(rank)] = p.pid
            except psutil.Error:
                continue
        if len(found) == n:
            return [found[r] for r in range(n)]
        time.sleep(0.2)
    raise RuntimeError(f"found only {found} rank processes")


def one_request(address: str, tokens: int) -> float:
    """Decode tokens/s of one streamed request."""
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content=PROMPT)],
        params=pb.SamplingParams(max_tokens=tokens, ignore_eos=True),
    )
    with Client(address, timeout=600) as client:
        first, count = None, 0
        for chunk in client.stream(request):
            count += len(chunk.token_ids)
            if first is None and chunk.token_ids:
                first = time.perf_counter()
        return (count - 1) / (time.perf_counter() - first)


PINGPONG_SERVER = r"""
import socket, sys
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, port)); s.listen(); print("up", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    buf = b""
    while len(buf) < size:
        part = c.recv(size - len(buf))
        if not part:
            sys.exit(0)
        buf += part
    c.sendall(buf)
"""

PINGPONG_CLIENT = r"""
import socket, statistics, sys, time
host, port, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
c = socket.create_connection((host, port)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
msg, times = b"x" * size, []
for i in range(n + 200):
    t0 = time.perf_counter_ns(); c.sendall(msg); got = 0
    while got < size:
        got += len(c.recv(size - got))
    if i >= 200:
        times.append(time.perf_counter_ns() - t0)
times.sort()
print(statistics.median(times) / 1000, times[int(0.9 * len(times))] / 1000)
"""


def pingpong(prefixes: tuple[list[str], list[str]], host: str, size: int, n: int) -> tuple:
    """Median and p90 round trip (us) of `size`-byte messages, server side prefixes[1]."""
    port = 7300
    server = subprocess.Popen(
        [*prefixes[1], sys.executable, "-c", PINGPONG_SERVER, host, str(port), str(size)],
        stdout=subprocess.PIPE,
    )
    try:
        server.stdout.readline()
        out = subprocess.run(
            [
                *prefixes[0],
                sys.executable,
                "-c",
                PINGPONG_CLIENT,
                host,
                str(port),
                str(size),
                str(n),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        return float(out[0]), float(out[1])
    finally:
        server.kill()
        server.wait()


def link_round_trips(hidden: int, chunk: int = 512) -> None:
    """What the link costs, measured without the model: TCP round trips of one decode
    token's hidden states and of one prefill chunk's (rank 0 -> 1 and back), medians."""
    for what, size, n in (
        ("one token's hidden states", hidden * 4, 3000),
        (f"a {chunk}-token prefill chunk's hidden states", chunk * hidden * 4, 100),
    ):
        print(f"TCP round trip of {size} bytes ({what}) each way, {n} samples:")
        rows = [("loopback", pingpong(([], []), "127.0.0.1", size, n))]
        if unavailable_reason() is None:
            for i, (name, rate) in enumerate(
                (("netns veth", None), ("netns 10gbit", "10gbit"), ("netns 1gbit", "1gbit"))
            ):
                with NetnsHosts(2, rate=rate, index=i + 1) as hosts:
                    prefixes = (hosts.prefix(0), hosts.prefix(1))
                    rows.append((name, pingpong(prefixes, hosts.addresses[1], size, n)))
        base = rows[0][1][0]
        print(f"{'link':<22}{'median us':>12}{'p90 us':>10}{'link +us':>10}{'wire us':>10}")
        for name, (median, p90) in rows:
            rate = {"netns 10gbit": 10e9, "netns 1gbit": 1e9}.get(name)
            wire = f"{2 * size * 8 / rate * 1e6:.1f}" if rate else "-"
            print(f"{name:<22}{median:>12.1f}{p90:>10.1f}{median - base:>+10.1f}{wire:>10}")
        print(flush=True)


class Cluster:
    """A 2-rank cluster started by `mlx-relay launch` (or by `mlx.launch` itself)."""

    def __init__(self, name: str, hosts: list[dict], grpc: str, env: dict, model: str) -> None:
        self.name, self.grpc = name, grpc
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-network-"))
        self.log = open(self.workdir / "launch.log", "wb")  # noqa: SIM115
        self.tps: list[float] = []
        self.cpu = self.wall = 0.0
        self.ranks: list[int] = []
        hostfile = self.workdir / "hosts.json"
        hostfile.write_text(json.dumps({"backend": "ring", "envs": [], "hosts": hosts}))
        base = free_port_range(5) if hosts[0]["ssh"] == "127.0.0.1" else 32323
        if name.endswith("mlx.launch"):
            self.proc = self._mlx_launch(hostfile, base, model)
            return
        cmd = [sys.executable, "-m", "mlx_relay", "launch", "--hostfile", str(hostfile)]
        cmd += ["-p", str(base), "--", "--model", model, "--grpc-address", grpc]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
        )

    def _mlx_launch(self, hostfile: Path, base: int, model: str) -> subprocess.Popen:
        """mlx.launch with stdin a pipe that is never written (its best case)."""
        doorbells = json.dumps([f"tcp://127.0.0.1:{base + 3 + r}" for r in range(2)])
        cmd = [str(Path(sys.executable).parent / "mlx.launch"), "--hostfile", str(hostfile)]
        cmd += ["-p", str(base), "--env", f"MLX_RELAY_SECRET={os.urandom(8).hex()}"]
        cmd += ["--env", f"MLX_RELAY_CONTROL=tcp://127.0.0.1:{base + 2}"]
        cmd += ["--env", f"MLX_RELAY_DOORBELLS={doorbells}", "--", sys.executable, "-m"]
        cmd += ["mlx_relay", "serve", "--model", model, "--grpc-address", self.grpc]
        return subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def ready(self) -> None:
        wait_serving(self.grpc, 600)
        self.ranks = rank_processes(self.proc.pid, 2)
        pin_ranks(self.ranks)
        one_request(self.grpc, 8)  # warm-up

    def measure(self, tokens: int) -> None:
        c0, t0 = cpu_seconds(self.proc.pid), time.perf_counter()
        self.tps.append(one_request(self.grpc, tokens))
        self.cpu += cpu_seconds(self.proc.pid) - c0
        self.wall += time.perf_counter() - t0

    def result(self) -> dict | None:
        if not self.tps:
            return None
        return {"tps": statistics.median(self.tps), "launcher_cpu": self.cpu / self.wall}

    def stop(self) -> None:
        if self.name.endswith("mlx.launch"):
            if self.ranks:  # SIGTERM to mlx.launch itself would orphan them
                os.kill(self.ranks[0], signal.SIGTERM)
                try:
                    self.proc.wait(60)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()
        self.log.close()


def measure_interleaved(clusters: list[Cluster], args: argparse.Namespace) -> None:
    """Round-robin over the clusters so background load drifts over all of them alike."""
    live = []
    for c in clusters:
        try:
            c.ready()
            live.append(c)
        except Exception as e:  # noqa: BLE001
            print(f"{c.name}: failed ({e}); log in {c.workdir}", flush=True)
    for _ in range(args.repeats):
        for c in live:
            c.measure(args.tokens)


def launcher_idle_cpu(model: str, seconds: float = 10.0) -> None:
    """Each launcher's own CPU use while its 2-rank loopback cluster is idle."""
    print(f"launcher CPU while the cluster idles ({seconds:.0f} s, psutil cpu_times):")
    for name in ("mlx-relay launch", "mlx.launch"):
        grpc = f"127.0.0.1:{free_ports(1)[0]}"
        label = "loopback, mlx.launch" if name == "mlx.launch" else "loopback"
        c = Cluster(label, LOCAL_HOSTS, grpc, dict(os.environ), model)
        try:
            c.ready()
            c0, t0 = cpu_seconds(c.proc.pid), time.perf_counter()
            time.sleep(seconds)
            share = (cpu_seconds(c.proc.pid) - c0) / (time.perf_counter() - t0)
            ranks = sum(cpu_seconds(r) for r in c.ranks)
            print(f"  {name:<18}{share * 100:>8.1f}% of a core  (ranks: {ranks:.1f} s CPU so far)")
        finally:
            c.stop()
    print(flush=True)


def run_model(label: str, model: str, args: argparse.Namespace) -> None:
    from mlx_relay.model import sharding
    from mlx_relay.model.default_model import resolve_model

    config = sharding.read_config(resolve_model(model))
    hidden = config.get("hidden_size", 0)
    print(
        f"\n{label}: hidden {hidden}, {sharding.count_layers(config)} layers, "
        f"{args.tokens} tokens x {args.repeats}, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    clusters: list[Cluster] = []
    with contextlib.ExitStack() as stack:
        grpc = f"127.0.0.1:{free_ports(1)[0]}"
        clusters.append(Cluster("loopback", LOCAL_HOSTS, grpc, dict(os.environ), model))
        reason = unavailable_reason()
        if reason:
            print(f"namespaces skipped: {reason}")
        else:
            for i, (name, rate) in enumerate(
                (("netns veth", None), ("netns 10gbit", "10gbit"), ("netns 1gbit", "1gbit"))
            ):
                hosts = stack.enter_context(NetnsHosts(2, rate=rate, index=i + 1))
                clusters.append(
                    Cluster(
                        name,
                        hosts.hostfile()["hosts"],
                        f"{hosts.addresses[0]}:50051",
                        hosts.env_with_ssh(),
                        model,
                    )
                )
        try:
            measure_interleaved(clusters, args)
        finally:
            for c in clusters:
                c.stop()
    if not args.no_mlx_launch:  # alone: its spinning launcher would slow the others
        grpc = f"127.0.0.1:{free_ports(1)[0]}"
        c = Cluster("loopback, mlx.launch", LOCAL_HOSTS, grpc, dict(os.environ), model)
        try:
            measure_interleaved([c], args)
        finally:
            c.stop()
        clusters.append(c)

    results = {c.name: c.result() for c in clusters}
    base = results["loopback"]
    wire = 2 * hidden * 4  # rank 0 -> 1 and back: one token's float32 hidden states
    print(f"{'config':<22}{'decode tok/s':>14}{'ms/token':>10}{'link +ms':>10}{'launcher CPU':>14}")
    for name, r in results.items():
        if r is None:
            print(f"{name:<22}{'failed':>14}")
            continue
        ms = 1000 / r["tps"]
        extra = f"{ms - 1000 / base['tps']:+.2f}" if base else "-"
        print(f"{name:<22}{r['tps']:>14.2f}{ms:>10.2f}{extra:>10}{r['launcher_cpu'] * 100:>13.1f}%")
    print(
        f"on the wire per token: {wire} bytes of hidden states + 2 step headers; serialising "
        f"them takes {wire * 8 / 10e9 * 1e6:.1f} us at 10 Gbit/s, {wire * 8 / 1e9 * 1e6:.1f} us "
        "at 1 Gbit/s",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-mlx-launch", action="store_true")
    ap.add_argument("--no-tiny", action="store_true")
    ap.add_argument("--links-only", action="store_true", help="only the TCP round trips")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # tear-down runs (namespaces)
    print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}", flush=True)
    link_round_trips(576)
    if args.links_only:
        return 0
    run_model(args.model, args.model, args)
    if not args.no_tiny:
        from tiny_models import make_tiny_model

        tiny = make_tiny_model(
            Path(tempfile.mkdtemp(prefix="bench-tiny-")), "llama", num_layers=2, hidden_size=576
        )
        if not args.no_mlx_launch:
            launcher_idle_cpu(str(tiny))
        args.tokens *= 4
        run_model("tiny llama (hidden 576)", str(tiny), args)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
