"""Images in through every API: chat `image_url`, Messages `image`
blocks (also inside `tool_result`), Responses `input_image`; data URLs, base64 and http(s) URLs
served from a loopback HTTP server; every bad image a 400 in the API's own shape, streamed or
not; the image-pad tokens of the rendered prompt, in order, one run of `n_tokens` per image;
usage's image tokens. Live servers on synthetic checkpoints: a vision-language one (tiny vision
tower, preprocessor bounds of at most 16 image tokens) and the text-only one."""

from __future__ import annotations

import base64
import io
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import numpy as np
import openai
import pytest

from mtp_serve.server.images import ImageSettings

e2e = pytest.mark.e2e  # live servers (conftest.py: test tiers); Codex below is the agents tier

LIMITS = ImageSettings(max_images=4, max_image_bytes=200_000, max_image_pixels=1_000_000, fetch_timeout=1.0,
                       fetch_allow_hosts=("127.0.0.1",))  # the image host below is on loopback
GREEDY = {"temperature": 0}


def png(width: int, height: int, noise: bool = False, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    if noise:  # incompressible: its PNG has about 3 bytes a pixel
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        pixels = np.zeros((height, width, 3), np.uint8) + rng.integers(0, 256, 3, dtype=np.uint8)
        pixels[: height // 2, : width // 3] = 255 - pixels[0, 0]
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


SMALL = png(64, 64)  # 4 image tokens at patch 16, merge 2
WIDE = png(128, 96, seed=1)  # 12
BIG = png(300, 300, noise=True)  # ~270 KB: over LIMITS.max_image_bytes
HUGE = png(1100, 1000)  # 1.1 Mpixels: over LIMITS.max_image_pixels, a few KB


# ---------------------------------------------------------------- a loopback image host


class ImageHost:
    """http://127.0.0.1:PORT/<name>: the PNGs above, a slow one, a 404, and a big one sent
    without Content-Length (the limit must hold while reading)."""

    def __init__(self):
        host = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                host.hits.append(self.path)
                name = self.path.lstrip("/")
                if name == "slow.png":
                    time.sleep(LIMITS.fetch_timeout + 1.5)
                body = {"small.png": SMALL, "wide.png": WIDE, "big.png": BIG, "slow.png": SMALL,
                        "unsized.png": BIG}.get(name)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                if name != "unsized.png":
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:  # the server stopped reading at its limit
                    pass

        self.hits = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def host():
    h = ImageHost()
    yield h
    h.close()


def load_with_vision(path):
    from mtp_serve.models.loader import load_model

    loaded = load_model(str(path))
    assert loaded.model.vision is not None, "the synthetic vision checkpoint loaded without its vision tower"
    return loaded


@pytest.fixture(scope="module")
def vision_server(checkpoint_dir):
    from support.server import LiveServer, ServerConfig

    path = checkpoint_dir("qwen3_5", vision=True, agreeable=True)
    s = LiveServer(load_with_vision(path), ServerConfig(served_model_name="test-model", mtp_depth=2, fixed_depth=True,
                                                       images=LIMITS)).start()
    yield s
    s.stop()


# ---------------------------------------------------------------- one image in each API's wire form


def chat_body(urls, text="What is in the picture?", **kw) -> dict:
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "test-model", "messages": [{"role": "user", "content": parts}], "max_tokens": 4, **GREEDY, **kw}


def anthropic_image(url: str) -> dict:
    if url.startswith("data:") and ";base64," in url:
        media, data = url[5:].split(";base64,", 1)
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def messages_body(urls, text="What is in the picture?", **kw) -> dict:
    blocks = [anthropic_image(u) for u in urls] + [{"type": "text", "text": text}]
    return {"model": "test-model", "messages": [{"role": "user", "content": blocks}], "max_tokens": 4, **GREEDY, **kw}


def responses_body(urls, text="What is in the picture?", **kw) -> dict:
    parts = [{"type": "input_text", "text": text}] + [{"type": "input_image", "image_url": u} for u in urls]
    return {"model": "test-model", "input": [{"role": "user", "content": parts}], "max_output_tokens": 4, **GREEDY, **kw}


APIS = {"chat": ("/v1/chat/completions", chat_body), "messages": ("/v1/messages", messages_body),
        "responses": ("/v1/responses", responses_body)}


def post(server, api: str, urls, stream: bool = False, **kw) -> httpx.Response:
    path, body = APIS[api]
    return httpx.post(server.root + path, json=body(urls, stream=stream, **kw), timeout=60)


def error_message(api: str, r: httpx.Response) -> str:
    """The 400's message, checking the API's own error shape."""
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers  # a 400, also when streaming was asked
    body = r.json()
    if api == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    else:
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"], body
    return body["error"]["message"]


# ---------------------------------------------------------------- 400s


@e2e
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_only_model_refuses_images(server, api, stream):
    msg = error_message(api, post(server, api, [data_url(SMALL)], stream=stream))
    assert "no vision tower" in msg and "content[" in msg, msg


CLOSED = socket.socket()  # bound, never listening: connections to its port are refused (and no server takes it)
CLOSED.bind(("127.0.0.1", 0))

BAD = {  # class: (urls, a needle of the 400's message); `{host}` is the loopback image host
    "undecodable": ([data_url(b"this is not a picture at all")], "decode"),
    "bad base64": (["data:image/png;base64,iVBOR!!w0KGgo="], "base64"),
    "not base64": (["data:image/png,rawbytes"], "base64"),
    "unsupported scheme": (["file:///etc/hostname"], "scheme 'file'"),
    "no scheme": (["picture.png"], "without a scheme"),
    "too many bytes": ([data_url(BIG)], "--max-image-bytes"),
    "too many bytes fetched": (["{host}/big.png"], "--max-image-bytes"),
    "too many bytes without length": (["{host}/unsized.png"], "--max-image-bytes"),
    "too many pixels": ([data_url(HUGE)], "--max-image-pixels"),
    "too many images": ([data_url(SMALL)] * (LIMITS.max_images + 1), "--max-images"),
    "http 404": (["{host}/missing.png"], "could not fetch the image (the request failed"),
    "refused": ([f"http://127.0.0.1:{CLOSED.getsockname()[1]}/x.png"], "could not fetch the image (the request failed"),
    "fetch timeout": (["{host}/slow.png"], "--image-fetch-timeout"),
    "fetch timeouts side by side": (["{host}/slow.png"] * LIMITS.max_images, "--image-fetch-timeout"),  # one timeout, not four
}


@e2e
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("case", BAD)
def test_bad_images_are_400s_in_each_api(vision_server, host, api, case):
    urls, needle = BAD[case]
    urls = [u.replace("{host}", host.url) for u in urls]
    for stream in (False, True):
        started = time.monotonic()
        msg = error_message(api, post(vision_server, api, urls, stream=stream))
        assert needle in msg and "content[" in msg, (case, msg)
        assert time.monotonic() - started < LIMITS.fetch_timeout + 1.0  # the time limit holds
    assert vision_server.service.engine.active_count == 0


@e2e
def test_images_in_system_and_assistant_turns_are_400s(vision_server):
    image = {"type": "image_url", "image_url": {"url": data_url(SMALL)}}
    for role in ("system", "assistant"):
        body = {"model": "test-model", "max_tokens": 4, "messages": [{"role": role, "content": [image]},
                                                                     {"role": "user", "content": "hi"}]}
        msg = error_message("chat", httpx.post(vision_server.base_url + "/chat/completions", json=body, timeout=30))
        assert "image content is not supported here" in msg, msg


# ---------------------------------------------------------------- the rendered prompt


def pad_runs(ids, pad: int) -> list:
    runs, n = [], 0
    for t in list(ids) + [-1]:
        if t == pad:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def conversations(host_url: str) -> dict:
    """The same conversation in each API: an image in an earlier user turn, two in a tool
    result (one fetched), and one in the last turn."""
    a, b, c, d = data_url(SMALL), data_url(WIDE), f"{host_url}/small.png", data_url(png(96, 64, seed=3))
    call = {"name": "screenshot", "arguments": "{}"}
    chat = [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": a}]},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": call}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image_url", "image_url": {"url": b}},
                                                                {"type": "text", "text": "and"},
                                                                {"type": "image_url", "image_url": {"url": c, "detail": "high"}}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": d}}, {"type": "text", "text": "Which?"}]}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look: "}, anthropic_image(a)]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "screenshot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                              "content": [anthropic_image(b), {"type": "text", "text": "and"}, anthropic_image(c)]},
                                             anthropic_image(d), {"type": "text", "text": "Which?"}]}]
    responses = [{"role": "user", "content": [{"type": "input_text", "text": "Look: "}, {"type": "input_image", "image_url": a}]},
                 {"type": "function_call", "call_id": "c1", **call},
                 {"type": "function_call_output", "call_id": "c1",
                  "output": [{"type": "input_image", "image_url": b}, {"type": "input_text", "text": "and"},
                             {"type": "input_image", "image_url": c}]},
                 {"role": "user", "content": [{"type": "input_image", "image_url": d}, {"type": "input_text", "text": "Which?"}]}]
    return {"chat": chat, "messages": messages, "responses": responses, "sent": [SMALL, WIDE, SMALL, png(96, 64, seed=3)]}


@e2e
def test_images_reach_the_prompt_in_order_with_their_token_counts(vision_server, host):
    from mtp_serve.models.vision import prepare_image
    from mtp_serve.server import anthropic_api, openai_api, responses_api
    from mtp_serve.server.schemas import ChatCompletionRequest

    svc = vision_server.service
    spec = svc.chat.vision.spec
    conv = conversations(host.url)
    expected = [prepare_image(data, spec) for data in conv["sent"]]
    assert len({e.n_tokens for e in expected}) >= 3  # sizes that tell the images apart by their runs
    tool = [{"type": "function", "function": {"name": "screenshot", "parameters": {"type": "object", "properties": {}}}}]
    prompts = {
        "chat": openai_api.render_chat(svc, ChatCompletionRequest.model_validate({"messages": conv["chat"], "tools": tool})),
        "messages": anthropic_api.render(svc, anthropic_api.MessagesRequest.model_validate(
            {"messages": conv["messages"], "max_tokens": 4, "tools": [{"name": "screenshot", "input_schema": {"type": "object"}}]})),
        "responses": responses_api.render(svc, responses_api.ResponsesRequest.model_validate(
            {"input": conv["responses"], "tools": [{"type": "function", "name": "screenshot"}]}), [])[0],
    }
    for api, prompt in prompts.items():
        assert pad_runs(prompt.ids, spec.image_token_id) == [e.n_tokens for e in expected], api
        assert [i.digest for i in prompt.images] == [e.digest for e in expected], api
        assert prompt.image_tokens == sum(e.n_tokens for e in expected)
        # each run sits between the vision start and end tokens the template wrote
        starts = [i for i, t in enumerate(prompt.ids) if t == spec.vision_start_token_id]
        assert [prompt.ids[s + 1 + e.n_tokens] for s, e in zip(starts, expected)] == [spec.vision_end_token_id] * 4, api
    assert (f"/small.png") in host.hits


@e2e
def test_usage_counts_image_tokens_and_the_log_says_so(vision_server, host, caplog):
    spec = vision_server.service.chat.vision.spec
    from mtp_serve.models.vision import prepare_image

    n = prepare_image(SMALL, spec).n_tokens + prepare_image(WIDE, spec).n_tokens
    urls = [data_url(SMALL), f"{host.url}/wide.png"]
    with caplog.at_level(logging.INFO, logger="mtp_serve.server"):
        chat = post(vision_server, "chat", urls).json()["usage"]
        resp = post(vision_server, "responses", urls).json()["usage"]
    assert chat["prompt_tokens_details"]["image_tokens"] == n and chat["prompt_tokens"] > n
    assert resp["input_tokens_details"]["image_tokens"] == n and resp["input_tokens"] == chat["prompt_tokens"]
    assert sum(f"2 images, {n} image tokens" in r.getMessage() for r in caplog.records) >= 2, caplog.text
    # streamed chat: the usage chunk; Messages: count_tokens counts the images' tokens
    with httpx.stream("POST", vision_server.base_url + "/chat/completions", timeout=60,
                      json=chat_body(urls, stream=True, stream_options={"include_usage": True})) as r:
        last = [line for line in r.iter_lines() if line.startswith("data: {")][-1]
    assert f'"image_tokens": {n}' in last
    counted = httpx.post(vision_server.root + "/v1/messages/count_tokens", json=messages_body(urls), timeout=60).json()
    assert counted["input_tokens"] == chat["prompt_tokens"]
    text = post(vision_server, "chat", []).json()["usage"]
    assert text["prompt_tokens_details"]["image_tokens"] == 0


@e2e
def test_an_image_in_a_stored_response_reaches_the_next_turn(vision_server):
    first = post(vision_server, "responses", [data_url(WIDE)]).json()
    n = first["usage"]["input_tokens_details"]["image_tokens"]
    assert n == 12
    body = {"model": "test-model", "input": "And now?", "previous_response_id": first["id"], "max_output_tokens": 4, **GREEDY}
    follow = httpx.post(vision_server.base_url + "/responses", json=body, timeout=60).json()
    assert follow["usage"]["input_tokens_details"]["image_tokens"] == n
    assert follow["usage"]["input_tokens"] > first["usage"]["input_tokens"]


@e2e
def test_a_raw_prompt_with_image_pads_is_a_400(vision_server):
    pad = vision_server.service.chat.vision.spec.image_token_id
    r = httpx.post(vision_server.base_url + "/completions", json={"model": "test-model", "prompt": [1, pad, 2], "max_tokens": 2})
    assert r.status_code == 400 and "image placeholder" in r.json()["error"]["message"], r.text


# ---------------------------------------------------------------- real clients


@e2e
def test_openai_sdk_image_url(vision_server, host):
    client = openai.OpenAI(base_url=vision_server.base_url, api_key="none", max_retries=0)
    content = [{"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": data_url(SMALL)}}]
    r = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": content}], max_tokens=6,
                                       temperature=0)
    assert r.choices[0].message.content is not None and r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens_details.image_tokens == 4  # 64x64 at patch 16, merge 2
    fetched = client.chat.completions.create(
        model="test-model", max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": [content[0], {"type": "image_url", "image_url": {"url": f"{host.url}/small.png"}}]}])
    assert fetched.choices[0].message.content == r.choices[0].message.content  # the same image, by URL
    stream = client.responses.create(model="test-model", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": data_url(WIDE)}]}],
        max_output_tokens=6, temperature=0, stream=True)
    done = [e for e in stream if e.type in ("response.completed", "response.incomplete")][-1]
    assert done.response.usage.input_tokens_details.model_extra["image_tokens"] == 12


@e2e
def test_anthropic_sdk_base64_image_and_tool_result(vision_server):
    client = anthropic.Anthropic(base_url=vision_server.root, api_key="none", max_retries=0, timeout=60)
    image = anthropic_image(data_url(SMALL))
    m = client.messages.create(model="test-model", max_tokens=6, extra_body=GREEDY,
                               messages=[{"role": "user", "content": [image, {"type": "text", "text": "Describe it."}]}])
    assert m.content[0].type == "text" and m.usage.output_tokens == 6
    # Claude Code's Read of a screenshot: the image comes back inside a tool_result
    tools = [{"name": "Read", "description": "Read a file", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    turns = [{"role": "user", "content": "Look at shot.png"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "shot.png"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}]}]
    with client.messages.stream(model="test-model", max_tokens=6, tools=tools, messages=turns, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.stop_reason in ("max_tokens", "end_turn", "tool_use")
    counted = client.messages.count_tokens(model="test-model", tools=tools, messages=turns)
    without = client.messages.count_tokens(model="test-model", tools=tools, messages=turns[:2] + [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}])
    assert counted.input_tokens - without.input_tokens >= 4  # the image's pads (and its start/end tokens)


# ---------------------------------------------------------------- agents: Codex CLI and Claude Code


@pytest.fixture(scope="module")
def agent_server(checkpoint_dir):
    """The vision checkpoint served as README's agent configurations name it (`demo`)."""
    from support.server import LiveServer, ServerConfig

    path = checkpoint_dir("qwen3_5", vision=True, agreeable=True, likely_eos=True)
    with LiveServer(load_with_vision(path), ServerConfig(served_model_name="demo", mtp_depth=2, max_context=32768)) as s:
        yield s


def image_requests(caplog) -> list:
    return [rec.getMessage() for rec in caplog.records if "image tokens" in rec.getMessage()]


@pytest.mark.agents
def test_codex_exec_with_an_image(agent_server, tmp_path, caplog):
    """`codex exec "..." -i picture.png`, configured as README says: the picture reaches the
    model as image tokens (the request's log line), and Codex gets its answer. With one-line
    instructions (`model_instructions_file`): the picture is the claim here, Codex's own 20k-token
    prompt runs in test_agents.py."""
    import subprocess

    from test_agents import Codex

    picture = tmp_path / "picture.png"
    picture.write_bytes(WIDE)
    agent = Codex(agent_server, tmp_path)
    (tmp_path / "instructions.md").write_text("You are a helpful assistant.\n")
    with caplog.at_level(logging.INFO, logger="mtp_serve.server"):
        r = subprocess.run([agent.bin, "exec", "--skip-git-repo-check", "-c", f"model_instructions_file={tmp_path / 'instructions.md'}",
                            "What is in this picture?", "-i", str(picture)],
                           cwd=agent.project, env=agent.env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert any("1 image, 12 image tokens" in line for line in image_requests(caplog)), caplog.text[-3000:]


@pytest.mark.agents
def test_claude_code_with_an_image(agent_server, tmp_path, caplog):
    """Claude Code, configured as README says, sends a user turn holding a picture (`-p
    --input-format stream-json`, as a script or an IDE drives it): it reaches the model as image
    tokens. A one-line system prompt and no tools: the picture is the claim here, Claude Code's
    full prompt runs in test_agents.py."""
    import json
    import subprocess

    from test_agents import ClaudeCode

    agent = ClaudeCode(agent_server, tmp_path)
    turn = {"type": "user", "message": {"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(WIDE).decode()}},
        {"type": "text", "text": "What is in this picture?"}]}}
    with caplog.at_level(logging.INFO, logger="mtp_serve.server"):
        r = subprocess.run([agent.bin, "-p", "--tools", "", "--system-prompt", "You are a helpful assistant.",
                            "--input-format", "stream-json", "--output-format", "stream-json", "--verbose"],
                           input=json.dumps(turn) + "\n", cwd=agent.project, env=agent.env, capture_output=True, text=True,
                           timeout=420)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["type"] == "result" and not result["is_error"], result
    assert any("1 image, 12 image tokens" in line for line in image_requests(caplog)), caplog.text[-3000:]


def test_max_image_tokens_resizes_large_images_down(checkpoint_dir):
    """--max-image-tokens lowers the checkpoint's resize bound: a picture that would take 12
    tokens takes at most 4, keeping its aspect; smaller ones are untouched."""
    from mtp_serve.models.vision import VisionSpec, prepare_image
    from mtp_serve.server.images import capped_spec

    path = checkpoint_dir("qwen3_5", agreeable=True, vision=True)
    import json

    spec = VisionSpec.from_model_dir(json.loads((path / "config.json").read_text()), path)
    big = prepare_image(png(128, 96), spec)
    small = prepare_image(png(128, 96), capped_spec(spec, 4))
    assert big.n_tokens == 12 and 1 <= small.n_tokens <= 4
    assert small.grid_thw[2] >= small.grid_thw[1]  # still wider than tall
    assert capped_spec(spec, 0) is spec and capped_spec(spec, 1000) is spec


@e2e
def test_qwen4_exp_serves_images_through_the_chat_api(checkpoint_dir):
    """A Qwen3.8-Flash-Next (`qwen4_exp`) checkpoint with its tower: a chat request with an image
    counts its image tokens, another image changes the reply, and greedy replies with MTP equal
    those without it, also while requests with and without images run together."""
    from concurrent.futures import ThreadPoolExecutor

    from support.server import LiveServer, ServerConfig

    path = checkpoint_dir("qwen4_exp", vision=True, agreeable=True)
    server = LiveServer(load_with_vision(path), ServerConfig(served_model_name="test-model", mtp_depth=2,
                                                             fixed_depth=True, images=LIMITS)).start()
    try:
        def ask(urls, depth, text="What is in the picture?"):
            r = httpx.post(server.root + "/v1/chat/completions", timeout=120,
                           json=chat_body(urls, text=text, max_tokens=16, mtp_depth=depth, ignore_eos=True))
            assert r.status_code == 200, r.text
            body = r.json()
            return body["choices"][0]["message"]["content"], body["usage"]

        plain, usage = ask([data_url(SMALL)], 0)
        assert usage["prompt_tokens_details"]["image_tokens"] == 4 and usage["completion_tokens"] == 16
        assert ask([data_url(SMALL)], 2)[0] == ask([data_url(SMALL)], 3)[0] == plain
        other = ask([data_url(WIDE)], 0)[0]
        assert other != plain
        requests = [([data_url(SMALL)], "What is in the picture?"), ([], "no picture here"), ([data_url(WIDE)], "and this?")]
        alone = [ask(urls, 0, text)[0] for urls, text in requests]
        with ThreadPoolExecutor(len(requests)) as pool:  # together: batched rounds
            together = list(pool.map(lambda r: ask(r[0], 2, r[1])[0], requests))
        assert together == alone and alone[0] == plain
    finally:
        server.stop()
