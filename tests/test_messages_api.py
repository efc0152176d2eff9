"""The Anthropic Messages API (/v1/messages) over real HTTP: the `anthropic` SDK as the
client, raw SSE read with httpx where the wire format matters."""

import anthropic
import httpx
import openai
import pytest

from support.api_events import anthropic_blocks, check_anthropic_order, sse_events
from support.server import SCRIPT, WEATHER_TOOL, serve
from test_server import wait_until

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

WEATHER_PT, _, HI, _, ROME = (s[0] for s in SCRIPT)
MSGS = [{"role": "user", "content": "Hello, model."}]
GREEDY = {"temperature": 0}  # anthropic 2.x takes sampling arguments only through extra_body
WEATHER = {"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER_TOOL["function"]["parameters"]}


def client(server, api_key="none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.root, api_key=api_key, max_retries=0, timeout=60)


def create(server, messages=MSGS, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("model", "test-model")
    kw["extra_body"] = {**GREEDY, **kw.get("extra_body", {})}
    return client(server).messages.create(messages=messages, **kw)


def raw_stream(server, body: dict, path="/v1/messages?beta=true") -> list:
    with httpx.stream("POST", server.root + path, json={"model": "test-model", "stream": True, **GREEDY, **body}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)


def test_message_non_streamed_and_streamed_agree(server):
    full = create(server, system="You are terse.")
    assert full.type == "message" and full.role == "assistant" and full.stop_reason == "max_tokens"
    assert [b.type for b in full.content] == ["text"] and full.content[0].text
    u = full.usage
    assert u.output_tokens == 16 and u.input_tokens + u.cache_read_input_tokens > 0
    spec = u.model_extra["speculative"]
    assert spec["depth"] == 2 and spec["drafted"] >= spec["accepted"] >= 0

    with client(server).messages.stream(model="test-model", max_tokens=16, system="You are terse.", messages=MSGS,
                                        extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full.content[0].text and final.stop_reason == "max_tokens"
    # The same prompt again: input_tokens counts only what was not read from the prompt cache.
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == u.input_tokens + u.cache_read_input_tokens

    events = raw_stream(server, {"max_tokens": 16, "system": "You are terse.", "messages": MSGS})
    kinds = check_anthropic_order(events)
    assert "ping" in [n for n, _ in events]
    assert anthropic_blocks(kinds) == [{"type": "text", "text": full.content[0].text}]
    delta = kinds[-2]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} and delta["usage"]["output_tokens"] == 16


def test_greedy_text_equals_chat_completions(server):
    conversation = [{"role": "user", "content": "Write a loop."}, {"role": "assistant", "content": "for i in x:"},
                    {"role": "user", "content": "Another one."}]
    m = create(server, messages=conversation, system="You write Python.", max_tokens=24)
    chat = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0).chat.completions.create(
        model="test-model", messages=[{"role": "system", "content": "You write Python."}] + conversation, max_tokens=24, temperature=0)
    assert m.content[0].text == chat.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_stop_sequence_and_count_tokens(server):
    text = create(server, max_tokens=12).content[0].text
    stop = text[5:7]
    r = create(server, max_tokens=12, stop_sequences=[stop, "never-there"])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.find(stop)]
    kinds = check_anthropic_order(raw_stream(server, {"max_tokens": 12, "messages": MSGS, "stop_sequences": [stop]}))
    assert kinds[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}

    count = client(server).messages.count_tokens(model="test-model", messages=MSGS)
    assert count.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens


def test_tool_use_round_trip(scripted):
    thinking = {"type": "enabled", "budget_tokens": 200}
    r = create(scripted, messages=WEATHER_PT, tools=[WEATHER], thinking=thinking, max_tokens=400)
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["thinking", "tool_use", "tool_use"]
    assert r.content[0].thinking == "The user wants the weather."
    calls = r.content[1:]
    assert [(c.name, c.input) for c in calls] == [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Tokyo"})]
    assert calls[0].id.startswith("toolu_") and calls[0].id != calls[1].id

    events = raw_stream(scripted, {"max_tokens": 400, "messages": WEATHER_PT, "tools": [WEATHER], "thinking": thinking})
    kinds = check_anthropic_order(events)
    blocks = anthropic_blocks(kinds)
    assert [b["type"] for b in blocks] == ["thinking", "tool_use", "tool_use"]
    assert [b["input"] for b in blocks[1:]] == [{"city": "Paris", "days": 3}, {"city": "Tokyo"}]
    assert kinds[-2]["delta"]["stop_reason"] == "tool_use"

    # The tool results go back; the model answers (whatever it says, the turn completes).
    turn2 = WEATHER_PT + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21C"},
                                                       {"type": "tool_result", "tool_use_id": calls[1].id,
                                                        "content": [{"type": "text", "text": "Rain"}]}]}]
    r2 = create(scripted, messages=turn2, tools=[WEATHER], thinking=thinking, max_tokens=40)
    assert r2.stop_reason in ("end_turn", "max_tokens", "tool_use") and r2.usage.cache_read_input_tokens > 0


def test_named_tool_choice_and_thinking_budget(scripted):
    r = create(scripted, messages=ROME, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
               thinking={"type": "disabled"}, max_tokens=200)
    assert [(b.type, b.name, b.input) for b in r.content] == [("tool_use", "get_weather", {"city": "Rome"})]
    # Thinking on, its reply reasons for 19 tokens ("Greet them briefly."): a budget of 5 closes
    # the think block after 5 tokens and the model goes on with the answer.
    full = create(scripted, messages=HI, thinking={"type": "enabled", "budget_tokens": 100}, max_tokens=60)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in full.content] == [("thinking", "Greet them briefly."), ("text", "Hello there!")]
    capped = create(scripted, messages=HI, thinking={"type": "enabled", "budget_tokens": 5}, max_tokens=60)
    assert capped.content[0].type == "thinking" and capped.content[0].thinking == "Greet"
    assert capped.usage.output_tokens <= 60 and capped.stop_reason in ("end_turn", "max_tokens")
    events = raw_stream(scripted, {"max_tokens": 60, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 5}})
    assert anthropic_blocks(check_anthropic_order(events))[0] == {"type": "thinking", "thinking": "Greet", "signature": ""}


def _error(server, body, status=400, path="/v1/messages"):
    r = httpx.post(server.root + path, json={"model": "test-model", **body}, timeout=30)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["message"], body
    return body["error"]


@pytest.mark.parametrize("body, needle", [
    ({"messages": MSGS}, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]}]}, "image"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]}, "tool_use"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]}, "image"),
    ({"max_tokens": 8, "messages": MSGS, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "not in tools"),
    ({"max_tokens": 8, "messages": MSGS, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "not supported"),
    ({"max_tokens": 8, "messages": [{"role": "bogus", "content": "x"}]}, "role"),
    ({"max_tokens": 8, "messages": MSGS, "thinking": {"type": "enabled"}}, "budget_tokens"),
])
def test_bad_input_is_a_400_in_anthropic_shape(server, body, needle):
    err = _error(server, body)
    assert err["type"] == "invalid_request_error" and needle in err["message"], err


def test_errors_through_the_sdk(server):
    with pytest.raises(anthropic.NotFoundError) as e:
        client(server).messages.create(model="no-such-model", max_tokens=4, messages=MSGS)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client(server).messages.create(model="test-model", max_tokens=4, messages=[{"role": "user", "content": "long " * 9000}])


def test_x_api_key(checkpoint_dir):
    with serve(checkpoint_dir("qwen3_5", agreeable=True), api_key="sekrit") as s:
        with pytest.raises(anthropic.AuthenticationError) as e:
            client(s, api_key="wrong").messages.create(model="test-model", max_tokens=2, messages=MSGS)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
        assert client(s, api_key="sekrit").messages.create(model="test-model", max_tokens=2, messages=MSGS).usage.output_tokens == 2


def test_disconnect_mid_stream_cancels(server):
    engine = server.service.engine
    body = {"model": "test-model", "max_tokens": 3000, "messages": MSGS, "stream": True}
    with httpx.stream("POST", server.root + "/v1/messages", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for line in lines:
            if "content_block_delta" in line:
                break
        assert engine.active_count == 1
    assert wait_until(lambda: engine.active_count == 0, 5), "still decoding after the client left"
