"""Soak: 8 concurrent streaming clients for a bounded time, mixing good requests
on every API (greedy and seeded, MTP on and off), mid-stream disconnects and bad requests,
against `mtp-serve` in its own process. Every good request's output equals its solo run,
every bad one is a 400, every slot is free at the end, and the server's memory is back
within 10% of where it started (after a warm-up burst)."""

import json
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest

from support.server import free_port

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

SOAK_SECONDS = 25
WARM_UP_SECONDS = 4
CLIENTS = 8
MSG = [{"role": "user", "content": "Tell me about the sea."}]
# name -> (path, body): streamed; greedy or seeded; MTP at the server's depth or off
GOOD = {
    "chat greedy": ("/v1/chat/completions", {"messages": MSG, "max_tokens": 24, "temperature": 0}),
    "chat greedy plain": ("/v1/chat/completions", {"messages": MSG, "max_tokens": 24, "temperature": 0, "mtp_depth": 0}),
    "chat seeded": ("/v1/chat/completions", {"messages": MSG, "max_tokens": 24, "temperature": 0.9, "seed": 7}),
    "completion seeded plain": ("/v1/completions", {"prompt": "The sea is", "max_tokens": 24, "temperature": 1.0, "seed": 11,
                                                    "mtp_depth": 0}),
    "messages greedy": ("/v1/messages", {"messages": MSG, "max_tokens": 24, "temperature": 0}),
    "responses seeded": ("/v1/responses", {"input": "Waves?", "max_output_tokens": 24, "temperature": 0.8, "seed": 3}),
}
BAD = [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
    ("/v1/completions", '{"prompt": "a\\ud800", "max_tokens": 4}'),
    ("/v1/messages", '{"messages": [{"role": "user", "content": "x"}], "max_tokens": "8"}'),
    ("/v1/responses", '{"input": "x", "max_output_tokens": 0}'),
    ("/v1/chat/completions", json.dumps({"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": json.loads('{"a":' * 200 + "1" + "}" * 200)}}]})),
    ("/v1/chat/completions", json.dumps({"messages": MSG, "stream": True, "seed": -(1 << 64)})),
]


def canonical(path: str, events: list) -> tuple:
    """What a stream says, without its ids, timestamps and usage (cached tokens differ): its text
    per kind joined (where a round's chunks end follows its accepted drafts, and copy lengths
    follow measured round times) and its other events in order."""
    text, other = {}, []

    def add(kind: str, piece: str) -> None:
        text[kind] = text.get(kind, "") + piece

    for e in events:
        if e == "[DONE]":
            continue
        d = json.loads(e)
        if path == "/v1/chat/completions" and d["choices"]:
            c = d["choices"][0]
            for k, v in c["delta"].items():
                if isinstance(v, str) and k != "role":
                    add(k, v)
                elif k != "role":
                    other.append((k, v))
            other += [c["finish_reason"]] if c["finish_reason"] else []
        elif path == "/v1/completions" and d["choices"]:
            add("text", d["choices"][0]["text"])
            other += [d["choices"][0]["finish_reason"]] if d["choices"][0]["finish_reason"] else []
        elif path == "/v1/messages" and d["type"] == "content_block_delta":
            delta = d["delta"]
            add(delta["type"], "".join(v for k, v in delta.items() if k != "type" and isinstance(v, str)))
        elif path == "/v1/messages" and d["type"] == "message_delta":
            other.append(d.get("delta"))
        elif path == "/v1/responses" and d["type"].endswith(".delta"):
            add(d["type"], d["delta"])
        elif path == "/v1/responses" and d["type"] in ("response.completed", "response.incomplete"):
            other.append(d["type"])
    return text, other


def stream(s, path: str, body: dict) -> list:
    with httpx.stream("POST", s.root + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


class Server:
    def __init__(self, ckpt):
        self.port = free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mtp_serve.cli.serve", "--model", str(ckpt), "--enable-mtp", "--mtp-depth", "2",
             "--fixed-depth", "--max-batch-size", "8", "--max-context", "1024", "--port", str(self.port),
             "--served-model-name", "test-model", "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(self.root + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("mtp-serve did not start")

    def health(self) -> dict:
        return httpx.get(self.root + "/health").json()

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * 4096 / 1e6


@pytest.fixture(scope="module")
def soak_server(checkpoint_dir):
    s = Server(checkpoint_dir("qwen3_5", agreeable=True))
    yield s
    s.proc.terminate()
    s.proc.wait(20)


def test_soak(soak_server):
    s = soak_server
    solo = {name: canonical(path, stream(s, path, body)) for name, (path, body) in GOOD.items()}
    assert all(text for text, _ in solo.values())
    counts = {"good": 0, "disconnects": 0, "bad": 0}
    failures, lock = [], threading.Lock()

    def client(i: int, until: float) -> None:
        rng = random.Random(i)
        while time.time() < until:
            roll = rng.random()
            try:
                if roll < 0.6:
                    name = rng.choice(sorted(GOOD))
                    path, body = GOOD[name]
                    got = canonical(path, stream(s, path, body))
                    kind, ok = "good", got == solo[name]
                elif roll < 0.8:
                    body = {"messages": MSG, "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0.5}
                    with httpx.stream("POST", s.root + "/v1/chat/completions", json=body, timeout=60) as r:
                        lines = r.iter_lines()
                        for _ in range(rng.randint(1, 6)):
                            next(lines)
                    kind, ok = "disconnects", True  # closed mid-stream
                else:
                    path, raw = rng.choice(BAD)
                    r = httpx.post(s.root + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
                    kind, ok = "bad", r.status_code == 400 and "error" in r.json()
            except Exception as e:  # noqa: BLE001 - a failure to report, not to crash the thread on
                kind, ok = "error", f"{type(e).__name__}: {e}"
            with lock:
                counts[kind] = counts.get(kind, 0) + 1
                if ok is not True:
                    failures.append((kind, ok if kind == "error" else name if kind == "good" else path))

    def run(seconds: float) -> float:
        t0 = time.time()
        threads = [threading.Thread(target=client, args=(i, t0 + seconds)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 120)
        return time.time() - t0

    def idle() -> None:
        deadline = time.time() + 10
        while (s.health()["active"] or s.health()["queue_depth"]) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the engine releases memory when it goes idle

    # Warm-up: a few seconds of the same mix, so MLX's kernels, buffers and the prompt cache
    # reach their working size; memory is measured from there.
    run(WARM_UP_SECONDS)
    idle()
    start_mb = s.rss_mb()
    counts.update(good=0, disconnects=0, bad=0)
    elapsed = run(SOAK_SECONDS)
    idle()
    end_mb = s.rss_mb()
    print(f"\nsoak: {elapsed:.0f}s, {CLIENTS} clients: {counts}; RSS {start_mb:.0f} MB -> {end_mb:.0f} MB "
          f"({(end_mb - start_mb) / start_mb:+.1%})")
    assert not failures, failures[:5]
    assert counts["good"] >= 20 and counts["disconnects"] >= 3 and counts["bad"] >= 3, counts
    health = s.health()
    assert health["active"] == 0 and health["queue_depth"] == 0, health
    assert 'mtp_active_sequences 0.0' in httpx.get(s.root + "/metrics").text
    assert abs(end_mb - start_mb) <= 0.10 * start_mb, (start_mb, end_mb)
