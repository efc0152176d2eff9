"""Tool calls stream as the model writes them (name first, then argument pieces), through the
official clients' own stream helpers; a call cut off by max_tokens is still a call. The scripted
model (tests/support/server.py) writes two XML calls, or one Hermes call."""

import json

import anthropic
import openai
import pytest

from support.server import SCRIPT, THINK, NO_THINK, WEATHER_TOOL, XML_CALLS, serve

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

WEATHER_PT, OSLO = SCRIPT[0][0], SCRIPT[1][0]
# The output up to the middle of the first call's "Paris": max_tokens cuts it there.
CUT = XML_CALLS[: XML_CALLS.index("Paris") + 3]
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER_TOOL["function"]["parameters"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def xml_server(scripted_checkpoint):
    s = serve(scripted_checkpoint, mtp_depth=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cut(scripted_checkpoint):
    """max_tokens that ends the output at CUT."""
    from transformers import PreTrainedTokenizerFast

    return len(PreTrainedTokenizerFast.from_pretrained(str(scripted_checkpoint)).encode(CUT, add_special_tokens=False))


def openai_client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def chat_stream(server, messages, thinking, **kw):
    return openai_client(server).chat.completions.stream(
        model="test-model", messages=messages, tools=[WEATHER_TOOL], temperature=0,
        extra_body={"chat_template_kwargs": thinking}, **kw)


def test_chat_stream_helper_assembles_tool_calls_streamed_piece_by_piece(xml_server):
    deltas, names_first = {}, []
    with chat_stream(xml_server, WEATHER_PT, THINK, max_tokens=400) as stream:
        for ev in stream:
            if ev.type == "tool_calls.function.arguments.delta":
                names_first.append(ev.name == "get_weather")
                deltas.setdefault(ev.index, []).append(ev.arguments_delta)
            assert ev.type != "content.delta" or "<" not in ev.delta
        final = stream.get_final_completion()
    assert all(names_first)
    assert all(len(pieces) >= 3 for pieces in deltas.values())  # in pieces as written, not whole at the end
    assert json.loads("".join(deltas[0])) == {"city": "Paris", "days": 3}
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and not msg.content
    assert [json.loads(c.function.arguments) for c in msg.tool_calls] == [{"city": "Paris", "days": 3}, {"city": "Tokyo"}]


def test_chat_tool_call_cut_off_by_max_tokens_is_a_call(xml_server, cut):
    # Streamed: the SDK's helper assembles the call, then refuses a "length" finish (its rule).
    with pytest.raises(openai.LengthFinishReasonError) as e:
        with chat_stream(xml_server, WEATHER_PT, THINK, max_tokens=cut) as stream:
            stream.get_final_completion()
    for choice in (e.value.completion.choices[0],
                   openai_client(xml_server).chat.completions.create(
                       model="test-model", messages=WEATHER_PT, tools=[WEATHER_TOOL], temperature=0, max_tokens=cut,
                       extra_body={"chat_template_kwargs": THINK}).choices[0]):
        assert choice.finish_reason == "length" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Par"}


def test_messages_stream_sends_input_json_deltas(xml_server, cut):
    client = anthropic.Anthropic(base_url=xml_server.root, api_key="none", max_retries=0, timeout=60)
    kw = dict(model="test-model", messages=WEATHER_PT, tools=[ANTHROPIC_TOOL], extra_body={"temperature": 0},
              thinking={"type": "enabled", "budget_tokens": 1024})
    with client.messages.stream(max_tokens=400, **kw) as stream:
        pieces = [ev.partial_json for ev in stream if ev.type == "input_json"]
        final = stream.get_final_message()
    assert len(pieces) >= 6 and final.stop_reason == "tool_use"
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Paris", "days": 3}, {"city": "Tokyo"}]
    with client.messages.stream(max_tokens=cut, **kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    assert [(b.type, b.input) for b in final.content if b.type != "thinking"] == [("tool_use", {"city": "Par"})]


def test_responses_stream_sends_function_call_argument_deltas(xml_server, cut):
    client = openai_client(xml_server)
    kw = dict(model="test-model", input=WEATHER_PT, tools=[RESPONSES_TOOL], temperature=0, reasoning={"effort": "medium"})
    with client.responses.stream(max_output_tokens=400, **kw) as stream:
        pieces = [ev.delta for ev in stream if ev.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert len(pieces) >= 6
    assert [json.loads(i.arguments) for i in final.output if i.type == "function_call"] == [{"city": "Paris", "days": 3}, {"city": "Tokyo"}]
    with client.responses.stream(max_output_tokens=cut, **kw) as stream:  # ends in response.incomplete
        (final,) = [ev.response for ev in stream if ev.type == "response.incomplete"]
    assert final.status == "incomplete"
    assert [(i.type, json.loads(i.arguments)) for i in final.output if i.type != "reasoning"] == [("function_call", {"city": "Par"})]


def test_hermes_tool_call_streams_name_then_arguments(scripted_checkpoint):
    s = serve(scripted_checkpoint, tool_call_parser="hermes")
    try:
        with chat_stream(s, OSLO, NO_THINK, max_tokens=400) as stream:
            pieces = [ev.arguments_delta for ev in stream if ev.type == "tool_calls.function.arguments.delta"]
            final = stream.get_final_completion()
    finally:
        s.stop()
    assert len(pieces) >= 3 and json.loads("".join(pieces)) == {"city": "Oslo", "days": 2}
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and final.choices[0].finish_reason == "tool_calls"
