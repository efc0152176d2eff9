"""HTTP overhead: streamed tokens/s through the server vs the engine called directly.

Same model, prompt, settings (greedy, ignore_eos, fixed max_tokens), `--repeats`
runs each, alternating, after a warm-up; the ratio is the median over the
back-to-back (direct, http) pairs, which share the machine's load at the time.
Direct: `generate()` in this process. HTTP: `mtp-serve` started as users start
it (its own process, on loopback), read as SSE with httpx from this process. Decode rate = (tokens - 1) / (time of last token - time of first token);
TTFT = request start to first text (a byte-level model can hold
back a partial UTF-8 character, on both paths alike).

    python bench/bench_http_overhead.py                      # the demo model
    python bench/bench_http_overhead.py --model DIR --max-tokens 256 --mtp-depth 2
    python bench/bench_http_overhead.py --synthetic          # a small random model
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import mtp_serve  # noqa: F401  (before mlx)
from common import stream_events


def direct_run(lm, prompt, params, depth):
    from mtp_serve.engine.generator import generate

    t0 = time.perf_counter()
    times, n = [], 0
    for chunk in generate(lm.model, lm.tokenizer, prompt, params, depth):
        n += len(chunk.token_ids)
        if chunk.text:  # as over HTTP, where a chunk is seen when it carries text
            times.append(time.perf_counter())
    return n, times[0] - t0, times[-1] - times[0]


def http_run(base_url, prompt, max_tokens, depth):
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "mtp_depth": depth}
    t0 = time.perf_counter()
    times, n = [], 0
    for event in stream_events(base_url + "/completions", body):
        if event["choices"] and event["choices"][0]["text"]:
            times.append(time.perf_counter())
        if event.get("usage"):
            n = event["usage"]["completion_tokens"]
    return n, times[0] - t0, times[-1] - times[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory or repo (default: the demo model)")
    p.add_argument("--synthetic", action="store_true", help="use a small random Qwen3.5 checkpoint instead")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--mtp-depth", type=int, default=2)
    p.add_argument("--prompt", default="def fibonacci(n):\n    ")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    from mtp_serve.engine.sampling import SamplingParams
    from mtp_serve.models.loader import load_model

    if args.synthetic:
        from mtp_serve.testing.synthetic import write_synthetic_checkpoint

        path = write_synthetic_checkpoint(tempfile.mkdtemp() + "/synthetic", "qwen3_5", agreeable=True)
    else:
        from mtp_serve.models.demo_model import default_model_path

        path = args.model or default_model_path()
    lm = load_model(str(path))
    depth = args.mtp_depth if lm.model.has_mtp else 0
    # A different prompt per repeat, so the server's prompt cache does not flatter its TTFT.
    prompts = [lm.tokenizer.encode(f"# run {i}\n" + args.prompt, add_special_tokens=False) for i in range(args.repeats)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mtp_serve.cli.serve", "--model", str(path), "--port", str(port),
           "--served-model-name", "bench", "--log-level", "warning"]
    if depth:
        cmd += ["--enable-mtp", "--mtp-depth", str(depth)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/v1"
    import httpx

    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    rows = []
    try:
        direct_run(lm, prompts[0][:4], SamplingParams(max_tokens=8, ignore_eos=True), depth)  # warm-up
        http_run(base, prompts[0][:4], 8, depth)
        for i, ids in enumerate(prompts):  # alternating, so machine noise hits both alike
            runs = [("direct", lambda: direct_run(lm, ids, params, depth)), ("http", lambda: http_run(base, ids, args.max_tokens, depth))]
            for name, fn in (runs if i % 2 == 0 else runs[::-1]):
                n, ttft, span = fn()
                rows.append({"run": i, "path": name, "tokens": n, "tok_s": (n - 1) / span, "ttft_ms": ttft * 1e3})
    finally:
        server.terminate()
        server.wait(30)

    print(f"model {path}  depth {depth}  max_tokens {args.max_tokens}  {args.repeats} runs each, alternating")
    med = {}
    for name in ("direct", "http"):
        mine = [r for r in rows if r["path"] == name]
        med[name] = {k: statistics.median(r[k] for r in mine) for k in ("tok_s", "ttft_ms")}
        print(f"{name:7s} " + "  ".join(f"{r['tok_s']:.1f}" for r in mine)
              + f"  tok/s; median {med[name]['tok_s']:.1f} tok/s, TTFT {med[name]['ttft_ms']:.1f} ms")
    # Each run's pair ran back to back, under the same machine load: compare within pairs.
    pairs = [h["tok_s"] / d["tok_s"] for d, h in zip(*[[r for r in rows if r["path"] == n] for n in ("direct", "http")])]
    ratio = statistics.median(pairs)
    print(f"ratio (http / direct tokens/s, median of the {len(pairs)} back-to-back pairs "
          f"{', '.join(f'{x:.3f}' for x in pairs)}): {ratio:.3f}  (target >= 0.95)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": str(path), "depth": depth, "runs": rows, "median": med, "ratio": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
