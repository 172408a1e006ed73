"""Test hosts on one machine: N network namespaces with their own addresses on a bridge.

    with NetnsHosts(3, rate="1gbit") as hosts:
        hosts.addresses          # ['10.77.X.1', '10.77.X.2', '10.77.X.3']
        hosts.run(0, ["ip", "addr"])
        hosts.ssh_dir            # put first on PATH: `ssh <address> cmd` runs cmd in that host

Each host is a namespace with a veth pair whose other end is in a bridge in the root
namespace; the bridge has the subnet's .254 address, so the root namespace (a test's
gRPC client) reaches every host. `rate` caps each host's outgoing traffic with `tc tbf`
(standing in for an Ethernet link; `netem` is not in these kernels). The addresses are
private ones on this machine only, in namespaces the helper creates and always removes;
leftovers of a killed run (the creator's pid is in every name) are removed next time.

The `ssh` stand-in takes ssh's command line (`ssh [-tt] [-o opt] host command`, what
`mlx.launch` and `mlx-relay launch` run) and `exec`s `ip netns exec <ns> bash -c command`
for the namespace owning `host`, so the rank process keeps the pid the launcher started.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

LOCK = Path(tempfile.gettempdir()) / "mlx-relay-netns.lock"
NETNS_DIR = Path("/run/netns")
NAME_RE = re.compile(r"^mr(\d+)[a-z]?h(\d+)$")


class NetnsUnavailable(RuntimeError):
    """This machine does not let the tests make namespaces (why is the message)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def unavailable_reason() -> str | None:
    """None if namespaces, veth, bridges and tbf work here; else why not."""
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    if shutil.which("tc") is None:
        return "'tc' (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"mr{os.getpid()}h99"
    try:
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"'ip netns add' failed: {r.stderr.strip()}"
        # (both ends named by this process: every pytest-xdist worker probes at once while
        # collecting, and a shared peer name made all but one see "File exists" and skip)
        r = _ip(
            "link", "add", f"mrp{os.getpid()}", "type", "veth",
            "peer", "name", f"mrq{os.getpid()}", check=False,
        )  # fmt: skip
        if r.returncode != 0:
            return f"cannot create a veth pair: {r.stderr.strip()}"
        _ip("link", "del", f"mrp{os.getpid()}", check=False)
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Remove namespaces and bridges left by test runs whose process is gone."""
    for ns in NETNS_DIR.glob("mr*h*") if NETNS_DIR.exists() else []:
        m = NAME_RE.match(ns.name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_inside(ns.name)
            _ip("netns", "del", ns.name, check=False)
    links = _ip("-o", "link", "show", "type", "bridge", check=False).stdout
    for m in re.finditer(r"^\d+: (mrb(\d+)[a-z]?)[:@]", links, re.M):
        if not _pid_alive(int(m.group(2))):
            _ip("link", "del", m.group(1), check=False)


def _kill_inside(ns: str) -> None:
    """SIGKILL every process in namespace `ns` (`ip netns del` would leave them running)."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


def _used_subnets() -> set[int]:
    out = _ip("-o", "-4", "addr", "show", check=False).stdout
    return {int(m.group(1)) for m in re.finditer(r"inet 10\.77\.(\d+)\.", out)}


def _burst_bytes(rate: str) -> int:
    """A bucket of 2 ms of traffic: small enough that a burst cannot hide the cap, and at
    least 128 KiB, since tbf drops packets larger than its bucket (GSO makes up to 64 KiB)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected e.g. 1gbit, 100mbit")
    bits = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return max(128 * 1024, int(bits / 8 / 500))


class NetnsHosts:
    """N namespaces `mr<pid>h<i>` on bridge `mrb<pid>`, subnet 10.77.<k>.0/24.

    `index` (1-25) lets one process hold several sets at once: `mr<pid><letter>h<i>`.
    """

    def __init__(self, n: int, rate: str | None = None, index: int = 0) -> None:
        self.n = n
        self.rate = rate
        self.index = index
        self.tag = f"{os.getpid()}{chr(ord('a') + index) if index else ''}"
        self.bridge = f"mrb{self.tag}"
        self.namespaces = [f"mr{self.tag}h{i}" for i in range(n)]
        self.addresses: list[str] = []
        self.gateway = ""
        self.ssh_dir: Path | None = None
        self._created: list[str] = []

    # ---------------------------------------------------------------- set-up
    def create(self) -> NetnsHosts:
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        LOCK.touch(exist_ok=True)
        with open(LOCK) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test runs pick distinct subnets
            remove_stale()
            free = [k for k in range(1, 250) if k not in _used_subnets()]
            if not free:
                raise NetnsUnavailable("no free 10.77.k.0/24 subnet left")
            k = free[(os.getpid() + self.index) % len(free)]
            net = ipaddress.ip_network(f"10.77.{k}.0/24")
            self.addresses = [str(net[i + 1]) for i in range(self.n)]
            self.gateway = str(net[254])
            try:
                self._create_links(net)
            except BaseException:
                self.destroy()
                raise
        self._write_ssh_standin()
        return self

    def _create_links(self, net: ipaddress.IPv4Network) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append("bridge")
        _ip("addr", "add", f"{self.gateway}/{net.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            self._created.append(ns)
            outer = f"mrv{self.tag}x{i}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            inside = ["ip", "netns", "exec", ns]
            _run(
                [
                    *inside,
                    "ip",
                    "addr",
                    "add",
                    f"{self.addresses[i]}/{net.prefixlen}",
                    "dev",
                    "eth0",
                ]
            )
            _run([*inside, "ip", "link", "set", "eth0", "up"])
            _run([*inside, "ip", "link", "set", "lo", "up"])
            if self.rate:
                _run(
                    [
                        *inside,
                        *("tc", "qdisc", "add", "dev", "eth0", "root", "tbf"),
                        *("rate", self.rate, "burst", str(_burst_bytes(self.rate))),
                        *("latency", "50ms"),
                    ]
                )

    def _write_ssh_standin(self) -> None:
        self.ssh_dir = Path(tempfile.mkdtemp(prefix=f"mr{self.tag}-ssh-"))
        hosts = dict(zip(self.addresses, self.namespaces, strict=True))
        (self.ssh_dir / "hosts.json").write_text(json.dumps(hosts))
        script = self.ssh_dir / "ssh"
        script.write_text(SSH_STANDIN.replace("@HOSTS@", str(self.ssh_dir / "hosts.json")))
        script.chmod(0o755)

    # ---------------------------------------------------------------- use
    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[i]]

    def run(self, i: int, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(i), *cmd], capture_output=True, text=True, **kw)

    def env_with_ssh(self, env: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if env is None else env)
        env["PATH"] = f"{self.ssh_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def hostfile(self, backend: str = "ring") -> dict:
        """An mlx.launch hostfile with one host per namespace, ssh'd into by address."""
        return {
            "backend": backend,
            "envs": [],
            "hosts": [{"ssh": a, "ips": [a]} for a in self.addresses],
        }

    # ---------------------------------------------------------------- tear-down
    def pids_inside(self) -> list[int]:
        pids = []
        for ns in self.namespaces:
            r = _ip("netns", "pids", ns, check=False)
            pids += [int(p) for p in r.stdout.split()]
        return pids

    def destroy(self) -> None:
        """Remove everything made; kills processes still inside (after the test's own stop)."""
        for ns in self.namespaces:
            if ns in self._created:
                _kill_inside(ns)
                _ip("netns", "del", ns, check=False)
        if "bridge" in self._created:
            _ip("link", "del", self.bridge, check=False)
        self._created.clear()
        if self.ssh_dir is not None:
            shutil.rmtree(self.ssh_dir, ignore_errors=True)
            self.ssh_dir = None

    def __enter__(self) -> NetnsHosts:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


SSH_STANDIN = r"""#!/usr/bin/env python3
# ssh stand-in for network-namespace test hosts: runs the command in the host's namespace.
import json, os, sys
args, i = sys.argv[1:], 0
with_value = {"-o", "-p", "-l", "-i", "-F", "-J", "-E", "-b", "-c", "-m", "-S", "-W", "-w"}
while i < len(args) and args[i].startswith("-"):
    i += 2 if args[i] in with_value else 1
if i >= len(args):
    sys.exit("ssh stand-in: no host given")
host, command = args[i], " ".join(args[i + 1:])
hosts = json.load(open("@HOSTS@"))
if host not in hosts:
    sys.exit(f"ssh stand-in: unknown host {host!r} (known: {', '.join(hosts)})")
# No tty here, so the `stty -echo` that mlx.launch sends to a remote tty becomes a no-op.
command = "stty() { :; }; " + command
os.execvp("ip", ["ip", "netns", "exec", hosts[host], "/bin/bash", "-c", command])
"""
