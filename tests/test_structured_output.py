"""Structured output through every API, with MTP on: JSON schemas, regexes, choices
and grammars constrain the output, forced tool calls come back as parsed calls whose
arguments validate, reasoning stays free before the constrained part, and bad
constraints are 400s naming the problem."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from support.server import THINK, WEATHER_TOOL

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

# A random-weight model stops a free string only by chance: bounded strings, one call.
SHORT_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 12},
                                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}}

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
MSGS = [{"role": "user", "content": "Describe a person."}]
CALC_TOOL = {"type": "function", "function": {"name": "add", "description": "Add numbers", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99},
                   "note": {"type": "string", "maxLength": 12}}}}}


def oai(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def test_chat_json_schema_and_json_object(server):
    c = oai(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        r = c.chat.completions.create(model="test-model", messages=MSGS, response_format=fmt, max_tokens=60, temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        assert r.usage.model_extra["speculative"]["drafted"] > 0  # MTP ran under the grammar
    r = c.chat.completions.create(model="test-model", messages=MSGS, response_format={"type": "json_object"}, max_tokens=300,
                                  extra_body={"top_k": 3, "seed": 1}, temperature=1.0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a JSON object's prefix
        assert r.choices[0].message.content.startswith("{")
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="test-model", messages=MSGS, response_format=fmt, max_tokens=60, temperature=0, stream=True) if ch.choices)
    greedy = c.chat.completions.create(model="test-model", messages=MSGS, response_format=fmt, max_tokens=60, temperature=0)
    assert streamed == greedy.choices[0].message.content


def test_completions_regex_choice_and_grammar(server):
    c = oai(server)
    r = c.completions.create(model="test-model", prompt="Code:", max_tokens=20, extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].text) == 6, r.choices[0]
    r = c.completions.create(model="test-model", prompt="Pick:", max_tokens=20,
                             extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    assert r.choices[0].text in ("alpha", "beta", "gamma")
    grammar = 'start: "x=" NUM ("," NUM){0,3}\nNUM: /[0-9]{1,3}/'
    r = c.completions.create(model="test-model", prompt="Nums:", max_tokens=30, extra_body={"guided_grammar": grammar})
    text = r.choices[0].text
    assert text.startswith("x=") and all(p.isdigit() for p in text[2:].split(",")), text


def test_responses_text_format(server):
    c = oai(server)
    r = c.responses.create(model="test-model", input="Describe a person.", max_output_tokens=60,
                           text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_through_chat(server, choice):
    r = oai(server).chat.completions.create(model="test-model", messages=[{"role": "user", "content": "Add 2 and 3."}],
                                            tools=[SHORT_WEATHER, CALC_TOOL], tool_choice=choice, max_tokens=300,
                                            parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (SHORT_WEATHER, CALC_TOOL)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(choice, dict):
        assert {call.function.name for call in calls} == {"add"}


def test_forced_tool_calls_through_messages_and_responses(server):
    a = anthropic.Anthropic(base_url=server.root, api_key="none", max_retries=0)
    tool = {"name": "add", "description": "Add numbers", "input_schema": CALC_TOOL["function"]["parameters"]}
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "add", "disable_parallel_tool_use": True}):
        m = a.messages.create(model="test-model", max_tokens=300, tools=[tool], tool_choice=choice,
                              messages=[{"role": "user", "content": "Add 2 and 3."}])
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and uses, m
        for u in uses:
            jsonschema.validate(u.input, tool["input_schema"])
    fn = {"type": "function", "name": "add", "description": "Add numbers", "parameters": CALC_TOOL["function"]["parameters"]}
    r = oai(server).responses.create(model="test-model", input="Add 2 and 3.", tools=[fn], tool_choice="required",
                                     max_output_tokens=300, parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "add" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), fn["parameters"])


def test_reasoning_stays_free_before_the_constraint(scripted):
    """The scripted model reasons, closes </think>, then writes the tool calls: with
    tool_choice required and thinking on, the grammar leaves the reasoning alone."""
    r = oai(scripted).chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "Weather in Paris and Tokyo?"}], tools=[WEATHER_TOOL],
        tool_choice="required", max_tokens=300, temperature=0, extra_body={"chat_template_kwargs": THINK})
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"].strip() == "The user wants the weather."
    assert [json.loads(c.function.arguments) for c in msg.tool_calls] == [{"city": "Paris", "days": 3}, {"city": "Tokyo"}]


@pytest.mark.parametrize("body, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "Invalid type"),
    ({"extra": {"guided_regex": "(unclosed"}}, "regex"),
    ({"extra": {"guided_grammar": "start: undefined_rule"}}, "lark"),
    ({"extra": {"guided_choice": []}}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "extra": {"guided_regex": "a+"}}, "one output constraint"),
    ({"tool_choice": "required", "extra": {"guided_regex": "a+"}}, "one output constraint"),
])
def test_bad_constraints_are_400_naming_the_problem(server, body, words):
    payload = {"model": "test-model", "messages": MSGS, "max_tokens": 5, **body.pop("extra", {}), **body}
    if payload.get("tool_choice"):
        payload["tools"] = [CALC_TOOL]
    r = httpx.post(server.base_url + "/chat/completions", json=payload, timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert server.service.engine.active_count == 0
