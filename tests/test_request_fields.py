"""Every request field of every API either changes what the server does or is refused:
none is ignored silently. The fields are the official clients' (the `openai` and
`anthropic` packages' create parameters) and mtp-serve's own (its request models).

Each field has one verdict here:
- CHANGES: a request with the field set answers differently from the same request without
  it (status, body, or events; ids and timestamps aside);
- REFUSED: a value the server does not implement is a 400 naming the field;
- inert (server/fields.py INERT): by definition no effect on the output, and none seen;
- not applied (server/fields.py NOT_APPLIED): accepted for agents that always send it,
  listed with the reason in docs/api.md; no effect seen.
A field without a verdict fails the test: a new field needs its own.
"""

import json
import typing
from dataclasses import dataclass, field as dc_field
from typing import Any, Callable, Dict, Union

import anthropic.types.message_create_params as anthropic_messages
import httpx
import openai.types.chat.completion_create_params as openai_chat
import openai.types.completion_create_params as openai_completions
import openai.types.responses.response_create_params as openai_responses
import pytest

from mtp_serve.server import fields
from mtp_serve.server.anthropic_api import MessagesRequest
from mtp_serve.server.responses_api import ResponsesRequest
from mtp_serve.server.schemas import ChatCompletionRequest, CompletionRequest
from support.server import SCRIPT, SCRIPT_TEMPLATE, WEATHER_TOOL

pytestmark = pytest.mark.e2e  # live servers (conftest.py: test tiers)

PATHS = {"chat": "/chat/completions", "completions": "/completions", "responses": "/responses", "messages": "/messages"}
MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest, "responses": ResponsesRequest,
          "messages": MessagesRequest}
CLIENT_PARAMS = {"chat": openai_chat.CompletionCreateParamsBase, "completions": openai_completions.CompletionCreateParamsBase,
                 "responses": openai_responses.ResponseCreateParamsBase, "messages": anthropic_messages.MessageCreateParamsBase}

MSGS = [{"role": "user", "content": "Hello, model."}]
GREEDY = {"temperature": 0}
SAMPLED = {"temperature": 1.0, "seed": 3}
BASE = {
    "chat": {"messages": MSGS, "max_tokens": 8, **GREEDY},
    "completions": {"prompt": "The sky", "max_tokens": 8, **GREEDY},
    "responses": {"input": "Hello, model.", "max_output_tokens": 8, **GREEDY},
    "messages": {"messages": MSGS, "max_tokens": 8, **GREEDY},
}
WEATHER_PT, OSLO, HI = (s[0] for s in SCRIPT[:3])
THINK = {"chat_template_kwargs": {"enable_thinking": True}}
RESPONSES_WEATHER = {"type": "function", **WEATHER_TOOL["function"]}
MESSAGES_WEATHER = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
UNIQUE = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}  # relaxed, refused by strict
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": UNIQUE}}
Change = Union[dict, Callable[[Any, dict], dict]]  # or a function of (server, the base's body)


@dataclass
class Case:
    change: Change
    base: dict = dc_field(default_factory=dict)  # on top of BASE[api]
    scripted: bool = False  # on the scripted model (reasoning, tool calls), else the agreeable one


def text_of(body: dict) -> str:
    if "choices" in body:
        c = body["choices"][0]
        return c.get("text") if "text" in c else c["message"]["content"]
    if "content" in body:
        return "".join(b.get("text", "") for b in body["content"])
    return "".join(p["text"] for o in body["output"] if o["type"] == "message" for p in o["content"])


def stop_inside(server, body: dict) -> dict:
    return {"stop": [text_of(body)[2:4]]}


def stop_token_inside(server, body: dict) -> dict:
    return {"stop_token_ids": [server.service.encode(text_of(body))[2]]}


def eos_first(server) -> dict:
    return {"logit_bias": {str(min(server.service.eos_ids)): 100}}


def previous(server, body: dict) -> dict:
    first = httpx.post(server.base_url + "/responses", json={"model": "test-model", **BASE["responses"]}, timeout=60).json()
    return {"previous_response_id": first["id"]}


def thinking_prompt(server, body: dict) -> dict:
    text = server.service.chat.tokenizer.apply_chat_template(HI, add_generation_prompt=True, tokenize=False,
                                                             chat_template=SCRIPT_TEMPLATE, enable_thinking=True)
    return {"prompt": text}


SAMPLING = {
    "temperature": Case({"temperature": 1.5}, {"seed": 3}),
    "top_p": Case({"top_p": 0.05}, SAMPLED),
    "top_k": Case({"top_k": 1}, SAMPLED),
    "min_p": Case({"min_p": 0.9}, SAMPLED),
    "seed": Case({"seed": 4}, SAMPLED),
    "frequency_penalty": Case({"frequency_penalty": 2.0}),
    "presence_penalty": Case({"presence_penalty": 2.0}),
    "repetition_penalty": Case({"repetition_penalty": 3.0}),
    "logit_bias": Case({"logit_bias": {"77": 100}}),
    "ignore_eos": Case({"ignore_eos": True}, {}),  # base: eos_first (set below)
    "mtp_depth": Case({"mtp_depth": 0}),
    "model": Case({"model": "no-such-model"}),
    "stream": Case({"stream": True}),
}
OPENAI_SHARED = {
    **SAMPLING,
    "max_tokens": Case({"max_tokens": 3}),
    "n": Case({"n": 2}),
    "stop": Case(stop_inside),
    "stop_token_ids": Case(stop_token_inside),
    "stream_options": Case({"stream_options": {"include_usage": True}}, {"stream": True}),
    "response_format": Case({"response_format": {"type": "json_object"}}),
    "json_schema_mode": Case({"json_schema_mode": "strict"}, {"response_format": SCHEMA_FORMAT}),
    "structured_outputs": Case({"structured_outputs": {"choice": ["yes", "no"]}}),
    "guided_choice": Case({"guided_choice": ["yes", "no"]}),
    "guided_regex": Case({"guided_regex": "[ab]{6}"}),
    "guided_json": Case({"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}),
    "guided_grammar": Case({"guided_grammar": 'start: "yes" | "no"'}),
}
CHANGES: Dict[str, Dict[str, Case]] = {
    "chat": {
        **OPENAI_SHARED,
        "messages": Case({"messages": [{"role": "user", "content": "Something else entirely."}]}),
        "max_completion_tokens": Case({"max_completion_tokens": 3}),
        "logprobs": Case({"logprobs": True}),
        "top_logprobs": Case({"top_logprobs": 3}, {"logprobs": True}),
        "add_generation_prompt": Case({"add_generation_prompt": False}),
        "continue_final_message": Case({"continue_final_message": True},
                                       {"messages": MSGS + [{"role": "assistant", "content": "Sure"}]}),
        "chat_template_kwargs": Case(THINK, {"messages": HI, "max_tokens": 30}, scripted=True),
        "reasoning_effort": Case({"reasoning_effort": "high"}, {"messages": HI, "max_tokens": 30}, scripted=True),
        "thinking_token_budget": Case({"thinking_token_budget": 2}, {"messages": HI, "max_tokens": 30, **THINK}, scripted=True),
        "tools": Case({"tools": [WEATHER_TOOL]}, {"messages": OSLO, "max_tokens": 120}, scripted=True),
        "tool_choice": Case({"tool_choice": "none"}, {"messages": WEATHER_PT, "max_tokens": 320, "tools": [WEATHER_TOOL], **THINK},
                            scripted=True),
        "parallel_tool_calls": Case({"parallel_tool_calls": False},
                                    {"messages": WEATHER_PT, "max_tokens": 320, "tools": [WEATHER_TOOL], **THINK}, scripted=True),
    },
    "completions": {
        **OPENAI_SHARED,
        "prompt": Case({"prompt": "Something else entirely."}),
        "echo": Case({"echo": True}),
        "logprobs": Case({"logprobs": 2}),
        "thinking_token_budget": Case({"thinking_token_budget": 2}, {"max_tokens": 30}, scripted=True),  # prompt: below
        # prompts where the greedy reply repeats the token the penalty then moves
        "presence_penalty": Case({"presence_penalty": 2.0}, {"prompt": "Hello, model."}),
        "repetition_penalty": Case({"repetition_penalty": 3.0}, {"prompt": "Once upon a time"}),
    },
    "responses": {
        **SAMPLING,
        "input": Case({"input": "Something else entirely."}),
        "instructions": Case({"instructions": "Be brief."}),
        "max_output_tokens": Case({"max_output_tokens": 3}),
        "previous_response_id": Case(previous),
        "text": Case({"text": {"format": {"type": "json_object"}}}),
        "json_schema_mode": Case({"json_schema_mode": "strict"},
                                 {"text": {"format": {"type": "json_schema", "name": "x", "schema": UNIQUE}}}),
        "reasoning": Case({"reasoning": {"effort": "high"}}, {"input": HI, "max_output_tokens": 30}, scripted=True),
        "thinking_token_budget": Case({"thinking_token_budget": 2},
                                      {"input": HI, "max_output_tokens": 30, "reasoning": {"effort": "high"}}, scripted=True),
        "tools": Case({"tools": [RESPONSES_WEATHER]}, {"input": OSLO, "max_output_tokens": 120}, scripted=True),
        "tool_choice": Case({"tool_choice": "none"}, {"input": WEATHER_PT, "max_output_tokens": 320, "tools": [RESPONSES_WEATHER],
                                                      "reasoning": {"effort": "high"}}, scripted=True),
        "parallel_tool_calls": Case({"parallel_tool_calls": False},
                                    {"input": WEATHER_PT, "max_output_tokens": 320, "tools": [RESPONSES_WEATHER],
                                     "reasoning": {"effort": "high"}}, scripted=True),
        "background": Case({"background": True}),
        "top_logprobs": Case({"top_logprobs": 2}),
        "include": Case({"include": ["message.output_text.logprobs"]}),
    },
    "messages": {
        **SAMPLING,
        "messages": Case({"messages": [{"role": "user", "content": "Something else entirely."}]}),
        "max_tokens": Case({"max_tokens": 3}),
        "system": Case({"system": "Be brief."}),
        "stop_sequences": Case(lambda server, body: {"stop_sequences": [text_of(body)[2:4]]}),
        "thinking": Case({"thinking": {"type": "enabled", "budget_tokens": 100}}, {"messages": HI, "max_tokens": 30},
                         scripted=True),
        "thinking_token_budget": Case({"thinking_token_budget": 2}, {"messages": HI, "max_tokens": 30,
                                                                     "thinking": {"type": "adaptive"}}, scripted=True),
        "tools": Case({"tools": [MESSAGES_WEATHER]}, {"messages": OSLO, "max_tokens": 120}, scripted=True),
        "tool_choice": Case({"tool_choice": {"type": "none"}},
                            {"messages": WEATHER_PT, "max_tokens": 320, "tools": [MESSAGES_WEATHER],
                             "thinking": {"type": "enabled", "budget_tokens": 300}}, scripted=True),
        "json_schema_mode": Case({"json_schema_mode": "strict"},
                                 {"messages": OSLO, "max_tokens": 4, "tool_choice": {"type": "any"},
                                  "tools": [{"name": "pick", "input_schema": {"type": "object", "properties": {"xs": UNIQUE}}}]},
                                 scripted=True),
    },
}
for _api in CHANGES:
    CHANGES[_api]["ignore_eos"] = Case({"ignore_eos": True}, {"logit_bias": "eos"})
    # Copies from the context fire once the agreeable model's reply repeats itself: usage counts them.
    CHANGES[_api]["speculative"] = Case({"speculative": {"copy": False}},
                                        {"max_output_tokens" if _api == "responses" else "max_tokens": 48, "ignore_eos": True})

# field -> a value refused with a 400 naming it
REFUSED: Dict[str, Dict[str, Any]] = {
    "chat": {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"], "functions": [{"name": "f"}],
             "function_call": "auto", "web_search_options": {}, "moderation": {}, "verbosity": "low"},
    "completions": {"best_of": 2, "suffix": "and then"},
    "responses": {"conversation": "conv_1", "prompt": {"id": "pmpt_1"}, "max_tool_calls": 3,
                  "moderation": {}, "truncation": "auto", "context_management": [{"type": "compaction"}]},
    "messages": {"container": "c1", "mcp_servers": [{"type": "url", "url": "https://example.com", "name": "x"}],
                 "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
}
# inert and not-applied fields: a value a client sends; the answer must not change
NEUTRAL_VALUES = {
    "user": "user-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "safety_identifier": "s-1",
    "prompt_cache_key": "k-1", "prompt_cache_options": {}, "prompt_cache_retention": "24h",
    "prediction": {"type": "content", "content": "Hello"}, "stream_options": {"include_obfuscation": False},
    "background_options": {}, "access_programs": [], "image": {}, "cache_control": {"type": "ephemeral"},
    "inference_geo": "us", "speed": "fast", "diagnostics": {"previous_message_id": None}, "user_profile_id": "u-1",
    "workspace_id": "w-1", "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
    "output_config": {"effort": "high"},
}
# Whole fields not applied; "field.part" entries are parts of a field refused otherwise (output_config.effort).
NOT_APPLIED = {api: {k for k in v if "." not in k} for api, v in fields.NOT_APPLIED.items()}
NOT_APPLIED_PARTS = {api: {k.split(".")[0] for k in v if "." in k} for api, v in fields.NOT_APPLIED.items()}


def accepted_fields(api: str) -> set:
    client = set(typing.get_type_hints(CLIENT_PARAMS[api])) | {"stream"}
    return client | set(MODELS[api].model_fields)


def verdicts(api: str) -> Dict[str, str]:
    out = {}
    for name in accepted_fields(api):
        kinds = [kind for kind, names in (("changes", CHANGES[api]), ("refused", REFUSED[api]),
                                          ("inert", fields.INERT.get(api, ())), ("not applied", NOT_APPLIED.get(api, ())))
                 if name in names]
        out[name] = "/".join(kinds) or "none"
    return out


@pytest.mark.parametrize("api", list(PATHS))
def test_every_field_has_one_verdict(api):
    missing = {k: v for k, v in verdicts(api).items() if "/" in v or v == "none"}
    assert not missing, f"{api}: fields with no verdict or several: {missing}"


def normalized(value):
    """A body or an event without what differs between two identical requests (ids, times,
    prompt-cache hits, draft counts) or merely echoes a field back."""
    if isinstance(value, dict):
        if "tokens_per_pass" in value:  # usage's speculative record: how many tokens each source drafts follows the
            # machine's measured round times, so only which sources drafted is the same twice
            return {k: bool(v) for k, v in value.items() if k.endswith("drafted")}
        if "cache_read_input_tokens" in value:  # Anthropic's input_tokens leave out the cached ones
            value = {**value, "input_tokens": value["input_tokens"] + value["cache_read_input_tokens"]
                     + value.get("cache_creation_input_tokens", 0)}
        return {k: normalized(v) for k, v in value.items()
                if k not in ("id", "created", "created_at", "item_id", "response_id", "call_id", "previous_response_id",
                             "metadata", "user", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                             "cached_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    if isinstance(value, str) and value.startswith(("call_", "toolu_", "fc_", "msg_", "rs_")):
        return value[:3]
    return value


def answer(server, api: str, body: dict) -> tuple:
    r = httpx.post(server.base_url + PATHS[api], json={"model": "test-model", **body}, timeout=120)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        return r.status_code, "stream", normalized(events)
    return r.status_code, normalized(r.json())


def base_body(server, api: str, case: Case) -> dict:
    body = {**BASE[api], **case.base}
    if body.get("logit_bias") == "eos":
        body.update(eos_first(server))
    if api == "completions" and case.scripted:
        body.update(thinking_prompt(server, body))
    return body


def live(request, case: Case):
    return request.getfixturevalue("scripted" if case.scripted else "server")


CHANGE_CASES = [(api, name) for api in CHANGES for name in CHANGES[api]]


_answers: Dict[tuple, tuple] = {}


def base_answer(server, api: str, body: dict) -> tuple:
    """The base request's answer, asked twice (the comparison's control: the same request
    answers the same), once per server and body."""
    key = (server.port, api, json.dumps(body, sort_keys=True))
    if key not in _answers:
        first = answer(server, api, body)
        assert first[0] == 200, first
        assert answer(server, api, body) == first, "the same request twice must answer the same"
        _answers[key] = first
    return _answers[key]


@pytest.mark.parametrize("api, name", CHANGE_CASES, ids=[f"{a}-{n}" for a, n in CHANGE_CASES])
def test_field_changes_the_answer(request, api, name):
    case = CHANGES[api][name]
    server = live(request, case)
    body = base_body(server, api, case)
    before = base_answer(server, api, body)
    change = case.change(server, before[1]) if callable(case.change) else case.change
    assert answer(server, api, {**body, **change}) != before, f"{api}: {name} changed nothing"


REFUSED_CASES = [(api, name) for api in REFUSED for name in REFUSED[api]]


@pytest.mark.parametrize("api, name", REFUSED_CASES, ids=[f"{a}-{n}" for a, n in REFUSED_CASES])
def test_field_is_refused(server, api, name):
    r = httpx.post(server.base_url + PATHS[api], json={"model": "test-model", **BASE[api], name: REFUSED[api][name]}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if api == "messages":
        assert err["type"] == "invalid_request_error" and name in err["message"]
    else:
        assert err["param"] == name


NEUTRAL_CASES = [(api, name) for api in PATHS
                 for name in sorted(set(fields.INERT.get(api, ())) | NOT_APPLIED.get(api, set()) | NOT_APPLIED_PARTS.get(api, set()))]


@pytest.mark.parametrize("api, name", NEUTRAL_CASES, ids=[f"{a}-{n}" for a, n in NEUTRAL_CASES])
def test_inert_field_changes_nothing(server, api, name):
    before = base_answer(server, api, BASE[api])
    assert answer(server, api, {**BASE[api], name: NEUTRAL_VALUES[name]}) == before
