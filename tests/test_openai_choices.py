"""OpenAI's n, batched completion prompts, logit_bias and the smaller reference behaviours
(completions top_logprobs, reasoning fields and tokens, request checks, empty replies),
through the official `openai` client against a live server with MTP on."""

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e  # a live server (conftest.py: test tiers)

MSGS = [{"role": "user", "content": "Hello, model."}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


def chat(server, **kw):
    return client(server).chat.completions.create(model="test-model", messages=MSGS, **{"max_tokens": 16, **kw})


def complete(server, **kw):
    return client(server).completions.create(model="test-model", **{"max_tokens": 12, **kw})


def post(server, path, body):
    return httpx.post(server.base_url + path, json={"model": "test-model", **body}, timeout=120)


# ---------------------------------------------------------------- n


def test_chat_n_greedy_choices_equal_the_single_request(server):
    one = chat(server, temperature=0)
    r = chat(server, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [one.choices[0].message.content] * 3
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert r.usage.model_extra["speculative"]["drafted"] > 0  # MTP on (depth 2) in every row


def test_chat_n_seeded_choices_differ_and_reproduce(server):
    a = chat(server, temperature=1.0, seed=7, n=4, max_tokens=24)
    b = chat(server, temperature=1.0, seed=7, n=4, max_tokens=24)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1, "each choice draws its own sample"
    # choice k draws with seed + k: choice 1 is the single request with seed 8
    assert chat(server, temperature=1.0, seed=8, max_tokens=24).choices[0].message.content == texts[1]


def test_chat_n_streamed_choices_match_the_non_streamed(server):
    want = [c.message.content for c in chat(server, temperature=1.0, seed=3, n=3).choices]
    stream = chat(server, temperature=1.0, seed=3, n=3, stream=True, stream_options={"include_usage": True})
    texts, finished, usage = ["", "", ""], set(), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert texts == want and finished == {0, 1, 2}
    assert usage is not None and usage.completion_tokens >= 3


def test_completions_n(server):
    r = complete(server, prompt="The sky", n=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text
    assert r.choices[0].text == complete(server, prompt="The sky", temperature=0).choices[0].text


def test_n_out_of_range_is_400(server):
    for n in (0, 129):
        with pytest.raises(openai.BadRequestError) as e:
            chat(server, n=n)
        assert e.value.body["param"] == "n"


# ---------------------------------------------------------------- batched prompts


def test_completions_batched_prompts_one_choice_each_in_order(server):
    prompts = ["The sky", "Once upon a time", "Hello"]
    singles = [complete(server, prompt=p, temperature=0).choices[0].text for p in prompts]
    r = complete(server, prompt=prompts, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == singles
    assert r.usage.prompt_tokens == sum(complete(server, prompt=p, temperature=0).usage.prompt_tokens for p in prompts)


def test_completions_batched_token_id_prompts_with_n(server):
    ids = [[5, 17, 200, 31], [44, 9, 120]]
    singles = [complete(server, prompt=p, temperature=0).choices[0].text for p in ids]
    r = complete(server, prompt=ids, n=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt * n + k
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]


def test_completions_batched_prompts_streamed(server):
    prompts = ["The sky", "Hello"]
    want = [c.text for c in complete(server, prompt=prompts, temperature=0).choices]
    texts = ["", ""]
    for chunk in complete(server, prompt=prompts, temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == want


def test_completions_empty_prompt_list_is_400(server):
    r = post(server, "/completions", {"prompt": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# ---------------------------------------------------------------- logit_bias


def test_logit_bias_forces_and_bans_tokens(server):
    svc = server.service
    word = svc.token_text(77)
    forced = chat(server, temperature=0, max_tokens=6, logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].message.content == word * 6
    plain = complete(server, prompt="The sky", temperature=0)
    first = svc.encode(plain.choices[0].text)[0]
    banned = complete(server, prompt="The sky", temperature=0, logit_bias={str(first): -100})
    assert svc.encode(banned.choices[0].text)[:1] != [first]


@pytest.mark.parametrize("bias, param", [
    ({"abc": 1}, "logit_bias"),
    ({"-3": 1}, "logit_bias"),
    ({"5": "x"}, "logit_bias.5"),
    ({"5": 100.5}, "logit_bias.5"),
    ({"999999": 1}, "logit_bias"),
])
@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_bad_logit_bias_is_400(server, bias, param, path):
    body = {"messages": MSGS} if path == "/chat/completions" else {"prompt": "hi"}
    r = post(server, path, {**body, "logit_bias": bias, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---------------------------------------------------------------- completions logprobs


def test_completions_top_logprobs_include_the_chosen_token(server):
    r = complete(server, prompt="The sky", temperature=1.0, seed=1, logprobs=2)
    lp = r.choices[0].logprobs
    for token, tops in zip(lp.tokens, lp.top_logprobs):
        assert token in tops and 2 <= len(tops) <= 3
    alone = complete(server, prompt="The sky", temperature=1.0, seed=1, logprobs=0).choices[0].logprobs
    assert [list(t) for t in alone.top_logprobs] == [[t] for t in alone.tokens]
    assert alone.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)


# ---------------------------------------------------------------- request checks, empty replies


def test_stream_options_without_stream_is_400(server):
    for path, body in (("/chat/completions", {"messages": MSGS}), ("/completions", {"prompt": "hi"})):
        r = post(server, path, {**body, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


def test_continue_final_message_with_add_generation_prompt_is_400(server):
    msgs = MSGS + [{"role": "assistant", "content": "Sure"}]
    r = post(server, "/chat/completions", {"messages": msgs, "continue_final_message": True, "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_generation_prompt"


def test_add_generation_prompt_false_leaves_the_turn_unopened(server):
    """Without the generation prompt the model goes on from the user's message: a different prompt."""
    on = post(server, "/chat/completions", {"messages": MSGS, "max_tokens": 1, "add_generation_prompt": True}).json()
    off = post(server, "/chat/completions", {"messages": MSGS, "max_tokens": 1, "add_generation_prompt": False}).json()
    assert off["usage"]["prompt_tokens"] < on["usage"]["prompt_tokens"]


def test_a_reply_that_stops_on_its_first_token_has_empty_content(server):
    eos = min(server.service.eos_ids)
    r = chat(server, temperature=0, logit_bias={str(eos): 100})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 1
    assert r.choices[0].message.content == ""


def test_reasoning_under_both_names_and_counted(scripted):
    c = openai.OpenAI(base_url=scripted.base_url, api_key="none", max_retries=0, timeout=60)
    kw = dict(model="test-model", messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=200,
              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == "Greet them briefly."
    n_reasoning = len(scripted.service.encode("Greet them briefly.\n"))
    details = r.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens <= r.usage.completion_tokens and abs(details.reasoning_tokens - n_reasoning) <= 2
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == "Greet them briefly."
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Greet them briefly."
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


def test_reasoning_sent_back_under_either_name_reaches_the_template():
    from mtp_serve.server.chat import template_messages
    from mtp_serve.server.schemas import ChatMessage

    sent = [ChatMessage(role="assistant", content="Hi", reasoning="Greet."),
            ChatMessage(role="assistant", content="Hi", reasoning_content="Greet.")]
    assert [m["reasoning_content"] for m in template_messages(sent)] == ["Greet.", "Greet."]


def test_n_choices_each_follow_the_output_constraint(server):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    r = chat(server, temperature=1.0, seed=5, n=3, max_tokens=40,
             response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    for c in r.choices:
        assert c.finish_reason == "stop" and set(json.loads(c.message.content)) == {"a"}
        assert c.model_extra["structured_output"]["valid"] is True
