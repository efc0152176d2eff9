"""HTTP overhead: streamed tokens/s through the server vs the engine called directly.

Same model, prompt, settings (greedy, ignore_eos, fixed max_tokens), one run each
after a warm-up. Direct: `generate()` in this process. HTTP: the real app under
uvicorn on loopback (in this process, as `mtp-serve` runs it), read as SSE with
httpx. Decode rate = (tokens - 1) / (time of last token - time of first token);
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
import tempfile
import threading
import time

import mtp_serve  # noqa: F401  (before mlx)


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
    import httpx

    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "mtp_depth": depth}
    t0 = time.perf_counter()
    times, n = [], 0
    with httpx.stream("POST", base_url + "/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
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
    args = p.parse_args(argv)

    import uvicorn

    from mtp_serve.engine.sampling import SamplingParams
    from mtp_serve.models.loader import load_model
    from mtp_serve.server.app import ServerConfig, create_app

    if args.synthetic:
        from mtp_serve.models.synthetic import write_synthetic_checkpoint

        path = write_synthetic_checkpoint(tempfile.mkdtemp() + "/synthetic", "qwen3_5", agreeable=True)
    else:
        from mtp_serve.models.demo_model import default_model_path

        path = args.model or default_model_path()
    lm = load_model(str(path))
    depth = args.mtp_depth if lm.model.has_mtp else 0
    prompt_ids = lm.tokenizer.encode(args.prompt, add_special_tokens=False)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    direct_run(lm, prompt_ids, SamplingParams(max_tokens=8, ignore_eos=True), depth)  # warm-up
    d_n, d_ttft, d_span = direct_run(lm, prompt_ids, params, depth)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(lm, ServerConfig(served_model_name="bench", mtp_depth=depth))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        http_run(base, prompt_ids, 8, depth)  # warm-up
        h_n, h_ttft, h_span = http_run(base, prompt_ids, args.max_tokens, depth)
    finally:
        server.should_exit = True
        thread.join(10)

    d_rate = (d_n - 1) / d_span if d_span > 0 else float("nan")
    h_rate = (h_n - 1) / h_span if h_span > 0 else float("nan")
    print(f"model {path}  depth {depth}  prompt {len(prompt_ids)} tokens  max_tokens {args.max_tokens}")
    print(f"direct: {d_n} tokens, {d_rate:.1f} tok/s, TTFT {d_ttft * 1000:.1f} ms")
    print(f"http:   {h_n} tokens, {h_rate:.1f} tok/s, TTFT {h_ttft * 1000:.1f} ms")
    print(f"ratio (http / direct tokens/s): {h_rate / d_rate:.3f}  (target >= 0.95)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
