"""Hostfiles for `mlx.launch`: parse, check, generate (the layer split is `model.split`).

Two formats are understood:

- the `mlx.launch --hostfile` format (mlx 0.32.4, `mlx/_distributed_utils/common.py`
  `Hostfile.from_file`): a JSON list of hosts `[{"ssh": ..., "ips": [...], "rdma": [...]}]`
  or an object `{"backend": ..., "envs": [...], "hosts": [...]}`;
- the ring backend's own `MLX_HOSTFILE` (what `mlx.launch` and mlx-relay's local launcher
  hand to each rank): a JSON list with one list of `"ip:port"` strings per rank.

The rules in `check_hostfile` are the ones `mlx.launch` (`launch_ring`, `launch_jaccl`,
`launch_mpi`, `launch_nccl` in `mlx/_distributed_utils/launch.py`) and the ring backend
(`mlx/distributed/ring/ring.cpp`) enforce, found before any machine is touched.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path

BACKENDS = ("ring", "mpi", "jaccl", "jaccl-ring", "nccl")
# What mlx.launch picks when neither --backend nor the file names one (nccl only with CUDA).
DEFAULT_BACKEND = "ring"
# mlx.launch runs a rank without ssh only when "ssh" is exactly this string.
LOCAL_SSH = "127.0.0.1"
LOCAL_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
OVERS = ("thunderbolt", "ethernet", "local")
# mlx.launch --starting-port default: ring ports, and the jaccl coordinator's port.
DEFAULT_STARTING_PORT = 32323

KIND_LAUNCH = "launch"  # the mlx.launch --hostfile format
KIND_RING_ENV = "ring-env"  # the MLX_HOSTFILE list of "ip:port" lists

_TOP_KEYS = ("backend", "envs", "hosts")
_HOST_KEYS = ("ssh", "ips", "rdma")

RdmaEntry = str | list[str] | None


class HostfileError(ValueError):
    """A hostfile that cannot be read at all; the message names the entry."""


@dataclass
class Host:
    ssh: str
    ips: list[str] = field(default_factory=list)
    # One entry per host (rank order): the RDMA device reaching it, None for itself.
    # A list of names means several cables to that peer. None: no "rdma" key.
    rdma: list[RdmaEntry] | None = None
    # Only for the MLX_HOSTFILE format, where each address carries its port.
    ports: list[int] | None = None


@dataclass
class Hostfile:
    backend: str | None = None
    envs: list[str] = field(default_factory=list)
    hosts: list[Host] = field(default_factory=list)
    kind: str = KIND_LAUNCH


# ---------------------------------------------------------------------------- parsing


def load_hostfile(path: str | Path) -> Hostfile:
    """Read and parse a hostfile; errors name the file and the entry."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise HostfileError(f"{path}: cannot read ({e.strerror or e})") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise HostfileError(f"{path}: not valid JSON ({e}); JSON has no comments") from e
    try:
        return parse_hostfile(data)
    except HostfileError as e:
        raise HostfileError(f"{path}: {e}") from e


def parse_hostfile(data: object) -> Hostfile:
    """Turn decoded JSON into a Hostfile, refusing shapes mlx.launch would choke on.

    Unknown keys are refused too: mlx.launch silently ignores them, so `"ip"` for
    `"ips"` would only show up later as a ring that cannot connect.
    """
    if isinstance(data, dict):
        _no_unknown_keys(data, _TOP_KEYS, "hostfile")
        if "hosts" not in data:
            raise HostfileError("the hostfile object has no 'hosts' list")
        backend = data.get("backend")
        if backend is not None and not isinstance(backend, str):
            raise HostfileError(f"'backend' must be a string, got {backend!r}")
        envs = data.get("envs", [])
        if not isinstance(envs, list) or not all(isinstance(e, str) for e in envs):
            raise HostfileError(f"'envs' must be a list of \"NAME=value\" strings, got {envs!r}")
        hosts = data["hosts"]
        if not isinstance(hosts, list):
            raise HostfileError(f"'hosts' must be a list, got {type(hosts).__name__}")
        return Hostfile(
            backend or None, list(envs), [_parse_host(h, i) for i, h in enumerate(hosts)]
        )
    if isinstance(data, list):
        if data and all(isinstance(r, list) for r in data):
            return Hostfile(
                "ring", [], [_parse_rank(r, i) for i, r in enumerate(data)], KIND_RING_ENV
            )
        return Hostfile(None, [], [_parse_host(h, i) for i, h in enumerate(data)])
    raise HostfileError(
        'a hostfile is a JSON list of hosts [{"ssh": ..., "ips": [...]}], an object '
        '{"backend": ..., "hosts": [...]}, or a list of "ip:port" lists per rank; '
        f"got {type(data).__name__}"
    )


def _no_unknown_keys(obj: dict, known: tuple[str, ...], where: str) -> None:
    for key in obj:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise HostfileError(
                f"{where}: unknown key {key!r}{hint}; known keys: {', '.join(known)}"
            )


def _parse_host(h: object, i: int) -> Host:
    if not isinstance(h, dict):
        raise HostfileError(
            f'hosts[{i}]: expected an object like {{"ssh": "mac1", "ips": ["10.0.0.1"]}}, '
            f"got {json.dumps(h)}"
        )
    ssh = h.get("ssh")
    label = f"hosts[{i}]" + (f" (ssh {ssh!r})" if isinstance(ssh, str) else "")
    _no_unknown_keys(h, _HOST_KEYS, label)
    if "ssh" not in h:
        raise HostfileError(
            f"hosts[{i}]: missing 'ssh' (the host to ssh into; \"127.0.0.1\" runs the rank "
            "locally); mlx.launch needs it for every backend"
        )
    if not isinstance(ssh, str) or not ssh.strip():
        raise HostfileError(f"hosts[{i}]: 'ssh' must be a non-empty string, got {ssh!r}")
    ips = h.get("ips", [])
    if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
        raise HostfileError(f"{label}: 'ips' must be a list of strings, got {json.dumps(ips)}")
    rdma = h.get("rdma")
    if rdma is not None:
        if not isinstance(rdma, list) or not all(_is_rdma_entry(d) for d in rdma):
            raise HostfileError(
                f"{label}: 'rdma' must be a list with one entry per host: null, a device name "
                f'like "rdma_en3", or a list of names; got {json.dumps(rdma)}'
            )
    return Host(ssh, list(ips), list(rdma) if rdma is not None else None)


def _is_rdma_entry(d: object) -> bool:
    return (
        d is None
        or isinstance(d, str)
        or (isinstance(d, list) and all(isinstance(x, str) for x in d))
    )


def _parse_rank(r: list, i: int) -> Host:
    ips, ports = [], []
    for a in r:
        # The ring backend splits at the first ':' (ring.cpp parse_address), so do the same.
        ip, sep, port = a.partition(":") if isinstance(a, str) else ("", "", "")
        if not sep or not port.isdigit():
            raise HostfileError(
                f'rank {i}: {json.dumps(a)} is not "ip:port" (the ring backend splits at '
                "the first ':', so IPv6 addresses cannot be used)"
            )
        ips.append(ip)
        ports.append(int(port))
    return Host("", ips, None, ports)


def hostfile_to_json(hf: Hostfile) -> object:
    """The JSON value for `hf`, in the format it was read from."""
    if hf.kind == KIND_RING_ENV:
        return [[f"{ip}:{p}" for ip, p in zip(h.ips, h.ports or [], strict=True)] for h in hf.hosts]
    hosts = []
    for h in hf.hosts:
        d: dict = {"ssh": h.ssh, "ips": list(h.ips)}
        if h.rdma is not None:
            d["rdma"] = list(h.rdma)
        hosts.append(d)
    if hf.backend is None and not hf.envs:
        return hosts
    return {"backend": hf.backend or "", "envs": list(hf.envs), "hosts": hosts}


def format_hostfile(data: object) -> str:
    """JSON text with one host a line, so a diff shows which host changed."""

    def one(x: object) -> str:
        return json.dumps(x, separators=(", ", ": "))

    if isinstance(data, dict):
        lines = [f"  {json.dumps(k)}: {one(v)}," for k, v in data.items() if k != "hosts"]
        rows = [f"    {one(h)}" for h in data.get("hosts", [])]
        hosts = '  "hosts": [\n' + ",\n".join(rows) + "\n  ]" if rows else '  "hosts": []'
        return "{\n" + "".join(line + "\n" for line in lines) + hosts + "\n}\n"
    if isinstance(data, list) and data:
        return "[\n" + ",\n".join(f"  {one(h)}" for h in data) + "\n]\n"
    return one(data) + "\n"


def ring_addresses(
    hf: Hostfile, *, starting_port: int = DEFAULT_STARTING_PORT, connections_per_ip: int = 1
) -> list[list[str]]:
    """The MLX_HOSTFILE that `mlx.launch` writes for a ring hostfile (`launch_ring`).

    Ports count up from `starting_port` over every rank's ips in order, so ranks sharing
    one machine (127.0.0.1 twice) still get distinct ports.
    """
    if hf.kind == KIND_RING_ENV:
        return hostfile_to_json(hf)  # type: ignore[return-value]
    port = starting_port
    nodes = []
    for i, h in enumerate(hf.hosts):
        if not h.ips:
            raise HostfileError(f"{_label(hf, i)}: ring backend needs 'ips'")
        node = []
        for ip in h.ips:
            for _ in range(connections_per_ip):
                node.append(f"{ip}:{port}")
                port += 1
        nodes.append(node)
    return nodes


# ---------------------------------------------------------------------------- checking


def check_hostfile(
    hf: Hostfile,
    *,
    backend: str | None = None,
    num_layers: int | None = None,
    layers: list[int] | None = None,
) -> list[str]:
    """Every reason `hf` would not start an mlx-relay cluster; empty means OK.

    `backend` overrides the file's, as `mlx.launch --backend` does. `num_layers` and
    `layers` (counts per rank) check that the model's layers can be split over the ranks.
    """
    if hf.kind == KIND_RING_ENV:
        problems = _check_ring_env(hf, backend)
    else:
        problems = _check_launch(hf, backend or hf.backend or DEFAULT_BACKEND)
    return problems + _check_layers(len(hf.hosts), num_layers, layers)


def effective_backend(hf: Hostfile, backend: str | None = None) -> str:
    """The backend mlx.launch would use for `hf` (on a machine without CUDA)."""
    if hf.kind == KIND_RING_ENV:
        return "ring"
    return backend or hf.backend or DEFAULT_BACKEND


def _label(hf: Hostfile, i: int) -> str:
    h = hf.hosts[i]
    if hf.kind == KIND_RING_ENV:
        addrs = ", ".join(f"{ip}:{p}" for ip, p in zip(h.ips, h.ports or [], strict=True))
        return f"rank {i} ({addrs})" if addrs else f"rank {i}"
    return f"hosts[{i}] (ssh {h.ssh!r})"


def _machine(h: Host) -> str:
    """Which machine a host runs on, as far as the file can tell."""
    return "local" if h.ssh in LOCAL_NAMES else h.ssh


def _ip_problem(ip: str) -> str | None:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return f"{ip!r} is not an IP address (mlx.launch uses ips verbatim; give IPv4 addresses)"
    if addr.version == 6:
        return (
            f"{ip!r} is IPv6: mlx joins ip and port as 'ip:port' and splits at the first ':', "
            "so only IPv4 addresses work"
        )
    if addr.is_unspecified or addr.is_multicast:
        return f"{ip!r} is not an address a peer can connect to"
    return None


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def _check_launch(hf: Hostfile, backend: str) -> list[str]:
    problems: list[str] = []
    hosts = hf.hosts
    n = len(hosts)
    if backend not in BACKENDS:
        problems.append(f"unknown backend {backend!r}: mlx.launch accepts {', '.join(BACKENDS)}")
    for k, env in enumerate(hf.envs):
        name, sep, _ = env.partition("=")
        if not name or not all(c.isalnum() or c == "_" for c in name):
            problems.append(
                f"envs[{k}] {env!r}: not NAME=value with a name of letters, digits and _; "
                "mlx.launch drops it with only a warning"
            )
        elif not sep:
            problems.append(f"envs[{k}] {env!r}: no '=' so mlx.launch exports {name} empty")

    if n == 0:
        return problems + ["no hosts: a hostfile needs at least 1 host"]

    for i, h in enumerate(hosts):
        if any(c.isspace() for c in h.ssh):
            problems.append(f"{_label(hf, i)}: 'ssh' contains whitespace")
        for ip in h.ips:
            if p := _ip_problem(ip):
                problems.append(f"{_label(hf, i)}: {p}")

    # The same machine twice is a second rank sharing its memory: on one's own machine
    # that is how a local cluster is made, elsewhere it is a copy-paste slip.
    seen: dict[tuple, int] = {}
    for i, h in enumerate(hosts):
        key = (_machine(h), tuple(h.ips))
        if key in seen and _machine(h) != "local":
            problems.append(
                f"{_label(hf, i)}: same ssh and ips as {_label(hf, seen[key])}: a duplicate "
                "rank on the same machine; list each machine once"
            )
        seen.setdefault(key, i)

    if backend == "ring":
        problems += _check_ring(hf)
    elif backend in ("jaccl", "jaccl-ring"):
        problems += _check_jaccl(hf, ring=backend == "jaccl-ring")
    elif backend == "mpi":
        problems += _check_mpi(hf)
    elif backend == "nccl":
        if not hosts[0].ips:
            problems.append(f"{_label(hf, 0)}: nccl needs rank 0's 'ips' (NCCL_HOST_IP)")
        problems.append(
            "nccl backend: MLX's NCCL backend has no send/recv, which mlx-relay's pipeline "
            "needs; use ring (or mpi) on CUDA machines (two CUDA ranks still carry their "
            "payloads over NCCL: --hop-mode collective or adaptive, what auto picks there)"
        )
    return problems


def _check_ring(hf: Hostfile) -> list[str]:
    problems: list[str] = []
    hosts = hf.hosts
    n = len(hosts)
    for i, h in enumerate(hosts):
        if not h.ips:
            problems.append(
                f"{_label(hf, i)}: ring backend needs 'ips' (the addresses the ring connects over)"
            )
    ref = next((i for i, h in enumerate(hosts) if h.ips), None)
    for i, h in enumerate(hosts):
        if ref is not None and h.ips and len(h.ips) != len(hosts[ref].ips):
            problems.append(
                f"{_label(hf, i)}: has {len(h.ips)} ips but {_label(hf, ref)} has "
                f"{len(hosts[ref].ips)}; the ring backend needs as many connections to the "
                "left as to the right, so every host must list the same number of ips"
            )
    if n == 1:
        problems.append(
            "ring backend with 1 host: mlx.launch then sets MLX_HOSTFILE to an empty file and "
            "mx.distributed.init() fails with a JSON parse error (mlx 0.32.4); run a single "
            "rank without mlx.launch"
        )
    # Rank i listens on its ips and rank i-1 connects to them (ring.cpp RingGroup), so a
    # loopback address only works when rank i-1 runs on the same machine.
    for i, h in enumerate(hosts):
        left = (i - 1) % n
        loop = [ip for ip in h.ips if _is_loopback(ip)]
        if loop and n > 1 and _machine(hosts[left]) != _machine(h):
            problems.append(
                f"{_label(hf, i)}: {loop[0]} is a loopback address, but {_label(hf, left)} "
                "connects to it from another machine"
            )
    owner: dict[str, int] = {}
    for i, h in enumerate(hosts):
        for ip in h.ips:
            if _is_loopback(ip):
                continue
            j = owner.setdefault(ip, i)
            if j != i and _machine(hosts[j]) != _machine(h):
                problems.append(
                    f"{_label(hf, i)}: ip {ip} is also listed for {_label(hf, j)}, a different "
                    "machine; each machine needs its own address"
                )
    return problems


def _check_jaccl(hf: Hostfile, *, ring: bool) -> list[str]:
    problems: list[str] = []
    hosts = hf.hosts
    n = len(hosts)
    name = "jaccl-ring" if ring else "jaccl"
    if not hosts[0].ips:
        problems.append(
            f"{_label(hf, 0)}: {name} needs rank 0's 'ips': mlx.launch uses the first as the "
            "coordinator (MLX_JACCL_COORDINATOR=<ip>:<starting port>), which every rank must "
            "reach, usually rank 0's Ethernet or Wi-Fi address"
        )
    else:
        coord = hosts[0].ips[0]
        others = [j for j in range(1, n) if _machine(hosts[j]) != _machine(hosts[0])]
        if _is_loopback(coord) and others:
            problems.append(
                f"{_label(hf, 0)}: coordinator {coord} is a loopback address, but "
                f"{_label(hf, others[0])} is another machine"
            )
    for i, h in enumerate(hosts):
        label = _label(hf, i)
        if h.rdma is None:
            problems.append(
                f"{label}: {name} needs 'rdma' (one entry per host, in rank order: the RDMA "
                "device that reaches it, null for itself)"
            )
            continue
        if len(h.rdma) != n:
            problems.append(
                f"{label}: 'rdma' has {len(h.rdma)} entries for {n} hosts; {name} needs an "
                f"{n} x {n} matrix (one entry per host, null for itself)"
            )
            continue
        if h.rdma[i] is not None:
            problems.append(f"{label}: rdma[{i}] must be null (the host itself), got {h.rdma[i]!r}")
        need = {(i - 1) % n, (i + 1) % n} if ring else set(range(n))
        for j in sorted(need - {i}):
            d = h.rdma[j]
            if d is None or d == "" or d == [] or (isinstance(d, list) and "" in d):
                what = "its ring neighbour " if ring else ""
                problems.append(
                    f"{label}: rdma[{j}] is {json.dumps(d)}: no RDMA device listed to reach "
                    f"{what}{_label(hf, j)}"
                )
    return problems


def _check_mpi(hf: Hostfile) -> list[str]:
    # launch_mpi writes "<ssh> slots=<count>" per distinct ssh name, so mpirun numbers the
    # ranks host by host: repeats of a name must be adjacent for ranks to follow the file.
    problems: list[str] = []
    last: dict[str, int] = {}
    for i, h in enumerate(hf.hosts):
        if h.ssh in last and last[h.ssh] != i - 1:
            problems.append(
                f"{_label(hf, i)}: repeats the ssh name of {_label(hf, last[h.ssh])} but not "
                "next to it; mpirun gives each host's ranks consecutively, so the rank order "
                "would differ from the file"
            )
        last[h.ssh] = i
    return problems


def _check_ring_env(hf: Hostfile, backend: str | None) -> list[str]:
    problems: list[str] = []
    hosts = hf.hosts
    n = len(hosts)
    if backend not in (None, "ring"):
        problems.append(
            f'backend {backend!r}: a list of "ip:port" lists is the ring backend\'s MLX_HOSTFILE'
        )
    if n == 0:
        return problems + ["no ranks: an MLX_HOSTFILE needs at least 2"]
    if n == 1:
        problems.append(
            "1 rank: a ring of one connects to itself and fails after about 31 s; run a single "
            "rank without MLX_HOSTFILE"
        )
    seen: dict[tuple[str, int], int] = {}
    for i, h in enumerate(hosts):
        label = _label(hf, i)
        if not h.ips:
            problems.append(f'{label}: no addresses; every rank needs at least one "ip:port"')
        elif len(h.ips) != len(hosts[0].ips):
            problems.append(
                f"{label}: has {len(h.ips)} addresses but rank 0 has {len(hosts[0].ips)}; the "
                "ring backend needs as many connections to the left as to the right"
            )
        for ip, port in zip(h.ips, h.ports or [], strict=True):
            if p := _ip_problem(ip):
                problems.append(f"{label}: {p}")
            if not 1 <= port <= 65535:
                problems.append(f"{label}: port {port} is not in 1..65535")
            if (ip, port) in seen:
                j = seen[(ip, port)]
                other = "itself" if j == i else f"rank {j}"
                problems.append(
                    f"{label}: {ip}:{port} is also used by {other}; with SO_REUSEPORT both "
                    "bind it and connections reach a random one"
                )
            seen.setdefault((ip, port), i)
    return problems


def _check_layers(n: int, num_layers: int | None, layers: list[int] | None) -> list[str]:
    problems: list[str] = []
    if num_layers is not None:
        if num_layers < 1:
            problems.append(f"num_layers {num_layers}: a model has at least 1 layer")
        elif n > num_layers:
            problems.append(
                f"{n} ranks but the model has {num_layers} layers: every rank needs at least "
                f"1 layer, so use at most {num_layers} hosts"
            )
    if layers is not None:
        if len(layers) != n:
            problems.append(f"layer split {layers}: {len(layers)} counts for {n} ranks")
        for i, c in enumerate(layers):
            if c < 1:
                problems.append(f"layer split {layers}: rank {i} gets {c}; every rank needs >= 1")
        if num_layers is not None and sum(layers) != num_layers:
            problems.append(
                f"layer split {layers}: sums to {sum(layers)}, the model has {num_layers} layers"
            )
    return problems


# ---------------------------------------------------------------------------- generation


def _host_spec(spec: str) -> tuple[str, str | None]:
    """'mac1', '10.0.0.1' or 'mac1=10.0.0.1' -> (ssh, ip or None)."""
    name, sep, ip = spec.strip().partition("=")
    name, ip = name.strip(), ip.strip()
    if not name or (sep and not ip):
        raise ValueError(f"host {spec!r}: expected NAME, IP or NAME=IP")
    if sep:
        if p := _ip_problem(ip):
            raise ValueError(f"host {spec!r}: {p}")
        return name, ip
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return name, None
    if p := _ip_problem(name):
        raise ValueError(f"host {spec!r}: {p}")
    return name, name


def _tb_ring_ips(n: int) -> list[str]:
    """Each rank's address on the cable from its left neighbour.

    The same per-cable /30 scheme as `mlx.distributed_config` (`IPConfigurator`): cable k
    joins rank k (192.168.x.4k+1) and rank k+1 (.4k+2). In the ring backend rank i-1
    connects to rank i, so rank i lists its end of cable i-1. Two Macs share one cable.
    """
    if n == 2:
        return ["192.168.0.1", "192.168.0.2"]
    out = []
    for i in range(n):
        k = (i - 1) % n
        out.append(f"192.168.{k // 64}.{4 * (k % 64) + 2}")
    return out


def _tb_rdma_matrix(n: int, ring: bool) -> list[list[str | None]]:
    """Placeholder device names: on each Mac its peers in rank order get en2, en3, ...

    Real names depend on which port each cable is in; `ibv_devices` lists them.
    """
    rows = []
    for i in range(n):
        peers = [j for j in range(n) if j != i]
        row: list[str | None] = [None] * n
        for port, j in enumerate(peers):
            if not ring or j in ((i - 1) % n, (i + 1) % n):
                row[j] = f"rdma_en{2 + port}"
        rows.append(row)
    return rows


def make_hostfile(hosts: list[str], over: str, *, backend: str | None = None) -> dict:
    """A hostfile object for `hosts` (NAME, IP or NAME=IP each) connected `over` a link.

    thunderbolt: ring addresses follow mlx.distributed_config's per-cable scheme and jaccl
    gets an N x N matrix of placeholder devices; ethernet: each host's IP (given, or the
    host itself when it is an IP); local: ranks on this machine over 127.0.0.1.
    """
    if over not in OVERS:
        raise ValueError(f"over {over!r}: expected one of {', '.join(OVERS)}")
    backend = backend or "ring"
    if backend not in ("ring", "jaccl", "jaccl-ring", "mpi"):
        raise ValueError(f"backend {backend!r}: make supports ring, jaccl, jaccl-ring and mpi")
    if not hosts:
        raise ValueError("no hosts given")
    specs = [_host_spec(h) for h in hosts]
    n = len(specs)
    jaccl = backend.startswith("jaccl")
    if jaccl and over != "thunderbolt":
        raise ValueError(f"{backend} is RDMA over Thunderbolt 5 only; use --over thunderbolt")

    if over == "local":
        out = []
        for spec, (name, ip) in zip(hosts, specs, strict=True):
            if name not in LOCAL_NAMES and not (ip and _is_loopback(ip)):
                raise ValueError(f"host {spec!r}: --over local takes 127.0.0.1 or localhost")
            # mlx.launch runs a rank in place only for ssh "127.0.0.1"; "localhost" is ssh'd.
            out.append({"ssh": LOCAL_SSH, "ips": [ip if ip and _is_loopback(ip) else LOCAL_SSH]})
        return {"backend": backend, "envs": [], "hosts": out}

    names = [name for name, _ in specs]
    dup = next((x for x in names if names.count(x) > 1), None)
    if dup is not None:
        raise ValueError(f"host {dup!r} is listed twice; list each machine once")

    if over == "ethernet":
        missing = [name for name, ip in specs if ip is None]
        if backend == "ring" and missing:
            raise ValueError(
                f"ring over ethernet needs every host's IP; give {missing[0]!r} as "
                f"{missing[0]}=<its IP> (on a Mac: ipconfig getifaddr en0)"
            )
        out = [{"ssh": name, "ips": [ip] if ip else []} for name, ip in specs]
        return {"backend": backend, "envs": [], "hosts": out}

    # thunderbolt
    if jaccl:
        if specs[0][1] is None:
            raise ValueError(
                f"{backend} needs rank 0's IP reachable from every rank (its Ethernet or Wi-Fi "
                f"address, the coordinator): give it as {names[0]}=<IP>"
            )
        rdma = _tb_rdma_matrix(n, ring=backend == "jaccl-ring")
        out = [
            {"ssh": name, "ips": [ip] if ip else [], "rdma": row}
            for (name, ip), row in zip(specs, rdma, strict=True)
        ]
        return {"backend": backend, "envs": ["MLX_METAL_FAST_SYNCH=1"], "hosts": out}
    if backend == "mpi":
        out = [{"ssh": name, "ips": [ip] if ip else []} for name, ip in specs]
        return {"backend": backend, "envs": [], "hosts": out}
    if n < 2:
        raise ValueError("a Thunderbolt ring needs at least 2 Macs")
    ips = _tb_ring_ips(n)
    out = [{"ssh": name, "ips": [ip or ips[i]]} for i, (name, ip) in enumerate(specs)]
    return {"backend": backend, "envs": [], "hosts": out}
