"""The prompt cache through the server, as agents use it: conversations sharing a
system prompt and tools, a restart with the disk tier, usage and /metrics."""

import re
import subprocess
import sys

import httpx
import openai
import pytest

from mtp_serve.models.demo_model import DEMO_MODEL_DIR
from mtp_serve.server.openai_api import render_chat
from mtp_serve.server.schemas import ChatCompletionRequest
from mtp_serve.testing.server_process import ServerProcess
from support.server import serve

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

SYSTEM = ("You are a careful coding agent. Read the task, plan, call tools to inspect and edit files, "
          "run the tests, and report what changed. " * 6)
TOOLS = [
    {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "description": "file path"}}, "required": ["path"]}}}
    for name, desc in [("read_file", "Read a file and return its text."), ("list_dir", "List a directory."),
                       ("run_tests", "Run the test suite under a path and return the failures.")]
]


def conversation(user: str) -> list:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def chat(server, messages, max_tokens):
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    return client.chat.completions.create(model="demo", messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=0)


def ids(server, messages) -> list:
    return render_chat(server.service, ChatCompletionRequest(model="demo", messages=messages, tools=TOOLS)).ids


def shared_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def demo_pair():
    """The demo model with MTP at a fixed depth (acceptance comparable run to run), twice."""
    servers = [serve(DEMO_MODEL_DIR, served_model_name="demo", mtp_depth=2, fixed_depth=True) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def test_a_new_conversation_reuses_the_shared_system_prompt_and_tools(demo_pair):
    warm, cold = demo_pair
    first, second = conversation("List the files under src/."), conversation("Why does test_io fail?")
    a, b = ids(warm, first), ids(warm, second)
    # The shared prefix: the system message with the tool schemas, then the user message's `<|im_start|>`.
    n_shared = a.index(warm.service.chat.turn_start_id, 1) + 1
    assert n_shared > 400 and shared_prefix(a, b) >= n_shared
    chat(warm, first, max_tokens=4)
    r = chat(warm, second, max_tokens=24)
    assert r.usage.prompt_tokens_details.cached_tokens >= n_shared - 1
    ref = chat(cold, second, max_tokens=24)
    assert ref.usage.prompt_tokens_details.cached_tokens == 0
    assert r.choices[0].message == ref.choices[0].message
    assert r.usage.speculative == ref.usage.speculative  # the same drafts accepted at every position

    m = httpx.get(warm.root + "/metrics").text
    assert metric(m, 'mtp_prompt_cache_hits_total{tier="ram"}') >= 1
    assert metric(m, 'mtp_prompt_cache_reused_tokens_total{tier="ram"}') >= n_shared - 1
    assert metric(m, 'mtp_prompt_cache_snapshots{tier="ram"}') >= 4
    assert metric(m, 'mtp_prompt_cache_bytes{tier="ram"}') > 0


def test_completions_report_reused_tokens(demo_pair):
    warm, _ = demo_pair
    body = {"model": "demo", "prompt": "def parse(line):\n    return line.split()\n\n" * 12, "max_tokens": 2, "temperature": 0}
    httpx.post(warm.base_url + "/completions", json=body, timeout=60).raise_for_status()
    body["prompt"] += "def main():"
    usage = httpx.post(warm.base_url + "/completions", json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] // 2


# ---------------------------------------------------------------- the disk tier across processes


def start(cache_dir) -> ServerProcess:
    return ServerProcess(["--enable-mtp", "--mtp-depth", "2", "--fixed-depth", "--served-model-name", "demo",
                          "--prompt-cache-dir", cache_dir],
                         env={"OPENBLAS_NUM_THREADS": "1"})  # the same numerics in every process


def post_chat(server: ServerProcess, messages, max_tokens=24) -> dict:
    body = {"model": "demo", "messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def test_a_restarted_server_restores_from_disk_exactly(tmp_path):
    turn1 = conversation("Read src/app.py and tell me what it does.")
    with start(tmp_path / "cache") as first:
        r1 = post_chat(first, turn1, max_tokens=12)
    turn2 = turn1 + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"] or "Done."},
                     {"role": "user", "content": "Now list the tests."}]

    with start(tmp_path / "cache") as restarted:
        warm = post_chat(restarted, turn2)
        metrics = httpx.get(restarted.root + "/metrics").text
    with start(tmp_path / "empty") as cold_server:
        cold = post_chat(cold_server, turn2)

    # Everything before turn 1's reply came back from disk (the reply is re-rendered).
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1["usage"]["prompt_tokens"] - 16
    assert metric(metrics, 'mtp_prompt_cache_hits_total{tier="disk"}') == 1
    assert metric(metrics, "mtp_prompt_cache_disk_read_seconds_total") > 0
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert warm["usage"]["speculative"] == cold["usage"]["speculative"]
    assert warm["usage"]["speculative"]["accepted"] > 0


def test_bad_prompt_cache_settings_are_one_line_errors(tmp_path):
    def serve_cli(*args):
        return subprocess.run([sys.executable, "-m", "mtp_serve.cli.serve", *map(str, args)], capture_output=True,
                              text=True, timeout=120)

    r = serve_cli("--prompt-cache-bytes", "8X")
    assert r.returncode == 2 and "'8X' is not a size (examples: 0, 512M, 8G)" in r.stderr
    r = serve_cli("--prompt-cache-disk-bytes", "1G")
    assert r.returncode == 1 and "--prompt-cache-disk-bytes needs --prompt-cache-dir" in r.stderr
    (tmp_path / "file").write_text("")
    r = serve_cli("--prompt-cache-dir", tmp_path / "file" / "cache", "--port", "1")
    assert r.returncode == 1 and "mtp-serve: error: --prompt-cache-dir:" in r.stderr, r.stderr
