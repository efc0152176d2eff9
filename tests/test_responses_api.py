"""The OpenAI Responses API (/v1/responses) over real HTTP: the `openai` SDK's
`client.responses` as the client, raw SSE read with httpx where the wire format matters."""

import json

import httpx
import openai
import pytest

from support.api_events import check_responses_order, sse_events
from support.server import SCRIPT, WEATHER_TOOL, serve
from test_server import wait_until

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

WEATHER_PT, _, HI, _, ROME = (s[0] for s in SCRIPT)
WEATHER = {"type": "function", **WEATHER_TOOL["function"]}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def create(server, input="Hello, model.", **kw):
    kw.setdefault("max_output_tokens", 16)
    kw.setdefault("model", "test-model")
    return client(server).responses.create(input=input, temperature=0, **kw)


def raw_stream(server, body: dict) -> list:
    with httpx.stream("POST", server.base_url + "/responses", timeout=60,
                      json={"model": "test-model", "stream": True, "temperature": 0, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)


def test_response_non_streamed_and_streamed_agree(server):
    full = create(server, instructions="You are terse.")
    assert full.status == "incomplete" and full.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in full.output] == ["message"] and full.output_text
    u = full.usage
    assert u.output_tokens == 16 and u.total_tokens == u.input_tokens + 16
    assert u.model_extra["speculative"]["depth"] == 2

    stream = create(server, instructions="You are terse.", stream=True)
    events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full.output_text
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.output_text == full.output_text
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again

    final = check_responses_order(raw_stream(server, {"input": "Hello, model.", "instructions": "You are terse.", "max_output_tokens": 16}))
    assert final["output"][0]["content"][0]["text"] == full.output_text


def test_previous_response_id_continues_a_stored_conversation(server):
    first = create(server, input="First question about lists.", max_output_tokens=12)
    follow = create(server, input="And a follow-up?", previous_response_id=first.id, max_output_tokens=12)
    # The same conversation sent whole, statelessly (as Codex does):
    whole = create(server, max_output_tokens=12, input=[
        {"role": "user", "content": "First question about lists."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "And a follow-up?"}])
    assert follow.output_text == whole.output_text
    assert follow.usage.input_tokens == whole.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2  # turn 1's prefix reused

    unstored = create(server, input="Not kept.", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError) as e:
        create(server, input="More.", previous_response_id=unstored.id)
    assert e.value.body["code"] == "previous_response_not_found" and e.value.body["param"] == "previous_response_id"


def test_function_calls_and_outputs(scripted):
    r = create(scripted, input=WEATHER_PT, tools=[WEATHER], reasoning={"effort": "high"}, max_output_tokens=400)
    assert r.status == "completed"
    assert [o.type for o in r.output] == ["reasoning", "function_call", "function_call"]
    assert r.output[0].content[0].text == "The user wants the weather."
    calls = r.output[1:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3}),
                                                                 ("get_weather", {"city": "Tokyo"})]
    assert calls[0].call_id != calls[1].call_id

    final = check_responses_order(raw_stream(scripted, {"input": WEATHER_PT, "tools": [WEATHER], "reasoning": {"effort": "high"},
                                                        "max_output_tokens": 400}))
    assert [o["type"] for o in final["output"]] == ["reasoning", "function_call", "function_call"]
    assert json.loads(final["output"][1]["arguments"]) == {"city": "Paris", "days": 3}

    named = create(scripted, input=ROME, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                   reasoning={"effort": "none"}, max_output_tokens=200)
    assert [(o.type, json.loads(o.arguments)) for o in named.output] == [("function_call", {"city": "Rome"})]

    # The outputs go back, continuing the stored response.
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny"} for c in calls]
    r2 = create(scripted, input=outputs, previous_response_id=r.id, tools=[WEATHER], reasoning={"effort": "high"}, max_output_tokens=30)
    assert r2.status in ("completed", "incomplete") and r2.usage.input_tokens_details.cached_tokens > 0


def _error(server, body, status=400):
    r = httpx.post(server.base_url + "/responses", json={"model": "test-model", **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"], err
    return err


@pytest.mark.parametrize("body, needle, param", [
    ({}, "input", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,iVBO"}]}]}, "input_image", "input.0.content"),
    ({"input": [{"type": "computer_call", "call_id": "x"}]}, "computer_call", "input.0.type"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "not in tools", "tool_choice"),
    ({"input": "hi", "tools": [{"type": "custom", "name": "apply_patch"}]}, "not supported", "tools.0.type"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "xml", "text.format"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
])
def test_bad_input_is_a_400_in_openai_shape(server, body, needle, param):
    err = _error(server, body)
    assert err["type"] == "invalid_request_error" and needle in err["message"] and err["param"] == param, err


def test_unknown_previous_response_id_is_404(server):
    err = _error(server, {"input": "hi", "previous_response_id": "resp_nope"}, status=404)
    assert err["code"] == "previous_response_not_found"


def test_disconnect_mid_stream_cancels(server):
    engine = server.service.engine
    body = {"model": "test-model", "input": "Hello", "max_output_tokens": 3000, "stream": True}
    with httpx.stream("POST", server.base_url + "/responses", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if "output_text.delta" in line:
                break
        assert engine.active_count == 1
    assert wait_until(lambda: engine.active_count == 0, 5), "still decoding after the client left"


def test_engine_failure_ends_the_stream_with_response_failed(checkpoint_dir):
    """The engine stops mid-stream: the stream ends with response.failed."""
    with serve(checkpoint_dir("qwen3_5", agreeable=True)) as s:
        body = {"model": "test-model", "input": "Hello", "max_output_tokens": 3000, "stream": True}
        with httpx.stream("POST", s.base_url + "/responses", json=body, timeout=30) as r:
            lines = r.iter_lines()
            for line in lines:
                if "output_text.delta" in line:
                    break
            s.service.engine.stop()
            rest = list(lines)
        failed = [json.loads(line[6:]) for line in rest if line.startswith("data: ") and "response.failed" in line]
        assert len(failed) == 1 and failed[0]["response"]["status"] == "failed" and failed[0]["response"]["error"]["message"]
