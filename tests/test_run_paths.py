"""One request path behind four APIs (server/run.py): the reasoning-budget split and the
200 count in /metrics behave the same on chat completions, completions, Messages and
Responses, streamed and not. Real HTTP against the scripted model, whose reply to HI
reasons for 19 tokens ("Greet them briefly.") before it answers."""

import json
import re

import httpx
import pytest
from transformers import AutoTokenizer

from support.server import SCRIPT, SCRIPT_TEMPLATE, serve

pytestmark = pytest.mark.e2e

HI = SCRIPT[2][0]
MODEL = "test-model"


def hi_text(checkpoint) -> str:
    """HI rendered with thinking on: the raw prompt for /v1/completions."""
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    return tok.apply_chat_template(HI, tokenize=False, add_generation_prompt=True, chat_template=SCRIPT_TEMPLATE,
                                   enable_thinking=True)


def body(api: str, prompt: str, budget: int, max_tokens: int) -> tuple:
    """(path, request body) asking for HI's reply with thinking on and a reasoning budget."""
    greedy = {"model": MODEL, "temperature": 0}
    if api == "chat":
        return "/v1/chat/completions", {**greedy, "messages": HI, "max_tokens": max_tokens, "thinking_token_budget": budget,
                                        "chat_template_kwargs": {"enable_thinking": True}}
    if api == "completions":
        return "/v1/completions", {**greedy, "prompt": prompt, "max_tokens": max_tokens, "thinking_token_budget": budget}
    if api == "messages":
        return "/v1/messages", {**greedy, "messages": HI, "max_tokens": max_tokens,
                                "thinking": {"type": "enabled", "budget_tokens": budget}}
    return "/v1/responses", {**greedy, "input": HI, "max_output_tokens": max_tokens, "thinking_token_budget": budget,
                             "reasoning": {"effort": "high"}}


def reasoning_and_tokens(api: str, stream: bool, r: httpx.Response) -> tuple:
    """(the reasoning text, output tokens) of a reply, from each API's own fields."""
    if stream:
        data = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        if api == "chat":
            text = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in data if c.get("choices"))
            return text, data[-1]["usage"]["completion_tokens"]
        if api == "completions":
            text = "".join(c["choices"][0]["text"] for c in data if c.get("choices"))
            return text.split("</think>")[0].strip(), data[-1]["usage"]["completion_tokens"]
        if api == "messages":
            text = "".join(d["delta"].get("thinking", "") for d in data if d["type"] == "content_block_delta")
            return text, next(d for d in data if d["type"] == "message_delta")["usage"]["output_tokens"]
        done = data[-1]["response"]
        return responses_reasoning(done), done["usage"]["output_tokens"]
    b = r.json()
    if api == "chat":
        return b["choices"][0]["message"].get("reasoning_content") or "", b["usage"]["completion_tokens"]
    if api == "completions":
        return b["choices"][0]["text"].split("</think>")[0].strip(), b["usage"]["completion_tokens"]
    if api == "messages":
        return "".join(c.get("thinking", "") for c in b["content"] if c["type"] == "thinking"), b["usage"]["output_tokens"]
    return responses_reasoning(b), b["usage"]["output_tokens"]


def responses_reasoning(b: dict) -> str:
    return "".join(c["text"] for item in b["output"] if item["type"] == "reasoning" for c in item["content"])


def ok_count(root: str, path: str) -> float:
    text = httpx.get(root + "/metrics", timeout=30).text
    m = re.search(r'^mtp_requests_total\{endpoint="%s",status="200"\} (\S+)$' % re.escape(path), text, re.M)
    return float(m.group(1)) if m else 0.0


def send(root: str, path: str, req: dict, stream: bool) -> tuple:
    if not stream:
        r = httpx.post(root + path, json=req, timeout=120)
        assert r.status_code == 200, r.text
        return r
    usage = {"stream_options": {"include_usage": True}} if "/v1/chat/" in path or "/v1/completions" in path else {}
    with httpx.stream("POST", root + path, json={**req, "stream": True, **usage}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        r.read()
        return r


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "completions", "messages", "responses"])
def test_reasoning_budget_and_one_count_per_request(scripted, scripted_checkpoint, api, stream):
    prompt = hi_text(scripted_checkpoint)
    path, full = body(api, prompt, budget=100, max_tokens=60)
    before = ok_count(scripted.root, path)
    r = send(scripted.root, path, full, stream)
    reasoning, _ = reasoning_and_tokens(api, stream, r)
    assert reasoning.strip() == "Greet them briefly."  # within the budget: the model's own reasoning
    assert ok_count(scripted.root, path) == before + 1  # the 200 counted once

    path, capped = body(api, prompt, budget=5, max_tokens=60)
    r = send(scripted.root, path, capped, stream)
    reasoning, n = reasoning_and_tokens(api, stream, r)
    assert reasoning.strip() == "Greet" and n <= 60  # closed after 5 tokens; two engine requests, one reply
    assert ok_count(scripted.root, path) == before + 2

    # A budget right under max_tokens: the think block's end and the answer fit in max_tokens, or nothing is added.
    path, tight = body(api, prompt, budget=5, max_tokens=6)
    r = send(scripted.root, path, tight, stream)
    _, n = reasoning_and_tokens(api, stream, r)
    assert n <= 6
    assert ok_count(scripted.root, path) == before + 3


def test_budget_never_passes_the_context(scripted_checkpoint):
    """A prompt that leaves 7 tokens of the context, with a budget of 6: at most 7 come back.
    (Its own server with a short --max-context: the prompt fills the context, prefilled whole.)"""
    with serve(scripted_checkpoint, max_context=512) as server:
        info = httpx.get(server.root + "/v1/models", timeout=30).json()["data"][0]
        context = info["max_model_len"]
        ids = AutoTokenizer.from_pretrained(str(scripted_checkpoint)).encode(hi_text(scripted_checkpoint))
        room = 7
        padded = [ids[0]] * (context - room - len(ids)) + ids  # the same ending: the think block still opens
        r = httpx.post(server.root + "/v1/completions", json={"model": MODEL, "prompt": padded, "max_tokens": 32,
                                                              "thinking_token_budget": 6, "temperature": 0}, timeout=300)
    assert context == 512
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] <= context and u["completion_tokens"] <= room, u
    assert json.dumps(r.json()["usage"]["max_tokens_lowered"]) == json.dumps({"requested": 32, "granted": room})
