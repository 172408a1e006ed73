"""How fast --stage-weights ships a worker its shard: loopback, and links shaped to a rate.

    sudo .venv/bin/python bench/bench_staging.py [--shard-mb 1024] [--shaped-mb 256]
                                                  [--rates 1gbit,200mbit]

A synthetic llama checkpoint (random bytes: staging moves bytes, it never looks at them)
whose worker shard is `--shard-mb`, cut into units and served by rank 0's real code
(model/shard_files.py, coordinator/staging.py's DigestCache, transport/blobs.py's
BlobServer), fetched by a worker's real Stager (worker/staging.py) into an empty cache,
in a process of its own. Rows:

- loopback: server and worker on 127.0.0.1, a `--shard-mb` shard, empty cache; then
  the same again with the cache full (a relaunch: every file checked, nothing sent);
- shaped: server and worker in two network namespaces (tests/netns.py), the server's
  outgoing traffic capped by `tc tbf` at each of `--rates`, a `--shaped-mb` shard;
  printed with the fraction of the link's rate reached (needs root; skipped otherwise).

Rank 0's hashing of the units (once per checkpoint; DigestCache keeps it) is timed on
its own line, not in the transfer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

LAYERS = 8
HIDDEN = 64


def make_checkpoint(directory: Path, shard_bytes: int) -> Path:
    """A llama config and one safetensors file whose layers 1..LAYERS-1 weigh
    `shard_bytes` together (the worker's share); layer 0 and the ends are rank 0's."""
    from mlx_relay.model.checkpoint import Tensor
    from mlx_relay.model.shard_files import compose_header

    directory.mkdir(parents=True, exist_ok=True)
    per_layer = shard_bytes // (LAYERS - 1)
    config = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    }
    (directory / "config.json").write_text(json.dumps(config))
    tensors = [("model.embed_tokens.weight", Tensor("U8", 256 * HIDDEN, (256, HIDDEN)))]
    for i in range(LAYERS):
        size = 4096 if i == 0 else per_layer
        tensors.append((f"model.layers.{i}.mlp.down_proj.weight", Tensor("U8", size, (size,))))
    tensors.append(("model.norm.weight", Tensor("U8", HIDDEN, (HIDDEN,))))
    with open(directory / "model.safetensors", "wb") as fh:
        fh.write(compose_header(tensors))
        for _, t in tensors:
            left = t.nbytes
            while left:
                n = min(left, 64 << 20)
                fh.write(os.urandom(n))
                left -= n
    return directory


def serve(model: Path, host: str, secret: bytes) -> None:
    """Rank 0's side: hash (timed), offer, print the worker's document, serve until
    stdin closes."""
    from mlx_relay.coordinator.staging import DigestCache
    from mlx_relay.model.shard_files import worker_units
    from mlx_relay.transport.blobs import BlobServer

    units = worker_units(model, 1, LAYERS)
    t0 = time.perf_counter()
    digests = DigestCache(model / "digests.json").digests(units)
    hashed = time.perf_counter() - t0
    server = BlobServer(host, secret)
    listed = []
    for unit, digest in zip(units, digests, strict=True):
        server.offer(digest, unit.size, unit.read)
        listed.append({"name": unit.name, "digest": digest, "size": unit.size})
    document = {
        "port": server.port,
        "config": (model / "config.json").read_text(),
        "keep_free": 0,
        "ranks": {"1": listed},
        "hash_seconds": hashed,
    }
    print(json.dumps(document), flush=True)
    sys.stdin.read()
    server.close()
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: kB)
    print(json.dumps({"peak_rss": peak}), flush=True)


def fetch(host: str, secret: bytes, document_file: Path) -> None:
    """A worker's side: stage into $MLX_RELAY_CACHE, print its last report."""
    from mlx_relay.worker.staging import Stager

    stager = Stager(1, secret, host)
    t0 = time.perf_counter()
    stager.start(json.loads(document_file.read_text()))
    stager.wait()
    report = {**vars(stager.progress), "wall": time.perf_counter() - t0}
    print(json.dumps(report), flush=True)


def run_pair(
    model: Path,
    cache: Path,
    server_prefix: list[str],
    worker_prefix: list[str],
    host: str,
    bind: str,
) -> dict:
    """One staging: the server in `server_prefix` bound to `bind`, the worker in
    `worker_prefix` reaching it at `host`; the worker's report."""
    secret = os.urandom(8).hex()
    me = [sys.executable, __file__]
    server = subprocess.Popen(
        [*server_prefix, *me, "serve", "--model", str(model), "--host", bind, "--secret", secret],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        document = json.loads(server.stdout.readline())
        cache.parent.mkdir(parents=True, exist_ok=True)
        doc_file = cache.parent / "document.json"
        doc_file.write_text(json.dumps(document))
        env = {**os.environ, "MLX_RELAY_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [*worker_prefix, "env", f"MLX_RELAY_CACHE={cache}", f"PYTHONPATH={ROOT}",
             *me, "fetch", "--host", host, "--secret", secret, "--document", str(doc_file)],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        report = json.loads(out.stdout.strip().splitlines()[-1])
        report["hash_seconds"] = document["hash_seconds"]
        server.stdin.close()
        report["server_peak_rss"] = json.loads(server.stdout.readline())["peak_rss"]
        return report
    finally:
        if not server.stdin.closed:
            server.stdin.close()
        server.wait(timeout=30)


def _rate_bytes(rate: str) -> float:
    scale = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for suffix, factor in scale.items():
        if rate.endswith(suffix):
            return float(rate.removesuffix(suffix)) * factor / 8
    raise ValueError(rate)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="mode")
    s = sub.add_parser("serve")
    s.add_argument("--model", type=Path)
    s.add_argument("--host")
    s.add_argument("--secret")
    f = sub.add_parser("fetch")
    f.add_argument("--host")
    f.add_argument("--secret")
    f.add_argument("--document", type=Path)
    p.add_argument("--shard-mb", type=int, default=1024)
    p.add_argument("--shaped-mb", type=int, default=256)
    p.add_argument("--rates", default="1gbit,200mbit")
    args = p.parse_args()
    if args.mode == "serve":
        return serve(args.model, args.host, args.secret.encode())
    if args.mode == "fetch":
        return fetch(args.host, args.secret.encode(), args.document)

    with tempfile.TemporaryDirectory(prefix="bench-staging-") as tmp:
        work = Path(tmp)
        model = make_checkpoint(work / "model", args.shard_mb << 20)
        cache = work / "cache-loopback" / "root"
        cold = run_pair(model, cache, [], [], "127.0.0.1", "127.0.0.1")
        warm = run_pair(model, cache, [], [], "127.0.0.1", "127.0.0.1")
        mb = cold["total"] / 1e6
        print(
            f"\nrank 0 hashes the {mb:.0f} MB shard once per checkpoint: {cold['hash_seconds']:.2f} s"
        )
        print(
            "| link | shard | fetched | seconds | MB/s | of the link's rate | rank 0's peak RSS |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, r in (("loopback, empty cache", cold), ("loopback, relaunch", warm)):
            rate = r["fetched"] / r["wall"] / 1e6
            print(f"| {name} | {r['total'] / 1e6:.0f} MB | {r['fetched'] / 1e6:.0f} MB | "
                  f"{r['wall']:.2f} | {rate:.0f} | | {r['server_peak_rss'] / 1e6:.0f} MB |")  # fmt: skip

        from netns import NetnsHosts, unavailable_reason

        if (why := unavailable_reason()) is not None:
            print(f"(shaped links skipped: {why})")
            return
        shaped = make_checkpoint(work / "shaped", args.shaped_mb << 20)
        for rate in args.rates.split(","):
            with NetnsHosts(2, rate=rate) as hosts:
                r = run_pair(
                    shaped, work / f"cache-{rate}" / "root", hosts.prefix(0), hosts.prefix(1),
                    hosts.addresses[0], hosts.addresses[0],
                )  # fmt: skip
            got = r["fetched"] / r["wall"]
            print(f"| netns, tbf {rate} | {r['total'] / 1e6:.0f} MB | {r['fetched'] / 1e6:.0f} MB | "
                  f"{r['wall']:.2f} | {got / 1e6:.0f} | {got / _rate_bytes(rate):.2f} | "
                  f"{r['server_peak_rss'] / 1e6:.0f} MB |")  # fmt: skip


if __name__ == "__main__":
    main()
