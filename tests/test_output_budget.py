"""Output budgets: a max_tokens larger than what the context leaves after the prompt
is lowered to fit by default (LM Studio, Ollama and llama.cpp's server do this; opencode and
Claude Code send 32,000 for any model they do not know), on every API, streamed and not, and
the output ends the way that API reports a hit budget. `--max-tokens-over-context refuse` keeps
vLLM's 400. A prompt that alone does not fit is a 400 either way. Real server on loopback."""

import json

import httpx
import pytest

from support.npm_clients import metric
from test_hardening import ENDPOINTS, assert_error, post
from support.server import serve

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

CONTEXT = 256


@pytest.fixture(scope="module")
def ckpt(checkpoint_dir):
    return checkpoint_dir("qwen3_5", agreeable=True)


@pytest.fixture(scope="module")
def clamping(ckpt):
    s = serve(ckpt, mtp_depth=2, max_context=CONTEXT)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def refusing(ckpt):
    s = serve(ckpt, mtp_depth=2, max_context=CONTEXT, max_tokens_over_context="refuse")
    yield s
    s.stop()


def prompt_tokens(server, endpoint: str) -> int:
    """The endpoint's good body's prompt length, from a one-token request's usage."""
    path, good, field = ENDPOINTS[endpoint]
    usage = post(server, path, {**good, field: 1}).json()["usage"]
    return usage.get("prompt_tokens", usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0))


def final(server, endpoint: str, body: dict) -> tuple:
    """(how the output ended, usage) of a non-streamed or streamed request."""
    path = ENDPOINTS[endpoint][0]
    if not body.get("stream"):
        r = post(server, path, body)
        assert r.status_code == 200, r.text[:500]
        b = r.json()
        ended = {"messages": lambda: b["stop_reason"], "responses": lambda: (b["status"], b["incomplete_details"])}.get(
            endpoint, lambda: b["choices"][0]["finish_reason"])()
        return ended, b["usage"]
    body = {**body, "stream_options": {"include_usage": True}} if endpoint in ("chat", "completions") else body
    with httpx.stream("POST", server.root + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()[:500]
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    if endpoint == "messages":
        delta = next(d for d in events if d["type"] == "message_delta")
        return delta["delta"]["stop_reason"], delta["usage"]
    if endpoint == "responses":
        done = next(d for d in events if d["type"] in ("response.completed", "response.incomplete"))["response"]
        return (done["status"], done["incomplete_details"]), done["usage"]
    ended = next(c["choices"][0]["finish_reason"] for c in events if c.get("choices") and c["choices"][0]["finish_reason"])
    return ended, next(c["usage"] for c in events if c.get("usage"))


HIT_BUDGET = {"chat": "length", "completions": "length", "messages": "max_tokens",
              "responses": ("incomplete", {"reason": "max_output_tokens"})}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_budget_past_the_context_is_lowered_to_fit(clamping, endpoint, stream):
    path, good, field = ENDPOINTS[endpoint]
    n_prompt = prompt_tokens(clamping, endpoint)
    before = metric(httpx.get(clamping.root + "/metrics").text, "mtp_max_tokens_lowered_total")
    ended, usage = final(clamping, endpoint, {**good, field: 32000, "ignore_eos": True, "stream": stream})
    assert ended == HIT_BUDGET[endpoint], (ended, usage)
    out = usage.get("completion_tokens", usage.get("output_tokens"))
    assert out == CONTEXT - n_prompt, (out, n_prompt, usage)  # the whole rest of the context, no token past it
    assert usage["max_tokens_lowered"] == {"requested": 32000, "granted": CONTEXT - n_prompt}, usage
    assert metric(httpx.get(clamping.root + "/metrics").text, "mtp_max_tokens_lowered_total") == before + 1


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_budget_that_fits_is_kept_and_not_reported(clamping, endpoint):
    path, good, field = ENDPOINTS[endpoint]
    ended, usage = final(clamping, endpoint, {**good, field: 3, "ignore_eos": True})
    assert ended == HIT_BUDGET[endpoint] and "max_tokens_lowered" not in usage, usage


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_a_prompt_that_does_not_fit_is_still_400(clamping, endpoint, stream):
    path, good, field = ENDPOINTS[endpoint]
    long = "word " * CONTEXT
    body = {"completions": {"prompt": long}, "responses": {"input": long}}.get(endpoint, {"messages": [{"role": "user", "content": long}]})
    err = assert_error(post(clamping, path, {**good, **body, field: 32000, "stream": stream}), path)
    assert err.get("code", "context_length_exceeded") == "context_length_exceeded" or "context" in err["message"], err


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_refuse_mode_keeps_vllms_rule(refusing, endpoint, stream):
    path, good, field = ENDPOINTS[endpoint]
    n_prompt = prompt_tokens(refusing, endpoint)
    err = assert_error(post(refusing, path, {**good, field: 32000, "stream": stream}), path,
                       param=None if endpoint == "messages" else field)
    assert "32000 for the completion" in err["message"], err
    if endpoint != "messages":
        assert err["code"] == "context_length_exceeded", err
    room = CONTEXT - n_prompt  # exactly the room left still fits
    ended, usage = final(refusing, endpoint, {**good, field: room, "ignore_eos": True, "stream": stream})
    assert ended == HIT_BUDGET[endpoint] and usage.get("completion_tokens", usage.get("output_tokens")) == room
    assert_error(post(refusing, path, {**good, field: room + 1}), path)
