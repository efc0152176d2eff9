"""The OpenAI-compatible server over real HTTP: uvicorn on loopback, the `openai`
package as the client, raw SSE read with httpx where the wire format matters."""

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from support.server import LiveServer, free_port, serve

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

MSGS = [{"role": "user", "content": "Hello, model."}]


@pytest.fixture(scope="module")
def ckpt(checkpoint_dir):
    return checkpoint_dir("qwen3_5", agreeable=True)


@pytest.fixture(scope="module")
def mtp_server(ckpt):
    s = serve(ckpt, mtp_depth=2, fixed_depth=True)  # the tiny model: drafting would not pay, the policy would stop it
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain_server(ckpt):
    s = serve(ckpt, mtp_depth=0, max_context=300)
    yield s
    s.stop()


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=kw.pop("api_key", "none"), max_retries=0, timeout=60, **kw)


def chat(server, messages=MSGS, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("model", "test-model")
    return client(server).chat.completions.create(messages=messages, temperature=0, **kw)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE response, in order (comments skipped)."""
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def wait_until(cond, timeout=10.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


# ---------------------------------------------------------------- endpoints


def test_models_health_metrics(mtp_server):
    models = client(mtp_server).models.list()
    assert [m.id for m in models.data] == ["test-model"]
    assert httpx.get(mtp_server.root + "/health").json()["status"] == "ok"
    chat(mtp_server, max_tokens=4)
    text = httpx.get(mtp_server.root + "/metrics").text
    for name in ("mtp_requests_total", "mtp_prompt_tokens_total", "mtp_completion_tokens_total",
                 "mtp_time_to_first_token_seconds_bucket", "mtp_inter_token_latency_seconds_bucket",
                 "mtp_queue_depth", "mtp_active_sequences", 'mtp_draft_tokens_total{position="1"}',
                 'mtp_accepted_tokens_total{position="2"}'):
        assert name in text, name
    assert 'mtp_requests_total{endpoint="/v1/chat/completions",status="200"}' in text


def test_chat_non_streaming_and_streaming_agree(mtp_server):
    full = chat(mtp_server)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    u = full.usage
    assert u.completion_tokens == 16 and u.total_tokens == u.prompt_tokens + 16
    # The same prompt again: the second request reuses the first one's prefill.
    again = chat(mtp_server)
    assert again.choices[0].message.content == choice.message.content
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    spec = u.model_extra["speculative"]
    assert spec["depth"] == 2 and spec["drafted"] >= spec["accepted"] >= 0 and 0 <= spec["acceptance_rate"] <= 1

    stream = chat(mtp_server, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_sse_wire_format(mtp_server):
    body = {"model": "test-model", "messages": MSGS, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", mtp_server.base_url + "/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])
    assert "usage" not in json.loads(events[1])  # only with include_usage


def test_keepalive_comments(ckpt):
    with serve(ckpt, ping_seconds=0.05) as s:
        body = {"model": "test-model", "prompt": "x" * 50, "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", s.base_url + "/completions", json=body, timeout=30) as r:
            lines = list(r.iter_lines())
            assert any(line.startswith(":") for line in lines)  # ": ping" comments
            assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines


def test_completions(mtp_server):
    c = client(mtp_server)
    full = c.completions.create(model="test-model", prompt="def add(a, b):", max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    parts = c.completions.create(model="test-model", prompt="def add(a, b):", max_tokens=12, temperature=0, stream=True,
                                 stream_options={"include_usage": True})
    parts = list(parts)
    assert "".join(p.choices[0].text for p in parts if p.choices) == full.choices[0].text
    assert parts[-1].usage.completion_tokens == 12
    ids = c.completions.create(model="test-model", prompt=[5, 17, 99, 3], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_logprobs(mtp_server):
    r = chat(mtp_server, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy picks the top token
    assert "".join(e.token for e in content) == r.choices[0].message.content

    streamed = list(chat(mtp_server, max_tokens=6, logprobs=True, top_logprobs=2, stream=True))
    lps = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in lps] == [e.token for e in content]

    comp = client(mtp_server).completions.create(model="test-model", prompt="abc", max_tokens=5, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.top_logprobs[0]) == 2 and all(x <= 0 for x in lp.token_logprobs)

    # Sampling filters leave tokens at probability 0: reported as a finite floor (JSON has no -inf).
    for kw in ({"top_k": 1}, {"top_p": 0.01}):
        comp = client(mtp_server).completions.create(model="test-model", prompt="abc", max_tokens=4, temperature=0.8,
                                                      seed=3, logprobs=3, extra_body=kw)
        tops = comp.choices[0].logprobs.top_logprobs
        assert all(1 < len(t) <= 3 and min(t.values()) == -9999.0 for t in tops), tops  # (texts may coincide)
        assert all(x == pytest.approx(0.0, abs=1e-5) for x in comp.choices[0].logprobs.token_logprobs)


def test_sampling_parameters_accepted(mtp_server):
    r = chat(mtp_server, max_completion_tokens=5, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.1, seed=7, stop=["\n"],
             extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "mtp_depth": 1, "unknown_field": 1})
    assert r.usage.completion_tokens <= 5 and r.usage.model_extra["speculative"]["depth"] == 1
    a = chat(mtp_server, max_tokens=8, seed=3, extra_body={"temperature": 0.9})
    b = chat(mtp_server, max_tokens=8, seed=3, extra_body={"temperature": 0.9})
    assert a.choices[0].message.content == b.choices[0].message.content  # seeded sampling repeats


# ---------------------------------------------------------------- engine behaviour over HTTP


def test_greedy_with_mtp_equals_without(mtp_server, plain_server):
    prompts = [MSGS, [{"role": "user", "content": "Write a loop in Python."}]]
    for msgs in prompts:
        with_mtp = chat(mtp_server, messages=msgs, max_tokens=32)
        without = chat(plain_server, messages=msgs, max_tokens=32)
        assert with_mtp.usage.model_extra["speculative"]["depth"] == 2
        assert without.usage.model_extra["speculative"]["depth"] == 0
        assert with_mtp.choices[0].message.content == without.choices[0].message.content


def test_concurrent_requests_all_complete(mtp_server):
    prompts = [[{"role": "user", "content": f"Question number {i}?"}] for i in range(6)]
    expected = [chat(mtp_server, messages=m, max_tokens=10).choices[0].message.content for m in prompts]
    results = [None] * len(prompts)

    def run(i):
        stream = chat(mtp_server, messages=prompts[i], max_tokens=10, stream=True)
        results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == expected


def test_client_disconnect_frees_the_slot(mtp_server):
    engine = mtp_server.service.engine
    body = {"model": "test-model", "messages": MSGS, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", mtp_server.base_url + "/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"content": ""' not in line:
                break  # a first token arrived
        assert engine.active_count == 1
    assert wait_until(lambda: engine.active_count == 0, 5), "streaming request still decoding after disconnect"

    # Non-streaming: the client gives up (timeout) and the server notices.
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(mtp_server.base_url + "/chat/completions", json=body, timeout=1.0)
    assert wait_until(lambda: engine.active_count == 0, 5), "non-streaming request still decoding after disconnect"
    assert chat(mtp_server, max_tokens=2).usage.completion_tokens == 2  # still serving


def test_multi_turn_reuse_matches_cold_run(mtp_server, plain_server):
    turn1 = [{"role": "user", "content": "First question about lists."}]
    r1 = chat(mtp_server, messages=turn1, max_tokens=12)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And a follow-up?"}]
    warm = chat(mtp_server, messages=turn2, max_tokens=12)
    assert warm.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    cold = chat(plain_server, messages=turn2, max_tokens=12, extra_body={"mtp_depth": 2})  # never saw turn 1
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content


# ---------------------------------------------------------------- errors


def _post(server, body, path="/chat/completions", **kw):
    return httpx.post(server.base_url + path, json=body, timeout=30, **kw)


@pytest.mark.parametrize("change, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": 3.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"messages": [{"role": "bogus", "content": "x"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"n": 0}, "n"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content"),
])
def test_invalid_values_are_400(plain_server, change, param):
    r = _post(plain_server, {"model": "test-model", "messages": MSGS, **change})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_openai_client_sees_errors(plain_server):
    with pytest.raises(openai.NotFoundError) as e:
        client(plain_server).chat.completions.create(model="no-such-model", messages=MSGS)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        chat(plain_server, messages=[{"role": "user", "content": "long " * 100}])
    assert e.value.body["code"] == "context_length_exceeded"


def test_invalid_json_is_400_with_details(plain_server):
    r = httpx.post(plain_server.base_url + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "invalid JSON" in err["message"] and err["detail"][0]["type"] == "json_invalid"


def test_api_key(ckpt):
    with serve(ckpt, api_key="sekrit") as s:
        assert httpx.get(s.base_url + "/models").status_code == 401
        r = httpx.get(s.base_url + "/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(s, api_key="wrong").models.list()
        assert client(s, api_key="sekrit").models.list().data[0].id == "test-model"
        assert httpx.get(s.root + "/health").status_code == 200  # health stays open


def test_full_queue_is_429_with_retry_after(ckpt):
    with serve(ckpt, max_queue=1, max_active=1) as s:
        engine = s.service.engine
        body = {"model": "test-model", "messages": MSGS, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.base_url + "/chat/completions", json=body, timeout=30) as first:
            first_lines = first.iter_lines()  # keep a reference: a dropped iterator closes the response
            next(first_lines)
            assert wait_until(lambda: engine.active_count == 1)
            with httpx.stream("POST", s.base_url + "/chat/completions", json=body, timeout=30) as second:
                assert wait_until(lambda: engine.queue_depth == 1)
                r = _post(s, {**body, "stream": False})
                assert r.status_code == 429 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
                second.close()
        assert wait_until(lambda: engine.active_count == 0 and engine.queue_depth == 0)
        assert 'status="429"' in httpx.get(s.root + "/metrics").text


# ---------------------------------------------------------------- the command


def test_cli_serves_with_mtp_and_matches_plain(ckpt, plain_server):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mtp_serve.cli.serve", "--model", str(ckpt), "--enable-mtp", "--mtp-depth", "2",
                             "--port", str(port), "--served-model-name", "test-model", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert f"serving test-model" in line and f"127.0.0.1:{port}/v1" in line and "MTP on, depth 2" in line, line
        assert "MLX" in line  # the backend note
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _up(url), 60)
        cli_client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        got = cli_client.chat.completions.create(model="test-model", messages=MSGS, max_tokens=24, temperature=0)
        ref = chat(plain_server, max_tokens=24)
        assert got.choices[0].message.content == ref.choices[0].message.content
        assert got.usage.model_extra["speculative"]["depth"] == 2
    finally:
        proc.terminate()
        proc.wait(20)


def test_cli_without_demo_model_or_mtp(tmp_path, ckpt):
    env = {**os.environ}
    from mtp_serve.models.demo_model import DEMO_MODEL_DIR

    if not (DEMO_MODEL_DIR / "config.json").exists():
        r = subprocess.run([sys.executable, "-m", "mtp_serve.cli.serve", "--port", str(free_port())], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 1 and "demo model is missing" in r.stderr and "--model" in r.stderr
    r = subprocess.run([sys.executable, "-m", "mtp_serve.cli.serve", "--model", str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "model not found" in r.stderr


def _up(url) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def demo_servers():
    """The demo model (a real Qwen3.5-style template: the generation prompt opens a think
    block the next turn's re-rendering drops), with MTP and without."""
    from mtp_serve.models.demo_model import DEMO_MODEL_DIR

    servers = [serve(DEMO_MODEL_DIR, served_model_name="demo", mtp_depth=2), serve(DEMO_MODEL_DIR, served_model_name="demo")]
    yield servers
    for server in servers:
        server.stop()


def test_next_turn_reuses_the_prompt_before_a_re_rendered_reply(demo_servers):
    """Agents send the previous reply back re-rendered (here: the think block dropped):
    the snapshot where turn 1's generation prompt starts still applies."""
    warm_server, cold_server = demo_servers
    turn1 = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    r1 = chat(warm_server, model="demo", messages=turn1, max_tokens=8)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "Now subtract."}]
    warm = chat(warm_server, model="demo", messages=turn2, max_tokens=16)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    # Everything up to turn 1's `<|im_start|>assistant`, not turn 1's whole prompt.
    assert 0 < cached < r1.usage.prompt_tokens, (cached, r1.usage.prompt_tokens)
    cold = chat(cold_server, model="demo", messages=turn2, max_tokens=16, extra_body={"mtp_depth": 2})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content


def test_system_messages_join_the_first(demo_servers):
    """The demo model's (Qwen3.5) template takes one system message, first; Codex sends two
    developer messages and Claude Code system turns: they join the first one."""
    server = demo_servers[0]
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"},
            {"role": "system", "content": "Be brief."}]
    assert chat(server, model="demo", messages=msgs, max_tokens=2).usage.completion_tokens == 2
    r = httpx.post(server.base_url + "/responses", timeout=60, json={"model": "demo", "max_output_tokens": 2, "input": [
        {"role": "developer", "content": "You write Python."}, {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "def add(a, b):"}]})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2, r.text
