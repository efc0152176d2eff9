"""Two models behind one server: does the main model keep its speed while the small model
answers an agent's background requests? And what do loads and unloads cost?

    python bench/bench_multi_model.py                      # the demo model as both (main: MTP, fast: plain)
    python bench/bench_multi_model.py --main PATH --fast PATH --tokens 256 --rounds 3

Through a real server on loopback (one EngineLoop thread per model):
- main alone: one greedy stream of --tokens tokens (ignore_eos), decode tok/s from the
  first token on (the client's clock);
- main with background: the same stream while a client sends the fast model short
  requests back to back (a title-like prompt, --small-tokens tokens): main's tok/s, and the
  small requests' latency (median, worst) and count;
- rounds alternate alone / with background, --rounds times; the ratio is of the medians.
Then load and unload times of the fast model (the registry's own timers, --reloads times).

On the CPU back end both engine loops compete for the same cores: the main model's tok/s
falls while background requests run; the figure says by how much on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import httpx  # noqa: E402

import mtp_serve  # noqa: E402,F401
from mtp_serve.models.demo_model import default_model_path  # noqa: E402
from mtp_serve.models.loader import load_model  # noqa: E402
from mtp_serve.server.models_registry import Models, ModelSpec  # noqa: E402
from mtp_serve.server.service import ServerConfig  # noqa: E402

PROMPT = "Write a Python function that parses a CSV file and returns the rows as dictionaries."
SMALL = "Summarize this conversation in a five-word title: the user asked for a CSV parser."


def stream_tok_s(root: str, model: str, tokens: int) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    first, n, end = None, 0, None
    with httpx.stream("POST", root + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            j = json.loads(line[6:])
            if j.get("usage"):
                n = j["usage"]["completion_tokens"]
            elif first is None:
                first = time.perf_counter()
            end = time.perf_counter()
    return (n - 1) / (end - first)


def background(root: str, model: str, tokens: int, stop: threading.Event, latencies: list) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": SMALL}], "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}
    while not stop.is_set():
        t0 = time.perf_counter()
        r = httpx.post(root + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        latencies.append(time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--main", default=None, help="main model (default: the demo model)")
    p.add_argument("--fast", default=None, help="small fast model (default: the demo model)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--small-tokens", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reloads", type=int, default=3)
    p.add_argument("--depth", type=int, default=3, help="main model's MTP depth cap")
    args = p.parse_args(argv)

    from support.server import free_port  # noqa: F401
    from test_multi_model import MultiServer

    main_path, fast_path = args.main or default_model_path(), args.fast or default_model_path()
    base = dict(prompt_cache_bytes=0, max_context=4096)
    models = Models.serving(load_model(main_path), ServerConfig("main", mtp_depth=args.depth, **base),
                            more=[ModelSpec("fast", fast_path, ServerConfig("fast", **base), enable_mtp=False)])
    alone, mixed, small = [], [], []
    with MultiServer(models).start() as s:
        stream_tok_s(s.root, "main", 16)  # warm both
        httpx.post(s.root + "/v1/chat/completions", json={"model": "fast", "messages": [{"role": "user", "content": SMALL}],
                                                         "max_tokens": 4}, timeout=600).raise_for_status()
        for _ in range(args.rounds):
            alone.append(stream_tok_s(s.root, "main", args.tokens))
            stop, lat = threading.Event(), []
            t = threading.Thread(target=background, args=(s.root, "fast", args.small_tokens, stop, lat))
            t.start()
            mixed.append(stream_tok_s(s.root, "main", args.tokens))
            stop.set()
            t.join()
            small.extend(lat)
    # Loads and unloads, apart from the server (its registry's code, on this process's own event loop).
    only = Models([ModelSpec("fast", fast_path, ServerConfig("fast", **base), enable_mtp=False)])
    fast = only.lookup("fast")

    async def reloads():
        for _ in range(args.reloads):
            await only.acquire("fast")
            only.release(fast)
            async with only._lock():
                await only._unload(fast, "(benchmark)")

    asyncio.run(reloads())
    load_s, unload_s, loads = fast.load_seconds / fast.loads, fast.unload_seconds / fast.unloads, fast.loads
    a, m = statistics.median(alone), statistics.median(mixed)
    print(f"main ({Path(main_path).name}, MTP depth cap {args.depth}), {args.tokens} tokens, {args.rounds} rounds each:")
    print(f"  alone:                  {a:7.1f} tok/s   ({', '.join(f'{x:.1f}' for x in alone)})")
    print(f"  fast model background:  {m:7.1f} tok/s   ({', '.join(f'{x:.1f}' for x in mixed)})   ratio {m / a:.2f}")
    if small:
        print(f"  background requests ({args.small_tokens} tokens): {len(small)} answered, latency median "
              f"{statistics.median(small) * 1000:.0f} ms, worst {max(small) * 1000:.0f} ms")
    print(f"fast ({Path(fast_path).name}): load {load_s:.2f}s, unload {unload_s:.2f}s (mean of {loads} loads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
