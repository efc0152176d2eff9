"""Reasoning and tool calls through the server, from a real model made to emit them
(the scripted model in tests/support/server.py: trained to give fixed replies)."""

import json

import openai
import pytest

from support.server import (COMMITTED, MALFORMED, NO_THINK, SCRIPT, THINK, WEATHER_TOOL, committed_fingerprint,
                            script_sequences, scripted_fingerprint, serve)

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

WEATHER_PT, OSLO, HI, BROKEN, ROME = (s[0] for s in SCRIPT)


def test_the_committed_scripted_model_is_current():
    """tests/data/scripted_model was trained on today's SCRIPT by today's training code; after a
    change to either, `python tests/support/server.py` retrains it (test runs would train their own)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(COMMITTED))
    assert committed_fingerprint() == scripted_fingerprint(script_sequences(tokenizer)), \
        "run `python tests/support/server.py` to retrain tests/data/scripted_model"


@pytest.fixture(scope="module")
def xml_server(scripted_checkpoint):
    s = serve(scripted_checkpoint, mtp_depth=2)  # tool parser "auto": the Qwen3.5 card's qwen3_coder
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hermes_server(scripted_checkpoint):
    s = serve(scripted_checkpoint, tool_call_parser="hermes")
    yield s
    s.stop()


def chat(server, messages, thinking, tools=(WEATHER_TOOL,), **kw):
    c = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)
    extra = {"chat_template_kwargs": thinking}
    if tools:
        kw["tools"] = list(tools)
    return c.chat.completions.create(model="test-model", messages=messages, temperature=0, max_tokens=400, extra_body=extra, **kw)


def test_tool_calls_non_streamed(xml_server):
    r = chat(xml_server, WEATHER_PT, THINK)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.model_extra["reasoning_content"] == "The user wants the weather."
    assert not msg.content
    calls = msg.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}  # "3" typed by the schema
    assert json.loads(calls[1].function.arguments) == {"city": "Tokyo"}
    assert calls[0].id != calls[1].id and all(c.id.startswith("call_") and c.type == "function" for c in calls)


def test_tool_calls_streamed(xml_server):
    chunks = list(chat(xml_server, WEATHER_PT, THINK, stream=True, stream_options={"include_usage": True}))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert reasoning == "The user wants the weather."
    calls = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            if tc.index not in calls:
                assert tc.id and tc.function.name == "get_weather"  # id and name come first
                calls[tc.index] = {"id": tc.id, "args": tc.function.arguments or ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["args"] += tc.function.arguments
    assert [json.loads(calls[i]["args"]) for i in sorted(calls)] == [{"city": "Paris", "days": 3}, {"city": "Tokyo"}]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens > 0


def test_reasoning_split(xml_server):
    r = chat(xml_server, HI, THINK, tools=())
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "Greet them briefly."
    assert msg.content == "Hello there!" and r.choices[0].finish_reason == "stop"
    chunks = list(chat(xml_server, HI, THINK, tools=(), stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Greet them briefly."
    assert "".join(d.content or "" for d in deltas) == "Hello there!"
    # Reasoning streams before content.
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not d.model_extra.get("reasoning_content") for d in deltas[first_content:])


def test_unclosed_tool_call_is_a_call(xml_server):
    """A call the model never closes is still a call (its stray text ignored), never markup as content."""
    for stream in (False, True):
        if stream:
            chunks = list(chat(xml_server, BROKEN, NO_THINK, stream=True))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            names = [tc.function.name for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            r = chat(xml_server, BROKEN, NO_THINK)
            content, finish = r.choices[0].message.content, [r.choices[0].finish_reason]
            names = [c.function.name for c in r.choices[0].message.tool_calls]
        assert not content and names[0] == "get_weather" and finish == ["tool_calls"]


def test_hermes_tool_call(hermes_server):
    r = chat(hermes_server, OSLO, NO_THINK)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}
    assert r.choices[0].finish_reason == "tool_calls"


def test_named_tool_choice_forces_the_call(xml_server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(xml_server, ROME, NO_THINK, tool_choice=named)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    chunks = list(chat(xml_server, ROME, NO_THINK, tool_choice=named, stream=True))
    first = next(tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or []))
    assert first.function.name == "get_weather"
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        chat(xml_server, ROME, NO_THINK, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_tool_choice_none_returns_text(xml_server):
    r = chat(xml_server, WEATHER_PT, THINK, tool_choice="none")
    msg = r.choices[0].message
    assert not msg.tool_calls and msg.content.startswith("<tool_call>\n<function=get_weather>")
    assert msg.model_extra["reasoning_content"] == "The user wants the weather."
    assert r.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_keeps_the_first(xml_server):
    r = chat(xml_server, WEATHER_PT, THINK, parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == ["Paris"]
