"""Single-stream speed of 1, 2 and 3 ranks against single-process mlx-lm, side by side.

    .venv/bin/python bench/bench_pipeline.py [--model default] [--tokens 128] [--repeats 3]

Every configuration runs in this one invocation on the same model and prompt, so the
printed ratios compare like with like on whatever machine runs it. Each rank is pinned
to its own core (rank i -> core i mod cores), standing for one machine; the mlx-lm
baseline runs in a subprocess pinned to core 0. The benchmark's own gRPC client is pinned
to core 0 too: left free, it lands on rank 1's core and takes time from it (measured:
2 ranks 0.87-0.98 of mlx-lm with the client free, 0.997 with it pinned), so the cost
of the client falls on rank 0's core, as a client on the coordinator's machine would.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_relay.coordinator.client import Client  # noqa: E402
from mlx_relay.launch.local import LocalCluster, free_ports  # noqa: E402
from mlx_relay.protocol import relay_pb2 as pb  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."

BASELINE = r"""
import json, os, sys, time
import mlx.core as mx
from mlx_lm import load, stream_generate
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
path, n, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, tok = load(path)
text = tok.apply_chat_template([{"role": "user", "content": sys.argv[4]}], tokenize=False,
                               add_generation_prompt=True)
ids = tok.encode(text, add_special_tokens=False)
runs = []
for _ in range(repeats + 1):
    t0 = time.perf_counter(); first = None; count = 0
    # mlx-lm stops at EOS; a huge eos-free budget is emulated by dropping EOS ids.
    tok.eos_token_ids = set()
    for r in stream_generate(model, tok, mx.array(ids), max_tokens=n):
        count += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    runs.append({"ttft": first - t0, "decode_tps": (count - 1) / (end - first)})
print(json.dumps({"prompt_tokens": len(ids), "runs": runs[1:]}))
"""


def baseline(path: Path, tokens: int, repeats: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", BASELINE, str(path), str(tokens), str(repeats), PROMPT],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def cluster_runs(model: str, n: int, tokens: int, repeats: int) -> list[dict]:
    address = f"127.0.0.1:{free_ports(1)[0]}"
    logs = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    cluster = LocalCluster(n, ["--model", model], grpc_address=address, log_dir=logs, pin=True)
    runs = []
    with cluster:
        cluster.wait_serving(600)
        with Client(address, timeout=600) as client:
            request = pb.GenerateRequest(
                messages=[pb.ChatMessage(role="user", content=PROMPT)],
                params=pb.SamplingParams(max_tokens=tokens, ignore_eos=True),
            )
            for i in range(repeats + 1):  # the first run warms up
                t0 = time.perf_counter()
                first = None
                count = 0
                final = None
                for chunk in client.stream(request):
                    count += len(chunk.token_ids)
                    if first is None and chunk.token_ids:
                        first = time.perf_counter()
                    final = chunk
                end = time.perf_counter()
                if i:
                    runs.append(
                        {
                            "ttft": first - t0,
                            "decode_tps": (count - 1) / (end - first),
                            "server_decode_tps": final.timings.decode_tokens_per_s,
                        }
                    )
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", default="1,2,3")
    args = ap.parse_args()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # see the module docstring

    from mlx_relay.default_model import resolve_model

    path = resolve_model(args.model)
    print(f"model {path}  tokens {args.tokens}  repeats {args.repeats}  cores {os.cpu_count()}")
    base = baseline(path, args.tokens, args.repeats)
    b_tps = statistics.median(r["decode_tps"] for r in base["runs"])
    b_ttft = statistics.median(r["ttft"] for r in base["runs"])
    print(f"prompt {base['prompt_tokens']} tokens")
    print(f"{'config':<22}{'decode tok/s':>14}{'ratio':>8}{'TTFT ms':>10}{'ratio':>8}")
    print(f"{'mlx_lm (1 process)':<22}{b_tps:>14.2f}{1.0:>8.3f}{b_ttft * 1000:>10.1f}{1.0:>8.3f}")
    for n in (int(x) for x in args.ranks.split(",")):
        runs = cluster_runs(args.model, n, args.tokens, args.repeats)
        tps = statistics.median(r["decode_tps"] for r in runs)
        ttft = statistics.median(r["ttft"] for r in runs)
        label = f"mlx-relay {n} rank{'s' if n > 1 else ''}"
        print(
            f"{label:<22}{tps:>14.2f}{tps / b_tps:>8.3f}{ttft * 1000:>10.1f}{ttft / b_ttft:>8.3f}"
        )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
