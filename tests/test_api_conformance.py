"""What the real APIs refuse is refused here too, with a 400 in the API's own shape, and
an assistant prefill continues the reply. Real HTTP against the scripted model."""

import httpx
import pytest
from transformers import AutoTokenizer

from support.server import SCRIPT, SCRIPT_TEMPLATE, WEATHER_TOOL, serve

pytestmark = pytest.mark.e2e

HI = SCRIPT[2][0]
WEATHER_FN = {"type": "function", **WEATHER_TOOL["function"]}
ANTHROPIC_WEATHER = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.root + path, json={"model": "test-model", **body}, timeout=60)


def refused(server, path: str, body: dict, needle: str, param: str = None) -> dict:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    b = r.json()
    if path.startswith("/v1/messages"):
        assert b["type"] == "error" and b["error"]["type"] == "invalid_request_error", b
        assert needle in b["error"]["message"], b
    else:
        assert needle in b["error"]["message"] and b["error"]["type"] == "invalid_request_error", b
        if param is not None:
            assert b["error"]["param"] == param, b
    return b


# ---------------------------------------------------------------- Responses input, by type


@pytest.mark.parametrize("body, needle, param", [
    ({"input": "hi", "text": {"format": "json_object"}}, "text.format", "text.format"),
    ({"input": [{"type": "reasoning", "content": 5}]}, "input.0.content", "input.0.content"),
    ({"input": [{"type": "reasoning", "summary": 5}]}, "input.0.summary", "input.0.summary"),
    ({"input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": [5]}]}, "tools.0.tools.0", "tools.0.tools.0"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": 5}], "tool_choice": "required"},
     "tools.0.parameters", "tools.0.parameters"),
    ({"input": [{"role": "user", "content": 5}]}, "content", "input.0.content"),
    ({"input": [{"role": "user", "content": {"type": "input_text", "text": "hi"}}]}, "content", "input.0.content"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nowhere", "output": "42"}]}, "no tool call found",
     "input.0.call_id"),
    ({"input": "hi", "tools": [WEATHER_FN, WEATHER_FN]}, "unique", "tools"),
])
def test_responses_input_is_checked_by_type(scripted, body, needle, param):
    refused(scripted, "/v1/responses", body, needle, param)


def test_function_call_output_answers_a_call_of_the_conversation(scripted):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    out = {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}
    r = post(scripted, "/v1/responses", {"input": [{"role": "user", "content": "Weather in Oslo?"}, call, out],
                                         "tools": [WEATHER_FN], "max_output_tokens": 4})
    assert r.status_code == 200, r.text
    first = post(scripted, "/v1/responses", {"input": [{"role": "user", "content": "Weather in Oslo?"}, call],
                                             "tools": [WEATHER_FN], "max_output_tokens": 4})
    assert first.status_code == 200, first.text
    # The output of a call made in a stored response, by previous_response_id:
    later = post(scripted, "/v1/responses", {"input": [out], "previous_response_id": first.json()["id"],
                                             "tools": [WEATHER_FN], "max_output_tokens": 4})
    assert later.status_code == 200, later.text


# ---------------------------------------------------------------- Messages


@pytest.mark.parametrize("body, needle", [
    ({"messages": [{"role": "user", "content": ""}]}, "non-empty content"),
    ({"messages": [{"role": "user", "content": []}]}, "non-empty content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "must be non-empty"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": {"a": 1}}]}]},
     "content must be a string or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}]},
     "content must be a string or a list"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [ANTHROPIC_WEATHER, ANTHROPIC_WEATHER]}, "unique"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is "}]},
     "trailing whitespace"),
])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_messages_refuses_what_anthropic_refuses(scripted, body, needle, path):
    refused(scripted, path, {"max_tokens": 8, **body}, needle)


def test_chat_refuses_duplicate_tool_names(scripted):
    refused(scripted, "/v1/chat/completions", {"messages": HI, "tools": [WEATHER_TOOL, WEATHER_TOOL]}, "unique", "tools")


def rendered(checkpoint, messages, **kw) -> str:
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    return tok, tok.apply_chat_template(messages, tokenize=False, chat_template=SCRIPT_TEMPLATE, **kw)


def test_assistant_prefill_continues_the_reply(scripted, scripted_checkpoint):
    """A final assistant message is the reply's start: the prompt ends with its text (no end
    of turn, no new turn), on Messages (count_tokens and generation) and on chat with
    continue_final_message; the output is what a raw completion of that prompt gives."""
    messages = HI + [{"role": "assistant", "content": "Hello"}]
    tok, text = rendered(scripted_checkpoint, messages, continue_final_message=True, enable_thinking=False)
    assert text.endswith("Hello")
    count = post(scripted, "/v1/messages/count_tokens", {"messages": messages}).json()["input_tokens"]
    assert count == len(tok.encode(text))
    raw = post(scripted, "/v1/completions", {"prompt": text, "max_tokens": 6, "temperature": 0}).json()
    m = post(scripted, "/v1/messages", {"messages": messages, "max_tokens": 6, "temperature": 0}).json()
    assert m["usage"]["input_tokens"] + m["usage"]["cache_read_input_tokens"] == count
    assert "".join(b.get("text", "") for b in m["content"]) == raw["choices"][0]["text"]
    chat = post(scripted, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0,
                                                   "continue_final_message": True,
                                                   "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert chat["usage"]["prompt_tokens"] == count
    assert chat["choices"][0]["message"]["content"] == raw["choices"][0]["text"]


# ---------------------------------------------------------------- chat's budget parameter


def test_chat_names_the_budget_field_the_client_sent(scripted_checkpoint):
    with serve(scripted_checkpoint, max_tokens_over_context="refuse") as s:
        for field in ("max_tokens", "max_completion_tokens"):
            refused(s, "/v1/chat/completions", {"messages": HI, field: 1 << 20}, "maximum context length", field)
