"""First start on a fresh machine: how fast the first requests answer after start-up.

MLX compiles its fused CPU kernels with g++ on first use and caches them on disk ($TMPDIR/mlx);
a fresh machine has an empty cache. This starts `mtp-serve --enable-mtp` (the demo model unless
--model) with an empty kernel cache (a new TMPDIR), then sends the same requests in turn
(greedy and seeded-sampled, non-streamed and streamed, each with a fixed output length) three
times over, and prints each kind's first, second and third latency and first/third ratio. The
start-up's own log (how long warm-up took, and what it compiled) is printed too.

    python bench/bench_first_start.py                  # fresh kernel cache
    python bench/bench_first_start.py --warm-cache     # the machine's cache, as a restart has it
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtp_serve.testing.server_process import ServerProcess  # noqa: E402

PROMPT = "Write a Python function that parses a CSV line into fields, handling quoted fields."
KINDS = {  # name -> (temperature, stream)
    "greedy": (0.0, False),
    "sampled": (0.8, False),
    "greedy, streamed": (0.0, True),
    "sampled, streamed": (0.8, True),
}


def request(base_url: str, temperature: float, stream: bool, max_tokens: int) -> float:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": temperature, "top_p": 0.95, "top_k": 20, "seed": 7, "stream": stream}
    t0 = time.perf_counter()
    if stream:
        with httpx.stream("POST", base_url + "/chat/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                pass
    else:
        httpx.post(base_url + "/chat/completions", json=body, timeout=600).raise_for_status()
    return time.perf_counter() - t0


def measure(args, env: dict) -> dict:
    """Seconds per kind, per repeat: {kind: [first, second, third]}."""
    t0 = time.perf_counter()
    with ServerProcess(["--enable-mtp", *(["--model", args.model] if args.model else [])], env=env, start_timeout=900) as server:
        started = time.perf_counter() - t0
        times = {k: [] for k in KINDS}
        for _ in range(args.repeats):
            for kind, (temperature, stream) in KINDS.items():
                times[kind].append(request(server.base_url, temperature, stream, args.max_tokens))
        log = server.stop()
    print(f"start-up (process start to /health answering): {started:.1f}s")
    for line in log.splitlines():
        if "warm" in line.lower() or "compil" in line.lower():
            print("  log:", line)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model to serve (default: the demo model)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warm-cache", action="store_true", help="keep the machine's kernel cache (a restart)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {} if args.warm_cache else {"TMPDIR": tmp}
        print(f"kernel cache: {'the machine s own' if args.warm_cache else 'empty (TMPDIR=' + tmp + ')'}; "
              f"{args.max_tokens} tokens per request, {os.cpu_count()} cores")
        times = measure(args, env)
    print(f"\n| request | {' | '.join(f'#{i + 1} (s)' for i in range(args.repeats))} | #1 / #{args.repeats} |")
    print("|---|" + "---|" * (args.repeats + 1))
    for kind, ts in times.items():
        print(f"| {kind} | {' | '.join(f'{t:.2f}' for t in ts)} | {ts[0] / ts[-1]:.2f}x |")


if __name__ == "__main__":
    main()
